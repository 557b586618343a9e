"""The policy contract between the learner's adapters, AAPS and the workers.

A deployable policy (:class:`DeployablePolicy`) acts on the workers with ``act`` and tells AAPS on
the learner what it would do with ``action_dist``, which returns one of the distributions here.
Each distribution knows how far another of its kind is from it (:meth:`ActionDistribution.divergence`),
so a new kind of policy head is one new class. The parameters are torch tensors of a batch of
states; torch is imported only inside the methods, so the core imports without it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

if TYPE_CHECKING:
    import torch


class ActionDistribution(ABC):
    """A policy's action distribution over a batch of states (its parameters: one row per state)."""

    def divergence(self, current: ActionDistribution) -> torch.Tensor:
        """How far ``current``, the learner's distribution on the same states, moved from this one,
        the workers' copy: one value per state (``KL(self || current)`` for stochastic policies).

        :raises TypeError: ``current`` is of another kind (the policies cannot be compared)
        """
        if type(current) is not type(self):
            raise TypeError(f"cannot compare a {type(self).__name__} policy with a {type(current).__name__} policy")
        return self._divergence(current)

    @abstractmethod
    def _divergence(self, current: Any) -> torch.Tensor:
        """:meth:`divergence` for a ``current`` of this class."""


def _categorical_kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    log_p = logits_p.log_softmax(-1)
    log_q = logits_q.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _sum_per_state(values: torch.Tensor) -> torch.Tensor:
    """Per-dimension values summed over all but the first (state) axis."""
    return values.reshape(values.shape[0], -1).sum(-1)


# eq=False: field-wise == on tensors is elementwise and has no single truth value.
@dataclass(frozen=True, eq=False)
class Categorical(ActionDistribution):
    """One choice among ``n``: ``logits`` of shape ``(states, n)``."""

    logits: torch.Tensor

    def _divergence(self, current: Categorical) -> torch.Tensor:
        return _categorical_kl(self.logits, current.logits)


@dataclass(frozen=True, eq=False)
class MultiCategorical(ActionDistribution):
    """Independent choices (a MultiDiscrete space): one ``(states, n_i)`` logits tensor per sub-action."""

    logits: Sequence[torch.Tensor]

    def _divergence(self, current: MultiCategorical) -> torch.Tensor:
        # sum() starts from 0, but adding the first tensor makes the total a tensor.
        return cast("torch.Tensor", sum(_categorical_kl(p, q) for p, q in zip(self.logits, current.logits)))


@dataclass(frozen=True, eq=False)
class Gaussian(ActionDistribution):
    """A diagonal Gaussian: ``mean`` and ``log_std`` of the same shape, ``(states, ...)``."""

    mean: torch.Tensor
    log_std: torch.Tensor

    def _divergence(self, current: Gaussian) -> torch.Tensor:
        var_p, var_q = (2 * self.log_std).exp(), (2 * current.log_std).exp()
        kl = current.log_std - self.log_std + (var_p + (self.mean - current.mean) ** 2) / (2 * var_q) - 0.5
        return _sum_per_state(kl) if kl.dim() > 1 else kl


@dataclass(frozen=True, eq=False)
class Bernoulli(ActionDistribution):
    """Independent binary choices (a MultiBinary space): ``logits`` of shape ``(states, ...)``."""

    logits: torch.Tensor

    def _divergence(self, current: Bernoulli) -> torch.Tensor:
        import torch.nn.functional as F

        p, q = self.logits, current.logits
        # KL(Bern(sigmoid p) || Bern(sigmoid q)) with log-sigmoids for stability.
        prob_p = p.sigmoid()
        kl = prob_p * (F.logsigmoid(p) - F.logsigmoid(q)) + (1 - prob_p) * (F.logsigmoid(-p) - F.logsigmoid(-q))
        return _sum_per_state(kl)


@dataclass(frozen=True, eq=False)
class Greedy(ActionDistribution):
    """A value-based policy acting (epsilon-)greedily on ``q_values`` of shape ``(states, n)``: its
    divergence is 1 where the greedy action changed, else 0, so AAPS measures the fraction of
    states that would be acted on differently."""

    q_values: torch.Tensor

    def _divergence(self, current: Greedy) -> torch.Tensor:
        return (self.q_values.argmax(-1) != current.q_values.argmax(-1)).float()


@runtime_checkable
class DeployablePolicy(Protocol):
    """What :meth:`EnvPool.deploy <clusterenv_core.pool.EnvPool.deploy>` takes: a ``torch.nn.Module``
    (its floating-point ``state_dict`` entries are the weights that travel) with these methods.

    It may also have ``numpy_actor(rng)``, returning ``None`` or a callable that does what ``act``
    does in numpy on numpy observations, drawing from ``rng`` (the worker's seeded
    ``numpy.random.Generator``); a worker then calls it instead of ``act`` (see
    :mod:`clusterenv_core.inference`).
    """

    def act(self, obs: Any, **context: Any) -> dict[str, Any]:
        """Run on a worker, on a batch of its envs' observations (a tensor, or a dict of tensors for
        Dict spaces); ``context`` is what the learner passed to the rollout (an exploration rate, ...).

        :return: tensors by name: ``"actions"`` (stored in the rollout), optionally
            ``"env_actions"`` (sent to the envs instead, e.g. clipped), ``"log_probs"`` and ``"values"``
        """
        ...

    def action_dist(self, obs: Any) -> ActionDistribution:
        """Run on the learner by AAPS: the distribution the policy acts from at ``obs`` (a batch)."""
        ...
