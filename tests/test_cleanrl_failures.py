"""Failure behaviour through ``ClusterVectorEnv``: remote exceptions, lost workers, bad actions, closing.

Runs on gymnasium 1.x and 0.29 alike, without torch or SB3.
"""

from __future__ import annotations

import functools
import os
import signal

import gymnasium as gym
import numpy as np
import psutil
import pytest

from clusterenv_cleanrl import ClusterEnvError, ClusterVectorEnv, EnvError, WorkerLostError
from clusterenv_cleanrl.vector_env import GYMNASIUM_1
from tests.envs import FailingEnv, SuicidalEnv, make_cartpole
from tests.helpers import assert_same

pytestmark = pytest.mark.timeout(60)

NUM_ENVS = 4
NUM_WORKERS = 2  # env 3 is on worker 1


def failing_cartpole(fail_at: int) -> gym.Env:
    return FailingEnv(gym.make("CartPole-v1"), fail_at=fail_at)


def suicidal_cartpole(die_at: int) -> gym.Env:
    return SuicidalEnv(gym.make("CartPole-v1"), die_at=die_at)


def assert_no_children_left(pids: list[int]) -> None:
    children = {child.pid for child in psutil.Process().children(recursive=True)}
    assert not children & set(pids), f"worker processes {children & set(pids)} are still alive"


def step_until_error(env: ClusterVectorEnv, max_steps: int = 50) -> None:
    env.reset(seed=0)
    for _ in range(max_steps):
        env.step(np.ones(env.num_envs, dtype=np.int64))


def test_remote_exception_names_env_worker_and_traceback():
    env_fns = [make_cartpole] * 3 + [functools.partial(failing_cartpole, fail_at=5)]
    env = ClusterVectorEnv(env_fns, num_workers=NUM_WORKERS, timeout=20)
    pids = env.pool.worker_pids
    with pytest.raises(EnvError) as raised:
        step_until_error(env)
    error = raised.value
    assert isinstance(error, ClusterEnvError)
    assert error.env_index == 3
    assert error.worker_index == 1
    assert error.exc_type == "builtins.ValueError"
    assert "injected failure at step 5" in error.remote_traceback
    assert "Traceback" in error.remote_traceback and "in step" in error.remote_traceback
    assert "env 3 on worker 1" in str(error)
    env.close()
    assert env.closed
    assert_no_children_left(pids)


def test_opt_in_env_restart_ends_the_episode_truncated():
    env_fns = [make_cartpole] * 3 + [functools.partial(failing_cartpole, fail_at=5)]
    with ClusterVectorEnv(env_fns, num_workers=NUM_WORKERS, restart_failed_envs=True) as env:
        env.reset(seed=0)
        for _ in range(5):
            _, rewards, terminations, truncations, infos = env.step(np.ones(NUM_ENVS, dtype=np.int64))
        assert truncations[3] and not terminations[3] and rewards[3] == 0.0
        if GYMNASIUM_1:  # next-step autoreset: the reason is in this step's infos
            assert infos["_clusterenv_restart"].tolist() == [False, False, False, True]
            reason = infos["clusterenv_restart"][3]
        else:  # same-step autoreset: in the final info of the ended episode
            assert infos["_final_info"][3]
            reason = infos["final_info"][3]["clusterenv_restart"]
        assert "injected failure at step 5" in reason
        assert env.pool.restarts == {"envs": 1, "workers": 0}
        for _ in range(3):
            env.step(np.ones(NUM_ENVS, dtype=np.int64))


@pytest.mark.parametrize("how", ["env kills itself", "SIGKILL from outside"])
def test_lost_worker(how):
    if how == "env kills itself":
        env_fns = [functools.partial(suicidal_cartpole, die_at=3)] + [make_cartpole] * (NUM_ENVS - 1)
    else:
        env_fns = [make_cartpole] * NUM_ENVS
    env = ClusterVectorEnv(env_fns, num_workers=NUM_WORKERS, timeout=20)
    pids = env.pool.worker_pids
    env.reset(seed=0)
    if how == "SIGKILL from outside":
        os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerLostError, match="SIGKILL"):
        for _ in range(5):
            env.step(np.zeros(NUM_ENVS, dtype=np.int64))
    # The pool is unusable from then on, and says why.
    with pytest.raises(ClusterEnvError, match="unusable"):
        env.step(np.zeros(NUM_ENVS, dtype=np.int64))
    env.close()
    assert_no_children_left(pids)


def test_wrong_actions_are_refused_before_anything_is_sent():
    env_fns = [make_cartpole] * NUM_ENVS
    env = ClusterVectorEnv(env_fns, num_workers=NUM_WORKERS)
    sync = gym.vector.SyncVectorEnv(env_fns)
    rng = np.random.default_rng(0)
    with env:
        assert_same(env.reset(seed=0), sync.reset(seed=0))
        for step in range(30):
            for bad in (np.zeros(NUM_ENVS - 1, dtype=np.int64), np.zeros((NUM_ENVS, 2)), np.full(NUM_ENVS, 0.5)):
                with pytest.raises(ValueError):
                    env.step(bad)
            # No env moved: the envs still agree with a SyncVectorEnv that saw only the good actions.
            actions = rng.integers(0, 2, NUM_ENVS)
            assert_same(env.step(actions), sync.step(actions), f"step {step}")
    sync.close()


def test_close_is_idempotent_and_leaves_no_process():
    env = ClusterVectorEnv([make_cartpole] * NUM_ENVS, num_workers=NUM_WORKERS)
    pids = env.pool.worker_pids
    assert len(pids) == NUM_WORKERS and all(psutil.pid_exists(pid) for pid in pids)
    env.reset(seed=0)
    env.step(np.zeros(NUM_ENVS, dtype=np.int64))
    env.close()
    env.close()
    assert env.closed
    assert_no_children_left(pids)
    with pytest.raises(ClusterEnvError, match="closed"):
        env.reset()
