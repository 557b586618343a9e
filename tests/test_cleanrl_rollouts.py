"""CleanRL worker-rollout helpers: tensors against a sequential reference, truncation bootstrapping,
episodic returns, replay transitions and the PolicySync wiring."""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from clusterenv_cleanrl import (  # noqa: E402
    ClusterVectorEnv,
    DeployableAgent,
    DeployableQNetwork,
    DeployableSACActor,
    DeployableTD3Actor,
    WorkerRollouts,
    add_to_replay_buffer,
    episodic_returns,
    ppo_batch,
    replay_transitions,
)
from clusterenv_core import EnvPool  # noqa: E402
from clusterenv_core.aaps import divergence  # noqa: E402
from clusterenv_core.policy import Greedy, MultiCategorical
from clusterenv_core.rollout import Rollout  # noqa: E402
from tests.envs import lost_once  # noqa: E402

GAMMA = 0.9


class GreedyAgent(DeployableAgent, torch.nn.Module):
    """CleanRL's Agent interface with a deterministic (argmax) action, so workers and reference agree."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = torch.nn.Linear(4, 2)
        self.critic = torch.nn.Linear(4, 1)

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        dist = torch.distributions.Categorical(logits=logits)
        if action is None:
            action = logits.argmax(-1)
        return action, dist.log_prob(action), dist.entropy(), self.critic(x)


class QNetwork(DeployableQNetwork, torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.network = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.network(x)


def make_env(max_episode_steps: int = 9) -> gym.Env:
    """CartPole whose episodes often hit the time limit: truncations and terminations both occur."""
    return gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1", max_episode_steps=max_episode_steps))


SEEDS = [5, 6, 7, 8]


def _vector_env(processes_per_worker: int = 1) -> ClusterVectorEnv:
    return ClusterVectorEnv(
        [make_env] * len(SEEDS),
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        num_workers=2,
        processes_per_worker=processes_per_worker,
    )


def _reference(agent, n_steps: int, segments: int = 1):
    """The same steps, one env after the other in this process (same-step autoreset by hand)."""
    envs = [make_env() for _ in SEEDS]
    obs = np.stack([env.reset(seed=seed)[0] for env, seed in zip(envs, SEEDS)])
    steps = []
    for _ in range(n_steps * segments):
        with torch.no_grad():
            actions = agent.act(torch.as_tensor(obs))["actions"].numpy()
        step = {"obs": obs.copy(), "actions": actions, "rewards": [], "term": [], "trunc": [], "final": {}, "eps": {}}
        for i, env in enumerate(envs):
            o, r, term, trunc, info = env.step(actions[i])
            step["rewards"].append(r)
            step["term"].append(term)
            step["trunc"].append(trunc)
            if term or trunc:
                step["final"][i] = o
                step["eps"][i] = (float(info["episode"]["r"]), int(info["episode"]["l"]))
                o, _ = env.reset()
            obs[i] = o
        steps.append(step)
    return steps, obs


@pytest.mark.parametrize("processes_per_worker", [1, 2], ids=["flat", "agents"])
def test_ppo_batch_matches_sequential_reference(processes_per_worker):
    torch.manual_seed(0)
    agent = GreedyAgent()
    with torch.no_grad():  # mostly push left: episodes end terminated (about 9 steps) or truncated (9)
        agent.actor.bias.copy_(torch.tensor([2.0, -2.0]))
    n_steps = 30
    expected, last_obs = _reference(agent, n_steps, segments=2)
    with _vector_env(processes_per_worker) as envs:
        rollouts = WorkerRollouts(envs, agent, n_steps, seed=SEEDS[0])
        batches = [rollouts.collect_ppo(GAMMA) for _ in range(2)]
        rollouts.close()
    terms = np.array([s["term"] for s in expected])
    truncs = np.array([s["trunc"] for s in expected])
    assert (truncs & ~terms).sum() >= 3 and terms.sum() >= 3  # both kinds of episode end are exercised

    prev_done = np.zeros(len(SEEDS), bool)
    for k, b in enumerate(batches):
        ref = expected[k * n_steps : (k + 1) * n_steps]
        obs = torch.as_tensor(np.stack([s["obs"] for s in ref]))
        assert b.obs.shape == (n_steps, 4, 4) and b.obs.dtype == torch.float32
        torch.testing.assert_close(b.obs, obs)
        np.testing.assert_array_equal(b.actions.numpy(), np.stack([s["actions"] for s in ref]))
        with torch.no_grad():
            _, logprob, _, value = agent.get_action_and_value(obs, b.actions)
            torch.testing.assert_close(b.logprobs, logprob)  # the workers' log-probs
            torch.testing.assert_close(b.learner_logprobs, logprob)  # the same policy on the learner
            torch.testing.assert_close(b.values, value.squeeze(-1))  # the learner's critic
            rewards = torch.tensor([s["rewards"] for s in ref], dtype=torch.float32)
            for t, s in enumerate(ref):
                for i, final in s["final"].items():
                    if s["trunc"][i] and not s["term"][i]:
                        rewards[t, i] += GAMMA * agent.get_value(torch.as_tensor(final)).item()
        torch.testing.assert_close(b.rewards, rewards)
        done = np.array([[te or tr for te, tr in zip(s["term"], s["trunc"])] for s in ref])
        np.testing.assert_array_equal(b.dones.numpy(), np.concatenate([prev_done[None], done[:-1]]).astype(np.float32))
        np.testing.assert_array_equal(b.next_done.numpy(), done[-1].astype(np.float32))
        prev_done = done[-1]
        following = expected[(k + 1) * n_steps]["obs"] if k == 0 else last_obs
        np.testing.assert_array_equal(b.next_obs.numpy(), following)
        # Episodes: RecordEpisodeStatistics' returns, at CleanRL's global step.
        eps = [
            (k * n_steps * 4 + (t + 1) * 4, i, *s["eps"][i]) for t, s in enumerate(ref) for i in sorted(s["eps"])
        ]
        assert [tuple(e) for e in b.episodes] == eps
        assert (b.versions == 0).all()


def _synthetic_rollout() -> Rollout:
    """Three steps of two envs with hand-made ends: env 0 truncated at t=0, env 1 terminated and
    truncated at t=1 (termination wins: no bootstrap), env 0 terminated at t=2."""
    obs = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)
    terminated = np.array([[False, False], [False, True], [True, False]])
    truncated = np.array([[True, False], [False, True], [False, False]])
    final = {(0, 0): np.full(4, 10.0, np.float32), (1, 1): np.full(4, 20.0, np.float32), (2, 0): np.full(4, 30.0, np.float32)}
    infos = [{0: {"episode": {"r": np.float64(7.0), "l": np.int32(7)}}}, {1: {"episode": {"r": 3.0, "l": 3}, "x": 1}}, {}]
    return Rollout(
        obs=obs,
        actions=np.array([[0, 1], [1, 1], [0, 0]]),
        rewards=np.ones((3, 2)),
        terminated=terminated,
        truncated=truncated,
        log_probs=np.full((3, 2), -0.5, np.float32),
        values=np.zeros((3, 2), np.float32),
        versions=np.zeros((3, 2), np.int64),
        last_obs=np.full((2, 4), -1.0, np.float32),
        infos=infos,
        reset_infos=[{}, {}, {}],
        pickled_final_obs=final,
    )


class SumCritic(torch.nn.Module):
    """V(x) = sum(x); a uniform policy over two actions."""

    def get_value(self, x):
        return x.sum(-1, keepdim=True)

    def get_action_and_value(self, x, action):
        log_prob = torch.full(action.shape, -float(np.log(2.0)))
        return action, log_prob, -log_prob, self.get_value(x)


def test_truncation_bootstraps_and_termination_does_not():
    rollout = _synthetic_rollout()
    b = ppo_batch(rollout, SumCritic(), GAMMA, episode_starts=np.array([True, False]), start_step=100)
    expected = np.ones((3, 2), np.float32)
    expected[0, 0] += GAMMA * 40.0  # truncated only: gamma * V(final obs), V = sum = 4 * 10
    np.testing.assert_allclose(b.rewards.numpy(), expected)
    np.testing.assert_array_equal(b.dones.numpy(), [[1, 0], [1, 0], [0, 1]])
    np.testing.assert_array_equal(b.next_done.numpy(), [1, 0])
    np.testing.assert_allclose(b.values.numpy(), rollout.obs.sum(-1))
    np.testing.assert_allclose(b.learner_logprobs.numpy(), np.full((3, 2), -np.log(2.0)), rtol=1e-6)
    assert [tuple(e) for e in b.episodes] == [(102, 0, 7.0, 7), (104, 1, 3.0, 3)]
    assert episodic_returns(rollout) == [(2, 0, 7.0, 7), (4, 1, 3.0, 3)]
    # The batch is a copy: the rollout's arrays may be reused by the pool.
    rollout.obs[:] = 0
    assert b.obs.abs().sum() > 0


def test_replay_transitions_use_final_observations():
    rollout = _synthetic_rollout()
    steps = replay_transitions(rollout)
    assert len(steps) == 3
    np.testing.assert_array_equal(steps[0].next_obs[0], np.full(4, 10.0))  # truncated: its last obs
    np.testing.assert_array_equal(steps[0].next_obs[1], rollout.obs[1, 1])
    np.testing.assert_array_equal(steps[1].next_obs[1], np.full(4, 20.0))
    np.testing.assert_array_equal(steps[2].next_obs[0], np.full(4, 30.0))
    np.testing.assert_array_equal(steps[2].next_obs[1], rollout.last_obs[1])

    from stable_baselines3.common.buffers import ReplayBuffer

    space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    for handle_timeouts in (False, True):
        rb = ReplayBuffer(10, space, gym.spaces.Discrete(2), device="cpu", n_envs=2, handle_timeout_termination=handle_timeouts)
        assert add_to_replay_buffer(rb, rollout) == 6
        np.testing.assert_array_equal(rb.observations[:3], rollout.obs)
        np.testing.assert_array_equal(rb.next_observations[:3], np.stack([s.next_obs for s in steps]))
        np.testing.assert_array_equal(rb.actions[:3, :, 0], rollout.actions)
        # What the TD target multiplies by: 1 - done, with timeouts not counted as done.
        effective_dones = rb.dones[:3] * (1 - rb.timeouts[:3]) if handle_timeouts else rb.dones[:3]
        np.testing.assert_array_equal(effective_dones, rollout.terminated.astype(np.float32))


@pytest.mark.parametrize("processes_per_worker", [1, 2], ids=["flat", "agents"])
def test_sync_modes_count_pushes_and_workers_act_with_the_pushed_weights(processes_per_worker):
    # Through node agents, one weights message per agent: 2, as from 2 flat workers.
    torch.manual_seed(1)
    for mode, expected_syncs in (("always", 3), ("never", 0)):
        agent = GreedyAgent()
        with EnvPool([make_env] * 4, num_workers=2, processes_per_worker=processes_per_worker) as pool:
            rollouts = WorkerRollouts(pool, agent, 8, sync=mode, seed=0)
            for _ in range(3):
                b = rollouts.collect_ppo(GAMMA)
                with torch.no_grad():  # an "update": the policy changes (one logit only: softmax moves)
                    agent.actor.weight[0].add_(0.5)
                rollouts.after_update()
            b = rollouts.collect_ppo(GAMMA)
            summary = rollouts.summary()
            assert summary["updates"] == 3 and summary["syncs"] == expected_syncs
            assert summary["weight_bytes_sent"] == expected_syncs * rollouts.actors.weights_nbytes * 2
            assert (b.versions == expected_syncs).all() and rollouts.actors.policy_version == expected_syncs
            with torch.no_grad():
                acting = agent if mode == "always" else rollouts.sync.deployed
                np.testing.assert_array_equal(b.actions[0].numpy(), acting.actor(b.obs[0]).argmax(-1).numpy())
                # logprobs: the policy that acted; learner_logprobs: the learner's current one.
                torch.testing.assert_close(b.logprobs, acting.get_action_and_value(b.obs, b.actions)[1])
                torch.testing.assert_close(b.learner_logprobs, agent.get_action_and_value(b.obs, b.actions)[1])
                if mode == "never":
                    assert not torch.allclose(b.logprobs, b.learner_logprobs)
            assert rollouts.global_step == 4 * 8 * 4
            # Segments collected after 0, 1, 2, 3 updates: never-synced workers lag 0..3 updates behind.
            assert summary["mean_update_lag"] == (0.0 if mode == "always" else 1.5)


def test_aaps_wiring_and_overlap_keep_segments_contiguous():
    torch.manual_seed(2)
    agent = GreedyAgent()
    with EnvPool([make_env] * 4, num_workers=2) as pool:
        rollouts = WorkerRollouts(pool, agent, 10, sync="aaps", threshold=1e-3, overlap=True, seed=0)
        first = rollouts.collect_ppo(GAMMA)
        assert rollouts.sync.probe_obs.shape == (40, 4)  # the segment's states are the probe batch
        assert rollouts.after_update() is False  # no change, no push
        with torch.no_grad():
            agent.actor.weight.mul_(-1)
        assert rollouts.after_update() is True and rollouts.summary()["syncs"] == 1
        second = rollouts.collect_ppo(GAMMA)  # started ahead, before the push
        torch.testing.assert_close(second.obs[0], first.next_obs)
        assert second.dones[0].tolist() == first.next_done.tolist()
        third = rollouts.collect_ppo(GAMMA)
        torch.testing.assert_close(third.obs[0], second.next_obs)
        assert third.versions[-1].tolist() == [1, 1, 1, 1]  # the pushed weights reach the workers
        rollouts.close()
        pool.reset()  # nothing pending after close
        rollouts.collect_ppo(GAMMA)  # starts the next segment ahead
    rollouts.close()  # after the pool: closing it ended that segment


def test_the_new_envs_of_a_worker_lost_mid_segment_start_episodes(tmp_path):
    env_fns = [make_env] * 3 + [functools.partial(lost_once, str(tmp_path / "built"), "killed", 6)]
    with EnvPool(env_fns, num_workers=2, restart_failed_workers=True) as pool:
        rollouts = WorkerRollouts(pool, GreedyAgent(), 4, seed=0)
        rollouts.collect_ppo(GAMMA)
        second = rollouts.collect_ppo(GAMMA)  # env 3's worker is lost at its 6th step
        assert pool.restarts["workers"] == 1
        assert second.dones[0, 2:].tolist() == [1.0, 1.0]


def test_an_update_before_any_segment_is_not_counted():
    with EnvPool([make_env] * 2, num_workers=1) as pool:
        rollouts = WorkerRollouts(pool, GreedyAgent(), 4, sync="aaps", seed=0)
        with pytest.raises(RuntimeError, match="collect a segment"):
            rollouts.after_update()
        assert rollouts.summary()["updates"] == 0


def test_q_network_acts_epsilon_greedy_with_context():
    torch.manual_seed(3)
    q = QNetwork()
    obs = torch.randn(2000, 4)
    greedy = q(obs).argmax(-1)
    assert torch.equal(q.act(obs)["actions"], greedy)
    assert (q.act(obs, epsilon=1.0)["actions"] != greedy).float().mean().item() == pytest.approx(0.5, abs=0.05)
    assert type(q.action_dist(obs)) is Greedy
    with EnvPool([make_env] * 2, num_workers=1) as pool:
        rollouts = WorkerRollouts(pool, q, 50, sync="aaps", seed=0)
        greedy_rollout = rollouts.collect(context={"epsilon": 0.0})
        with torch.no_grad():
            np.testing.assert_array_equal(greedy_rollout.actions, q(torch.as_tensor(greedy_rollout.obs)).argmax(-1))
        random_rollout = rollouts.collect(context={"epsilon": 1.0})
        with torch.no_grad():
            matches = (random_rollout.actions == q(torch.as_tensor(random_rollout.obs)).argmax(-1).numpy()).mean()
        assert 0.3 < matches < 0.7


def test_rollouts_need_same_step_autoreset():
    with ClusterVectorEnv([functools.partial(gym.make, "CartPole-v1")] * 2, num_workers=1) as envs:
        with pytest.raises(ValueError, match="SAME_STEP"):
            WorkerRollouts(envs, GreedyAgent(), 4)
    with pytest.raises(TypeError, match="ClusterVectorEnv"):
        WorkerRollouts(gym.vector.SyncVectorEnv([make_env]), GreedyAgent(), 4)


class TwoKnobCartPole(gym.ActionWrapper):
    """CartPole driven by a MultiDiscrete([2, 3]) action (its first entry pushes the cart)."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1", max_episode_steps=9))
        self.action_space = gym.spaces.MultiDiscrete([2, 3])

    def action(self, action):
        return int(action[0])


