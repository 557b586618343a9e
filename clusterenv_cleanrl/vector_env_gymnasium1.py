"""``ClusterVectorEnv`` for gymnasium 1.x: its ``SyncVectorEnv``, with the three autoreset modes and
partial resets (see :mod:`clusterenv_cleanrl.vector_env`, which picks this module or the 0.29 one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_differing_spaces, batch_space, create_empty_array

from clusterenv_cleanrl.pool_vector_env import _PoolVectorEnv, _start_pool
from clusterenv_core import StepResult

#: The keywords of an env's ``reset`` left out when ``None`` (``EnvPool.reset``'s ``omit_if_none``):
#: none, as gymnasium 1.x's ``SyncVectorEnv`` passes ``seed=`` and ``options=`` always.
RESET_OMIT_IF_NONE: tuple[str, ...] = ()

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
    :param options: ClusterEnv's keywords: the pool's (:data:`~clusterenv_core.pool.POOL_OPTIONS`, see
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

    # One per env, as SyncVectorEnv's (which VectorEnv's types, one for the whole vector env, do not allow).
    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """The ``np_random_seed`` of every env."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]  # read-only, as SyncVectorEnv's
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
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
            raise ValueError(f"`options['reset_mask']` must have shape `({self.num_envs},)`, got {reset_mask.shape}")
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
