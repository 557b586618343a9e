"""Env ids registered in the learner build on the workers exactly as ``gym.make`` builds them there.

A user's script is run as a user runs it (``tests/scripts/user_registrations.py``, a fresh
interpreter whose ``__main__`` is the script), on the local backend and in every MPI launch mode.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import threading
import types

import gymnasium as gym
import numpy as np
import psutil
import pytest

from clusterenv_core import EnvError, EnvPool
from tests.envs import SpacesEnv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "user_registrations.py")
SB3_CHECKS = ["main_class", "module_string", "main_string"]


LOCAL_CHECKS = (SB3_CHECKS if importlib.util.find_spec("stable_baselines3") else []) + ["vector", "override"]


def run_script(*args: str, timeout: float = 300.0) -> str:
    # From another directory, as a user runs their script: only the script's own folder is on its path.
    result = subprocess.run(
        [sys.executable, SCRIPT, *args], cwd="/", capture_output=True, text=True, timeout=timeout
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


@pytest.mark.slow
def test_script_registrations_reach_local_workers():
    output = run_script("local", *LOCAL_CHECKS)
    for check in LOCAL_CHECKS:
        assert f"OK {check}" in output, output


@pytest.mark.slow
def test_script_running_as_a_spawn_or_forkserver_child_reaches_local_workers():
    # A multiprocessing child has the script as __mp_main__, which cloudpickle would send by reference.
    output = run_script("local", "in_child")
    assert "OK in_child" in output, output


@pytest.mark.slow
def test_ids_an_env_package_registers_on_import_build_without_warnings():
    pytest.importorskip("ale_py")
    output = run_script("local", "ale")
    assert "OK ale" in output, output
    # Workers import ale_py before installing the learner's specs, so its registrations never collide.
    assert "Overriding environment" not in output, output


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, check",
    [("spawn", "main_class"), ("mpmd", "main_class"), ("spmd", "main_class"), ("mpmd", "module_string"), ("mpmd", "main_string")],
)
def test_script_registrations_reach_mpi_ranks(mode, check):
    pytest.importorskip("mpi4py")
    pytest.importorskip("stable_baselines3")
    from tests.helpers import assert_exit_codes, launch

    code, output, _ = launch(mode, SCRIPT, "mpi", check)
    assert code == 0 and f"OK {check}" in output, output
    if mode != "spawn":
        assert_exit_codes(output, "0,0,0")


# -- in this process ------------------------------------------------------------------------------


@pytest.fixture
def registered():
    """Ids registered by a test, removed again afterwards."""
    ids: list[str] = []
    yield ids
    for env_id in ids:
        gym.registry.pop(env_id, None)


def _spaces_env(size: int = 2) -> gym.Env:
    return SpacesEnv(gym.spaces.Box(-1, 1, (size,), np.float32), gym.spaces.Discrete(2))


def test_kwargs_and_spec_fields_are_those_of_the_learner(registered):
    gym.register("TestSpaces-v3", entry_point=_spaces_env, max_episode_steps=4, kwargs={"size": 5}, reward_threshold=2.5)
    registered.append("TestSpaces-v3")
    with EnvPool.make("TestSpaces-v3", 2, num_workers=2) as pool:
        assert pool.observation_space.shape == (5,)
        assert pool.get_attr("spec") == [gym.spec("TestSpaces-v3")] * 2
        pool.reset(seeds=[0, 1])
        for _ in range(3):
            assert not pool.step(np.zeros(2, np.int64)).truncated.any()
        assert pool.step(np.zeros(2, np.int64)).truncated.all()  # max_episode_steps reached the workers


def test_unpicklable_spec_is_named_before_anything_starts(registered):
    lock = threading.Lock()
    gym.register("TestLocked-v0", entry_point=_spaces_env, kwargs={"size": 2, "lock": lock})
    registered.append("TestLocked-v0")
    children = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="'TestLocked-v0' registered in this process cannot be shipped"):
        EnvPool.make("CartPole-v1", 2, num_workers=2)
    assert {child.pid for child in psutil.Process().children(recursive=True)} == children


def test_spec_a_worker_cannot_rebuild_fails_only_the_pool_that_uses_it(registered, monkeypatch):
    # The entry point lives in a module that exists in the learner only, so it is pickled by
    # reference and cannot be unpickled on a worker.
    def make(**kwargs):
        return _spaces_env(**kwargs)

    make.__module__, make.__qualname__ = "learner_only_envs", "make"
    module = types.ModuleType("learner_only_envs")
    module.make = make
    monkeypatch.setitem(sys.modules, "learner_only_envs", module)
    gym.register("TestLearnerOnly-v0", entry_point=make)
    registered.append("TestLearnerOnly-v0")
    with EnvPool.make("CartPole-v1", 2, num_workers=2) as pool:  # does not use it: unaffected
        pool.reset(seeds=[0, 1])
    with pytest.raises(EnvError, match="creating the env failed in env 0") as caught:
        EnvPool([functools.partial(gym.make, "TestLearnerOnly-v0")] * 2, num_workers=2)
    assert "'TestLearnerOnly-v0' is registered in the learner, but its spec could not be rebuilt" in str(caught.value)
    assert "learner_only_envs" in str(caught.value)
