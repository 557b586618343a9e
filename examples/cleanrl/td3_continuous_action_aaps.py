"""TD3 for continuous actions in one file, CleanRL style, with the actor on the ClusterEnv workers and AAPS.

    python examples/cleanrl/td3_continuous_action_aaps.py --seed 1 --total-timesteps 20000 --sync always
    python examples/cleanrl/td3_continuous_action_aaps.py --sync aaps --kl-threshold 0.5
    python examples/cleanrl/td3_continuous_action_aaps.py --env-id HalfCheetah-v5 --total-timesteps 200000

The workers hold a copy of the actor (never the critics or the targets) and act themselves, adding
CleanRL's exploration noise ``N(0, action_scale * exploration_noise)`` per env and step and
clipping to the Box; every ``train_frequency`` vector steps they return one segment, which goes
into the replay buffer in one call (``rollouts.collect_replay``); before ``learning_starts`` they
draw uniform random actions. The learner then does ``train_frequency`` gradient steps of TD3
(critics every step; the actor and the targets every ``policy_frequency`` steps), and
``rollouts.after_update()`` pushes the actor's weights always, never, or, with ``--sync aaps``,
when ``||mu_workers - mu_learner||^2 / (2 sigma^2)`` on recent states (the KL between the two
actors' exploration Gaussians, sigma = action_scale * exploration_noise) exceeds
``--kl-threshold``. ``--overlap`` collects the next segment while the learner trains.

Segments use same-step autoreset: a transition that ends an episode stores its real last
observation as ``next_obs`` and only termination stops the bootstrap. Metrics go to TensorBoard
under ``runs/`` (``charts/*``, ``losses/*``, ``aaps/*``); at the end the deterministic actor is
evaluated on ``--eval-episodes`` fresh episodes.
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

from clusterenv_cleanrl import ClusterVectorEnv, DeployableTD3Actor, WorkerRollouts


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    track_dir: str | None = "runs"
    """TensorBoard log directory (None: no logging)"""
    env_id: str = "Pendulum-v1"
    """the id of the environment"""
    total_timesteps: int = 20_000
    """total timesteps of the experiment"""
    num_envs: int = 2
    """the number of parallel environments"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizers"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 256
    """the batch size of sample from the replay memory"""
    policy_noise: float = 0.2
    """the scale of the target policy smoothing noise"""
    exploration_noise: float = 0.1
    """the scale of the exploration noise, relative to action_scale"""
    learning_starts: int = 1_000
    """timestep to start learning (uniform random actions before)"""
    policy_frequency: int = 2
    """the frequency of training the policy and the targets (delayed)"""
    noise_clip: float = 0.5
    """the clip of the target policy smoothing noise"""
    train_frequency: int = 8
    """vector steps per worker segment; as many gradient steps follow each segment"""
    backend: str = "local"
    """ClusterEnv backend: local (processes on this machine) or mpi"""
    num_workers: int | None = None
    """ClusterEnv workers (default: one per core, at most one per env)"""
    sync: Literal["always", "aaps", "never"] = "always"
    """when the workers get the actor's new weights: after every update, when AAPS says so, or never"""
    kl_threshold: float = 0.5
    """AAPS: push when ||mu_d - mu_c||^2 / (2 sigma^2), averaged over recent states, exceeds this"""
    max_staleness: int | None = None
    """AAPS: push anyway after this many updates without a push"""
    overlap: bool = False
    """collect the next segment while the learner trains"""
    eval_episodes: int = 10
    """episodes of the deterministic actor evaluated at the end"""


def make_env(env_id: str):
    def thunk() -> gym.Env:
        return gym.wrappers.RecordEpisodeStatistics(gym.make(env_id))

    return thunk


