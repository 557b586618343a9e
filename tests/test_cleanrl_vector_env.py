"""Contract tests of ``clusterenv_cleanrl.ClusterVectorEnv``: step for step what ``SyncVectorEnv`` returns.

Every test runs the same envs, seeds and actions through a ``ClusterVectorEnv`` and a
``SyncVectorEnv`` and compares the results exactly (values, dtypes, container types). They pass on
gymnasium 1.x (all three autoreset modes) and on gymnasium 0.29 (same-step autoreset with
``final_observation``/``final_info``); ``.ci/gym029.sh`` runs them on 0.29. No torch or SB3 here.
"""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from clusterenv_cleanrl import ClusterVectorEnv
from clusterenv_cleanrl.batched_infos import numeric_infos
from clusterenv_cleanrl.vector_env import GYMNASIUM_1
from clusterenv_core import EnvError
from tests.envs import (
    InPlaceStateEnv,
    IntFlagsEnv,
    MaskedObsEnv,
    ResetKeywordsEnv,
    SameReprKey,
    SeedOnlyResetEnv,
    SpacesEnv,
    cartpole_with_statistics,
    make_dict_env,
)
from tests.helpers import assert_same, assert_same_results, random_actions, run_and_compare

pytestmark = pytest.mark.timeout(120)

NUM_ENVS = 4
NUM_WORKERS = 2
STEPS = 2000

# Autoreset modes to compare; gymnasium 0.29 has only its same-step autoreset (no keyword).
MODES = ["NextStep", "SameStep", "Disabled"] if GYMNASIUM_1 else [None]


# Episodes of 40 steps: many truncations in a short run.
short_cartpole = functools.partial(cartpole_with_statistics, max_episode_steps=40)


def make_int_flags_cartpole() -> gym.Env:
    return IntFlagsEnv(gym.make("CartPole-v1", max_episode_steps=30))


class TextObsEnv(gym.Env):
    """Text observations (a space without buffers), discrete actions, termination and truncation."""

    def __init__(self) -> None:
        self.observation_space = spaces.Text(max_length=6, charset="abcdef")
        self.action_space = spaces.Discrete(3)
        self.steps = 0

    def _obs(self) -> str:
        return "".join(self.np_random.choice(list("abcdef"), size=int(self.np_random.integers(1, 7))))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return self._obs(), {"length": 0}

    def step(self, action):
        self.steps += 1
        terminated = bool(self.np_random.random() < 0.1)
        return self._obs(), float(action), terminated, self.steps >= 8, {"action": int(action)}


