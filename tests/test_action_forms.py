"""Every action form the baselines accept reaches each env exactly as the baseline delivers it.

SB3's ``DummyVecEnv`` steps env ``i`` with ``actions[i]`` (a list of dicts for a ``Dict`` space);
gymnasium's ``SyncVectorEnv`` splits a batch with ``gymnasium.vector.utils.iterate``. The envs echo
their action in the info, so comparing infos compares what each env received.
"""

from __future__ import annotations

import functools
import itertools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from clusterenv_cleanrl import ClusterVectorEnv
from tests.envs import ActionDtypeEnv, Coin, EchoActionEnv
from tests.helpers import assert_same

NUM_ENVS = 3
GYMNASIUM_1 = int(gym.__version__.split(".")[0]) >= 1

ACTION_SPACES = {
    "box": spaces.Box(-1.0, 1.0, (2,), np.float32),
    "discrete": spaces.Discrete(4, start=1),
    "multi_discrete": spaces.MultiDiscrete([2, 3]),
    "multi_binary": spaces.MultiBinary(3),
    "dict": spaces.Dict({"move": spaces.Box(-1.0, 1.0, (2,), np.float32), "pick": spaces.Discrete(3)}),
    "tuple": spaces.Tuple((spaces.Discrete(2), spaces.MultiBinary(2))),
    "nested": spaces.Dict({"a": spaces.Tuple((spaces.Discrete(2), spaces.Box(0, 1, (), np.float64))), "b": spaces.Discrete(5)}),
    "text": spaces.Text(4),
    "tuple_with_text": spaces.Tuple((spaces.Discrete(3), spaces.Text(3))),
    "dict_with_sequence": spaces.Dict({"n": spaces.Discrete(2), "s": spaces.Sequence(spaces.Discrete(4))}),
    "tuple_with_graph": spaces.Tuple(
        (spaces.Graph(spaces.Box(0, 1, (2,), np.float32), spaces.Discrete(2)), spaces.Box(-1, 1, (1,), np.float32))
    ),
    "custom": Coin(),
    "dict_with_custom": spaces.Dict({"coin": Coin(), "k": spaces.Discrete(2)}),
}


def _env_fns(name: str) -> list:
    return [functools.partial(EchoActionEnv, ACTION_SPACES[name])] * NUM_ENVS


def _step_both_with_sampled_batches(name: str, steps: int, batch_of=lambda sample: sample, env_fns=None) -> None:
    """ClusterVectorEnv and SyncVectorEnv stepped with ``batch_of`` each sampled batch: the same results."""
    env_fns = env_fns or _env_fns(name)
    sync = gym.vector.SyncVectorEnv(env_fns)
    cluster = ClusterVectorEnv(env_fns, num_workers=2)
    with cluster:
        assert_same(cluster.reset(seed=1), sync.reset(seed=1), "reset")
        sync.action_space.seed(2)
        for step in range(steps):
            actions = batch_of(sync.action_space.sample())
            assert_same(cluster.step(actions), sync.step(actions), f"step {step}")
    sync.close()


@pytest.mark.parametrize("name", list(ACTION_SPACES))
def test_vector_env_splits_batches_as_sync_vector_env(name):
    _step_both_with_sampled_batches(name, 12)


# Batches of another dtype than the space's, every other step: envs get the batch's dtype, as from
# the baselines (SB3's PPO sends float32 actions for an int8 MultiBinary space).
OTHER_DTYPES = {
    "box": np.float64,
    "discrete": np.int32,
    "multi_discrete": np.float32,
    "multi_binary": np.float32,
    "tuple": np.bool_,
}


def _alternately_as(dtype):
    """Every other batch cast to ``dtype``, leaf by leaf."""
    count = itertools.count()
    return lambda batch: _cast_leaves(batch, dtype) if next(count) % 2 else batch


def _cast_leaves(batch, dtype):
    if isinstance(batch, tuple):
        return tuple(_cast_leaves(item, dtype) for item in batch)
    return np.asarray(batch).astype(dtype)


@pytest.mark.parametrize("name", list(OTHER_DTYPES))
def test_vector_env_hands_actions_on_in_the_batchs_dtype(name):
    env_fns = [functools.partial(EchoActionEnv, ACTION_SPACES[name], check_action=False)] * NUM_ENVS
    _step_both_with_sampled_batches(name, 8, _alternately_as(OTHER_DTYPES[name]), env_fns)


