"""A differential fuzzer: random spaces, episodes, infos, seeds, options and action forms, run side by
side through ClusterEnv and the single-process baselines, which must agree at every step.

CI runs a few examples of each property (``CLUSTERENV_FUZZ_EXAMPLES``, default 12, the same ones
every run); a longer run explores new examples each time:

    CLUSTERENV_FUZZ_EXAMPLES=300 python -m pytest tests/test_fuzz.py -q

The MPI backend runs the same properties in a spawned job, with flat ranks and with node agents
(``tests/mpi_scripts/fuzz.py``, from ``tests/test_mpi_backend.py``). Whatever the fuzzer finds is
fixed and kept as a regression test.
"""

from __future__ import annotations

import functools
import os

import gymnasium as gym
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from gymnasium import spaces  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from clusterenv_cleanrl import ClusterVectorEnv  # noqa: E402
from tests.envs import FuzzEnv  # noqa: E402
from tests.helpers import assert_same  # noqa: E402

GYMNASIUM_1 = int(gym.__version__.split(".")[0]) >= 1
EXAMPLES = int(os.environ.get("CLUSTERENV_FUZZ_EXAMPLES", "12"))
STEPS = 30
# The same examples on every CI run; a longer run (examples given) explores new ones each time.
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize="CLUSTERENV_FUZZ_EXAMPLES" not in os.environ,
    database=None,
)

# -- spaces ---------------------------------------------------------------------------------------

SHAPES = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
BOX_DTYPES = st.sampled_from([np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64])


def _box(shape: tuple, dtype: type) -> spaces.Box:
    if np.dtype(dtype).kind == "u":
        return spaces.Box(0, 9, shape, dtype)
    return spaces.Box(-5, 5, shape, dtype)


LEAVES = st.one_of(
    st.builds(_box, SHAPES, BOX_DTYPES),
    st.builds(spaces.Discrete, st.integers(1, 5), start=st.integers(-3, 3)),
    st.builds(spaces.MultiDiscrete, st.lists(st.integers(1, 4), min_size=1, max_size=3)),
    st.builds(spaces.MultiBinary, st.integers(1, 4)),
)
UNBUFFERED = st.one_of(
    st.builds(spaces.Text, max_length=st.integers(1, 4)),
    st.builds(spaces.Sequence, st.builds(_box, st.just((2,)), st.just(np.float32))),
    st.just(spaces.Graph(spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(3))),
)


def _nested(leaves: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3).map(spaces.Dict),
            st.lists(children, min_size=1, max_size=3).map(lambda items: spaces.Tuple(tuple(items))),
        ),
        max_leaves=4,
    )


OBSERVATION_SPACES = _nested(st.one_of(LEAVES, LEAVES, LEAVES, UNBUFFERED))
# Sequence and Graph actions have no fixed batch form in SB3 (DummyVecEnv passes them as given).
ACTION_SPACES = _nested(st.one_of(LEAVES, LEAVES, st.builds(spaces.Text, max_length=st.integers(1, 3))))

# SB3's DummyVecEnv holds observations in arrays: leaf spaces, or one level of Dict/Tuple of them.
SB3_OBSERVATION_SPACES = st.one_of(
    LEAVES,
    st.dictionaries(st.sampled_from("abcd"), LEAVES, min_size=1, max_size=3).map(spaces.Dict),
    st.lists(LEAVES, min_size=1, max_size=3).map(lambda items: spaces.Tuple(tuple(items))),
)


def _scenarios(observation_spaces: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {
            "observation_space": observation_spaces,
            "action_space": ACTION_SPACES,
            "terminate_p": st.sampled_from([0.0, 0.05, 0.3]),
            "max_steps": st.integers(1, 12),
            "info_kind": st.sampled_from(FuzzEnv.INFO_KINDS),
            "num_envs": st.integers(1, 4),
            "num_workers": st.integers(1, 2),
            "seed": st.integers(0, 2**16),
        }
    )


SCENARIOS = _scenarios(OBSERVATION_SPACES)
SB3_SCENARIOS = _scenarios(SB3_OBSERVATION_SPACES)


def _env_fns(scenario: dict) -> list:
    make = functools.partial(
        FuzzEnv,
        scenario["observation_space"],
        scenario["action_space"],
        scenario["terminate_p"],
        scenario["max_steps"],
        scenario["info_kind"],
    )
    return [make] * scenario["num_envs"]


def _workers(scenario: dict) -> int:
    return min(scenario["num_workers"], scenario["num_envs"])


# -- properties -----------------------------------------------------------------------------------


def same_outcome(actual_call, expected_call, what: str):
    """Call both: identical results, or the same exception type from both. Returns the baseline's
    result, or ``None`` after an exception (the two may then have moved differently: stop there)."""
    try:
        expected = expected_call()
    except Exception as error:
        with pytest.raises(type(error)):
            actual_call()
        return None
    assert_same(actual_call(), expected, what)
    return expected


