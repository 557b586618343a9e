"""SB3 PPO on CartPole-v1 with its environments on ClusterEnv workers.

    python examples/sb3_ppo_cartpole.py

The only ClusterEnv-specific line is ``vec_env_cls=ClusterVecEnv``; with ``DummyVecEnv`` in its
place (or ``--baseline``) the same seed gives bit-identical training. Progress is printed by SB3;
at the end the trained policy is evaluated on fresh episodes and the mean return printed.
"""

from __future__ import annotations

import argparse
import time

import torch
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import DummyVecEnv

from clusterenv_sb3 import ClusterVecEnv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timesteps", type=int, default=150_000)
    parser.add_argument("--n-envs", type=int, default=8)
    parser.add_argument("--num-workers", type=int, default=None, help="default: one per core")
    parser.add_argument("--backend", default="local", choices=["local", "mpi"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", action="store_true", help="use DummyVecEnv instead, for comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.baseline:
        vec_env_cls, vec_env_kwargs = DummyVecEnv, {}
    else:
        vec_env_cls = ClusterVecEnv  # the one changed line
        vec_env_kwargs = {"backend": args.backend, "num_workers": args.num_workers}
    env = make_vec_env(
        "CartPole-v1", n_envs=args.n_envs, seed=args.seed, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_env_kwargs
    )
    # Hyperparameters tuned for CartPole (rl-baselines3-zoo's choice of values).
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=32,
        batch_size=256,
        gae_lambda=0.8,
        gamma=0.98,
        n_epochs=20,
        ent_coef=0.0,
        learning_rate=lambda progress: 1e-3 * progress,
        clip_range=lambda progress: 0.2 * progress,
        seed=args.seed,
        device="cpu",
        verbose=1,
    )
    started = time.perf_counter()
    model.learn(total_timesteps=args.timesteps, progress_bar=False)
    train_seconds = time.perf_counter() - started

    mean_return, std_return = evaluate_policy(model, env, n_eval_episodes=20, deterministic=True)
    env.close()
    print(f"trained {args.timesteps} steps in {train_seconds:.1f} s on {type(env).__name__}")
    print(f"mean return over 20 episodes: {mean_return:.1f} +/- {std_return:.1f}")


if __name__ == "__main__":
    main()
