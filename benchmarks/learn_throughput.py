"""Whole SB3 ``learn()`` calls with each vectorizer: env steps per second, and where the time goes.

    python benchmarks/learn_throughput.py [--runs ppo_halfcheetah ppo_pong sac_halfcheetah] [--repeats 1]
                                          [--torch-threads N] [--json benchmarks/results/learn_throughput.json]

What a user sees end to end, policy updates included. Runs (defaults follow rl-baselines3-zoo's
shapes, shortened):

- ``ppo_halfcheetah``: PPO, HalfCheetah-v5, 16 envs, ``n_steps=64``, one epoch, 65,536 steps;
- ``ppo_pong``: PPO with ``CnnPolicy``, Pong with SB3's Atari preprocessing and 4 stacked frames,
  16 envs, ``n_steps=128``, one epoch, 16,384 steps;
- ``sac_halfcheetah``: SAC, HalfCheetah-v5, 4 envs, one gradient step per transition, 4,000 steps
  after 1,000 random ones.

Each with ``DummyVecEnv``, ``SubprocVecEnv`` (fork) and ``ClusterVecEnv`` (central inference;
also with ``inline_worker=True``), and with ``clusterenv_sb3.PPO``/``SAC`` (the policy or actor on
the workers), without and with ``overlap_collection``; for those the Pong env stacks its frames
itself (a ``VecFrameStack`` would stack them in the learner, out of the workers' reach). The learner's torch runs one thread, as
the examples set it; ``--torch-threads 0`` keeps torch's default (one per core), which makes
every vectorizer with worker processes slower (docs/guides/sb3_quickstart.md). The time inside ``collect_rollouts`` and
inside ``train`` is reported apart (with overlap, collection runs during training, so ``collect``
is only the wait for it); ``setup`` is the rest of ``learn()`` (for worker-side inference:
deploying the policy); ``model`` is the algorithm's construction, before ``learn()`` (for
worker-side inference it starts the workers' torch, beside the learner building its policy).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from typing import Any

import measuring
import torch
from stable_baselines3 import PPO, SAC
from stable_baselines3.common.env_util import make_atari_env, make_vec_env
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecFrameStack

import clusterenv_sb3
from clusterenv_sb3 import ClusterVecEnv

VEC_ENVS: dict[str, tuple[type, dict]] = {
    "DummyVecEnv": (DummyVecEnv, {}),
    "SubprocVecEnv(fork)": (SubprocVecEnv, {"start_method": "fork"}),
    "ClusterVecEnv": (ClusterVecEnv, {}),
    "ClusterVecEnv(inline)": (ClusterVecEnv, {"inline_worker": True}),
}


def _timed(model: Any, name: str, totals: dict[str, float]) -> None:
    """Wrap ``model.<name>`` so the seconds spent inside it add up in ``totals[name]``."""
    inner = getattr(model, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - started

    setattr(model, name, timed)


def _halfcheetah(vec_env_cls: type, vec_env_kwargs: dict, n_envs: int) -> Any:
    return make_vec_env("HalfCheetah-v5", n_envs=n_envs, seed=0, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_env_kwargs)


def _pong(vec_env_cls: type, vec_env_kwargs: dict, n_envs: int) -> Any:
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    venv = make_atari_env("PongNoFrameskip-v4", n_envs=n_envs, seed=0, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_env_kwargs)
    return VecFrameStack(venv, n_stack=4)


def _stacked_pong() -> Any:
    """Pong as ``make_atari_env`` builds it, with the 4 frames stacked in the env, channels first:
    what a policy on the workers sees (``VecFrameStack`` would stack them in the learner)."""
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import FrameStackObservation, ReshapeObservation
    from stable_baselines3.common.atari_wrappers import AtariWrapper
    from stable_baselines3.common.monitor import Monitor

    gym.register_envs(ale_py)
    env = AtariWrapper(Monitor(gym.make("PongNoFrameskip-v4")))
    return ReshapeObservation(FrameStackObservation(env, 4, padding_type="zero"), (4, 84, 84))


def _pong_stacked_in_envs(vec_env_cls: type, vec_env_kwargs: dict, n_envs: int) -> Any:
    return make_vec_env(_stacked_pong, n_envs=n_envs, seed=0, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_env_kwargs)


# name -> how to make the env, n_envs, the algorithm, total timesteps, the worker-side algorithm
# class (or None) and, when it needs another, how to make its env
RUNS: dict[str, dict[str, Any]] = {
    "ppo_halfcheetah": {
        "make_env": _halfcheetah,
        "n_envs": 16,
        "algorithm": lambda cls, env: cls("MlpPolicy", env, n_steps=64, batch_size=256, n_epochs=1, seed=0, device="cpu"),
        "timesteps": 65_536,
        "worker_side": clusterenv_sb3.PPO,
    },
    "ppo_pong": {
        "make_env": _pong,
        "n_envs": 16,
        "algorithm": lambda cls, env: cls("CnnPolicy", env, n_steps=128, batch_size=256, n_epochs=1, seed=0, device="cpu"),
        "timesteps": 16_384,
        "worker_side": clusterenv_sb3.PPO,
        "worker_side_env": _pong_stacked_in_envs,  # the workers' policy sees the stacked frames
    },
    "sac_halfcheetah": {
        "make_env": _halfcheetah,
        "n_envs": 4,
        "algorithm": lambda cls, env: cls("MlpPolicy", env, learning_starts=1_000, gradient_steps=-1, seed=0, device="cpu"),
        "timesteps": 5_000,
        "worker_side": clusterenv_sb3.SAC,
    },
}


def measure(run: dict, vec_name: str, vec_env_cls: type, vec_env_kwargs: dict, algorithm_cls: type, **extra: Any) -> dict:
    started = time.perf_counter()
    make_env = run.get("worker_side_env", run["make_env"]) if algorithm_cls is run["worker_side"] else run["make_env"]
    env = make_env(vec_env_cls, vec_env_kwargs, run["n_envs"])
    construct = time.perf_counter() - started
    totals = {"collect_rollouts": 0.0, "train": 0.0}
    try:
        started = time.perf_counter()
        model = run["algorithm"](functools.partial(algorithm_cls, **extra), env)
        model_s = time.perf_counter() - started
        _timed(model, "collect_rollouts", totals)
        _timed(model, "train", totals)
        started = time.perf_counter()
        model.learn(run["timesteps"])
        wall = time.perf_counter() - started
        steps = model.num_timesteps
    finally:
        env.close()
    return {
        "vec_env": vec_name,
        "env_steps": steps,
        "learn_s": wall,
        "steps_per_s": steps / wall,
        "collect_s": totals["collect_rollouts"],
        "train_s": totals["train"],
        "setup_s": wall - totals["collect_rollouts"] - totals["train"],
        "construct_s": construct,
        "model_s": model_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (the median is reported)")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "learn_throughput.json"))
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="the learner's torch threads, as the examples set them (0: torch's default)"
    )
    args = parser.parse_args()
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)

    results = []
    for name in args.runs:
        run = RUNS[name]
        algorithm = PPO if name.startswith("ppo") else SAC
        configs: list[tuple[str, type, dict, type, dict]] = [
            (vec_name, cls, kwargs, algorithm, {}) for vec_name, (cls, kwargs) in VEC_ENVS.items()
        ]
        worker_side = run["worker_side"]
        if worker_side is not None:
            label = f"clusterenv_sb3.{worker_side.__name__}"
            configs.append((label, ClusterVecEnv, {}, worker_side, {}))
            configs.append((f"{label}, overlap", ClusterVecEnv, {}, worker_side, {"overlap_collection": True}))

        def measure_config(config: tuple[str, type, dict, type, dict]) -> dict:
            vec_name, cls, kwargs, algorithm_cls, extra = config
            return {**measure(run, vec_name, cls, kwargs, algorithm_cls, **extra), "run": name}

        def progress(number: int, config: tuple, row: dict) -> None:
            print(
                f"{name:16s} {row['vec_env']:30s} {row['steps_per_s']:7.0f} env steps/s  learn {row['learn_s']:6.1f} s"
                f" (collect {row['collect_s']:6.1f}, train {row['train_s']:6.1f}, setup {row['setup_s']:5.1f})"
                f"  model {row['model_s']:4.1f} s",
                flush=True,
            )

        # The run with the median env steps/s of each configuration is reported.
        rows = []
        for repeats in measuring.measure_rounds(configs, args.repeats, measure_config, progress=progress):
            row = measuring.median_round(repeats, "steps_per_s")
            row["repeats"] = [entry["steps_per_s"] for entry in repeats]
            rows.append(row)
        dummy = rows[0]["steps_per_s"]
        for row in rows:
            row["vs_dummy"] = row["steps_per_s"] / dummy
        results += rows

    print()
    print("| run | vectorizer | env steps/s | vs Dummy | learn (s) | collect (s) | train (s) | setup (s) | model (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in results:
        print(
            f"| {row['run']} | {row['vec_env']} | {row['steps_per_s']:,.0f} | {row['vs_dummy']:.2f}x | {row['learn_s']:.1f} |"
            f" {row['collect_s']:.1f} | {row['train_s']:.1f} | {row['setup_s']:.1f} | {row['model_s']:.1f} |"
        )
    measuring.write_json(args.json, {"machine": measuring.machine(), "results": results})
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
