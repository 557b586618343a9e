"""DQN on CartPole-v1 in one file, CleanRL style, with the environments on ClusterEnv workers.

    python examples/cleanrl/dqn.py --seed 1 --total-timesteps 500000

Going distributed is one line: ``ClusterVectorEnv(env_fns, ...)`` where the script had
``gym.vector.SyncVectorEnv(env_fns)`` (marked below); with the same seed both train identically.

Written for gymnasium 1.x and its default next-step autoreset: the step after an episode ends only
resets that env, so its "transition" (from the episode's last observation to the first of the
next) never enters the replay buffer; and a truncated episode's last observation is a real one,
so only termination stops the bootstrap. Metrics go to TensorBoard under ``runs/``; at the end the
greedy policy is evaluated on ``--eval-episodes`` fresh episodes.
"""

from __future__ import annotations

import os
import random
import time
from collections import deque
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tyro
from stable_baselines3.common.buffers import ReplayBuffer
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
    env_id: str = "CartPole-v1"
    """the id of the environment"""
    total_timesteps: int = 500_000
    """total timesteps of the experiment"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel environments"""
    buffer_size: int = 100_000
    """the replay memory buffer size; large, so that early failures stay in it and are not forgotten"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate"""
    target_network_frequency: int = 500
    """the vector steps between target network updates"""
    batch_size: int = 128
    """the batch size of sample from the replay memory"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.5
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    learning_starts: int = 10_000
    """timestep to start learning"""
    train_frequency: int = 10
    """the vector steps between gradient steps"""
    backend: str = "local"
    """ClusterEnv backend: local (processes on this machine) or mpi"""
    num_workers: int | None = None
    """ClusterEnv workers (default: one per core, at most one per env)"""
    eval_episodes: int = 10
    """episodes of the greedy policy evaluated at the end"""


def make_env(env_id: str):
    def thunk() -> gym.Env:
        return gym.wrappers.RecordEpisodeStatistics(gym.make(env_id))

    return thunk


class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, num_actions: int) -> None:
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(obs_dim, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_actions),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


def linear_schedule(start_e: float, end_e: float, duration: int, t: int) -> float:
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def evaluate(q_network: QNetwork, env_id: str, episodes: int, seed: int) -> list[float]:
    """Returns of ``episodes`` episodes of the greedy policy, each from its own seed."""
    env = gym.make(env_id)
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, total = False, 0.0
        while not done:
            with torch.no_grad():
                action = q_network(torch.as_tensor(obs)).argmax().item()
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return returns


if __name__ == "__main__":
    args = tyro.cli(Args)
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

    env_fns = [make_env(args.env_id) for _ in range(args.num_envs)]
    # The one ClusterEnv line; it was: envs = gym.vector.SyncVectorEnv(env_fns)
    envs = ClusterVectorEnv(env_fns, backend=args.backend, num_workers=args.num_workers)
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), "only discrete action space is supported"
    envs.action_space.seed(args.seed)

    obs_dim = int(np.prod(envs.single_observation_space.shape))
    q_network = QNetwork(obs_dim, int(envs.single_action_space.n))
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(obs_dim, int(envs.single_action_space.n))
    target_network.load_state_dict(q_network.state_dict())

    # One env's transitions at a time, so the reset steps of next-step autoreset can be left out.
    rb = ReplayBuffer(
        args.buffer_size,
        envs.single_observation_space,
        envs.single_action_space,
        device="cpu",
        n_envs=1,
        handle_timeout_termination=False,
    )

    recent_returns: deque[float] = deque(maxlen=20)
    start_time = time.time()
    obs, _ = envs.reset(seed=args.seed)
    autoreset = np.zeros(args.num_envs, dtype=bool)  # this step of these envs only resets them
    num_updates = args.total_timesteps // args.num_envs
    for update in range(num_updates):
        global_step = update * args.num_envs
        exploration_steps = int(args.exploration_fraction * args.total_timesteps)
        epsilon = linear_schedule(args.start_e, args.end_e, exploration_steps, global_step)
        with torch.no_grad():
            greedy = q_network(torch.as_tensor(obs)).argmax(dim=1).numpy()
        explore = np.random.random(args.num_envs) < epsilon
        actions = np.where(explore, envs.action_space.sample(), greedy)

        next_obs, rewards, terminations, truncations, infos = envs.step(actions)

        if "episode" in infos:
            for i in np.flatnonzero(infos["_episode"]):
                episodic_return = float(infos["episode"]["r"][i])
                recent_returns.append(episodic_return)
                writer.add_scalar("charts/episodic_return", episodic_return, global_step)
                writer.add_scalar("charts/episodic_length", int(infos["episode"]["l"][i]), global_step)

        # Termination, not truncation, ends the bootstrap: next_obs is the real last observation either way.
        for i in np.flatnonzero(~autoreset):
            one = slice(i, i + 1)
            rb.add(obs[one], next_obs[one], actions[one], rewards[one], terminations[one], [{}])
        autoreset = np.logical_or(terminations, truncations)
        obs = next_obs

        if global_step > args.learning_starts:
            if update % args.train_frequency == 0:
                data = rb.sample(args.batch_size)
                with torch.no_grad():
                    target_max, _ = target_network(data.next_observations).max(dim=1)
                    td_target = data.rewards.flatten() + args.gamma * target_max * (1 - data.dones.flatten())
                old_val = q_network(data.observations).gather(1, data.actions).squeeze()
                loss = F.mse_loss(td_target, old_val)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if update % 100 == 0:
                    writer.add_scalar("losses/td_loss", loss.item(), global_step)
                    writer.add_scalar("losses/q_values", old_val.mean().item(), global_step)
                    writer.add_scalar("charts/SPS", int(global_step / (time.time() - start_time)), global_step)

            if update % args.target_network_frequency == 0:
                for target_param, param in zip(target_network.parameters(), q_network.parameters()):
                    target_param.data.copy_(args.tau * param.data + (1.0 - args.tau) * target_param.data)

        if update % 10_000 == 0 and update > 0:
            mean_return = np.mean(recent_returns) if recent_returns else float("nan")
            sps = int(global_step / (time.time() - start_time))
            print(f"global_step={global_step}, mean_episodic_return(last 20)={mean_return:.1f}, SPS={sps}")

    total_steps = num_updates * args.num_envs
    train_seconds = time.time() - start_time
    envs.close()
    print(f"trained {total_steps} steps in {train_seconds:.0f} s ({int(total_steps / train_seconds)} SPS)")
    print(f"mean episodic return of the last {len(recent_returns)} training episodes: {np.mean(recent_returns):.1f}")
    if args.eval_episodes > 0:
        eval_returns = evaluate(q_network, args.env_id, args.eval_episodes, seed=args.seed + 10_000)
        for episode, episodic_return in enumerate(eval_returns):
            writer.add_scalar("eval/episodic_return", episodic_return, episode)
        print(f"greedy policy, mean return over {args.eval_episodes} episodes: {np.mean(eval_returns):.1f}")
    writer.close()
