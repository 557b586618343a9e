"""Atari and MuJoCo, the workloads people distribute: ClusterEnv returns exactly what the baselines return.

SB3: ``make_atari_env`` + ``VecFrameStack`` on Pong and ``make_vec_env`` on HalfCheetah, against
``DummyVecEnv``, 1000 steps (obs, rewards, dones, infos with terminal observations). gymnasium:
``ALE/Pong-v5`` and HalfCheetah against ``SyncVectorEnv``. The ALE and MuJoCo ids are registered
by their packages in the learner only; workers get them from the learner's registry. Runs on
gymnasium 1.x and on 0.29.1 (ale-py 0.9.0, mujoco 2.3.7; SB3 parts skip there).
"""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest

from tests.helpers import assert_same

pytestmark = pytest.mark.slow  # thousands of Atari and MuJoCo steps

GYMNASIUM_1 = int(gym.__version__.split(".")[0]) >= 1
HALF_CHEETAH = "HalfCheetah-v5" if GYMNASIUM_1 else "HalfCheetah-v4"
STEPS = 1000


def _import_ale():
    ale_py = pytest.importorskip("ale_py")
    if hasattr(gym, "register_envs"):
        gym.register_envs(ale_py)


def _require_mujoco():
    pytest.importorskip("mujoco")


def compare_vec_envs(actual, expected, steps: int = STEPS, seed: int = 0) -> int:
    """Step two SB3 VecEnvs with the same random actions; identical results at every step.

    Returns the number of episodes that ended."""
    try:
        assert_same(actual.reset(), expected.reset(), "reset obs")
        expected.action_space.seed(seed)
        ended = 0
        for t in range(steps):
            actions = np.stack([expected.action_space.sample() for _ in range(expected.num_envs)])
            want = expected.step(actions)
            for name, got, wanted in zip(("obs", "rewards", "dones", "infos"), actual.step(actions), want):
                assert_same(got, wanted, f"{name} at step {t}")
            ended += int(want[2].sum())
        return ended
    finally:
        actual.close()
        expected.close()


def compare_vector_envs(env_fns, steps: int, seed: int = 0) -> None:
    from clusterenv_cleanrl import ClusterVectorEnv

    cluster = ClusterVectorEnv(env_fns, num_workers=2)
    sync = gym.vector.SyncVectorEnv(env_fns)
    with cluster:
        assert_same(cluster.reset(seed=seed), sync.reset(seed=seed), "reset")
        sync.action_space.seed(seed)
        for t in range(steps):
            actions = sync.action_space.sample()
            assert_same(cluster.step(actions), sync.step(actions), f"step {t}")
    sync.close()


def test_pong_vector_env_matches_sync_vector_env():
    _import_ale()
    compare_vector_envs([functools.partial(gym.make, "ALE/Pong-v5")] * 2, steps=STEPS)


def test_half_cheetah_vector_env_matches_sync_vector_env():
    _require_mujoco()
    env_fns = [lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(HALF_CHEETAH))] * 3
    compare_vector_envs(env_fns, steps=STEPS)


def test_pong_atari_wrapper_frame_stack_matches_dummy_vec_env():
    _import_ale()
    pytest.importorskip("stable_baselines3")
    pytest.importorskip("cv2")
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack

    from clusterenv_sb3 import ClusterVecEnv

    def build(vec_env_cls, **vec_env_kwargs):
        venv = make_atari_env("PongNoFrameskip-v4", n_envs=4, seed=0, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_env_kwargs)
        return VecFrameStack(venv, n_stack=4)

    # Episodes of Pong are thousands of frames long; the AtariWrapper's life losses and noop resets
    # still happen within 1000 steps.
    compare_vec_envs(build(ClusterVecEnv, num_workers=2), build(DummyVecEnv))


def test_half_cheetah_matches_dummy_vec_env():
    _require_mujoco()
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv

    from clusterenv_sb3 import ClusterVecEnv

    def build(vec_env_cls, **vec_env_kwargs):
        return make_vec_env(HALF_CHEETAH, n_envs=4, seed=0, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_env_kwargs)

    # HalfCheetah truncates at 1000 steps: every env ends an episode (terminal observation included).
    ended = compare_vec_envs(build(ClusterVecEnv, num_workers=2), build(DummyVecEnv), steps=1001)
    assert ended == 4