def check_vec_env(scenario: dict, backend: str = "local", processes_per_worker: int = 1) -> None:
    """ClusterVecEnv and DummyVecEnv: the same results, step by step, for per-env actions."""
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.vec_env import DummyVecEnv

    from clusterenv_sb3 import ClusterVecEnv

    env_fns = _env_fns(scenario)
    dummy = DummyVecEnv(env_fns)
    cluster = ClusterVecEnv(
        env_fns, backend=backend, num_workers=_workers(scenario), processes_per_worker=processes_per_worker
    )
    try:
        for venv in (dummy, cluster):
            venv.seed(scenario["seed"])
            venv.set_options({"level": scenario["seed"] % 3})
        if same_outcome(cluster.reset, dummy.reset, "reset") is None:
            return
        assert_same(cluster.reset_infos, dummy.reset_infos, "reset_infos")
        space = scenario["action_space"]
        space.seed(scenario["seed"])
        one_array = isinstance(space, (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary))
        for t in range(STEPS):
            actions = [space.sample() for _ in range(dummy.num_envs)]
            if one_array and t % 2:  # what SB3's algorithms pass: one array
                actions = np.stack(actions)
            if same_outcome(lambda: cluster.step(actions), lambda: dummy.step(actions), f"step {t}") is None:
                return
            assert_same(cluster.reset_infos, dummy.reset_infos, f"reset_infos at step {t}")
    finally:
        dummy.close()
        cluster.close()


def check_vector_env(
    scenario: dict, autoreset_mode: str | None, backend: str = "local", processes_per_worker: int = 1
) -> None:
    """ClusterVectorEnv and SyncVectorEnv: the same results, step by step, for batched actions
    (gymnasium 1.x: every autoreset mode; DISABLED resets the ended envs with a mask)."""
    env_fns = _env_fns(scenario)
    kwargs = {} if autoreset_mode is None else {"autoreset_mode": gym.vector.AutoresetMode(autoreset_mode)}
    sync = gym.vector.SyncVectorEnv(env_fns, **kwargs)
    cluster = ClusterVectorEnv(
        env_fns, backend=backend, num_workers=_workers(scenario), processes_per_worker=processes_per_worker, **kwargs
    )
    try:
        seed, options = scenario["seed"], {"level": scenario["seed"] % 3}
        if same_outcome(
            lambda: cluster.reset(seed=seed, options=dict(options)),
            lambda: sync.reset(seed=seed, options=dict(options)),
            "reset",
        ) is None:
            return
        sync.action_space.seed(seed)
        ended = np.zeros(sync.num_envs, dtype=bool)
        for t in range(STEPS):
            if autoreset_mode == "Disabled" and ended.any():
                mask = ended.copy()
                if same_outcome(
                    lambda: cluster.reset(options={"reset_mask": mask.copy()}),
                    lambda: sync.reset(options={"reset_mask": mask.copy()}),
                    f"partial reset before step {t}",
                ) is None:
                    return
            actions = sync.action_space.sample()
            result = same_outcome(lambda: cluster.step(actions), lambda: sync.step(actions), f"step {t}")
            if result is None:
                return
            ended = result[2] | result[3]
    finally:
        sync.close()
        cluster.close()


AUTORESET_MODES = ["NextStep", "SameStep", "Disabled"] if GYMNASIUM_1 else [None]


@FUZZ
@given(SB3_SCENARIOS)
def test_vec_env_agrees_with_dummy_vec_env(scenario):
    check_vec_env(scenario)


@pytest.mark.parametrize("autoreset_mode", AUTORESET_MODES)
def test_vector_env_agrees_with_sync_vector_env(autoreset_mode):
    @FUZZ
    @given(SCENARIOS)
    def check(scenario):
        check_vector_env(scenario, autoreset_mode)

    check()


# Node agents (processes_per_worker): scenarios whose every block has two envs or more, each agent
# stepping its block on two local processes.
def _agent_blocks(scenario: dict) -> bool:
    return scenario["num_envs"] // _workers(scenario) >= 2


SB3_AGENT_SCENARIOS = SB3_SCENARIOS.filter(_agent_blocks)
AGENT_SCENARIOS = SCENARIOS.filter(_agent_blocks)


@pytest.mark.slow
@FUZZ
@given(SB3_AGENT_SCENARIOS)
def test_vec_env_through_node_agents_agrees_with_dummy_vec_env(scenario):
    check_vec_env(scenario, processes_per_worker=2)


@pytest.mark.slow
@pytest.mark.parametrize("autoreset_mode", AUTORESET_MODES)
def test_vector_env_through_node_agents_agrees_with_sync_vector_env(autoreset_mode):
    @FUZZ
    @given(AGENT_SCENARIOS)
    def check(scenario):
        check_vector_env(scenario, autoreset_mode, processes_per_worker=2)

    check()
