"""Steps per second of vectorized environments on the workloads people distribute, all in one run.

    python benchmarks/throughput.py [--seconds 2] [--rounds 3] [--workloads cartpole busy pong halfcheetah]
                                    [--envs 8 16 32] [--json benchmarks/results/throughput.json]

Workloads: CartPole-v1; CartPole whose step busy-waits 200 µs (a stand-in for a costly simulator);
Pong with SB3's ``AtariWrapper`` (``PongNoFrameskip-v4``, 84x84 frames); HalfCheetah-v5 (MuJoCo).
Vectorizers: SB3's ``DummyVecEnv`` (one process) and ``SubprocVecEnv`` (fork), gymnasium's
``SyncVectorEnv`` and ``AsyncVectorEnv``, ``ClusterVectorEnv`` (the CleanRL adapter, which
``SyncVectorEnv`` users compare with), ``ClusterVecEnv`` (local backend, one worker per core; again with
``inline_worker=True``, the last block stepped in the learner's process; the MPI backend with 2
spawned ranks when mpi4py is installed), EnvPool (native C++ of the same task, where it has it and
is installed: ``pip install envpool``; its Pong does its own preprocessing), and **ideal**: one
process per core, each stepping its share of the envs with no coordination at all, the machine's
limit for these Python envs; and **lockstep**: the same processes, each waiting after every step
until all have stepped (a spin on shared memory, no message; ``sync_bounds.py``'s "lockstep pair"):
what the barrier of a synchronous step costs by itself on this machine, where the cores' speeds
differ and vary, before any message, copy or adapter: the ceiling of a synchronous step over even
blocks here.

Per configuration: env steps/s and the ratios to DummyVecEnv, ideal and lockstep; the learner's CPU per
vector step (µs; for EnvPool it includes its threads); each worker process's busy fraction (CPU
seconds over wall seconds while stepping), which shows where a synchronous step loses the machine;
and the construction time (build and first reset). Random actions are drawn before timing. The
machine is noisy, so every configuration is measured ``--rounds`` times, interleaved (each round
starts at another vectorizer); the table shows medians, and each ratio is the median of the
per-round ratios with its range. Compare ratios within one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import mmap
import multiprocessing
import os
import queue
import time
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import measuring
import numpy as np
from benchmark_envs import BusyCartPole
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

from clusterenv_cleanrl import ClusterVectorEnv
from clusterenv_core import LearnerThreadsWarning
from clusterenv_sb3 import ClusterVecEnv

# Random actions: torch is imported (by SB3) but never runs here, so its threads cannot get in the way.
warnings.filterwarnings("ignore", category=LearnerThreadsWarning)

HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
HAVE_ENVPOOL = importlib.util.find_spec("envpool") is not None
CORES = os.cpu_count() or 1


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


def _worker_pids(venv: Any) -> list[int]:
    if isinstance(venv, (ClusterVecEnv, ClusterVectorEnv)):
        return venv.pool.worker_pids
    processes = getattr(venv, "processes", None) or []
    return [process.pid for process in processes]


def _envpool_vec(task: str, num_envs: int) -> Any:
    import envpool

    return envpool.make_gymnasium(task, num_envs=num_envs, batch_size=num_envs, num_threads=CORES, seed=0)


def _core_shares(num_envs: int) -> list[range]:
    """The envs of each of one process per core, as even as they split."""
    return [range(part[0], part[-1] + 1) for part in np.array_split(np.arange(num_envs), min(CORES, num_envs))]


def measure(make_venv: Callable[[], Any], action_space: gym.Space, num_envs: int, seconds: float) -> dict:
    """Step the vector env ``make_venv()`` builds with random actions for ``seconds``."""
    started = time.perf_counter()
    venv = make_venv()
    venv.reset()
    construct = time.perf_counter() - started
    actions = measuring.random_actions(action_space, num_envs, 256)
    try:
        timing = measuring.time_steps(venv.step, actions, seconds, warmup=20, chunk=16, worker_pids=_worker_pids(venv))
    finally:
        venv.close()
    return {
        "construct_s": construct,
        "steps_per_s": timing.steps_per_s,
        "step_us": timing.step_us,
        "learner_cpu_us_per_step": timing.learner_us,
        "worker_busy": timing.worker_busy,
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
    cpu, steps = measuring.process_cpu_seconds(os.getpid()), 0
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        step_all(actions[steps % 256])
        steps += 1
    elapsed = time.perf_counter() - started
    results.put((steps * num_envs / elapsed, (measuring.process_cpu_seconds(os.getpid()) - cpu) / elapsed))


def _lockstep_worker(env_fn: Callable, rows: range, index: int, counts: np.ndarray, actions: list, conn: Any) -> None:
    envs = [env_fn() for _ in rows]
    for row, env in zip(rows, envs):
        env.reset(seed=row)
    done = 0
    while True:
        steps = conn.recv()
        if steps is None:
            return
        started = time.perf_counter()
        for _ in range(steps):
            for env, action in zip(envs, actions[done % len(actions)][rows.start : rows.stop]):
                _, _, terminated, truncated, _ = env.step(action)
                if terminated or truncated:
                    env.reset()
            done += 1
            counts[index] = done
            while counts.min() < done:  # the barrier: every core stays busy, so spinning is cheap here
                pass
        conn.send(time.perf_counter() - started)


class Lockstep:
    """One process per core stepping its share of the envs, a spin barrier after every step, no
    learner: the ceiling of a synchronous step over even blocks on this machine."""

    def __init__(self, env_fns: list[Callable[[], gym.Env]], actions: list[np.ndarray]) -> None:
        shares = _core_shares(len(env_fns))
        self.memory = mmap.mmap(-1, 8 * len(shares))
        counts = np.frombuffer(self.memory, dtype=np.int64)
        context = multiprocessing.get_context("fork")
        self.pipes, self.processes = [], []
        for index, rows in enumerate(shares):
            mine, theirs = context.Pipe()
            args = (env_fns[rows.start], rows, index, counts, actions, theirs)
            process = context.Process(target=_lockstep_worker, args=args, daemon=True)
            process.start()
            self.pipes.append(mine)
            self.processes.append(process)

    def run(self, steps: int) -> float:
        """Seconds for ``steps`` steps of every share (the learner sleeps meanwhile)."""
        for pipe in self.pipes:
            pipe.send(steps)
        return max(pipe.recv() for pipe in self.pipes)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for process in self.processes:
            process.join(timeout=10)


def measure_ideal(env_fn: Callable, action_space: gym.Space, num_envs: int, seconds: float) -> dict:
    """One process per core, each stepping its share of the envs alone: the sum of their steps/s."""
    context = multiprocessing.get_context("fork")
    shares = [len(share) for share in _core_shares(num_envs)]
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


def measure_lockstep(env_fn: Callable, action_space: gym.Space, num_envs: int, seconds: float) -> dict:
    """:class:`Lockstep` stepped in chunks of 64 steps for ``seconds`` of its own stepping time."""
    actions = measuring.random_actions(action_space, num_envs, 256)
    started = time.perf_counter()
    lockstep = Lockstep([env_fn] * num_envs, actions)
    try:
        lockstep.run(1)  # the first step, after each process built and reset its envs
        construct = time.perf_counter() - started
        lockstep.run(20)  # warm-up
        cpu = [measuring.process_cpu_seconds(process.pid) for process in lockstep.processes]
        steps, stepping, started = 0, 0.0, time.perf_counter()
        while stepping < seconds:
            stepping += lockstep.run(64)
            steps += 64
        elapsed = time.perf_counter() - started
        busy = [
            (measuring.process_cpu_seconds(process.pid) - before) / elapsed
            for process, before in zip(lockstep.processes, cpu)
        ]
    finally:
        lockstep.close()
    return {
        "construct_s": construct,
        "steps_per_s": steps * num_envs / stepping,
        "step_us": float("nan"),
        "learner_cpu_us_per_step": float("nan"),
        "worker_busy": busy,
    }


def _measure_child(workload: str, num_envs: int, name: str, seconds: float, results) -> None:
    # The platform's start method, as in a plain script (a forkserver child inherits "forkserver").
    multiprocessing.set_start_method(None, force=True)
    env_fn = WORKLOADS[workload][0]
    probe = env_fn()
    action_space = probe.action_space
    probe.close()
    make_venv = vectorizers(workload, num_envs)[name]
    if name == "lockstep":
        results.put(measure_lockstep(env_fn, action_space, num_envs, seconds))
    elif make_venv is None:
        results.put(measure_ideal(env_fn, action_space, num_envs, seconds))
    else:
        results.put(measure(make_venv, action_space, num_envs, seconds))


def measure_isolated(context: Any, workload: str, num_envs: int, name: str, seconds: float) -> dict:
    """:func:`measure` (or :func:`measure_ideal`) of one vectorizer in a process of its own."""
    results = context.Queue()
    process = context.Process(target=_measure_child, args=(workload, num_envs, name, seconds, results))
    process.start()
    deadline = time.monotonic() + seconds + 600
    try:
        while time.monotonic() < deadline:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                if not process.is_alive() and results.empty():
                    raise RuntimeError(f"measuring {name} on {workload} with {num_envs} envs: exit code {process.exitcode}")
        raise TimeoutError(f"measuring {name} on {workload} with {num_envs} envs took over {seconds + 600:.0f} s")
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()


def summarize(rows: list[dict], dummy_rows: list[dict], ideal_rows: list[dict] | None, lockstep_rows: list[dict] | None) -> dict:
    """Medians over the rounds of one vectorizer; its ratios are taken per round, against that
    round's DummyVecEnv, ideal and lockstep, so a round the machine ran slow for everyone cancels out."""
    ratios = [row["steps_per_s"] / dummy["steps_per_s"] for row, dummy in zip(rows, dummy_rows)]
    of_ideal = [row["steps_per_s"] / ideal["steps_per_s"] for row, ideal in zip(rows, ideal_rows or [])]
    of_lockstep = [row["steps_per_s"] / lockstep["steps_per_s"] for row, lockstep in zip(rows, lockstep_rows or [])]
    busy = np.median([row["worker_busy"] for row in rows], axis=0).tolist() if rows[0]["worker_busy"] else []
    return {
        "construct_s": float(np.median([row["construct_s"] for row in rows])),
        "steps_per_s": float(np.median([row["steps_per_s"] for row in rows])),
        "step_us": float(np.median([row["step_us"] for row in rows])),
        "learner_cpu_us_per_step": float(np.median([row["learner_cpu_us_per_step"] for row in rows])),
        "worker_busy": busy,
        "vs_dummy": float(np.median(ratios)),
        "vs_dummy_range": [min(ratios), max(ratios)],
        "vs_ideal": float(np.median(of_ideal)) if of_ideal else float("nan"),
        "vs_lockstep": float(np.median(of_lockstep)) if of_lockstep else float("nan"),
        "rounds": rows,
    }


