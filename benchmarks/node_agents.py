"""The learner's cost per synchronous step with node agents (``processes_per_worker``) against flat workers, on MPI spawn.

    python benchmarks/node_agents.py [--seconds 2] [--rounds 3] [--layouts 2x4 1x8 8x1]
                                     [--json benchmarks/results/node_agents.json]

A layout ``WxP`` is W workers (MPI ranks the learner spawns) of P local processes each; ``8x1`` is 8
flat ranks. Every layout steps ``--envs-per-process`` envs per process (4: 32 envs in 8 processes),
for each workload: ``noop`` (a step that returns at once: the learner's and the backend's cost
alone), ``cartpole`` (CartPole-v1) and ``busy`` (CartPole whose step busy-waits 200 us). Each
measurement runs in a fresh Python process (a training script holds one pool for its whole run);
layouts alternate within each round and the median round is reported, as the machine is shared.

Reported per workload and layout:

- ``learner_us``: the learner's CPU time (``time.process_time()``: all its threads) per pool step;
- ``steps_per_s``: env steps per second (pool steps x envs);
- ``step_us``: wall time of one pool step.

Read the ratios within one run. On a machine with fewer cores than processes the envs' own work
competes with the learner for cores: ``busy`` then measures that contention more than the backend.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmark_envs import BusyCartPole, NoopEnv

from clusterenv_core import EnvPool

WORKLOADS = {
    "noop": NoopEnv,
    "cartpole": functools.partial(gym.make, "CartPole-v1"),
    "busy": functools.partial(BusyCartPole, 200.0),
}


def parse_layout(text: str) -> tuple[int, int]:
    """``"2x4"`` -> (2 workers, 4 processes each)."""
    workers, processes = text.lower().split("x")
    return int(workers), int(processes)


def measure(workload: str, layout: str, envs_per_process: int, seconds: float, backend_options: dict) -> dict:
    """Step one pool of ``layout`` for ``seconds`` after a warm-up; the learner's CPU and wall time per step."""
    workers, processes = parse_layout(layout)
    num_envs = workers * processes * envs_per_process
    started = time.perf_counter()
    pool = EnvPool([WORKLOADS[workload]] * num_envs, backend="mpi", num_workers=workers, processes_per_worker=processes)
    construct = time.perf_counter() - started
    actions = np.random.default_rng(0).integers(0, 2, size=(256, num_envs))
    try:
        pool.reset(seeds=list(range(num_envs)))
        for i in range(100):  # warm-up
            pool.step(actions[i % 256])
        steps = 0
        cpu_started, started = time.process_time(), time.perf_counter()
        while time.perf_counter() - started < seconds:
            for i in range(32):
                pool.step(actions[(steps + i) % 256])
            steps += 32
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    finally:
        pool.close()
    return {
        "construct_s": construct,
        "steps": steps,
        "learner_us": cpu / steps * 1e6,
        "step_us": elapsed / steps * 1e6,
        "steps_per_s": steps * num_envs / elapsed,
    }


def measure_in_new_process(
    workload: str, layout: str, envs_per_process: int, seconds: float, backend_options: dict
) -> dict:
    """:func:`measure` in a fresh interpreter (this script with ``--measure``)."""
    arguments = json.dumps([workload, layout, envs_per_process, seconds, backend_options])
    command = [sys.executable, os.path.abspath(__file__), "--measure", arguments]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300 + 3 * seconds, check=False)
    if finished.returncode != 0:
        raise RuntimeError(f"measuring {workload} {layout} failed:\n{finished.stderr}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is reported")
    parser.add_argument("--layouts", nargs="+", default=["2x4", "1x8", "8x1"], help="WxP: W workers of P processes")
    parser.add_argument("--envs-per-process", type=int, default=4)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--mpi-options", type=json.loads, default={}, help="the MPI backend's options (JSON)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # measure's arguments
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(*json.loads(args.measure))))
        return

    configurations = [(workload, layout) for workload in args.workloads for layout in args.layouts]
    measured: dict[tuple[str, str], list[dict]] = {configuration: [] for configuration in configurations}
    for _ in range(args.rounds):
        for workload, layout in configurations:
            measured[workload, layout].append(
                measure_in_new_process(workload, layout, args.envs_per_process, args.seconds, args.mpi_options)
            )

    results = []
    for (workload, layout), rounds in measured.items():
        median = sorted(rounds, key=lambda m: m["learner_us"])[len(rounds) // 2]
        results.append(
            {
                "workload": workload,
                "layout": layout,
                **median,
                "learner_us_rounds": [m["learner_us"] for m in rounds],
                "steps_per_s_rounds": [m["steps_per_s"] for m in rounds],
            }
        )
    print(
        f"MPI spawn{' ' + json.dumps(args.mpi_options) if args.mpi_options else ''}, {args.envs_per_process} envs per process, median of {args.rounds} rounds of {args.seconds:g} s "
        f"(each in a fresh process); {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'workload':<9} {'layout':>6} {'learner us/step':>16} {'x flat':>7} {'steps/s':>9} {'x flat':>7} {'spread':>7}"
    )
    for result in results:
        flat = next(
            (r for r in results if r["workload"] == result["workload"] and parse_layout(r["layout"])[1] == 1), result
        )
        spread = statistics.pstdev(result["learner_us_rounds"]) / statistics.mean(result["learner_us_rounds"])
        print(
            f"{result['workload']:<9} {result['layout']:>6} {result['learner_us']:>16.0f} "
            f"{result['learner_us'] / flat['learner_us']:>7.2f} {result['steps_per_s']:>9.0f} "
            f"{result['steps_per_s'] / flat['steps_per_s']:>7.2f} {spread:>7.0%}"
        )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as file:
            json.dump(
                {
                    "backend": "mpi (spawn)",
                    "mpi_options": args.mpi_options,
                    "envs_per_process": args.envs_per_process,
                    "seconds": args.seconds,
                    "rounds": args.rounds,
                    "cpu_count": os.cpu_count(),
                    "load_average": os.getloadavg(),
                    "python": platform.python_version(),
                    "results": results,
                },
                file,
                indent=2,
            )


if __name__ == "__main__":
    main()
