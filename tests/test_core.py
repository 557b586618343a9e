"""The core pool on its own: space layouts, every supported space, imports, per-env access."""

from __future__ import annotations

import functools
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import psutil
import pytest
from gymnasium import spaces

from clusterenv_core import EnvPool
from clusterenv_core.spaces import SpaceLayout
from tests.envs import ResetKeywordsEnv, SpacesEnv
from tests.helpers import assert_same

BUFFERED = {
    "box": spaces.Box(-1, 1, (2, 3), np.float32),
    "discrete": spaces.Discrete(5, start=-2),
    "multi_discrete": spaces.MultiDiscrete([3, 4, 5]),
    "multi_binary": spaces.MultiBinary(4),
    "dict": spaces.Dict({"a": spaces.Box(0, 1, (2,), np.float64), "b": spaces.Discrete(3)}),
    "tuple": spaces.Tuple((spaces.MultiBinary(2), spaces.Dict({"c": spaces.Box(-5, 5, (), np.int32)}))),
}
PICKLED = {
    "text": spaces.Text(8),
    "sequence": spaces.Sequence(spaces.Box(0, 1, (2,), np.float32)),
    "graph": spaces.Graph(spaces.Box(0, 1, (3,), np.float32), spaces.Discrete(2)),
    "dict_with_text": spaces.Dict({"a": spaces.Discrete(2), "b": spaces.Text(4)}),
}


@pytest.mark.parametrize("name", list(BUFFERED))
def test_layout_round_trip(name):
    space = BUFFERED[name]
    layout = SpaceLayout(space, "obs")
    assert layout.buffered
    arrays = [np.zeros((3, *f.shape), f.dtype) for f in layout.fields]
    space.seed(0)
    values = [space.sample() for _ in range(3)]
    for row, value in enumerate(values):
        assert layout.conforms(value)
        layout.write(arrays, row, value)
    for row, value in enumerate(values):
        assert_same(layout.read(arrays, row), value)
    batch = layout.batch(arrays)
    assert_same(batch, gym.vector.utils.concatenate(space, values, gym.vector.utils.create_empty_array(space, 3)))


@pytest.mark.parametrize("name", list(PICKLED))
def test_unbuffered_spaces_have_no_fields(name):
    assert not SpaceLayout(PICKLED[name], "obs").buffered


def test_check_batch_rejects_bad_actions():
    layout = SpaceLayout(spaces.Dict({"d": spaces.Discrete(3), "b": spaces.Box(-1, 1, (2,))}), "act")
    good = {"d": np.array([0, 2]), "b": np.zeros((2, 2), np.float32)}
    # gymnasium sorts Dict keys: fields are b, d
    assert [a.shape for a in layout.check_batch(good, 2)] == [(2, 2), (2,)]
    for bad in (
        {"d": np.array([0, 2])},
        {"d": np.array([0, 2, 1]), "b": np.zeros((2, 2))},
        {"d": np.array([0.0, np.nan]), "b": np.zeros((2, 2))},
        {"d": np.array([0.5, 1.0]), "b": np.zeros((2, 2))},
        {"d": np.array(["a", "b"]), "b": np.zeros((2, 2))},
        {"d": np.array([0, 1]), "b": np.array([["x", "y"], ["z", "w"]])},
    ):
        with pytest.raises(ValueError):
            layout.check_batch(bad, 2)


def _reference_run(env_fns, actions, seeds):
    """What a pool in same_step mode must produce, computed in this process."""
    envs = [fn() for fn in env_fns]
    obs = [env.reset(seed=seed)[0] for env, seed in zip(envs, seeds)]
    steps = []
    for batch in actions:
        out = []
        for env, action in zip(envs, batch):
            o, r, term, trunc, _ = env.step(action)
            final = o if term or trunc else None
            if term or trunc:
                o, _ = env.reset()
            out.append((o, r, term, trunc, final))
        steps.append(out)
    return obs, steps


