"""A user's training script that hands its envs objects it defines itself: a config class in reset
options and ``set_attr``, a function in ``call`` / ``env_method``, a wrapper class in
``env_is_wrapped``. Workers never import this file, so these must travel by value.

Usage: ``python user_objects.py <backend>``; prints ``OK vector`` and ``OK sb3`` when ClusterEnv
gave what SyncVectorEnv and DummyVecEnv gave.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import gymnasium as gym  # noqa: E402


class Level:
    """A config object of the script."""

    def __init__(self, n: int) -> None:
        self.n = n


def double(x: int) -> int:
    return 2 * x


class LevelWrapper(gym.Wrapper):
    """Puts the level of the reset options into the reset info."""

    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=seed)
        if options and "level" in options:
            info["level"] = options["level"].n
        return obs, info

    def apply(self, fn, x):
        return fn(x)


def make() -> gym.Env:
    return LevelWrapper(gym.make("CartPole-v1"))


def outcomes(envs, set_attr, call) -> list:
    """What each way of passing the script's objects gives on ``envs``."""
    set_attr("level_config", Level(4))
    return [
        envs.reset(seed=0, options={"level": Level(3)})[1]["level"].tolist(),
        [config.n for config in envs.get_attr("level_config")],
        list(call("apply", double, 21)),
    ]


def vector(backend: str) -> None:
    from clusterenv_cleanrl import ClusterVectorEnv

    sync = gym.vector.SyncVectorEnv([make] * 2)
    with ClusterVectorEnv([make] * 2, backend=backend, num_workers=2) as cluster:
        got = outcomes(cluster, cluster.set_attr, cluster.call)
    want = outcomes(sync, sync.set_attr, sync.call)
    sync.close()
    assert got == want == [[3, 3], [4, 4], [42, 42]], (got, want)


def sb3(backend: str) -> None:
    import torch
    from stable_baselines3.common.vec_env import DummyVecEnv

    from clusterenv_sb3 import ClusterVecEnv

    def check(venv) -> list:
        venv.set_options({"level": Level(5)})
        infos = [info["level"] for info in (venv.reset(), venv.reset_infos)[1]]
        venv.set_attr("level_config", Level(6))
        return [
            infos,
            [config.n for config in venv.get_attr("level_config")],
            venv.env_method("apply", double, 4),
            venv.env_is_wrapped(LevelWrapper),
        ]

    torch.set_num_threads(1)  # as the README asks of a learner beside its workers
    with ClusterVecEnv([make] * 2, backend=backend, num_workers=2) as cluster:
        got = check(cluster)
    dummy = DummyVecEnv([make] * 2)
    want = check(dummy)
    dummy.close()
    assert got == want == [[5, 5], [6, 6], [8, 8], [True, True]], (got, want)


if __name__ == "__main__":
    backend = sys.argv[1]
    for check in (vector, sb3):
        check(backend)
        print(f"OK {check.__name__}", flush=True)