def _dtypes_received(result) -> list[str]:
    return [result.infos[index]["dtype"] for index in sorted(result.infos)]


def test_ctrl_c_while_workers_are_told_a_new_dtype(monkeypatch):
    # The workers may have switched when Ctrl-C lands: the pool must not take them for unchanged.
    from clusterenv_core import EnvPool, protocol

    with EnvPool([functools.partial(ActionDtypeEnv, spaces.Box(-1.0, 1.0, (1,), np.float32))] * 2, num_workers=2) as pool:
        pool.reset()
        transport = pool._transport
        recv = transport.recv

        def interrupted_recv(worker, timeout):
            if pool._channel.awaited(worker) is protocol.ActionDtypes and not interrupted_recv.done:
                interrupted_recv.done = True
                raise KeyboardInterrupt
            return recv(worker, timeout)

        interrupted_recv.done = False
        monkeypatch.setattr(transport, "recv", interrupted_recv)
        with pytest.raises(KeyboardInterrupt):
            pool.step(np.zeros((2, 1), np.float64))
        assert _dtypes_received(pool.step(np.zeros((2, 1), np.float32))) == ["float32", "float32"]


def test_asynchronous_batches_hand_on_the_spaces_dtypes_whatever_came_before():
    from clusterenv_core import EnvPool

    env_fns = [functools.partial(ActionDtypeEnv, spaces.Box(-1.0, 1.0, (1,), np.float32))] * 2
    with EnvPool(env_fns, num_workers=2, autoreset_mode="next_step") as pool:
        batches = pool.async_batches(2)
        batches.reset()
        env_ids = batches.recv().env_ids.copy()
        for _ in range(2):  # a synchronous step in float64 (an evaluation, say) between two batches
            batches.send(np.zeros((2, 1), np.float64), env_ids)
            assert _dtypes_received(batches.recv()) == ["float32", "float32"]
            assert _dtypes_received(pool.step(np.zeros((2, 1), np.float64))) == ["float64", "float64"]


def _with_extra_entries(space: spaces.Space, batch):
    if isinstance(space, spaces.Dict):
        return {**{key: _with_extra_entries(space[key], value) for key, value in batch.items()}, "logp": np.zeros(NUM_ENVS)}
    if isinstance(space, spaces.Tuple):
        return (*(_with_extra_entries(sub, item) for sub, item in zip(space, batch)), np.zeros(NUM_ENVS))
    return batch


@pytest.mark.parametrize("name", ["dict", "tuple", "nested"])
def test_vector_env_ignores_batch_entries_beyond_the_space_as_sync_vector_env(name):
    # A Dict batch with a key, or a Tuple batch with an item, that the space does not have.
    _step_both_with_sampled_batches(name, 4, functools.partial(_with_extra_entries, ACTION_SPACES[name]))


@pytest.mark.parametrize("name", ["box", "discrete", "dict", "tuple", "text", "tuple_with_text", "custom"])
def test_vector_env_raises_the_exception_types_of_sync_vector_env(name):
    """A scalar, or a batch for the wrong number of envs, raises exactly the type SyncVectorEnv
    raises; ours raise before any env steps, so the pool stays in step with a baseline that saw no
    bad action."""
    env_fns = _env_fns(name)
    space = ACTION_SPACES[name]
    short = gym.vector.utils.batch_space(space, NUM_ENVS - 1)
    short.seed(3)
    bad_actions = {"scalar": 0 if isinstance(space, (spaces.Box, spaces.Discrete, spaces.Dict)) else None}
    if GYMNASIUM_1:  # gymnasium 0.29's SyncVectorEnv steps as many envs as there are actions
        bad_actions["too few"] = short.sample()
    raised = {}
    for label, bad in bad_actions.items():
        sync = gym.vector.SyncVectorEnv(env_fns)
        sync.reset(seed=0)
        with pytest.raises(Exception) as expected:
            sync.step(bad)
        raised[label] = expected.type
        sync.close()
    sync = gym.vector.SyncVectorEnv(env_fns)
    with ClusterVectorEnv(env_fns, num_workers=2) as cluster:
        assert_same(cluster.reset(seed=0), sync.reset(seed=0))
        for label, bad in bad_actions.items():
            with pytest.raises(Exception) as got:
                cluster.step(bad)
            assert got.type is raised[label], f"{label}: {got.type.__name__} ({got.value}), SyncVectorEnv raises {raised[label].__name__}"
        sync.action_space.seed(4)
        actions = sync.action_space.sample()
        assert_same(cluster.step(actions), sync.step(actions), "the step after the refused ones")
    sync.close()


