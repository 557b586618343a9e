"""PPO for continuous actions (MuJoCo's HalfCheetah-v5 by default) in one file, CleanRL style, with
the simulators on ClusterEnv workers.

    python examples/cleanrl/ppo_continuous_action.py --env-id HalfCheetah-v5 --total-timesteps 1000000

Going distributed is one line: ``ClusterVectorEnv(env_fns, ...)`` where the script had
``gym.vector.SyncVectorEnv(env_fns)`` (marked below). Each env normalizes its own observations and
rewards with gymnasium's wrappers, so those running statistics live on the workers; the final
evaluation reads env 0's observation statistics back with ``envs.get_attr``. Written for gymnasium
1.x and its next-step autoreset (see ``ppo.py``); metrics go to TensorBoard under ``runs/``.
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections import deque
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import tyro
from torch.distributions.normal import Normal
from torch.utils.tensorboard import SummaryWriter

from clusterenv_cleanrl import ClusterVectorEnv


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    env_id: str = "HalfCheetah-v5"
    """the id of the environment"""
    total_timesteps: int = 1_000_000
    """total timesteps of the experiment"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 4
    """the number of parallel environments"""
    num_steps: int = 512
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 32
    """the number of mini-batches"""
    update_epochs: int = 10
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """toggles advantages normalization"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function"""
    ent_coef: float = 0.0
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    backend: str = "local"
    """ClusterEnv backend: local (processes on this machine) or mpi"""
    num_workers: int | None = None
    """ClusterEnv workers (default: one per core, at most one per env)"""
    eval_episodes: int = 10
    """episodes of the deterministic policy evaluated at the end"""


def make_env(env_id: str, gamma: float):
    def thunk() -> gym.Env:
        env = gym.make(env_id)
        env = gym.wrappers.FlattenObservation(env)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env = gym.wrappers.ClipAction(env)
        env = gym.wrappers.NormalizeObservation(env)
        env = gym.wrappers.TransformObservation(env, lambda obs: np.clip(obs, -10, 10), env.observation_space)
        env = gym.wrappers.NormalizeReward(env, gamma=gamma)
        return gym.wrappers.TransformReward(env, lambda reward: np.clip(reward, -10, 10))

    return thunk


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim: int, action_dim: int) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, action_dim), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, action_dim))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        action_mean = self.actor_mean(x)
        probs = Normal(action_mean, self.actor_logstd.expand_as(action_mean).exp())
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


def evaluate(agent: Agent, env_fn, obs_rms, episodes: int, seed: int) -> list[float]:
    """Returns of ``episodes`` episodes of the mean action, observations normalized with ``obs_rms``
    (frozen); the returns are the env's own (RecordEpisodeStatistics sits below the reward wrappers)."""
    env = env_fn()
    env.set_wrapper_attr("obs_rms", obs_rms)
    env.set_wrapper_attr("update_running_mean", False)
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        while True:
            with torch.no_grad():
                action = agent.actor_mean(torch.as_tensor(obs, dtype=torch.float32).unsqueeze(0))[0].numpy()
            obs, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                returns.append(float(info["episode"]["r"]))
                break
    env.close()
    return returns