class MultiDiscreteAgent(DeployableAgent, torch.nn.Module):
    """CleanRL's ppo_multidiscrete agent, small: one logits head split per sub-action."""

    def __init__(self, with_nvec: bool) -> None:
        super().__init__()
        if with_nvec:
            self.nvec = np.array([2, 3])
        self.actor = torch.nn.Linear(4, 5)
        self.critic = torch.nn.Linear(4, 1)

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        dists = [torch.distributions.Categorical(logits=part) for part in torch.split(self.actor(x), [2, 3], dim=1)]
        if action is None:
            action = torch.stack([dist.sample() for dist in dists], dim=1)
        log_prob = torch.stack([dist.log_prob(part) for dist, part in zip(dists, action.T)]).sum(0)
        entropy = torch.stack([dist.entropy() for dist in dists]).sum(0)
        return action, log_prob, entropy, self.critic(x)


def test_a_multidiscrete_agents_divergence_is_per_sub_action():
    with ClusterVectorEnv([TwoKnobCartPole] * 2, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP, num_workers=1) as envs:
        with pytest.raises(ValueError, match="self.nvec"):
            WorkerRollouts(envs, MultiDiscreteAgent(with_nvec=False), 4)
        deployed = MultiDiscreteAgent(with_nvec=True)
        rollouts = WorkerRollouts(envs, deployed, 4, seed=0)
        rollout = rollouts.collect()
        assert rollout.actions.shape == (4, 2, 2)
    current = MultiDiscreteAgent(with_nvec=True)
    current.load_state_dict(deployed.state_dict())
    with torch.no_grad():
        current.actor.bias[2:].add_(torch.tensor([3.0, 0.0, -3.0]))  # only the second sub-action changes
    probe = np.random.default_rng(0).uniform(-1, 1, (32, 4)).astype(np.float32)
    with torch.no_grad():
        heads = [torch.split(agent.actor(torch.as_tensor(probe)), [2, 3], dim=1) for agent in (deployed, current)]
        dists = [[torch.distributions.Categorical(logits=part) for part in parts] for parts in heads]
        expected = sum(torch.distributions.kl_divergence(p, q) for p, q in zip(*dists)).mean().item()
    assert type(deployed.action_dist(torch.as_tensor(probe))) is MultiCategorical
    assert divergence(deployed, current, probe) == pytest.approx(expected, rel=1e-5)


