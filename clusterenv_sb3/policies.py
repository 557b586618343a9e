"""Deployable wrappers around Stable-Baselines3 policies, for worker-side inference.

A wrapper is a ``torch.nn.Module`` with the methods :class:`clusterenv_core.policy.DeployablePolicy`
asks for: ``act(obs, **context)`` (run on the workers) and ``action_dist(obs)`` (for AAPS on the
learner, one of :mod:`clusterenv_core.policy`'s distributions).
The learner keeps a wrapper around its *live* policy (same parameters, updated in place by
training); :meth:`deployable_copy` makes the copy that is shipped to the workers. Copies never
carry the optimizer (nor the last distribution SB3 caches on the policy): only the networks.

- :class:`ActorCriticDeployable` wraps an ``ActorCriticPolicy`` (PPO, A2C): ``act`` gives the
  actions and log-probabilities of the policy's ``forward`` (not its values: the learner
  recomputes values for the whole segment, so the workers skip the critic) and adds the actions
  the envs receive, clipped to the Box bounds or unscaled as SB3's ``collect_rollouts`` does. For
  SB3's ``MlpPolicy`` with a Gaussian or categorical distribution, ``numpy_actor`` gives the
  workers :class:`_NumpyMlpActor`: the same operations in numpy, without torch's cost per
  operation (850 -> 265 µs of CPU a step for 8 HalfCheetah observations inside a rollout).
- :class:`QNetworkDeployable` wraps a DQN ``QNetwork``: ``act(obs, epsilon=...)`` is
  epsilon-greedy per env, random draws from the worker's torch generator (seeded per worker by
  ``EnvPool.deploy(seed=...)``).
- :class:`SACActorDeployable` and :class:`TD3ActorDeployable` wrap the actor of SAC and TD3 (never
  the critics): ``act(obs, random=..., noise=...)`` picks actions as SB3's off-policy
  ``_sample_action`` does, through the actor's own ``scale_action``/``unscale_action``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, cast

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
from stable_baselines3.common.policies import ActorCriticPolicy, BasePolicy
from stable_baselines3.common.preprocessing import is_image_space
from stable_baselines3.common.torch_layers import FlattenExtractor, MlpExtractor
from stable_baselines3.dqn.policies import QNetwork
from stable_baselines3.sac.policies import Actor as SACActor
from stable_baselines3.td3.policies import Actor as TD3Actor

from clusterenv_core.policy import ActionDistribution, Bernoulli, Categorical, Gaussian, Greedy, MultiCategorical


def _to_device(obs: Any, device: th.device) -> Any:
    if isinstance(obs, dict):
        return {key: th.as_tensor(value).to(device) for key, value in obs.items()}
    return th.as_tensor(obs).to(device)


def _shape(space: spaces.Space) -> tuple[int, ...]:
    """The shape of a space the wrappers take (a Box, Discrete, MultiDiscrete or MultiBinary
    space, as their distributions say), which has one."""
    return cast("tuple[int, ...]", space.shape)


class _Deployable(th.nn.Module):
    """Shared copying rules: a deep copy leaves out the objects :meth:`_not_copied` names (they
    become ``None``) and, as pickling does, the attributes ``__getstate__`` drops."""

    def _not_copied(self) -> list:
        return []

    def __deepcopy__(self, memo: dict) -> _Deployable:
        # Mapping an object's id to None in the memo makes deepcopy use None in its place.
        for obj in self._not_copied():
            if obj is not None:
                memo.setdefault(id(obj), None)
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__getstate__().items():  # what pickling keeps, so both leave out the same
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
        if isinstance(space, spaces.Box):  # self._box, in a form the type checker follows
            # Plain attributes, not buffers: they are not weights and never travel with them.
            self._low = th.as_tensor(space.low)
            self._high = th.as_tensor(space.high)

    def acting_module(self) -> th.nn.Module:
        return self.policy

    def _not_copied(self) -> list:
        return [getattr(self.policy, "optimizer", None), getattr(self.policy.action_dist, "distribution", None)]

    def act(self, obs: Any, deterministic: bool = False) -> dict[str, th.Tensor]:
        """What the policy's ``forward`` draws: ``actions`` (what SB3 stores in its buffer) and
        ``log_probs``, and ``env_actions`` (Box spaces: what SB3 sends to the envs)."""
        if th.is_grad_enabled():  # workers call it in inference mode, which no_grad would only slow
            with th.no_grad():
                return self.act(obs, deterministic)
        policy = self.policy
        actions, log_probs = _generic_forward(policy)(policy, _to_device(obs, policy.device), deterministic)
        out = {"actions": actions, "log_probs": log_probs}
        if self._box:
            low, high = self._low.to(actions.device), self._high.to(actions.device)
            if self._squash:
                out["env_actions"] = low + (0.5 * (actions + 1.0) * (high - low))
            else:
                out["env_actions"] = th.clamp(actions, low, high)
        return {key: value.cpu() for key, value in out.items()}

    def numpy_actor(self, rng: np.random.Generator) -> Callable[..., dict[str, np.ndarray]] | None:
        """For SB3's ``MlpPolicy`` on the CPU, :meth:`act` in numpy on numpy observations, drawing
        from ``rng`` (see :class:`_NumpyMlpActor`); ``None`` for other policies. Workers use it."""
        return _NumpyMlpActor.of(self.policy, rng)

    @th.no_grad()
    def action_dist(self, obs: Any) -> ActionDistribution:
        """The policy's :class:`Categorical`, :class:`MultiCategorical`, :class:`Bernoulli` or
        :class:`Gaussian` at ``obs``."""
        policy = self.policy
        dist = policy.get_distribution(_to_device(obs, policy.device))
        if isinstance(dist, CategoricalDistribution):
            return Categorical(dist.distribution.logits.cpu())
        if isinstance(dist, MultiCategoricalDistribution):
            return MultiCategorical([part.logits.cpu() for part in dist.distribution])
        if isinstance(dist, BernoulliDistribution):
            return Bernoulli(dist.distribution.logits.cpu())
        mean = cast(DiagGaussianDistribution, dist).distribution.mean  # the one left (checked in __init__)
        return Gaussian(mean.cpu(), (th.ones_like(mean) * policy.log_std).cpu())


def _generic_forward(policy: ActorCriticPolicy) -> Callable[[ActorCriticPolicy, Any, bool], tuple]:
    """How to draw ``(actions, log_probs)`` as ``policy.forward`` draws them: with SB3's own
    ``forward``, through ``get_distribution`` (the same operations for the actor, none for the
    critic, which may have its own features extractor); an overridden one runs as it is."""
    policy_class = type(policy)
    if all(
        getattr(policy_class, name) is getattr(ActorCriticPolicy, name)
        for name in ("forward", "get_distribution", "extract_features")
    ):
        return _actor_forward
    return _own_forward


def _actor_forward(policy: ActorCriticPolicy, obs: Any, deterministic: bool) -> tuple:
    distribution = policy.get_distribution(obs)
    actions = distribution.get_actions(deterministic=deterministic)
    return actions.reshape((-1, *_shape(policy.action_space))), distribution.log_prob(actions)


def _own_forward(policy: ActorCriticPolicy, obs: Any, deterministic: bool) -> tuple:
    actions, _, log_probs = policy(obs, deterministic=deterministic)
    return actions, log_probs


# float32, as torch rounds the Python float it subtracts from a float32 tensor.
_LOG_SQRT_2PI = np.float32(math.log(math.sqrt(2 * math.pi)))


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0, out=x)


# Activation modules and what they compute.
_ACTIVATIONS: dict[type[th.nn.Module], Callable[[np.ndarray], np.ndarray]] = {th.nn.Tanh: np.tanh, th.nn.ReLU: _relu}


def _numpy_layers(network: th.nn.Module) -> list | None:
    """``network`` (an ``nn.Sequential`` of ``Linear`` layers and Tanh/ReLU) as numpy views of its
    parameters (``(weight.T, bias)``) and activation functions, or ``None`` for anything else."""
    if not isinstance(network, th.nn.Sequential):
        return None
    layers: list[tuple[np.ndarray, np.ndarray] | Callable[[np.ndarray], np.ndarray]] = []
    for module in network:
        if type(module) is th.nn.Linear:
            layers.append(_linear_views(module))
        elif type(module) in _ACTIVATIONS and not getattr(module, "inplace", False):
            layers.append(_ACTIVATIONS[type(module)])
        else:
            return None
    return layers


def _linear_views(linear: th.nn.Linear) -> tuple[np.ndarray, np.ndarray]:
    """Numpy views of a ``Linear``'s weight (transposed) and bias: weights loaded into the module
    in place show through them."""
    return linear.weight.detach().numpy().T, linear.bias.detach().numpy()


class _NumpyMlpActor:
    """The actor's half of SB3's ``ActorCriticPolicy.forward`` for an ``MlpPolicy`` (flattened Box
    observations, an ``MlpExtractor`` of Linear/Tanh/ReLU layers, a diagonal Gaussian or
    categorical distribution) in numpy, over views of the policy's CPU parameters, so weights loaded
    into them later show through. SB3's operations in float32; numpy rounds matrix products and
    sums in its own order, so actions and log-probabilities agree with SB3's to float32 precision,
    not bit for bit; the random draws come from ``rng``.

    :param pi_layers: the policy network's layers and the action net (see :func:`_numpy_layers`)
    :param log_std: a view of the Gaussian's ``log_std`` parameter, or ``None`` for a categorical
    :param policy: the policy, for its spaces and preprocessing
    :param rng: the generator the actions are drawn from
    """

    def __init__(self, pi_layers: list, log_std: np.ndarray | None, policy: ActorCriticPolicy, rng: np.random.Generator) -> None:
        self.pi_layers = pi_layers
        self.log_std = log_std
        self.rng = rng
        # What SB3's preprocess_obs and FlattenExtractor do to a Box observation, decided once.
        observation_space = policy.observation_space
        self.scale_image = policy.normalize_images and is_image_space(observation_space)
        self.flatten = len(_shape(observation_space)) > 1
        action_space = policy.action_space
        # The actions come out as (batch, n) for a Gaussian, (batch,) for a categorical: reshaped to
        # the space's shape unless that is theirs already.
        shape = _shape(action_space)
        self.action_shape = None if len(shape) == (1 if log_std is not None else 0) else (-1, *shape)
        # What SB3's collect_rollouts sends to the envs: the actions clipped to the Box.
        self.bounds = (action_space.low, action_space.high) if isinstance(action_space, spaces.Box) else None

    @classmethod
    def of(cls, policy: ActorCriticPolicy, rng: np.random.Generator) -> _NumpyMlpActor | None:
        """The numpy actor of ``policy``, or ``None`` when it is not a plain ``MlpPolicy`` on the CPU."""
        policy_class = type(policy)
        plain = (
            policy_class.forward is ActorCriticPolicy.forward
            and policy_class.extract_features is ActorCriticPolicy.extract_features
            and policy_class._get_action_dist_from_latent is ActorCriticPolicy._get_action_dist_from_latent
            and not any(module._forward_hooks or module._forward_pre_hooks for module in policy.modules())
            and isinstance(policy.observation_space, spaces.Box)
            and type(policy.features_extractor) is FlattenExtractor
            and type(policy.mlp_extractor) is MlpExtractor
            and type(policy.action_net) is th.nn.Linear
            and type(policy.action_dist) in (DiagGaussianDistribution, CategoricalDistribution)
            and not policy.squash_output
            and all(p.device.type == "cpu" and p.dtype == th.float32 for p in policy.parameters())
        )
        if not plain:
            return None
        pi_layers = _numpy_layers(policy.mlp_extractor.policy_net)
        if pi_layers is None:
            return None
        pi_layers.append(_linear_views(cast(th.nn.Linear, policy.action_net)))  # a Linear: checked above
        log_std = policy.log_std.detach().numpy() if type(policy.action_dist) is DiagGaussianDistribution else None
        return cls(pi_layers, log_std, policy, rng)

    def __call__(self, obs: np.ndarray, deterministic: bool = False) -> dict[str, np.ndarray]:
        """``actions``, ``log_probs`` and, for a Box, ``env_actions``, as :meth:`ActorCriticDeployable.act`."""
        x = np.asarray(obs, dtype=np.float32)
        if self.scale_image:
            x = x / np.float32(255.0)
        if self.flatten:
            x = x.reshape(len(x), -1)
        for layer in self.pi_layers:
            x = x @ layer[0] + layer[1] if type(layer) is tuple else layer(x)
        if self.log_std is not None:
            # torch's Normal(mean, std): mean + std * a standard normal draw; SB3 sums the
            # log-probabilities over the action dimensions.
            log_std = self.log_std
            std = np.exp(log_std)
            actions = x if deterministic else x + std * self.rng.standard_normal(x.shape, dtype=np.float32)
            terms = -np.square(actions - x) / (2 * np.square(std)) - log_std - _LOG_SQRT_2PI
            log_probs = terms.sum(axis=1, dtype=np.float32)
        else:
            # torch's Categorical(logits=x): normalized logits, softmax probabilities, one draw per row
            # by the inverse of the cumulative distribution.
            shifted = x - x.max(axis=1, keepdims=True)
            logits = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            probs = np.exp(logits)
            if deterministic:
                actions = probs.argmax(axis=1)
            else:
                cumulative = np.cumsum(probs, axis=1, dtype=np.float64)
                uniform = self.rng.random((len(x), 1)) * cumulative[:, -1:]
                actions = (uniform >= cumulative[:, :-1]).sum(axis=1)
            log_probs = logits[np.arange(len(x)), actions]
        if self.action_shape is not None:
            actions = actions.reshape(self.action_shape)
        out = {"actions": actions, "log_probs": log_probs}
        if self.bounds is not None:
            out["env_actions"] = np.clip(actions, *self.bounds)
        return out


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
    def action_dist(self, obs: Any) -> Greedy:
        """:class:`Greedy` over the Q-values: AAPS measures the fraction of states whose greedy action changed."""
        return Greedy(self.q_net(_to_device(obs, self.q_net.device)).cpu())


class _OffPolicyActorDeployable(_Deployable):
    """What SAC's and TD3's actors share: SB3's ``_sample_action`` on the workers.

    :param actor: the actor of a SAC or TD3 policy (its ``action_space`` a Box)
    """

    def __init__(self, actor: BasePolicy) -> None:
        super().__init__()
        if not isinstance(actor.action_space, spaces.Box):
            raise ValueError(f"SAC and TD3 need a Box action space, got {actor.action_space}")
        self.actor = actor
        self.action_dim = int(np.prod(actor.action_space.shape))

    def acting_module(self) -> th.nn.Module:
        return self.actor

    def _policy_actions(self, obs: Any) -> th.Tensor:
        """The actor's squashed actions in [-1, 1] (SAC samples, TD3 is deterministic)."""
        raise NotImplementedError

    @th.no_grad()
    def act(self, obs: Any, random: bool = False, noise: tuple | None = None) -> dict[str, th.Tensor]:
        """``actions``, the scaled actions SB3 stores in its replay buffer, and ``env_actions``, what
        the envs receive.

        :param random: uniform random actions over the Box (SB3's warm-up before ``learning_starts``),
            drawn from the worker's torch generator
        :param noise: ``(mean, sigma)`` of Gaussian exploration noise added to the scaled actions and
            clipped to [-1, 1], one draw per env (SB3's ``NormalActionNoise``, vectorized over envs)
        """
        actor = self.actor
        space = cast(spaces.Box, actor.action_space)  # checked in __init__
        if random:
            n = len(next(iter(obs.values()))) if isinstance(obs, dict) else len(obs)
            draw = th.rand((n, *space.shape), dtype=th.float32).numpy()
            unscaled = (space.low + draw * (space.high - space.low)).astype(space.dtype)
        else:
            # What SB3's predict() returns: the squashed actions unscaled to the Box.
            squashed = self._policy_actions(_to_device(obs, actor.device)).cpu().numpy()
            unscaled = actor.unscale_action(squashed.reshape((-1, *space.shape)))
        scaled = actor.scale_action(unscaled)
        if noise is not None:
            mean, sigma = noise
            draw = (mean + sigma * th.randn(scaled.shape, dtype=th.float64).numpy()).astype(np.float32)
            scaled = np.clip(scaled + draw, -1, 1)
        return {"actions": th.from_numpy(np.asarray(scaled)), "env_actions": th.from_numpy(actor.unscale_action(scaled))}


