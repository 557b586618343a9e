"""ClusterVecEnv returns exactly what DummyVecEnv returns, and trains to identical parameters."""

from __future__ import annotations

import functools
from collections import OrderedDict

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack, VecMonitor, VecNormalize  # noqa: E402

from clusterenv_sb3 import ClusterVecEnv  # noqa: E402
from tests.envs import (  # noqa: E402
    CallCounter,
    InPlaceStateEnv,
    LightsEnv,
    MaskedObsEnv,
    OrderedInfoEnv,
    ResetKeywordsEnv,
    SeedOnlyResetEnv,
    SpacesEnv,
    make_dict_env,
)
from tests.helpers import assert_same, run_side_by_side  # noqa: E402


def test_cartpole_matches_dummy_vec_env():
    run_side_by_side([functools.partial(gym.make, "CartPole-v1")] * 8)


@pytest.mark.slow
def test_dict_obs_continuous_truncation_matches_dummy_vec_env():
    # 5 envs on 2 workers: uneven blocks; the env truncates at 25 steps and terminates at random.
    run_side_by_side([make_dict_env] * 5)


@pytest.mark.parametrize("cluster_kwargs", [{}, {"num_workers": 2, "inline_worker": True}], ids=["processes", "inline"])
def test_terminal_observation_of_an_env_that_resets_its_array_in_place(cluster_kwargs):
    # DummyVecEnv keeps the env's own array as terminal_observation and then resets the env, which
    # zeroes that array: what it returns (and what off-policy algorithms learn from) is the zeros.
    run_side_by_side([InPlaceStateEnv] * 4, steps=30, **cluster_kwargs)


def test_reset_options_and_seed_match():
    env_fns = [make_dict_env] * 3
    expected, actual = DummyVecEnv(env_fns), ClusterVecEnv(env_fns, num_workers=3)
    try:
        for venv in (expected, actual):
            venv.seed(11)
            venv.set_options([{"level": 1}, {}, {"level": 3}])
        assert_same(actual.reset(), expected.reset())
        assert_same(actual.reset_infos, expected.reset_infos)
        # Seeds and options are used once: the next reset is unseeded, without options.
        actual.reset()
        assert actual.reset_infos[0].keys() == {"start"}
    finally:
        expected.close()
        actual.close()


def check_reset_keywords_match_dummy_vec_env(**cluster_kwargs) -> None:
    """DummyVecEnv passes ``seed=`` always and ``options=`` only when set: the envs get the same
    keywords from ClusterVecEnv (``ResetKeywordsEnv`` says which in its reset info), and an env whose
    ``reset`` takes no options (env 1) resets unless options are set for it. Episodes truncate after
    3 steps, so automatic resets (``reset()``) are compared too (also run by tests/mpi_scripts/contract.py)."""
    env_fns = [ResetKeywordsEnv, SeedOnlyResetEnv, ResetKeywordsEnv]
    actual = ClusterVecEnv(env_fns, **{"num_workers": 2, **cluster_kwargs})  # first: SPMD worker ranks stop here
    expected = DummyVecEnv(env_fns)
    try:
        rng = np.random.default_rng(0)
        for options in (None, [{"level": 1}, {}, {}], [None, None, {"level": 2}]):
            for venv in (expected, actual):
                venv.seed(7)
                if options is not None:
                    venv.set_options(options)
            assert_same(actual.reset(), expected.reset(), f"reset obs with options {options}")
            assert_same(actual.reset_infos, expected.reset_infos, f"reset_infos with options {options}")
            for t in range(4):
                actions = rng.integers(0, 2, size=3)
                got, want = actual.step(actions), expected.step(actions)
                for name, g, w in zip(("obs", "rewards", "dones", "infos"), got, want):
                    assert_same(g, w, f"{name} at step {t}")
                assert_same(actual.reset_infos, expected.reset_infos, f"reset_infos at step {t}")
        assert expected.reset_infos[0] == {"reset_keywords": ""}  # the last step's automatic reset
        # Options for env 1 too: both raise the env's TypeError.
        for venv in (expected, actual):
            venv.set_options({"level": 3})
            with pytest.raises(TypeError, match="options"):
                venv.reset()
    finally:
        expected.close()
        actual.close()


@pytest.mark.parametrize("cluster_kwargs", [{}, {"inline_worker": True}], ids=["processes", "inline"])
def test_reset_passes_the_keywords_dummy_vec_env_passes(cluster_kwargs):
    check_reset_keywords_match_dummy_vec_env(**cluster_kwargs)


def _assert_same_run(actual, expected, steps: int, num_envs: int) -> None:
    try:
        assert_same(actual.reset(), expected.reset())
        rng = np.random.default_rng(0)
        for t in range(steps):
            actions = rng.integers(0, 2, size=num_envs)
            for name, g, w in zip(("obs", "rewards", "dones", "infos"), actual.step(actions), expected.step(actions)):
                assert_same(g, w, f"{name} at step {t}")
    finally:
        expected.close()
        actual.close()


