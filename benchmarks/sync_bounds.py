"""What bounds a synchronous step on this machine: ClusterVecEnv beside the designs that bracket it.

    python benchmarks/sync_bounds.py [--workloads halfcheetah cartpole] [--envs 16 32] [--seconds 60]
                                     [--extra-envs 0 1 2 3] [--learner-delay-us 10 20]
                                     [--json benchmarks/results/sync_bounds.json]

Every configuration steps the same envs with the same random actions:

- ``DummyVecEnv``: the baseline, one process.
- ``ClusterVecEnv``: the learner beside one worker per core; on two cores, three processes.
- **bare three processes**: the same processes and the same waits as ``ClusterVecEnv`` (the first
  worker polls for its next step, the second sleeps until woken, the learner sleeps until the
  last reply) and nothing else: actions and observations in shared memory, one byte each way, no
  rewards, flags, infos or checks. What separates ``ClusterVecEnv`` from it is ClusterEnv's own
  work per step; what separates it from the lockstep pair is the learner being a third process.
- **learner steps a block**: the learner steps ``num_envs / cores`` envs itself in a
  ``DummyVecEnv`` while spinning ClusterEnv workers step the rest: one process per core, at the
  price of the isolation ClusterEnv exists for (an env in the learner can hang it with no
  timeout, crash it, or catch its Ctrl-C), so ClusterEnv does not do it.
- **lockstep pair**: two processes, each stepping its half of the envs, meeting at a shared-memory
  barrier after every step, with the learner out of the loop: the limit of any synchronous step
  on two cores.

Two probes of where ClusterVecEnv's time goes, on request:

- ``--learner-delay-us D``: **ClusterVecEnv, learner +D µs**, the same with D µs of busy work added
  to every ``step_wait``: what a microsecond of the learner's work costs a step.
- ``--extra-envs K``: **blocks A/B**, the two workers of a two-core pool with uneven blocks (the
  polling worker, which has a core of its own, takes K envs more than half): two one-worker
  ClusterVecEnvs, one polling and one sleeping, stepped as one pool steps its workers. Give 0 as
  well: the even split of the same construction is what the others compare with.

The machine's speed drifts within seconds, so the configurations take turns in chunks of 100
steps (each after 10 unmeasured ones) for ``--seconds`` per workload: all share the same drift.
Each round of turns goes in a new random order (seeded): in a fixed order, three identical
ClusterVecEnvs measured 1.33x, 1.34x and 1.36x DummyVecEnv by their place in the round.
The table gives each configuration's steps/s over all its chunks, its ratio to DummyVecEnv, and
the median and quartiles of the per-chunk ratios (each chunk against DummyVecEnv's in its round).
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import random
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import measuring
import numpy as np
from stable_baselines3.common.vec_env import DummyVecEnv
from throughput import CORES, TITLES, WORKLOADS, Lockstep

from clusterenv_sb3 import ClusterVecEnv

CHUNK_STEPS = 100
WARMUP_STEPS = 10
WORKER_SPIN = 5e-4  # seconds the first worker polls for its next step, as ClusterEnv's local backend


def _shared_arrays(num_envs: int, env: gym.Env) -> tuple[mmap.mmap, np.ndarray, np.ndarray]:
    """Actions and observations of ``num_envs`` envs in one anonymous shared mapping (kept by fork)."""
    obs_space, act_space = env.observation_space, env.action_space
    obs_shape, act_shape = (num_envs, *obs_space.shape), (num_envs, *act_space.shape)
    obs_bytes = int(np.prod(obs_shape)) * np.dtype(obs_space.dtype).itemsize
    act_bytes = int(np.prod(act_shape)) * np.dtype(act_space.dtype).itemsize
    memory = mmap.mmap(-1, obs_bytes + act_bytes)
    obs = np.frombuffer(memory, dtype=obs_space.dtype, count=int(np.prod(obs_shape))).reshape(obs_shape)
    actions = np.frombuffer(memory, dtype=act_space.dtype, count=int(np.prod(act_shape)), offset=obs_bytes)
    return memory, obs, actions.reshape(act_shape)


def _step_rows(envs: list, rows: range, actions: np.ndarray, obs: np.ndarray) -> None:
    for row, env in zip(rows, envs):
        observation, _, terminated, truncated, _ = env.step(actions[row])
        if terminated or truncated:
            observation, _ = env.reset()
        obs[row] = observation


def _bare_worker(env_fn: Callable, rows: range, obs: np.ndarray, actions: np.ndarray, sock: socket.socket, spin: float) -> None:
    envs = [env_fn() for _ in rows]
    for row, env in zip(rows, envs):
        obs[row], _ = env.reset(seed=row)
    sock.send(b"r")
    while True:
        message = None
        deadline = time.perf_counter() + spin
        while spin and message is None:
            try:
                message = sock.recv(1, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() > deadline:
                    break
        if message is None:
            message = sock.recv(1)
        if message != b"s":
            return
        _step_rows(envs, rows, actions, obs)
        sock.send(b"d")


class BareThreeProcesses:
    """ClusterVecEnv's processes and waits with nothing else: one worker per core, the first polling."""

    def __init__(self, env_fns: list[Callable[[], gym.Env]]) -> None:
        probe = env_fns[0]()
        self.memory, self.obs, self.actions = _shared_arrays(len(env_fns), probe)
        probe.close()
        context = multiprocessing.get_context("fork")
        self.sockets, self.processes = [], []
        for worker, rows in enumerate(np.array_split(np.arange(len(env_fns)), CORES)):
            mine, theirs = socket.socketpair()
            spin = WORKER_SPIN if worker < CORES - 1 else 0.0
            block = range(int(rows[0]), int(rows[-1]) + 1)
            args = (env_fns[block.start], block, self.obs, self.actions, theirs, spin)
            process = context.Process(target=_bare_worker, args=args, daemon=True)
            process.start()
            theirs.close()
            mine.recv(1)  # its envs are built
            self.sockets.append(mine)
            self.processes.append(process)

    def reset(self) -> np.ndarray:
        return self.obs.copy()

    def step(self, actions: np.ndarray) -> np.ndarray:
        self.actions[...] = actions
        for sock in self.sockets:
            sock.send(b"s")
        for sock in reversed(self.sockets):  # the sleeping worker answers last, as in ClusterVecEnv
            sock.recv(1)
        return self.obs.copy()

    def close(self) -> None:
        for sock in self.sockets:
            sock.send(b"q")
        for process in self.processes:
            process.join(timeout=10)