class SACActorDeployable(_OffPolicyActorDeployable):
    """Deployable view of SAC's actor (``model.actor``; shared, not copied): a squashed diagonal
    Gaussian, sampled on the workers."""

    actor: SACActor

    def __init__(self, actor: SACActor) -> None:
        if not isinstance(actor, SACActor):
            raise TypeError(f"expected SAC's Actor, got {type(actor).__name__}")
        if actor.use_sde:
            raise ValueError("gSDE (use_sde=True) is not supported with worker-side inference")
        super().__init__(actor)

    def _policy_actions(self, obs: Any) -> th.Tensor:
        return self.actor(obs, deterministic=False)

    @th.no_grad()
    def action_dist(self, obs: Any) -> Gaussian:
        """The :class:`Gaussian` before the tanh: the KL of the squashed Gaussians equals theirs
        (tanh is a bijection)."""
        mean, log_std, _ = self.actor.get_action_dist_params(_to_device(obs, self.actor.device))
        return Gaussian(mean.cpu(), log_std.cpu())


class TD3ActorDeployable(_OffPolicyActorDeployable):
    """Deployable view of TD3's deterministic actor (``model.actor``; shared, not copied).

    :param actor: TD3's actor
    :param sigma: the exploration noise's standard deviation in the scaled action space (per
        action dimension), which makes the acting policy the Gaussian AAPS compares; ``None``
        without noise (then AAPS cannot measure the drift)
    """

    actor: TD3Actor

    def __init__(self, actor: TD3Actor, sigma: np.ndarray | None = None) -> None:
        if not isinstance(actor, TD3Actor):
            raise TypeError(f"expected TD3's Actor, got {type(actor).__name__}")
        super().__init__(actor)
        self.sigma = None if sigma is None else np.broadcast_to(np.asarray(sigma, dtype=np.float32), (self.action_dim,)).copy()

    def _policy_actions(self, obs: Any) -> th.Tensor:
        return self.actor(obs)

    @th.no_grad()
    def action_dist(self, obs: Any) -> Gaussian:
        """``Gaussian(mu, log sigma)``: the deterministic action with its exploration noise; the KL
        of two of them is ``||mu_d - mu_c||^2 / (2 sigma^2)`` summed over action dimensions."""
        if self.sigma is None:
            raise ValueError(
                "AAPS compares TD3 actors through their Gaussian exploration noise: give the model "
                "action_noise=NormalActionNoise(...), or sync 'always'/'never'"
            )
        mu = self.actor(_to_device(obs, self.actor.device)).cpu()
        log_sigma = th.log(th.as_tensor(self.sigma)).expand_as(mu)
        return Gaussian(mu, log_sigma)