@pytest.mark.slow
def test_make_vec_env_matches():
    def build(vec_env_cls):
        return make_vec_env("CartPole-v1", n_envs=6, seed=5, vec_env_cls=vec_env_cls)

    _assert_same_run(build(ClusterVecEnv), build(DummyVecEnv), steps=300, num_envs=6)


@pytest.mark.slow
def test_vec_normalize_frame_stack_monitor_match():
    def build(vec_env_cls):
        venv = VecMonitor(vec_env_cls([functools.partial(gym.make, "CartPole-v1")] * 6))
        venv.seed(5)
        return VecNormalize(VecFrameStack(venv, n_stack=3))

    _assert_same_run(build(ClusterVecEnv), build(DummyVecEnv), steps=500, num_envs=6)


def test_terminal_observation_of_an_ndarray_subclass_keeps_its_type():
    expected, actual = DummyVecEnv([MaskedObsEnv] * 2), ClusterVecEnv([MaskedObsEnv] * 2, num_workers=1)
    try:
        expected.reset()
        actual.reset()
        infos, expected_infos = actual.step(np.zeros(2, np.int64))[3], expected.step(np.zeros(2, np.int64))[3]
        for info, expected_info in zip(infos, expected_infos):
            assert type(info["terminal_observation"]) is type(expected_info["terminal_observation"]) is np.ma.MaskedArray
    finally:
        expected.close()
        actual.close()


def test_dict_keys_of_one_string_form_keep_their_buffers():
    # 1 and "1" were both the buffer "obs.1".
    space = gym.spaces.Dict({1: gym.spaces.Box(-1, 1, (3,), np.float32), "1": gym.spaces.Discrete(4)})
    env_fns = [functools.partial(SpacesEnv, space, gym.spaces.Discrete(2))] * 2
    actual, expected = ClusterVecEnv(env_fns, num_workers=2), DummyVecEnv(env_fns)
    actual.seed(3)
    expected.seed(3)
    _assert_same_run(actual, expected, steps=30, num_envs=2)


def test_empty_infos_of_a_dict_subclass_keep_their_type():
    env_fns = [lambda: OrderedInfoEnv(gym.make("CartPole-v1"))] * 3
    actual, expected = ClusterVecEnv(env_fns, num_workers=2), DummyVecEnv(env_fns)
    actual.seed(1)
    expected.seed(1)
    _assert_same_run(actual, expected, steps=60, num_envs=3)  # episodes end: reset infos after autoresets
    assert_same(actual.reset_infos, expected.reset_infos)
    assert type(expected.reset_infos[0]) is OrderedDict


def test_methods_and_attributes_of_an_env_listed_twice():
    # Uneven blocks (7 envs on 3 workers); an env listed twice is called twice, each result in its place.
    env_fns = [lambda: CallCounter(gym.make("CartPole-v1"))] * 7
    expected, actual = DummyVecEnv(env_fns), ClusterVecEnv(env_fns, num_workers=3)
    try:
        for indices in ([3, 3, 0, 3], [6, 0, 6], [5, 5]):
            assert actual.env_method("bump", 2, indices=indices) == expected.env_method("bump", 2, indices=indices)
        actual.set_attr("calls", 40, indices=[1, 1, 4])
        expected.set_attr("calls", 40, indices=[1, 1, 4])
        assert actual.get_attr("calls", indices=[4, 1, 4]) == expected.get_attr("calls", indices=[4, 1, 4])
    finally:
        expected.close()
        actual.close()


def test_attribute_access_and_methods():
    env_fns = [make_dict_env] * 4
    expected, actual = DummyVecEnv(env_fns), ClusterVecEnv(env_fns, num_workers=2)
    try:
        expected.reset()
        actual.reset()
        assert actual.render_mode == "rgb_array"
        assert actual.get_attr("_max_episode_steps") == expected.get_attr("_max_episode_steps")
        actual.set_attr("_max_episode_steps", 7, indices=[1, 3])
        assert actual.get_attr("_max_episode_steps") == [25, 7, 25, 7]
        assert actual.get_attr("steps", indices=2) == [0]
        assert actual.env_method("render", indices=[3, 0])[0].shape == (8, 8, 3)
        assert actual.env_is_wrapped(gym.wrappers.TimeLimit) == [True] * 4
        assert actual.env_is_wrapped(gym.wrappers.RecordEpisodeStatistics) == [False] * 4
        assert actual.has_attr("steps") and not actual.has_attr("no_such_attribute")
        with pytest.raises(AttributeError):
            actual.get_attr("no_such_attribute")
        assert_same(actual.get_images(), expected.get_images())
        assert actual.render().shape == expected.render().shape
        assert actual.seed(4) == expected.seed(4) == [4, 5, 6, 7]
    finally:
        expected.close()
        actual.close()