def _sb3_vec_envs():
    """SB3's DummyVecEnv and ClusterVecEnv (the SB3 tests skip where SB3 is not installed)."""
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.vec_env import DummyVecEnv

    from clusterenv_sb3 import ClusterVecEnv

    return DummyVecEnv, ClusterVecEnv


def _step_dummy_and_cluster(env_fns: list, steps: int, actions_at) -> None:
    """DummyVecEnv and ClusterVecEnv stepped with ``actions_at(step)``: the same results."""
    DummyVecEnv, ClusterVecEnv = _sb3_vec_envs()
    dummy, cluster = DummyVecEnv(env_fns), ClusterVecEnv(env_fns, num_workers=2)
    try:
        dummy.seed(6)
        cluster.seed(6)
        assert_same(cluster.reset(), dummy.reset(), "reset")
        for step in range(steps):
            actions = actions_at(step)
            for label, got, want in zip(("obs", "rewards", "dones", "infos"), cluster.step(actions), dummy.step(actions)):
                assert_same(got, want, f"{label} at step {step}")
    finally:
        dummy.close()
        cluster.close()


@pytest.mark.parametrize("name", ["box", "discrete", "multi_discrete", "multi_binary"])
def test_vec_env_hands_actions_on_in_the_batchs_dtype(name):
    space = ACTION_SPACES[name]
    space.seed(5)

    def actions_at(step: int) -> np.ndarray:
        actions = np.stack([space.sample() for _ in range(NUM_ENVS)])
        return actions.astype(OTHER_DTYPES[name]) if step % 2 else actions

    env_fns = [functools.partial(EchoActionEnv, space, check_action=False)] * NUM_ENVS
    _step_dummy_and_cluster(env_fns, 8, actions_at)


@pytest.mark.parametrize("name", list(ACTION_SPACES))
def test_vec_env_takes_per_env_actions_as_dummy_vec_env(name):
    space = ACTION_SPACES[name]
    space.seed(5)

    def actions_at(step: int) -> list | np.ndarray:
        per_env = [_without_0d_arrays(space.sample()) for _ in range(NUM_ENVS)]
        # One-array spaces also come as one stacked array (what SB3's algorithms pass).
        forms = [per_env, np.stack(per_env)] if isinstance(space, (spaces.Box, spaces.Discrete)) else [per_env]
        return forms[step % len(forms)]

    _step_dummy_and_cluster(_env_fns(name), 12, actions_at)


def _without_0d_arrays(value):
    """``value`` with 0-d arrays as numpy scalars. DummyVecEnv hands each env the very object it was
    given; ClusterEnv hands over numpy values read from the action batch, and a 0-d leaf reads as a
    scalar (as SyncVectorEnv's ``iterate`` yields it)."""
    if isinstance(value, dict):
        return {key: _without_0d_arrays(item) for key, item in value.items()}
    if type(value) is tuple:
        return tuple(_without_0d_arrays(item) for item in value)
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value[()]
    return value


def test_vec_env_refuses_bad_per_env_actions_before_sending():
    env_fns = _env_fns("dict")
    space = ACTION_SPACES["dict"]
    space.seed(7)
    _, ClusterVecEnv = _sb3_vec_envs()
    with ClusterVecEnv(env_fns, num_workers=2) as cluster:
        cluster.reset()
        good = [space.sample() for _ in range(NUM_ENVS)]
        for bad, error in (
            (good[:2], ValueError),
            (good[0], TypeError),
            ([good[0], good[1], {"move": good[2]["move"]}], ValueError),
            ([good[0], good[1], (1, 2)], TypeError),
            ([good[0], good[1], {"move": np.zeros(3, np.float32), "pick": 1}], ValueError),
        ):
            with pytest.raises(error):
                cluster.step(bad)
        _, rewards, _, infos = cluster.step(good)
        assert rewards.tolist() == [1.0] * NUM_ENVS  # the first step any env took
        assert_same([info["action"] for info in infos], good)
