"""Central inference against worker-side rollouts as the network between learner and workers gets slower.

With **central inference** (``ClusterVecEnv`` + a policy forward on the learner) every env step is a
round trip learner -> workers -> learner, so steps/s fall as 1 / (round trip + step time). With
**worker-side rollouts** (``EnvPool.deploy`` + ``rollout``) the workers act with their own copy of the
policy and send back whole segments: one round trip per ``n_steps`` steps. This benchmark measures
both, with the same envs and the same small policy, on whatever network the worker ranks sit behind.

Run it as rank 0 of an MPI job whose other ranks are workers (one pool per job, so one latency per
run); ``--json`` merges the run into a results file, one entry per ``--label``::

    mpiexec -hosts learner,w1,w2 -n 1 python benchmarks/cluster_latency.py --label "delay 1 ms" \\
        --delay-ms 1 --json benchmarks/results/cluster_latency.json : -n 2 python -m clusterenv_core.worker mpi

``bash tests/cluster/netns.sh bench`` does that for netem delays of 0, 1 and 5 ms on the worker hosts'
links (network namespaces on this machine) and writes benchmarks/results/cluster_latency.json.
Without mpiexec (``python benchmarks/cluster_latency.py``) the worker ranks are spawned on this host.

Measured, each for ``--seconds``:

- ``central_steps_per_s``: env steps/s of the loop ``actions = policy(obs); obs = venv.step(actions)``
  (``central_step_ms``: one iteration);
- ``rollout_steps_per_s``: env steps/s of back-to-back ``actors.rollout(n_steps)`` calls, policy on the
  workers (``rollout_segment_ms``: one segment of ``n_steps`` x ``num_envs`` steps);
- ``ratio``: rollout / central steps/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gymnasium as gym  # noqa: E402
import measuring  # noqa: E402
import torch  # noqa: E402

from clusterenv_core.policy import Categorical  # noqa: E402
from clusterenv_sb3 import ClusterVecEnv  # noqa: E402

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


class MLPPolicy(torch.nn.Module):
    """A small actor-critic for CartPole (4 -> 64 -> 64 -> 2 actions + 1 value), deployable on workers."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh())
        self.logits = torch.nn.Linear(64, 2)
        self.value = torch.nn.Linear(64, 1)

    def act(self, obs):
        hidden = self.body(obs)
        dist = torch.distributions.Categorical(logits=self.logits(hidden))
        actions = dist.sample()
        return {"actions": actions, "log_probs": dist.log_prob(actions), "values": self.value(hidden).squeeze(-1)}

    def action_dist(self, obs):
        return Categorical(self.logits(self.body(obs)))


def central(venv: ClusterVecEnv, policy: MLPPolicy, seconds: float, max_steps: int) -> tuple[float, float]:
    """(env steps/s, ms per step) of central inference."""
    obs = venv.reset()
    for _ in range(10):  # warm-up
        with torch.no_grad():
            obs, *_ = venv.step(policy.act(torch.as_tensor(obs))["actions"].numpy())
    steps = 0
    started = time.perf_counter()
    deadline = started + seconds
    while steps < max_steps and time.perf_counter() < deadline:
        with torch.no_grad():
            actions = policy.act(torch.as_tensor(obs))["actions"].numpy()
        obs, _, _, _ = venv.step(actions)
        steps += 1
    elapsed = time.perf_counter() - started
    return steps * venv.num_envs / elapsed, 1e3 * elapsed / steps


def rollouts(venv: ClusterVecEnv, policy: MLPPolicy, n_steps: int, seconds: float, max_segments: int) -> tuple[float, float]:
    """(env steps/s, ms per segment) of worker-side rollouts."""
    pool = venv.pool
    actors = pool.deploy(policy, seed=0)
    actors.rollout(n_steps)  # warm-up: workers import torch and build their policy copy
    segments = 0
    started = time.perf_counter()
    deadline = started + seconds
    while segments < max_segments and time.perf_counter() < deadline:
        actors.rollout(n_steps)
        segments += 1
    elapsed = time.perf_counter() - started
    return segments * n_steps * pool.num_envs / elapsed, 1e3 * elapsed / segments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="", help="name of this run in the results file (default: the delay)")
    parser.add_argument("--delay-ms", type=float, default=None, help="the added one-way delay, for the record")
    parser.add_argument("--rtt-ms", type=float, default=None, help="a measured network round trip, for the record")
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2, help="worker ranks to spawn when not under mpiexec")
    parser.add_argument("--n-steps", type=int, default=128, help="steps per env in one rollout segment")
    parser.add_argument("--seconds", type=float, default=3.0, help="time per mode")
    parser.add_argument("--json", default=None, help="merge the result into this JSON file")
    parser.add_argument("--setup", default=None, help="how learner and workers are connected, for the record")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    from mpi4py import MPI

    world = MPI.COMM_WORLD.Get_size()
    num_workers = world - 1 if world > 1 else args.workers
    started = time.perf_counter()
    venv = ClusterVecEnv([CARTPOLE] * args.num_envs, backend="mpi", num_workers=num_workers, timeout=60.0)
    try:
        hosts = list(venv.pool._transport.hosts)
        start_s = time.perf_counter() - started
        policy = MLPPolicy()
        venv.seed(0)
        central_sps, step_ms = central(venv, policy, args.seconds, max_steps=200_000)
        rollout_sps, segment_ms = rollouts(venv, policy, args.n_steps, args.seconds, max_segments=10_000)
    finally:
        venv.close()

    label = args.label or (f"delay {args.delay_ms:g} ms" if args.delay_ms is not None else "this network")
    result = {
        "label": label,
        "delay_ms": args.delay_ms,
        "rtt_ms": args.rtt_ms,
        "central_steps_per_s": round(central_sps),
        "central_step_ms": round(step_ms, 3),
        "rollout_steps_per_s": round(rollout_sps),
        "rollout_segment_ms": round(segment_ms, 2),
        "ratio": round(rollout_sps / central_sps, 2),
        "worker_hosts": hosts,
        "pool_start_s": round(start_s, 2),
        "load_average": [round(load, 2) for load in os.getloadavg()],
    }
    print(
        f"{label}: central {central_sps:,.0f} steps/s ({step_ms:.2f} ms a step), worker-side rollouts "
        f"{rollout_sps:,.0f} steps/s ({segment_ms:.1f} ms a {args.n_steps}-step segment): x{rollout_sps / central_sps:.1f}",
        flush=True,
    )
    measuring.print_result(result)  # the marked line tests/cluster/netns.sh looks for
    if args.json:
        merge(args.json, result, args)


def merge(path: str, result: dict, args: argparse.Namespace) -> None:
    data = {}
    if os.path.exists(path):
        with open(path) as file:
            data = json.load(file)
    data["benchmark"] = "benchmarks/cluster_latency.py"
    data["config"] = {
        "env": "CartPole-v1",
        "num_envs": args.num_envs,
        "num_workers": len(result["worker_hosts"]),
        "n_steps": args.n_steps,
        "seconds_per_mode": args.seconds,
        "policy": "MLP 4-64-64-2 (+value), torch, 1 thread, sampling",
    }
    data["machine"] = measuring.machine()
    if args.setup:
        data["setup"] = args.setup
    runs = [run for run in data.get("runs", []) if run.get("label") != result["label"]]
    runs.append(result)
    runs.sort(key=lambda run: (run.get("delay_ms") is None, run.get("delay_ms") or 0.0, run["label"]))
    data["runs"] = runs
    measuring.write_json(path, data)


if __name__ == "__main__":
    main()
