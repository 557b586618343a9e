"""SB3 PPO on Atari with SB3's Atari preprocessing, the emulators on ClusterEnv workers.

    python examples/sb3_ppo_atari.py --env-id PongNoFrameskip-v4 --timesteps 1000000
    python examples/sb3_ppo_atari.py --env-id BreakoutNoFrameskip-v4 --baseline   # DummyVecEnv instead

SB3's ``make_atari_env`` builds each env with ``AtariWrapper`` (noop resets, frame skip and max,
life loss as episode end for training, 84x84 grayscale, reward clipping); the only ClusterEnv line is
``vec_env_cls=ClusterVecEnv``. The ALE ids exist in this process because ``ale_py`` is imported;
the workers get them from its registry. ``VecFrameStack`` stays in the learner, as with any VecEnv.
At the end the policy is evaluated on whole games (all lives, unclipped score).
"""

from __future__ import annotations

import argparse
import time

import ale_py
import gymnasium as gym
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_atari_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack

from clusterenv_sb3 import ClusterVecEnv

gym.register_envs(ale_py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-id", default="PongNoFrameskip-v4")
    parser.add_argument("--timesteps", type=int, default=1_000_000)
    parser.add_argument("--n-envs", type=int, default=8)
    parser.add_argument("--num-workers", type=int, default=None, help="default: one per core")
    parser.add_argument("--backend", default="local", choices=["local", "mpi"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-episodes", type=int, default=5)
    parser.add_argument("--baseline", action="store_true", help="use DummyVecEnv instead, for comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.baseline:
        vec_env_cls, vec_env_kwargs = DummyVecEnv, {}
    else:
        vec_env_cls = ClusterVecEnv  # the one changed line
        vec_env_kwargs = {"backend": args.backend, "num_workers": args.num_workers}
    env = make_atari_env(
        args.env_id, n_envs=args.n_envs, seed=args.seed, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_env_kwargs
    )
    env = VecFrameStack(env, n_stack=4)
    # rl-baselines3-zoo's Atari PPO settings.
    model = PPO(
        "CnnPolicy",
        env,
        n_steps=128,
        n_epochs=4,
        batch_size=256,
        learning_rate=lambda progress: 2.5e-4 * progress,
        clip_range=lambda progress: 0.1 * progress,
        vf_coef=0.5,
        ent_coef=0.01,
        seed=args.seed,
        device="cpu",
        verbose=1,
    )
    started = time.perf_counter()
    model.learn(total_timesteps=args.timesteps)
    train_seconds = time.perf_counter() - started
    env.close()
    print(f"trained {model.num_timesteps} steps in {train_seconds:.0f} s on {vec_env_cls.__name__}")

    if args.eval_episodes > 0:
        # Whole games: the Monitor below AtariWrapper records the unclipped score of all lives.
        eval_env = VecFrameStack(make_atari_env(args.env_id, n_envs=1, seed=args.seed + 1000), n_stack=4)
        returns, _ = evaluate_policy(model, eval_env, n_eval_episodes=args.eval_episodes, return_episode_rewards=True)
        eval_env.close()
        print(f"mean score over {args.eval_episodes} games: {sum(returns) / len(returns):.1f}")


if __name__ == "__main__":
    main()
