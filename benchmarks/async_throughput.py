"""Asynchronous batches against synchronous steps, on envs whose step times vary.

    python benchmarks/async_throughput.py [--seconds 3] [--rounds 3] [--workloads heavy uniform hopper ant] [--mpi]

16 envs on 2 workers; asynchronous batches of 8 (one worker's block: ``pool.async_batches(8)``,
``recv`` then ``send`` to the envs it returned) against the same pool stepping all 16 envs at once
(``pool.step``), both with next-step autoreset and random actions drawn beforehand. Workloads:

- ``heavy``: CartPole whose step busy-waits 100 µs, and 10 ms on 1% of steps (a heavy tail: level
  loads, contact-rich physics, a slow node);
- ``uniform``: CartPole whose step busy-waits a uniform 0-200 µs (the same mean, no tail);
- ``hopper``, ``ant``: MuJoCo Hopper-v5 and Ant-v5, whose episodes end at different times (with
  random actions Hopper falls within tens of steps), beside EnvPool's native C++ tasks in its own
  synchronous and asynchronous modes (``envpool.make_gymnasium(..., batch_size=8)``, 2 threads).

``ideal`` is what the two modes could reach with no overhead at all: a simulation of the same step
costs, where a synchronous step lasts as long as the slower block and asynchronous workers never
wait (their ratio is the best async can do). Configurations alternate for ``--rounds`` rounds; the
median is reported. Env steps per second; writes ``benchmarks/results/async_throughput.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gymnasium as gym  # noqa: E402
import measuring  # noqa: E402
import numpy as np  # noqa: E402

from clusterenv_core import EnvPool  # noqa: E402

NUM_ENVS, NUM_WORKERS, BATCH_SIZE = 16, 2, 8


class BusyCartPole(gym.Wrapper):
    """CartPole whose step busy-waits a cost drawn by ``cost(rng)`` seconds (its own RNG)."""

    def __init__(self, workload: str, seed: int = 0) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.workload = workload
        self.rng = random.Random(seed)

    def step(self, action):
        end = time.perf_counter() + step_cost(self.workload, self.rng)
        while time.perf_counter() < end:
            pass
        return self.env.step(action)


def step_cost(workload: str, rng: random.Random) -> float:
    if workload == "heavy":
        return 10e-3 if rng.random() < 0.01 else 100e-6
    return rng.uniform(0.0, 200e-6)


def env_fns(workload: str) -> list[Callable[[], gym.Env]]:
    if workload in ("heavy", "uniform"):
        return [functools.partial(BusyCartPole, workload, seed) for seed in range(NUM_ENVS)]
    task = {"hopper": "Hopper-v5", "ant": "Ant-v5"}[workload]
    return [functools.partial(gym.make, task)] * NUM_ENVS


def simulated_ideal(workload: str, steps: int = 20000) -> float | None:
    """Async/sync steps/s ratio with no overhead, for the busy-wait workloads (None for MuJoCo)."""
    if workload not in ("heavy", "uniform"):
        return None
    rng = random.Random(0)
    block = NUM_ENVS // NUM_WORKERS
    costs = np.array([[sum(step_cost(workload, rng) for _ in range(block)) for _ in range(NUM_WORKERS)] for _ in range(steps)])
    return float(costs.max(axis=1).mean() / costs.mean())


def measure_sync(fns: list, seconds: float, backend: str) -> float:
    with EnvPool(fns, num_workers=NUM_WORKERS, autoreset_mode="next_step", backend=backend) as pool:
        pool.reset(seeds=list(range(NUM_ENVS)))
        actions = measuring.random_actions(pool.action_space, NUM_ENVS, 64)
        for index in range(20):
            pool.step(actions[index % 64])
        steps, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            pool.step(actions[steps % 64])
            steps += 1
        return steps * NUM_ENVS / (time.perf_counter() - started)


def measure_async(fns: list, seconds: float, backend: str) -> float:
    with EnvPool(fns, num_workers=NUM_WORKERS, autoreset_mode="next_step", backend=backend) as pool:
        batches = pool.async_batches(BATCH_SIZE)
        batches.reset(seeds=list(range(NUM_ENVS)))
        actions = measuring.random_actions(pool.action_space, BATCH_SIZE, 64)
        for index in range(40):
            batches.send(actions[index % 64], batches.recv().env_ids)
        recvs, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            batches.send(actions[recvs % 64], batches.recv().env_ids)
            recvs += 1
        return recvs * BATCH_SIZE / (time.perf_counter() - started)


def measure_envpool(task: str, seconds: float, batch_size: int) -> float:
    import envpool

    envs = envpool.make_gymnasium(task, num_envs=NUM_ENVS, batch_size=batch_size, num_threads=NUM_WORKERS, seed=0)
    try:
        actions = measuring.random_actions(envs.action_space, batch_size, 64)
        envs.async_reset()
        recvs, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            env_id = envs.recv()[4]["env_id"]
            envs.send(actions[recvs % 64], env_id)
            recvs += 1
        return recvs * batch_size / (time.perf_counter() - started)
    finally:
        envs.close()


def configurations(workload: str, mpi: bool) -> dict[str, Callable[[float], float]]:
    fns = env_fns(workload)
    configs: dict[str, Callable[[float], float]] = {
        "sync": functools.partial(measure_sync, fns, backend="local"),
        "async": functools.partial(measure_async, fns, backend="local"),
    }
    if mpi:
        configs["sync (mpi)"] = functools.partial(measure_sync, fns, backend="mpi")
        configs["async (mpi)"] = functools.partial(measure_async, fns, backend="mpi")
    if workload in ("hopper", "ant"):
        try:
            import envpool  # noqa: F401

            task = {"hopper": "Hopper-v5", "ant": "Ant-v5"}[workload]
            configs["envpool sync"] = functools.partial(measure_envpool, task, batch_size=NUM_ENVS)
            configs["envpool async"] = functools.partial(measure_envpool, task, batch_size=BATCH_SIZE)
        except ImportError:
            pass
    return configs


SYNC_OF = {"async": "sync", "async (mpi)": "sync (mpi)", "envpool async": "envpool sync"}

TITLES = {
    "heavy": "CartPole, 100 µs busy step, 10 ms on 1%",
    "uniform": "CartPole, uniform 0-200 µs busy step",
    "hopper": "Hopper-v5",
    "ant": "Ant-v5",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["heavy", "uniform", "hopper", "ant"], choices=sorted(TITLES))
    parser.add_argument("--mpi", action="store_true", help="also the MPI backend (spawned ranks)")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "async_throughput.json"))
    args = parser.parse_args()

    rows: list[dict[str, Any]] = []
    for workload in args.workloads:
        configs = configurations(workload, args.mpi)
        measured = measuring.measure_rounds(list(configs.values()), args.rounds, lambda run: run(args.seconds))
        samples = dict(zip(configs, measured))
        medians = {name: statistics.median(values) for name, values in samples.items()}
        ideal = simulated_ideal(workload)
        for name, value in medians.items():
            own_sync = medians[SYNC_OF.get(name, name)]  # the synchronous mode of the same implementation
            row = {
                "workload": workload,
                "config": name,
                "steps_per_s": round(value),
                "vs_own_sync": round(value / own_sync, 3),
                "vs_clusterenv_sync": round(value / medians["sync"], 3),
                "rounds": [round(sample) for sample in samples[name]],
            }
            rows.append(row)
            print(
                f"{TITLES[workload]:42} {name:14} {value:10,.0f} steps/s  {row['vs_own_sync']:5.2f}x its sync mode, "
                f"{row['vs_clusterenv_sync']:5.2f}x ClusterEnv's",
                flush=True,
            )
        if ideal is not None:
            rows.append({"workload": workload, "config": "ideal (simulated)", "vs_own_sync": round(ideal, 3)})
            print(f"{TITLES[workload]:42} {'ideal':14} {'':>10}          {ideal:5.2f}x (simulated, no overhead)")

    print()
    print("| env | configuration | steps/s | vs its sync mode | vs ClusterEnv sync |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        steps = f"{row['steps_per_s']:,}" if "steps_per_s" in row else "—"
        versus = f"{row['vs_clusterenv_sync']:.2f}x" if "vs_clusterenv_sync" in row else "—"
        print(f"| {TITLES[row['workload']]} | {row['config']} | {steps} | {row['vs_own_sync']:.2f}x | {versus} |")
    measuring.write_json(
        args.json,
        {
            "command": measuring.command(),
            "setup": f"{NUM_ENVS} envs, {NUM_WORKERS} workers, batch_size {BATCH_SIZE}, next-step autoreset, "
            f"random actions; {args.seconds:g} s x {args.rounds} rounds, median",
            "machine": measuring.machine(),
            "rows": rows,
        },
    )
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
