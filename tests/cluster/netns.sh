#!/usr/bin/env bash
# Several hosts on one machine: a learner host and two worker hosts, each a network namespace (plus
# a UTS namespace for its hostname), cabled to a bridge in a fourth "switch" namespace on the
# private 10.77.0.0/24. No address or route is added outside these namespaces, so no packet can
# leave the machine. MPICH's hydra starts the ranks on the "hosts" through tests/cluster/nsexec.sh
# (its ssh), and MPI traffic goes over TCP on the veths (UCX_TLS=tcp): the namespaces share
# /dev/shm, which UCX would otherwise use, so this is forced, and checked with packet counters.
#
#   bash tests/cluster/netns.sh [contract] [agents] [partition] [kill] [bench] [bench_agents]
#                               (default: contract agents partition kill)
#
#   contract   ClusterVecEnv(backend="mpi") == DummyVecEnv over 2000 steps, learner on "learner",
#              one worker rank on each of "w1" and "w2": MPMD launch (mpiexec), then spawn launch
#              (plain python spawning its ranks on w1 and w2)
#   agents     the contract with node agents (processes_per_worker=2): the rank on each of w1 and
#              w2 steps its 4 envs on 2 local processes of its host (both launches)
#   partition  a step longer than the heartbeat timeout (5 s here) is not a lost host; a 1 s cut of
#              w2's link is survived; a lasting cut is WorkerLostError (no heartbeat) within the
#              heartbeat timeout, not the pool's 60 s, and close() returns; w2's worker rank exits by
#              itself within the heartbeat timeout while its link is still cut, and nothing of the
#              job is left on w2 (both launches)
#   kill       the worker rank on w1 is SIGKILLed mid-run: mpiexec ends the whole job at once;
#              under mpiexec -disable-auto-cleanup the learner gets WorkerLostError (no heartbeat)
#              within the heartbeat timeout, not the pool's 30 s, closes, and aborts the job at
#              exit; spawned ranks: WorkerLostError within 0.25 s and the learner lives on. A
#              SIGKILLed learner: every rank on every host ends (both launches). The learner's
#              host down (its link cut, then everything on it SIGKILLed): the worker ranks on w1
#              and w2 exit within the heartbeat timeout and nothing is left on them (both launches)
#   bench      benchmarks/cluster_latency.py with delays of 0, 1 and 5 ms each way on the worker
#              hosts' links (CLUSTER_DELAYS_MS="0 1 5"; tc netem, or tests/cluster/delayline.py on
#              kernels without netem), results merged into
#              benchmarks/results/cluster_latency.json; with --quick: 0 and 5 ms, 1 s per mode, results
#              to a temporary file (the CI smoke run)
#   bench_agents  benchmarks/node_agents.py across the hosts: 2 node agents (one rank on each of w1
#              and w2) of P processes against 2P flat ranks spread over w1 and w2, results to
#              benchmarks/results/node_agents_hosts.json
#
# Needs root, `ip netns` and veth/bridge support, and mpi4py + MPICH; otherwise prints SKIPPED and
# exits 0. Cleans up namespaces, veths, hosts files and processes on any exit (trap).
set -euo pipefail
LOG_TAG=netns
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MODES=()
QUICK=0
for arg in "$@"; do
    case "$arg" in
        contract | agents | partition | kill | bench | bench_agents) MODES+=("$arg") ;;
        --quick) QUICK=1 ;;
        *) fail "unknown argument '$arg' (contract, agents, partition, kill, bench, bench_agents, --quick)" ;;
    esac
