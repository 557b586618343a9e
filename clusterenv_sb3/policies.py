"""Deployable wrappers around Stable-Baselines3 policies, for worker-side inference.

A wrapper is a ``torch.nn.Module`` with the methods :mod:`clusterenv_core.inference` asks for:
``act(obs, **context)`` (run on the workers) and ``action_dist(obs)`` (for AAPS on the learner).
The learner keeps a wrapper around its *live* policy (same parameters, updated in place by
training); :meth:`deployable_copy` makes the copy that is shipped to the workers. Copies never
carry the optimizer (nor the last distribution SB3 caches on the policy): only the networks.

- :class:`ActorCriticDeployable` wraps an ``ActorCriticPolicy`` (PPO, A2C): ``act`` is the
  policy's ``forward`` (actions, values, log-probabilities) and adds the actions the envs receive,
  clipped to the Box bounds or unscaled as SB3's ``collect_rollouts`` does.
- :class:`QNetworkDeployable` wraps a DQN ``QNetwork``: ``act(obs, epsilon=...)`` is
  epsilon-greedy per env, random draws from the worker's torch generator (seeded per worker by
  ``EnvPool.deploy(seed=...)``).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.distributions import (
    BernoulliDistribution,
    CategoricalDistribution,
    DiagGaussianDistribution,
    MultiCategoricalDistribution,
    StateDependentNoiseDistribution,
)
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.dqn.policies import QNetwork


def _to_device(obs: Any, device: th.device) -> Any:
    if isinstance(obs, dict):
        return {key: th.as_tensor(value).to(device) for key, value in obs.items()}
    return th.as_tensor(obs).to(device)


class _Deployable(th.nn.Module):
    """Shared copying rules: a deep copy leaves out the objects :meth:`_not_copied` names."""

    def _not_copied(self) -> list:
        return []

    def __deepcopy__(self, memo: dict) -> _Deployable:
        # Mapping an object's id to None in the memo makes deepcopy use None in its place.
        for obj in self._not_copied():
            if obj is not None:
                memo.setdefault(id(obj), None)
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    def acting_module(self) -> th.nn.Module:
        """The wrapped SB3 module."""
        raise NotImplementedError

    def deployable_copy(self) -> _Deployable:
        """A CPU copy in evaluation mode, without optimizer, to ship to the workers."""
        return copy.deepcopy(self).cpu().eval()


class ActorCriticDeployable(_Deployable):
    """Deployable view of an SB3 ``ActorCriticPolicy`` (the wrapped policy is shared, not copied).

    :param policy: the policy; gSDE policies are rejected (their exploration noise is a per-env
        matrix that SB3 resamples on the learner)
    """

    def __init__(self, policy: ActorCriticPolicy) -> None:
        super().__init__()
        if not isinstance(policy, ActorCriticPolicy):
            raise TypeError(f"expected an ActorCriticPolicy, got {type(policy).__name__}")
        dist = policy.action_dist
        if isinstance(dist, StateDependentNoiseDistribution) or getattr(policy, "use_sde", False):
            raise ValueError(
                "gSDE (use_sde=True) is not supported with worker-side inference: its exploration matrix is "
                "sampled per env on the learner; use use_sde=False, or stable_baselines3's algorithm on the "
                "ClusterVecEnv (learner-side inference)"
            )
        if not isinstance(
            dist, (CategoricalDistribution, MultiCategoricalDistribution, BernoulliDistribution, DiagGaussianDistribution)
        ):
            raise ValueError(f"unsupported action distribution for worker-side inference: {type(dist).__name__}")
        self.policy = policy
        space = policy.action_space
        self._box = isinstance(space, spaces.Box)
        self._squash = bool(policy.squash_output)
        if self._box:
            # Plain attributes, not buffers: they are not weights and never travel with them.
            self._low = th.as_tensor(space.low)
            self._high = th.as_tensor(space.high)

    def acting_module(self) -> th.nn.Module:
        return self.policy

    def _not_copied(self) -> list:
        return [getattr(self.policy, "optimizer", None), getattr(self.policy.action_dist, "distribution", None)]

    @th.no_grad()
    def act(self, obs: Any, deterministic: bool = False) -> dict[str, th.Tensor]:
        """The policy's ``forward``: ``actions`` (what SB3 stores in its buffer), ``env_actions``
        (Box spaces: what SB3 sends to the envs), ``values`` and ``log_probs``."""
        policy = self.policy
        actions, values, log_probs = policy(_to_device(obs, policy.device), deterministic=deterministic)
        out = {"actions": actions, "values": values.flatten(), "log_probs": log_probs}
        if self._box:
            low, high = self._low.to(actions.device), self._high.to(actions.device)
            if self._squash:
                out["env_actions"] = low + (0.5 * (actions + 1.0) * (high - low))
            else:
                out["env_actions"] = th.clamp(actions, low, high)
        return {key: value.cpu() for key, value in out.items()}

    @th.no_grad()
    def action_dist(self, obs: Any) -> tuple:
        """``("categorical", logits)``, ``("multicategorical", [logits, ...])``, ``("bernoulli", logits)``
        or ``("gaussian", mean, log_std)`` of the policy at ``obs``."""
        policy = self.policy
        dist = policy.get_distribution(_to_device(obs, policy.device))
        if isinstance(dist, CategoricalDistribution):
            return ("categorical", dist.distribution.logits.cpu())
        if isinstance(dist, MultiCategoricalDistribution):
            return ("multicategorical", [part.logits.cpu() for part in dist.distribution])
        if isinstance(dist, BernoulliDistribution):
            return ("bernoulli", dist.distribution.logits.cpu())
        mean = dist.distribution.mean
        return ("gaussian", mean.cpu(), (th.ones_like(mean) * policy.log_std).cpu())


class QNetworkDeployable(_Deployable):
    """Deployable view of a DQN ``QNetwork`` (``model.q_net``; shared, not copied).

    :param q_net: the online Q-network
    """

    def __init__(self, q_net: QNetwork) -> None:
        super().__init__()
        if not isinstance(q_net, QNetwork):
            raise TypeError(f"expected a DQN QNetwork, got {type(q_net).__name__}")
        if not isinstance(q_net.action_space, spaces.Discrete):
            raise ValueError(f"a QNetwork needs a Discrete action space, got {q_net.action_space}")
        self.q_net = q_net
        self.n_actions = int(q_net.action_space.n)

    def acting_module(self) -> th.nn.Module:
        return self.q_net

    @th.no_grad()
    def act(self, obs: Any, epsilon: float = 0.0) -> dict[str, th.Tensor]:
        """Greedy actions, each replaced by a uniformly random one with probability ``epsilon``
        (one draw per env)."""
        q_values = self.q_net(_to_device(obs, self.q_net.device))
        actions = q_values.argmax(dim=1).reshape(-1).cpu()
        if epsilon > 0:
            n = actions.shape[0]
            explore = th.rand(n) < epsilon
            actions = th.where(explore, th.randint(self.n_actions, (n,)), actions)
        return {"actions": actions}

    @th.no_grad()
    def action_dist(self, obs: Any) -> tuple:
        """``("greedy", q_values)``: AAPS measures the fraction of states whose greedy action changed."""
        return ("greedy", self.q_net(_to_device(obs, self.q_net.device)).cpu())


def make_deployable(policy: Any) -> _Deployable:
    """The wrapper for an SB3 policy: an ``ActorCriticPolicy``, a ``QNetwork``, or a DQN policy
    (whose online ``q_net`` is what acts)."""
    if isinstance(policy, ActorCriticPolicy):
        return ActorCriticDeployable(policy)
    if isinstance(policy, QNetwork):
        return QNetworkDeployable(policy)
    q_net = getattr(policy, "q_net", None)
    if isinstance(q_net, QNetwork):
        return QNetworkDeployable(q_net)
    raise TypeError(
        f"no worker-side inference wrapper for {type(policy).__name__}: supported are ActorCriticPolicy "
        "(PPO, A2C) and DQN's QNetwork"
    )


def weights_nbytes(module: th.nn.Module) -> int:
    """Bytes of one flat float32 copy of ``module``'s weights (what one sync sends to one worker)."""
    from clusterenv_core.inference import weight_tensors

    return int(sum(tensor.numel() for tensor in weight_tensors(module)) * np.dtype(np.float32).itemsize)
