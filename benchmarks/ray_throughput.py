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
cluster would be up already; its start is not measured); the vectorizers alternate within each
round, in an order rotated from round to round, and the median round is reported, as the machine
may be shared. Reported per workload and vectorizer: env steps per second, the wall time of one
step of all envs, and the learner's CPU time per step (``time.process_time()``: all threads of the
learning process, Ray's own included), which grows with the actors, not with the processes behind
them (compare ``2x1`` with ``2x2``). The targets of ClusterEnv issue #49, met when a Ray layout
meets them: at least 10x ``naive`` on CartPole, and at least 0.8x ``local`` on the busy env.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCHMARKS)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCHMARKS)

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
    space = make_env(workload).action_space
    space.seed(0)
    actions = np.stack([np.stack([space.sample() for _ in range(num_envs)]) for _ in range(64)])
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
        for i in range(50):  # warm-up
            vec.step(actions[i % 64])
        steps = 0
        cpu_started, started = time.process_time(), time.perf_counter()
        while time.perf_counter() - started < seconds:
            for i in range(16):
                vec.step(actions[(steps + i) % 64])
            steps += 16
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    finally:
        vec.close()
    return {
        "construct_s": construct,
        "steps": steps,
        "steps_per_s": steps * num_envs / elapsed,
        "step_us": elapsed / steps * 1e6,
        "learner_us": cpu / steps * 1e6,
    }


def measure_in_new_process(vectorizer: str, workload: str, num_envs: int, seconds: float, options: dict) -> dict:
    """:func:`measure` in a fresh interpreter (this script with ``--measure``)."""
    arguments = json.dumps([vectorizer, workload, num_envs, seconds, options])
    command = [sys.executable, os.path.abspath(__file__), "--measure", arguments]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300 + 3 * seconds, check=False)
    if finished.returncode != 0:
        raise RuntimeError(f"measuring {vectorizer} on {workload} failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured stepping per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument(
        "--ray-layouts", nargs="+", default=None, help="WxP: W actors of P processes; default: CPUs x 1"
    )
    parser.add_argument("--json", default=os.path.join(BENCHMARKS, "results", "ray_throughput.json"))
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # measure's arguments
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(*json.loads(args.measure))), flush=True)
        return

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
    rounds: dict[tuple[str, str], list[dict]] = {}
    try:
        for number in range(args.rounds):
            for workload in workloads:
                shift = number % len(vectorizers)
                order = vectorizers[shift:] + vectorizers[:shift]
                for vectorizer in order:
                    result = measure_in_new_process(vectorizer, workload, args.envs, args.seconds, options)
                    rounds.setdefault((workload, vectorizer), []).append(result)
                    print(
                        f"round {number + 1} {workload:12s} {vectorizer:10s} {result['steps_per_s']:10.0f} steps/s",
                        flush=True,
                    )
    finally:
        ray.shutdown()

    results = []
    for (workload, vectorizer), measured in rounds.items():
        median = sorted(measured, key=lambda result: result["steps_per_s"])[len(measured) // 2]
        results.append(
            {
                "workload": workload,
                "vectorizer": vectorizer,
                **median,
                "rounds_steps_per_s": [result["steps_per_s"] for result in measured],
            }
        )
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
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as file:
            json.dump(
                {
                    "command": " ".join(["python", "benchmarks/ray_throughput.py", *sys.argv[1:]]),
                    "machine": {
                        "cpus": cpus,
                        "platform": platform.platform(),
                        "python": platform.python_version(),
                        "ray": ray.__version__,
                    },
                    "envs": args.envs,
                    "seconds": args.seconds,
                    "rounds": args.rounds,
                    "ray_layouts": layouts,
                    "results": results,
                    "ratios": ratios,
                    "targets": targets,
                },
                file,
                indent=1,
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