done
[ ${#MODES[@]} -gt 0 ] || MODES=(contract agents partition kill)

# -- can this machine do it? ------------------------------------------------------------------------

[ "$(id -u)" = 0 ] || skip "network namespaces need root"
for tool in ip unshare timeout tc; do
    command -v "$tool" >/dev/null || skip "'$tool' is not installed"
done
need_mpi

PREFIX="ce$$"                       # namespaces: ce<pid>-learner, -w1, -w2, -sw
HOSTS=(learner w1 w2)
declare -A ADDRESS=([learner]=10.77.0.1 [w1]=10.77.0.11 [w2]=10.77.0.12)
SWITCH="$PREFIX-sw"
WORK="$(mktemp -d /tmp/clusterenv-netns.XXXXXX)"
ETC_NETNS_MADE=0
[ -d /etc/netns ] || ETC_NETNS_MADE=1
JOB_PID=""
DELAY_PID=""
export CLUSTER_NS_PREFIX="$PREFIX"

namespaces() { echo "$PREFIX-learner" "$PREFIX-w1" "$PREFIX-w2" "$SWITCH"; }

cleanup() {
    local status=$?
    set +e
    trap - EXIT INT TERM
    local pid
    for pid in "$JOB_PID" "$DELAY_PID"; do
        [ -n "$pid" ] && { kill -KILL "$pid" && wait "$pid"; } 2>/dev/null
    done
    local ns pids
    for ns in $(namespaces); do
        if [ -e "/run/netns/$ns" ]; then
            pids="$(ip netns pids "$ns" 2>/dev/null)"
            [ -z "$pids" ] || kill -KILL $pids 2>/dev/null
        fi
    done
    for ns in $(namespaces); do
        local tries=0
        while [ -e "/run/netns/$ns" ] && [ -n "$(ip netns pids "$ns" 2>/dev/null)" ] && [ $tries -lt 50 ]; do
            sleep 0.1
            tries=$((tries + 1))
        done
        [ -e "/run/netns/$ns" ] && ip netns del "$ns" 2>/dev/null
        rm -rf "/etc/netns/$ns"
    done
    [ "$ETC_NETNS_MADE" = 1 ] && rmdir /etc/netns 2>/dev/null
    local left
    left="$(ip netns list 2>/dev/null | grep -c "^$PREFIX-" || true)"
    if [ "$left" != 0 ]; then
        echo "FAILED: cleanup left $left namespaces: $(ip netns list | grep "^$PREFIX-")" >&2
        status=1
    else
        log "cleanup: namespaces, veths, hosts files and processes removed"
    fi
    rm -rf "$WORK"
    exit $status
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -- the network --------------------------------------------------------------------------------------

for ns in $(namespaces); do
    [ ! -e "/run/netns/$ns" ] || fail "namespace $ns exists already (left by a killed run?): ip netns del $ns"
done
ip netns add "$SWITCH" 2>"$WORK/err" || skip "cannot create network namespaces here: $(cat "$WORK/err")"
ip -n "$SWITCH" link add br0 type bridge 2>"$WORK/err" || skip "no bridge support: $(cat "$WORK/err")"
ip -n "$SWITCH" link set br0 up

# Latency: tc netem where the kernel has it; otherwise (bench only) the worker hosts' cables are TAP
# pairs joined by tests/cluster/delayline.py, a user-space relay that delays every frame.
NETEM=0
if ip netns exec "$SWITCH" tc qdisc add dev br0 root netem delay 1ms 2>/dev/null; then
    ip netns exec "$SWITCH" tc qdisc del dev br0 root
    NETEM=1
fi
TAPS=0
[[ " ${MODES[*]} " == *" bench "* ]] && [ "$NETEM" = 0 ] && TAPS=1

# start_delayline <ms>: (re)start the relay of the worker hosts' TAP cables.
start_delayline() {
    if [ -n "$DELAY_PID" ]; then
        kill "$DELAY_PID" 2>/dev/null
        wait "$DELAY_PID" 2>/dev/null || true
    fi
    ip netns exec "$SWITCH" "$PYTHON" "$CLUSTER_DIR/delayline.py" --delay-ms "$1" \
        "$PREFIX-w1:ce0,$SWITCH:p-w1" "$PREFIX-w2:ce0,$SWITCH:p-w2" >"$WORK/delayline.out" 2>&1 &
    DELAY_PID=$!
}

for host in "${HOSTS[@]}"; do
    ns="$PREFIX-$host"
    ip netns add "$ns"
    # Both ends created inside the namespaces: no interface ever appears in the machine's own namespace.
    if [ "$TAPS" = 1 ] && [ "$host" != learner ]; then
        ip -n "$ns" tuntap add dev ce0 mode tap 2>"$WORK/err" && ip -n "$SWITCH" tuntap add dev "p-$host" mode tap \
            || skip "no netem and no TAP devices for a delay line: $(cat "$WORK/err")"
    else
        ip -n "$ns" link add ce0 type veth peer name "p-$host" netns "$SWITCH" 2>"$WORK/err" \
            || skip "no veth support: $(cat "$WORK/err")"
    fi
    ip -n "$ns" addr add "${ADDRESS[$host]}/24" dev ce0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set ce0 up
    ip -n "$SWITCH" link set "p-$host" master br0 up
    # Names for `ip netns exec` (it bind-mounts /etc/netns/<ns>/hosts over /etc/hosts).
    mkdir -p "/etc/netns/$ns"
    {
        echo "127.0.0.1 localhost"
        for other in "${HOSTS[@]}"; do echo "${ADDRESS[$other]} $other"; done
    } >"/etc/netns/$ns/hosts"
done
[ "$TAPS" = 1 ] && start_delayline 0
# reachable <from> <to>: a TCP connection to a closed port is refused at once when the host is there.
reachable() {
    local answer
    answer="$(ip netns exec "$PREFIX-$1" timeout 2 bash -c "exec 3<>/dev/tcp/$2/9" 2>&1 || true)"
    [[ "$answer" == *"Connection refused"* ]]
}
for host in w1 w2; do
    wait_for 10 "$host reachable from learner" reachable learner "$host" \
        || fail "the namespaces' network does not work (learner -> $host)"
done
log "hosts up: learner ${ADDRESS[learner]}, w1 ${ADDRESS[w1]}, w2 ${ADDRESS[w2]} (bridge in $SWITCH$([ "$TAPS" = 1 ] && echo "; worker cables: TAP pairs + delayline.py, no netem in this kernel"))"

# MPI between "hosts" over TCP on ce0 only: UCX (MPICH's default netmod here) with its TCP transport
# (no shared-memory transport: all namespaces share /dev/shm and would silently use it).
export UCX_TLS=tcp,self UCX_NET_DEVICES=ce0
export CLUSTERENV_MPI_CONNECT_TIMEOUT=120
export PYTHONUNBUFFERED=1

counter() { ip netns exec "$PREFIX-$1" cat "/sys/class/net/ce0/statistics/$2"; }

# start_job <launch> <seconds> <output file> <learner args...>: the learner on "learner", one worker
# rank on w1 and one on w2, in the background (JOB_PID). Launch "world": mpiexec in the learner's
# namespace (MPMD); "spawn": the learner alone, spawning its ranks on w1 and w2 (--spawn), MPICH's
# singleton process manager reaching them through the same "ssh" (HYDRA_LAUNCHER_EXEC).
start_job() {
    local launch=$1 seconds=$2 output=$3
    shift 3
    if [ "$launch" = world ]; then
        timeout -k 5 "$seconds" ip netns exec "$PREFIX-learner" unshare --uts sh -c 'hostname learner && exec "$@"' job \
            "$MPIEXEC" -launcher ssh -launcher-exec "$CLUSTER_DIR/nsexec.sh" -iface ce0 -print-all-exitcodes \
            -hosts learner,w1,w2 ${CLUSTER_MPIEXEC_ARGS:-} \
            -n 1 "$PYTHON" "$@" : -n 2 "$PYTHON" -m clusterenv_core.worker mpi \
            >"$output" 2>&1 &
    else
        HYDRA_LAUNCHER=ssh HYDRA_LAUNCHER_EXEC="$CLUSTER_DIR/nsexec.sh" HYDRA_IFACE=ce0 \
            timeout -k 5 "$seconds" ip netns exec "$PREFIX-learner" unshare --uts sh -c 'hostname learner && exec "$@"' job \
            "$PYTHON" "$@" --spawn >"$output" 2>&1 &
    fi
    JOB_PID=$!
}

wait_job() {  # sets JOB_STATUS
    JOB_STATUS=0
    wait "$JOB_PID" || JOB_STATUS=$?
    JOB_PID=""
}

# all_exited_0 <file>: mpiexec -print-all-exitcodes said 0 for the learner and both worker ranks
# (one line per host: "[mpiexec@learner] Exit codes: [learner] 0", "[w1] 0", "[w2] 0").
all_exited_0() {
    grep -Eq "Exit codes: \[learner\] 0$" "$1" && grep -Eq "^\[w1\] 0$" "$1" && grep -Eq "^\[w2\] 0$" "$1"
}

now() { date +%s.%N; }
since() { awk -v start="$1" -v end="$(now)" 'BEGIN { printf "%.1f", end - start }'; }
processes() { ip netns pids "$PREFIX-$1" | xargs -r ps -o pid=,args= -p | cut -c1-90 | tr '\n' ';'; }
no_processes() { [ -z "$(ip netns pids "$PREFIX-$1")" ]; }

show() {  # show <file>: the job's output, indented
    sed 's/^/    | /' "$1" >&2
}

# -- scenarios ----------------------------------------------------------------------------------------

contract() {  # contract <world|spawn>
    local launch=$1
    log "contract ($launch): ClusterVecEnv(backend='mpi') vs DummyVecEnv, 2000 steps, workers on w1 and w2"
    local out="$WORK/contract-$launch.out" before_w1 before_w2 packets_w1 packets_w2 started=$SECONDS
    before_w1=$(counter w1 rx_packets)
    before_w2=$(counter w2 rx_packets)
    start_job "$launch" 240 "$out" "$CLUSTER_DIR/multihost.py" contract
    wait_job
    packets_w1=$(($(counter w1 rx_packets) - before_w1))
    packets_w2=$(($(counter w2 rx_packets) - before_w2))
    show "$out"
    [ "$JOB_STATUS" = 0 ] || fail "contract ($launch): the learner's job exited with $JOB_STATUS"
    grep -q "OK contract" "$out" || fail "contract ($launch): no OK line"
    grep -q "HOSTS w1 w2$" "$out" || fail "contract ($launch): the workers did not run on w1 and w2"
    [ "$launch" = spawn ] || all_exited_0 "$out" || fail "contract ($launch): not every rank exited 0"
    # 2000 steps are at least 2000 step requests into each worker host: proof the links carried them.
    log "contract ($launch): packets received on w1's link: $packets_w1, on w2's: $packets_w2"
    [ "$packets_w1" -ge 2000 ] && [ "$packets_w2" -ge 2000 ] \
        || fail "contract ($launch): too few packets on the worker links: MPI did not go over the network"
    no_processes_left "contract ($launch)"
    log "contract ($launch): OK in $((SECONDS - started)) s"
}

run_contract() {
    contract world
    contract spawn
}

# agents <world|spawn>: the contract with node agents: the worker rank on each of w1 and w2 steps
# its 4 envs on 2 local processes there (processes_per_worker=2).
agents() {
    local launch=$1
    log "agents ($launch): ClusterVecEnv(backend='mpi', processes_per_worker=2) vs DummyVecEnv, 2000 steps, agents on w1 and w2"
    local out="$WORK/agents-$launch.out" started=$SECONDS host pids
    start_job "$launch" 240 "$out" "$CLUSTER_DIR/multihost.py" agents
    wait_job
    show "$out"
    [ "$JOB_STATUS" = 0 ] || fail "agents ($launch): the learner's job exited with $JOB_STATUS"
    grep -q "OK agents" "$out" || fail "agents ($launch): no OK line"
    grep -q "^HOSTS w1 w2$" "$out" || fail "agents ($launch): the agents did not run on w1 and w2"
    # "ENV HOSTS w1:<pid> ...": each host's 4 envs in 2 local processes of that host.
    for host in w1 w2; do
        pids="$(grep "^ENV HOSTS" "$out" | tr ' ' '\n' | grep "^$host:" | sort | uniq -c | awk '{print $1}' | tr '\n' ' ')"
        [ "$pids" = "2 2 " ] || fail "agents ($launch): $host's envs are not 2 per local process on it (counts: '$pids')"
    done
    [ "$launch" = spawn ] || all_exited_0 "$out" || fail "agents ($launch): not every rank exited 0"
    no_processes_left "agents ($launch)"
    log "agents ($launch): OK in $((SECONDS - started)) s"
}

run_agents() {
    agents world
    agents spawn
}

# no_processes_left <what>: nothing of the job runs on any host (within 10 s).
no_processes_left() {
    local host
    for host in learner w1 w2; do
        wait_for 10 "processes on $host to end" no_processes "$host" \
            || fail "$1: still running on $host after the job ended: $(processes "$host")"
    done
}

HEARTBEAT_TIMEOUT=5  # multihost.py's pools

# partition <world|spawn>: a slow step on w2, a 1 s cut of w2's link (both survived), then a lasting
# cut: the learner's step raises WorkerLostError within the heartbeat timeout and close() returns;
# w2's worker rank exits by itself while w2 is still cut off, and nothing of the job stays there.
partition() {
    local launch=$1 timeout_s=60
    log "partition ($launch): a slow step, a 1 s cut of w2's link (survived), then a lasting cut (WorkerLostError within ${HEARTBEAT_TIMEOUT} s)"
    local out="$WORK/partition-$launch.out" signals="$WORK/signals-partition-$launch" started=$SECONDS
    mkdir -p "$signals"
    CLUSTER_SIGNALS="$signals" start_job "$launch" 120 "$out" "$CLUSTER_DIR/multihost.py" partition --timeout "$timeout_s"
    wait_for 90 "the learner stepping (blip)" test -e "$signals/ready-blip" || { show "$out"; fail "partition: no ready-blip"; }
    ip -n "$PREFIX-w2" link set ce0 down
    sleep 1
    ip -n "$PREFIX-w2" link set ce0 up
    touch "$signals/blip-over"
    wait_for 60 "the learner stepping (cut)" test -e "$signals/ready-cut" || { show "$out"; fail "partition: no ready-cut"; }
    ip -n "$PREFIX-w2" link set ce0 down
    local cut
    cut=$(now)
    log "partition ($launch): w2 cut off"
    wait_job
    log "partition ($launch): the learner's job ended $(since "$cut") s after the cut, status $JOB_STATUS"
    show "$out"
    [ "$JOB_STATUS" != 124 ] && [ "$JOB_STATUS" != 137 ] || fail "partition ($launch): the learner did not end by itself"
    grep -q "OK slow step" "$out" || fail "partition ($launch): the slow step was not survived"
    grep -q "OK blip" "$out" || fail "partition ($launch): the 1 s cut was not survived"
    grep -Eq "OK partition WorkerLostError .*sent no heartbeat" "$out" || fail "partition ($launch): no WorkerLostError for the silent host"
    if ! grep -q "OK closed" "$out"; then
        # World ranks are one MPI job, and MPI is fail-stop: when hydra or MPICH notice the lost
        # rank (about when the pool's timeout fires) they may end the job before close() returns.
        # That is the documented outcome too, as long as the job ended by itself (checked above).
        [ "$launch" = world ] && [ "$JOB_STATUS" != 0 ] || fail "partition ($launch): close() did not return"
        log "partition ($launch): the launcher ended the job (status $JOB_STATUS) before close() returned"
    fi
    local host
    for host in learner w1; do
        wait_for 10 "processes on $host to end" no_processes "$host" \
            || log "partition ($launch): still running on $host after the learner ended: $(processes "$host")"
    done
    # The launcher cannot reach w2; its worker rank hears no heartbeat and exits by itself.
    wait_for $((HEARTBEAT_TIMEOUT + 10)) "w2's processes to end while it is cut off" no_processes w2 \
        || fail "partition ($launch): still running on w2 $(since "$cut") s after the cut: $(processes w2)"
    log "partition ($launch): nothing left on w2 $(since "$cut") s after the cut (link still down)"
    ip -n "$PREFIX-w2" link set ce0 up
    for host in learner w1 w2; do
        if ! no_processes "$host"; then
            log "partition ($launch): killing what is left on $host: $(processes "$host")"
            ip netns pids "$PREFIX-$host" | xargs -r kill -KILL
        fi
    done
    log "partition ($launch): OK in $((SECONDS - started)) s"
}

run_partition() {
    partition world
    partition spawn
}

# kill_rank <variant>: SIGKILL the worker rank on w1 mid-run.
#   auto:    mpiexec (hydra's default): the launcher ends the whole job at once, learner included
#   noclean: mpiexec -disable-auto-cleanup: the job goes on; the learner's step raises
#            WorkerLostError (no heartbeat) within the heartbeat timeout, close() returns, MPI_Abort at exit
#   spawn:   spawned ranks: MPICH's process manager ends the spawn; WorkerLostError at once
kill_rank() {
    local variant=$1 timeout_s=30 launch=world
    [ "$variant" = spawn ] && launch=spawn
    log "kill ($variant): SIGKILL the worker rank on w1 mid-run"
    local out="$WORK/kill-$variant.out" signals="$WORK/signals-kill-$variant" started=$SECONDS
    mkdir -p "$signals"
    local extra=""
    [ "$variant" = noclean ] && extra="-disable-auto-cleanup"
    CLUSTER_SIGNALS="$signals" CLUSTER_MPIEXEC_ARGS="$extra" \
        start_job "$launch" 120 "$out" "$CLUSTER_DIR/multihost.py" kill --timeout "$timeout_s"
    wait_for 90 "the learner stepping" test -e "$signals/ready-kill" || { show "$out"; fail "kill: no ready-kill"; }
    local victims
    victims="$(ip netns pids "$PREFIX-w1" | xargs -r ps -o pid=,args= -p | awk '/clusterenv_core.worker/ {print $1}')"
    [ -n "$victims" ] || fail "kill ($variant): no worker rank found on w1"
    kill -KILL $victims
    local killed
    killed=$(now)
    wait_job
    log "kill ($variant): the learner's job ended $(since "$killed") s after the kill, status $JOB_STATUS"
    show "$out"
    case "$variant" in
    auto)
        [ "$JOB_STATUS" != 0 ] || fail "kill (auto): the job exited 0 after losing a rank"
        grep -q "BAD TERMINATION" "$out" || fail "kill (auto): mpiexec did not report the lost rank"
        ! grep -q "OK kill" "$out" || fail "kill (auto): the learner outlived the job?"
        ;;
    noclean)
        [ "$JOB_STATUS" != 0 ] || fail "kill (noclean): the job exited 0 after losing a rank"
        grep -Eq "OK kill WorkerLostError .*sent no heartbeat" "$out" || fail "kill (noclean): no WorkerLostError for the silent rank"
        grep -q "OK closed" "$out" && grep -q "MPI_Abort" "$out" || fail "kill (noclean): no close and MPI_Abort"
        ;;
    spawn)
        [ "$JOB_STATUS" = 0 ] || fail "kill (spawn): the learner exited with $JOB_STATUS"
        grep -Eq "OK kill WorkerLostError after [0-1]\." "$out" || fail "kill (spawn): no WorkerLostError within 2 s"
        grep -q "OK closed" "$out" || fail "kill (spawn): close() did not return"
        ;;
    esac
    # The launcher ends every rank and proxy itself (the cleanup trap would hide a leak).
    no_processes_left "kill ($variant)"
    log "kill ($variant): OK in $((SECONDS - started)) s"
}

