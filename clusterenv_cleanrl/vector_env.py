"""``ClusterVectorEnv``: gymnasium's ``SyncVectorEnv`` with its environments on ClusterEnv workers.

Replace ``gym.vector.SyncVectorEnv(env_fns)`` with ``ClusterVectorEnv(env_fns)``: observations,
rewards, terminations, truncations and infos are what ``SyncVectorEnv`` returns for the same
environments, seeds and actions, and each env's ``reset`` gets the keywords ``SyncVectorEnv`` passes
(:data:`RESET_OMIT_IF_NONE`). The constructor and the results follow the installed gymnasium:

- gymnasium 1.x: ``ClusterVectorEnv(env_fns, copy=True, observation_mode="same",
  autoreset_mode=AutoresetMode.NEXT_STEP, ...)``, with the three autoreset modes and partial resets
  through ``reset(options={"reset_mask": mask})``;
- gymnasium 0.29: ``ClusterVectorEnv(env_fns, observation_space=None, action_space=None, copy=True, ...)``,
  resetting in the same step and reporting ``final_observation``/``final_info`` in the infos.

Both also take ClusterEnv's keywords: the pool's ``backend``, ``num_workers``, ``timeout`` and the
opt-in restarts (``restart_failed_envs``, ``restart_failed_workers``, ``max_restarts``; see
:class:`~clusterenv_core.pool.EnvPool`), and backend options.

Where it differs from ``SyncVectorEnv``: there is no ``envs`` list (the envs live on the workers;
use :meth:`call`, :meth:`get_attr` and :meth:`set_attr`); an exception raised by an
env reaches the caller as :class:`~clusterenv_core.errors.EnvError` carrying the remote traceback;
it is a context manager, and on gymnasium 0.29 it has :meth:`render` too.
"""

from __future__ import annotations

import gymnasium as gym

GYMNASIUM_1 = int(gym.__version__.split(".")[0]) >= 1

if GYMNASIUM_1:
    from clusterenv_cleanrl.vector_env_gymnasium1 import RESET_OMIT_IF_NONE, ClusterVectorEnv
else:  # the type checker runs with gymnasium 1.x, so it takes the class above as the one
    from clusterenv_cleanrl.vector_env_gymnasium029 import (  # type: ignore[assignment]
        RESET_OMIT_IF_NONE,
        ClusterVectorEnv,
    )

__all__ = ["GYMNASIUM_1", "RESET_OMIT_IF_NONE", "ClusterVectorEnv"]
