"""Soak test: long runs must keep their speed and memory, also while envs and workers fail.

    python benchmarks/soak.py [--steps 2000000] [--failure-steps 200000] [--segment-steps 400000]
                              [--mpi-steps 1000000] [--atari-steps 200000] [--envs 32]

Phases, each on ClusterVecEnv: ``plain`` runs ``--steps`` CartPole-v1 steps; ``failures`` runs
``--failure-steps`` steps where every env raises with probability 1e-3 per step and a worker kills
itself with probability 2e-5 per env step, with ``restart_failed_envs`` and
``restart_failed_workers`` on; ``segment failures`` runs ``--segment-steps`` steps of worker-side
inference (an SB3 MLP policy deployed on the workers collects 128-step segments, and its weights
are published after each) with envs raising as before and workers killing themselves with
probability 1e-4 per env step, restarts on; ``mpi`` runs ``--mpi-steps`` CartPole steps on the MPI backend (2
spawned ranks; skipped without mpi4py); ``atari`` runs ``--atari-steps`` steps of Pong with SB3's
AtariWrapper and 4 stacked frames inside each env (4x84x84 observations through the buffers, 16
envs; skipped without ale-py). Each phase prints steps/s per tenth of the run and the resident
memory (RSS) of the learner and of the workers after warm-up (the first tenth) and at the end;
the script exits with status 1 if any of them grew by more than 5%. Results go to
benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import signal
import time
import warnings

import gymnasium as gym
import measuring
import numpy as np
import psutil

from clusterenv_core import LearnerThreadsWarning
from clusterenv_sb3 import ClusterVecEnv

# The learner's torch does next to nothing here (random actions, or a policy acting on the workers), so
# its threads cannot get in the way.
warnings.filterwarnings("ignore", category=LearnerThreadsWarning)

MAX_GROWTH = 0.05


class RandomFailures(gym.Wrapper):
    """Raises with probability ``raise_p`` per step; kills its process with probability ``kill_p``."""

    def __init__(self, raise_p: float, kill_p: float) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.raise_p, self.kill_p = raise_p, kill_p
        self.rng = np.random.default_rng()

    def step(self, action):
        draw = self.rng.random()
        if draw < self.kill_p:
            os.kill(os.getpid(), signal.SIGKILL)
        if draw < self.raise_p:
            raise RuntimeError("injected env failure")
        return self.env.step(action)


def make_stacked_pong() -> gym.Env:
    import ale_py
    from stable_baselines3.common.atari_wrappers import AtariWrapper

    gym.register_envs(ale_py)
    return gym.wrappers.FrameStackObservation(AtariWrapper(gym.make("PongNoFrameskip-v4")), 4)


def rss_mb(venv: ClusterVecEnv) -> dict:
    workers = [psutil.Process(pid).memory_info().rss for pid in venv.pool.worker_pids]
    return {"learner": psutil.Process().memory_info().rss / 2**20, "workers": sum(workers) / 2**20}


def run_phase(name: str, env_fn, num_envs: int, total_steps: int, segment_steps: int = 0, **vec_kwargs) -> dict:
    """Step ``num_envs`` envs from ``env_fn`` for ``total_steps`` steps in all: random actions, or
    with ``segment_steps`` segments of that many steps collected by the workers."""
    venv = ClusterVecEnv([env_fn] * num_envs, **vec_kwargs)
    venv.reset()
    if segment_steps:
        from stable_baselines3.common.policies import ActorCriticPolicy

        from clusterenv_sb3.policies import make_deployable

        policy = make_deployable(ActorCriticPolicy(venv.observation_space, venv.action_space, lambda _: 3e-4))
        actors = venv.pool.deploy(policy, seed=0)
        steps_per_call = num_envs * segment_steps

        def advance(call: int) -> None:
            actors.rollout(segment_steps)
            actors.publish_weights(policy)
    else:
        actions = measuring.random_actions(venv.action_space, num_envs, 1000)
        steps_per_call = num_envs

        def advance(call: int) -> None:
            venv.step(actions[call % 1000])

    calls = total_steps // steps_per_call
    tenth = max(calls // 10, 1)
    rates, memory = [], {}
    started = time.perf_counter()
    try:
        for call in range(calls):
            advance(call)
            if (call + 1) % tenth == 0:
                now = time.perf_counter()
                rates.append(tenth * steps_per_call / (now - started))
                started = now
                if len(rates) == 1:
                    memory["start"] = rss_mb(venv)
                print(f"{name}: {100 * (call + 1) // calls:3d}%  {rates[-1]:9.0f} steps/s", flush=True)
        memory["end"] = rss_mb(venv)
        restarts = dict(venv.pool.restarts)
    finally:
        venv.close()
    growth = {part: memory["end"][part] / memory["start"][part] - 1 for part in ("learner", "workers")}
    for part in ("learner", "workers"):
        print(
            f"{name}: {part} RSS {memory['start'][part]:.1f} MB after warm-up -> {memory['end'][part]:.1f} MB at the end"
            f" ({100 * growth[part]:+.2f}%)"
        )
    print(f"{name}: restarts {restarts}")
    return {"steps": calls * steps_per_call, "steps_per_s": rates, "rss_mb": memory, "growth": growth, "restarts": restarts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2_000_000)
    parser.add_argument("--failure-steps", type=int, default=200_000)
    parser.add_argument("--segment-steps", type=int, default=400_000)
    parser.add_argument("--mpi-steps", type=int, default=1_000_000)
    parser.add_argument("--atari-steps", type=int, default=200_000)
    parser.add_argument("--envs", type=int, default=32)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "soak.json"))
    args = parser.parse_args()

    results = {
        "plain": run_phase("plain", functools.partial(gym.make, "CartPole-v1"), args.envs, args.steps),
        "failures": run_phase(
            "failures",
            functools.partial(RandomFailures, raise_p=1e-3, kill_p=2e-5),
            args.envs,
            args.failure_steps,
            restart_failed_envs=True,
            restart_failed_workers=True,
            max_restarts=1_000_000,
        ),
    }
    if args.segment_steps:
        results["segment failures"] = run_phase(
            "segment failures",
            functools.partial(RandomFailures, raise_p=1e-3, kill_p=1e-4),
            args.envs,
            args.segment_steps,
            segment_steps=128,
            restart_failed_envs=True,
            restart_failed_workers=True,
            max_restarts=1_000_000,
        )
    if importlib.util.find_spec("mpi4py") is not None and args.mpi_steps:
        cartpole = functools.partial(gym.make, "CartPole-v1")
        results["mpi"] = run_phase("mpi", cartpole, args.envs, args.mpi_steps, backend="mpi", num_workers=2)
    if importlib.util.find_spec("ale_py") is not None and args.atari_steps:
        results["atari"] = run_phase("atari", make_stacked_pong, 16, args.atari_steps)
    measuring.write_json(args.json, results)
    worst = max(growth for phase in results.values() for growth in phase["growth"].values())
    verdict = "PASS" if worst <= MAX_GROWTH else "FAIL"
    print(f"\n{verdict}: largest memory growth {100 * worst:+.2f}% (limit {100 * MAX_GROWTH:.0f}%); wrote {args.json}")
    raise SystemExit(0 if verdict == "PASS" else 1)


if __name__ == "__main__":
    main()