run_kill() {
    kill_rank auto
    kill_rank noclean
    kill_rank spawn
    kill_learner world
    kill_learner spawn
    host_down world
    host_down spawn
}

# kill_learner <world|spawn>: SIGKILL the learner mid-run: every rank on every host must end (the
# worker ranks cannot see the learner's pid from another host; the launcher has to end them).
kill_learner() {
    local launch=$1
    log "kill learner ($launch): SIGKILL the learner mid-run"
    local out="$WORK/kill-learner-$launch.out" signals="$WORK/signals-kill-learner-$launch" started=$SECONDS
    mkdir -p "$signals"
    CLUSTER_SIGNALS="$signals" start_job "$launch" 120 "$out" "$CLUSTER_DIR/multihost.py" kill --timeout 5
    wait_for 90 "the learner stepping" test -e "$signals/ready-kill" || { show "$out"; fail "kill learner: no ready-kill"; }
    local victims
    victims="$(ip netns pids "$PREFIX-learner" | xargs -r ps -o pid=,args= -p | awk '/multihost.py kill/ && !/mpiexec|sh -c/ {print $1}')"
    [ -n "$victims" ] || fail "kill learner ($launch): no learner process found"
    kill -KILL $victims
    local killed
    killed=$(now)
    wait_job
    log "kill learner ($launch): the job ended $(since "$killed") s after the kill, status $JOB_STATUS"
    show "$out"
    [ "$JOB_STATUS" != 0 ] || fail "kill learner ($launch): status 0"
    no_processes_left "kill learner ($launch)"
    log "kill learner ($launch): every rank on every host ended, $(since "$killed") s after the kill"
}

