"""The Ray backend's steps/s against a naive Ray vectorizer and against the local backend.

    python benchmarks/ray_throughput.py [--seconds 3] [--rounds 3] [--envs 16]
                                        [--workloads cartpole busy halfcheetah] [--ray-layouts 2x1 1x2]
                                        [--json benchmarks/results/ray_throughput.json]
    python benchmarks/ray_throughput.py --seconds 0.5 --rounds 1 --json /tmp/smoke.json    # a smoke run

Three vectorizers step the same ``--envs`` envs with actions drawn in advance:

- ``ray WxP``: ``EnvPool(backend="ray")`` with W actors of P local processes each (node agents when
  P > 1), one vectorizer per layout of ``--ray-layouts`` (default: an actor per CPU, ``2x1`` on 2
  CPUs): one Ray call per actor per step, carrying the block's actions and results;
- ``naive``: one Ray actor per env and one remote call per env per step, the results gathered with
  one ``ray.get`` (what SB3 issue #1345 proposes for a "multi-cluster SubprocVecEnv"), written here
  (:class:`NaiveRayVecEnv`), autoresetting as SB3's ``DummyVecEnv`` does;
- ``local``: ``EnvPool(backend="local")`` with its default workers (one per core).

Workloads: ``cartpole`` (CartPole-v1), ``busy`` (CartPole whose step busy-waits 200 us,
benchmarks/benchmark_envs.py) and ``halfcheetah`` (HalfCheetah-v5, when mujoco is importable).
Each measurement runs in a fresh Python process (a training script holds one vectorizer for its
whole run), connected to one Ray instance this script starts for the whole run (``ray.init``, as a
cluster would be up already; its start is not measured); one workload after the other, the
vectorizers alternate within each round, in an order rotated from round to round, and the median
round is reported, as the machine may be shared. Reported per workload and vectorizer: env steps
per second, the wall time of one step of all envs, and the learner's CPU time per step
(``time.process_time()``: all threads of the learning process, Ray's own included), which grows
with the actors, not with the processes behind them (compare ``2x1`` with ``2x2``). The targets
of ClusterEnv issue #49, met when a Ray layout meets them: at least 10x ``naive`` on CartPole, and
at least 0.8x ``local`` on the busy env.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import gymnasium as gym
import numpy as np

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCHMARKS)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCHMARKS)

import measuring  # noqa: E402
from benchmark_envs import BusyCartPole  # noqa: E402

WORKLOADS = {
    "cartpole": lambda: gym.make("CartPole-v1"),
    "busy": lambda: BusyCartPole(200.0),
    "halfcheetah": lambda: gym.make("HalfCheetah-v5"),
}


def make_env(workload: str) -> gym.Env:
    """An env of ``workload`` (a module-level function: the factories pickle by reference)."""
    return WORKLOADS[workload]()


class NaiveRayVecEnv:
    """One Ray actor per env, one remote call per env per step: the naive Ray vectorizer.

    :param env_fns: the envs' factories
    :param cpus_per_actor: the CPUs each actor reserves (a fraction: many actors share a core)
    """

    def __init__(self, env_fns: list, cpus_per_actor: float) -> None:
        import ray

        @ray.remote(num_cpus=cpus_per_actor)
        class EnvActor:
            def __init__(self, env_fn) -> None:
                self.env = env_fn()

            def reset(self, seed: int) -> np.ndarray:
                return self.env.reset(seed=seed)[0]

            def step(self, action) -> tuple:
                obs, reward, terminated, truncated, info = self.env.step(action)
                if terminated or truncated:  # DummyVecEnv's autoreset: the new episode's first observation
                    info = dict(info, terminal_observation=obs)
                    obs, _ = self.env.reset()
                return obs, reward, terminated or truncated, info

        self._ray = ray
        self.actors = [EnvActor.remote(env_fn) for env_fn in env_fns]

    def reset(self, seeds: list[int]) -> np.ndarray:
        return np.stack(self._ray.get([actor.reset.remote(seed) for actor, seed in zip(self.actors, seeds)]))

    def step(self, actions: np.ndarray) -> tuple:
        results = self._ray.get([actor.step.remote(action) for actor, action in zip(self.actors, actions)])
        obs, rewards, dones, infos = zip(*results)
        return np.stack(obs), np.array(rewards, np.float32), np.array(dones), list(infos)

    def close(self) -> None:
        for actor in self.actors:
            self._ray.kill(actor)


def parse_layout(text: str) -> tuple[int, int]:
    """``"2x4"`` -> (2 actors, 4 processes each)."""
    workers, processes = text.lower().split("x")
    return int(workers), int(processes)


def measure(vectorizer: str, workload: str, num_envs: int, seconds: float, options: dict) -> dict:
    """Step one vectorizer for ``seconds`` after a warm-up; steps/s and the learner's CPU per step."""
    import functools

    import ray

    from clusterenv_core import EnvPool

    env_fns = [functools.partial(make_env, workload)] * num_envs
    actions = measuring.random_actions(make_env(workload).action_space, num_envs, 64)
    started = time.perf_counter()
    if vectorizer == "local":
        vec = EnvPool(env_fns, backend="local")
    else:
        ray.init(address=options["address"], logging_level="warning")
        if vectorizer.startswith("ray "):
            workers, processes = parse_layout(vectorizer.removeprefix("ray "))
            vec = EnvPool(env_fns, backend="ray", num_workers=workers, processes_per_worker=processes)
        else:
            vec = NaiveRayVecEnv(env_fns, cpus_per_actor=options["cpus"] / num_envs)
    construct = time.perf_counter() - started
    try:
        if vectorizer == "naive":
            vec.reset(list(range(num_envs)))
        else:
            vec.reset(seeds=list(range(num_envs)))
        timing = measuring.time_steps(vec.step, actions, seconds, warmup=50, chunk=16)
    finally:
        vec.close()
    return {"construct_s": construct, **timing.as_dict()}


