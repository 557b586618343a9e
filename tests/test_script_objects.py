"""Objects a user's script defines (a config class, a function, a wrapper class) reach the envs
through reset options, ``set_attr``, ``call`` / ``env_method`` and ``env_is_wrapped`` as they reach
them in SyncVectorEnv and DummyVecEnv, though workers never import the script.

The script runs as a user runs it (``tests/scripts/user_objects.py``, a fresh interpreter whose
``__main__`` is the script).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "user_objects.py")


@pytest.mark.parametrize("backend", ["local", pytest.param("mpi", marks=pytest.mark.slow)])
def test_objects_of_the_users_script_reach_the_envs(backend):
    pytest.importorskip("stable_baselines3")
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    result = subprocess.run([sys.executable, SCRIPT, backend], cwd="/", capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "OK vector" in output and "OK sb3" in output, output
