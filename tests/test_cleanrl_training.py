"""A CleanRL-style PPO loop learns exactly the same on ``ClusterVectorEnv`` as on ``SyncVectorEnv``.

Needs torch (skipped where it is not installed, e.g. the gymnasium 0.29 CI venv).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from clusterenv_cleanrl import ClusterVectorEnv
from tests.envs import cartpole_with_statistics

torch = pytest.importorskip("torch")
nn = torch.nn

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

NUM_ENVS = 4
NUM_STEPS = 64
ITERATIONS = 4
EPOCHS = 2
MINIBATCHES = 4


class Agent(nn.Module):
    def __init__(self, obs_dim: int, num_actions: int) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(obs_dim, 16), nn.Tanh(), nn.Linear(16, 1))
        self.actor = nn.Sequential(nn.Linear(obs_dim, 16), nn.Tanh(), nn.Linear(16, num_actions))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        distribution = torch.distributions.Categorical(logits=self.actor(x))
        if action is None:
            action = distribution.sample()
        return action, distribution.log_prob(action), distribution.entropy(), self.critic(x)


def finished_returns(infos: dict) -> list[float]:
    """Episodic returns of the episodes that ended in this step."""
    if "episode" in infos:  # gymnasium 1.x, next-step autoreset
        return infos["episode"]["r"][infos["_episode"]].tolist()
    if "final_info" in infos:  # gymnasium 0.29
        return [float(np.squeeze(info["episode"]["r"])) for info in infos["final_info"][infos["_final_info"]]]
    return []


def train_ppo(envs: gym.vector.VectorEnv, seed: int = 1) -> tuple[dict, list[float]]:
    """A few PPO iterations (CleanRL's ppo.py, scaled down); returns the parameters and episodic returns."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    obs_dim = envs.single_observation_space.shape[0]
    agent = Agent(obs_dim, int(envs.single_action_space.n))
    optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-3, eps=1e-5)
    obs = torch.zeros((NUM_STEPS, NUM_ENVS, obs_dim))
    actions = torch.zeros((NUM_STEPS, NUM_ENVS), dtype=torch.long)
    logprobs = torch.zeros((NUM_STEPS, NUM_ENVS))
    rewards = torch.zeros((NUM_STEPS, NUM_ENVS))
    dones = torch.zeros((NUM_STEPS, NUM_ENVS))
    values = torch.zeros((NUM_STEPS, NUM_ENVS))
    returns_seen: list[float] = []

    next_obs, _ = envs.reset(seed=seed)
    next_obs, next_done = torch.tensor(next_obs), torch.zeros(NUM_ENVS)
    for _ in range(ITERATIONS):
        for step in range(NUM_STEPS):
            obs[step], dones[step] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            actions[step], logprobs[step], values[step] = action, logprob, value.flatten()
            next_obs, reward, terminations, truncations, infos = envs.step(action.numpy())
            rewards[step] = torch.tensor(reward, dtype=torch.float32)
            next_obs = torch.tensor(next_obs)
            next_done = torch.tensor(np.logical_or(terminations, truncations), dtype=torch.float32)
            returns_seen += finished_returns(infos)

        with torch.no_grad():
            next_value = agent.get_value(next_obs).flatten()
            advantages = torch.zeros_like(rewards)
            last = torch.zeros(NUM_ENVS)
            for t in reversed(range(NUM_STEPS)):
                nonterminal = 1.0 - (next_done if t == NUM_STEPS - 1 else dones[t + 1])
                following = next_value if t == NUM_STEPS - 1 else values[t + 1]
                delta = rewards[t] + 0.99 * following * nonterminal - values[t]
                advantages[t] = last = delta + 0.99 * 0.95 * nonterminal * last
            value_targets = advantages + values

        b_obs, b_actions, b_logprobs = obs.reshape(-1, obs_dim), actions.reshape(-1), logprobs.reshape(-1)
        b_advantages, b_targets = advantages.reshape(-1), value_targets.reshape(-1)
        batch_size = NUM_STEPS * NUM_ENVS
        for _ in range(EPOCHS):
            order = rng.permutation(batch_size)
            for start in range(0, batch_size, batch_size // MINIBATCHES):
                mb = torch.as_tensor(order[start : start + batch_size // MINIBATCHES])
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions[mb])
                ratio = (newlogprob - b_logprobs[mb]).exp()
                mb_adv = (b_advantages[mb] - b_advantages[mb].mean()) / (b_advantages[mb].std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 0.8, 1.2)).mean()
                v_loss = 0.5 * ((newvalue.flatten() - b_targets[mb]) ** 2).mean()
                loss = pg_loss - 0.01 * entropy.mean() + 0.5 * v_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                optimizer.step()
    return agent.state_dict(), returns_seen


def test_ppo_learns_bit_identical_parameters():
    env_fns = [cartpole_with_statistics] * NUM_ENVS
    sync = gym.vector.SyncVectorEnv(env_fns)
    expected_params, expected_returns = train_ppo(sync)
    sync.close()
    with ClusterVectorEnv(env_fns, num_workers=2) as cluster:
        params, episode_returns = train_ppo(cluster)

    assert len(expected_returns) > 10
    assert episode_returns == expected_returns
    assert list(params) == list(expected_params)
    for name in expected_params:
        assert torch.equal(params[name], expected_params[name]), name
