"""SB3 PPO with the policy on the ClusterEnv workers, and AAPS deciding when they get new weights.

    python examples/sb3_ppo_aaps.py                              # AAPS, KL threshold 0.01, overlap
    python examples/sb3_ppo_aaps.py --sync always                # new weights after every update
    python examples/sb3_ppo_aaps.py --sync never                 # the workers keep the first weights

Compared with ``sb3_ppo_cartpole.py`` (SB3's PPO, actions chosen in this process), ClusterEnv
takes two lines: ``from clusterenv_sb3 import PPO`` (the workers act and return whole segments) and
``callback=AAPSCallback(...)`` (weights are shipped only when the learner's policy has drifted from
the workers' copy by more than ``--kl-threshold``, mean KL on recent states). Its PPO settings are
its own (longer segments, fewer epochs, constant learning rate and clip range, 50k steps): the
runs are not meant to be compared step for step. At the end the
learner's policy is evaluated on fresh episodes and the sync counters printed; with
``--tensorboard-log`` they are also under ``aaps/`` in TensorBoard.
"""

from __future__ import annotations

import argparse
import time

import torch
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy

from clusterenv_sb3 import PPO, AAPSCallback, ClusterVecEnv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timesteps", type=int, default=50_000)
    parser.add_argument("--n-envs", type=int, default=8)
    parser.add_argument("--num-workers", type=int, default=None, help="default: one per core")
    parser.add_argument("--backend", default="local", choices=["local", "mpi"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync", default="aaps", choices=["always", "aaps", "never"])
    parser.add_argument("--kl-threshold", type=float, default=0.01)
    parser.add_argument("--max-staleness", type=int, default=None, help="push anyway after this many updates")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                        help="collect the next segment while training on the current one")
    parser.add_argument("--tensorboard-log", default=None, help="a directory for TensorBoard logs")
    args = parser.parse_args()
    torch.set_num_threads(1)  # small networks; the workers need the other cores

    env = make_vec_env(
        "CartPole-v1", n_envs=args.n_envs, seed=args.seed, vec_env_cls=ClusterVecEnv,
        vec_env_kwargs={"backend": args.backend, "num_workers": args.num_workers},
    )
    # Hyperparameters close to rl-baselines3-zoo's for CartPole.
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=64,
        batch_size=128,
        n_epochs=10,
        gae_lambda=0.8,
        gamma=0.98,
        learning_rate=1e-3,
        ent_coef=0.0,
        overlap_collection=args.overlap,
        seed=args.seed,
        device="cpu",
        tensorboard_log=args.tensorboard_log,
    )
    callback = AAPSCallback(kl_threshold=args.kl_threshold, max_staleness=args.max_staleness, mode=args.sync)
    started = time.perf_counter()
    model.learn(total_timesteps=args.timesteps, callback=callback)
    train_seconds = time.perf_counter() - started
    sync = model.policy_sync.summary()
    env.close()

    mean_return, std_return = evaluate_policy(model, make_vec_env("CartPole-v1", n_envs=1, seed=10_000),
                                              n_eval_episodes=10, deterministic=True)
    print(f"trained {model.num_timesteps} steps in {train_seconds:.1f} s, sync={args.sync}")
    print(
        f"syncs {sync['syncs']} of {sync['updates']} updates, {sync['weight_bytes_sent'] / 1e6:.2f} MB of weights, "
        f"workers {sync['mean_update_lag']:.1f} updates behind on average"
    )
    print(f"greedy policy, mean return over 10 episodes: {mean_return:.1f} +/- {std_return:.1f}")


if __name__ == "__main__":
    main()
