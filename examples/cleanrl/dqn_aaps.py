"""DQN in one file, CleanRL style, with the Q-network acting on the ClusterEnv workers and AAPS.

    python examples/cleanrl/dqn_aaps.py --seed 1 --total-timesteps 500000 --sync always
    python examples/cleanrl/dqn_aaps.py --sync aaps --kl-threshold 0.05

Compared with ``dqn.py``, the workers hold a copy of the Q-network and act epsilon-greedily
themselves: every ``train_frequency`` vector steps they return one segment, which goes into the
replay buffer in one call (``rollouts.collect_replay``), with the exploration rate of the schedule
passed along as the rollout context. After each gradient step (one "update") ``rollouts.after_update()``
pushes the new weights always, never, or, with ``--sync aaps``, when the fraction of recent states
whose greedy action changed exceeds ``--kl-threshold`` (for a value-based policy AAPS compares
greedy actions, not a KL). ``--overlap`` collects the next segment while the learner trains.

Segments use same-step autoreset: a transition that ends an episode stores its real last
observation as ``next_obs`` and only termination stops the bootstrap. Metrics go to TensorBoard
under ``runs/`` (``charts/*``, ``losses/*``, ``aaps/*``); at the end the greedy policy is evaluated
on ``--eval-episodes`` fresh episodes.
"""

from __future__ import annotations

import os
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tyro
from stable_baselines3.common.buffers import ReplayBuffer
from torch.utils.tensorboard import SummaryWriter

from clusterenv_cleanrl import ClusterVectorEnv, DeployableQNetwork, WorkerRollouts


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    track_dir: str | None = "runs"
    """TensorBoard log directory (None: no logging)"""
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
    """the vector steps between gradient steps (the length of a worker segment)"""
    backend: str = "local"
    """ClusterEnv backend: local (processes on this machine) or mpi"""
    num_workers: int | None = None
    """ClusterEnv workers (default: one per core, at most one per env)"""
    sync: Literal["always", "aaps", "never"] = "always"
    """when the workers get new weights: after every gradient step, when AAPS says so, or never"""
    kl_threshold: float = 0.05
    """AAPS: push when this fraction of recent states changed their greedy action"""
    max_staleness: int | None = None
    """AAPS: push anyway after this many gradient steps without a push"""
    overlap: bool = False
    """collect the next segment while the learner trains (its epsilon is then one segment old)"""
    eval_episodes: int = 10
    """episodes of the greedy policy evaluated at the end"""


def make_env(env_id: str):
    def thunk() -> gym.Env:
        return gym.wrappers.RecordEpisodeStatistics(gym.make(env_id))

    return thunk


class QNetwork(DeployableQNetwork, nn.Module):  # DeployableQNetwork: epsilon-greedy act() on the workers
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
    run_name = f"{args.env_id}__{args.exp_name}__{args.sync}__{args.seed}__{int(time.time())}"
    writer = SummaryWriter(f"{args.track_dir}/{run_name}") if args.track_dir else None
    if writer:
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
    # Worker rollouts reset an env in the step that ends its episode (same-step autoreset).
    envs = ClusterVectorEnv(
        env_fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP, backend=args.backend, num_workers=args.num_workers
    )
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), "only discrete action space is supported"

    obs_dim = int(np.prod(envs.single_observation_space.shape))
    q_network = QNetwork(obs_dim, int(envs.single_action_space.n))
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(obs_dim, int(envs.single_action_space.n))
    target_network.load_state_dict(q_network.state_dict())
    # Deploys the Q-network on the workers (seeded) and decides when they get new weights.
    rollouts = WorkerRollouts(
        envs, q_network, args.train_frequency, sync=args.sync, threshold=args.kl_threshold,
        max_staleness=args.max_staleness, overlap=args.overlap, seed=args.seed,
    )

    rb = ReplayBuffer(
        args.buffer_size,
        envs.single_observation_space,
        envs.single_action_space,
        device="cpu",
        n_envs=args.num_envs,
        handle_timeout_termination=False,
    )

    recent_returns: deque[float] = deque(maxlen=20)
    start_time = time.time()
    num_segments = args.total_timesteps // (args.num_envs * args.train_frequency)
    exploration_steps = int(args.exploration_fraction * args.total_timesteps)
    for segment in range(num_segments):
        global_step = rollouts.global_step
        epsilon = linear_schedule(args.start_e, args.end_e, exploration_steps, global_step)
        # The rollout loop: train_frequency vector steps acted on the workers, into the replay buffer.
        for episode in rollouts.collect_replay(rb, context={"epsilon": epsilon}):
            recent_returns.append(episode.episodic_return)
            if writer:
                writer.add_scalar("charts/episodic_return", episode.episodic_return, episode.global_step)
                writer.add_scalar("charts/episodic_length", episode.length, episode.global_step)
        global_step = rollouts.global_step

        if global_step > args.learning_starts:
            data = rb.sample(args.batch_size)
            with torch.no_grad():
                target_max, _ = target_network(data.next_observations).max(dim=1)
                td_target = data.rewards.flatten() + args.gamma * target_max * (1 - data.dones.flatten())
            old_val = q_network(data.observations).gather(1, data.actions).squeeze()
            loss = F.mse_loss(td_target, old_val)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            rollouts.after_update()  # AAPS: push the weights only if enough greedy actions changed

            if writer and segment % 10 == 0:
                writer.add_scalar("losses/td_loss", loss.item(), global_step)
                writer.add_scalar("losses/q_values", old_val.mean().item(), global_step)
                writer.add_scalar("charts/epsilon", epsilon, global_step)
                writer.add_scalar("charts/SPS", int(global_step / (time.time() - start_time)), global_step)
                for key, value in rollouts.summary().items():
                    writer.add_scalar(f"aaps/{key}", value, global_step)

        # Target network updates every target_network_frequency vector steps, as in dqn.py.
        vector_step = (segment + 1) * args.train_frequency
        if vector_step % args.target_network_frequency < args.train_frequency:
            for target_param, param in zip(target_network.parameters(), q_network.parameters()):
                target_param.data.copy_(args.tau * param.data + (1.0 - args.tau) * target_param.data)

        if segment % 1_000 == 0 and segment > 0:
            mean_return = np.mean(recent_returns) if recent_returns else float("nan")
            sync = rollouts.summary()
            sps = int(global_step / (time.time() - start_time))
            print(
                f"global_step={global_step}, mean_episodic_return(last 20)={mean_return:.1f}, "
                f"syncs={sync['syncs']}/{sync['updates']}, SPS={sps}"
            )

    train_seconds = time.time() - start_time
    rollouts.close()
    envs.close()
    total_steps = rollouts.global_step
    sync = rollouts.summary()
    print(
        f"trained {total_steps} steps in {train_seconds:.0f} s ({int(total_steps / train_seconds)} SPS); "
        f"syncs {sync['syncs']} of {sync['updates']} updates, {sync['weight_bytes_sent'] / 1e6:.2f} MB of weights, "
        f"workers {sync['mean_update_lag']:.1f} updates behind on average"
    )
    print(f"mean episodic return of the last {len(recent_returns)} training episodes: {np.mean(recent_returns):.1f}")
    if args.eval_episodes > 0:
        eval_returns = evaluate(q_network, args.env_id, args.eval_episodes, seed=args.seed + 10_000)
        if writer:
            for episode, episodic_return in enumerate(eval_returns):
                writer.add_scalar("eval/episodic_return", episodic_return, episode)
        print(f"greedy policy, mean return over {args.eval_episodes} episodes: {np.mean(eval_returns):.1f}")
    if writer:
        writer.close()
