"""Steps per second of vectorized environments on the workloads people distribute, all in one run.

    python benchmarks/throughput.py [--seconds 3] [--workloads cartpole busy pong halfcheetah]
                                    [--envs 8 16 32] [--json benchmarks/results/throughput.json]

Workloads: CartPole-v1; CartPole whose step busy-waits 200 µs (a stand-in for a costly simulator);
Pong with SB3's ``AtariWrapper`` (``PongNoFrameskip-v4``, 84x84 frames); HalfCheetah-v5 (MuJoCo).
Vectorizers: SB3's ``DummyVecEnv`` (one process) and ``SubprocVecEnv`` (fork), gymnasium's
``AsyncVectorEnv``, ``ClusterVecEnv`` (local backend, one worker per core; the MPI backend with 2
spawned ranks when mpi4py is installed), EnvPool (native C++ of the same task, where it has it and
is installed: ``pip install envpool``; its Pong does its own preprocessing), and **ideal**: one
process per core, each stepping its share of the envs with no coordination at all, the machine's
limit for these Python envs.

Per configuration: env steps/s and the ratios to DummyVecEnv and to ideal; the learner's CPU per
vector step (µs; for EnvPool it includes its threads); each worker process's busy fraction (CPU
seconds over wall seconds while stepping), which shows where a synchronous step loses the machine;
and the construction time (build and first reset). Random actions are drawn before timing. The
machine is noisy: compare the ratios within one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import multiprocessing
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

from clusterenv_sb3 import ClusterVecEnv

HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
HAVE_ENVPOOL = importlib.util.find_spec("envpool") is not None
CORES = os.cpu_count() or 1


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


def make_pong() -> gym.Env:
    """Pong as SB3's ``make_atari_env`` builds it (without its Monitor)."""
    import ale_py
    from stable_baselines3.common.atari_wrappers import AtariWrapper

    gym.register_envs(ale_py)
    return AtariWrapper(gym.make("PongNoFrameskip-v4"))


