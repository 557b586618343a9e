#!/usr/bin/env bash
# The cluster suite, run once by .ci/run after pytest (pytest never collects tests/cluster/):
#
#   bash tests/cluster/run_all.sh
#
# 1. slurm.sh      a one-node Slurm cluster here, examples/slurm/*.sbatch submitted with sbatch --wait
# 2. netns.sh      learner and worker "hosts" in network namespaces: the DummyVecEnv contract over TCP
#                  (flat ranks, and node agents), a network partition, a killed rank
# 3. netns.sh bench --quick   the latency benchmark's smoke run (results to a temporary file)
#
# Each part prints "SKIPPED: <why>" and counts as skipped where the machine cannot run it (no root,
# no namespaces, no Slurm); any other failure makes this script exit non-zero. Each part is bounded
# by a timeout. Afterwards nothing may be left in /dev/shm, which every namespace host shares, though
# the parts kill ranks (docs/mpi.md, "Shared memory").
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

failed=0
summary=()
shm_before="$(ls /dev/shm 2>/dev/null | sort)"

run() {  # run <name> <seconds> <command...>
    local name=$1 seconds=$2 started=$SECONDS status output
    shift 2
    echo "== cluster: $name"
    output="$(mktemp)"
    timeout -k 10 "$seconds" "$@" 2>&1 | tee "$output"
    status=${PIPESTATUS[0]}
    local took=$((SECONDS - started))
    if [ "$status" = 0 ] && grep -q "^SKIPPED:" "$output"; then
        summary+=("$name: $(grep -m 1 "^SKIPPED:" "$output") (${took} s)")
    elif [ "$status" = 0 ]; then
        summary+=("$name: passed (${took} s)")
    else
        [ "$status" = 124 ] && echo "cluster: $name did not finish within ${seconds} s" >&2
        summary+=("$name: FAILED with status $status (${took} s)")
        failed=1
    fi
    rm -f "$output"
}

run slurm 420 bash "$HERE/slurm.sh"
run "several hosts" 420 bash "$HERE/netns.sh" contract agents partition kill
run "latency benchmark (smoke)" 300 bash "$HERE/netns.sh" bench --quick

shm_left="$(comm -13 <(echo "$shm_before") <(ls /dev/shm 2>/dev/null | sort))"
if [ -n "$shm_left" ]; then
    summary+=("FAILED: left in /dev/shm: $(echo $shm_left)")
    failed=1
fi

echo "== cluster suite"
printf '   %s\n' "${summary[@]}"
exit $failed