def test_step_async_returns_before_workers_finish():
    import time

    from tests.envs import SlowCartPole

    # Bounds far apart, so that a loaded machine's scheduling delays cannot cross them.
    venv = ClusterVecEnv([functools.partial(SlowCartPole, seconds=0.5)] * 2, num_workers=2)
    try:
        venv.reset()
        started = time.perf_counter()
        venv.step_async(np.zeros(2, dtype=np.int64))
        returned = time.perf_counter() - started
        venv.step_wait()
        finished = time.perf_counter() - started
        assert returned < 0.25 and finished >= 0.5
    finally:
        venv.close()


@pytest.mark.slow
@pytest.mark.parametrize("cluster_kwargs", [{}, {"num_workers": 2, "inline_worker": True}], ids=["processes", "inline"])
def test_ppo_parameters_identical_to_dummy_vec_env(cluster_kwargs):
    import torch
    from stable_baselines3 import PPO

    def train(vec_env_cls, **vec_env_kwargs):
        venv = make_vec_env("CartPole-v1", n_envs=4, seed=0, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_env_kwargs)
        model = PPO("MlpPolicy", venv, n_steps=256, batch_size=256, n_epochs=2, seed=0, device="cpu")
        model.learn(total_timesteps=4096)
        venv.close()
        return model.policy.state_dict()

    torch.set_num_threads(1)
    expected, actual = train(DummyVecEnv), train(ClusterVecEnv, **cluster_kwargs)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def test_ppo_with_multibinary_actions_identical_to_dummy_vec_env():
    # SB3's policy sends float32 actions for the int8 MultiBinary space; the env's reward uses them.
    import torch
    from stable_baselines3 import PPO

    def train(vec_env_cls):
        venv = make_vec_env(LightsEnv, n_envs=2, seed=0, vec_env_cls=vec_env_cls)
        model = PPO("MlpPolicy", venv, n_steps=32, batch_size=32, n_epochs=2, seed=0, device="cpu", policy_kwargs={"net_arch": [16]})
        model.learn(total_timesteps=256)
        venv.close()
        return model.policy.state_dict()

    torch.set_num_threads(1)
    expected, actual = train(DummyVecEnv), train(ClusterVecEnv)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def test_subproc_vec_env_keywords_run_unchanged():
    # Code switching from SubprocVecEnv keeps its vec_env_kwargs; a method that does not exist is refused.
    venv = make_vec_env("CartPole-v1", n_envs=2, seed=0, vec_env_cls=ClusterVecEnv, vec_env_kwargs={"start_method": "fork"})
    expected = make_vec_env("CartPole-v1", n_envs=2, seed=0, vec_env_cls=DummyVecEnv)
    try:
        assert_same(venv.reset(), expected.reset())
    finally:
        venv.close()
        expected.close()
    with pytest.raises(ValueError, match="start_method must be one of"):
        ClusterVecEnv([functools.partial(gym.make, "CartPole-v1")], start_method="telepathy")


def test_saving_loading_and_evaluating_never_copy_or_pickle_the_env(tmp_path, monkeypatch):
    """A ClusterVecEnv refuses to be copied or pickled, and SB3's usual flows never ask: ``model.save``
    leaves the env out, ``VecNormalize.save`` its venv; ``EvalCallback`` (saving the best model) and
    ``evaluate_policy`` use the env as it is."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import EvalCallback
    from stable_baselines3.common.evaluation import evaluate_policy

    from clusterenv_core.not_copyable import NotCopyable

    asked = []  # also attempts whose TypeError something caught
    refuse = NotCopyable.__reduce_ex__

    def recording_refusal(self, protocol):
        asked.append(type(self).__name__)
        return refuse(self, protocol)

    monkeypatch.setattr(NotCopyable, "__reduce_ex__", recording_refusal)
    env_fns = [functools.partial(gym.make, "CartPole-v1")] * 2
    with ClusterVecEnv(env_fns, num_workers=2) as train_env, ClusterVecEnv(env_fns, num_workers=1) as eval_env:
        venv, eval_venv = VecNormalize(train_env), VecNormalize(eval_env, training=False)
        model = PPO("MlpPolicy", venv, n_steps=32, batch_size=32, n_epochs=1, seed=0)
        evaluation = EvalCallback(eval_venv, eval_freq=32, n_eval_episodes=2, best_model_save_path=str(tmp_path / "best"))
        model.learn(128, callback=evaluation)
        model.save(tmp_path / "ppo")
        venv.save(tmp_path / "vec_normalize.pkl")
        loaded = PPO.load(tmp_path / "ppo", env=VecNormalize.load(tmp_path / "vec_normalize.pkl", train_env), seed=0)
        loaded.learn(64)
        evaluate_policy(loaded, eval_venv, n_eval_episodes=2)
        assert (tmp_path / "best" / "best_model.zip").exists()
    assert asked == []
