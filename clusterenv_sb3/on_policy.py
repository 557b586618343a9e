"""PPO and A2C with worker-side inference: each worker-collected segment fills SB3's ``RolloutBuffer``.

The learner recomputes values and log-probabilities of the whole segment with its current policy,
and weights each step's advantage by pi_learner / pi_workers (see :class:`PPO`); what the algorithms
share with the off-policy ones is in :mod:`clusterenv_sb3.algorithms`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import stable_baselines3 as sb3
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.utils import obs_as_tensor
from stable_baselines3.common.vec_env import VecEnv

from clusterenv_sb3.algorithms import WorkerInferenceMixin, _copy, _Segment

if TYPE_CHECKING:  # the mixin runs inside SB3's PPO and A2C, whose attributes it uses
    from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm as _OnPolicyBase
else:
    _OnPolicyBase = object


def _flatten(obs: Any, leading: int) -> Any:
    """Merge the first two axes (time, env) into one batch axis."""
    if isinstance(obs, dict):
        return {name: _flatten(value, leading) for name, value in obs.items()}
    return obs.reshape(leading, *obs.shape[2:])


class OnPolicyWorkerInferenceMixin(WorkerInferenceMixin, _OnPolicyBase):
    """On-policy collection (PPO, A2C) from worker-collected segments, filling SB3's ``RolloutBuffer``."""

    max_behaviour_weight: float

    def __init__(
        self, *args: Any, overlap_collection: bool = False, max_behaviour_weight: float = 2.0, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)  # the SB3 algorithm's constructor
        if (
            isinstance(max_behaviour_weight, bool)
            or not isinstance(max_behaviour_weight, (int, float))
            or not (max_behaviour_weight >= 1.0)
        ):
            raise ValueError(
                f"max_behaviour_weight must be a number >= 1 (inf: no truncation), got {max_behaviour_weight!r}"
            )
        self.max_behaviour_weight = float(max_behaviour_weight)
        self._init_worker_inference(overlap_collection)

    def _segment_request(self) -> tuple[int, dict]:
        return self.n_steps, {}

    def collect_rollouts(
        self, env: VecEnv, callback: BaseCallback, rollout_buffer: RolloutBuffer, n_rollout_steps: int
    ) -> bool:
        """Fill ``rollout_buffer`` from one worker-collected segment as SB3's ``collect_rollouts`` would."""
        assert self._last_obs is not None, "No previous observation was provided"
        if n_rollout_steps != self.n_steps:
            raise ValueError(f"segments have n_steps={self.n_steps} steps, {n_rollout_steps} were asked for")
        self.policy.set_training_mode(False)
        n_steps = 0
        rollout_buffer.reset()
        callback.on_rollout_start()

        rollout = self._rollout(env)
        num_envs = env.num_envs
        batch = n_rollout_steps * num_envs
        if rollout.restarted_envs:  # the new envs of a replaced worker start episodes at step 0
            self._last_episode_starts = np.array(self._last_episode_starts, dtype=bool)
            self._last_episode_starts[rollout.restarted_envs] = True
        # The next segment (in the pool's other region) runs while this one is processed and trained on.
        self._start_next_segment(uncounted=batch)
        segment = _Segment(rollout, env)
        flat_actions = th.as_tensor(
            np.asarray(rollout.actions).reshape(batch, -1), dtype=th.float32, device=self.device
        )
        if isinstance(self.action_space, spaces.Discrete):
            flat_actions = flat_actions.long().flatten()  # as SB3's train() hands them to the policy
        with th.no_grad():
            # The learner's critic and log-probabilities on every step of the segment, in one pass.
            all_values, learner_log_probs, _ = self.policy.evaluate_actions(
                obs_as_tensor(_flatten(rollout.obs, batch), self.device), flat_actions
            )
            all_values = all_values.reshape(n_rollout_steps, num_envs, 1)
            all_log_probs = learner_log_probs.reshape(n_rollout_steps, num_envs)
            # Bootstrapping on truncation: gamma * V(terminal observation), one pass for the segment.
            bootstrapped_rewards = rollout.bootstrapped_rewards(
                self.gamma,
                lambda terminal_obs: (
                    self.policy.predict_values(obs_as_tensor(terminal_obs, self.device)).flatten().cpu().numpy()
                ),
            )
        # Decoupled policy gradient: the workers' (possibly stale) policy chose the actions, so each step
        # is weighted by pi_learner / pi_workers, truncated; the learner's log-probs anchor PPO's clip.
        behaviour_weights = np.minimum(
            np.exp(all_log_probs.cpu().numpy() - rollout.log_probs), self.max_behaviour_weight
        ).astype(np.float32)
        sync = self._sync
        if sync.workers_current():
            # Steps taken with the learner's own weights are SB3's on-policy steps, of weight 1
            # exactly: log-probabilities recomputed over the whole segment differ from the workers'
            # in the last bits, as float32 matrix products do with the batch size.
            behaviour_weights[rollout.versions == sync.actors.policy_version] = 1.0

        for t in range(n_rollout_steps):
            obs = rollout.obs_at(t)
            actions = np.array(rollout.actions[t])
            values = all_values[t]
            log_probs = all_log_probs[t]
            clipped_actions = actions
            if isinstance(self.action_space, spaces.Box):
                if self.policy.squash_output:
                    clipped_actions = self.policy.unscale_action(clipped_actions)
                else:
                    clipped_actions = np.clip(actions, self.action_space.low, self.action_space.high)
            rewards, dones, infos = segment.step(t)
            new_obs = segment.next_obs(t)

            self.num_timesteps += env.num_envs

            # Give access to local variables
            callback.update_locals(locals())
            if not callback.on_step():
                self._last_obs = _copy(rollout.last_obs)
                self._last_episode_starts = segment.dones[-1].copy()
                return False

            self._update_info_buffer(infos, dones)
            n_steps += 1

            if isinstance(self.action_space, spaces.Discrete):
                actions = actions.reshape(-1, 1)

            # Handle timeout by bootstrapping with the value function (values computed above), in
            # place as SB3 does: the callbacks' locals hold this array.
            rewards[:] = bootstrapped_rewards[t]
            episode_starts = cast(np.ndarray, self._last_episode_starts)  # set by SB3's _setup_learn
            rollout_buffer.add(obs, actions, rewards, episode_starts, values, log_probs)
            self._last_obs = new_obs
            self._last_episode_starts = dones

        with th.no_grad():
            values = self.policy.predict_values(obs_as_tensor(_copy(rollout.last_obs), self.device))

        rollout_buffer.compute_returns_and_advantage(last_values=values, dones=dones)
        # After the returns (value targets stay unweighted): the policy loss sees weighted advantages.
        rollout_buffer.advantages *= behaviour_weights

        callback.update_locals(locals())
        callback.on_rollout_end()
        return True


