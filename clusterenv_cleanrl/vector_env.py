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

from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array

from clusterenv_cleanrl.batched_infos import batch_infos
from clusterenv_core import EnvPool, SpaceMismatchError, StepResult
from clusterenv_core.pool import NotCopyable

GYMNASIUM_1 = int(gym.__version__.split(".")[0]) >= 1

#: The keywords of an env's ``reset`` left out when ``None`` (``EnvPool.reset``'s ``omit_if_none``),
#: as the installed gymnasium's ``SyncVectorEnv`` leaves them out: 1.x passes ``seed=`` and
#: ``options=`` always, 0.29 each only when not ``None``.
RESET_OMIT_IF_NONE: tuple[str, ...] = () if GYMNASIUM_1 else ("seed", "options")


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


if GYMNASIUM_1:
    from gymnasium.spaces.utils import is_space_dtype_shape_equiv
    from gymnasium.vector import AutoresetMode
    from gymnasium.vector.utils import batch_differing_spaces, batch_space

    _POOL_MODES = {
        AutoresetMode.NEXT_STEP: "next_step",
        AutoresetMode.SAME_STEP: "same_step",
        AutoresetMode.DISABLED: "disabled",
    }

    class ClusterVectorEnv(_PoolVectorEnv):
        """Drop-in for gymnasium 1.x's ``SyncVectorEnv``: same results, environments on ClusterEnv workers.

        :param env_fns: callables that build the environments (closures work: they are cloudpickled)
        :param copy: return copies of the observations; with ``False``, the returned observations are
            overwritten by the next ``step`` or ``reset``
        :param observation_mode: ``"same"``, ``"different"`` or a ``(batched, single)`` pair of spaces,
            as in ``SyncVectorEnv``: with the latter two, the envs' observation spaces need only share
            their dtype and shape (Box bounds may differ)
        :param autoreset_mode: a ``gymnasium.vector.AutoresetMode`` or its value
        :param options: ClusterEnv's keywords: the pool's ``backend``, ``num_workers``, ``timeout``,
            ``restart_failed_envs``, ``restart_failed_workers`` and ``max_restarts`` (see
            :class:`~clusterenv_core.pool.EnvPool`), and any option of the backend (its transport class)

        A replaced env or worker ends its episodes as truncated, with the reason under the info key
        ``"clusterenv_restart"``; ``self.pool.restarts`` counts restarts.
        """

        def __init__(
            self,
            env_fns: Sequence[Callable[[], gym.Env]],
            copy: bool = True,
            observation_mode: str | tuple[gym.Space, gym.Space] = "same",
            autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
            **options: Any,
        ) -> None:
            custom_spaces = isinstance(observation_mode, tuple) and len(observation_mode) == 2
            if custom_spaces:
                if not isinstance(observation_mode[0], gym.Space) or not isinstance(observation_mode[1], gym.Space):
                    raise TypeError(
                        "Expected both elements of observation_mode to be Spaces, "
                        f"got {type(observation_mode[0])} and {type(observation_mode[1])}"
                    )
            elif observation_mode not in ("same", "different"):
                raise ValueError(
                    "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single and batch "
                    f"observation space, actual got {observation_mode}"
                )
            self.env_fns = env_fns
            self.copy = copy
            self.observation_mode = observation_mode
            self.autoreset_mode = AutoresetMode(autoreset_mode)
            self._through_wrappers = True
            # As SyncVectorEnv: equal observation spaces for "same", else only a common dtype and shape.
            fit = None if observation_mode == "same" else is_space_dtype_shape_equiv
            self.pool = _start_pool(env_fns, _POOL_MODES[self.autoreset_mode], options, fit)
            try:
                self._describe(observation_mode, custom_spaces)
            except BaseException:
                self.pool.close()
                raise

        def _describe(self, observation_mode: Any, custom_spaces: bool) -> None:
            pool = self.pool
            self.num_envs = pool.num_envs
            # A copy, so the envs' (class-level) metadata is not modified.
            self.metadata = dict(pool.metadata)
            self.metadata["autoreset_mode"] = self.autoreset_mode
            self.render_mode = pool.render_mode
            self.single_action_space = pool.action_space
            self.action_space = batch_space(self.single_action_space, self.num_envs)
            if custom_spaces:
                self.observation_space, self.single_observation_space = observation_mode
            else:
                self.single_observation_space = pool.observation_space
                if observation_mode == "same":
                    self.observation_space = batch_space(self.single_observation_space, self.num_envs)
                else:
                    self.observation_space = batch_differing_spaces(pool.observation_spaces)
            if observation_mode != "same" and not is_space_dtype_shape_equiv(
                pool.observation_space, self.single_observation_space
            ):
                raise RuntimeError(
                    "ClusterVectorEnv(..., observation_mode='different' or custom space) however the "
                    "sub-environments observation spaces do not share a common shape and dtype, "
                    f"single_observation_space={self.single_observation_space}, "
                    f"sub-environment observation space={pool.observation_space}"
                )
            self._observations = create_empty_array(self.single_observation_space, n=self.num_envs, fn=np.zeros)
            # Envs whose episode ended at the last step; stepping them is an error in DISABLED mode.
            self._autoreset_envs = np.zeros((self.num_envs,), dtype=np.bool_)

        @property
        def np_random_seed(self) -> tuple[int, ...]:
            """The ``np_random_seed`` of every env."""
            return self.get_attr("np_random_seed")

        @property
        def np_random(self) -> tuple[np.random.Generator, ...]:
            """Copies of the random number generators of every env."""
            return self.get_attr("np_random")

        def reset(
            self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
        ) -> tuple[Any, dict[str, Any]]:
            """Reset the envs (those of ``options["reset_mask"]`` only, if given).

            :param seed: ``None``, an int (env ``i`` gets ``seed + i``) or one seed (or ``None``) per env
            :param options: options for every env's reset; ``options["reset_mask"]``, a bool array of
                shape ``(num_envs,)``, selects the envs to reset and is removed from ``options``
            :return: the batched observations and infos
            """
            if seed is None:
                seed = [None for _ in range(self.num_envs)]
            elif isinstance(seed, int):
                seed = [seed + i for i in range(self.num_envs)]
            if len(seed) != self.num_envs:
                raise ValueError(
                    f"If seeds are passed as a list the length must match num_envs={self.num_envs} "
                    f"but got length={len(seed)}."
                )
            reset_mask = None
            # Popped from the caller's dict, as SyncVectorEnv does; the other options reach every env.
            if options is not None and "reset_mask" in options:
                reset_mask = options.pop("reset_mask")
                self._check_reset_mask(reset_mask)
            result = self.pool.reset(
                seeds=seed, options=[options] * self.num_envs, mask=reset_mask, omit_if_none=RESET_OMIT_IF_NONE
            )
            self._autoreset_envs[slice(None) if reset_mask is None else reset_mask] = False
            return self._batch(result.obs), self._vector_infos(result.infos)

        def _check_reset_mask(self, reset_mask: Any) -> None:
            if not isinstance(reset_mask, np.ndarray):
                raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(reset_mask)}")
            if reset_mask.shape != (self.num_envs,):
                raise ValueError(
                    f"`options['reset_mask']` must have shape `({self.num_envs},)`, got {reset_mask.shape}"
                )
            if reset_mask.dtype != np.bool_:
                raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {reset_mask.dtype}")
            if not np.any(reset_mask):
                raise ValueError(
                    "`options['reset_mask']` must contain a boolean array with at least one True value, "
                    f"got reset_mask={reset_mask}"
                )

        def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
            """Step every env with its action.

            :param actions: a batch of ``single_action_space`` actions (an element of ``action_space``)
            :return: batched observations, rewards (float64), terminations, truncations and infos
            :raises ValueError: actions of the wrong shape or type, before any env is stepped
            :raises AssertionError: in ``DISABLED`` mode, an env whose episode ended has not been reset
            """
            if self.autoreset_mode == AutoresetMode.DISABLED and self._autoreset_envs.any():
                # SyncVectorEnv asserts the same, but only after stepping the envs before the first such env.
                raise AssertionError(
                    f"envs {np.flatnonzero(self._autoreset_envs).tolist()} ended their episodes and "
                    "autoreset is disabled: reset them with reset(options={'reset_mask': mask}) first"
                )
            result = self.pool.step(actions)
            terminations, truncations = result.terminated.copy(), result.truncated.copy()
            self._autoreset_envs = terminations | truncations
            if self.autoreset_mode == AutoresetMode.SAME_STEP:
                infos = self._same_step_infos(result, self._autoreset_envs)
            else:
                infos = self._vector_infos(result.infos)
            return self._batch(result.obs), result.rewards.copy(), terminations, truncations, infos

        def _same_step_infos(self, result: StepResult, done: np.ndarray) -> dict[str, Any]:
            if not done.any():
                return self._vector_infos(result.infos)
            # Per env in index order: the final observation and step info of an ended episode, then
            # the info of its reset (or the step info if it did not end), as SyncVectorEnv adds them.
            infos: dict[str, Any] = {}
            for index in sorted(set(result.infos).union(np.flatnonzero(done).tolist())):
                info = result.infos.get(index, {})
                if done[index]:
                    final = {"final_obs": result.final_observation(index), "final_info": info}
                    infos = self._add_info(infos, final, index)
                    info = result.reset_infos.get(index, {})
                infos = self._add_info(infos, info, index)
            return infos

