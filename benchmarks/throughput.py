"""Steps per second of vectorized environments, all measured in one run on this machine.

    python benchmarks/throughput.py [--seconds 2] [--envs 8 32] [--json benchmarks/results/throughput.json]

Compares SB3's DummyVecEnv (one process), SB3's SubprocVecEnv (fork), gymnasium's AsyncVectorEnv
and ClusterVecEnv (local backend, one worker per core; and the MPI backend, 2 spawned worker ranks,
when mpi4py is installed) on CartPole-v1 and on CartPole whose step busy-waits 200 µs (a stand-in
for a costly simulator). Random actions are drawn before timing. ``benchmarks/mpi_throughput.py``
compares the two backends more closely (alternating rounds in fresh processes, round trips, CPU).
Construction time is the time to build the vector env and reset it. The machine is noisy: read the
ratios to DummyVecEnv within one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import time

import gymnasium as gym
import numpy as np
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

from clusterenv_sb3 import ClusterVecEnv


class BusyCartPole(gym.Wrapper):
    """CartPole whose step busy-waits ``busy_us`` microseconds."""

    def __init__(self, busy_us: float = 200.0) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.busy_s = busy_us * 1e-6

    def step(self, action):
        end = time.perf_counter() + self.busy_s
        while time.perf_counter() < end:
            pass
        return self.env.step(action)


ENVS = {
    "CartPole-v1": functools.partial(gym.make, "CartPole-v1"),
    "CartPole busy 200us": functools.partial(BusyCartPole, 200.0),
}

VEC_ENVS = {
    "DummyVecEnv": DummyVecEnv,
    "SubprocVecEnv(fork)": functools.partial(SubprocVecEnv, start_method="fork"),
    "AsyncVectorEnv": gym.vector.AsyncVectorEnv,
    "ClusterVecEnv": ClusterVecEnv,
}
if importlib.util.find_spec("mpi4py") is not None:
    VEC_ENVS["ClusterVecEnv(mpi)"] = functools.partial(ClusterVecEnv, backend="mpi", num_workers=2)


def measure(vec_env_cls, env_fn, num_envs: int, seconds: float) -> dict:
    started = time.perf_counter()
    venv = vec_env_cls([env_fn] * num_envs)
    venv.reset()
    construct = time.perf_counter() - started
    actions = np.random.default_rng(0).integers(0, 2, size=(1024, num_envs))
    try:
        for i in range(20):  # warm-up
            venv.step(actions[i])
        steps = 0
        started = time.perf_counter()
        deadline = started + seconds
        while time.perf_counter() < deadline:
            for i in range(32):
                venv.step(actions[(steps + i) % 1024])
            steps += 32
        elapsed = time.perf_counter() - started
    finally:
        venv.close()
    return {"construct_s": construct, "steps_per_s": steps * num_envs / elapsed, "step_us": elapsed / steps * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per configuration")
    parser.add_argument("--envs", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "throughput.json"))
    args = parser.parse_args()

    results = []
    for env_name, env_fn in ENVS.items():
        for num_envs in args.envs:
            baseline = None
            for vec_name, vec_env_cls in VEC_ENVS.items():
                row = {"env": env_name, "num_envs": num_envs, "vec_env": vec_name}
                row.update(measure(vec_env_cls, env_fn, num_envs, args.seconds))
                baseline = baseline or row["steps_per_s"]
                row["vs_dummy"] = row["steps_per_s"] / baseline
                results.append(row)
                print(
                    f"{env_name:20s} {num_envs:3d} envs  {vec_name:20s} {row['steps_per_s']:10.0f} steps/s"
                    f"  {row['vs_dummy']:5.2f}x DummyVecEnv  construct {row['construct_s']:6.2f} s",
                    flush=True,
                )
    print()
    print("| env | envs | vec env | steps/s | vs DummyVecEnv | construct (s) |")
    print("|---|---:|---|---:|---:|---:|")
    for row in results:
        print(
            f"| {row['env']} | {row['num_envs']} | {row['vec_env']} | {row['steps_per_s']:,.0f} |"
            f" {row['vs_dummy']:.2f}x | {row['construct_s']:.2f} |"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as file:
        machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
        json.dump({"machine": machine, "seconds": args.seconds, "results": results}, file, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
