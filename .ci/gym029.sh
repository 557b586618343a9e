#!/usr/bin/env bash
# Runs the CleanRL adapter's tests on gymnasium 0.29.1, the version CleanRL's scripts pin, with the
# Atari and MuJoCo packages of that generation.
#
# Usage: .ci/gym029.sh [all|install|test] [venv path]
#   all (the default) installs, then tests; install only installs (.ci/run does it in the
#   background while the cluster suite runs); test only tests, in a venv installed before.
#   The venv defaults to .venv-gym029 in the repository root (gitignored); a relative path is taken
#   from the current directory. It is created if missing and reused otherwise.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
step="${1:-all}"
venv="$(realpath -m "${2:-$root/.venv-gym029}")"

install() {
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
    fi
    # ale-py 0.9.0 is the last release for gymnasium 0.29 (its ids register on `import ale_py`);
    # mujoco 2.3.7 is the one gymnasium 0.29's MuJoCo envs were written for.
    "$venv/bin/python" -m pip install --quiet "gymnasium==0.29.1" numpy cloudpickle pytest pytest-timeout psutil \
        hypothesis "ale-py==0.9.0" "mujoco==2.3.7" imageio
    # --no-deps: the package's own requirements are met above; its extras (SB3, torch) are not wanted here.
    "$venv/bin/python" -m pip install --quiet --no-deps -e "$root"
}

run_tests() {
    cd "$root"
    "$venv/bin/python" -c 'import gymnasium; assert gymnasium.__version__ == "0.29.1", gymnasium.__version__'
    # The training test needs torch and skips itself, the SB3 parts skip too; the contract, failure,
    # registry (ids from the user's script and from ale_py), action-form, Atari/MuJoCo and
    # asynchronous-batch tests run.
    "$venv/bin/python" -m pytest tests/test_cleanrl_vector_env.py tests/test_cleanrl_failures.py \
        tests/test_cleanrl_training.py tests/test_registry.py tests/test_action_forms.py tests/test_workloads.py \
        tests/test_env_output.py tests/test_fuzz.py tests/test_async_batches.py -q
}

case "$step" in
    all) install; run_tests ;;
    install) install ;;
    test) run_tests ;;
    *) echo "usage: $0 [all|install|test] [venv path]" >&2; exit 2 ;;
esac
