"""The local backend's inline worker: the last block of envs runs in the learner's process.

Results stay exactly DummyVecEnv's and SyncVectorEnv's (identical PPO parameters: in
test_sb3_contract.py); failures, Ctrl-C and close behave as with worker processes, except what
sharing the learner's process rules out (timeouts, policy copies).
"""

from __future__ import annotations

import functools
import os

import gymnasium as gym
import numpy as np
import pytest

from clusterenv_core import EnvError, EnvPool
from tests.envs import (
    FailingEnv,
    SameInfoDictEnv,
    SlowCartPole,
    StateInInfoEnv,
    cartpole_with_statistics,
    make_dict_env,
)
from tests.helpers import interrupt_at_events, run_and_compare, run_side_by_side

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


def _failing_cartpole(fail_at: int):
    return FailingEnv(gym.make("CartPole-v1"), fail_at=fail_at)


def test_results_match_dummy_vec_env():
    pytest.importorskip("stable_baselines3")
    for env_fns in ([make_dict_env] * 5, [CARTPOLE] * 4):
        run_side_by_side(env_fns, steps=600, inline_worker=True)


def test_results_match_sync_vector_env():
    from clusterenv_cleanrl import ClusterVectorEnv

    env_fns = [cartpole_with_statistics] * 4
    sync = gym.vector.SyncVectorEnv(env_fns)
    with ClusterVectorEnv(env_fns, num_workers=2, inline_worker=True) as cluster:
        counts = run_and_compare(cluster, sync, 500, seed=1)
    sync.close()
    assert counts["terminated"] > 10, counts


def _cartpole_knowing_its_process():
    env = gym.make("CartPole-v1")
    env.unwrapped.built_in = os.getpid()
    return env


def test_the_last_block_runs_in_the_learners_process(no_leaks):
    with EnvPool([_cartpole_knowing_its_process] * 5, num_workers=2, backend_options={"inline_worker": True}) as pool:
        assert pool.worker_pids[1] == os.getpid() != pool.worker_pids[0]
        assert list(pool.blocks[1]) == [3, 4]
        assert pool.get_attr("built_in") == [pool.worker_pids[0]] * 3 + [os.getpid()] * 2


def test_infos_are_copies_not_the_envs_own_objects(no_leaks):
    """An info kept from one step stays as it was returned when the env changes its state at the
    next steps, as with DummyVecEnv (which deep-copies infos) and worker processes (which pickle them)."""
    with EnvPool([StateInInfoEnv] * 2, num_workers=2, backend_options={"inline_worker": True}) as pool:
        pool.reset(seeds=[0, 1])
        kept = pool.step(np.zeros(2, np.int64)).infos
        as_returned = {index: {key: value.copy() for key, value in info.items()} for index, info in kept.items()}
        pool.step(np.zeros(2, np.int64))
        pool.step(np.zeros(2, np.int64))
    assert set(kept) == {0, 1}
    for index in kept:
        np.testing.assert_array_equal(kept[index]["position"], as_returned[index]["position"])
        assert kept[index]["position"].tolist() == [1.0, 1.0]


def test_plain_infos_are_copies_too(no_leaks):
    """Infos of plain values only take a shorter way than pickle, and are still copies: an env that
    returns one dict at every step, changed in place, leaves each step's info as it was."""
    with EnvPool([SameInfoDictEnv] * 2, num_workers=2, backend_options={"inline_worker": True}) as pool:
        pool.reset(seeds=[0, 1])
        infos = [pool.step(np.zeros(2, np.int64)).infos for _ in range(3)]
    for step, step_infos in enumerate(infos, start=1):
        for index in (0, 1):
            assert step_infos[index] == {"steps": step, "speed": step / 2}
            assert type(step_infos[index]["speed"]) is np.float64


def test_a_failing_inline_env_names_env_and_worker_and_the_pool_lives_on(no_leaks):
    env_fns = [CARTPOLE] * 3 + [functools.partial(_failing_cartpole, fail_at=2)]
    pool = EnvPool(env_fns, num_workers=2, backend_options={"inline_worker": True})
    pool.reset(seeds=[0, 1, 2, 3])
    actions = np.zeros(4, dtype=np.int64)
    pool.step(actions)
    with pytest.raises(EnvError) as caught:
        pool.step(actions)
    error = caught.value
    assert (error.env_index, error.worker_index) == (3, 1)
    assert "injected failure at step 2" in str(error)
    assert "in step" in error.remote_traceback
    pool.reset()
    pool.step(actions)
    pool.close()


def test_ctrl_c_during_the_inline_step_interrupts_the_wait_not_the_env(no_leaks, tmp_path):
    # Steps of 1 s, interrupted once both began: the inline env finishes its step, then the
    # learner's wait raises, and the step stays pending as with worker processes.
    stepping = str(tmp_path / "stepping")
    env_fns = [functools.partial(SlowCartPole, seconds=1.0, stepping=stepping)] * 2
    pool = EnvPool(env_fns, num_workers=2, backend_options={"inline_worker": True})
    pool.reset(seeds=[0, 1])
    actions = np.zeros(2, dtype=np.int64)
    interrupt_at_events(stepping, 2)
    with pytest.raises(KeyboardInterrupt):
        pool.step(actions)
    result = pool.step_wait()
    assert result.rewards.tolist() == [1.0, 1.0]
    assert not result.infos  # no env was taken for failed
    pool.step(actions)
    pool.close()


def test_worker_side_inference_is_refused_clearly(no_leaks):
    torch = pytest.importorskip("torch")
    from tests.policies import LinearPolicy

    with EnvPool.make("CartPole-v1", 4, num_workers=2, backend_options={"inline_worker": True}) as pool:
        threads = torch.get_num_threads()
        with pytest.raises(ValueError, match="inline_worker"):
            pool.deploy(LinearPolicy(), seed=0)
        assert torch.get_num_threads() == threads
        pool.reset()


def test_bad_option_is_rejected_before_start(no_leaks):
    with pytest.raises(ValueError, match="inline_worker must be a bool"):
        EnvPool.make("CartPole-v1", 2, backend_options={"inline_worker": "yes"})