# host_down <world|spawn>: the learner's host goes away: its link is cut, then every process on it
# is SIGKILLed (nothing closes a connection). The worker ranks on w1 and w2 hear no heartbeat and
# exit by themselves; nothing of the job may be left on either host.
host_down() {
    local launch=$1
    log "host down ($launch): cut the learner's link, SIGKILL everything on it"
    local out="$WORK/host-down-$launch.out" signals="$WORK/signals-host-down-$launch" started=$SECONDS
    mkdir -p "$signals"
    CLUSTER_SIGNALS="$signals" start_job "$launch" 120 "$out" "$CLUSTER_DIR/multihost.py" kill --timeout 30
    wait_for 90 "the learner stepping" test -e "$signals/ready-kill" || { show "$out"; fail "host down: no ready-kill"; }
    ip -n "$PREFIX-learner" link set ce0 down
    ip netns pids "$PREFIX-learner" | xargs -r kill -KILL
    local down
    down=$(now)
    wait_job
    local host
    for host in w1 w2; do
        wait_for $((HEARTBEAT_TIMEOUT + 10)) "$host's processes to end" no_processes "$host" \
            || { show "$out"; fail "host down ($launch): still running on $host $(since "$down") s later: $(processes "$host")"; }
    done
    log "host down ($launch): nothing left on w1 and w2 $(since "$down") s after the learner's host went down"
    ip -n "$PREFIX-learner" link set ce0 up
    log "host down ($launch): OK in $((SECONDS - started)) s"
}

