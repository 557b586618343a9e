"""Asynchronous batches (``EnvPool.async_batches``, ``clusterenv_cleanrl.ClusterEnvPool``).

Each env's own trajectory must be what the env gives stepped alone, whatever order the envs finish
in; a full batch must be exactly ``SyncVectorEnv`` in next-step mode; no env may starve; bad env ids
fail before anything is sent. The ``check_*`` functions also run on the MPI backend
(``tests/mpi_scripts/async_batches.py``, from ``tests/test_mpi_backend.py``).
"""

from __future__ import annotations

import functools
import re
import time

import gymnasium as gym
import numpy as np
import pytest

from clusterenv_cleanrl import ClusterEnvPool
from clusterenv_core import ClusterEnvError, EnvError, EnvPool, WorkerLostError, WorkerTimeoutError
from tests.envs import (
    CallCounter,
    FailingEnv,
    HangingEnv,
    JitteryEnv,
    OneStepEnv,
    ResetFailingEnv,
    ResetKeywordsEnv,
    SlowCartPole,
    SuicidalEnv,
    make_dict_env,
)
from tests.helpers import assert_same, interrupt_at_events

GYMNASIUM_1 = int(gym.__version__.split(".")[0]) >= 1


def jittery_dict_env(max_seconds: float = 2e-3) -> gym.Env:
    return JitteryEnv(make_dict_env(max_episode_steps=7), max_seconds)


def replay_alone(env_fn, seed: int, actions: list) -> list[tuple]:
    """What one env returns for ``actions`` when stepped by itself with next-step autoreset:
    (obs, reward, terminated, truncated, info) after the first reset and after each action."""
    env = env_fn()
    obs, info = env.reset(seed=seed)
    results = [(obs, 0.0, False, False, info)]
    done = False
    for action in actions:
        if done:
            obs, info = env.reset()
            results.append((obs, 0.0, False, False, info))
            done = False
        else:
            obs, reward, terminated, truncated, info = env.step(action)
            results.append((obs, float(reward), bool(terminated), bool(truncated), info))
            done = terminated or truncated
    env.close()
    return results


def check_trajectories_match_envs_alone(batch_size: int, recvs: int = 300, **pool_kwargs) -> None:
    """8 envs on 2 workers finishing in random order: every env's returned results equal the env alone."""
    num_envs = 8
    pool = EnvPool([jittery_dict_env] * num_envs, num_workers=2, autoreset_mode="next_step", **pool_kwargs)
    rng = np.random.default_rng(1)
    seen: list[list[tuple]] = [[] for _ in range(num_envs)]
    sent: list[list] = [[] for _ in range(num_envs)]
    try:
        batches = pool.async_batches(batch_size)
        batches.reset(seeds=list(range(num_envs)))
        for _ in range(recvs):
            result = batches.recv()
            assert list(result.env_ids) == sorted(set(result.env_ids.tolist())) and len(result.env_ids) == batch_size
            for position, env in enumerate(result.env_ids.tolist()):
                obs = {key: value[position].copy() for key, value in result.obs.items()}
                seen[env].append(
                    (
                        obs,
                        float(result.rewards[position]),
                        bool(result.terminated[position]),
                        bool(result.truncated[position]),
                        result.infos.get(env, {}),
                    )
                )
            actions = rng.uniform(-1.0, 1.0, size=(batch_size, 2)).astype(np.float32)
            batches.send(actions, result.env_ids)
            for env, action in zip(result.env_ids.tolist(), actions):
                sent[env].append(action)
    finally:
        pool.close()
    for env in range(num_envs):
        assert len(seen[env]) > 10, f"env {env} returned only {len(seen[env])} times"
        expected = replay_alone(make_dict_env_7, env, sent[env][: len(seen[env]) - 1])
        for step, (got, want) in enumerate(zip(seen[env], expected)):
            for name, left, right in zip(("obs", "reward", "terminated", "truncated", "info"), got, want):
                assert_same(left, right, f"env {env}, result {step}, {name}")


make_dict_env_7 = functools.partial(make_dict_env, max_episode_steps=7)