else:

    class ClusterVectorEnv(_PoolVectorEnv):  # type: ignore[no-redef]
        """Drop-in for gymnasium 0.29's ``SyncVectorEnv``: same results, environments on ClusterEnv workers.

        Episodes reset in the step that ends them; the infos then hold ``final_observation`` and
        ``final_info`` for those envs.

        :param env_fns: callables that build the environments (closures work: they are cloudpickled)
        :param observation_space: observation space of one env (default: that of the envs)
        :param action_space: action space of one env (default: that of the envs)
        :param copy: return copies of the observations; with ``False``, the returned observations are
            overwritten by the next ``step`` or ``reset``, already from its ``step_async`` on (where
            ``SyncVectorEnv`` writes them in ``step_wait``; ``AsyncVectorEnv`` is like ClusterEnv), so
            keep what you need of them before you call ``step_async``
        :param options: ClusterEnv's keywords: the pool's ``backend``, ``num_workers``, ``timeout``,
            ``restart_failed_envs``, ``restart_failed_workers`` and ``max_restarts`` (see
            :class:`~clusterenv_core.pool.EnvPool`), and any option of the backend (its transport class)

        A replaced env or worker ends its episodes as truncated, with the reason under the info key
        ``"clusterenv_restart"``; ``self.pool.restarts`` counts restarts.
        """

        def __init__(
            self,
            env_fns: Sequence[Callable[[], gym.Env]],
            observation_space: gym.Space | None = None,
            action_space: gym.Space | None = None,
            copy: bool = True,
            **options: Any,
        ) -> None:
            self.env_fns = env_fns
            self.copy = copy
            self._through_wrappers = False
            self.pool = _start_pool(env_fns, "same_step", options)
            try:
                self._describe(observation_space, action_space)
            except BaseException:
                self.pool.close()
                raise

        def _describe(self, observation_space: gym.Space | None, action_space: gym.Space | None) -> None:
            pool = self.pool
            self.metadata = pool.metadata
            super().__init__(
                num_envs=pool.num_envs,
                observation_space=pool.observation_space if observation_space is None else observation_space,
                action_space=pool.action_space if action_space is None else action_space,
            )
            # The pool has checked that every env has the spaces of the first.
            if pool.observation_space != self.single_observation_space:
                raise RuntimeError(
                    "Some environments have an observation space different from "
                    f"`{self.single_observation_space}`. In order to batch observations, "
                    "the observation spaces from all environments must be equal."
                )
            if pool.action_space != self.single_action_space:
                raise RuntimeError(
                    "Some environments have an action space different from "
                    f"`{self.single_action_space}`. In order to batch actions, the "
                    "action spaces from all environments must be equal."
                )
            self._observations = create_empty_array(self.single_observation_space, n=self.num_envs, fn=np.zeros)

        def reset_wait(
            self, seed: int | list[int | None] | None = None, options: dict | None = None
        ) -> tuple[Any, dict[str, Any]]:
            """Reset every env.

            :param seed: ``None``, an int (env ``i`` gets ``seed + i``) or one seed (or ``None``) per env
            :param options: options for every env's reset
            :return: the batched observations and infos
            """
            if seed is None:
                seed = [None for _ in range(self.num_envs)]
            if isinstance(seed, int):
                seed = [seed + i for i in range(self.num_envs)]
            assert len(seed) == self.num_envs  # the AssertionError SyncVectorEnv raises
            result = self.pool.reset(seeds=seed, options=[options] * self.num_envs, omit_if_none=RESET_OMIT_IF_NONE)
            return self._batch(result.obs), self._vector_infos(result.infos)

        def step_async(self, actions: Any) -> None:
            """Start stepping every env with its action; returns at once.

            :param actions: a batch of ``single_action_space`` actions (an element of ``action_space``)
            :raises ValueError: actions of the wrong shape or type, before any env is stepped
            """
            self.pool.step_async(actions)

        def step_wait(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
            """Wait for the step started by :meth:`step_async`.

            :return: batched observations, rewards (float64), terminations, truncations and infos
            """
            result = self.pool.step_wait()
            done = result.terminated | result.truncated
            if not done.any():
                return self._step_result(result, self._vector_infos(result.infos))
            infos: dict[str, Any] = {}
            for index in sorted(set(result.infos).union(np.flatnonzero(done).tolist())):
                info = result.infos.get(index, {})
                if done[index]:
                    # As SyncVectorEnv: the reset's info, with the ended episode's last observation and info.
                    info, final_info = result.reset_infos.get(index, {}), info
                    info["final_observation"] = result.final_observation(index)
                    info["final_info"] = final_info
                infos = self._add_info(infos, info, index)
            return self._step_result(result, infos)

        def _step_result(self, result: StepResult, infos: dict[str, Any]) -> tuple:
            return (
                self._batch(result.obs),
                result.rewards.copy(),
                result.terminated.copy(),
                result.truncated.copy(),
                infos,
            )