def vectorizers(workload: str, num_envs: int) -> dict[str, Callable[[], Any] | None]:
    env_fn, envpool_task, _ = WORKLOADS[workload]
    env_fns = [env_fn] * num_envs
    makers: dict[str, Callable[[], Any] | None] = {
        "DummyVecEnv": lambda: DummyVecEnv(env_fns),
        "SubprocVecEnv(fork)": lambda: SubprocVecEnv(env_fns, start_method="fork"),
        "SyncVectorEnv": lambda: gym.vector.SyncVectorEnv(env_fns),
        "AsyncVectorEnv": lambda: gym.vector.AsyncVectorEnv(env_fns),
        "ClusterVectorEnv": lambda: ClusterVectorEnv(env_fns),
        "ClusterVecEnv": lambda: ClusterVecEnv(env_fns),
        "ClusterVecEnv(inline)": lambda: ClusterVecEnv(env_fns, inline_worker=True),
    }
    if HAVE_MPI:
        makers["ClusterVecEnv(mpi)"] = lambda: ClusterVecEnv(env_fns, backend="mpi", num_workers=min(2, num_envs))
    if HAVE_ENVPOOL and envpool_task is not None:
        makers["EnvPool (native)"] = lambda: _envpool_vec(envpool_task, num_envs)
    makers["ideal"] = None
    makers["lockstep"] = None
    return makers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per configuration and round")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--envs", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument(
        "--rounds", type=int, default=3, help="measurements of each configuration, interleaved; the table shows medians"
    )
    parser.add_argument("--only", nargs="+", default=None, help="vectorizer names to run (DummyVecEnv always runs)")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "throughput.json"))
    args = parser.parse_args()

    # Every measurement runs in a fresh process forked from a server that has only imported the
    # libraries: one long-lived process that had run every other vectorizer before measured
    # ClusterVecEnv 0.96x DummyVecEnv on HalfCheetah-16, where a run of those two alone gave 1.39x.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["gymnasium", "numpy", "stable_baselines3", "clusterenv_sb3", "clusterenv_cleanrl"])
    results = []
    for workload in args.workloads:
        _, _, package = WORKLOADS[workload]
        if package is not None and importlib.util.find_spec(package) is None:
            print(f"skipping {workload}: {package} is not installed")
            continue
        for num_envs in args.envs:
            names = [
                name
                for name in vectorizers(workload, num_envs)
                if not args.only or name == "DummyVecEnv" or name in args.only
            ]

            def progress(round_index: int, name: str, row: dict) -> None:
                busy = " ".join(f"{b:.0%}" for b in row["worker_busy"])
                print(
                    f"{TITLES[workload]:27s} {num_envs:3d} envs  {name:20s} {row['steps_per_s']:9.0f} steps/s"
                    f"  learner {row['learner_cpu_us_per_step']:7.0f} µs/step  workers busy [{busy}]"
                    f"  construct {row['construct_s']:5.2f} s  (round {round_index + 1})",
                    flush=True,
                )

            measured = measuring.measure_rounds(
                names,
                args.rounds,
                lambda name: measure_isolated(context, workload, num_envs, name, args.seconds),
                rotate=True,
                progress=progress,
            )
            rounds = dict(zip(names, measured))
            for name in names:
                row = summarize(rounds[name], rounds["DummyVecEnv"], rounds.get("ideal"), rounds.get("lockstep"))
                row.update(workload=workload, env=TITLES[workload], num_envs=num_envs, vec_env=name)
                results.append(row)

    print()
    print("| env | envs | vec env | steps/s | vs Dummy (range) | vs ideal | vs lockstep | learner µs/step | workers busy | construct (s) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---:|")
    for row in results:
        busy = " ".join(f"{b:.0%}" for b in row["worker_busy"]) or "—"
        learner = "—" if np.isnan(row["learner_cpu_us_per_step"]) else f"{row['learner_cpu_us_per_step']:,.0f}"
        low, high = row["vs_dummy_range"]
        print(
            f"| {row['env']} | {row['num_envs']} | {row['vec_env']} | {row['steps_per_s']:,.0f} |"
            f" {row['vs_dummy']:.2f}x ({low:.2f}–{high:.2f}) | {row['vs_ideal']:.2f} | {row['vs_lockstep']:.2f} | {learner} | {busy} |"
            f" {row['construct_s']:.2f} |"
        )
    record = {"machine": measuring.machine(), "seconds": args.seconds, "rounds": args.rounds, "results": results}
    measuring.write_json(args.json, record)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
