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
from tests.envs import FailingEnv, SameInfoDictEnv, SlowCartPole, StateInInfoEnv, make_dict_env
from tests.interrupts import interrupt_soon
from tests.test_failures import no_leaks  # noqa: F401  (fixture)

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


def _cartpole_with_statistics():
    return gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1"))


def _failing_cartpole(fail_at: int):
    return FailingEnv(gym.make("CartPole-v1"), fail_at=fail_at)


def test_results_match_dummy_vec_env():
    pytest.importorskip("stable_baselines3")
    from tests.test_sb3_contract import run_side_by_side

    for env_fns in ([make_dict_env] * 5, [CARTPOLE] * 4):
        run_side_by_side(env_fns, steps=600, inline_worker=True)


def test_results_match_sync_vector_env():
    from clusterenv_cleanrl import ClusterVectorEnv
    from tests.test_cleanrl_vector_env import run_and_compare

    env_fns = [_cartpole_with_statistics] * 4
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


def test_ctrl_c_during_the_inline_step_interrupts_the_wait_not_the_env(no_leaks):
    # Steps of 1 s, interrupted after 0.1 s: the inline env finishes its step, then the learner's
    # wait raises, and the step stays pending as with worker processes.
    pool = EnvPool([functools.partial(SlowCartPole, seconds=1.0)] * 2, num_workers=2, backend_options={"inline_worker": True})
    pool.reset(seeds=[0, 1])
    actions = np.zeros(2, dtype=np.int64)
    interrupt_soon(0.1)
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



def test_asynchronous_batches_give_each_env_its_own_trajectory():
    from tests.test_async_batches import check_trajectories_match_envs_alone

    check_trajectories_match_envs_alone(4, recvs=150, backend_options={"inline_worker": True})


@pytest.fixture
def inline_vector_env(monkeypatch):
    """test_cleanrl_vector_env's checks, run with an inline worker."""
    from clusterenv_cleanrl import ClusterVectorEnv
    from tests import test_cleanrl_vector_env as checks

    monkeypatch.setattr(checks, "ClusterVectorEnv", functools.partial(ClusterVectorEnv, inline_worker=True))
    return checks


def test_spaces_without_buffers_and_copy_semantics(inline_vector_env):
    # The inline block's observations and infos are the envs' own objects, not unpickled copies:
    # what reaches the caller must still be what SyncVectorEnv gives, copies where it copies.
    checks = inline_vector_env
    mode = checks.MODES[0]
    checks.test_spaces_without_buffers(checks.TextObsEnv, mode)
    for pair in ("graph obs", "text actions", "nested obs, dict actions"):
        checks.test_more_spaces(pair, mode)
    checks.test_final_observation_is_the_envs_own_dict()
    for copy in (True, False):
        checks.test_copy_semantics(copy)
