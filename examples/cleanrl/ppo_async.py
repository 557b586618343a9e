"""Asynchronous PPO on CartPole-v1 in one file, CleanRL style: EnvPool's send/recv loop over Python
envs on ClusterEnv workers.

    python examples/cleanrl/ppo_async.py --seed 1 --total-timesteps 500000

The loop is EnvPool's asynchronous pattern: ``recv`` returns the envs whose steps finished first
(``batch_size`` of the ``num_envs``), the agent acts on that batch only, and ``send`` steps exactly
those envs, so a slow env never holds up the others. Transitions are stored by env id, each env
filling its own ``num_steps`` column; the update runs once every env has filled its column (envs
that are done early wait, holding the observation their next transition starts from). Going
distributed is one line: ``clusterenv_cleanrl.make_gymnasium(...)`` where the script had
``envpool.make_gymnasium(...)`` (marked below); EnvPool itself cannot run Python envs.

Episodes reset as EnvPool's do: the result after an episode's end is the reset observation, with
reward 0, and the action sent then is ignored, so those transitions are left out of the update; a
truncated episode bootstraps from its last observation's value, a terminated one does not.
Metrics go to TensorBoard under ``runs/``; at the end the greedy policy is evaluated on
``--eval-episodes`` fresh episodes.
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
import torch.optim as optim
import tyro
from torch.distributions.categorical import Categorical
from torch.utils.tensorboard import SummaryWriter

import clusterenv_cleanrl


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    env_id: str = "CartPole-v1"
    """the id of the environment"""
    total_timesteps: int = 500_000
    """total timesteps of the experiment"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel environments"""
    async_batch_size: int = 4
    """the number of envs each recv returns (a worker's block keeps every worker busy)"""
    num_steps: int = 128
    """the number of steps each env contributes to a policy rollout"""
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
    clip_coef: float = 0.2
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
    num_workers: int = 2
    """ClusterEnv workers; num_envs / num_workers envs each"""
    eval_episodes: int = 10
    """episodes of the greedy policy evaluated at the end"""


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim: int, num_actions: int) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, num_actions), std=0.01),
        )

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def evaluate(agent: Agent, env_id: str, episodes: int, seed: int) -> list[float]:
    """Returns of ``episodes`` episodes of the greedy policy, each from its own seed."""
    env = gym.make(env_id)
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, total = False, 0.0
        while not done:
            with torch.no_grad():
                action = agent.actor(torch.as_tensor(obs)).argmax().item()
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
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
    # Small networks run fastest on one thread, and the env workers need the other cores.
    torch.set_num_threads(1)

    # The one ClusterEnv line; it was: envs = envpool.make_gymnasium(args.env_id, num_envs=..., batch_size=..., seed=...)
    envs = clusterenv_cleanrl.make_gymnasium(
        args.env_id,
        num_envs=args.num_envs,
        batch_size=args.async_batch_size,
        seed=args.seed,
        backend=args.backend,
        num_workers=args.num_workers,
    )
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), "only discrete action space is supported"

    obs_dim = int(np.prod(envs.single_observation_space.shape))
    agent = Agent(obs_dim, int(envs.single_action_space.n))
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    # Rollout storage by (step, env id); each env fills its own column. ``valid`` is 0 for the
    # transitions that only reset an env, which are no transitions.
    obs = torch.zeros((args.num_steps, args.num_envs, obs_dim))
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long)
    logprobs = torch.zeros((args.num_steps, args.num_envs))
    rewards = torch.zeros((args.num_steps, args.num_envs))
    terminated = torch.zeros((args.num_steps, args.num_envs))
    ended = torch.zeros((args.num_steps, args.num_envs))
    valid = torch.zeros((args.num_steps, args.num_envs), dtype=torch.bool)
    values = torch.zeros((args.num_steps, args.num_envs))

    filled = np.zeros(args.num_envs, dtype=np.int64)  # transitions each env has started this rollout
    autoreset = np.zeros(args.num_envs, dtype=bool)  # the next step of these envs only resets them
    held_obs = torch.zeros((args.num_envs, obs_dim))  # where each full env's next transition starts
    episode_return = np.zeros(args.num_envs)
    episode_length = np.full(args.num_envs, -1, dtype=np.int64)  # the first result is the reset
    global_step = 0
    recent_returns: deque[float] = deque(maxlen=20)

    def act(env_ids: np.ndarray, env_obs: torch.Tensor) -> None:
        """Start a transition of each env (it has room) from its observation, and send the actions."""
        steps = filled[env_ids]
        with torch.no_grad():
            action, logprob, _, value = agent.get_action_and_value(env_obs)
        obs[steps, env_ids] = env_obs
        actions[steps, env_ids], logprobs[steps, env_ids], values[steps, env_ids] = action, logprob, value.flatten()
        valid[steps, env_ids] = torch.as_tensor(~autoreset[env_ids])
        filled[env_ids] += 1
        envs.send(action.numpy(), env_ids)

    start_time = time.time()
    envs.async_reset()
    for iteration in range(1, num_iterations + 1):
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
        if iteration > 1:  # every env is held, with the observation its first transition starts from
            act(np.arange(args.num_envs), held_obs.clone())

        held: set[int] = set()  # envs whose column is full
        while len(held) < args.num_envs:
            next_obs, reward, terminations, truncations, info = envs.recv()
            env_ids = info["env_id"].astype(np.int64)
            next_obs = torch.as_tensor(next_obs)
            # These results end each env's last transition (none yet right after the first reset).
            started = filled[env_ids] > 0
            previous = filled[env_ids[started]] - 1
            done = np.logical_or(terminations, truncations)
            rewards[previous, env_ids[started]] = torch.as_tensor(reward[started], dtype=torch.float32)
            terminated[previous, env_ids[started]] = torch.as_tensor(terminations[started], dtype=torch.float32)
            ended[previous, env_ids[started]] = torch.as_tensor(done[started], dtype=torch.float32)
            global_step += int(started.sum())
            episode_return[env_ids] += reward
            episode_length[env_ids] += 1
            for env in env_ids[done]:
                recent_returns.append(float(episode_return[env]))
                writer.add_scalar("charts/episodic_return", episode_return[env], global_step)
                writer.add_scalar("charts/episodic_length", episode_length[env], global_step)
            episode_return[env_ids[done]] = 0.0
            episode_length[env_ids[done]] = -1  # the reset step that follows is no step of the episode
            autoreset[env_ids] = done

            room = filled[env_ids] < args.num_steps
            if room.any():
                act(env_ids[room], next_obs[room])
            for position in np.flatnonzero(~room):
                held_obs[env_ids[position]] = next_obs[position]
                held.add(int(env_ids[position]))

        # GAE per env column. A step's successor is the next stored observation of the same env (or
        # its held observation after the last step); after a truncation it is the episode's real
        # last observation, so only termination cuts the bootstrap, and any ended episode cuts the
        # advantage chain.
        with torch.no_grad():
            next_values = torch.cat([values[1:], agent.get_value(held_obs).reshape(1, -1)])
            deltas = rewards + args.gamma * next_values * (1.0 - terminated) - values
            advantages = torch.zeros_like(rewards)
            last_advantage = torch.zeros(args.num_envs)
            for t in reversed(range(args.num_steps)):
                last_advantage = deltas[t] + args.gamma * args.gae_lambda * (1.0 - ended[t]) * last_advantage
                advantages[t] = last_advantage
            returns = advantages + values
        filled[:] = 0

        # Flatten the batch, keeping real transitions only.
        kept = valid.reshape(-1)
        b_obs = obs.reshape(-1, obs_dim)[kept]
        b_actions = actions.reshape(-1)[kept]
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
        if iteration % 20 == 0 or iteration == num_iterations:
            mean_return = np.mean(recent_returns) if recent_returns else float("nan")
            print(f"global_step={global_step}, mean_episodic_return(last 20)={mean_return:.1f}, SPS={sps}")

    train_seconds = time.time() - start_time
    envs.close()
    print(f"trained {global_step} steps in {train_seconds:.0f} s ({int(global_step / train_seconds)} SPS)")
    print(f"mean episodic return of the last {len(recent_returns)} training episodes: {np.mean(recent_returns):.1f}")
    if args.eval_episodes > 0:
        eval_returns = evaluate(agent, args.env_id, args.eval_episodes, seed=args.seed + 10_000)
        for episode, episodic_return in enumerate(eval_returns):
            writer.add_scalar("eval/episodic_return", episodic_return, episode)
        print(f"greedy policy, mean return over {args.eval_episodes} episodes: {np.mean(eval_returns):.1f}")
    writer.close()
