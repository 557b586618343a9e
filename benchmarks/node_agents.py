"""The learner's cost per synchronous step with node agents (``processes_per_worker``) against flat workers.

    python benchmarks/node_agents.py [--seconds 2] [--rounds 3] [--layouts 2x8 16x1 2x16 32x1]
                                     [--curve noop sleepy] [--json benchmarks/results/node_agents.json]
                                     [--png benchmarks/results/node_agents.png]

A layout ``WxP`` is W workers (MPI ranks the learner spawns) of P local processes each; ``8x1`` is 8
flat ranks. Every layout steps ``--envs-per-process`` envs per process (4: 32 envs in 8 processes),
for each workload: ``noop`` (a step that returns at once: the learner's and the backend's cost
alone), ``cartpole`` (CartPole-v1), ``busy`` (CartPole whose step busy-waits 200 us: the envs
compete for the cores) and ``sleepy`` (CartPole whose step sleeps 200 us: slow steps that leave the
cores idle, as on hosts with a core for each process). Each
measurement runs in a fresh Python process (a training script holds one pool for its whole run);
layouts alternate within each round and the median round is reported, as the machine is shared.

Reported per workload and layout:

- ``learner_us``: the learner's CPU time (``time.process_time()``: all its threads) per pool step;
- ``steps_per_s``: env steps per second (pool steps x envs);
- ``step_us``: wall time of one pool step.

Each layout is compared with the flat layout of as many processes (``x flat``). ``--curve W...``
also measures the workloads named over a range of process counts, flat (N ranks), as 2 agents
(2 x N/2) and as agents of 8 processes (N/8 x 8); fits the learner's cost per step to ``base +
per_worker * W + per_process * N`` for flat workers and for agents, per workload; and draws the
curves (``--png``). The fits are what the node-agent guide scales to 1,000 processes.

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
import sys
import time

import gymnasium as gym
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import measuring
from benchmark_envs import BusyCartPole, NoopEnv, SleepyCartPole

from clusterenv_core import EnvPool

WORKLOADS = {
    "noop": NoopEnv,
    "cartpole": functools.partial(gym.make, "CartPole-v1"),
    "busy": functools.partial(BusyCartPole, 200.0),
    "sleepy": functools.partial(SleepyCartPole, 200.0),
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
    pool = EnvPool(
        [WORKLOADS[workload]] * num_envs,
        backend="mpi",
        num_workers=workers,
        processes_per_worker=processes,
        backend_options=backend_options,
    )
    construct = time.perf_counter() - started
    actions = np.random.default_rng(0).integers(0, 2, size=(256, num_envs))
    try:
        pool.reset(seeds=list(range(num_envs)))
        timing = measuring.time_steps(pool.step, actions, seconds, warmup=100, chunk=32)
    finally:
        pool.close()
    return {"construct_s": construct, **timing.as_dict()}


CURVE_PROCESSES = (2, 4, 8, 16, 32)


def curve_layouts() -> list[str]:
    """Flat N x 1, two agents 2 x N/2, agents of eight N/8 x 8, for each N of :data:`CURVE_PROCESSES`."""
    layouts = [f"{n}x1" for n in (1, *CURVE_PROCESSES)]
    layouts += [f"2x{n // 2}" for n in CURVE_PROCESSES]
    layouts += [f"{n // 8}x8" for n in CURVE_PROCESSES if n >= 8]
    return list(dict.fromkeys(layouts))


def fit_costs(points: list[tuple[int, int, float]]) -> dict:
    """Least-squares ``learner_us = base + per_worker * W + per_process * N`` over ``(W, N, us)``
    points; with only flat points (W == N) the per-process term is folded into ``per_worker``."""
    workers = np.array([w for w, _, _ in points], float)
    processes = np.array([n for _, n, _ in points], float)
    cost = np.array([us for _, _, us in points], float)
    if np.array_equal(workers, processes):
        columns, names = [np.ones_like(cost), workers], ["base_us", "per_worker_us"]
    else:
        columns, names = [np.ones_like(cost), workers, processes], ["base_us", "per_worker_us", "per_process_us"]
    coefficients, *_ = np.linalg.lstsq(np.stack(columns, axis=1), cost, rcond=None)
    fit = dict(zip(names, (float(c) for c in coefficients)))
    fit.setdefault("per_process_us", 0.0)
    return fit


def plot(results: list[dict], fits: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {
        "flat: N ranks": [f"{n}x1" for n in CURVE_PROCESSES],
        "2 node agents of N/2 processes": [f"2x{n // 2}" for n in CURVE_PROCESSES],
        "node agents of 8 processes": [f"{n // 8}x8" for n in CURVE_PROCESSES if n >= 8],
    }
    fig, axes = plt.subplots(1, len(fits), figsize=(6.5 * len(fits), 4.8), squeeze=False)
    for ax, (workload, fit) in zip(axes[0], fits.items()):
        measured_us = {r["layout"]: r["learner_us"] for r in results if r["workload"] == workload}
        for (label, layouts), marker in zip(series.items(), "osD"):
            points = [(parse_layout(layout), measured_us[layout]) for layout in layouts if layout in measured_us]
            ax.plot([w * p for (w, p), _ in points], [us for _, us in points], marker=marker, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(CURVE_PROCESSES, [str(n) for n in CURVE_PROCESSES])
        ax.set_xlabel("processes stepping envs (4 envs each)")
        ax.set_ylabel("learner CPU per step (us)")
        flat, agents = fit["flat"], fit["agents"]
        ax.set_title(
            f"{workload}: flat {flat['base_us']:.0f} + {flat['per_worker_us']:.1f}/rank us;\nagents "
            f"{agents['base_us']:.0f} + {agents['per_worker_us']:.1f}/agent"
            f" + {agents['per_process_us']:.2f}/process us",
            fontsize=9,
        )
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Learner CPU per synchronous step: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if measuring.measure_if_asked(measure):
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is reported")
    parser.add_argument(
        "--layouts", nargs="+", default=["2x8", "16x1", "2x16", "32x1"], help="WxP: W workers of P processes"
    )
    parser.add_argument("--envs-per-process", type=int, default=4)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument(
        "--curve", nargs="*", default=[], choices=list(WORKLOADS), help="workloads measured over the curve's layouts"
    )
    parser.add_argument("--mpi-options", type=json.loads, default={}, help="the MPI backend's options (JSON)")
    parser.add_argument("--setup", default="MPI spawn on this machine", help="what the run measured, for the JSON")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--png", default=None, help="draw the scaling curve here (with --curve)")
    args = parser.parse_args()

    configurations = [(workload, layout) for workload in args.workloads for layout in args.layouts]
    configurations += [(workload, layout) for workload in args.curve for layout in curve_layouts()]
    configurations = list(dict.fromkeys(configurations))
    measured = measuring.measure_rounds(
        configurations,
        args.rounds,
        lambda configuration: measuring.measure_in_new_process(
            __file__, [*configuration, args.envs_per_process, args.seconds, args.mpi_options], 300 + 3 * args.seconds
        ),
    )

    results = []
    for (workload, layout), rounds in zip(configurations, measured):
        median = measuring.median_round(rounds, "learner_us")
        results.append(
            {
                "workload": workload,
                "layout": layout,
                **median,
                "learner_us_rounds": [m["learner_us"] for m in rounds],
                "steps_per_s_rounds": [m["steps_per_s"] for m in rounds],
            }
        )
    by_key = {(result["workload"], result["layout"]): result for result in results}
    print(
        f"{args.setup}{' ' + json.dumps(args.mpi_options) if args.mpi_options else ''}, {args.envs_per_process} "
        f"envs per process, median of {args.rounds} rounds of {args.seconds:g} s (each in a fresh process); "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'workload':<9} {'layout':>6} {'learner us/step':>16} {'x flat':>7} {'us/process':>11} {'steps/s':>9} "
        f"{'x flat':>7} {'spread':>7}"
    )
    for result in results:
        workers, processes = parse_layout(result["layout"])
        flat = by_key.get((result["workload"], f"{workers * processes}x1"))
        spread = statistics.pstdev(result["learner_us_rounds"]) / statistics.mean(result["learner_us_rounds"])
        learner_ratio = f"{result['learner_us'] / flat['learner_us']:>7.2f}" if flat else f"{'':>7}"
        speed_ratio = f"{result['steps_per_s'] / flat['steps_per_s']:>7.2f}" if flat else f"{'':>7}"
        print(
            f"{result['workload']:<9} {result['layout']:>6} {result['learner_us']:>16.0f} {learner_ratio} "
            f"{result['learner_us'] / (workers * processes):>11.1f} {result['steps_per_s']:>9.0f} {speed_ratio} "
            f"{spread:>7.0%}"
        )

    fits = {}
    for workload in args.curve:
        curve = [(parse_layout(r["layout"]), r["learner_us"]) for r in results if r["workload"] == workload]
        fits[workload] = {
            "flat": fit_costs([(w, w, us) for (w, p), us in curve if p == 1]),
            "agents": fit_costs([(w, w * p, us) for (w, p), us in curve if p > 1]),
        }
        for kind, fit in fits[workload].items():
            print(
                f"fit, {workload}, {kind}: learner us/step = {fit['base_us']:.1f} + {fit['per_worker_us']:.1f} x "
                f"workers + {fit['per_process_us']:.2f} x processes"
            )
    if fits and args.png:
        plot(results, fits, args.png, args.setup)
    if args.json:
        measuring.write_json(
            args.json,
            {
                "setup": args.setup,
                "command": measuring.command(),
                "mpi_options": args.mpi_options,
                "envs_per_process": args.envs_per_process,
                "seconds": args.seconds,
                "rounds": args.rounds,
                "cpu_count": os.cpu_count(),
                "load_average": os.getloadavg(),
                "python": platform.python_version(),
                "results": results,
                "fits": fits,
            },
        )


if __name__ == "__main__":
    main()