def main() -> None:
    if measuring.measure_if_asked(measure):
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured stepping per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument(
        "--ray-layouts", nargs="+", default=None, help="WxP: W actors of P processes; default: CPUs x 1"
    )
    parser.add_argument("--json", default=os.path.join(BENCHMARKS, "results", "ray_throughput.json"))
    args = parser.parse_args()

    import ray

    workloads = list(args.workloads)
    if "halfcheetah" in workloads and importlib.util.find_spec("mujoco") is None:
        print("mujoco is not importable: HalfCheetah left out")
        workloads.remove("halfcheetah")
    cpus = os.cpu_count() or 1
    layouts = args.ray_layouts or [f"{min(cpus, args.envs)}x1"]
    for layout in layouts:
        workers, processes = parse_layout(layout)
        if not 1 <= workers <= args.envs or processes < 1:
            raise SystemExit(f"bad Ray layout {layout!r}: W actors (1 to --envs) x P processes")
    ray_vectorizers = [f"ray {layout}" for layout in layouts]
    vectorizers = [*ray_vectorizers, "naive", "local"]
    # The Ray workers (started by this Ray) import the benchmark's envs and this checkout's packages.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, BENCHMARKS, os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=cpus, include_dashboard=False, logging_level="warning")
    options = {
        "address": ray.get_runtime_context().gcs_address,
        "cpus": cpus,
    }
    results = []
    try:
        for workload in workloads:
            measured = measuring.measure_rounds(
                vectorizers,
                args.rounds,
                lambda vectorizer: measuring.measure_in_new_process(
                    __file__, [vectorizer, workload, args.envs, args.seconds, options], 300 + 3 * args.seconds
                ),
                rotate=True,
                progress=lambda number, vectorizer, result: print(
                    f"round {number + 1} {workload:12s} {vectorizer:10s} {result['steps_per_s']:10.0f} steps/s",
                    flush=True,
                ),
            )
            for vectorizer, rounds in zip(vectorizers, measured):
                median = measuring.median_round(rounds, "steps_per_s")
                results.append(
                    {
                        "workload": workload,
                        "vectorizer": vectorizer,
                        **median,
                        "rounds_steps_per_s": [result["steps_per_s"] for result in rounds],
                    }
                )
    finally:
        ray.shutdown()

    by_key = {(r["workload"], r["vectorizer"]): r for r in results}
    ratios = {
        workload: {
            f"{vectorizer} vs {baseline}": by_key[workload, vectorizer]["steps_per_s"]
            / by_key[workload, baseline]["steps_per_s"]
            for vectorizer in ray_vectorizers
            for baseline in ("naive", "local")
        }
        for workload in workloads
    }
    print(f"\n{args.envs} envs; ray WxP: W actors x P processes; naive: {args.envs} actors; local: default workers")
    header = ("workload", "vectorizer", "steps/s", "step us", "learner us", "x naive", "x local")
    print("{:12s} {:10s} {:>10s} {:>9s} {:>11s} {:>8s} {:>8s}".format(*header))
    for result in results:
        workload = result["workload"]
        naive, local = by_key[workload, "naive"]["steps_per_s"], by_key[workload, "local"]["steps_per_s"]
        print(
            f"{workload:12s} {result['vectorizer']:10s} {result['steps_per_s']:10.0f} {result['step_us']:9.0f} "
            f"{result['learner_us']:11.0f} {result['steps_per_s'] / naive:8.2f} {result['steps_per_s'] / local:8.2f}"
        )
    targets = {}
    if "cartpole" in ratios:
        best = max(ratios["cartpole"][f"{vectorizer} vs naive"] for vectorizer in ray_vectorizers)
        targets["cartpole_ray_vs_naive_at_least_10x"] = best >= 10
    if "busy" in ratios:
        best = max(ratios["busy"][f"{vectorizer} vs local"] for vectorizer in ray_vectorizers)
        targets["busy_ray_vs_local_at_least_0.8x"] = best >= 0.8
    print("targets:", ", ".join(f"{name}: {'met' if met else 'NOT met'}" for name, met in targets.items()))
    if args.json:
        measuring.write_json(
            args.json,
            {
                "command": measuring.command(),
                "machine": measuring.machine("ray"),
                "envs": args.envs,
                "seconds": args.seconds,
                "rounds": args.rounds,
                "ray_layouts": layouts,
                "results": results,
                "ratios": ratios,
                "targets": targets,
            },
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