class ScaledActor(torch.nn.Module):
    """The parts CleanRL's SAC and TD3 actors share: a Box of [-2, 2] and [0, 1] (scale and bias buffers)."""

    def __init__(self, outputs: int) -> None:
        super().__init__()
        self.body = torch.nn.Linear(3, outputs)
        self.register_buffer("action_scale", torch.tensor([2.0, 0.5]))
        self.register_buffer("action_bias", torch.tensor([0.0, 0.5]))


class SACActor(DeployableSACActor, ScaledActor):
    def __init__(self) -> None:
        super().__init__(4)

    def forward(self, x):
        mean, log_std = self.body(x).chunk(2, dim=-1)
        return mean, log_std.clamp(-5, 2)

    def get_action(self, x):
        mean, log_std = self(x)
        y = torch.tanh(torch.distributions.Normal(mean, log_std.exp()).rsample())
        return y * self.action_scale + self.action_bias, None, torch.tanh(mean) * self.action_scale + self.action_bias


class TD3Actor(DeployableTD3Actor, ScaledActor):
    def __init__(self) -> None:
        super().__init__(2)
        self.exploration_noise = 0.25

    def forward(self, x):
        return torch.tanh(self.body(x)) * self.action_scale + self.action_bias


@pytest.mark.parametrize("actor_class", [SACActor, TD3Actor])
def test_continuous_actors_act_within_the_box_and_warm_up_uniformly(actor_class):
    torch.manual_seed(0)
    actor = actor_class()
    obs = torch.randn(4000, 3)
    low, high = torch.tensor([-2.0, 0.0]), torch.tensor([2.0, 1.0])
    for context in ({}, {"random": True}):
        actions = actor.act(obs, **context)["actions"]
        assert actions.shape == (4000, 2) and torch.all(actions >= low) and torch.all(actions <= high)
    uniform = actor.act(obs, random=True)["actions"]
    np.testing.assert_allclose(uniform.mean(0).numpy(), [0.0, 0.5], atol=0.05)  # uniform over the Box
    np.testing.assert_allclose(uniform.std(0).numpy(), [4 / 12**0.5, 1 / 12**0.5], rtol=0.05)