class PPO(OnPolicyWorkerInferenceMixin, sb3.PPO):
    """Stable-Baselines3's PPO with worker-side inference (same constructor as ``stable_baselines3.PPO``).

    :param overlap_collection: collect the next segment while training on the current one (the
        workers then act with weights up to one update old)
    :param max_behaviour_weight: truncation of the importance weights pi_learner / pi_workers

    When the workers' weights are stale (AAPS, ``never``, overlap) the segment comes from an older
    policy than the learner's. The loss is then decoupled PPO (Hilton et al., "Batch size-invariance
    for policy optimization"): the ratio and its clip are relative to the learner's policy when the
    segment arrived, and each step's advantage is weighted by pi_learner / pi_workers. With
    up-to-date workers the weights are 1 and this is SB3's PPO. (SB3 normalizes the weighted
    advantages per minibatch.) Clipping against the workers' policy instead would keep the learner
    within the clip range of the deployed weights until the next sync.

    ``env`` must be a bare :class:`~clusterenv_sb3.ClusterVecEnv`. gSDE is not supported.
    """


class A2C(OnPolicyWorkerInferenceMixin, sb3.A2C):
    """Stable-Baselines3's A2C with worker-side inference (same constructor as ``stable_baselines3.A2C``).

    :param overlap_collection: collect the next segment while training on the current one
    :param max_behaviour_weight: truncation of the importance weights pi_learner / pi_workers

    Steps acted by stale weights (AAPS, ``never``, overlap) are importance-weighted by
    pi_learner / pi_workers (truncated), which makes A2C's gradient that of the learner's policy.

    ``env`` must be a bare :class:`~clusterenv_sb3.ClusterVecEnv`. gSDE is not supported.
    """
