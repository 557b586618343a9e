"""Stable-Baselines3 adapter: ``ClusterVecEnv`` runs a ``VecEnv``'s environments on ClusterEnv workers.

Change ``DummyVecEnv(env_fns)`` (or ``SubprocVecEnv``) to ``ClusterVecEnv(env_fns)``, or pass
``vec_env_cls=ClusterVecEnv`` to ``make_vec_env``.

Worker-side inference: ``clusterenv_sb3.PPO``, ``A2C``, ``DQN``, ``SAC`` and ``TD3`` are SB3's algorithms acting
on the workers (give them a bare ``ClusterVecEnv``); ``AAPSCallback`` syncs weights adaptively.
"""

from clusterenv_core.errors import ClusterEnvError, EnvError, WorkerLostError, WorkerTimeoutError
from clusterenv_sb3.aaps_callback import AAPSCallback
from clusterenv_sb3.cluster_vec_env import ClusterVecEnv
from clusterenv_sb3.off_policy import DQN, SAC, TD3
from clusterenv_sb3.on_policy import A2C, PPO

__all__ = [
    "A2C",
    "DQN",
    "PPO",
    "SAC",
    "TD3",
    "AAPSCallback",
    "ClusterEnvError",
    "ClusterVecEnv",
    "EnvError",
    "WorkerLostError",
    "WorkerTimeoutError",
]
