"""Whole SB3 ``learn()`` calls with each vectorizer taking turns in one process: ratios that the
machine's drift cancels out of.

    python benchmarks/learn_in_turns.py [--run ppo_halfcheetah] [--rounds 10] [--chunk 16384]
                                        [--json benchmarks/results/learn_in_turns.json]

``learn_throughput.py`` times each configuration in runs of its own, a minute apart; on a shared
machine whose speed changes within seconds a run's ratio to DummyVecEnv then swings by tens of
percent. Here every configuration (DummyVecEnv's algorithm, the worker-side algorithm without and
with ``overlap_collection``, on ``learn_throughput``'s run settings) is built once and warmed up,
then each ``learn()``s ``--chunk`` more steps in turn, in a shuffled order each round; a model's
workers wait idle while the others learn. Reported per configuration: the median env steps/s and
the median over rounds of its ratio to that round's DummyVecEnv.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import measuring
import numpy as np
import torch
from learn_throughput import RUNS
from stable_baselines3 import PPO, SAC
from stable_baselines3.common.vec_env import DummyVecEnv

from clusterenv_sb3 import ClusterVecEnv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="ppo_halfcheetah", choices=[name for name, run in RUNS.items() if run["worker_side"]])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=16_384, help="env steps each configuration learns per turn")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "learn_in_turns.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the examples set it

    run = RUNS[args.run]
    algorithm = PPO if args.run.startswith("ppo") else SAC
    worker_side = run["worker_side"]
    label = f"clusterenv_sb3.{worker_side.__name__}"
    make_worker_env = run.get("worker_side_env", run["make_env"])
    models = {
        "DummyVecEnv": run["algorithm"](algorithm, run["make_env"](DummyVecEnv, {}, run["n_envs"])),
        label: run["algorithm"](worker_side, make_worker_env(ClusterVecEnv, {}, run["n_envs"])),
        f"{label}, overlap": run["algorithm"](
            functools.partial(worker_side, overlap_collection=True), make_worker_env(ClusterVecEnv, {}, run["n_envs"])
        ),
    }
    try:
        for model in models.values():
            model.learn(args.chunk // 4)  # warm-up: deployment, first segments, buffers
        rates: dict[str, list[float]] = {name: [] for name in models}
        order = list(models)
        rng = np.random.default_rng(0)
        for round_index in range(args.rounds):
            rng.shuffle(order)
            for name in order:
                model = models[name]
                before, started = model.num_timesteps, time.perf_counter()
                model.learn(args.chunk, reset_num_timesteps=False)
                rates[name].append((model.num_timesteps - before) / (time.perf_counter() - started))
            print(f"round {round_index + 1}: " + ", ".join(f"{name} {rates[name][-1]:,.0f}" for name in models), flush=True)
    finally:
        for model in models.values():
            model.get_env().close()

    dummy = np.array(rates["DummyVecEnv"])
    results = []
    print("\n| run | vectorizer | env steps/s (median) | vs Dummy (median of rounds, range) |")
    print("|---|---|---:|---:|")
    for name, values in rates.items():
        ratios = np.array(values) / dummy
        row = {
            "run": args.run,
            "vec_env": name,
            "steps_per_s": float(np.median(values)),
            "vs_dummy": float(np.median(ratios)),
            "vs_dummy_range": [float(ratios.min()), float(ratios.max())],
            "rounds": values,
        }
        results.append(row)
        print(
            f"| {args.run} | {name} | {row['steps_per_s']:,.0f} | {row['vs_dummy']:.2f}x"
            f" ({ratios.min():.2f}–{ratios.max():.2f}) |"
        )
    measuring.write_json(args.json, {"machine": measuring.machine(), "chunk": args.chunk, "results": results})
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