# name -> (env factory, EnvPool task id or None, package it needs or None)
WORKLOADS: dict[str, tuple[Callable[[], gym.Env], str | None, str | None]] = {
    "cartpole": (functools.partial(gym.make, "CartPole-v1"), None, None),
    "busy": (functools.partial(BusyCartPole, 200.0), None, None),
    "pong": (make_pong, "Pong-v5", "ale_py"),
    "halfcheetah": (functools.partial(gym.make, "HalfCheetah-v5"), "HalfCheetah-v5", "mujoco"),
}
TITLES = {"cartpole": "CartPole-v1", "busy": "CartPole, 200 µs busy step", "pong": "Pong (AtariWrapper)", "halfcheetah": "HalfCheetah-v5"}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, threads included (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker_pids(venv: Any) -> list[int]:
    if isinstance(venv, ClusterVecEnv):
        return venv.pool.worker_pids
    processes = getattr(venv, "processes", None) or []
    return [process.pid for process in processes]


def _envpool_vec(task: str, num_envs: int) -> Any:
    import envpool

    return envpool.make_gymnasium(task, num_envs=num_envs, batch_size=num_envs, num_threads=CORES, seed=0)


def measure(make_venv: Callable[[], Any], action_space: gym.Space, num_envs: int, seconds: float) -> dict:
    """Step the vector env ``make_venv()`` builds with random actions for ``seconds``."""
    started = time.perf_counter()
    venv = make_venv()
    venv.reset()
    construct = time.perf_counter() - started
    action_space.seed(0)
    actions = [np.stack([action_space.sample() for _ in range(num_envs)]) for _ in range(256)]
    try:
        for i in range(20):  # warm-up
            venv.step(actions[i])
        workers = _worker_pids(venv)
        learner_cpu = _cpu_seconds(os.getpid())
        worker_cpu = [_cpu_seconds(pid) for pid in workers]
        steps = 0
        started = time.perf_counter()
        deadline = started + seconds
        while time.perf_counter() < deadline:
            for i in range(16):
                venv.step(actions[(steps + i) % 256])
            steps += 16
        elapsed = time.perf_counter() - started
        learner_cpu = _cpu_seconds(os.getpid()) - learner_cpu
        busy = [(_cpu_seconds(pid) - cpu) / elapsed for pid, cpu in zip(workers, worker_cpu)]
    finally:
        venv.close()
    return {
        "construct_s": construct,
        "steps_per_s": steps * num_envs / elapsed,
        "step_us": elapsed / steps * 1e6,
        "learner_cpu_us_per_step": learner_cpu / steps * 1e6,
        "worker_busy": busy,
    }


def _ideal_process(env_fn: Callable, num_envs: int, action_space: gym.Space, seconds: float, barrier, results) -> None:
    envs = [env_fn() for _ in range(num_envs)]
    for env in envs:
        env.reset(seed=0)
    action_space.seed(os.getpid())
    actions = [[action_space.sample() for _ in range(num_envs)] for _ in range(256)]

    def step_all(batch: list) -> None:
        for env, action in zip(envs, batch):
            _, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                env.reset()

    for i in range(20):
        step_all(actions[i])
    barrier.wait()
    cpu, steps = _cpu_seconds(os.getpid()), 0
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        step_all(actions[steps % 256])
        steps += 1
    elapsed = time.perf_counter() - started
    results.put((steps * num_envs / elapsed, (_cpu_seconds(os.getpid()) - cpu) / elapsed))


def measure_ideal(env_fn: Callable, action_space: gym.Space, num_envs: int, seconds: float) -> dict:
    """One process per core, each stepping its share of the envs alone: the sum of their steps/s."""
    context = multiprocessing.get_context("fork")
    shares = [len(part) for part in np.array_split(np.arange(num_envs), min(CORES, num_envs))]
    barrier, results = context.Barrier(len(shares)), context.Queue()
    started = time.perf_counter()
    processes = [
        context.Process(target=_ideal_process, args=(env_fn, share, action_space, seconds, barrier, results))
        for share in shares
    ]
    for process in processes:
        process.start()
    reports = [results.get(timeout=seconds + 600) for _ in processes]
    for process in processes:
        process.join()
    return {
        "construct_s": time.perf_counter() - started - seconds,
        "steps_per_s": sum(rate for rate, _ in reports),
        "step_us": float("nan"),
        "learner_cpu_us_per_step": float("nan"),
        "worker_busy": [busy for _, busy in reports],
    }


def vectorizers(workload: str, num_envs: int) -> dict[str, Callable[[], Any] | None]:
    env_fn, envpool_task, _ = WORKLOADS[workload]
    env_fns = [env_fn] * num_envs
    makers: dict[str, Callable[[], Any] | None] = {
        "DummyVecEnv": lambda: DummyVecEnv(env_fns),
        "SubprocVecEnv(fork)": lambda: SubprocVecEnv(env_fns, start_method="fork"),
        "AsyncVectorEnv": lambda: gym.vector.AsyncVectorEnv(env_fns),
        "ClusterVecEnv": lambda: ClusterVecEnv(env_fns),
    }
    if HAVE_MPI:
        makers["ClusterVecEnv(mpi)"] = lambda: ClusterVecEnv(env_fns, backend="mpi", num_workers=min(2, num_envs))
    if HAVE_ENVPOOL and envpool_task is not None:
        makers["EnvPool (native)"] = lambda: _envpool_vec(envpool_task, num_envs)
    makers["ideal"] = None
    return makers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per configuration")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--envs", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--only", nargs="+", default=None, help="vectorizer names to run (DummyVecEnv always runs)")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "throughput.json"))
    args = parser.parse_args()

    results = []
    for workload in args.workloads:
        env_fn, _, package = WORKLOADS[workload]
        if package is not None and importlib.util.find_spec(package) is None:
            print(f"skipping {workload}: {package} is not installed")
            continue
        probe = env_fn()
        action_space = probe.action_space
        probe.close()
        for num_envs in args.envs:
            rows = []
            for name, make_venv in vectorizers(workload, num_envs).items():
                if args.only and name != "DummyVecEnv" and name not in args.only:
                    continue
                if make_venv is None:
                    row = measure_ideal(env_fn, action_space, num_envs, args.seconds)
                else:
                    row = measure(make_venv, action_space, num_envs, args.seconds)
                row.update(workload=workload, env=TITLES[workload], num_envs=num_envs, vec_env=name)
                rows.append(row)
                busy = " ".join(f"{b:.0%}" for b in row["worker_busy"])
                print(
                    f"{TITLES[workload]:27s} {num_envs:3d} envs  {name:20s} {row['steps_per_s']:9.0f} steps/s"
                    f"  learner {row['learner_cpu_us_per_step']:7.0f} µs/step  workers busy [{busy}]"
                    f"  construct {row['construct_s']:5.2f} s",
                    flush=True,
                )
            dummy = next(row["steps_per_s"] for row in rows if row["vec_env"] == "DummyVecEnv")
            ideal = next((row["steps_per_s"] for row in rows if row["vec_env"] == "ideal"), float("nan"))
            for row in rows:
                row["vs_dummy"] = row["steps_per_s"] / dummy
                row["vs_ideal"] = row["steps_per_s"] / ideal
            results += rows

    print()
    print("| env | envs | vec env | steps/s | vs Dummy | vs ideal | learner µs/step | workers busy | construct (s) |")
    print("|---|---:|---|---:|---:|---:|---:|---|---:|")
    for row in results:
        busy = " ".join(f"{b:.0%}" for b in row["worker_busy"]) or "—"
        learner = "—" if np.isnan(row["learner_cpu_us_per_step"]) else f"{row['learner_cpu_us_per_step']:,.0f}"
        print(
            f"| {row['env']} | {row['num_envs']} | {row['vec_env']} | {row['steps_per_s']:,.0f} | {row['vs_dummy']:.2f}x |"
            f" {row['vs_ideal']:.2f} | {learner} | {busy} | {row['construct_s']:.2f} |"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as file:
        machine = {"cpus": CORES, "python": platform.python_version(), "platform": platform.platform()}
        json.dump({"machine": machine, "seconds": args.seconds, "results": results}, file, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
