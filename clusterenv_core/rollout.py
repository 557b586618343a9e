"""Rollout segments: what workers collect with their policy copy, laid out for one message per worker.

A segment of ``n_steps`` lives in a region whose arrays are env-major, ``(num_envs, n_steps, ...)``,
so a worker's block of envs is one contiguous slice; :class:`Rollout` presents them time-major,
``(n_steps, num_envs, ...)``, as RL code indexes rollouts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clusterenv_core.buffers import BatchSpec, Field
from clusterenv_core.spaces import SpaceLayout

STEP_FIELDS = ("rewards", "terminated", "truncated", "log_probs", "values", "versions")


def rollout_fields(spec: BatchSpec, n_steps: int) -> list[Field]:
    """Fields of a segment, per env: observations before each step, final observations, the
    observation after the last step, actions, and the per-step scalars."""
    obs, final_obs, act = spec.layouts()
    fields = [Field(f"r.{f.name}", (n_steps, *f.shape), f.dtype) for f in [*obs.fields, *final_obs.fields]]
    fields += [Field(f"r.last_{f.name}", f.shape, f.dtype) for f in obs.fields]
    fields += [Field(f"r.{f.name}", (n_steps, *f.shape), f.dtype) for f in act.fields]
    dtypes = {"rewards": np.float64, "terminated": np.bool_, "truncated": np.bool_, "log_probs": np.float32}
    dtypes.update(values=np.float32, versions=np.int64)
    fields += [Field(f"r.{name}", (n_steps,), np.dtype(dtypes[name])) for name in STEP_FIELDS]
    return fields


class RolloutArrays:
    """Named env-major views of a segment region.

    :param arrays: views made from :func:`rollout_fields`
    :param obs_layout: layout of the observation space
    :param act_layout: layout of the action space
    :param handle: the region's handle from the backend (learner side)
    :param row0: the row of the worker's first env in the views (worker side)
    """

    # The per-step fields (STEP_FIELDS), set by name in __init__.
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    versions: np.ndarray

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        obs_layout: SpaceLayout,
        act_layout: SpaceLayout,
        handle: Any = None,
        row0: int = 0,
    ) -> None:
        self.handle = handle
        self.row0 = row0
        self.all = list(arrays.values())
        self.obs = [arrays[f"r.{f.name}"] for f in obs_layout.fields]
        self.final_obs = [arrays[f"r.final_{f.name}"] for f in obs_layout.fields]
        self.last_obs = [arrays[f"r.last_{f.name}"] for f in obs_layout.fields]
        self.actions = [arrays[f"r.{f.name}"] for f in act_layout.fields]
        for name in STEP_FIELDS:
            setattr(self, name, arrays[f"r.{name}"])


@dataclass
class Rollout:
    """A collected segment, time-major: arrays are ``(n_steps, num_envs, ...)`` views of the region
    (valid until the pool reuses it two segments later; copy what you keep longer).

    ``obs[t]`` is what the policy saw at step ``t``, ``actions[t]`` what it chose, ``rewards[t]``,
    ``terminated[t]``, ``truncated[t]`` what the env returned; after an episode end the next
    observation is already the reset one (``same_step`` autoreset) and the last one is
    :meth:`final_observation`. ``last_obs`` follows the last step. ``versions[t]`` is the weights
    version each step acted with; ``log_probs``/``values`` are zeros unless the policy returns them.
    ``collect_seconds`` is the longest time a worker spent collecting its part (stepping its envs
    and acting): beside the time the learner waited, it tells who waits for whom.
    ``restarted_envs`` are the envs of workers lost during the segment and replaced
    (``restart_failed_workers``): their part of it comes from new envs, reset (unseeded) before
    step 0, which starts an episode, and step 0's info says why under ``"clusterenv_restart"``.
    The episodes they were in ended, unflagged, where the previous segment ended.
    ``arrays`` are the env-major views of the region itself, laid out as :func:`rollout_fields`
    says (a node agent copies them into its learner's region as they are).
    """

    obs: Any
    actions: Any
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    versions: np.ndarray
    last_obs: Any
    infos: list[dict[int, dict]]
    reset_infos: list[dict[int, dict]]
    collect_seconds: float = 0.0
    pickled_final_obs: dict[tuple[int, int], Any] = field(default_factory=dict)
    restarted_envs: list[int] = field(default_factory=list)
    arrays: RolloutArrays | None = None
    _final_obs: list[np.ndarray] = field(default_factory=list)
    _obs_layout: SpaceLayout | None = None

    @property
    def n_steps(self) -> int:
        return self.rewards.shape[0]

    def final_observation(self, step: int, index: int) -> Any:
        """The last observation of the episode env ``index`` ended at ``step``."""
        if (step, index) in self.pickled_final_obs:
            return self.pickled_final_obs[(step, index)]
        if self._obs_layout is None:  # a Rollout made without a region (by hand): only pickled ones
            raise KeyError(f"no final observation of env {index} at step {step}")
        return self._obs_layout.read([array[step] for array in self._final_obs], index)

    # -- what learners derive from a segment, the same for every adapter --------------------------

    @property
    def dones(self) -> np.ndarray:
        """``(n_steps, num_envs)``: where an episode ended, terminated or truncated."""
        return self.terminated | self.truncated

    @property
    def timeouts(self) -> np.ndarray:
        """``(n_steps, num_envs)``: where an episode was truncated and not terminated (a time limit,
        a restart): its return goes on past the end, so learners bootstrap from the final observation."""
        return self.truncated & ~self.terminated

    def obs_at(self, step: int) -> Any:
        """What the policy saw at ``step``, for every env (views)."""
        return _map(lambda array: array[step], self.obs)

    def obs_after(self, step: int) -> Any:
        """The observation each env returned at ``step`` (views): the reset one where an episode
        ended, since segments reset in the same step."""
        return self.obs_at(step + 1) if step + 1 < self.n_steps else self.last_obs

    def final_observations(self, steps: np.ndarray, envs: np.ndarray) -> Any:
        """The final observations of the episodes ``envs[k]`` ended at ``steps[k]``, stacked (copies)."""
        return _stack([self.final_observation(int(step), int(env)) for step, env in zip(steps, envs)])

    def next_observations(self) -> Any:
        """Time-major copies of each step's next observation as a transition has it: the episode's
        final observation where it ended, else the observation after the step."""
        next_obs = _map(lambda obs, last: np.concatenate([obs[1:], np.asarray(last)[None]]), self.obs, self.last_obs)
        steps, envs = np.nonzero(self.dones)
        if len(steps):
            finals = self.final_observations(steps, envs)

            def place(array: np.ndarray, final: np.ndarray) -> np.ndarray:
                array[steps, envs] = final
                return array

            next_obs = _map(place, next_obs, finals)
        return next_obs

    def bootstrapped_rewards(self, gamma: float, values: Callable[[Any], np.ndarray]) -> np.ndarray:
        """The rewards as float32 (as SB3's buffers and CleanRL's tensors hold them), with
        ``gamma * V(final observation)`` added at :attr:`timeouts`.

        :param gamma: the discount
        :param values: the learner's values (a float32 array, one per observation) of a batch of
            stacked final observations; not called when no episode timed out
        """
        rewards = self.rewards.astype(np.float32)
        steps, envs = np.nonzero(self.timeouts)
        if len(steps):
            rewards[steps, envs] += gamma * values(self.final_observations(steps, envs))
        return rewards


def _map(function: Callable[..., Any], value: Any, *others: Any) -> Any:
    """``function`` applied to the arrays of one or more observations of the same structure (nested
    dicts and tuples), leaf by leaf."""
    if isinstance(value, dict):
        return {key: _map(function, value[key], *(other[key] for other in others)) for key in value}
    if isinstance(value, tuple):
        return tuple(_map(function, *items) for items in zip(value, *others))
    return function(value, *others)


def _stack(observations: list[Any]) -> Any:
    """One batch of ``observations`` (each a value of the space): arrays stacked leaf by leaf."""
    return _map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *observations)


def time_major(layout: SpaceLayout, arrays: list[np.ndarray]) -> Any:
    """The batched structure of ``layout`` over env-major arrays, with time first."""
    return layout.batch([array.swapaxes(0, 1) for array in arrays])