class LearnerStepsABlock:
    """The learner's own block in a ``DummyVecEnv`` beside ClusterEnv workers for the others."""

    def __init__(self, env_fns: list[Callable[[], gym.Env]]) -> None:
        self.split = len(env_fns) // CORES
        self.own = DummyVecEnv(env_fns[: self.split])
        workers = CORES - 1
        self.remote = ClusterVecEnv(env_fns[self.split :], num_workers=workers, spinning_workers=workers)

    def reset(self) -> np.ndarray:
        return np.concatenate([self.own.reset(), self.remote.reset()])

    def step(self, actions: np.ndarray) -> tuple:
        self.remote.step_async(actions[self.split :])
        own = self.own.step(actions[: self.split])
        remote = self.remote.step_wait()
        return (*(np.concatenate(pair) for pair in zip(own[:3], remote[:3])), own[3] + remote[3])

    def close(self) -> None:
        self.own.close()
        self.remote.close()


class DelayedClusterVecEnv(ClusterVecEnv):
    """ClusterVecEnv with ``delay`` seconds of busy work added to every ``step_wait``."""

    def __init__(self, env_fns: list[Callable[[], gym.Env]], delay: float) -> None:
        super().__init__(env_fns)
        self.delay = delay

    def step_wait(self) -> tuple:
        result = super().step_wait()
        until = time.perf_counter() + self.delay
        while time.perf_counter() < until:
            pass
        return result


class UnevenBlocks:
    """A two-core pool's two workers with blocks of any sizes: a polling and a sleeping one-worker
    ClusterVecEnv, started in that order and the sleeping one waited for first, as a pool does."""

    def __init__(self, env_fns: list[Callable[[], gym.Env]], first: int) -> None:
        self.first = first
        self.polling = ClusterVecEnv(env_fns[:first], num_workers=1, spinning_workers=1)
        self.sleeping = ClusterVecEnv(env_fns[first:], num_workers=1, spinning_workers=0)

    def reset(self) -> np.ndarray:
        return np.concatenate([self.polling.reset(), self.sleeping.reset()])

    def step(self, actions: np.ndarray) -> tuple:
        self.polling.step_async(actions[: self.first])
        self.sleeping.step_async(actions[self.first :])
        second = self.sleeping.step_wait()
        first = self.polling.step_wait()
        return (*(np.concatenate(pair) for pair in zip(first[:3], second[:3])), first[3] + second[3])

    def close(self) -> None:
        self.polling.close()
        self.sleeping.close()