# delay <ms>: every packet between the learner and a worker host is delayed <ms> one way: netem on
# both ends of each worker host's link (the worker's ce0 and its switch port), or the delay line.
delay() {
    local ms=$1 host
    if [ "$NETEM" = 0 ]; then
        start_delayline "$ms"
        sleep 0.5
        kill -0 "$DELAY_PID" 2>/dev/null || { cat "$WORK/delayline.out" >&2; return 1; }
        return 0
    fi
    for host in w1 w2; do
        if [ "$ms" = 0 ]; then
            ip netns exec "$PREFIX-$host" tc qdisc del dev ce0 root 2>/dev/null || true
            ip netns exec "$SWITCH" tc qdisc del dev "p-$host" root 2>/dev/null || true
        else
            ip netns exec "$PREFIX-$host" tc qdisc replace dev ce0 root netem delay "${ms}ms" \
                && ip netns exec "$SWITCH" tc qdisc replace dev "p-$host" root netem delay "${ms}ms" \
                || return 1
        fi
    done
}

# rtt <host>: median time of 7 refused TCP connections learner -> host (one round trip each), ms.
rtt() {
    ip netns exec "$PREFIX-learner" "$PYTHON" - "$1" <<'PY'
import socket, statistics, sys, time
samples = []
for _ in range(7):
    sock = socket.socket()
    sock.settimeout(2.0)
    started = time.perf_counter()
    try:
        sock.connect((sys.argv[1], 9))
    except ConnectionRefusedError:
        samples.append(time.perf_counter() - started)
    finally:
        sock.close()
print(f"{statistics.median(samples) * 1e3:.2f}" if samples else "nan")
PY
}