@pytest.mark.parametrize("batch_size", [4, 2, 8])
def test_each_envs_trajectory_is_the_env_alone(batch_size):
    check_trajectories_match_envs_alone(batch_size)


def test_each_envs_trajectory_is_the_env_alone_with_an_inline_worker():
    check_trajectories_match_envs_alone(4, recvs=150, backend_options={"inline_worker": True})


def check_full_batch_is_sync_vector_env(steps: int = 300, **options) -> None:
    """``ClusterEnvPool`` with ``batch_size == num_envs`` against ``SyncVectorEnv`` in next-step mode."""
    env_fns = [jittery_dict_env] * 4
    envs = ClusterEnvPool(env_fns, batch_size=4, seed=3, num_workers=2, **options)
    sync = gym.vector.SyncVectorEnv(
        [make_dict_env_7] * 4, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP
    )
    try:
        obs, infos = envs.reset()
        sync_obs, sync_infos = sync.reset(seed=[3, 4, 5, 6])
        assert_same(obs, sync_obs, "reset obs")
        assert np.array_equal(infos.pop("env_id"), np.arange(4))
        assert_same(infos, sync_infos, "reset infos")
        rng = np.random.default_rng(0)
        for step in range(steps):
            actions = rng.uniform(-1.0, 1.0, size=(4, 2)).astype(np.float32)
            got = envs.step(actions)
            want = sync.step(actions)
            assert np.array_equal(got[4].pop("env_id"), np.arange(4))
            for name, left, right in zip(("obs", "rewards", "terminations", "truncations", "infos"), got, want):
                assert_same(left, right, f"step {step} {name}")
                if name in ("rewards", "terminations", "truncations"):
                    assert left.dtype == right.dtype, (name, left.dtype, right.dtype)
    finally:
        envs.close()
        sync.close()


@pytest.mark.skipif(not GYMNASIUM_1, reason="next-step autoreset is gymnasium 1.x's SyncVectorEnv")
def test_full_batch_is_sync_vector_env_in_next_step_mode():
    check_full_batch_is_sync_vector_env()