class SequenceObsEnv(TextObsEnv):
    """Variable-length sequences of vectors as observations."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = spaces.Sequence(spaces.Box(-1.0, 1.0, (2,), np.float32))

    def _obs(self) -> tuple:
        length = int(self.np_random.integers(0, 4))
        return tuple(self.np_random.uniform(-1, 1, 2).astype(np.float32) for _ in range(length))


def mode_kwargs(mode: str | None) -> dict:
    return {} if mode is None else {"autoreset_mode": mode}


def make_pair(env_fns: list, mode: str | None = None, **kwargs) -> tuple[ClusterVectorEnv, gym.vector.VectorEnv]:
    cluster = ClusterVectorEnv(env_fns, num_workers=NUM_WORKERS, timeout=30, **mode_kwargs(mode), **kwargs)
    sync = gym.vector.SyncVectorEnv(env_fns, **mode_kwargs(mode), **kwargs)
    return cluster, sync


@pytest.mark.parametrize("mode", MODES)
def test_cartpole_with_episode_statistics(mode):
    env_fns = [short_cartpole] * NUM_ENVS
    cluster, sync = make_pair(env_fns, mode)
    with cluster:
        counts = run_and_compare(cluster, sync, STEPS, seed=1)
    sync.close()
    assert counts["terminated"] > 50 and counts["truncated"] > 5, counts


@pytest.mark.parametrize("mode", MODES)
def test_flags_returned_as_ints_or_0d_arrays(mode):
    env_fns = [make_int_flags_cartpole] * NUM_ENVS
    cluster, sync = make_pair(env_fns, mode)
    with cluster:
        counts = run_and_compare(cluster, sync, 400, seed=3)
    sync.close()
    assert counts["terminated"] > 5 and counts["truncated"] > 5, counts


@pytest.mark.parametrize("mode", MODES)
def test_final_observation_of_an_env_that_resets_its_array_in_place(mode):
    # SyncVectorEnv keeps the env's own array as the final observation and then resets the env,
    # which zeroes that array: in same-step autoreset the final observations it returns are zeros.
    cluster, sync = make_pair([InPlaceStateEnv] * NUM_ENVS, mode)
    with cluster:
        counts = run_and_compare(cluster, sync, 30, seed=4)
    sync.close()
    assert counts["truncated"] > 10, counts


@pytest.mark.parametrize("mode", ["SameStep"] if GYMNASIUM_1 else [None])
def test_final_observation_of_an_ndarray_subclass_keeps_its_type(mode):
    # SyncVectorEnv's final observations are the env's own objects: here masked arrays.
    cluster, sync = make_pair([MaskedObsEnv] * 2, mode)
    with cluster:
        cluster.reset(seed=0)
        sync.reset(seed=0)
        actual, expected = cluster.step(np.zeros(2, np.int64))[4], sync.step(np.zeros(2, np.int64))[4]
        key = "final_obs" if GYMNASIUM_1 else "final_observation"
        for index in range(2):
            assert type(actual[key][index]) is type(expected[key][index]) is np.ma.MaskedArray
            np.testing.assert_array_equal(actual[key][index].mask, expected[key][index].mask)
    sync.close()


@pytest.mark.parametrize("mode", MODES)
def test_dict_observations_continuous_actions(mode):
    env_fns = [make_dict_env] * NUM_ENVS
    cluster, sync = make_pair(env_fns, mode)
    with cluster:
        counts = run_and_compare(cluster, sync, STEPS, seed=2)
    sync.close()
    assert counts["terminated"] > 50 and counts["truncated"] > 50, counts


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("env_class", [TextObsEnv, SequenceObsEnv])
def test_spaces_without_buffers(env_class, mode):
    cluster, sync = make_pair([env_class] * NUM_ENVS, mode)
    with cluster:
        assert isinstance(cluster.pool.reset().obs, list)  # the pickled path, not buffers
        counts = run_and_compare(cluster, sync, 300, seed=3)
    sync.close()
    assert counts["terminated"] > 10 and counts["truncated"] > 10, counts


SPACE_PAIRS = {
    "tuple obs": (spaces.Tuple((spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(3))), spaces.Discrete(2)),
    "nested obs, dict actions": (
        spaces.Dict(
            {
                "a": spaces.Tuple((spaces.MultiDiscrete([2, 3]), spaces.MultiBinary(2))),
                "b": spaces.Box(0, 1, (2, 2), np.float64),
            }
        ),
        spaces.Dict({"move": spaces.Box(-1, 1, (2,), np.float32), "pick": spaces.Discrete(3)}),
    ),
    "graph obs": (spaces.Graph(spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(2)), spaces.MultiBinary(3)),
    # Leaves whose paths read alike when joined with dots ("a.b" and "a" -> "b"; "t.0" and "t" -> 0).
    "keys that read alike": (
        spaces.Dict({"a.b": spaces.Box(-1, 1, (3,), np.float32), "a": spaces.Dict({"b": spaces.Discrete(4)})}),
        spaces.Dict({"t": spaces.Tuple((spaces.Discrete(3), spaces.Discrete(5))), "t.0": spaces.Box(-1, 1, (2,), np.float32)}),
    ),
    "keys of one repr": (
        spaces.Dict({SameReprKey(1): spaces.Box(-1, 1, (3,), np.float32), SameReprKey(2): spaces.Discrete(4)}),
        spaces.Discrete(2),
    ),
    "text actions": (spaces.Box(-1, 1, (3,), np.float32), spaces.Text(4)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pair", list(SPACE_PAIRS))
def test_more_spaces(pair, mode):
    observation_space, action_space = SPACE_PAIRS[pair]
    env_fns = [functools.partial(SpacesEnv, observation_space, action_space)] * 3
    cluster, sync = make_pair(env_fns, mode)
    sync.action_space.seed(9)
    with cluster:
        disabled = GYMNASIUM_1 and mode == "Disabled"
        assert_same_results(cluster.reset(seed=9), sync.reset(seed=9), "reset")
        for step in range(40):
            actions = sync.action_space.sample()
            expected = sync.step(actions)
            assert_same_results(cluster.step(actions), expected, f"step {step}")
            if disabled and expected[2].any():
                mask = expected[2].copy()
                assert_same_results(
                    cluster.reset(options={"reset_mask": mask}), sync.reset(options={"reset_mask": mask}), "reset"
                )
    sync.close()


def test_final_observation_is_the_envs_own_dict():
    mode = "SameStep" if GYMNASIUM_1 else None
    cluster, sync = make_pair([make_dict_env] * 2, mode)
    final_key = "final_obs" if GYMNASIUM_1 else "final_observation"
    with cluster:
        cluster.reset(seed=10)
        sync.reset(seed=10)
        expected = {}
        while final_key not in expected:
            actions = np.zeros((2, 2), np.float32)
            *_, infos = cluster.step(actions)
            *_, expected = sync.step(actions)
        index = np.flatnonzero(expected[f"_{final_key}"])[0]
        # DictObsEnv's keys are not in the space's (sorted) order.
        assert list(infos[final_key][index]) == list(expected[final_key][index])
    sync.close()


def _add_info_loop(reference: gym.vector.VectorEnv, infos_by_index: dict[int, dict]) -> dict:
    infos: dict = {}
    for index in sorted(infos_by_index):
        infos = reference._add_info(infos, infos_by_index[index], index)
    return infos


def test_numeric_infos_are_batched_as_gymnasiums_add_info_batches_them():
    """The batched path for infos of numeric scalars gives what gymnasium's per-env loop gives (key
    order, dtypes, values, masks), and leaves every other kind of info to that loop."""
    reference = gym.vector.SyncVectorEnv([short_cartpole] * 5)

    def info(t: int) -> dict:
        return {
            "t": t, "x": t / 3, "ok": t % 2 == 0, "y": np.float32(t / 7), "h": np.float16(t / 5),
            "k": np.int8(-t), "u": np.uint64(2**64 - 1 - t), "z": np.float64(t * 1e300), "c": np.complex64(t + 1j),
        }

    some_envs = {0: info(1), 2: info(2), 4: info(3)}
    every_env = {index: info(index) for index in range(5)}
    other_order = {0: {"a": 1, "b": np.float32(2)}, 3: {"b": np.float32(4), "a": 3}}
    for infos_by_index in (some_envs, every_env, other_order):
        batched = numeric_infos(infos_by_index, 5)
        expected = _add_info_loop(reference, infos_by_index)
        assert batched is not None and list(batched) == list(expected)
        assert_same(batched, expected)
    # Left to the loop: a key whose type changes between envs, different keys, non-numeric values,
    # timedelta64, a key named as another key's mask, and 1.x's final_obs.
    for infos_by_index in (
        {0: {"a": 1}, 1: {"a": 1.0}},
        {0: {"a": 1}, 1: {"a": 1, "b": 2}},
        {0: {"a": np.True_}},
        {0: {"a": np.zeros(2)}},
        {0: {"a": "text"}},
        {0: {"a": np.timedelta64(3, "s")}},
        {0: {"a": 1, "_a": 2}},
        {0: {"final_obs": 1.0}},
    ):
        assert numeric_infos(infos_by_index, 5) is None, infos_by_index
    # A Python int past int64 fails both ways alike.
    for build in (lambda infos: numeric_infos(infos, 5), lambda infos: _add_info_loop(reference, infos)):
        with pytest.raises(OverflowError):
            build({0: {"n": 1}, 3: {"n": 2**64}})
    reference.close()


@pytest.mark.parametrize("copy", [True, False])
def test_copy_semantics(copy):
    """With copy=False both return observations the next step overwrites; with copy=True, neither does."""
    for env_fn in (short_cartpole, make_dict_env):
        cluster, sync = make_pair([env_fn] * 3, copy=copy)
        rng = np.random.default_rng(4)
        with cluster:
            kept = [(cluster.reset(seed=4)[0], sync.reset(seed=4)[0])]
            for _ in range(60):
                actions = random_actions(sync.action_space, rng)
                kept.append((cluster.step(actions)[0], sync.step(actions)[0]))
            for actual, expected in kept:
                assert_same(actual, expected)
        sync.close()


def test_spaces_without_buffers_and_copy_semantics_with_an_inline_worker(monkeypatch):
    # The inline block's observations and infos are the envs' own objects, not unpickled copies:
    # what reaches the caller must still be what SyncVectorEnv gives, copies where it copies.
    monkeypatch.setitem(globals(), "ClusterVectorEnv", functools.partial(ClusterVectorEnv, inline_worker=True))
    mode = MODES[0]
    test_spaces_without_buffers(TextObsEnv, mode)
    for pair in ("graph obs", "text actions", "nested obs, dict actions"):
        test_more_spaces(pair, mode)
    test_final_observation_is_the_envs_own_dict()
    for copy in (True, False):
        test_copy_semantics(copy)


def test_spaces_metadata_and_attributes():
    cluster, sync = make_pair([make_dict_env] * 3)
    with cluster:
        assert cluster.num_envs == sync.num_envs == 3
        for name in ("single_observation_space", "observation_space", "single_action_space", "action_space"):
            assert getattr(cluster, name) == getattr(sync, name), name
        assert cluster.metadata == sync.metadata
        assert cluster.metadata is not sync.metadata
        assert cluster.render_mode == sync.render_mode
        if GYMNASIUM_1:
            assert cluster.metadata["autoreset_mode"] == gym.vector.AutoresetMode.NEXT_STEP
            assert cluster.render_mode == "rgb_array"
    sync.close()


def test_seeding_and_options():
    cluster, sync = make_pair([make_dict_env] * NUM_ENVS)
    rng = np.random.default_rng(5)
    with cluster:
        for seed in (7, [3, 1, 4, 1], [10, 20, 30, 40]):
            assert_same(cluster.reset(seed=seed), sync.reset(seed=seed))
            if GYMNASIUM_1:
                expected_seeds = tuple(seed + i for i in range(NUM_ENVS)) if isinstance(seed, int) else tuple(seed)
                assert cluster.np_random_seed == sync.np_random_seed == expected_seeds
                for actual, expected in zip(cluster.np_random, sync.np_random):
                    assert actual.bit_generator.state == expected.bit_generator.state
            for _ in range(5):
                actions = random_actions(sync.action_space, rng)
                assert_same(cluster.step(actions), sync.step(actions))
        # Options reach every env (DictObsEnv puts them into its reset info).
        assert_same(cluster.reset(seed=1, options={"level": 3}), sync.reset(seed=1, options={"level": 3}))
        with pytest.raises(type(_raised(lambda: sync.reset(seed=[1, 2])))):
            cluster.reset(seed=[1, 2])
    sync.close()


def test_seeds_reach_the_envs_as_given():
    """A seed is the env's to judge, as under SyncVectorEnv: gymnasium's envs take ``True`` (an int)
    and refuse a numpy integer, and the pool stays usable after the refusal."""
    cluster, sync = make_pair([short_cartpole] * NUM_ENVS)
    with cluster:
        seeds = [True, 2, None, 0]
        cluster_obs, _ = cluster.reset(seed=seeds)
        sync_obs, _ = sync.reset(seed=seeds)
        np.testing.assert_array_equal(cluster_obs[[0, 1, 3]], sync_obs[[0, 1, 3]])
        refused = [1, np.int64(1), 2, 3]
        sync_error = _raised(lambda: sync.reset(seed=refused))
        with pytest.raises(EnvError) as raised:
            cluster.reset(seed=refused)
        assert raised.value.env_index == 1
        assert raised.value.exc_type == f"{type(sync_error).__module__}.{type(sync_error).__qualname__}"
        assert raised.value.remote_message == str(sync_error)
        assert_same(cluster.reset(seed=[4, 5, 6, 7]), sync.reset(seed=[4, 5, 6, 7]))
    sync.close()


@pytest.mark.parametrize("mode", MODES)
def test_reset_passes_the_keywords_sync_vector_env_passes(mode):
    """gymnasium 1.x's SyncVectorEnv passes ``seed=`` and ``options=`` always, 0.29's each only when
    not ``None``: the envs get the same keywords (``ResetKeywordsEnv`` says which in its reset info)
    with and without seeds and options, in partial resets, and in automatic resets (``reset()``;
    episodes truncate after 3 steps)."""
    cluster, sync = make_pair([ResetKeywordsEnv] * NUM_ENVS, mode)
    disabled = GYMNASIUM_1 and mode == "Disabled"
    rng = np.random.default_rng(0)
    with cluster:
        # Seeded first: an unseeded reset then continues each env's generator.
        resets = ({"seed": 3}, {}, {"seed": [None, 1, None, 2]}, {"options": {"level": 1}}, {"seed": 5, "options": {}})
        for kwargs in resets:
            assert_same_results(cluster.reset(**kwargs), sync.reset(**kwargs), f"reset({kwargs})")
            for step in range(4):
                actions = rng.integers(0, 2, size=NUM_ENVS)
                expected = sync.step(actions)
                assert_same_results(cluster.step(actions), expected, f"step {step} after reset({kwargs})")
                ended = expected[2] | expected[3]
                if disabled and ended.any():
                    assert_same_results(
                        cluster.reset(options={"reset_mask": ended.copy()}),
                        sync.reset(options={"reset_mask": ended.copy()}),
                        f"partial reset after step {step}",
                    )
    sync.close()


def test_an_env_whose_reset_takes_no_options_resets_where_sync_vector_env_resets_it():
    """gymnasium 0.29's SyncVectorEnv resets it unless given options; 1.x's never (it passes ``options=None``)."""
    cluster, sync = make_pair([SeedOnlyResetEnv] * NUM_ENVS)
    rng = np.random.default_rng(0)
    with cluster:
        for kwargs in ({"seed": 3}, {}, {"options": {"level": 1}}):
            if GYMNASIUM_1 or "options" in kwargs:
                for venv in (sync, cluster):
                    with pytest.raises(TypeError, match="options"):
                        venv.reset(**kwargs)
                continue
            assert_same_results(cluster.reset(**kwargs), sync.reset(**kwargs), f"reset({kwargs})")
            for step in range(4):
                actions = rng.integers(0, 2, size=NUM_ENVS)
                assert_same_results(cluster.step(actions), sync.step(actions), f"step {step} after reset({kwargs})")
    sync.close()


def _raised(call) -> BaseException:
    try:
        call()
    except BaseException as error:  # noqa: BLE001 - the test compares whatever SyncVectorEnv raises
        return error
    raise AssertionError("expected an exception")


def test_call_get_attr_set_attr_render():
    cluster, sync = make_pair([make_dict_env] * 3)
    rng = np.random.default_rng(6)
    with cluster:
        assert_same(cluster.reset(seed=6), sync.reset(seed=6))
        for _ in range(5):
            actions = random_actions(sync.action_space, rng)
            assert_same(cluster.step(actions), sync.step(actions))
        assert_same(cluster.call("render"), sync.call("render"))
        assert_same(cluster.render(), cluster.call("render"))
        if GYMNASIUM_1:
            assert_same(cluster.render(), sync.render())
        assert_same(cluster.get_attr("steps"), sync.get_attr("steps"))
        assert_same(cluster.call("get_wrapper_attr", "steps"), sync.call("get_wrapper_attr", "steps"))
        assert_same(cluster.get_attr("_max_episode_steps"), sync.get_attr("_max_episode_steps"))
        # gymnasium 1.x sets through the wrappers (the env's own counter), 0.29 on the outer wrapper:
        # either way, later steps and attributes must agree.
        for values in ([1, 2, 3], (4, 5, 6), 7):
            cluster.set_attr("steps", values)
            sync.set_attr("steps", values)
            assert_same(cluster.get_attr("steps"), sync.get_attr("steps"))
            actions = random_actions(sync.action_space, rng)
            assert_same(cluster.step(actions), sync.step(actions))
        for values in ([1, 2], (1, 2, 3, 4)):
            expected = _raised(lambda: sync.set_attr("steps", values))
            with pytest.raises(type(expected)) as raised:
                cluster.set_attr("steps", values)
            assert str(raised.value) == str(expected)
        with pytest.raises(AttributeError):
            cluster.get_attr("no_such_attribute")
    sync.close()


def test_private_attributes_are_looked_up_as_sync_vector_env_looks_them_up():
    # gymnasium 1.x finds a wrapper's private attribute through the stack; 0.29's wrappers refuse it.
    cluster, sync = make_pair([short_cartpole] * 2)
    with cluster:
        cluster.reset(seed=0)
        sync.reset(seed=0)
        try:
            expected = sync.get_attr("_elapsed_steps")
        except AttributeError as error:
            with pytest.raises(AttributeError, match="private attribute"):
                cluster.get_attr("_elapsed_steps")
            assert not GYMNASIUM_1, error
        else:
            assert cluster.get_attr("_elapsed_steps") == expected == (0, 0)
    sync.close()


@pytest.mark.skipif(not GYMNASIUM_1, reason="reset_mask and autoreset modes are gymnasium 1.x")
def test_reset_mask_validation():
    cluster, sync = make_pair([make_dict_env] * NUM_ENVS, "Disabled")
    with cluster:
        cluster.reset(seed=0)
        sync.reset(seed=0)
        bad_masks = [
            [True, False, True, False],
            np.array([True, False]),
            np.array([1, 0, 1, 0]),
            np.zeros(NUM_ENVS, dtype=bool),
        ]
        for mask in bad_masks:
            expected = _raised(lambda: sync.reset(options={"reset_mask": mask}))
            with pytest.raises(type(expected)) as raised:
                cluster.reset(options={"reset_mask": mask})
            assert str(raised.value) == str(expected)
        # reset_mask is taken out of the caller's options; the rest reaches the selected envs.
        mask = np.array([True, False, False, True])
        options_cluster, options_sync = {"reset_mask": mask, "level": 1}, {"reset_mask": mask, "level": 1}
        assert_same(cluster.reset(options=options_cluster), sync.reset(options=options_sync))
        assert options_cluster == options_sync == {"level": 1}
    sync.close()


def _cartpole_within(bound: float) -> gym.Env:
    """CartPole whose observation space says its values lie within ``bound``: same dtype and shape
    for every bound, not the same space."""
    space = spaces.Box(-bound, bound, (4,), np.float32)
    return gym.wrappers.TransformObservation(gym.make("CartPole-v1"), lambda obs: obs, space)


@pytest.mark.skipif(not GYMNASIUM_1, reason="observation_mode is gymnasium 1.x")
def test_observation_modes():
    single = spaces.Box(-5.0, 5.0, (4,), np.float32)
    custom = (gym.vector.utils.batch_space(single, 3), single)
    same_spaces = [functools.partial(gym.make, "CartPole-v1")] * 3
    differing_spaces = [functools.partial(_cartpole_within, bound) for bound in (5.0, 6.0, 7.0)]
    env_fns = same_spaces
    for observation_mode in ("different", custom):
        for fns in (same_spaces, differing_spaces):
            cluster, sync = make_pair(fns, observation_mode=observation_mode)
            with cluster:
                assert cluster.single_observation_space == sync.single_observation_space
                assert cluster.observation_space == sync.observation_space
                run_and_compare(cluster, sync, 50, seed=11)
            sync.close()
    expected = _raised(lambda: gym.vector.SyncVectorEnv(differing_spaces))
    with pytest.raises(type(expected), match="observation space"):
        ClusterVectorEnv(differing_spaces)
    for bad_mode in ("other", (single, "not a space")):
        expected = _raised(lambda: gym.vector.SyncVectorEnv(env_fns, observation_mode=bad_mode))
        with pytest.raises(type(expected)) as raised:
            ClusterVectorEnv(env_fns, observation_mode=bad_mode)
        assert str(raised.value) == str(expected)
    wrong_shape = spaces.Box(-1.0, 1.0, (3,), np.float32)
    with pytest.raises(RuntimeError, match="do not share a common shape and dtype"):
        ClusterVectorEnv(env_fns, observation_mode=(gym.vector.utils.batch_space(wrong_shape, 3), wrong_shape))


@pytest.mark.skipif(not GYMNASIUM_1, reason="autoreset modes are gymnasium 1.x")
def test_disabled_mode_refuses_to_step_an_ended_episode():
    env_fns = [functools.partial(gym.make, "CartPole-v1")] * 2
    cluster = ClusterVectorEnv(env_fns, autoreset_mode="Disabled", num_workers=2)
    with cluster:
        cluster.reset(seed=0)
        done = np.zeros(2, dtype=bool)
        while not done.any():
            _, _, terminated, truncated, _ = cluster.step(np.ones(2, dtype=np.int64))
            done = terminated | truncated
        with pytest.raises(AssertionError):
            cluster.step(np.ones(2, dtype=np.int64))
        cluster.reset(options={"reset_mask": done})
        cluster.step(np.ones(2, dtype=np.int64))


def test_is_a_vector_env_usable_by_vector_wrappers():
    cluster, sync = make_pair([functools.partial(gym.make, "CartPole-v1", max_episode_steps=40)] * 2)
    if GYMNASIUM_1:
        cluster = gym.wrappers.vector.RecordEpisodeStatistics(cluster)
        sync = gym.wrappers.vector.RecordEpisodeStatistics(sync)
    assert isinstance(cluster, gym.vector.VectorEnv)
    try:
        rng = np.random.default_rng(8)
        assert_same_results(cluster.reset(seed=8), sync.reset(seed=8), "reset")
        for step in range(200):
            actions = random_actions(sync.action_space, rng)
            assert_same_results(cluster.step(actions), sync.step(actions), f"step {step}")
    finally:
        cluster.close()
        sync.close()


# Gymnasium 1.x's vector wrappers, each over ClusterVectorEnv and over SyncVectorEnv.
VECTOR_WRAPPERS = {
    "NormalizeObservation": ("CartPole-v1", lambda env: gym.wrappers.vector.NormalizeObservation(env)),
    "NormalizeReward": ("CartPole-v1", lambda env: gym.wrappers.vector.NormalizeReward(env)),
    "ClipReward": ("CartPole-v1", lambda env: gym.wrappers.vector.ClipReward(env, -0.5, 0.5)),
    "DictInfoToList": ("CartPole-v1", lambda env: gym.wrappers.vector.DictInfoToList(env)),
    "FlattenObservation": ("CartPole-v1", lambda env: gym.wrappers.vector.FlattenObservation(env)),
    "RescaleAction+ClipAction": (
        "Pendulum-v1", lambda env: gym.wrappers.vector.ClipAction(gym.wrappers.vector.RescaleAction(env, -1.0, 1.0))
    ),
}


@pytest.mark.skipif(not GYMNASIUM_1, reason="gymnasium.wrappers.vector is gymnasium 1.x's")
@pytest.mark.parametrize("name", list(VECTOR_WRAPPERS))
def test_vector_wrappers_give_what_they_give_over_sync_vector_env(name):
    env_id, wrap = VECTOR_WRAPPERS[name]
    cluster, sync = (wrap(env) for env in make_pair([functools.partial(gym.make, env_id)] * 2))
    try:
        assert_same_results(cluster.reset(seed=5), sync.reset(seed=5), "reset")
        sync.action_space.seed(5)
        for step in range(250):  # past CartPole's first episodes and Pendulum's 200-step truncation
            actions = sync.action_space.sample()
            assert_same_results(cluster.step(actions), sync.step(actions), f"step {step}")
    finally:
        cluster.close()
        sync.close()