def test_td3_noise_is_cleanrls_and_its_divergence_the_closed_form():
    torch.manual_seed(1)
    actor = TD3Actor()
    obs = torch.randn(20000, 3)
    with torch.no_grad():
        mu = actor(obs)
        noisy = actor.act(obs, exploration_noise=0.05)["actions"]
    inside = (mu[:, 0].abs() < 1.0)  # far from the bounds: no clipping
    np.testing.assert_allclose((noisy - mu)[inside, 0].std().item(), 2.0 * 0.05, rtol=0.05)  # action_scale * noise
    changed = TD3Actor()
    changed.load_state_dict(actor.state_dict())
    with torch.no_grad():
        changed.body.bias.add_(0.1)
        sigma = actor.action_scale * 0.25
        expected = (((actor(obs) - changed(obs)) ** 2) / (2 * sigma**2)).sum(-1).mean().item()
    assert divergence(actor, changed, obs.numpy()) == pytest.approx(expected, rel=1e-5)


def test_sac_divergence_is_the_kl_of_its_gaussians():
    torch.manual_seed(2)
    actor, changed = SACActor(), SACActor()
    obs = torch.randn(500, 3)
    with torch.no_grad():
        (mean_p, log_std_p), (mean_q, log_std_q) = actor(obs), changed(obs)
    expected = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean_p, log_std_p.exp()), torch.distributions.Normal(mean_q, log_std_q.exp())
    ).sum(-1).mean().item()
    assert divergence(actor, changed, obs.numpy()) == pytest.approx(expected, rel=1e-5)


