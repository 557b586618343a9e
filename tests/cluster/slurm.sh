#!/usr/bin/env bash
# SLURM for real: a one-node Slurm 22.05 cluster on this machine (controller and compute node, 2
# CPUs, no cgroups), then examples/slurm/*.sbatch submitted with `sbatch --wait` on a short CartPole
# run, exactly as a user would (sizes only through the environment variables and sbatch options the
# script documents).
#
#   bash tests/cluster/slurm.sh              # LAUNCHER=mpiexec (the script's default) and srun
#   CLUSTER_SLURM_LAUNCHERS=mpiexec bash tests/cluster/slurm.sh
#
# Installs Debian's slurm-wlm and munge when missing (apt-get). Its own munged, slurmctld and slurmd
# run from a temporary directory with their own key, socket, ports and state, so a Slurm or munge
# already on the machine is neither used nor disturbed; all three are stopped on any exit (trap).
# Needs root; prints SKIPPED and exits 0 where Slurm cannot be installed or started.
set -euo pipefail
LOG_TAG=slurm
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

LAUNCHERS=(${CLUSTER_SLURM_LAUNCHERS:-mpiexec srun})

[ "$(id -u)" = 0 ] || skip "running slurmctld, slurmd and munged for the test needs root"
need_mpi

shopt -s nullglob
SBATCH_SCRIPTS=("$ROOT"/examples/slurm/*.sbatch)
shopt -u nullglob
[ ${#SBATCH_SCRIPTS[@]} -gt 0 ] || fail "no examples/slurm/*.sbatch to test"

# -- install ------------------------------------------------------------------------------------------

have_slurm() { command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null

if ! have_slurm; then
    command -v apt-get >/dev/null || skip "Slurm is not installed and there is no apt-get to install it"
    log "installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    if ! timeout 600 apt-get install -y -q --no-install-recommends slurm-wlm munge >/tmp/clusterenv-apt.log 2>&1; then
        timeout 300 apt-get update -q >>/tmp/clusterenv-apt.log 2>&1 || true
        timeout 600 apt-get install -y -q --no-install-recommends slurm-wlm munge >>/tmp/clusterenv-apt.log 2>&1 \
            || skip "apt-get could not install slurm-wlm and munge (log: /tmp/clusterenv-apt.log)"
    fi
    have_slurm || skip "slurm-wlm installed but its programs are missing"
    rm -f /tmp/clusterenv-apt.log
fi
log "$(slurmctld -V), $(munged -V 2>&1 | head -1)"

# -- configure and start ------------------------------------------------------------------------------

WORK="$(mktemp -d /tmp/clusterenv-slurm.XXXXXX)"
chmod 755 "$WORK"
NODE="$(hostname -s)"
MUNGE_PID="" CTLD_PID="" SLURMD_PID="" JOB_ID="" SUBMIT_PID=""
export SLURM_CONF="$WORK/slurm.conf"

diagnostics() {
    local file
    for file in "$WORK"/*.console "$WORK/slurmctld.log" "$WORK/slurmd.log" "$WORK/munged.log"; do
        [ -f "$file" ] || continue
        echo "---- last lines of $(basename "$file")" >&2
        tail -n 40 "$file" | sed 's/^/    | /' >&2
    done
}

stop() {  # stop <pid> <name>: TERM, then KILL after 10 s
    local pid=$1 name=$2 tries=0
    [ -n "$pid" ] || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    while kill -0 "$pid" 2>/dev/null && [ $tries -lt 100 ]; do
        sleep 0.1
        tries=$((tries + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name did not stop within 10 s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null
    fi
    wait "$pid" 2>/dev/null || true
}

# Every process of a submitted job carries this in its environment (sbatch --export=ALL), so that
# cleanup can find what a job left behind, and nothing else.
TOKEN="clusterenv-slurm-test-$$-$RANDOM"

job_ended() { [ -z "$(timeout 5 squeue -h -j "$1" -t PD,CF,R,CG,S,RQ,RS 2>/dev/null)" ]; }

job_processes() {
    local proc
    for proc in /proc/[0-9]*; do
        { tr '\0' '\n' <"$proc/environ"; } 2>/dev/null | grep -qx "CLUSTERENV_SLURM_TEST=$TOKEN" && echo "${proc#/proc/}"
    done
    return 0
}

cleanup() {
    local status=$?
    set +e
    trap - EXIT INT TERM
    [ -n "$SUBMIT_PID" ] && kill -TERM "$SUBMIT_PID" 2>/dev/null
    [ -n "$JOB_ID" ] || JOB_ID="$(head -n 1 "$WORK/sbatch.id" 2>/dev/null | cut -d';' -f1)"
    if [ -n "$JOB_ID" ] && [ -n "$CTLD_PID" ] && kill -0 "$CTLD_PID" 2>/dev/null; then
        # Let Slurm end the job's processes (proctrack) before the daemons go.
        timeout 10 scancel "$JOB_ID" 2>/dev/null
        wait_for 30 "job $JOB_ID to end" job_ended "$JOB_ID"
    fi
    [ $status = 0 ] || diagnostics
    stop "$SLURMD_PID" slurmd
    # slurmstepd of a job that outlived slurmd are ours too (they run with our slurm.conf).
    local pid
    for pid in $(pgrep -f "^slurmstepd: \[" 2>/dev/null); do
        if { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qx "SLURM_CONF=$SLURM_CONF"; then
            kill -KILL "$pid" 2>/dev/null
        fi
    done
    stop "$CTLD_PID" slurmctld
    stop "$MUNGE_PID" munged
    local left
    left="$(job_processes)"
    if [ -n "$left" ]; then
        log "killing what the job left running: $(echo $left)"
        kill -KILL $left 2>/dev/null
    fi
    [ -n "$SUBMIT_PID" ] && wait "$SUBMIT_PID" 2>/dev/null
    rm -rf "$WORK"
    log "cleanup: slurmd, slurmctld, munged and the job's processes stopped"
    exit $status
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

mkdir -p "$WORK/munge" "$WORK/state" "$WORK/spool" "$WORK/runs"
chmod 755 "$WORK/munge"  # munged wants its socket directory reachable, not writable, by others
dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$WORK/munge/munge.key"
MUNGE_SOCKET="$WORK/munge/munge.socket"
munged --foreground --force --socket="$MUNGE_SOCKET" --key-file="$WORK/munge/munge.key" \
    --pid-file="$WORK/munge/munged.pid" --seed-file="$WORK/munge/munged.seed" --log-file="$WORK/munged.log" \
    >"$WORK/munged.console" 2>&1 &
MUNGE_PID=$!
wait_for 20 "munged's socket" test -S "$MUNGE_SOCKET" || skip "munged does not start here: $(tail -n 3 "$WORK/munged.console")"
munge --socket="$MUNGE_SOCKET" -n </dev/null | unmunge --socket="$MUNGE_SOCKET" >/dev/null \
    || fail "munge credentials do not round-trip"

CTLD_PORT=$(free_port)
SLURMD_PORT=$(free_port)
# One node, this machine: controller and compute node. No cgroups (proctrack/linuxproc, task/none),
# no accounting. MpiDefault=pmi2: MPICH's built-in PMI client speaks PMI-2, so a plain `srun python`
# gives one MPI job (with none every task would be a singleton of its own); Debian's pmix plugin has
# no PMIx library. mpiexec inside the allocation (hydra, proxies started through srun) works too.
# MinJobAge=16: sbatch --wait polls every 2, 8, 8, ... s (its naps grow only while shorter than
# MinJobAge/2; 32 s naps with the default of 300) and the finished job stays visible to scontrol.
cat >"$SLURM_CONF" <<EOF
ClusterName=clusterenv-ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool/%n
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=pmi2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=16
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=ci Nodes=$NODE Default=YES MaxTime=15 State=UP
EOF

slurmctld -D -i -f "$SLURM_CONF" >"$WORK/slurmctld.console" 2>&1 &
CTLD_PID=$!
slurmd -D -f "$SLURM_CONF" >"$WORK/slurmd.console" 2>&1 &
SLURMD_PID=$!

node_idle() { [ "$(sinfo -h -N -n "$NODE" -o %T 2>/dev/null)" = idle ]; }
if ! wait_for 60 "node $NODE idle in sinfo" node_idle; then
    sinfo -N -l >&2 || true
    kill -0 "$CTLD_PID" 2>/dev/null || { diagnostics; skip "slurmctld does not run here"; }
    kill -0 "$SLURMD_PID" 2>/dev/null || { diagnostics; skip "slurmd does not run here"; }
    fail "node $NODE did not become idle within 60 s"
fi
log "node $NODE idle (slurmctld pid $CTLD_PID, slurmd pid $SLURMD_PID); srun --mpi=list: $(srun --mpi=list 2>&1 | tail -n +2 | tr -s ' \n' ' ')"

# -- the example --------------------------------------------------------------------------------------

VENV="$(dirname "$(dirname "$PYTHON")")"

job_state() { scontrol -o show job "$1" 2>/dev/null | grep -Eo "(JobState|ExitCode)=[^ ]+" | tr '\n' ' ' | sed 's/ $//'; }

# submit <sbatch script> <launcher>: a short CartPole PPO run on this node's 2 CPUs.
# The allocation is 2 tasks (--ntasks-per-node may not exceed the node's CPUs, even with
# --overcommit). LAUNCHER=mpiexec: WORKERS=2, so hydra places 3 ranks on the 2 slots (learner + 2
# worker ranks); LAUNCHER=srun: the script's default, 1 worker rank (srun cannot start more tasks
# than the allocation has).
# With a third argument P (mpiexec): PROCESSES_PER_WORKER=P, one worker rank (a node agent of P
# local processes) beside the learner.
submit() {
    local script=$1 launcher=$2 processes=${3:-1} out status started=$SECONDS workers=1
    [ "$launcher" = mpiexec ] && [ "$processes" = 1 ] && workers=2
    out="$WORK/job-$launcher-$processes.out"
    log "sbatch --wait $(basename "$script") with LAUNCHER=$launcher: 1 learner + $workers worker ranks of $processes process(es), 2048 PPO steps"
    status=0
    (
        cd "$ROOT"
        export CLUSTERENV_SLURM_TEST="$TOKEN"
        export VENV="$VENV" LAUNCHER="$launcher" NUM_ENVS=4 TOTAL_TIMESTEPS=2048 N_STEPS=128 OUTPUT_DIR="$WORK/runs"
        [ "$workers" = 2 ] && export WORKERS=2
        export PROCESSES_PER_WORKER="$processes"
        exec timeout 600 sbatch --wait --parsable --export=ALL --nodes=1 --ntasks=2 --ntasks-per-node=2 \
            --time=10 --output="$out" "$script"
    ) >"$WORK/sbatch.id" 2>"$WORK/sbatch.err" &
    SUBMIT_PID=$!
    wait "$SUBMIT_PID" || status=$?
    SUBMIT_PID=""
    JOB_ID="$(head -n 1 "$WORK/sbatch.id" | cut -d';' -f1)"
    log "job $JOB_ID ($launcher) ended with status $status after $((SECONDS - started)) s: $(job_state "$JOB_ID")"
    [ ! -s "$WORK/sbatch.err" ] || sed 's/^/    sbatch: /' "$WORK/sbatch.err" >&2
    # The job's output without SB3's progress tables; all of it when a check fails.
    grep -v '^[|-]' "$out" | sed 's/^/    | /' >&2 || true
    job_fail() {
        echo "---- the job's whole output" >&2
        sed 's/^/    | /' "$out" >&2 || true
        fail "$launcher: $*"
    }
    [ "$status" = 0 ] || job_fail "sbatch --wait exited with $status"
    [ "$(job_state "$JOB_ID")" = "JobState=COMPLETED ExitCode=0:0" ] || job_fail "the job did not complete with 0:0"
    grep -Eq "^learner on $NODE; $workers worker ranks" "$out" || job_fail "the script did not start $workers worker ranks"
    grep -Eq "on $workers worker ranks .* on $processes process\(es\) each.* learner on " "$out" \
        || job_fail "the learner did not start its pool"
    grep -Eq "^[0-9]+ steps in [0-9.]+ s" "$out" || job_fail "the learner did not finish training"
    local mean
    mean="$(grep -Eio "final mean return[^0-9-]*-?[0-9.]+" "$out" | tail -n 1 || true)"
    if [ -z "$mean" ]; then
        # Fallback until the example prints it: SB3's last rollout table.
        mean="$(grep -Eo "ep_rew_mean +\| +[0-9.e+-]+" "$out" | tail -n 1 | grep -Eo "[0-9.e+-]+$" || true)"
        [ -n "$mean" ] || job_fail "the learner reported no mean return"
        log "NOTE: the example prints no final mean return; SB3's last rollout table says ep_rew_mean $mean"
        mean="ep_rew_mean $mean"
    fi
    ! grep -q "BAD TERMINATION\|error:" "$out" || job_fail "a rank failed"
    # Every rank's exit code, where the launcher prints them (mpiexec -print-all-exitcodes:
    # "Exit codes: [vm] 0,0,0"); otherwise the job's 0:0 above says that no rank failed.
    if grep -q "Exit codes:" "$out"; then
        ! grep -A 20 "Exit codes:" "$out" | grep -Eo "\] [0-9,]+" | grep -q "[1-9]" || job_fail "a rank exited non-zero"
        log "$launcher: every rank exited 0 ($(grep -A 20 "Exit codes:" "$out" | grep -Eo "\[[^]]+\] [0-9,]+" | tr '\n' ' '))"
    fi
    JOB_ID=""
    log "$launcher: OK ($mean) in $((SECONDS - started)) s"
}

for script in "${SBATCH_SCRIPTS[@]}"; do
    for launcher in "${LAUNCHERS[@]}"; do
        submit "$script" "$launcher"
    done
    if [[ " ${LAUNCHERS[*]} " == *" mpiexec "* ]]; then
        submit "$script" mpiexec 2  # a node agent
    fi
done
