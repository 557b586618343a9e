"""Steps per second of the MPI backend against the local backend, measured in one run on this machine.

    python benchmarks/mpi_throughput.py [--seconds 3] [--rounds 3] [--json benchmarks/results/mpi_throughput.json]

CartPole-v1, 32 envs on 2 workers, driven through ``EnvPool.step`` with random actions drawn before
timing. The MPI pool spawns its 2 worker ranks (plain ``python``, no mpiexec needed: MPICH's
singleton init). Configurations alternate for ``--rounds`` rounds and the median round is reported,
because the machine is shared and noisy: read the ratio mpi/local within one run.

Each measurement runs in a fresh Python process, as a training script holds one pool for its whole
run. ``--same-process`` measures all of them in this process instead: there the order matters on
this 2-core machine (measured: the first MPI pool after a local one ran about 125k steps/s and the
later ones about 100k, while the local pools went from 141k to 155k), whatever the backend code.

Reported per configuration:

- ``steps_per_s``: env steps per second (pool steps x 32);
- ``step_us``: round trip of one pool step (actions out, every worker steps its 16 envs, results
  back), mean over the timed steps;
- ``rtt_us``: the same for a pool of 2 envs that do nothing (one per worker): the backend's own
  round trip;
- ``cpu_cores``: CPU used by the learner and its workers while stepping, in cores;
- ``idle_worker_cpu``: CPU used by all workers in one second in which the learner sends nothing
  (an idle pool; a worker that spins forever would show 1.0 per worker).

``--mpi-options '{"spin": 0}' ...`` adds MPI configurations with other backend options (polling).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import measuring
from benchmark_envs import NoopEnv

from clusterenv_core import EnvPool  # noqa: E402

NUM_ENVS = 32
NUM_WORKERS = 2


def measure(backend: str, options: dict, seconds: float) -> dict:
    started = time.perf_counter()
    pool = EnvPool.make(
        "CartPole-v1", num_envs=NUM_ENVS, num_workers=NUM_WORKERS, backend=backend, backend_options=options
    )
    construct = time.perf_counter() - started
    actions = np.random.default_rng(0).integers(0, 2, size=(1024, NUM_ENVS))
    try:
        pool.reset(seeds=list(range(NUM_ENVS)))
        workers = pool.worker_pids
        timing = measuring.time_steps(pool.step, actions, seconds, warmup=50, chunk=32, worker_pids=workers)
        idle_before = sum(measuring.process_cpu_seconds(pid) for pid in workers)
        time.sleep(1.0)
        idle = sum(measuring.process_cpu_seconds(pid) for pid in workers) - idle_before
    finally:
        pool.close()
    with EnvPool([NoopEnv] * NUM_WORKERS, num_workers=NUM_WORKERS, backend=backend, backend_options=options) as noop:
        noop.reset()
        zeros = np.zeros(NUM_WORKERS, dtype=np.int64)
        for _ in range(200):
            noop.step(zeros)
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < min(seconds, 1.0):
            for _ in range(100):
                noop.step(zeros)
            count += 100
        rtt = (time.perf_counter() - started) / count
    return {
        "construct_s": construct,
        "steps_per_s": timing.steps_per_s,
        "step_us": timing.step_us,
        "rtt_us": rtt * 1e6,
        "cpu_cores": (timing.cpu_seconds + sum(timing.worker_cpu_seconds)) / timing.seconds,
        "idle_worker_cpu": idle,
    }


def main() -> None:
    if measuring.measure_if_asked(measure):
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per configuration and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is reported")
    parser.add_argument("--mpi-options", type=json.loads, nargs="*", default=[], help="extra MPI option sets (JSON)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--same-process", action="store_true", help="measure every pool in this process")
    args = parser.parse_args()

    def run(backend: str, options: dict) -> dict:
        if args.same_process:
            return measure(backend, options, args.seconds)
        return measuring.measure_in_new_process(__file__, [backend, options, args.seconds], 300 + 3 * args.seconds)

    configurations = [("local", {}), ("mpi", {})] + [("mpi", options) for options in args.mpi_options]
    rounds = measuring.measure_rounds(configurations, args.rounds, lambda configuration: run(*configuration))

    results = []
    for (backend, options), measured in zip(configurations, rounds):
        median = measuring.median_round(measured, "steps_per_s")
        results.append(
            {
                "backend": backend,
                "options": options,
                **median,
                "steps_per_s_rounds": [m["steps_per_s"] for m in measured],
            }
        )
    local = results[0]["steps_per_s"]
    where = "all in this process" if args.same_process else "each in a fresh process"
    print(
        f"CartPole-v1, {NUM_ENVS} envs on {NUM_WORKERS} workers, median of {args.rounds} rounds of {args.seconds:g} s"
        f" ({where})"
    )
    names = [result["backend"] + (" " + json.dumps(result["options"]) if result["options"] else "") for result in results]
    width = max(len(name) for name in names)
    print(
        f"{'backend':<{width}} {'steps/s':>9} {'x local':>8} {'step us':>8} {'rtt us':>7} {'cores':>6} "
        f"{'idle cpu':>9} {'start s':>8}"
    )
    for name, result in zip(names, results):
        print(
            f"{name:<{width}} {result['steps_per_s']:>9.0f} {result['steps_per_s'] / local:>8.2f} "
            f"{result['step_us']:>8.0f} {result['rtt_us']:>7.0f} {result['cpu_cores']:>6.2f} "
            f"{result['idle_worker_cpu']:>9.3f} {result['construct_s']:>8.2f}"
        )
    spread = [statistics.pstdev(r["steps_per_s_rounds"]) / statistics.mean(r["steps_per_s_rounds"]) for r in results]
    print(f"round-to-round spread (stdev/mean): {', '.join(f'{s:.0%}' for s in spread)}")
    if args.json:
        measuring.write_json(
            args.json,
            {
                "env": "CartPole-v1",
                "num_envs": NUM_ENVS,
                "num_workers": NUM_WORKERS,
                "seconds": args.seconds,
                "rounds": args.rounds,
                "same_process": args.same_process,
                "cpu_count": os.cpu_count(),
                "load_average": os.getloadavg(),
                "python": platform.python_version(),
                "mpi_ratio_to_local": results[1]["steps_per_s"] / local,
                "results": results,
            },
        )


if __name__ == "__main__":
    main()
