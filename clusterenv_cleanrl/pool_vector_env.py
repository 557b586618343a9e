"""What ``ClusterVectorEnv`` does the same on gymnasium 1.x and 0.29: the pool, batching
observations, per-env access and closing (the two versions' classes are in
:mod:`clusterenv_cleanrl.vector_env_gymnasium1` and :mod:`clusterenv_cleanrl.vector_env_gymnasium029`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import Any

import gymnasium as gym
from gymnasium.vector.utils import concatenate

from clusterenv_cleanrl.batched_infos import batch_infos
from clusterenv_core import EnvPool, SpaceMismatchError
from clusterenv_core.not_copyable import NotCopyable


def _like(template: Any, batch: Any) -> Any:
    """``batch`` (nested dicts and tuples of arrays) in the container types of ``template``.

    The pool builds plain dicts; ``SyncVectorEnv`` returns what ``create_empty_array`` builds, which
    is an ``OrderedDict`` for ``Dict`` spaces on gymnasium 0.29.
    """
    if isinstance(template, dict):
        return type(template)((key, _like(template[key], batch[key])) for key in template)
    if isinstance(template, tuple):
        return tuple(_like(sub, item) for sub, item in zip(template, batch))
    return batch


def _start_pool(
    env_fns: Sequence[Callable[[], gym.Env]],
    autoreset_mode: str,
    options: dict[str, Any],
    observation_spaces_fit: Callable[[gym.Space, gym.Space], bool] | None = None,
) -> EnvPool:
    try:
        return EnvPool.from_options(env_fns, autoreset_mode, observation_spaces_fit, **options)
    except SpaceMismatchError as error:
        # SyncVectorEnv reports envs whose spaces differ with a RuntimeError.
        raise RuntimeError(str(error)) from error


class _PoolVectorEnv(NotCopyable, gym.vector.VectorEnv):
    """What both gymnasium versions share: the pool, batching observations, per-env access, closing."""

    pool: EnvPool
    copy: bool
    _observations: Any
    _through_wrappers: bool  # gymnasium 1.x looks attributes up with get/set_wrapper_attr, 0.29 with getattr/setattr

    def _batch(self, obs: Any) -> Any:
        """The batched observation ``SyncVectorEnv`` would return for the pool's ``obs``."""
        if isinstance(obs, list):
            # A space without buffers: one value per env, batched as SyncVectorEnv batches them.
            self._observations = concatenate(self.single_observation_space, obs, self._observations)
        else:
            # Views of the pool's buffers, overwritten by the next call; copy=False hands them out as
            # SyncVectorEnv hands out its own buffer.
            self._observations = _like(self._observations, obs)
        return deepcopy(self._observations) if self.copy else self._observations

    def _vector_infos(self, infos_by_index: dict[int, dict]) -> dict[str, Any]:
        """The per-env infos (non-empty ones, by env index) as one dict of arrays with ``_key`` masks."""
        return batch_infos(infos_by_index, self.num_envs, self._add_info)

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call method ``name`` of every env with ``args`` and ``kwargs``, or get it if it is not callable.

        :param name: attribute name, looked up as ``SyncVectorEnv`` looks it up (gymnasium 1.x:
            through the env's wrappers; 0.29: ``getattr``, whose wrappers refuse private names)
        :return: one result per env
        """
        return tuple(self.pool.call(name, args, kwargs, through_wrappers=self._through_wrappers))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Attribute ``name`` of every env (called if callable, as ``SyncVectorEnv`` does).

        :param name: attribute name, looked up as by :meth:`call`
        :return: one value per env
        """
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Set attribute ``name`` of every env.

        :param name: attribute name
        :param values: one value per env as a list or tuple, or any other object for all envs
        :raises ValueError: a list or tuple whose length is not ``num_envs``
        """
        if not isinstance(values, (list, tuple)):
            values = [values for _ in range(self.num_envs)]
        if len(values) != self.num_envs:
            raise ValueError(
                "Values must be a list or tuple with length equal to the number of environments. "
                f"Got `{len(values)}` values for {self.num_envs} environments."
            )
        self.pool.set_attr(name, list(values), through_wrappers=self._through_wrappers)

    def render(self) -> tuple[Any, ...]:
        """The frames rendered by every env."""
        return self.call("render")

    def close_extras(self, **kwargs: Any) -> None:
        """Close the envs and stop the workers."""
        if hasattr(self, "pool"):
            self._observations = None  # views of the pool's shared memory, which close() unmaps
            self.pool.close()

    # gymnasium 1.x vector envs are not context managers; workers are worth a ``with`` block.
    def __enter__(self) -> _PoolVectorEnv:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
