"""PPO on Atari in one file, CleanRL style, with the emulators on ClusterEnv workers.

    python examples/cleanrl/ppo_atari.py --env-id BreakoutNoFrameskip-v4 --total-timesteps 10000000

Going distributed is one line: ``ClusterVectorEnv(env_fns, ...)`` where the script had
``gym.vector.SyncVectorEnv(env_fns)`` (marked below). This script also silences ClusterEnv's
``LearnerThreadsWarning`` on purpose (its CNN gains from torch's threads; see there). The ALE ids exist here because ``ale_py`` is
imported; the workers get them from this process's registry, wrappers and all.

Preprocessing as in DQN's Nature paper, with SB3's Atari wrappers and gymnasium's: noop starts,
frame skip 4 with max-pooling, a lost life ends the episode for training, FIRE on reset where the
game needs it, clipped rewards, 84x84 grayscale, 4 stacked frames. Episode statistics are recorded
below those wrappers, so the returns printed are whole games with their real score. Written for
gymnasium 1.x and its next-step autoreset (see ``ppo.py``); metrics go to TensorBoard under ``runs/``.
"""

from __future__ import annotations

import os
import random
import time
import warnings
from collections import deque
from dataclasses import dataclass

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import tyro
from stable_baselines3.common.atari_wrappers import ClipRewardEnv, EpisodicLifeEnv, FireResetEnv, MaxAndSkipEnv, NoopResetEnv
from torch.distributions.categorical import Categorical
from torch.utils.tensorboard import SummaryWriter

from clusterenv_cleanrl import ClusterVectorEnv
from clusterenv_core import LearnerThreadsWarning

gym.register_envs(ale_py)


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of the environment"""
    total_timesteps: int = 10_000_000
    """total timesteps of the experiment"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """toggles advantages normalization"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    backend: str = "local"
    """ClusterEnv backend: local (processes on this machine) or mpi"""
    num_workers: int | None = None
    """ClusterEnv workers (default: one per core, at most one per env)"""


def make_env(env_id: str):
    def thunk() -> gym.Env:
        env = gym.make(env_id)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env = NoopResetEnv(env, noop_max=30)
        env = MaxAndSkipEnv(env, skip=4)
        env = EpisodicLifeEnv(env)
        if "FIRE" in env.unwrapped.get_action_meanings():
            env = FireResetEnv(env)
        env = ClipRewardEnv(env)
        env = gym.wrappers.ResizeObservation(env, (84, 84))
        env = gym.wrappers.GrayscaleObservation(env)
        return gym.wrappers.FrameStackObservation(env, 4)

    return thunk


def layer_init(layer: nn.Module, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, num_actions: int) -> None:
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(self.network(x / 255.0))

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        hidden = self.network(x / 255.0)
        probs = Categorical(logits=self.actor(hidden))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


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
    # torch keeps one thread per core: the CNN's training gains more from them than the workers lose
    # (8 envs on 2 cores: 137-158 steps/s with two threads, 109-125 with one).
    warnings.filterwarnings("ignore", category=LearnerThreadsWarning)

    env_fns = [make_env(args.env_id) for _ in range(args.num_envs)]
    # The one ClusterEnv line; it was: envs = gym.vector.SyncVectorEnv(env_fns)
    envs = ClusterVectorEnv(env_fns, backend=args.backend, num_workers=args.num_workers)
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), "only discrete action space is supported"

    agent = Agent(int(envs.single_action_space.n))
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    # Rollout storage; frames stay uint8 until a minibatch needs them. ``valid`` is 0 for the reset
    # steps of next-step autoreset, which are no transitions.
    obs_shape = envs.single_observation_space.shape
    obs = torch.zeros((args.num_steps, args.num_envs, *obs_shape), dtype=torch.uint8)
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long)
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
    next_obs = torch.as_tensor(next_obs)
    autoreset = np.zeros(args.num_envs, dtype=bool)  # the next step of these envs only resets them

    for iteration in range(1, num_iterations + 1):
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate

        for step in range(args.num_steps):
            global_step += args.num_envs
            obs[step] = next_obs
            valid[step] = torch.as_tensor(~autoreset)
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs.float())
            actions[step], logprobs[step], values[step] = action, logprob, value.flatten()

            next_obs, reward, terminations, truncations, infos = envs.step(action.numpy())
            autoreset = np.logical_or(terminations, truncations)
            rewards[step] = torch.as_tensor(reward, dtype=torch.float32)
            terminated[step] = torch.as_tensor(terminations, dtype=torch.float32)
            ended[step] = torch.as_tensor(autoreset, dtype=torch.float32)
            next_obs = torch.as_tensor(next_obs)

            if "episode" in infos:
                for i in np.flatnonzero(infos["_episode"]):
                    episodic_return = float(infos["episode"]["r"][i])
                    recent_returns.append(episodic_return)
                    writer.add_scalar("charts/episodic_return", episodic_return, global_step)
                    writer.add_scalar("charts/episodic_length", int(infos["episode"]["l"][i]), global_step)

        # GAE, as in ppo.py: only termination cuts the bootstrap, any ended episode the advantage chain.
        with torch.no_grad():
            next_values = torch.cat([values[1:], agent.get_value(next_obs.float()).reshape(1, -1)])
            deltas = rewards + args.gamma * next_values * (1.0 - terminated) - values
            advantages = torch.zeros_like(rewards)
            last_advantage = torch.zeros(args.num_envs)
            for t in reversed(range(args.num_steps)):
                last_advantage = deltas[t] + args.gamma * args.gae_lambda * (1.0 - ended[t]) * last_advantage
                advantages[t] = last_advantage
            returns = advantages + values

        # Flatten the batch, keeping real transitions only.
        kept = valid.reshape(-1)
        b_obs = obs.reshape(-1, *obs_shape)[kept]
        b_actions = actions.reshape(-1)[kept]
        b_logprobs = logprobs.reshape(-1)[kept]
        b_advantages = advantages.reshape(-1)[kept]
        b_returns = returns.reshape(-1)[kept]
        b_values = values.reshape(-1)[kept]

        clipfracs = []
        for epoch in range(args.update_epochs):
            for mb_inds in np.array_split(np.random.permutation(len(b_obs)), args.num_minibatches):
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds].float(), b_actions[mb_inds])
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
            print(f"global_step={global_step}, mean_episodic_return(last 20 games)={mean_return:.1f}, SPS={sps}")

    train_seconds = time.time() - start_time
    envs.close()
    writer.close()
    print(f"trained {global_step} steps in {train_seconds:.0f} s ({int(global_step / train_seconds)} SPS)")
    mean_return = np.mean(recent_returns) if recent_returns else float("nan")
    print(f"mean score of the last {len(recent_returns)} training games: {mean_return:.1f}")
