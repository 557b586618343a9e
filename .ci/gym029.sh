#!/usr/bin/env bash
# Runs the CleanRL adapter's tests on gymnasium 0.29.1, the version CleanRL's scripts pin.
#
# Usage: .ci/gym029.sh [venv path]   (default: .venv-gym029 in the repository root, gitignored;
# a relative path is taken from the current directory)
# The venv is created if missing and reused otherwise.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(realpath -m "${1:-$root/.venv-gym029}")"

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet "gymnasium==0.29.1" numpy cloudpickle pytest pytest-timeout psutil
# --no-deps: the package's own requirements are met above; its extras (SB3, torch) are not wanted here.
"$venv/bin/python" -m pip install --quiet --no-deps -e "$root"

cd "$root"
"$venv/bin/python" -c 'import gymnasium; assert gymnasium.__version__ == "0.29.1", gymnasium.__version__'
# The training test needs torch and skips itself; the contract and failure tests run.
"$venv/bin/python" -m pytest tests/test_cleanrl_vector_env.py tests/test_cleanrl_failures.py tests/test_cleanrl_training.py -q
