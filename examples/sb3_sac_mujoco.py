"""SB3 SAC on a MuJoCo task (HalfCheetah-v5 by default), the simulators on ClusterEnv workers.

    python examples/sb3_sac_mujoco.py --timesteps 100000
    python examples/sb3_sac_mujoco.py --env-id Hopper-v5 --baseline   # DummyVecEnv instead

The only ClusterEnv line is ``vec_env_cls=ClusterVecEnv``. Each of the ``--n-envs`` simulators
steps on a worker while the learner picks the next actions and trains; ``gradient_steps=-1`` makes
one gradient step per collected transition, so the update-to-data ratio is that of single-env SAC.
At the end the deterministic policy is evaluated on fresh episodes.
"""

from __future__ import annotations

import argparse
import time

import torch
from stable_baselines3 import SAC
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import DummyVecEnv

from clusterenv_sb3 import ClusterVecEnv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-id", default="HalfCheetah-v5")
    parser.add_argument("--timesteps", type=int, default=100_000)
    parser.add_argument("--n-envs", type=int, default=4)
    parser.add_argument("--learning-starts", type=int, default=10_000)
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
    env = make_vec_env(
        args.env_id, n_envs=args.n_envs, seed=args.seed, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_env_kwargs
    )
    model = SAC(
        "MlpPolicy",
        env,
        learning_starts=args.learning_starts,
        gradient_steps=-1,
        seed=args.seed,
        device="cpu",
        verbose=1,
    )
    started = time.perf_counter()
    model.learn(total_timesteps=args.timesteps, log_interval=10)
    train_seconds = time.perf_counter() - started
    env.close()
    print(f"trained {model.num_timesteps} steps in {train_seconds:.0f} s on {vec_env_cls.__name__}")

    if args.eval_episodes > 0:
        eval_env = make_vec_env(args.env_id, n_envs=1, seed=args.seed + 1000)
        mean_return, std_return = evaluate_policy(model, eval_env, n_eval_episodes=args.eval_episodes, deterministic=True)
        eval_env.close()
        print(f"mean return over {args.eval_episodes} episodes: {mean_return:.1f} +/- {std_return:.1f}")


if __name__ == "__main__":
    main()
