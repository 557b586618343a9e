"""``AAPSCallback``: Adaptive Actor Policy Synchronization for clusterenv_sb3's PPO, A2C, DQN, SAC and TD3, in SB3's logger.

The decision itself is :class:`clusterenv_core.aaps.PolicySync`'s; this callback only configures
it for the ``learn()`` call it is passed to and records its counters under ``aaps/`` (so they reach
stdout, CSV and TensorBoard like SB3's own ``train/`` and ``rollout/`` values).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

from stable_baselines3.common.callbacks import BaseCallback

from clusterenv_core.aaps import SYNC_MODES

if TYPE_CHECKING:
    from clusterenv_sb3.algorithms import WorkerInferenceMixin


class AAPSCallback(BaseCallback):
    """Push new weights to the workers only when the learner's policy has drifted.

    :param kl_threshold: divergence above which the weights are pushed (strictly greater): mean
        KL(deployed || current) for PPO's stochastic policies, the fraction of probe states whose
        greedy action changed for DQN
    :param max_staleness: push anyway after this many updates without a push (``None``: no bound)
    :param probe_size: how many recent observations the divergence is measured on
    :param mode: ``"aaps"``, ``"always"`` (every update, the default without this callback) or
        ``"never"`` (the workers keep the weights deployed when learning started)

    Logged after every segment (and at the end of training): ``aaps/syncs``,
    ``aaps/weight_bytes_sent``, ``aaps/divergence`` (``aaps`` mode: the last measured divergence),
    ``aaps/updates``, ``aaps/updates_since_sync``, ``aaps/sync_ratio`` (syncs per update),
    ``aaps/policy_version``, ``aaps/mean_policy_lag`` and ``aaps/max_policy_lag`` (how many
    published versions the collected steps' weights were behind when the learner received them),
    ``aaps/mean_update_lag`` and ``aaps/max_update_lag`` (the same in learner updates: the
    staleness AAPS trades for fewer syncs).
    """

    def __init__(
        self,
        kl_threshold: float = 0.01,
        max_staleness: int | None = None,
        probe_size: int = 256,
        mode: str = "aaps",
        verbose: int = 0,
    ) -> None:
        super().__init__(verbose)
        if mode not in SYNC_MODES:
            raise ValueError(f"mode must be one of {SYNC_MODES}, got {mode!r}")
        self.kl_threshold = kl_threshold
        self.max_staleness = max_staleness
        self.probe_size = probe_size
        self.mode = mode

    def _init_callback(self) -> None:
        from clusterenv_sb3.algorithms import WorkerInferenceMixin

        if not isinstance(self.model, WorkerInferenceMixin):
            raise TypeError(
                f"AAPSCallback needs an algorithm with worker-side inference (clusterenv_sb3.PPO, A2C, DQN, SAC or TD3), "
                f"got {type(self.model).__module__}.{type(self.model).__name__}"
            )
        self.model.configure_sync(
            mode=self.mode, threshold=self.kl_threshold, max_staleness=self.max_staleness, probe_size=self.probe_size
        )

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        self._record()

    def _on_training_end(self) -> None:
        self._record()

    def _record(self) -> None:
        sync = cast("WorkerInferenceMixin", self.model).policy_sync  # _init_callback checked it
        if sync is None:
            return
        summary = sync.summary()
        record = self.logger.record
        record("aaps/syncs", summary["syncs"])
        record("aaps/weight_bytes_sent", summary["weight_bytes_sent"])
        if not math.isnan(summary["last_divergence"]):
            record("aaps/divergence", summary["last_divergence"])
        record("aaps/updates", summary["updates"])
        record("aaps/updates_since_sync", summary["updates_since_sync"])
        record("aaps/sync_ratio", summary["syncs"] / summary["updates"] if summary["updates"] else 0.0)
        record("aaps/policy_version", sync.actors.policy_version)
        record("aaps/mean_policy_lag", summary["mean_policy_lag"])
        record("aaps/max_policy_lag", summary["max_policy_lag"])
        record("aaps/mean_update_lag", summary["mean_update_lag"])
        record("aaps/max_update_lag", summary["max_update_lag"])
        if self.verbose >= 2:
            print(f"AAPS: {summary}")