def make_deployable(policy: Any) -> _Deployable:
    """The wrapper for an SB3 policy: an ``ActorCriticPolicy``, a ``QNetwork``, a DQN policy (whose
    online ``q_net`` is what acts), or SAC's actor (TD3's takes its noise: :class:`TD3ActorDeployable`)."""
    if isinstance(policy, ActorCriticPolicy):
        return ActorCriticDeployable(policy)
    if isinstance(policy, QNetwork):
        return QNetworkDeployable(policy)
    if isinstance(policy, SACActor):
        return SACActorDeployable(policy)
    if isinstance(policy, TD3Actor):
        return TD3ActorDeployable(policy)
    q_net = getattr(policy, "q_net", None)
    if isinstance(q_net, QNetwork):
        return QNetworkDeployable(q_net)
    raise TypeError(
        f"no worker-side inference wrapper for {type(policy).__name__}: supported are ActorCriticPolicy "
        "(PPO, A2C), DQN's QNetwork and the actors of SAC and TD3"
    )


def weights_nbytes(module: th.nn.Module) -> int:
    """Bytes of one flat float32 copy of ``module``'s weights (what one sync sends to one worker)."""
    from clusterenv_core.inference import weight_tensors

    return int(sum(tensor.numel() for tensor in weight_tensors(module)) * np.dtype(np.float32).itemsize)