run_bench() {
    local delays seconds json
    if [ "$QUICK" = 1 ]; then
        delays=(0 5) seconds=1 json="$WORK/cluster_latency.json"
    else
        delays=(${CLUSTER_DELAYS_MS:-0 1 5}) seconds=3 json="$ROOT/benchmarks/results/cluster_latency.json"
    fi
    "$PYTHON" -c "import torch, stable_baselines3" 2>/dev/null || skip "the benchmark needs torch and stable-baselines3"
    [ "$NETEM" = 1 ] || log "bench: no tc netem in this kernel: delays come from tests/cluster/delayline.py"
    local setup="tests/cluster/netns.sh bench: learner and 2 worker hosts as network namespaces on this machine, \
MPI over TCP (UCX); delay_ms added each way on the worker hosts' links by \
$([ "$NETEM" = 1 ] && echo "tc netem" || echo "tests/cluster/delayline.py (TAP cables; no netem in this kernel)"); \
rtt_ms: median TCP connect round trip learner -> w1"
    local ms out measured started=$SECONDS
    for ms in "${delays[@]}"; do
        delay "$ms" || fail "bench: could not set a ${ms} ms delay"
        measured="$(rtt w1)"
        log "bench: +${ms} ms each way on the worker links, TCP round trip learner -> w1 ${measured} ms"
        out="$WORK/bench-$ms.out"
        start_job world 240 "$out" "$ROOT/benchmarks/cluster_latency.py" --delay-ms "$ms" --rtt-ms "$measured" \
            --seconds "$seconds" --json "$json" --setup "$setup"
        wait_job
        show "$out"
        [ "$JOB_STATUS" = 0 ] && grep -q "^RESULT " "$out" || fail "bench: the ${ms} ms run failed (status $JOB_STATUS)"
        all_exited_0 "$out" || fail "bench: not every rank exited 0"
    done
    delay 0
    log "bench: results in $json ($((SECONDS - started)) s):"
    "$PYTHON" - "$json" <<'PY' >&2
import json, sys
data = json.load(open(sys.argv[1]))
print(f"    {'delay':>8} {'rtt ms':>7} {'central steps/s':>16} {'step ms':>8} {'rollout steps/s':>16} {'segment ms':>11} {'ratio':>6}")
for run in data["runs"]:
    print(f"    {run['delay_ms']:>6g}ms {run['rtt_ms'] or float('nan'):>7.2f} {run['central_steps_per_s']:>16,} {run['central_step_ms']:>8.2f} "
          f"{run['rollout_steps_per_s']:>16,} {run['rollout_segment_ms']:>11.1f} {run['ratio']:>6.1f}")
PY
}