@pytest.mark.parametrize("obs_name", ["tuple", "multi_discrete", "text", "graph", "dict_with_text"])
def test_pool_carries_every_space(obs_name):
    obs_space = {**BUFFERED, **PICKLED}[obs_name]
    action_space = spaces.Tuple((spaces.MultiDiscrete([2, 3]), spaces.MultiBinary(2)))
    env_fns = [functools.partial(SpacesEnv, obs_space, action_space)] * 3
    action_space.seed(0)
    actions = [[action_space.sample() for _ in range(3)] for _ in range(30)]
    batched = [
        (np.stack([a[0] for a in batch]), np.stack([a[1] for a in batch])) for batch in actions
    ]
    reference_obs, reference_steps = _reference_run(env_fns, actions, seeds=[7, 8, 9])
    layout = SpaceLayout(obs_space, "obs")
    with EnvPool(env_fns, num_workers=2) as pool:
        result = pool.reset(seeds=[7, 8, 9])

        def rows(obs):
            return [layout.read(pool.buffers.obs, i) for i in range(3)] if layout.buffered else list(obs)

        assert_same(rows(result.obs), reference_obs)
        for batch, expected in zip(batched, reference_steps):
            result = pool.step(batch)
            assert_same(rows(result.obs), [e[0] for e in expected])
            assert result.rewards.tolist() == [e[1] for e in expected]
            assert result.terminated.tolist() == [e[2] for e in expected]
            for i, e in enumerate(expected):
                if e[4] is not None:
                    assert_same(result.final_observation(i), e[4])


def test_call_get_set_attr_order_and_indices():
    env_fns = [functools.partial(gym.make, "CartPole-v1")] * 5
    with EnvPool(env_fns, num_workers=2) as pool:
        pool.set_attr("marker", ["a", "b", "c"], indices=[4, 0, 2])
        assert pool.get_attr("marker", indices=[0, 2, 4]) == ["b", "c", "a"]
        assert pool.call("has_wrapper_attr", ["marker"], indices=[-1]) == [True]
        assert pool.get_attr("spec", indices=[3])[0].id == "CartPole-v1"
        with pytest.raises(IndexError):
            pool.get_attr("spec", indices=[5])


def test_workers_import_torch_only_if_env_does():
    from stable_baselines3.common.monitor import Monitor

    # Workers of an SB3 factory import torch (on the local backend, their fork server does).
    with EnvPool([lambda: Monitor(gym.make("CartPole-v1"))] * 2, num_workers=2) as pool:
        for pid in pool.worker_pids:
            assert any("libtorch" in mapping.path for mapping in psutil.Process(pid).memory_maps())
    env_fns = [functools.partial(SpacesEnv, spaces.Discrete(2), spaces.Discrete(2))] * 2
    with EnvPool(env_fns, num_workers=2) as pool:
        assert pool.call("has_module", ["torch"]) == [False, False]
        assert pool.call("has_module", kwargs={"name": "stable_baselines3"}) == [False, False]


