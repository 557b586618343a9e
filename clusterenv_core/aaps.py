"""Adaptive Actor Policy Synchronization (AAPS): ship new weights only when the policy has drifted.

The learner keeps a snapshot of the policy the workers hold. After each update it compares
snapshot and current policy on a probe batch of recent observations — both evaluated on the *same*
states — and publishes the weights only when the divergence exceeds a threshold:

- stochastic policies: mean KL(pi_deployed || pi_current), in closed form for Categorical,
  diagonal Gaussian, MultiCategorical and Bernoulli distributions;
- greedy or epsilon-greedy value-based policies: the fraction of probe states whose greedy action
  changed.

A policy reports its distribution with ``action_dist(obs)``, returning one of the distributions of
:mod:`clusterenv_core.policy` (``Categorical``, ``Gaussian``, ``MultiCategorical``, ``Bernoulli``,
``Greedy``), each of which computes its own divergence. torch is imported only when used.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from clusterenv_core.policy import DeployablePolicy

if TYPE_CHECKING:
    import torch

SYNC_MODES = ("always", "aaps", "never")


def divergence(deployed_policy: DeployablePolicy, current_policy: DeployablePolicy, probe_obs: Any) -> float:
    """Mean divergence between two policies on the same probe observations (numpy or tensors)."""
    import torch

    obs = _to_tensor(probe_obs)
    with torch.no_grad():
        return float(deployed_policy.action_dist(obs).divergence(current_policy.action_dist(obs)).mean())


def _module(policy: DeployablePolicy) -> torch.nn.Module:
    """The policy as the ``torch.nn.Module`` its contract says it is (which a Protocol cannot state)."""
    return cast("torch.nn.Module", policy)


def _length(batch: Any) -> int:
    return len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch)


def _to_tensor(obs: Any):
    import torch

    if isinstance(obs, dict):
        return {key: torch.as_tensor(value) for key, value in obs.items()}
    return torch.as_tensor(obs)


@dataclass
class SyncStats:
    """What synchronization cost and how stale the workers' policy was."""

    updates: int = 0
    syncs: int = 0
    weight_bytes_sent: int = 0
    last_divergence: float = float("nan")
    updates_since_sync: int = 0
    steps_collected: int = 0
    policy_lag_sum: int = 0
    max_policy_lag: int = 0
    update_lag_sum: int = 0
    max_update_lag: int = 0

    @property
    def mean_policy_lag(self) -> float:
        """Mean number of published versions each collected step lagged behind the learner."""
        return self.policy_lag_sum / self.steps_collected if self.steps_collected else 0.0

    @property
    def mean_update_lag(self) -> float:
        """Mean number of learner updates each collected step's weights lagged behind the learner
        (AAPS publishes fewer versions than there are updates, so this is the staleness that counts)."""
        return self.update_lag_sum / self.steps_collected if self.steps_collected else 0.0