# bench_agents: benchmarks/node_agents.py with the learner on "learner" spawning its ranks on w1 and
# w2 (hydra places them round-robin): 2 node agents of P processes against 2P flat ranks, over TCP.
run_bench_agents() {
    local json="$ROOT/benchmarks/results/node_agents_hosts.json" started=$SECONDS
    local setup="tests/cluster/netns.sh bench_agents: learner and 2 worker hosts as network namespaces on this \
machine, MPI over TCP (UCX), ranks spawned round-robin on w1 and w2"
    HYDRA_LAUNCHER=ssh HYDRA_LAUNCHER_EXEC="$CLUSTER_DIR/nsexec.sh" HYDRA_IFACE=ce0 \
        timeout -k 5 1800 ip netns exec "$PREFIX-learner" unshare --uts sh -c 'hostname learner && exec "$@"' job \
        "$PYTHON" "$ROOT/benchmarks/node_agents.py" --layouts 2x4 8x1 2x8 16x1 \
        --mpi-options '{"launch": "spawn", "spawn_info": {"hosts": "w1,w2"}}' --setup "$setup" --json "$json" \
        || fail "bench_agents: the benchmark failed"
    log "bench_agents: results in $json ($((SECONDS - started)) s)"
}

for mode in "${MODES[@]}"; do
    "run_$mode"
done
