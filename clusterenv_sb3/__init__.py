"""Stable-Baselines3 adapter: ``ClusterVecEnv`` runs a ``VecEnv``'s environments on ClusterEnv workers.

Change ``DummyVecEnv(env_fns)`` (or ``SubprocVecEnv``) to ``ClusterVecEnv(env_fns)``, or pass
``vec_env_cls=ClusterVecEnv`` to ``make_vec_env``.
"""

from clusterenv_core.errors import ClusterEnvError, EnvError, WorkerLostError, WorkerTimeoutError
from clusterenv_sb3.cluster_vec_env import ClusterVecEnv

__all__ = ["ClusterEnvError", "ClusterVecEnv", "EnvError", "WorkerLostError", "WorkerTimeoutError"]