class PolicySync:
    """Decides after each learner update whether the workers get the new weights.

    :param actors: the :class:`~clusterenv_core.actors.WorkerActors` that :meth:`EnvPool.deploy
        <clusterenv_core.pool.EnvPool.deploy>` returned
    :param policy: the learner's policy module (the one updated in place)
    :param mode: ``"always"`` (every update, the baseline), ``"aaps"`` (when the divergence exceeds
        ``threshold``) or ``"never"`` (workers keep the initial weights)
    :param threshold: divergence above which ``aaps`` pushes (strictly greater)
    :param max_staleness: with ``aaps``, push anyway after this many updates without a push
    :param probe_size: number of recent observations the divergence is measured on
    """

    def __init__(
        self,
        actors: Any,
        policy: DeployablePolicy,
        mode: str = "aaps",
        threshold: float = 0.01,
        max_staleness: int | None = None,
        probe_size: int = 256,
    ) -> None:
        self.actors = actors
        self.policy = policy
        self.configure(mode, threshold, max_staleness, probe_size)
        self.deployed = copy.deepcopy(policy)
        self.probe_obs: Any = None
        self._recent: deque = deque()  # flattened observation batches the probe is drawn from
        self.stats = SyncStats()
        # Learner updates done when each published version went out (index: version).
        self._updates_at_version = [0]
        self._note_versions()

    def configure(
        self, mode: str = "aaps", threshold: float = 0.01, max_staleness: int | None = None, probe_size: int = 256
    ) -> None:
        """Change the sync policy; the snapshot, the probe batch and the counters carry over."""
        if mode not in SYNC_MODES:
            raise ValueError(f"mode must be one of {SYNC_MODES}, got {mode!r}")
        if not threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {threshold!r}")
        if max_staleness is not None and max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 or None, got {max_staleness!r}")
        if probe_size < 1:
            raise ValueError(f"probe_size must be >= 1, got {probe_size!r}")
        self.mode = mode
        self.threshold = float(threshold)
        self.max_staleness = max_staleness
        self.probe_size = probe_size

    def observe(self, obs: Any, leading_dims: int = 2) -> None:
        """Add recent observations (e.g. a rollout's ``(n_steps, num_envs, ...)``) to the probe batch.

        The probe is ``probe_size`` evenly spaced states of the latest batches: the newest alone once
        it holds that many, older ones added while it holds fewer (short segments, as DQN's).
        """
        def flat(array: Any) -> np.ndarray:
            array = np.asarray(array)
            return array.reshape(-1, *array.shape[leading_dims:]).copy()

        batch = {key: flat(value) for key, value in obs.items()} if isinstance(obs, dict) else flat(obs)
        self._recent.append(batch)
        while len(self._recent) > 1 and sum(map(_length, self._recent)) - _length(self._recent[0]) >= self.probe_size:
            self._recent.popleft()
        total = sum(map(_length, self._recent))
        # Evenly spaced states: deterministic, and spread over the whole window.
        picks = np.linspace(0, total - 1, min(self.probe_size, total)).astype(np.int64)

        def probe(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts)[picks]

        if isinstance(batch, dict):
            self.probe_obs = {key: probe([part[key] for part in self._recent]) for key in batch}
        else:
            self.probe_obs = probe(list(self._recent))

    def record_rollout(self, versions: np.ndarray) -> None:
        """Account the policy lag of collected steps (``versions`` as a rollout reports them), in
        published versions and in learner updates."""
        self._note_versions()
        versions = np.asarray(versions)
        stats = self.stats
        lag = self.actors.policy_version - versions
        update_lag = stats.updates - np.asarray(self._updates_at_version)[versions]
        stats.steps_collected += lag.size
        stats.policy_lag_sum += int(lag.sum())
        stats.max_policy_lag = max(stats.max_policy_lag, int(lag.max(initial=0)))
        stats.update_lag_sum += int(update_lag.sum())
        stats.max_update_lag = max(stats.max_update_lag, int(update_lag.max(initial=0)))

    def _note_versions(self) -> None:
        """Record the update count of versions published since (also by ``actors.publish_weights``)."""
        while len(self._updates_at_version) <= self.actors.policy_version:
            self._updates_at_version.append(self.stats.updates)

    def after_update(self) -> bool:
        """Call after each learner update; publishes the weights if the mode says so. Returns whether it did."""
        if self.mode == "aaps" and self.probe_obs is None:  # before counting an update it cannot judge
            raise RuntimeError(
                "no probe observations: AAPS compares the policies on recent observations; collect a segment "
                "(or call observe() with observations) before the first update"
            )
        stats = self.stats
        stats.updates += 1
        stats.updates_since_sync += 1
        if self.mode == "never":
            return False
        if self.mode == "aaps":
            stats.last_divergence = divergence(self.deployed, self.policy, self.probe_obs)
            stale = self.max_staleness is not None and stats.updates_since_sync >= self.max_staleness
            if not (stats.last_divergence > self.threshold or stale):
                return False
        self.push()
        return True

    def push(self) -> None:
        """Publish the current weights and make them the new snapshot."""
        self.actors.publish_weights(self.policy)
        self._note_versions()
        _module(self.deployed).load_state_dict(_module(self.policy).state_dict())
        self.stats.syncs += 1
        self.stats.weight_bytes_sent += self.actors.weights_nbytes * self.actors.num_workers
        self.stats.updates_since_sync = 0

    def workers_current(self) -> bool:
        """Whether the workers hold exactly the learner's weights (the last ones published are
        the current ones, bit for bit)."""
        from clusterenv_core.inference import same_state

        return same_state(_module(self.policy).state_dict(), _module(self.deployed).state_dict())

    def summary(self) -> dict[str, float]:
        """Counters for logging (``aaps/...`` in SB3, TensorBoard scalars in CleanRL)."""
        stats = self.stats
        return {
            "updates": stats.updates,
            "syncs": stats.syncs,
            "weight_bytes_sent": stats.weight_bytes_sent,
            "last_divergence": stats.last_divergence,
            "updates_since_sync": stats.updates_since_sync,
            "mean_policy_lag": stats.mean_policy_lag,
            "max_policy_lag": stats.max_policy_lag,
            "mean_update_lag": stats.mean_update_lag,
            "max_update_lag": stats.max_update_lag,
        }
