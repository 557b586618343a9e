"""A user's training script that registers its own env ids, then vectorizes them with ClusterEnv.

Usage: ``python user_registrations.py <backend> <check> [<check> ...]``, also under mpiexec (a world
launch serves one pool: give it one check). Rank 0 prints ``OK <check>`` for each check that passed.

Checks, each against the single-process baseline: ``main_class`` (entry point a class of this
script, with kwargs and max_episode_steps), ``module_string`` (``"user_envs:ModuleEnv"``) and
``main_string`` (``"__main__:MainEnv"``) through SB3's make_vec_env; ``vector`` (all three with
ClusterVectorEnv against SyncVectorEnv); ``override`` (this script re-registers CartPole-v1 with
another time limit); ``ale`` (ids ale_py registers on import); ``in_child`` (``vector`` and a
factory of this script's class from spawn and forkserver children of this script).
"""

from __future__ import annotations

import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

from tests.helpers import assert_same  # noqa: E402


class MainEnv(gym.Env):
    """Defined in the script itself: workers never import this file, so the class travels by value."""

    def __init__(self, size: int = 2) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (size,), np.float32)
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.np_random.uniform(-1, 1, self.observation_space.shape).astype(np.float32), {}

    def step(self, action):
        obs = self.np_random.uniform(-1, 1, self.observation_space.shape).astype(np.float32)
        return obs, float(action) + float(obs[0]), False, False, {}


gym.register("UserMain-v0", entry_point=MainEnv, max_episode_steps=7, kwargs={"size": 4})
gym.register("UserModule-v0", entry_point="user_envs:ModuleEnv", max_episode_steps=11, kwargs={"size": 3, "scale": 2.0})
gym.register("UserMainString-v0", entry_point="__main__:MainEnv", max_episode_steps=5)


def sb3_side_by_side(env_id: str, backend: str, steps: int = 200) -> None:
    """SB3's make_vec_env with ClusterVecEnv against DummyVecEnv: identical results and env specs."""
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv

    from clusterenv_sb3 import ClusterVecEnv

    # ClusterVecEnv first: in an SPMD launch the worker ranks become workers right here.
    cluster = make_vec_env(env_id, n_envs=4, seed=0, vec_env_cls=ClusterVecEnv, vec_env_kwargs={"backend": backend, "num_workers": 2})
    dummy = make_vec_env(env_id, n_envs=4, seed=0, vec_env_cls=DummyVecEnv)
    try:
        assert_same(cluster.reset(), dummy.reset(), "reset")
        dummy.action_space.seed(0)
        dones = 0
        for step in range(steps):
            actions = np.array([dummy.action_space.sample() for _ in range(4)])
            want = dummy.step(actions)
            for label, got, expected in zip(("obs", "rewards", "dones", "infos"), cluster.step(actions), want):
                assert_same(got, expected, f"{label} at step {step}")
            dones += int(want[2].sum())
        assert dones > 10, dones
        assert_same(cluster.get_attr("spec"), dummy.get_attr("spec"), "specs")
    finally:
        cluster.close()
        dummy.close()


def vector_side_by_side(env_fns: list, backend: str, steps: int = 200) -> None:
    """ClusterVectorEnv against SyncVectorEnv on ``env_fns``: identical results and specs."""
    from clusterenv_cleanrl import ClusterVectorEnv

    cluster = ClusterVectorEnv(env_fns, backend=backend, num_workers=2)
    sync = gym.vector.SyncVectorEnv(env_fns)
    with cluster:
        assert_same(cluster.reset(seed=1), sync.reset(seed=1), "reset")
        sync.action_space.seed(1)
        ended = 0
        for step in range(steps):
            actions = sync.action_space.sample()
            expected = sync.step(actions)
            assert_same(cluster.step(actions), expected, f"step {step}")
            ended += int(expected[2].sum() + expected[3].sum())
        assert ended > 10, ended
        assert cluster.get_attr("spec") == sync.get_attr("spec")
    sync.close()


def factories_of(env_id: str) -> list:
    """Four factories of ``gym.make(env_id)``."""
    return [functools.partial(gym.make, env_id)] * 4


def limited_main_env() -> gym.Env:
    """A factory of this script, not through the registry: MainEnv under a time limit."""
    return gym.wrappers.TimeLimit(MainEnv(3), max_episode_steps=6)


def vector(backend: str) -> None:
    for env_id in ("UserMain-v0", "UserModule-v0", "UserMainString-v0"):
        vector_side_by_side(factories_of(env_id), backend)


def override(backend: str) -> None:
    spec = gym.spec("CartPole-v1")
    gym.register("CartPole-v1", entry_point=spec.entry_point, max_episode_steps=13, reward_threshold=9.0)
    vector_side_by_side(factories_of("CartPole-v1"), backend)


def ale(backend: str) -> None:
    import ale_py

    from clusterenv_cleanrl import ClusterVectorEnv

    if hasattr(gym, "register_envs"):  # gymnasium 1.x; on 0.29 the import registers them
        gym.register_envs(ale_py)
    env_fns = [functools.partial(gym.make, "ALE/Pong-v5", frameskip=4)] * 2
    cluster = ClusterVectorEnv(env_fns, backend=backend, num_workers=2)
    sync = gym.vector.SyncVectorEnv(env_fns)
    with cluster:
        assert_same(cluster.reset(seed=2), sync.reset(seed=2), "reset")
        sync.action_space.seed(2)
        for step in range(50):
            actions = sync.action_space.sample()
            assert_same(cluster.step(actions), sync.step(actions), f"step {step}")
        assert cluster.get_attr("spec") == sync.get_attr("spec")
    sync.close()


def _checks_in_child(backend: str, outcome) -> None:
    try:
        vector(backend)
        vector_side_by_side([limited_main_env] * 4, backend)
        outcome.put("done")
    except BaseException:
        import traceback

        outcome.put(traceback.format_exc())


def in_child(backend: str) -> None:
    """The ``vector`` checks and a factory of this script's class, from a spawn and a forkserver
    child of this script (a ``multiprocessing`` pool of training runs): there the script is
    ``__mp_main__``, not ``__main__``."""
    import multiprocessing

    for method in ("spawn", "forkserver"):
        context = multiprocessing.get_context(method)
        outcome = context.Queue()
        child = context.Process(target=_checks_in_child, args=(backend, outcome))
        child.start()
        result = outcome.get(timeout=240)
        child.join(timeout=60)
        assert result == "done" and child.exitcode == 0, f"{method} child (exit code {child.exitcode}):\n{result}"


CHECKS = {
    "main_class": functools.partial(sb3_side_by_side, "UserMain-v0"),
    "module_string": functools.partial(sb3_side_by_side, "UserModule-v0"),
    "main_string": functools.partial(sb3_side_by_side, "UserMainString-v0"),
    "vector": vector,
    "override": override,
    "ale": ale,
    "in_child": in_child,
}

if __name__ == "__main__":
    backend, *checks = sys.argv[1:]
    for check in checks:
        CHECKS[check](backend)
        print(f"OK {check}", flush=True)
