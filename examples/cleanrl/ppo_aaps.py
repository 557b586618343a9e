"""PPO in one file, CleanRL style, with the policy running on the ClusterEnv workers and AAPS.

    python examples/cleanrl/ppo_aaps.py --seed 1 --total-timesteps 500000 --sync always
    python examples/cleanrl/ppo_aaps.py --sync aaps --kl-threshold 0.01 --overlap --sync-every minibatch

Compared with ``ppo.py``, the workers hold a copy of the agent and return whole segments, so the
rollout loop is one call (``rollouts.collect_ppo``) and the weights follow the learner with one more
line (``rollouts.after_update()``), which pushes them always, never, or when AAPS measures that the
learner's policy drifted from the workers' copy by more than ``--kl-threshold`` (mean KL on recent
states). ``--overlap`` collects the next segment while the learner trains on the current one.

What one "update" (one ``after_update``) is, ``--sync-every``:

- ``iteration``: after all epochs of a PPO iteration, as ``clusterenv_sb3`` does; without
  ``--overlap`` this is the only point where the workers can use new weights, since they are idle
  while the learner trains;
- ``minibatch``: after every optimizer step. With ``--overlap`` the workers collect the next
  segment during those steps and (local backend) pick up new weights at their next env step, so
  ``always`` gives them the freshest policy at ``update_epochs * num_minibatches`` syncs per
  iteration; that is the expensive baseline where AAPS saves most.

The agent is CleanRL's, with ``DeployableAgent`` added to its bases. With stale weights on the
workers the data comes from an older policy than the learner's, so the loss is decoupled PPO
(``--ppo-ratio proximal``, after Hilton et al., "Batch size-invariance for policy optimization"):
the ratio and its clip are relative to the learner's policy when the segment arrived, and each step
is weighted by pi_learner / pi_workers (truncated at ``--max-behaviour-weight``). With up-to-date
workers the weights are 1 and this is CleanRL's loss. Clipping against the workers' policy instead
(``--ppo-ratio behaviour``) pins the learner within the clip range of the deployed weights: it can
never drift far enough for a high AAPS threshold to fire, and stops learning between syncs. Values
come from the learner's current critic. Segments use same-step autoreset: truncated episodes bootstrap
through their reward (``gamma * V(last observation)``), so CleanRL's GAE is unchanged. Metrics go
to TensorBoard under ``runs/`` (``charts/*``, ``losses/*``, ``aaps/*``); at the end the greedy
policy is evaluated on ``--eval-episodes`` fresh episodes.
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
import torch.optim as optim
import tyro
from torch.distributions.categorical import Categorical
from torch.utils.tensorboard import SummaryWriter

from clusterenv_cleanrl import ClusterVectorEnv, DeployableAgent, WorkerRollouts


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
    num_envs: int = 4
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
    num_workers: int | None = None
    """ClusterEnv workers (default: one per core, at most one per env)"""
    sync: Literal["always", "aaps", "never"] = "always"
    """when the workers get new weights: after every update, when AAPS says so, or never"""
    kl_threshold: float = 0.01
    """AAPS: push when mean KL(workers' policy || learner's policy) on recent states exceeds this"""
    max_staleness: int | None = None
    """AAPS: push anyway after this many updates without a push"""
    sync_every: Literal["iteration", "minibatch"] = "iteration"
    """what one update is: a whole PPO iteration, or each optimizer (minibatch) step"""
    overlap: bool = False
    """collect the next segment while the learner trains on the current one"""
    ppo_ratio: Literal["proximal", "behaviour"] = "proximal"
    """what PPO's ratio and clip are relative to: the learner's policy at collection (decoupled PPO,
    importance-weighted to the workers' policy) or the workers' (possibly stale) policy"""
    max_behaviour_weight: float = 2.0
    """decoupled PPO: importance weights pi_learner / pi_workers are truncated at this value"""
    eval_episodes: int = 10
    """episodes of the greedy policy evaluated at the end"""
    log_every: int = 20
    """print progress every this many iterations"""


def make_env(env_id: str):
    def thunk() -> gym.Env:
        return gym.wrappers.RecordEpisodeStatistics(gym.make(env_id))

    return thunk


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(DeployableAgent, nn.Module):  # DeployableAgent: act() for the workers, action_dist() for AAPS
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


def train(args: Args) -> dict:
    """Train, log, evaluate; returns the run's results (curve, returns, sync counters, wall time)."""
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
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
    agent = Agent(obs_dim, int(envs.single_action_space.n))
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    # Deploys the agent on the workers (seeded) and decides when they get new weights.
    rollouts = WorkerRollouts(
        envs, agent, args.num_steps, sync=args.sync, threshold=args.kl_threshold,
        max_staleness=args.max_staleness, overlap=args.overlap, seed=args.seed,
    )

    recent_returns: deque[float] = deque(maxlen=20)
    curve: list[tuple[int, float]] = []  # (global_step, mean return of the last 20 episodes)
    start_time = time.time()

    for iteration in range(1, num_iterations + 1):
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate

        # The rollout loop: one segment of num_steps steps of every env, collected by the workers.
        b = rollouts.collect_ppo(args.gamma)
        global_step = rollouts.global_step
        for episode in b.episodes:
            recent_returns.append(episode.episodic_return)
            if writer:
                writer.add_scalar("charts/episodic_return", episode.episodic_return, episode.global_step)
                writer.add_scalar("charts/episodic_length", episode.length, episode.global_step)

        # CleanRL's GAE, unchanged: dones[t] marks obs[t] as an episode's first observation.
        with torch.no_grad():
            next_value = agent.get_value(b.next_obs).reshape(1, -1)
            advantages = torch.zeros_like(b.rewards)
            lastgaelam = 0
            for t in reversed(range(args.num_steps)):
                if t == args.num_steps - 1:
                    nextnonterminal = 1.0 - b.next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - b.dones[t + 1]
                    nextvalues = b.values[t + 1]
                delta = b.rewards[t] + args.gamma * nextvalues * nextnonterminal - b.values[t]
                advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + b.values

        b_obs = b.obs.reshape((-1, obs_dim))
        if args.ppo_ratio == "proximal":
            # Decoupled PPO: clip relative to the learner's policy when the segment arrived, and weight
            # each step by how much likelier that policy makes its action than the workers' did.
            b_logprobs = b.learner_logprobs.reshape(-1)
            b_weights = (b.learner_logprobs - b.logprobs).exp().clamp(max=args.max_behaviour_weight).reshape(-1)
        else:
            b_logprobs = b.logprobs.reshape(-1)
            b_weights = torch.ones_like(b_logprobs)
        b_actions = b.actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = b.values.reshape(-1)

        b_inds = np.arange(batch_size)
        clipfracs = []
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                mb_inds = b_inds[start : start + minibatch_size]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()
                with torch.no_grad():
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfracs.append(((ratio - 1.0).abs() > args.clip_coef).float().mean().item())

                mb_advantages = b_advantages[mb_inds]
                if args.norm_adv:
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
                pg_loss = (
                    b_weights[mb_inds]
                    * torch.max(
                        -mb_advantages * ratio,
                        -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef),
                    )
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
                if args.sync_every == "minibatch":
                    rollouts.after_update()  # AAPS: push the weights only if the policy drifted enough

        if args.sync_every == "iteration":
            rollouts.after_update()  # AAPS: push the weights only if the policy drifted enough

        mean_return = float(np.mean(recent_returns)) if recent_returns else float("nan")
        curve.append((global_step, mean_return))
        sync = rollouts.summary()
        sps = int(global_step / (time.time() - start_time))
        if writer:
            y_pred, y_true = b_values.numpy(), b_returns.numpy()
            explained_var = np.nan if np.var(y_true) == 0 else 1 - np.var(y_true - y_pred) / np.var(y_true)
            writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
            writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
            writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
            writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
            writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
            writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
            writer.add_scalar("losses/explained_variance", explained_var, global_step)
            writer.add_scalar("charts/SPS", sps, global_step)
            for key, value in sync.items():
                writer.add_scalar(f"aaps/{key}", value, global_step)
        if args.log_every and (iteration % args.log_every == 0 or iteration == num_iterations):
            print(
                f"global_step={global_step}, mean_episodic_return(last 20)={mean_return:.1f}, "
                f"syncs={sync['syncs']}/{sync['updates']}, SPS={sps}"
            )

    train_seconds = time.time() - start_time
    rollouts.close()
    envs.close()
    sync = rollouts.summary()
    final_return = float(np.mean(recent_returns)) if recent_returns else float("nan")
    print(
        f"trained {global_step} steps in {train_seconds:.0f} s ({int(global_step / train_seconds)} SPS); "
        f"syncs {sync['syncs']} of {sync['updates']} updates, {sync['weight_bytes_sent'] / 1e6:.2f} MB of weights, "
        f"workers {sync['mean_update_lag']:.1f} updates behind on average"
    )
    print(f"mean episodic return of the last {len(recent_returns)} training episodes: {final_return:.1f}")
    eval_returns = []
    if args.eval_episodes > 0:
        eval_returns = evaluate(agent, args.env_id, args.eval_episodes, seed=args.seed + 10_000)
        if writer:
            for episode, episodic_return in enumerate(eval_returns):
                writer.add_scalar("eval/episodic_return", episodic_return, episode)
        print(f"greedy policy, mean return over {args.eval_episodes} episodes: {np.mean(eval_returns):.1f}")
    if writer:
        writer.close()
    return {
        "global_step": global_step,
        "train_seconds": train_seconds,
        "curve": curve,
        "final_train_return": final_return,
        "eval_returns": eval_returns,
        "sync": sync,
    }


if __name__ == "__main__":
    train(tyro.cli(Args))
