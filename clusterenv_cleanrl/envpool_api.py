"""``ClusterEnvPool``: EnvPool's gymnasium-style interface over Python envs on ClusterEnv workers.

Code written against ``envpool.make_gymnasium(...)`` runs with that call replaced::

    envs = clusterenv_cleanrl.make_gymnasium("Hopper-v5", num_envs=16, batch_size=8, seed=1)
    envs.async_reset()
    while ...:
        obs, rew, term, trunc, info = envs.recv()      # the first 8 envs whose steps finished
        envs.send(policy(obs), info["env_id"])         # actions for exactly those envs

EnvPool runs its own C++ tasks only and refuses Python envs by design; this runs any env factory
or registered id, locally or on MPI ranks (the pool's ``backend`` and options). Episodes reset as
EnvPool's do (gymnasium's next-step mode): after an episode ends, the env's next action is ignored
and it returns its reset observation with reward 0. With ``batch_size == num_envs`` the results are
those of ``SyncVectorEnv`` in next-step mode, and each env's ``reset`` gets the keywords the
installed gymnasium's ``SyncVectorEnv`` passes (EnvPool's C++ envs have no Python ``reset`` to
follow; CleanRL's EnvPool scripts pin gymnasium 0.29). Infos are one dict of arrays over the batch:
``env_id`` (int32), and the envs' own infos with ``_key`` masks as gymnasium batches them.
Observations are copies; ``send``'s rules are :meth:`AsyncBatches.send
<clusterenv_core.batches.AsyncBatches.send>`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from clusterenv_cleanrl.batched_infos import batch_infos
from clusterenv_cleanrl.vector_env import RESET_OMIT_IF_NONE
from clusterenv_core import EnvPool
from clusterenv_core.checks import check_int
from clusterenv_core.not_copyable import NotCopyable


def _copy(batch: Any) -> Any:
    """A copy of batched observations (arrays in nested dicts and tuples)."""
    if isinstance(batch, dict):
        return type(batch)((key, _copy(value)) for key, value in batch.items())
    if isinstance(batch, tuple):
        return tuple(_copy(value) for value in batch)
    return np.array(batch)


def _batch_infos(infos_by_env: dict[int, dict], env_ids: list[int]) -> dict[str, Any]:
    """The infos of the envs ``env_ids`` (by env id; empty ones may be missing) as one dict of arrays
    by batch position, with ``_key`` masks."""
    present = {position: infos_by_env[env] for position, env in enumerate(env_ids) if infos_by_env.get(env)}
    return batch_infos(present, len(env_ids), functools.partial(_add_info, count=len(env_ids)))


def _add_info(batched: dict[str, Any], info: dict, position: int, count: int) -> dict[str, Any]:
    for key, value in info.items():
        if isinstance(value, dict):
            _add_info(batched.setdefault(key, {}), value, position, count)
        else:
            if key not in batched:
                if type(value) in (int, float, bool) or isinstance(value, np.number):
                    batched[key] = np.zeros(count, dtype=type(value))
                elif isinstance(value, np.ndarray):
                    batched[key] = np.zeros((count, *value.shape), dtype=value.dtype)
                else:
                    batched[key] = np.full(count, None, dtype=object)
            batched[key][position] = value
        batched.setdefault(f"_{key}", np.zeros(count, dtype=bool))[position] = True
    return batched


class ClusterEnvPool(NotCopyable):
    """EnvPool's gymnasium API (``async_reset``/``recv``/``send``, ``step``/``reset``) over env factories.

    :param env_fns: one factory per env (or give ``env_id`` and ``num_envs``)
    :param env_id: a registered env id, made ``num_envs`` times with ``make_kwargs``
    :param num_envs: the number of envs (with ``env_id``)
    :param batch_size: envs per ``recv`` (default ``num_envs``: synchronous)
    :param seed: env ``i`` is seeded with ``seed + i`` at its first reset (EnvPool's convention)
    :param make_kwargs: keyword arguments of ``gymnasium.make`` (with ``env_id``)
    :param options: the pool's keywords (:data:`~clusterenv_core.pool.POOL_OPTIONS`) and backend
        options, as for ``ClusterVectorEnv``
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]] | None = None,
        *,
        env_id: str | None = None,
        num_envs: int | None = None,
        batch_size: int | None = None,
        seed: int = 42,
        make_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        if (env_fns is None) == (env_id is None):
            raise ValueError("give either env_fns or env_id (with num_envs)")
        if env_fns is None:
            assert env_id is not None  # one of the two is given, as checked above
            num_envs = check_int("num_envs", num_envs, minimum=1)
            env_fns = [functools.partial(gym.make, env_id, **(make_kwargs or {}))] * num_envs
        elif num_envs is not None and num_envs != len(env_fns):
            raise ValueError(f"num_envs={num_envs} but {len(env_fns)} env_fns")
        self.num_envs = len(env_fns)
        self.batch_size = self.num_envs if batch_size is None else check_int("batch_size", batch_size, minimum=1)
        if self.batch_size > self.num_envs:
            raise ValueError(f"batch_size must be at most num_envs={self.num_envs}, got {self.batch_size}")
        self.seed = check_int("seed", seed, minimum=0)
        self.pool = EnvPool.from_options(env_fns, "next_step", **options)
        try:
            self.batches = self.pool.async_batches(self.batch_size)
        except BaseException:
            self.pool.close()
            raise
        self.single_observation_space = self.observation_space = self.pool.observation_space
        self.single_action_space = self.action_space = self.pool.action_space
        self.is_async = self.batch_size < self.num_envs
        self.all_env_ids = np.arange(self.num_envs, dtype=np.int32)
        self.config = {"num_envs": self.num_envs, "batch_size": self.batch_size, "seed": self.seed}
        self.metadata = self.pool.metadata
        self.spec = self.pool.spec
        self._seeded = False

    # -- EnvPool's asynchronous calls -------------------------------------------------------------

    def async_reset(self) -> None:
        """Reset every env (seeded the first time); the next ``recv`` returns reset observations."""
        seeds: list[int | None] | None = None if self._seeded else [self.seed + index for index in range(self.num_envs)]
        self.batches.reset(seeds, omit_if_none=RESET_OMIT_IF_NONE)
        self._seeded = True

    def send(self, action: Any, env_id: Any = None) -> None:
        """Actions for the envs ``env_id`` (default: all), which the last ``recv`` calls returned."""
        self.batches.send(action, self.all_env_ids if env_id is None else env_id)

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The first ``batch_size`` envs whose results are in: observations, rewards (float64),
        terminations, truncations and infos (with ``env_id``)."""
        result = self.batches.recv()
        infos = _batch_infos(result.infos, result.env_ids.tolist())
        infos["env_id"] = result.env_ids.astype(np.int32)
        rewards = result.rewards.astype(np.float64)
        return _copy(result.obs), rewards, result.terminated.copy(), result.truncated.copy(), infos

    # -- EnvPool's synchronous calls --------------------------------------------------------------

    def step(self, action: Any, env_id: Any = None) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """``send(action, env_id)`` then ``recv()``."""
        self.send(action, env_id)
        return self.recv()

    def reset(self, env_id: Any = None) -> tuple[Any, dict[str, Any]]:
        """Without ``env_id``: reset every env and return the first batch's observations and infos.
        With it: reset those envs (returned by ``recv``, no action sent yet) and return theirs; they
        then wait for their actions."""
        if env_id is None:
            self.async_reset()
            obs, _, _, _, infos = self.recv()
            return obs, infos
        env_ids = np.asarray(env_id)
        obs, infos_by_env = self.batches.reset_envs(env_ids, omit_if_none=RESET_OMIT_IF_NONE)
        infos = _batch_infos(infos_by_env, env_ids.tolist())
        infos["env_id"] = env_ids.astype(np.int32)
        return obs, infos

    def close(self) -> None:
        self.pool.close()

    @property
    def closed(self) -> bool:
        return self.pool.closed

    def __enter__(self) -> ClusterEnvPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def make_gymnasium(
    task_id: str, num_envs: int = 1, batch_size: int | None = None, seed: int = 42, **kwargs: Any
) -> ClusterEnvPool:
    """Like ``envpool.make_gymnasium``: ``num_envs`` envs of the registered id ``task_id``.

    :param kwargs: ``make_kwargs`` for ``gymnasium.make``, and the pool's options
    """
    return ClusterEnvPool(env_id=task_id, num_envs=num_envs, batch_size=batch_size, seed=seed, **kwargs)