class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, action_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(obs_dim + action_dim, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc3 = nn.Linear(256, 1)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(torch.cat([x, a], 1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class Actor(DeployableTD3Actor, nn.Module):  # DeployableTD3Actor: noisy act() on the workers, its Gaussian for AAPS
    def __init__(self, obs_dim: int, action_space: gym.spaces.Box, exploration_noise: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(obs_dim, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc_mu = nn.Linear(256, int(np.prod(action_space.shape)))
        self.register_buffer("action_scale", torch.tensor((action_space.high - action_space.low) / 2.0, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((action_space.high + action_space.low) / 2.0, dtype=torch.float32))
        self.exploration_noise = exploration_noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return torch.tanh(self.fc_mu(x)) * self.action_scale + self.action_bias


def evaluate(actor: Actor, env_id: str, episodes: int, seed: int) -> list[float]:
    """Returns of ``episodes`` episodes of the deterministic actor, each from its own seed."""
    env = gym.make(env_id)
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, total = False, 0.0
        while not done:
            with torch.no_grad():
                action = actor(torch.as_tensor(obs, dtype=torch.float32)[None])[0].numpy()
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
    # Small networks run fastest on one thread, and the env workers need the other cores.
    torch.set_num_threads(1)

    env_fns = [make_env(args.env_id) for _ in range(args.num_envs)]
    # Worker rollouts reset an env in the step that ends its episode (same-step autoreset).
    envs = ClusterVectorEnv(
        env_fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP, backend=args.backend, num_workers=args.num_workers
    )
    assert isinstance(envs.single_action_space, gym.spaces.Box), "only continuous action space is supported"

    obs_dim = int(np.prod(envs.single_observation_space.shape))
    action_dim = int(np.prod(envs.single_action_space.shape))
    actor = Actor(obs_dim, envs.single_action_space, args.exploration_noise)
    qf1, qf2 = QNetwork(obs_dim, action_dim), QNetwork(obs_dim, action_dim)
    target_actor = Actor(obs_dim, envs.single_action_space, args.exploration_noise)
    qf1_target, qf2_target = QNetwork(obs_dim, action_dim), QNetwork(obs_dim, action_dim)
    target_actor.load_state_dict(actor.state_dict())
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.learning_rate)
    actor_optimizer = optim.Adam(list(actor.parameters()), lr=args.learning_rate)

    # Deploys the actor on the workers (seeded) and decides when they get its new weights.
    rollouts = WorkerRollouts(
        envs, actor, args.train_frequency, sync=args.sync, threshold=args.kl_threshold,
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
    gradient_step = 0
    actor_loss = torch.zeros(())
    num_segments = args.total_timesteps // (args.num_envs * args.train_frequency)
    for segment in range(num_segments):
        # The rollout loop: train_frequency vector steps acted on the workers, into the replay buffer.
        warmup = rollouts.global_step < args.learning_starts
        for episode in rollouts.collect_replay(rb, context={"random": warmup, "exploration_noise": args.exploration_noise}):
            recent_returns.append(episode.episodic_return)
            if writer:
                writer.add_scalar("charts/episodic_return", episode.episodic_return, episode.global_step)
                writer.add_scalar("charts/episodic_length", episode.length, episode.global_step)
        global_step = rollouts.global_step
        if global_step <= args.learning_starts:
            continue

        for _ in range(args.train_frequency):
            gradient_step += 1
            data = rb.sample(args.batch_size)
            with torch.no_grad():
                clipped_noise = (torch.randn_like(data.actions, device="cpu") * args.policy_noise).clamp(
                    -args.noise_clip, args.noise_clip
                ) * target_actor.action_scale
                next_actions = (target_actor(data.next_observations) + clipped_noise).clamp(
                    envs.single_action_space.low[0], envs.single_action_space.high[0]
                )
                qf1_next = qf1_target(data.next_observations, next_actions)
                qf2_next = qf2_target(data.next_observations, next_actions)
                min_qf_next = torch.min(qf1_next, qf2_next)
                next_q_value = data.rewards.flatten() + (1 - data.dones.flatten()) * args.gamma * min_qf_next.view(-1)
            qf1_a_values = qf1(data.observations, data.actions).view(-1)
            qf2_a_values = qf2(data.observations, data.actions).view(-1)
            qf_loss = F.mse_loss(qf1_a_values, next_q_value) + F.mse_loss(qf2_a_values, next_q_value)
            q_optimizer.zero_grad()
            qf_loss.backward()
            q_optimizer.step()

            if gradient_step % args.policy_frequency == 0:
                actor_loss = -qf1(data.observations, actor(data.observations)).mean()
                actor_optimizer.zero_grad()
                actor_loss.backward()
                actor_optimizer.step()
                for network, target in ((actor, target_actor), (qf1, qf1_target), (qf2, qf2_target)):
                    for param, target_param in zip(network.parameters(), target.parameters()):
                        target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
        rollouts.after_update()  # AAPS: push the actor's weights only if it drifted enough

        if writer and segment % 10 == 0:
            writer.add_scalar("losses/qf_loss", qf_loss.item() / 2.0, global_step)
            writer.add_scalar("losses/actor_loss", actor_loss.item(), global_step)
            writer.add_scalar("charts/SPS", int(global_step / (time.time() - start_time)), global_step)
            for key, value in rollouts.summary().items():
                writer.add_scalar(f"aaps/{key}", value, global_step)
        if segment % 200 == 0 and segment > 0:
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
        eval_returns = evaluate(actor, args.env_id, args.eval_episodes, seed=args.seed + 10_000)
        if writer:
            for episode, episodic_return in enumerate(eval_returns):
                writer.add_scalar("eval/episodic_return", episodic_return, episode)
        print(f"deterministic policy, mean return over {args.eval_episodes} episodes: {np.mean(eval_returns):.1f}")
    if writer:
        writer.close()
