"""``ClusterVectorEnv`` for gymnasium 0.29, the version CleanRL pins: its ``SyncVectorEnv``, resetting
in the same step (see :mod:`clusterenv_cleanrl.vector_env`, which picks this module or the 1.x one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import create_empty_array

from clusterenv_cleanrl.pool_vector_env import _PoolVectorEnv, _start_pool
from clusterenv_core import StepResult

#: The keywords of an env's ``reset`` left out when ``None`` (``EnvPool.reset``'s ``omit_if_none``):
#: gymnasium 0.29's ``SyncVectorEnv`` passes ``seed=`` and ``options=`` each only when not ``None``.
RESET_OMIT_IF_NONE: tuple[str, ...] = ("seed", "options")


class ClusterVectorEnv(_PoolVectorEnv):
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
    :param options: ClusterEnv's keywords: the pool's (:data:`~clusterenv_core.pool.POOL_OPTIONS`, see
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
        # gymnasium 0.29's VectorEnv.__init__ takes these; the type checker runs with 1.x's, which has none.
        super().__init__(  # type: ignore[call-arg]
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