def _chunk(venv: Any, actions: list[np.ndarray], start: int) -> float:
    """Seconds for ``CHUNK_STEPS`` steps of ``venv``, after ``WARMUP_STEPS`` unmeasured ones."""
    if isinstance(venv, Lockstep):
        venv.run(WARMUP_STEPS)
        return venv.run(CHUNK_STEPS)
    for step in range(WARMUP_STEPS):
        venv.step(actions[(start + step) % len(actions)])
    started = time.perf_counter()
    for step in range(CHUNK_STEPS):
        venv.step(actions[(start + step) % len(actions)])
    return time.perf_counter() - started


def measure(
    workload: str, num_envs: int, seconds: float, extra_envs: Sequence[int] = (), learner_delays_us: Sequence[float] = ()
) -> list[dict]:
    env_fns = [WORKLOADS[workload][0]] * num_envs
    actions = measuring.random_actions(env_fns[0]().action_space, num_envs, 64)
    makers: dict[str, Callable[[], Any]] = {
        "DummyVecEnv": lambda: DummyVecEnv(env_fns),
        "ClusterVecEnv": lambda: ClusterVecEnv(env_fns),
        "bare three processes": lambda: BareThreeProcesses(env_fns),
        "learner steps a block": lambda: LearnerStepsABlock(env_fns),
        "lockstep pair": lambda: Lockstep(env_fns, actions),
    }
    for delay in learner_delays_us:
        makers[f"ClusterVecEnv, learner +{delay:g} µs"] = lambda delay=delay: DelayedClusterVecEnv(env_fns, delay * 1e-6)
    for extra in extra_envs:
        first = num_envs // 2 + extra
        makers[f"blocks {first}/{num_envs - first}"] = lambda first=first: UnevenBlocks(env_fns, first)
    venvs: dict[str, Any] = {}
    try:
        for name, make in makers.items():
            venvs[name] = make()
            if not isinstance(venvs[name], Lockstep):
                venvs[name].reset()
        chunks: dict[str, list[float]] = {name: [] for name in venvs}
        order, shuffle = list(venvs), random.Random(0).shuffle
        deadline, start = time.perf_counter() + seconds, 0
        while time.perf_counter() < deadline:
            shuffle(order)
            for name in order:
                chunks[name].append(_chunk(venvs[name], actions, start))
            start += CHUNK_STEPS
    finally:
        for venv in venvs.values():
            venv.close()
    dummy = np.array(chunks["DummyVecEnv"])
    rows = []
    for name, times in chunks.items():
        times = np.array(times)
        per_chunk = dummy / times  # a chunk's speed relative to the DummyVecEnv chunk of its round
        rows.append({
            "workload": workload,
            "env": TITLES[workload],
            "num_envs": num_envs,
            "config": name,
            "chunks": len(times),
            "steps_per_s": len(times) * CHUNK_STEPS * num_envs / times.sum(),
            "vs_dummy": dummy.sum() / times.sum(),
            "chunk_ratio_quartiles": np.percentile(per_chunk, [25, 50, 75]).tolist(),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["halfcheetah", "cartpole"], choices=list(WORKLOADS))
    parser.add_argument("--envs", type=int, nargs="+", default=[16, 32], help="one count per workload, in order")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of turns per workload")
    parser.add_argument("--extra-envs", type=int, nargs="*", default=[],
                        help="uneven blocks: envs the polling worker takes beyond half (give 0 too)")
    parser.add_argument("--learner-delay-us", type=float, nargs="*", default=[],
                        help="ClusterVecEnv with this much busy work added to every step_wait")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "sync_bounds.json"))
    args = parser.parse_args()
    if CORES != 2:
        raise SystemExit(f"the bounds are measured for two cores; this machine has {CORES}")

    results = []
    for workload, num_envs in zip(args.workloads, args.envs):
        rows = measure(workload, num_envs, args.seconds, args.extra_envs, args.learner_delay_us)
        results += rows
        for row in rows:
            print(f"{row['env']:16s} {num_envs:3d} envs  {row['config']:30s} {row['steps_per_s']:9.0f} steps/s", flush=True)

    print()
    print("| env | envs | configuration | steps/s | vs DummyVecEnv | per-chunk ratio: median (quartiles) |")
    print("|---|---:|---|---:|---:|---|")
    for row in results:
        low, median, high = row["chunk_ratio_quartiles"]
        print(
            f"| {row['env']} | {row['num_envs']} | {row['config']} | {row['steps_per_s']:,.0f} |"
            f" {row['vs_dummy']:.2f}x | {median:.2f}x ({low:.2f}–{high:.2f}) |"
        )
    record = {"cores": CORES, "seconds": args.seconds, "chunk_steps": CHUNK_STEPS, "results": results}
    measuring.write_json(args.json, record)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
