"""Worker-side inference for CleanRL-style scripts: the rollout loop as one call, AAPS as one line.

The workers hold a copy of the agent, act locally and return whole segments
(:class:`~clusterenv_core.rollout.Rollout`); these helpers translate a segment into what a CleanRL
script already works with::

    class Agent(DeployableAgent, nn.Module): ...          # adds act() and action_dist()

    envs = ClusterVectorEnv(env_fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    rollouts = WorkerRollouts(envs, agent, args.num_steps, sync="aaps", threshold=0.01, seed=args.seed)
    for iteration in range(1, num_iterations + 1):
        b = rollouts.collect_ppo(args.gamma)   # was: for step in range(args.num_steps): ...
        ...                                     # CleanRL's GAE and update, unchanged
        rollouts.after_update()                 # AAPS: push the weights only if the policy drifted
    rollouts.close()

- :class:`DeployableAgent` turns CleanRL's PPO ``Agent`` into a deployable policy
  (``get_action_and_value`` becomes ``act``; ``actor`` logits, or ``actor_mean``/``actor_logstd``,
  become ``action_dist``); :class:`DeployableQNetwork` does the same for DQN's ``QNetwork``
  (epsilon-greedy ``act(obs, epsilon=...)`` on the workers, greedy-action divergence for AAPS);
  :class:`DeployableSACActor` and :class:`DeployableTD3Actor` for the actors of CleanRL's SAC and
  TD3 (warm-up actions, TD3's exploration noise, and their Gaussian divergences for AAPS).
- :func:`ppo_batch` gives CleanRL's rollout tensors: ``obs``, ``actions``, ``logprobs`` (the
  workers'), ``learner_logprobs`` and ``values`` (the learner's current policy and critic),
  ``rewards``, ``dones`` and ``next_obs``/``next_done``.
  Segments use same-step autoreset, so after an episode end ``obs[t + 1]`` is already the reset
  observation; a truncated (not terminated) episode gets ``gamma * V(last observation)`` added to
  its last reward, so CleanRL's GAE, which cuts at every ``done``, stays correct for truncation.
- :func:`replay_transitions` / :func:`add_to_replay_buffer` give DQN's transitions for SB3's
  ``ReplayBuffer`` with the real last observation of each ended episode as ``next_obs``.
- :func:`episodic_returns` reads ``RecordEpisodeStatistics`` results from a segment's infos.
- :class:`WorkerRollouts` deploys the agent, collects segments (optionally overlapped with
  learning) and owns the :class:`~clusterenv_core.aaps.PolicySync` that decides when the workers
  get new weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from clusterenv_cleanrl.vector_env import RESET_OMIT_IF_NONE
from clusterenv_core.aaps import PolicySync
from clusterenv_core.checks import check_int
from clusterenv_core.policy import ActionDistribution, Categorical, DeployablePolicy, Gaussian, Greedy, MultiCategorical
from clusterenv_core.pool import EnvPool
from clusterenv_core.rollout import Rollout

if TYPE_CHECKING:  # the mixins below run inside CleanRL's modules, whose methods and buffers they use
    import torch

    class _PPOAgent:
        def get_action_and_value(
            self, x: torch.Tensor, action: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...

    class _QNetwork:
        def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    class _SACActor:
        def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

        def get_action(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    class _TD3Actor:
        action_scale: torch.Tensor
        action_bias: torch.Tensor

        def __call__(self, x: torch.Tensor) -> torch.Tensor: ...
else:
    _PPOAgent = _QNetwork = _SACActor = _TD3Actor = object

# torch is imported inside the functions that use it, so ``import clusterenv_cleanrl`` works without it.

__all__ = [
    "DeployableAgent",
    "DeployableQNetwork",
    "DeployableSACActor",
    "DeployableTD3Actor",
    "Episode",
    "PPOBatch",
    "Transition",
    "WorkerRollouts",
    "add_to_replay_buffer",
    "episodic_returns",
    "ppo_batch",
    "replay_transitions",
]


def _float(obs: Any) -> torch.Tensor:
    """Observations as CleanRL's agents take them (``torch.Tensor(obs)``: float32)."""
    import torch

    if isinstance(obs, dict):
        raise TypeError("Dict observations are not supported by the CleanRL helpers; flatten them in the env")
    return obs if obs.dtype == torch.float32 else obs.to(torch.float32)


