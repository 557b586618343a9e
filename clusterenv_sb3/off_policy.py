"""DQN, SAC and TD3 with worker-side inference: each ``train_freq`` segment the workers collect goes
into SB3's replay buffer, transition by transition.

DQN's exploration rate, and SAC's and TD3's warm-up and exploration noise, travel to the workers as
the segment's context; what the algorithms share with the on-policy ones is in
:mod:`clusterenv_sb3.algorithms`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import stable_baselines3 as sb3
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.noise import NormalActionNoise, VectorizedActionNoise
from stable_baselines3.common.type_aliases import RolloutReturn, TrainFreq, TrainFrequencyUnit
from stable_baselines3.common.vec_env import VecEnv

from clusterenv_sb3.algorithms import WorkerInferenceMixin, _copy, _Segment
from clusterenv_sb3.policies import TD3ActorDeployable

if TYPE_CHECKING:  # the mixin runs inside SB3's DQN, SAC and TD3, whose attributes it uses
    from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm as _OffPolicyBase
else:
    _OffPolicyBase = object


class OffPolicyWorkerInferenceMixin(WorkerInferenceMixin, _OffPolicyBase):
    """Off-policy collection (DQN, SAC, TD3): segments of ``train_freq`` steps stored in SB3's replay
    buffer, transition by transition, as SB3's ``collect_rollouts`` stores them."""

    def __init__(self, *args: Any, overlap_collection: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # the SB3 algorithm's constructor
        self._init_worker_inference(overlap_collection)
        if isinstance(self.train_freq, TrainFreq):  # converted by _setup_model (not when loading)
            self._segment_request()  # refuses what the workers cannot do now rather than at learn()

    def _segment_steps(self) -> int:
        train_freq = self.train_freq
        if not isinstance(train_freq, TrainFreq) or train_freq.unit != TrainFrequencyUnit.STEP:
            raise NotImplementedError(
                f"clusterenv_sb3.{self._algorithm_name()} collects fixed-length segments: train_freq must count "
                f"steps, got {train_freq}; use stable_baselines3.{self._algorithm_name()} for train_freq in episodes"
            )
        return int(train_freq.frequency)

    def collect_rollouts(
        self,
        env: VecEnv,
        callback: BaseCallback,
        train_freq: TrainFreq,
        replay_buffer: ReplayBuffer,
        action_noise: Any = None,
        learning_starts: int = 0,
        log_interval: int | None = None,
    ) -> RolloutReturn:
        """Store one worker-collected segment in ``replay_buffer`` as SB3's ``collect_rollouts`` would."""
        self.policy.set_training_mode(False)
        num_collected_steps, num_collected_episodes = 0, 0
        if train_freq.unit != TrainFrequencyUnit.STEP or train_freq != self.train_freq:
            raise NotImplementedError(
                f"segments follow the model's train_freq in steps ({self.train_freq}), got {train_freq}"
            )
        callback.on_rollout_start()

        rollout = self._rollout(env)
        segment = _Segment(rollout, env)
        self._last_obs = _copy(rollout.obs_at(0))
        for t in range(rollout.n_steps):
            buffer_actions = np.array(rollout.actions[t])  # what the replay buffer stores (scaled)
            # What the envs got, as SB3's _sample_action gives it to callbacks.
            actions = (
                self.policy.unscale_action(buffer_actions)
                if isinstance(self.action_space, spaces.Box)
                else buffer_actions
            )
            new_obs = segment.next_obs(t)
            rewards, dones, infos = segment.step(t)

            self.num_timesteps += env.num_envs
            num_collected_steps += 1

            # Give access to local variables
            callback.update_locals(locals())
            if not callback.on_step():
                self._last_obs = _copy(rollout.last_obs)
                return RolloutReturn(
                    num_collected_steps * env.num_envs, num_collected_episodes, continue_training=False
                )

            self._update_info_buffer(infos, dones)
            # Stores the transition from self._last_obs and moves self._last_obs to new_obs.
            self._store_transition(replay_buffer, buffer_actions, new_obs, rewards, dones, infos)
            self._update_current_progress_remaining(self.num_timesteps, self._total_timesteps)
            # Target network updates and the exploration schedule, per env step as in SB3.
            self._on_step()

            for done in dones:
                if done:
                    num_collected_episodes += 1
                    self._episode_num += 1
                    if log_interval is not None and self._episode_num % log_interval == 0:
                        self.dump_logs()
        callback.on_rollout_end()
        self._start_next_segment()
        return RolloutReturn(num_collected_steps * env.num_envs, num_collected_episodes, continue_training=True)


class DQN(OffPolicyWorkerInferenceMixin, sb3.DQN):
    """Stable-Baselines3's DQN with worker-side inference (same constructor as ``stable_baselines3.DQN``).

    :param overlap_collection: collect the next ``train_freq`` segment while training

    Workers act epsilon-greedily with the exploration rate of the segment's start (one random draw
    per env and step); ``train_freq`` must count steps (episodes: ``NotImplementedError``).
    ``env`` must be a bare :class:`~clusterenv_sb3.ClusterVecEnv`.
    """

    def _acting_policy(self) -> th.nn.Module:
        return self.policy.q_net

    def _segment_request(self) -> tuple[int, dict]:
        steps = self._segment_steps()
        if self.num_timesteps < self.learning_starts:
            epsilon = 1.0  # SB3 samples uniformly before learning starts
        else:
            epsilon = float(self.exploration_schedule(self._current_progress_remaining))
        return steps, {"epsilon": epsilon}


def _noise_parameters(action_noise: Any, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(mean, sigma)`` of SB3 action noise that the workers can draw themselves, of the action
    space's ``shape``: Gaussian (``NormalActionNoise``, or SB3's ``VectorizedActionNoise`` of one,
    which is per env anyway)."""
    if action_noise is None:
        return None
    base = action_noise.base_noise if isinstance(action_noise, VectorizedActionNoise) else action_noise
    if not isinstance(base, NormalActionNoise):
        raise ValueError(
            f"{type(base).__name__} cannot run on the workers (only NormalActionNoise, a draw per env and step, "
            "which needs no state): use NormalActionNoise, or stable_baselines3's algorithm on the ClusterVecEnv"
        )
    return np.broadcast_to(base._mu, shape).astype(np.float64), np.broadcast_to(base._sigma, shape).astype(np.float64)


def _box_shape(space: spaces.Space) -> tuple[int, ...]:
    """The shape of SAC's and TD3's action space, a Box (their constructors refuse others)."""
    return cast(spaces.Box, space).shape


class _ActorWorkerInferenceMixin(OffPolicyWorkerInferenceMixin):
    """SAC and TD3 (whose constructors refuse action spaces other than Box): the actor acts on the
    workers; warm-up and exploration noise travel as the context."""

    def _acting_policy(self) -> th.nn.Module:
        return cast(th.nn.Module, self.policy.actor)

    def _segment_request(self) -> tuple[int, dict]:
        steps = self._segment_steps()
        noise = _noise_parameters(self.action_noise, _box_shape(self.action_space))
        # SB3 samples uniformly before learning starts (decided here per segment, as DQN's rate).
        return steps, {"random": self.num_timesteps < self.learning_starts, "noise": noise}


class SAC(_ActorWorkerInferenceMixin, sb3.SAC):
    """Stable-Baselines3's SAC with its actor on the workers (same constructor as ``stable_baselines3.SAC``).

    :param overlap_collection: collect the next ``train_freq`` segment while training

    Only the actor travels (never the critics, the entropy coefficient or the replay buffer). The
    workers sample the squashed Gaussian, and before ``learning_starts`` draw uniform actions from
    the Box; ``action_noise`` may be SB3's ``NormalActionNoise`` (drawn per env on the workers).
    Transitions fill SB3's replay buffer as its ``collect_rollouts`` would (terminal observations,
    timeouts for ``handle_timeout_termination``); ``train_freq`` must count steps, and the warm-up
    is decided per segment. AAPS compares the actors' Gaussians before the tanh (the KL of the
    squashed ones is the same). ``env`` must be a bare :class:`~clusterenv_sb3.ClusterVecEnv`; gSDE
    is not supported.
    """


class TD3(_ActorWorkerInferenceMixin, sb3.TD3):
    """Stable-Baselines3's TD3 with its actor on the workers (same constructor as ``stable_baselines3.TD3``).

    :param overlap_collection: collect the next ``train_freq`` segment while training

    Only the actor travels (never the critics, the target networks or the replay buffer). The
    workers add ``action_noise`` (SB3's ``NormalActionNoise``; other noise types need state the
    workers do not have and are refused) per env and step, and clip to [-1, 1] as SB3 does. AAPS
    treats the acting policy as the Gaussian N(mu(s), sigma^2) of that noise: the divergence of two
    actors is ``||mu_d - mu_c||^2 / (2 sigma^2)`` (summed over action dimensions) averaged over probe
    states, so AAPS needs the noise. Otherwise as :class:`SAC`.
    """

    def _make_deployable(self, acting: th.nn.Module) -> Any:
        noise = _noise_parameters(self.action_noise, _box_shape(self.action_space))
        # AAPS compares the actor's flat outputs: sigma per output.
        return TD3ActorDeployable(cast(Any, acting), None if noise is None else noise[1].reshape(-1))