def check_no_env_starves(recvs: int = 150, **pool_kwargs) -> None:
    """Worker 1's envs step 20x slower than worker 0's; batches of one block: every env keeps coming."""
    fast = functools.partial(SlowCartPole, 2e-4)
    slow = functools.partial(SlowCartPole, 4e-3)
    pool = EnvPool([fast] * 4 + [slow] * 4, num_workers=2, autoreset_mode="next_step", **pool_kwargs)
    last_seen = np.zeros(8, dtype=np.int64)
    longest_gap = np.zeros(8, dtype=np.int64)
    counts = np.zeros(8, dtype=np.int64)
    try:
        batches = pool.async_batches(4)
        batches.reset(seeds=list(range(8)))
        for index in range(1, recvs + 1):
            result = batches.recv()
            ids = result.env_ids
            longest_gap[ids] = np.maximum(longest_gap[ids], index - last_seen[ids])
            last_seen[ids] = index
            counts[ids] += 1
            batches.send(np.zeros(4, dtype=np.int64), ids)
    finally:
        pool.close()
    # While the slow block steps once (16 ms), the fast one steps about 20 times: the slow block is
    # returned as soon as it is in, so it comes back within about 21 recvs, never later.
    assert counts[:4].sum() > counts[4:].sum() > 0, counts
    assert longest_gap.max() <= 60, longest_gap
    assert np.all(counts[4:] >= recvs // 60), counts


def test_no_env_starves_behind_a_fast_worker():
    check_no_env_starves()


@pytest.fixture
def pool():
    pool = EnvPool.make("CartPole-v1", 8, num_workers=2, autoreset_mode="next_step")
    yield pool
    pool.close()


@pytest.fixture
def batches(pool):
    batches = pool.async_batches(4)
    batches.reset(seeds=list(range(8)))
    return batches


@pytest.mark.parametrize(
    "env_ids, message",
    [
        ([0, 1, 2, 9], "env id 9 is out of range"),
        ([-1, 0, 1, 2], "env id -1 is out of range"),
        ([0, 1, 1, 2], "env id 1 is given more than once"),
        ([4, 5, 6, 7], "env 4 has not been returned by recv"),
        ([], "non-empty 1-d sequence of ints"),
        ([[0, 1], [2, 3]], "non-empty 1-d sequence of ints"),
        ([0.0, 1.0, 2.0, 3.0], "non-empty 1-d sequence of ints"),
    ],
)
def test_bad_env_ids_are_value_errors_before_anything_is_sent(batches, env_ids, message):
    result = batches.recv()
    assert list(result.env_ids) == [0, 1, 2, 3]
    actions = np.zeros(max(len(env_ids), 1), dtype=np.int64)
    with pytest.raises(ValueError, match=message):
        batches.send(actions[: len(env_ids)] if env_ids else actions[:0], env_ids)
    assert not batches.stepping  # nothing was sent
    batches.send(np.zeros(4, dtype=np.int64), result.env_ids)  # the right ids still work
    assert batches.stepping


def test_actions_twice_and_wrong_actions_are_value_errors(batches):
    result = batches.recv()
    batches.send(np.zeros(2, dtype=np.int64), [0, 1])
    with pytest.raises(ValueError, match="env 1 has its action already"):
        batches.send(np.zeros(2, dtype=np.int64), [1, 2])
    with pytest.raises(ValueError):
        batches.send(np.zeros(3, dtype=np.int64), [2, 3])  # 3 actions for 2 envs
    with pytest.raises(ValueError):
        batches.send(np.array([0.0, 0.5]), [2, 3])  # fractional for Discrete(2)
    assert not batches.stepping
    batches.send(np.zeros(2, dtype=np.int64), [2, 3])
    assert batches.stepping
    assert list(result.env_ids) == [0, 1, 2, 3]


def test_recv_that_cannot_be_answered_raises_instead_of_waiting(batches):
    batches.recv()
    batches.recv()  # both blocks returned, no actions sent
    with pytest.raises(ClusterEnvError, match="wait for actions"):
        batches.recv()


def test_pool_calls_wait_until_no_worker_steps(pool, batches):
    result = batches.recv()
    batches.send(np.zeros(4, dtype=np.int64), result.env_ids)
    with pytest.raises(ClusterEnvError, match="asynchronous steps are pending"):
        pool.get_attr("spec")
    assert list(batches.recv().env_ids) == [4, 5, 6, 7]  # ready since the reset
    assert list(batches.recv().env_ids) == [0, 1, 2, 3]  # worker 0's step
    assert len(pool.get_attr("spec")) == 8  # nothing stepping: the pool answers again


def test_reset_of_returned_envs_while_others_step():
    envs = ClusterEnvPool(env_id="CartPole-v1", num_envs=8, batch_size=4, seed=0, num_workers=2)
    try:
        envs.async_reset()
        _, _, _, _, info = envs.recv()
        assert info["env_id"].dtype == np.int32 and list(info["env_id"]) == [0, 1, 2, 3]
        envs.send(np.zeros(4, dtype=np.int64), info["env_id"])  # worker 0 steps
        _, _, _, _, info = envs.recv()
        assert list(info["env_id"]) == [4, 5, 6, 7]
        reset_obs, reset_info = envs.reset(np.array([4, 5]))  # worker 1 is idle: envs 4 and 5 reset
        assert list(reset_info["env_id"]) == [4, 5] and reset_obs.shape == (2, 4)
        envs.send(np.ones(4, dtype=np.int64), [4, 5, 6, 7])
        while True:
            obs, rewards, _, _, info = envs.recv()
            if 4 in info["env_id"]:
                break
            envs.send(np.zeros(4, dtype=np.int64), info["env_id"])
        # Env 4 stepped from its new reset state: CartPole's dynamics from that state, pushed right.
        alone = gym.make("CartPole-v1")
        alone.reset(seed=0)
        alone.unwrapped.state = reset_obs[0].astype(np.float64)
        expected = alone.step(1)[0]
        assert np.array_equal(obs[list(info["env_id"]).index(4)], expected)
    finally:
        envs.close()
    assert envs.closed


def test_envs_reset_with_the_keywords_sync_vector_env_passes():
    """``ClusterEnvPool`` resets as the installed gymnasium's ``SyncVectorEnv.reset`` resets (1.x:
    ``seed=`` and ``options=`` always; 0.29: each only when not ``None``): seeded the first time,
    unseeded after, and envs reset by id as by an unseeded reset."""
    envs = ClusterEnvPool([ResetKeywordsEnv] * 4, batch_size=2, seed=3, num_workers=2)
    sync = gym.vector.SyncVectorEnv([ResetKeywordsEnv] * 4)
    try:
        for sync_kwargs in ({"seed": [3, 4, 5, 6]}, {}):
            _, infos = envs.reset()
            _, sync_infos = sync.reset(**sync_kwargs)
            assert_same(infos["reset_keywords"], sync_infos["reset_keywords"][:2], f"reset like reset({sync_kwargs})")
        _, infos = envs.reset(np.array([0, 1]))  # the envs the last recv returned
        assert_same(infos["reset_keywords"], sync_infos["reset_keywords"][:2], "reset of envs 0 and 1")
    finally:
        envs.close()
        sync.close()


def check_reset_envs_leaves_the_rest_of_the_block_as_reset(**pool_kwargs) -> None:
    """After a step that ended every episode (reward 1, terminated), ``reset`` then ``reset_envs`` of
    one env: the other env of its block, still to be returned, shows its reset (reward 0, no flags).
    On MPI the worker's stale rows of the ended step came back with the reset of its neighbour."""
    with EnvPool([OneStepEnv] * 4, num_workers=2, autoreset_mode="next_step", **pool_kwargs) as pool:
        batches = pool.async_batches(1)
        batches.reset()
        for _ in range(4):
            batches.send(np.zeros(1, dtype=np.int64), batches.recv().env_ids)
        for _ in range(4):
            ended = batches.recv()  # recv reuses its arrays: checked one by one
            assert (ended.rewards[0], ended.terminated[0]) == (1.0, True)
        batches.reset()
        first = batches.recv()
        assert list(first.env_ids) == [0]
        batches.reset_envs(first.env_ids)
        second = batches.recv()
        assert list(second.env_ids) == [1]
        assert (second.rewards[0], second.terminated[0], second.truncated[0]) == (0.0, False, False)


def test_reset_envs_leaves_the_rest_of_the_block_as_reset():
    check_reset_envs_leaves_the_rest_of_the_block_as_reset()


def test_env_error_names_the_env_and_its_block_waits_for_actions():
    env_fns = [functools.partial(gym.make, "CartPole-v1")] * 3
    env_fns.append(lambda: FailingEnv(gym.make("CartPole-v1"), fail_at=3))
    pool = EnvPool(env_fns, num_workers=2, autoreset_mode="next_step")
    try:
        batches = pool.async_batches(2)
        batches.reset(seeds=[0, 1, 2, 3])
        # Worker 0 may step many times while worker 1 formats its error's traceback: bounded by
        # time, not by a count of recvs.
        started = time.monotonic()
        with pytest.raises(EnvError, match="env 3") as caught:
            while time.monotonic() - started < 10.0:
                result = batches.recv()
                batches.send(np.zeros(2, dtype=np.int64), result.env_ids)
        assert "injected failure" in str(caught.value)
        # The failed block's envs wait for actions again; the pool goes on.
        batches.send(np.zeros(2, dtype=np.int64), [2, 3])
        ids = set()
        started = time.monotonic()
        while ids != {0, 1, 2, 3} and time.monotonic() - started < 10.0:
            result = batches.recv()
            ids.update(result.env_ids.tolist())
            batches.send(np.zeros(2, dtype=np.int64), result.env_ids)
        assert ids == {0, 1, 2, 3}
    finally:
        pool.close()


def check_lost_or_stuck_worker_is_reported(fault: str, lost_within: float = 0.5, **pool_kwargs) -> None:
    wrap = (lambda env: SuicidalEnv(env, die_at=4)) if fault == "dies" else (lambda env: HangingEnv(env, hang_at=4))
    env_fns = [functools.partial(gym.make, "CartPole-v1")] * 2 + [lambda: wrap(gym.make("CartPole-v1"))] * 2
    pool = EnvPool(env_fns, num_workers=2, autoreset_mode="next_step", timeout=2.0, **pool_kwargs)
    try:
        batches = pool.async_batches(2)
        batches.reset(seeds=[0, 1, 2, 3])
        # Worker 1's envs fail at their 4th step, within milliseconds; worker 0's keep the batches
        # full, yet the stuck worker is reported within the timeout (the lost one at once).
        started = time.monotonic()
        with pytest.raises(WorkerLostError if fault == "dies" else WorkerTimeoutError) as caught:
            while time.monotonic() - started < 10.0:
                result = batches.recv()
                batches.send(np.zeros(2, dtype=np.int64), result.env_ids)
        assert time.monotonic() - started < (lost_within if fault == "dies" else 2.0 + 0.5)
        if fault == "hangs":  # named as a synchronous step names it: its process and envs
            assert re.search(r"worker 1 \((pid|MPI rank) .*envs 2-3\) did not answer within 2 s", str(caught.value))
        with pytest.raises(ClusterEnvError, match="unusable"):
            batches.recv()
    finally:
        pool.close()


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_lost_or_stuck_worker_is_reported_within_the_timeout(fault):
    check_lost_or_stuck_worker_is_reported(fault)


def check_reply_left_unread_is_no_timeout(**pool_kwargs) -> None:
    """The learner trains for longer than the timeout between recvs: the worker answered long ago."""
    with EnvPool.make("CartPole-v1", 8, num_workers=2, autoreset_mode="next_step", timeout=1.0, **pool_kwargs) as pool:
        batches = pool.async_batches(4)
        batches.reset(seeds=list(range(8)))
        batches.send(np.zeros(4, dtype=np.int64), batches.recv().env_ids)  # worker 0 steps, answers at once
        time.sleep(1.5)
        assert list(batches.recv().env_ids) == [4, 5, 6, 7]
        assert list(batches.recv().env_ids) == [0, 1, 2, 3]


def test_a_reply_left_unread_longer_than_the_timeout_is_no_timeout():
    check_reply_left_unread_is_no_timeout()


def test_restarted_worker_ends_its_episodes_truncated():
    env_fns = [functools.partial(gym.make, "CartPole-v1")] * 2 + [
        lambda: SuicidalEnv(gym.make("CartPole-v1"), die_at=4)
    ] * 2
    pool = EnvPool(env_fns, num_workers=2, autoreset_mode="next_step", restart_failed_workers=True, max_restarts=1)
    try:
        batches = pool.async_batches(2)
        batches.reset(seeds=[0, 1, 2, 3])
        restarted = None
        deadline = time.monotonic() + 30.0  # bounded in time: worker 0 may come back many times first
        while time.monotonic() < deadline:
            result = batches.recv()
            if 2 in result.env_ids and "clusterenv_restart" in result.infos.get(2, {}):
                restarted = result
                break
            batches.send(np.zeros(2, dtype=np.int64), result.env_ids)
        assert restarted is not None and pool.restarts["workers"] == 1
        assert restarted.truncated.all() and not restarted.terminated.any()
    finally:
        pool.close()


def test_a_worker_lost_in_a_reset_step_resets_its_ended_envs():
    # Envs 0 and 1 end their episodes at step 3; worker 0 dies in the reset of step 4. The
    # replacement gives them that reset step (no second end of the episodes that ended).
    env_fns = [functools.partial(ResetFailingEnv, fail_at=2, kill=True)] + [functools.partial(ResetFailingEnv, fail_at=0)] * 3
    with EnvPool(env_fns, num_workers=2, autoreset_mode="next_step", restart_failed_workers=True) as pool:
        batches = pool.async_batches(2)
        batches.reset(seeds=[0, 1, 2, 3])
        steps = -1  # the first recv returns the reset
        while True:
            result = batches.recv()
            if 0 in result.env_ids:
                steps += 1
                if steps == 4:
                    break
                if steps == 3:
                    assert result.terminated.all()
            batches.send(np.zeros(2, dtype=np.int64), result.env_ids)
        assert pool.restarts["workers"] == 1 and "clusterenv_restart" in result.infos[0]
        assert not result.truncated.any() and not result.terminated.any() and not result.rewards.any()
        np.testing.assert_array_equal(result.obs, [[1.0, 0.0], [1.0, 0.0]])


def test_a_call_interrupted_between_batches_is_answered_before_the_next_step(tmp_path):
    # Its reply comes first on the worker's connection: read as the step's, every later reply was one behind.
    sleeping = str(tmp_path / "sleeping")
    with EnvPool([lambda: CallCounter(gym.make("CartPole-v1"))] * 2, num_workers=1, autoreset_mode="next_step") as pool:
        batches = pool.async_batches(2)
        batches.reset(seeds=[0, 1])
        result = batches.recv()
        interrupt_at_events(sleeping, 1)  # Ctrl-C while the env is inside the call
        with pytest.raises(KeyboardInterrupt):
            pool.call("sleep_then_bump", (1.0, sleeping), indices=[0])
        batches.send(np.zeros(2, np.int64), result.env_ids)
        assert batches.recv().rewards.tolist() == [1.0, 1.0]
        assert pool.get_attr("calls") == [1, 0]


def test_replaced_envs_are_counted():
    env_fns = [functools.partial(gym.make, "CartPole-v1"), lambda: FailingEnv(gym.make("CartPole-v1"), fail_at=3)]
    with EnvPool(env_fns, num_workers=1, autoreset_mode="next_step", restart_failed_envs=True) as pool:
        batches = pool.async_batches(2)
        batches.reset(seeds=[0, 1])
        for _ in range(3):
            result = batches.recv()
            batches.send(np.zeros(2, dtype=np.int64), result.env_ids)
        result = batches.recv()
        assert "injected failure at step 3" in result.infos[1]["clusterenv_restart"]
        assert pool.restarts == {"envs": 1, "workers": 0} and pool.env_restarts == [0, 1]


def test_batches_need_next_step_autoreset_and_buffered_spaces():
    with EnvPool.make("CartPole-v1", 2, num_workers=1) as pool:
        with pytest.raises(ValueError, match="autoreset_mode='next_step'"):
            pool.async_batches(1)
    with EnvPool.make("CartPole-v1", 2, num_workers=1, autoreset_mode="next_step") as pool:
        with pytest.raises(ValueError, match="batch_size must be at most num_envs=2"):
            pool.async_batches(3)
        batches = pool.async_batches(2)
        with pytest.raises(ClusterEnvError, match="recv before reset"):
            batches.recv()


@pytest.mark.parametrize(
    "num_envs, num_workers, batch_size, fits",
    [
        (6, 2, 1, True),  # a divisor of every block
        (6, 2, 3, True),  # one whole block
        (6, 2, 6, True),  # all the envs
        (10, 3, 1, True),  # blocks 4/3/3: only 1 and 10 fit
        (10, 3, 10, True),
        (6, 2, 5, False),  # these left envs that no batch returns
        (6, 2, 4, False),
        (10, 3, 9, False),
        (10, 3, 3, False),
    ],
)
def test_batch_sizes_that_could_strand_envs_are_refused(num_envs, num_workers, batch_size, fits):
    make = functools.partial(
        ClusterEnvPool, env_id="CartPole-v1", num_envs=num_envs, batch_size=batch_size, seed=1, num_workers=num_workers
    )
    if not fits:
        with pytest.raises(ValueError, match=f"batch_size={batch_size} does not fit the workers' blocks"):
            make()
        return
    envs = make()
    try:
        envs.async_reset()
        rng = np.random.default_rng(0)
        for _ in range(30):  # the pattern EnvPool's users write: act on the batch that came
            *_, info = envs.recv()
            env_ids = rng.permutation(info["env_id"])
            envs.send(rng.integers(0, 2, len(env_ids)), env_ids)
    finally:
        envs.close()
