"""SB3 PPO whose environments run on Ray actors across the nodes of a Ray cluster.

    python examples/ray/train_sb3_ppo_ray.py                     # a local Ray, started for this run
    python examples/ray/train_sb3_ppo_ray.py --address auto      # the cluster this machine belongs to
    python examples/ray/train_sb3_ppo_ray.py --address ray://head:10001 --processes-per-worker 8

This process learns (on the head node, or wherever the script is submitted with ``ray job submit``);
each ClusterEnv worker is a Ray actor, one per node with CPUs unless ``--num-workers`` says
otherwise, each stepping its block of envs (on ``--processes-per-worker`` local processes of its
node when more than 1). Against ``examples/sb3_ppo_cartpole.py`` the one changed line is
``"backend": "ray"``. With ``--restart-failed-workers`` a lost node's actor is replaced on a node
with room (its envs end their episodes and start over) and training goes on. The cluster
definitions beside this script start such a cluster: ``raycluster.yaml`` (KubeRay) and
``ray_up.yaml`` (``ray up``); docs/guides/ray.md says how to run them.
"""

from __future__ import annotations

import argparse
import time

import ray
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy

from clusterenv_sb3 import ClusterVecEnv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=None, help='the Ray cluster ("auto", "ray://head:10001"); default: local')
    parser.add_argument("--env-id", default="CartPole-v1")
    parser.add_argument("--timesteps", type=int, default=150_000)
    parser.add_argument("--n-envs", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=None, help="actors; default: one per node with CPUs")
    parser.add_argument(
        "--processes-per-worker", type=int, default=None, help="local processes of each actor; default: a node's CPUs"
    )
    parser.add_argument("--restart-failed-workers", action="store_true", help="replace lost actors, train on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-episodes", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)  # small networks; leave the cores to the envs

    if args.address is not None:
        ray.init(address=args.address, logging_level="warning")  # else the pool starts a local Ray
    env = make_vec_env(
        args.env_id,
        n_envs=args.n_envs,
        seed=args.seed,
        vec_env_cls=ClusterVecEnv,
        vec_env_kwargs={
            "backend": "ray",  # the one changed line
            "num_workers": args.num_workers,
            "processes_per_worker": args.processes_per_worker,
            "restart_failed_workers": args.restart_failed_workers,
        },
    )
    nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) > 0}
    print(
        f"{args.n_envs} envs on {env.pool.num_workers} Ray actors x {env.pool.processes_per_worker} processes, "
        f"{len(nodes)} nodes with CPUs",
        flush=True,
    )
    # Hyperparameters close to rl-baselines3-zoo's for CartPole.
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
    )
    started = time.perf_counter()
    model.learn(total_timesteps=args.timesteps)
    train_seconds = time.perf_counter() - started
    mean_return, std_return = evaluate_policy(model, env, n_eval_episodes=args.eval_episodes, deterministic=True)
    steps_per_s = model.num_timesteps / train_seconds
    print(f"trained {model.num_timesteps} steps in {train_seconds:.1f} s ({steps_per_s:.0f} steps/s)")
    print(f"workers replaced: {env.pool.restarts['workers']}")
    print(f"mean return over {args.eval_episodes} episodes: {mean_return:.1f} +/- {std_return:.1f}")
    env.close()


if __name__ == "__main__":
    main()