def test_continuous_actor_collects_into_a_replay_buffer_and_syncs():
    from stable_baselines3.common.buffers import ReplayBuffer

    env_fn = functools.partial(gym.make, "Pendulum-v1")
    envs = ClusterVectorEnv([env_fn] * 2, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP, num_workers=1)
    try:
        actor = PendulumTD3Actor()
        rollouts = WorkerRollouts(envs, actor, 8, sync="aaps", threshold=0.5, seed=0)
        rb = ReplayBuffer(100, envs.single_observation_space, envs.single_action_space, device="cpu", n_envs=2)
        rollouts.collect_replay(rb, context={"random": True})
        rollout = rollouts.collect(context={"exploration_noise": 0.0})
        with torch.no_grad():  # no noise: the workers' actions are the deployed actor's
            np.testing.assert_allclose(rollout.actions, actor(torch.as_tensor(rollout.obs)).numpy(), rtol=1e-6)
        assert rb.pos == 8 and np.all(np.abs(rb.actions[:8]) <= 2.0)
        with torch.no_grad():
            actor.fc.bias.add_(1.0)  # a large drift: AAPS pushes
        assert rollouts.after_update() and rollouts.summary()["syncs"] == 1
        assert not rollouts.after_update()  # no further change: no push
    finally:
        rollouts.close()
        envs.close()


class PendulumTD3Actor(DeployableTD3Actor, torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 1)
        self.register_buffer("action_scale", torch.tensor([2.0]))
        self.register_buffer("action_bias", torch.tensor([0.0]))

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.action_scale + self.action_bias
