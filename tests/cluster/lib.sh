# Shared helpers of the cluster tests (sourced, not run).
#
# Conventions: a script that cannot run here (no root, no namespaces, no apt, no slurm) prints
# "SKIPPED: <why>" and exits 0; anything else that goes wrong exits non-zero. Every wait is bounded.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER_DIR="$ROOT/tests/cluster"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
    PYTHON="$(command -v python3 || true)"
fi
MPIEXEC="${MPIEXEC:-$(dirname "$PYTHON")/mpiexec}"
if [ ! -x "$MPIEXEC" ]; then
    MPIEXEC="$(command -v mpiexec || true)"
fi

log() { printf '[%s %s] %s\n' "$(date +%H:%M:%S)" "${LOG_TAG:-cluster}" "$*" >&2; }

skip() {
    echo "SKIPPED: $*"
    exit 0
}

fail() {
    echo "FAILED: $*" >&2
    exit 1
}

# wait_for <seconds> <description> <command...>: run the command every 0.2 s until it succeeds;
# returns 1 (after saying so) when the time is up.
wait_for() {
    local seconds=$1 what=$2
    shift 2
    local deadline=$((SECONDS + seconds))
    while ! "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "gave up after ${seconds} s waiting for: $what"
            return 1
        fi
        sleep 0.2
    done
}

# need_mpi: skip unless mpi4py and MPICH's mpiexec are installed.
need_mpi() {
    [ -n "$PYTHON" ] || skip "no python interpreter found"
    [ -n "$MPIEXEC" ] && [ -x "$MPIEXEC" ] || skip "MPICH's mpiexec not found (pip install -e '.[mpi]')"
    "$PYTHON" -c "import mpi4py" 2>/dev/null || skip "mpi4py is not installed (pip install -e '.[mpi]')"
}
