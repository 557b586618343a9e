"""An env that returns what its spaces or the Gymnasium API forbid gets a named EnvError, and the
worker lives on: its other envs, and the pool, stay usable (``restart_failed_envs`` replaces it)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from clusterenv_core import EnvError, EnvPool
from clusterenv_core.protocol import RESTART_INFO_KEY
from tests.envs import MisbehavingEnv

# mode -> what the error must say (besides the env, the worker and the operation)
EXPECTED = {
    "obs_shape": r"does not fit the observation space Box\(-1\.0, 1\.0, \(3,\), float32\): obs: shape \(5,\) where the space has \(3,\)",
    # What SyncVectorEnv's batching refuses, and a numpy assignment would take by changing the data.
    "obs_scalar": r"float32\): obs: shape \(\) where the space has \(3,\)",
    "obs_rows": r"float32\): obs: shape \(1, 3\) where the space has \(3,\)",
    "obs_complex": r"float32\): obs: dtype complex64 where the space has float32",
    "obs_none": r"float32\): obs: shape \(\) where the space has \(3,\)",
    "dict_float_discrete": r"obs\['b'\]: dtype float64 where the space has int64",
    "dict_missing_key": r"keys \['a'\] where the space has \['a', 'b'\] \(missing \['b'\], extra \[\]\)",
    "dict_extra_key": r"\(missing \[\], extra \['z'\]\)",
    "reward_array": r"the reward must be one number, got ndarray float64 \(2,\)",
    "flag_not_bool": r"terminated must be a bool, got str: 'yes'",
    "step_tuple": r"step must return \(obs, reward, terminated, truncated, info\), got tuple of 4",
    "info_unpicklable": r"the info of env 1 holds, under key 'lock', lock, which cannot be pickled",
    "system_exit": r"builtins\.SystemExit: 4",
}


def _pool(mode: str, **kwargs) -> EnvPool:
    """Env 1 of 3 misbehaves at its 3rd step; envs 0 (worker 0) and 2 (worker 1) behave."""
    env_fns = [functools.partial(MisbehavingEnv, "obs_shape", bad_at=10**9)] * 3
    env_fns[1] = functools.partial(MisbehavingEnv, mode, bad_at=3)
    return EnvPool(env_fns, num_workers=2, **kwargs)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_bad_output_is_an_env_error_and_the_worker_lives_on(mode):
    if mode.startswith("dict"):
        env_fns = [functools.partial(MisbehavingEnv, "dict_extra_key", bad_at=10**9)] * 3
        env_fns[1] = functools.partial(MisbehavingEnv, mode, bad_at=3)
        pool = EnvPool(env_fns, num_workers=2)
    else:
        pool = _pool(mode)
    with pool:
        pids = pool.worker_pids
        pool.reset(seeds=[0, 1, 2])
        actions = np.zeros(3, np.int64)
        pool.step(actions)
        pool.step(actions)
        with pytest.raises(EnvError, match=EXPECTED[mode]) as caught:
            pool.step(actions)
        error = caught.value
        assert (error.env_index, error.worker_index, error.operation) == (1, 0, "step")
        assert "env 1 on worker 0" in str(error) and "Remote traceback" in str(error)
        # The worker is the same process, and every env can be reset and stepped again.
        assert pool.worker_pids == pids
        assert all(process.poll() is None for process in pool._transport.processes)
        pool.reset(seeds=[0, 1, 2])
        assert pool.step(actions).rewards.tolist() == [1.0, 1.0, 1.0]


def test_a_reset_that_returns_no_info_is_named():
    with _pool("reset_obs_only") as pool:
        with pytest.raises(EnvError, match=r"reset must return \(obs, info\), got ndarray float32 \(3,\)") as caught:
            pool.reset(options=[None, {"bad": True}, None])
        assert (caught.value.env_index, caught.value.operation) == (1, "reset")
        pool.reset()  # still usable


@pytest.mark.parametrize("mode", ["obs_shape", "reward_array", "flag_not_bool", "system_exit"])
def test_restart_failed_envs_replaces_an_env_with_bad_output(mode):
    with _pool(mode, restart_failed_envs=True) as pool:
        pool.reset(seeds=[0, 1, 2])
        actions = np.zeros(3, np.int64)
        pool.step(actions)
        pool.step(actions)
        result = pool.step(actions)
        assert result.truncated.tolist() == [False, True, False]
        assert "replaced by a new env" in result.infos[1][RESTART_INFO_KEY]
        assert pool.restarts["envs"] == 1
        assert pool.step(actions).rewards.tolist() == [1.0, 1.0, 1.0]


def test_an_unpicklable_result_of_an_env_method_is_named():
    with EnvPool([functools.partial(MisbehavingEnv, "obs_shape", bad_at=10**9)] * 3, num_workers=2) as pool:
        pool.reset()
        with pytest.raises(EnvError, match=r"the result of 'make_lock' of env 2 \(lock\) cannot be pickled to reach the learner") as caught:
            pool.call("make_lock", indices=[2])
        assert (caught.value.env_index, caught.value.worker_index, caught.value.operation) == (2, 1, "call make_lock")
        assert pool.step(np.zeros(3, np.int64)).rewards.tolist() == [1.0, 1.0, 1.0]


def test_every_kind_of_single_number_is_a_reward():
    with EnvPool([functools.partial(MisbehavingEnv, "obs_shape", bad_at=10**9)] * 3, num_workers=2) as pool:
        pool.reset()
        for reward in (0.5, 2, True, np.float32(0.25), np.int64(3), np.array(4.0)):
            pool.set_attr("reward", [reward] * 3)
            assert pool.step(np.zeros(3, np.int64)).rewards.tolist() == [float(reward)] * 3
