"""What one step costs over Ray's two call paths: ordinary actor calls, which the Ray backend uses,
and a compiled graph (``ray.dag`` ... ``experimental_compile()``), which skips Ray's task machinery.

Each step sends an action batch to every actor and gathers the result rows, as the Ray backend's
step does; the actors do no work (``idle``), busy-wait (``busy``: 8 envs of 200 µs) or sleep
(``sleepy``: an env that waits on something else). Per path, actors and work: the wall time of a
step, the learner's CPU time per step (process CPU time), and the CPU an actor burns per second
while the learner sends nothing (``idle actor``: a compiled graph's actors wait for their input by
polling). Paths interleave within each round; the median of the rounds is reported.

    python benchmarks/ray_call_paths.py                  # prints a table
    python benchmarks/ray_call_paths.py --json benchmarks/results/ray_call_paths.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import measuring  # this directory's, first on sys.path when the script runs
import numpy as np
import psutil
import ray
from ray.dag import InputNode, MultiOutputNode

WORK_SECONDS = {"idle": 0.0, "busy": 0.0016, "sleepy": 0.002}
PATHS = ("calls", "compiled graph")


@ray.remote
class StepActor:
    """Returns result rows of 8 CartPole envs after ``work`` (busy-waiting or sleeping)."""

    def __init__(self, work: str) -> None:
        self.work = work

    def pid(self) -> int:
        return os.getpid()

    def step(self, actions: np.ndarray) -> list[np.ndarray]:
        seconds = WORK_SECONDS[self.work]
        if self.work == "busy":
            until = time.perf_counter() + seconds
            while time.perf_counter() < until:
                pass
        elif self.work == "sleepy":
            time.sleep(seconds)
        return [np.zeros((8, 4), np.float32), np.zeros(8), np.zeros(8, bool), np.zeros(8, bool)]


def measure(path: str, num_actors: int, work: str, steps: int) -> dict[str, float]:
    """One measurement: a fresh set of actors, a warm-up, ``steps`` timed steps, one idle second."""
    actors = [StepActor.remote(work) for _ in range(num_actors)]
    pids = ray.get([actor.pid.remote() for actor in actors])
    actions = np.zeros(8, np.int64)
    graph = None
    if path == "compiled graph":
        with InputNode() as batch:
            dag = MultiOutputNode([actor.step.bind(batch) for actor in actors])
        graph = dag.experimental_compile()

        def step() -> Any:
            return ray.get(graph.execute(actions))
    else:

        def step() -> Any:
            return ray.get([actor.step.remote(actions) for actor in actors])

    try:
        for _ in range(20):
            step()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        processes = [psutil.Process(pid) for pid in pids]
        before = [sum(process.cpu_times()[:2]) for process in processes]
        time.sleep(1.0)
        idle = statistics.mean(sum(p.cpu_times()[:2]) - b for p, b in zip(processes, before))
    finally:
        if graph is not None:
            graph.teardown()
        for actor in actors:
            ray.kill(actor)
    return {"step_us": wall / steps * 1e6, "learner_us": cpu / steps * 1e6, "idle_actor_cpu": idle}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--work", nargs="+", default=list(WORK_SECONDS), choices=list(WORK_SECONDS))
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="error", log_to_driver=False)
    cases = [(work, actors, path) for work in args.work for actors in args.actors for path in PATHS]
    rounds = measuring.measure_rounds(cases, args.rounds, lambda case: measure(case[2], case[1], case[0], args.steps))
    ray.shutdown()

    results = []
    print(f"{'work':>7} {'actors':>6} {'path':>15} {'step µs':>9} {'learner µs':>11} {'idle actor CPU':>15}")
    for (work, actors, path), measured in zip(cases, rounds):
        row = {"work": work, "actors": actors, "path": path}
        row.update({key: statistics.median(m[key] for m in measured) for key in measured[0]})
        results.append(row)
        print(
            f"{work:>7} {actors:>6} {path:>15} {row['step_us']:>9.0f} {row['learner_us']:>11.0f} "
            f"{row['idle_actor_cpu'] * 100:>14.0f}%"
        )
    if args.json:
        report = {
            "command": measuring.command(),
            "machine": measuring.machine("ray"),
            "steps": args.steps,
            "rounds": args.rounds,
            "results": results,
        }
        measuring.write_json(args.json, report)


if __name__ == "__main__":
    main()