class DeployableAgent(_PPOAgent):
    """Mixin making a CleanRL PPO ``Agent`` deployable on ClusterEnv workers: ``class Agent(DeployableAgent, nn.Module)``.

    The agent keeps CleanRL's interface: ``get_action_and_value(x, action=None)`` returning
    ``(action, log_prob, entropy, value)``, and ``get_value(x)``. The mixin adds

    - ``act(obs)``: ``get_action_and_value`` on a worker (sampled actions, their log-probabilities
      and values);
    - ``action_dist(obs)``: ``Categorical(self.actor(obs))`` for discrete agents; for
      MultiDiscrete ones, ``self.actor(obs)`` split by ``self.nvec`` (CleanRL's
      ``ppo_multidiscrete`` agent keeps its action space's ``nvec``) as a ``MultiCategorical``; or
      ``Gaussian(self.actor_mean(obs), self.actor_logstd)`` for CleanRL's continuous agent.
      Override it for other heads (the distributions are in :mod:`clusterenv_core.policy`).
    """

    def act(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        action, log_prob, _, value = self.get_action_and_value(_float(obs))
        return {"actions": action, "log_probs": log_prob, "values": value.reshape(-1)}

    def action_dist(self, obs: torch.Tensor) -> ActionDistribution:
        obs = _float(obs)
        if hasattr(self, "actor_mean") and hasattr(self, "actor_logstd"):
            mean = self.actor_mean(obs)
            return Gaussian(mean, self.actor_logstd.expand_as(mean))
        if hasattr(self, "actor"):
            logits = self.actor(obs)
            if hasattr(self, "nvec"):
                import torch

                return MultiCategorical(list(torch.split(logits, [int(n) for n in self.nvec], dim=-1)))
            return Categorical(logits)
        raise NotImplementedError(
            f"{type(self).__name__} has neither `actor` (logits) nor `actor_mean`/`actor_logstd`: "
            "override action_dist(obs) to return a distribution of clusterenv_core.policy"
        )


class DeployableQNetwork(_QNetwork):
    """Mixin making a CleanRL DQN ``QNetwork`` deployable: ``class QNetwork(DeployableQNetwork, nn.Module)``.

    ``forward(x)`` must return the Q-values. ``act(obs, epsilon=0.0)`` is epsilon-greedy per env
    (random draws from the worker's torch generator, seeded by ``EnvPool.deploy(seed=...)``);
    ``action_dist`` is ``Greedy(q_values)``, so AAPS measures the fraction of changed greedy actions.
    """

    def act(self, obs: torch.Tensor, epsilon: float = 0.0) -> dict[str, torch.Tensor]:
        import torch

        q_values = self(_float(obs))
        actions = q_values.argmax(-1)
        if epsilon > 0:
            explore = torch.rand(actions.shape) < epsilon
            actions = torch.where(explore, torch.randint(q_values.shape[-1], actions.shape), actions)
        return {"actions": actions}

    def action_dist(self, obs: torch.Tensor) -> Greedy:
        return Greedy(self(_float(obs)))


def _uniform_actions(actor: Any, obs: torch.Tensor) -> torch.Tensor:
    """Uniform random actions over the Box the actor's ``action_scale``/``action_bias`` span, one per
    env (CleanRL's ``envs.action_space.sample()`` before ``learning_starts``), from the worker's
    torch generator."""
    import torch

    shape = (obs.shape[0], *actor.action_scale.shape)
    return actor.action_bias + actor.action_scale * (2.0 * torch.rand(shape) - 1.0)


class DeployableSACActor(_SACActor):
    """Mixin making CleanRL's SAC ``Actor`` deployable: ``class Actor(DeployableSACActor, nn.Module)``.

    The actor keeps CleanRL's interface: ``forward(x)`` returning ``(mean, log_std)`` of the Gaussian
    before the tanh, ``get_action(x)`` returning ``(action, log_prob, mean)`` with actions scaled by
    the ``action_scale`` and ``action_bias`` buffers. The mixin adds ``act(obs, random=False)``
    (sampled actions; uniform ones with ``random``, as before ``learning_starts``) and
    ``action_dist(obs)``: ``Gaussian(mean, log_std)``. The KL of the squashed, scaled actions
    equals that of these Gaussians (tanh and the scaling are bijections).
    """

    def act(self, obs: torch.Tensor, random: bool = False) -> dict[str, torch.Tensor]:
        obs = _float(obs)
        actions = _uniform_actions(self, obs) if random else self.get_action(obs)[0]
        return {"actions": actions}

    def action_dist(self, obs: torch.Tensor) -> Gaussian:
        mean, log_std = self(_float(obs))
        return Gaussian(mean, log_std)


class DeployableTD3Actor(_TD3Actor):
    """Mixin making CleanRL's TD3 ``Actor`` deployable: ``class Actor(DeployableTD3Actor, nn.Module)``.

    ``forward(x)`` returns the deterministic action, scaled by the ``action_scale`` and
    ``action_bias`` buffers. ``act(obs, random=False, exploration_noise=...)`` adds CleanRL's noise,
    ``N(0, action_scale * exploration_noise)``, and clips to the Box (uniform actions with
    ``random``). For AAPS the acting policy is that Gaussian around ``forward(x)``:
    ``action_dist(obs)`` is ``Gaussian(mu, log(action_scale * exploration_noise))``, so the
    divergence of two actors is ``||mu_d - mu_c||^2 / (2 sigma^2)``; set the instance's
    ``exploration_noise`` to the script's (CleanRL's default, 0.1, otherwise).
    """

    exploration_noise: float = 0.1

    def act(self, obs: torch.Tensor, random: bool = False, exploration_noise: float | None = None) -> dict[str, torch.Tensor]:
        import torch

        obs = _float(obs)
        if random:
            return {"actions": _uniform_actions(self, obs)}
        noise = self.exploration_noise if exploration_noise is None else exploration_noise
        actions = self(obs)
        actions = actions + torch.normal(torch.zeros_like(actions), self.action_scale * noise)
        low, high = self.action_bias - self.action_scale, self.action_bias + self.action_scale
        return {"actions": torch.max(torch.min(actions, high), low)}

    def action_dist(self, obs: torch.Tensor) -> Gaussian:
        import torch

        mu = self(_float(obs))
        return Gaussian(mu, torch.log(self.action_scale * self.exploration_noise).expand_as(mu))


class Episode(NamedTuple):
    """An episode that ended in a segment, as ``RecordEpisodeStatistics`` reported it."""

    global_step: int  # the global step at which it ended (CleanRL logs the return there)
    env: int
    episodic_return: float
    length: int


def episodic_returns(rollout: Rollout, start_step: int = 0) -> list[Episode]:
    """The episodes that ended in ``rollout`` (envs wrapped in ``RecordEpisodeStatistics``), in step
    then env order. ``start_step`` is the global step before the segment; step ``t`` ends at
    ``start_step + (t + 1) * num_envs``, as CleanRL counts."""
    num_envs = rollout.rewards.shape[1]
    episodes = []
    for t, infos in enumerate(rollout.infos):
        for index in sorted(infos):
            stats = infos[index].get("episode")
            if stats is not None:
                r, length = np.asarray(stats["r"]).item(), np.asarray(stats["l"]).item()
                episodes.append(Episode(start_step + (t + 1) * num_envs, index, float(r), int(length)))
    return episodes


@dataclass
class PPOBatch:
    """One segment as CleanRL's PPO stores it, time-major ``(num_steps, num_envs, ...)`` tensors.

    ``dones[t]`` is 1 when ``obs[t]`` starts an episode because the step before ended one (CleanRL's
    ``next_done`` stored before each step; ``dones[0]`` comes from the previous segment).
    ``rewards`` include ``gamma * V(final observation)`` at truncations that are not terminations;
    ``values`` are the learner's critic on ``obs``. ``next_obs``/``next_done`` follow the last step.
    ``logprobs`` are the workers' (the behaviour policy that chose the actions, possibly stale);
    ``learner_logprobs`` the learner's policy's at collection time, the proximal policy of a
    decoupled PPO objective (equal to ``logprobs`` up to rounding when the workers were up to date).
    """

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    learner_logprobs: torch.Tensor
    rewards: torch.Tensor
    dones: torch.Tensor
    values: torch.Tensor
    next_obs: torch.Tensor
    next_done: torch.Tensor
    episodes: list[Episode] = field(default_factory=list)
    versions: np.ndarray | None = None  # the weights version each step acted with


def ppo_batch(
    rollout: Rollout,
    agent: Any,
    gamma: float,
    episode_starts: np.ndarray | None = None,
    start_step: int = 0,
) -> PPOBatch:
    """CleanRL's PPO tensors from a segment (copies: valid after the pool reuses its region).

    :param agent: the learner's agent; ``agent.get_value(obs)`` gives the values (its current
        critic, not the workers' possibly stale copy) and the truncation bootstraps, and
        ``agent.get_action_and_value(obs, actions)`` the learner's log-probabilities
    :param gamma: discount of the truncation bootstrap
    :param episode_starts: done flags before the segment's first step (``dones[0]``); zeros if ``None``
    :param start_step: global step before the segment, for the episodes' global steps
    """
    import torch

    if isinstance(rollout.obs, dict):
        raise TypeError("Dict observations are not supported by ppo_batch; flatten them in the env")
    num_steps, num_envs = rollout.rewards.shape
    obs = torch.tensor(np.asarray(rollout.obs), dtype=torch.float32)
    next_obs = torch.tensor(np.asarray(rollout.last_obs), dtype=torch.float32)
    done = rollout.dones
    actions = torch.tensor(np.asarray(rollout.actions))
    with torch.no_grad():
        flat_obs = obs.reshape(num_steps * num_envs, *obs.shape[2:])
        _, learner_logprobs, _, values = agent.get_action_and_value(
            flat_obs, actions.reshape(num_steps * num_envs, *actions.shape[2:])
        )
        values = values.reshape(num_steps, num_envs)
        # A truncated episode did not end by the MDP: bootstrap from its real last observation.
        rewards = rollout.bootstrapped_rewards(
            gamma, lambda final: agent.get_value(torch.tensor(final, dtype=torch.float32)).reshape(-1).numpy()
        )
    dones = np.zeros((num_steps, num_envs), dtype=np.float32)
    if episode_starts is not None:
        dones[0] = np.asarray(episode_starts, dtype=np.float32)
    dones[1:] = done[:-1]
    return PPOBatch(
        obs=obs,
        actions=actions,
        logprobs=torch.tensor(rollout.log_probs, dtype=torch.float32),
        learner_logprobs=learner_logprobs.reshape(num_steps, num_envs),
        rewards=torch.from_numpy(rewards),
        dones=torch.from_numpy(dones),
        values=values,
        next_obs=next_obs,
        next_done=torch.tensor(done[-1], dtype=torch.float32),
        episodes=episodic_returns(rollout, start_step),
        versions=rollout.versions.copy(),
    )


class Transition(NamedTuple):
    """One vector step for ``ReplayBuffer.add``: arrays over envs (copies)."""

    obs: np.ndarray
    next_obs: np.ndarray  # the real next observation: the episode's last one where it ended
    actions: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray


def replay_transitions(rollout: Rollout) -> list[Transition]:
    """The segment's transitions, one per step; ``next_obs`` is the last observation of an ended
    episode (not the reset observation that follows it in same-step autoreset)."""
    if isinstance(rollout.obs, dict):
        raise TypeError("Dict observations are not supported by replay_transitions")
    obs, next_obs = np.array(rollout.obs), rollout.next_observations()
    actions, rewards = np.array(rollout.actions), np.array(rollout.rewards)
    terminated, truncated = np.array(rollout.terminated), np.array(rollout.truncated)
    return [
        Transition(obs[t], next_obs[t], actions[t], rewards[t], terminated[t], truncated[t])
        for t in range(rollout.n_steps)
    ]


def add_to_replay_buffer(rb: Any, rollout: Rollout) -> int:
    """Add a segment's transitions to SB3's ``ReplayBuffer`` (created with ``n_envs=num_envs``);
    returns how many env transitions were added.

    With ``handle_timeout_termination=False`` (CleanRL's choice) ``dones`` are the terminations, so
    a truncated episode still bootstraps from its last observation; with ``True``, ``dones`` are
    terminations or truncations and ``TimeLimit.truncated`` infos tell the buffer which were timeouts.
    """
    handle_timeouts = getattr(rb, "handle_timeout_termination", False)
    added = 0
    for step in replay_transitions(rollout):
        if handle_timeouts:
            dones = step.terminations | step.truncations
            infos = [{"TimeLimit.truncated": bool(t and not d)} for t, d in zip(step.truncations, step.terminations)]
        else:
            dones, infos = step.terminations, [{} for _ in step.rewards]
        rb.add(step.obs, step.next_obs, step.actions, step.rewards, dones, infos)
        added += len(step.rewards)
    return added


def _pool_of(envs: Any) -> EnvPool:
    pool = envs if isinstance(envs, EnvPool) else getattr(envs, "pool", None)
    if not isinstance(pool, EnvPool):
        raise TypeError(f"expected a ClusterVectorEnv or an EnvPool, got {type(envs).__name__}")
    if pool.autoreset_mode != "same_step":
        raise ValueError(
            f"worker rollouts need same-step autoreset, the envs use {pool.autoreset_mode!r}: create them with "
            "ClusterVectorEnv(env_fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP) "
            "(or EnvPool(env_fns, autoreset_mode='same_step'))"
        )
    return pool


def _check_dist_fits_actions(policy: Any, action_space: Any) -> None:
    """Refuse a :class:`DeployableAgent` that would take MultiDiscrete logits for one categorical:
    AAPS would measure a distribution the agent does not sample from, and miss its changes."""
    from gymnasium import spaces

    if (
        isinstance(policy, DeployableAgent)
        and type(policy).action_dist is DeployableAgent.action_dist
        and isinstance(action_space, spaces.MultiDiscrete)
        and action_space.nvec.size > 1
        and hasattr(policy, "actor")
        and not hasattr(policy, "nvec")
    ):
        raise ValueError(
            f"{type(policy).__name__} acts in {action_space}: give it self.nvec = "
            "envs.single_action_space.nvec (as CleanRL's ppo_multidiscrete agent has) so that action_dist splits "
            "its logits per sub-action, or override action_dist"
        )


class WorkerRollouts:
    """Segments collected by the workers with their copy of ``policy``, and when they get new weights.

    Resets the envs (seeded), deploys ``policy`` and makes a
    :class:`~clusterenv_core.aaps.PolicySync` (:attr:`sync`). Then each ``collect*`` call returns one
    segment of ``num_steps`` steps of every env, and :meth:`after_update`, called after each learner
    update, pushes the weights when the sync mode says so.

    :param envs: a :class:`~clusterenv_cleanrl.ClusterVectorEnv` created with same-step autoreset,
        or an :class:`~clusterenv_core.EnvPool` with ``autoreset_mode="same_step"``; do not step it
        yourself while rollouts are in use
    :param policy: the learner's module with ``act`` and ``action_dist`` (e.g. a
        :class:`DeployableAgent`); it stays the learner's, the workers get a copy
    :param num_steps: steps per env per segment
    :param sync: ``"always"`` (every update), ``"aaps"`` (when the divergence exceeds ``threshold``)
        or ``"never"``
    :param threshold: AAPS divergence threshold (mean KL, or fraction of changed greedy actions)
    :param max_staleness: with ``aaps``, push anyway after this many updates without a push
    :param probe_size: recent states AAPS compares the policies on (the latest segment's, and
        earlier segments' while it has fewer)
    :param overlap: start the next segment as soon as one is returned, so it is collected while
        the learner trains (its steps then act with weights up to one segment old; ``versions`` and
        the workers' log-probabilities record which)
    :param seed: envs reset with ``seed + i``; worker ``w`` samples actions with torch seed ``seed + w``
    """

    def __init__(
        self,
        envs: Any,
        policy: DeployablePolicy,
        num_steps: int,
        *,
        sync: str = "always",
        threshold: float = 0.01,
        max_staleness: int | None = None,
        probe_size: int = 256,
        overlap: bool = False,
        seed: int | None = None,
    ) -> None:
        self.pool = _pool_of(envs)
        self.num_steps = check_int("num_steps", num_steps, minimum=1)
        _check_dist_fits_actions(policy, self.pool.action_space)
        self.policy = policy
        self.num_envs = self.pool.num_envs
        self.overlap = bool(overlap)
        seeds = None if seed is None else [seed + i for i in range(self.num_envs)]
        # The reset a CleanRL script's envs.reset(seed=seed) did: a ClusterVectorEnv's passes SyncVectorEnv's keywords.
        self.pool.reset(seeds=seeds, omit_if_none=() if isinstance(envs, EnvPool) else RESET_OMIT_IF_NONE)
        #: the policy copies on the workers (:class:`~clusterenv_core.actors.WorkerActors`)
        self.actors = self.pool.deploy(policy, seed=seed)
        self.sync = PolicySync(self.actors, policy, mode=sync, threshold=threshold, max_staleness=max_staleness,
                               probe_size=probe_size)
        #: environment steps collected so far (all envs)
        self.global_step = 0
        #: done flags after the last collected step (CleanRL's ``next_done``)
        self.next_done = np.zeros(self.num_envs, dtype=bool)
        self._started = False

    def collect(self, context: dict | None = None) -> Rollout:
        """The next segment (waiting for it), as a :class:`~clusterenv_core.rollout.Rollout` valid
        until the next ``collect*`` call. Records its policy lag and, with AAPS, takes its states as
        the probe batch.

        :param context: keyword arguments of the policy's ``act`` (e.g. ``{"epsilon": 0.1}``); with
            ``overlap`` it also goes to the segment started ahead
        """
        actors = self.actors
        if not self._started:
            actors.rollout_async(self.num_steps, context)
        self._started = False
        rollout = actors.rollout_wait()  # the pool's timeout bounds the time without progress
        if self.overlap:
            actors.rollout_async(self.num_steps, context)
            self._started = True
        self.sync.record_rollout(rollout.versions)
        if self.sync.mode == "aaps":
            self.sync.observe(rollout.obs)
        self.global_step += rollout.rewards.size
        return rollout

    def collect_ppo(self, gamma: float) -> PPOBatch:
        """The next segment as CleanRL's PPO tensors (:func:`ppo_batch` with the learner's critic and policy)."""
        episode_starts = self.next_done.copy()
        start_step = self.global_step
        rollout = self.collect()
        episode_starts[rollout.restarted_envs] = True  # the new envs of a replaced worker
        self.next_done = rollout.dones[-1]
        return ppo_batch(rollout, self.policy, gamma, episode_starts, start_step)

    def collect_replay(self, rb: Any, context: dict | None = None) -> list[Episode]:
        """Collect the next segment into SB3's ``ReplayBuffer`` ``rb``; returns the episodes that ended."""
        start_step = self.global_step
        rollout = self.collect(context)
        self.next_done = rollout.dones[-1]
        add_to_replay_buffer(rb, rollout)
        return episodic_returns(rollout, start_step)

    def after_update(self) -> bool:
        """Call after each learner update: pushes the weights if the sync mode says so; returns whether it did."""
        return self.sync.after_update()

    def summary(self) -> dict[str, float]:
        """The sync counters: syncs, weight_bytes_sent, last_divergence, and the policy lag of the
        collected steps in published versions and in learner updates (``mean_update_lag``)."""
        return self.sync.summary()

    def close(self) -> None:
        """Wait for a segment started ahead (its steps are dropped), so the envs can be closed or reused."""
        if self._started:
            self._started = False
            if not self.pool.closed:  # closing the pool finished the segment already
                self.actors.rollout_wait()