if __name__ == "__main__":
    args = tyro.cli(Args)
    batch_size = args.num_envs * args.num_steps
    num_iterations = args.total_timesteps // batch_size
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    writer = SummaryWriter(f"runs/{run_name}")
    writer.add_text(
        "hyperparameters",
        "|param|value|\n|-|-|\n%s" % ("\n".join(f"|{key}|{value}|" for key, value in vars(args).items())),
    )

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    # Small networks run fastest on one thread, and the env workers need the other cores.
    torch.set_num_threads(1)

    env_fns = [make_env(args.env_id, args.gamma) for _ in range(args.num_envs)]
    # The one ClusterEnv line; it was: envs = gym.vector.SyncVectorEnv(env_fns)
    envs = ClusterVectorEnv(env_fns, backend=args.backend, num_workers=args.num_workers)
    assert isinstance(envs.single_action_space, gym.spaces.Box), "only continuous action space is supported"

    obs_dim = int(np.prod(envs.single_observation_space.shape))
    action_dim = int(np.prod(envs.single_action_space.shape))
    agent = Agent(obs_dim, action_dim)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    # Rollout storage. ``valid`` is 0 for the reset steps of next-step autoreset, which are no transitions.
    obs = torch.zeros((args.num_steps, args.num_envs, obs_dim))
    actions = torch.zeros((args.num_steps, args.num_envs, action_dim))
    logprobs = torch.zeros((args.num_steps, args.num_envs))
    rewards = torch.zeros((args.num_steps, args.num_envs))
    terminated = torch.zeros((args.num_steps, args.num_envs))
    ended = torch.zeros((args.num_steps, args.num_envs))
    valid = torch.zeros((args.num_steps, args.num_envs), dtype=torch.bool)
    values = torch.zeros((args.num_steps, args.num_envs))

    global_step = 0
    recent_returns: deque[float] = deque(maxlen=20)
    start_time = time.time()
    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.as_tensor(next_obs, dtype=torch.float32)
    autoreset = np.zeros(args.num_envs, dtype=bool)  # the next step of these envs only resets them

    for iteration in range(1, num_iterations + 1):
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate

        for step in range(args.num_steps):
            global_step += args.num_envs
            obs[step] = next_obs
            valid[step] = torch.as_tensor(~autoreset)
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            actions[step], logprobs[step], values[step] = action, logprob, value.flatten()

            next_obs, reward, terminations, truncations, infos = envs.step(action.numpy())
            autoreset = np.logical_or(terminations, truncations)
            rewards[step] = torch.as_tensor(reward, dtype=torch.float32)
            terminated[step] = torch.as_tensor(terminations, dtype=torch.float32)
            ended[step] = torch.as_tensor(autoreset, dtype=torch.float32)
            next_obs = torch.as_tensor(next_obs, dtype=torch.float32)

            if "episode" in infos:
                for i in np.flatnonzero(infos["_episode"]):
                    episodic_return = float(infos["episode"]["r"][i])
                    recent_returns.append(episodic_return)
                    writer.add_scalar("charts/episodic_return", episodic_return, global_step)
                    writer.add_scalar("charts/episodic_length", int(infos["episode"]["l"][i]), global_step)

        # GAE, as in ppo.py: only termination cuts the bootstrap, any ended episode the advantage chain.
        with torch.no_grad():
            next_values = torch.cat([values[1:], agent.get_value(next_obs).reshape(1, -1)])
            deltas = rewards + args.gamma * next_values * (1.0 - terminated) - values
            advantages = torch.zeros_like(rewards)
            last_advantage = torch.zeros(args.num_envs)
            for t in reversed(range(args.num_steps)):
                last_advantage = deltas[t] + args.gamma * args.gae_lambda * (1.0 - ended[t]) * last_advantage
                advantages[t] = last_advantage
            returns = advantages + values

        # Flatten the batch, keeping real transitions only.
        kept = valid.reshape(-1)
        b_obs = obs.reshape(-1, obs_dim)[kept]
        b_actions = actions.reshape(-1, action_dim)[kept]
        b_logprobs = logprobs.reshape(-1)[kept]
        b_advantages = advantages.reshape(-1)[kept]
        b_returns = returns.reshape(-1)[kept]
        b_values = values.reshape(-1)[kept]

        clipfracs = []
        for epoch in range(args.update_epochs):
            for mb_inds in np.array_split(np.random.permutation(len(b_obs)), args.num_minibatches):
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()
                with torch.no_grad():
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfracs.append(((ratio - 1.0).abs() > args.clip_coef).float().mean().item())

                mb_advantages = b_advantages[mb_inds]
                if args.norm_adv:
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
                pg_loss = torch.max(
                    -mb_advantages * ratio, -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                ).mean()

                newvalue = newvalue.view(-1)
                if args.clip_vloss:
                    v_clipped = b_values[mb_inds] + torch.clamp(
                        newvalue - b_values[mb_inds], -args.clip_coef, args.clip_coef
                    )
                    v_loss = 0.5 * torch.max(
                        (newvalue - b_returns[mb_inds]) ** 2, (v_clipped - b_returns[mb_inds]) ** 2
                    ).mean()
                else:
                    v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()

                entropy_loss = entropy.mean()
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()

        y_pred, y_true = b_values.numpy(), b_returns.numpy()
        explained_var = np.nan if np.var(y_true) == 0 else 1 - np.var(y_true - y_pred) / np.var(y_true)
        sps = int(global_step / (time.time() - start_time))
        writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
        writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
        writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
        writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
        writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
        writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
        writer.add_scalar("losses/explained_variance", explained_var, global_step)
        writer.add_scalar("charts/SPS", sps, global_step)
        if iteration % 10 == 0 or iteration == num_iterations:
            mean_return = np.mean(recent_returns) if recent_returns else float("nan")
            print(f"global_step={global_step}, mean_episodic_return(last 20)={mean_return:.1f}, SPS={sps}")

    train_seconds = time.time() - start_time
    obs_rms = copy.deepcopy(envs.get_attr("obs_rms")[0])  # env 0's observation statistics, from its worker
    envs.close()
    print(f"trained {global_step} steps in {train_seconds:.0f} s ({int(global_step / train_seconds)} SPS)")
    mean_return = np.mean(recent_returns) if recent_returns else float("nan")
    print(f"mean episodic return of the last {len(recent_returns)} training episodes: {mean_return:.1f}")
    if args.eval_episodes > 0:
        eval_returns = evaluate(agent, env_fns[0], obs_rms, args.eval_episodes, seed=args.seed + 10_000)
        for episode, episodic_return in enumerate(eval_returns):
            writer.add_scalar("eval/episodic_return", episodic_return, episode)
        print(f"deterministic policy, mean return over {args.eval_episodes} episodes: {np.mean(eval_returns):.1f}")
    writer.close()
