"""What a synchronous step could gain if the learner stepped one block of envs itself.

    python benchmarks/learner_block.py [--workloads halfcheetah cartpole] [--envs 16 32] [--rounds 10]
                                       [--seconds 1] [--json benchmarks/results/learner_block.json]

On a machine with few cores, ``ClusterVecEnv`` runs one worker per core beside the learner: three
processes on two cores, so every step pays cross-core wake-ups and the learner's turnaround while
a worker waits. This measures the alternative before anyone builds it: the learner steps the first
``num_envs / cores`` envs in a ``DummyVecEnv`` while ``cores - 1`` spinning ClusterEnv workers step
the rest (``step_async``, own block, ``step_wait``), one process per core. Rounds interleave
DummyVecEnv, ClusterVecEnv and that composition (all three built once, stepped in turn), and the
table gives the medians of each round's ratio to DummyVecEnv, with their range: the machine is
noisy, so only ratios within a round mean anything.

What the composition leaves out, and a real mode would have to answer: an env in the learner that
hangs has no timeout, one that crashes takes the learner with it, and Ctrl-C lands in env code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from stable_baselines3.common.vec_env import DummyVecEnv

from clusterenv_sb3 import ClusterVecEnv
from throughput import CORES, TITLES, WORKLOADS


class LearnerStepsABlock:
    """The learner's own block in a ``DummyVecEnv`` beside ClusterEnv workers for the others."""

    def __init__(self, env_fns: list[Callable[[], gym.Env]]) -> None:
        self.split = len(env_fns) // CORES
        self.own = DummyVecEnv(env_fns[: self.split])
        workers = CORES - 1
        self.remote = ClusterVecEnv(env_fns[self.split :], num_workers=workers, spinning_workers=workers)

    def reset(self) -> np.ndarray:
        return np.concatenate([self.own.reset(), self.remote.reset()])

    def step(self, actions: np.ndarray) -> tuple:
        self.remote.step_async(actions[self.split :])
        own = self.own.step(actions[: self.split])
        remote = self.remote.step_wait()
        return (*(np.concatenate(pair) for pair in zip(own[:3], remote[:3])), own[3] + remote[3])

    def close(self) -> None:
        self.own.close()
        self.remote.close()


def steps_per_second(venv: Any, actions: list[np.ndarray], seconds: float) -> float:
    for batch in actions[:10]:  # warm-up: caches, spinning workers
        venv.step(batch)
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        venv.step(actions[steps % len(actions)])
        steps += 1
    return steps * len(actions[0]) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["halfcheetah", "cartpole"], choices=list(WORKLOADS))
    parser.add_argument("--envs", type=int, nargs="+", default=[16, 32], help="one count per workload, in order")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per vectorizer and round")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "learner_block.json"))
    args = parser.parse_args()
    if CORES < 2:
        raise SystemExit("needs at least 2 cores")

    results = []
    for workload, num_envs in zip(args.workloads, args.envs):
        env_fn = WORKLOADS[workload][0]
        env_fns = [env_fn] * num_envs
        venvs = {
            "DummyVecEnv": DummyVecEnv(env_fns),
            "ClusterVecEnv": ClusterVecEnv(env_fns),
            "learner steps a block": LearnerStepsABlock(env_fns),
        }
        try:
            action_space = venvs["DummyVecEnv"].action_space
            action_space.seed(0)
            actions = [np.stack([action_space.sample() for _ in range(num_envs)]) for _ in range(64)]
            for venv in venvs.values():
                venv.reset()
            rates: dict[str, list[float]] = {name: [] for name in venvs}
            for _ in range(args.rounds):
                for name, venv in venvs.items():
                    rates[name].append(steps_per_second(venv, actions, args.seconds))
        finally:
            for venv in venvs.values():
                venv.close()
        for name, rate in rates.items():
            ratios = [r / d for r, d in zip(rate, rates["DummyVecEnv"])]
            results.append({
                "workload": workload, "env": TITLES[workload], "num_envs": num_envs, "vec_env": name,
                "median_steps_per_s": statistics.median(rate), "median_vs_dummy": statistics.median(ratios),
                "min_vs_dummy": min(ratios), "max_vs_dummy": max(ratios), "steps_per_s": rate,
            })

    print(f"| env | envs | vec env | median steps/s | vs Dummy (median of {args.rounds} rounds) | range |")
    print("|---|---:|---|---:|---:|---|")
    for row in results:
        print(
            f"| {row['env']} | {row['num_envs']} | {row['vec_env']} | {row['median_steps_per_s']:,.0f} |"
            f" {row['median_vs_dummy']:.2f}x | {row['min_vs_dummy']:.2f}-{row['max_vs_dummy']:.2f} |"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as file:
        json.dump({"cores": CORES, "rounds": args.rounds, "seconds": args.seconds, "results": results}, file, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
