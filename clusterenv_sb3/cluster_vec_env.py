"""``ClusterVecEnv``: a Stable-Baselines3 ``VecEnv`` whose environments run on ClusterEnv workers."""

from __future__ import annotations

import multiprocessing
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from stable_baselines3.common.preprocessing import check_for_nested_spaces
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn

from clusterenv_core import EnvPool
from clusterenv_core.not_copyable import NotCopyable


class ClusterVecEnv(NotCopyable, VecEnv):
    """Drop-in for ``DummyVecEnv``/``SubprocVecEnv``: same results as ``DummyVecEnv``, envs on workers.

    ``step_async`` returns at once while the workers step their blocks of envs in parallel. Episodes
    reset automatically as in ``DummyVecEnv``: the info of a finished env holds
    ``terminal_observation`` and ``TimeLimit.truncated``, and ``reset_infos`` the reset's info.
    Envs receive actions in the dtype they are passed in, and their ``reset`` gets ``seed=`` and,
    only when set, ``options=``, as from ``DummyVecEnv``.

    :param env_fns: callables that build the environments (closures work: they are cloudpickled)
    :param options: ClusterEnv's keywords: the pool's (:data:`~clusterenv_core.pool.POOL_OPTIONS`, see
        :class:`~clusterenv_core.pool.EnvPool`), and any option of the backend (its transport class)
    :param start_method: ``SubprocVecEnv``'s keyword, accepted so that code passing it runs unchanged.
        Workers are always fresh interpreters that receive the cloudpickled factories, whatever the
        method: what ``"spawn"`` or ``"forkserver"`` give ``SubprocVecEnv``.

    A replaced env or worker ends its episodes as truncated (``TimeLimit.truncated`` is ``True`` and
    ``terminal_observation`` is the last observation before the failure), with the reason under the
    info key ``"clusterenv_restart"``; ``self.pool.restarts`` counts restarts.
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], start_method: str | None = None, **options: Any) -> None:
        if start_method is not None and start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"start_method must be one of {multiprocessing.get_all_start_methods()} or None, got {start_method!r}"
            )
        self.pool = EnvPool.from_options(env_fns, autoreset_mode="same_step", **options)
        try:
            # Nested Dict/Tuple observations: refused with DummyVecEnv's error, as SB3 supports none.
            check_for_nested_spaces(self.pool.observation_space)
            super().__init__(self.pool.num_envs, self.pool.observation_space, self.pool.action_space)
        except BaseException:
            self.pool.close()
            raise
        self.metadata = self.pool.metadata

    def step_async(self, actions: np.ndarray | Sequence[Any]) -> None:
        # As DummyVecEnv, actions[i] is env i's action (a list of dicts for a Dict space, ...).
        self.pool.step_async(actions, per_env=True)

    def step_wait(self) -> VecEnvStepReturn:
        result = self.pool.step_wait()
        dones = result.terminated | result.truncated
        # DummyVecEnv's info per env: the env's own keys, then TimeLimit.truncated, then the
        # terminal observation of a finished episode. Built per kind of env, not per env and key.
        timeouts = (result.truncated & ~result.terminated).tolist()
        infos: list[dict[str, Any]] = [{"TimeLimit.truncated": timeout} for timeout in timeouts]
        for index, info in result.infos.items():
            info["TimeLimit.truncated"] = timeouts[index]
            infos[index] = info
        for index in dones.nonzero()[0].tolist():  # not np.flatnonzero, whose wrappers add 1 µs a step
            infos[index]["terminal_observation"] = result.final_observation(index)
            self.reset_infos[index] = result.reset_infos.get(index, {})
        # DummyVecEnv keeps rewards in a float32 buffer.
        return self._copy_obs(result.obs), result.rewards.astype(np.float32), dones, infos

    def reset(self) -> VecEnvObs:
        # As DummyVecEnv and SubprocVecEnv: seed= always, options= only when set (not empty).
        options = [options or None for options in self._options]
        result = self.pool.reset(seeds=self._seeds, options=options, omit_if_none=("options",))
        self.reset_infos = [result.infos.get(index, {}) for index in range(self.num_envs)]
        # Seeds and options are used once, as in DummyVecEnv.
        self._reset_seeds()
        self._reset_options()
        return self._copy_obs(result.obs)

    def _copy_obs(self, obs: Any) -> VecEnvObs:
        if isinstance(obs, dict):
            return OrderedDict((key, value.copy()) for key, value in obs.items())
        if isinstance(obs, tuple):
            return tuple(value.copy() for value in obs)
        return obs.copy()

    def close(self) -> None:
        self.pool.close()

    # SB3's VecEnvs are not context managers; workers are worth a ``with`` block.
    def __enter__(self) -> ClusterVecEnv:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def get_images(self) -> Sequence[np.ndarray | None]:
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is `rgb_array` to obtain images."
            )
            return [None for _ in range(self.num_envs)]
        return self.pool.call("render")

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        return self.pool.get_attr(attr_name, indices=self._get_indices(indices))

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        target = list(self._get_indices(indices))
        self.pool.set_attr(attr_name, [value] * len(target), indices=target)

    def env_method(self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **method_kwargs: Any) -> list[Any]:
        return self.pool.call(
            method_name, method_args, method_kwargs, indices=self._get_indices(indices), require_callable=True
        )

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        return self.pool.env_is_wrapped(wrapper_class, indices=self._get_indices(indices))