def test_preload_imports_in_the_background_and_the_next_call_waits_for_it(tmp_path, monkeypatch):
    # A module slower to import than the pool's timeout: preload returns at once, and the next call
    # waits for the import as long as for a starting worker, not the pool's timeout.
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(1.5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # before the pool starts: workers get the learner's path
    env_fns = [functools.partial(SpacesEnv, spaces.Discrete(2), spaces.Discrete(2))] * 2
    with EnvPool(env_fns, num_workers=2, timeout=0.5) as pool:
        started = time.monotonic()
        pool.preload(["slow_to_import", "no_such_module_anywhere"])
        assert time.monotonic() - started < 1.0  # it did not wait for the import
        # A module that fails to import is left to the call that needs it.
        assert pool.call("has_module", ["slow_to_import"]) == [True, True]
        assert pool.call("has_module", ["no_such_module_anywhere"]) == [False, False]
        pool.reset()
        pool.step(np.zeros(2, np.int64))
        with pytest.raises(TypeError, match="module names"):
            pool.preload([sys])


def test_core_imports_without_torch_or_sb3():
    code = (
        "import sys\n"
        "for name in ('torch', 'stable_baselines3', 'cleanrl'):\n"
        "    sys.modules[name] = None  # makes any import of it fail\n"
        "import clusterenv_core, clusterenv_core.worker.serving, clusterenv_core.transports.local\n"
        "print('ok')\n"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert output.stdout.strip() == "ok", output.stderr


def test_an_idle_pool_costs_no_cpu():
    """Workers sleep in the kernel between requests; the first ones poll for at most
    ``worker_spin`` after a reply (0.5 ms by default), so a pool left alone uses no CPU."""
    psutil = pytest.importorskip("psutil")
    with EnvPool.make("CartPole-v1", 4, num_workers=2, backend_options={"spinning_workers": 2}) as pool:
        pool.reset()
        pool.step(np.zeros(4, np.int64))
        time.sleep(0.1)
        processes = [psutil.Process(process.pid) for process in pool._transport.processes]
        before = [sum(process.cpu_times()[:2]) for process in processes]
        time.sleep(1.0)
        used = [sum(process.cpu_times()[:2]) - cpu for process, cpu in zip(processes, before)]
        assert max(used) < 0.05, f"CPU seconds used by idle workers: {used}"
    with pytest.raises(ValueError, match="worker_spin"):
        EnvPool.make("CartPole-v1", 2, backend_options={"worker_spin": -1.0})


def test_make_from_env_id_and_partial_reset():
    with EnvPool.make("CartPole-v1", 4, num_workers=2, autoreset_mode="disabled") as pool:
        first = pool.reset(seeds=[1, 2, 3, 4]).obs.copy()
        mask = np.array([False, True, False, False])
        second = pool.reset(seeds=[None, 9, None, None], mask=mask).obs
        assert np.array_equal(second[~mask], first[~mask])
        assert not np.array_equal(second[1], first[1])


def test_reset_leaves_out_the_keywords_omit_if_none_names_where_they_are_none():
    def keywords(result) -> list[str]:
        return [result.infos[index]["reset_keywords"] for index in range(2)]

    with EnvPool([ResetKeywordsEnv] * 2, num_workers=1) as pool:
        assert keywords(pool.reset()) == ["seed,options", "seed,options"]
        assert keywords(pool.reset(omit_if_none=("options",))) == ["seed", "seed"]
        both = ("seed", "options")
        assert keywords(pool.reset([1, None], [None, {}], omit_if_none=both)) == ["seed", "options"]
        assert keywords(pool.reset(omit_if_none=both)) == ["", ""]
        # Refused before anything is sent: the pool answers the next reset.
        with pytest.raises(ValueError, match=r"omit_if_none may name only \('seed', 'options'\), got \['mask'\]"):
            pool.reset(omit_if_none=("seed", "mask"))
        with pytest.raises(TypeError, match="omit_if_none must be a sequence of names"):
            pool.reset(omit_if_none="options")
        assert keywords(pool.reset(omit_if_none=["seed"])) == ["options", "options"]


@pytest.mark.parametrize(
    "value",
    [
        np.float64(1.5), np.float64("nan"), np.float64(-0.0), np.float32(-0.1), np.float32("inf"), np.float16(0.3),
        np.int64(-(2**63)), np.uint64(2**64 - 1), np.int32(7), np.int16(-3), np.int8(-5), np.uint8(255),
        np.bool_(True), np.bool_(False),
    ],
    ids=repr,
)
def test_wire_pickles_numpy_scalars_by_value_exactly(value):
    import pickle

    from clusterenv_core.protocol import dumps

    back = pickle.loads(dumps(("ok", {"infos": {0: {"key": value, "list": [value]}}})))[1]["infos"][0]
    for got in (back["key"], back["list"][0]):
        assert type(got) is type(value) and got.tobytes() == value.tobytes()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P (a path without the working directory) is 3.11+")
def test_a_clusterenv_core_in_the_working_directory_does_not_shadow_the_learners(tmp_path, monkeypatch):
    # A source checkout where the user runs their script, another clusterenv_core installed.
    shadow = tmp_path / "clusterenv_core"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the clusterenv_core of the working directory was imported')\n")
    monkeypatch.chdir(tmp_path)
    with EnvPool.make("CartPole-v1", 2, num_workers=1, timeout=30) as pool:
        pool.reset(seeds=[0, 1])
        assert pool.step(np.zeros(2, np.int64)).rewards.tolist() == [1.0, 1.0]


def _cluster_vec_env(env_fns):
    pytest.importorskip("stable_baselines3")
    from clusterenv_sb3 import ClusterVecEnv

    return ClusterVecEnv(env_fns, num_workers=1)


def _cluster_vector_env(env_fns):
    from clusterenv_cleanrl import ClusterVectorEnv

    return ClusterVectorEnv(env_fns, num_workers=1)


def _cluster_env_pool(env_fns):
    from clusterenv_cleanrl import ClusterEnvPool

    return ClusterEnvPool(env_fns, num_workers=1)


@pytest.mark.parametrize(
    "make", [functools.partial(EnvPool, num_workers=1), _cluster_vec_env, _cluster_vector_env, _cluster_env_pool]
)
def test_copying_or_pickling_a_pool_or_an_adapter_says_why_it_cannot(make):
    import copy
    import pickle

    import cloudpickle

    env_fns = [functools.partial(gym.make, "CartPole-v1")] * 2
    with make(env_fns) as holder:
        name = type(holder).__name__
        for operation in (copy.copy, copy.deepcopy, pickle.dumps, cloudpickle.dumps):
            with pytest.raises(TypeError, match=f"this {name} cannot be copied or pickled: its envs live in worker processes"):
                operation(holder)
        holder.reset()  # untouched
