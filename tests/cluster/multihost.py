"""The learner of tests/cluster/netns.sh: rank 0 of an MPMD job whose worker ranks run on other hosts.

    mpiexec -hosts learner,w1,w2 -n 1 python tests/cluster/multihost.py <scenario> [--timeout S] \
        : -n 2 python -m clusterenv_core.worker mpi
    python tests/cluster/multihost.py <scenario> --spawn    # spawns its 2 worker ranks on w1 and w2

Scenarios (one per job: a world launch serves one pool):

- ``contract``: ClusterVecEnv(backend="mpi") against DummyVecEnv over 2000 steps, exactly equal;
- ``agents``: the contract with node agents: each worker rank steps its 4 envs on 2 local
  processes of its own host (``processes_per_worker=2``); prints the host and pid of every env;
- ``partition``: a step that one env on w2 spends asleep for longer than the heartbeat timeout
  succeeds (a slow step is not a lost host); steps on while the shell cuts w2's link for 1 s (must
  be survived), then steps until the lasting cut raises WorkerLostError (no heartbeat) within the
  heartbeat timeout, far sooner than the pool's timeout, and closes the pool;
- ``kill``: steps until the shell has SIGKILLed a worker rank (or the learner's whole host): the
  launcher ends the job, or (under ``mpiexec -disable-auto-cleanup``) the step raises WorkerLostError
  within the heartbeat timeout and the pool closes; spawned ranks: WorkerLostError once MPICH's
  process manager has ended the spawn.

Every pool beats every HEARTBEAT_INTERVAL and declares silence after HEARTBEAT_TIMEOUT seconds.

The shell and the learner meet through files in ``$CLUSTER_SIGNALS``: the learner creates
``ready-<phase>`` when it is stepping, the shell creates ``blip-over`` after the 1 s cut. Prints
``OK ...`` lines the shell checks; every loop is bounded in time.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

from clusterenv_core import ClusterEnvError, EnvPool, WorkerLostError, WorkerTimeoutError  # noqa: E402

STEPS = 2000
CARTPOLE = functools.partial(gym.make, "CartPole-v1")
HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 5.0
SLOW_STEP = HEARTBEAT_TIMEOUT + 3.0
SPAWN = False  # --spawn: this learner is a plain process that spawns its worker ranks on w1 and w2


def signal_file(name: str) -> str:
    return os.path.join(os.environ["CLUSTER_SIGNALS"], name)


def contract(timeout: float) -> None:
    from tests.helpers import run_side_by_side

    def report_hosts(env) -> None:
        print("HOSTS", *env.pool._transport.hosts, flush=True)

    started = time.monotonic()
    episodes, seconds = run_side_by_side(
        [CARTPOLE] * 8, STEPS, on_start=report_hosts, backend="mpi", timeout=timeout, **backend_options()
    )
    print(
        f"OK contract: {STEPS} steps x 8 envs identical, {episodes} episodes, "
        f"{STEPS / seconds:.0f} steps/s, {time.monotonic() - started:.1f} s in all",
        flush=True,
    )


def agents(timeout: float) -> None:
    from tests.envs import WhereCartPole
    from tests.helpers import run_side_by_side

    def report_where(env) -> None:
        print("HOSTS", *env.pool._transport.hosts, flush=True)
        print("ENV HOSTS", *[f"{host}:{pid}" for host, pid in env.env_method("where")], flush=True)

    started = time.monotonic()
    episodes, seconds = run_side_by_side(
        [WhereCartPole] * 8,
        STEPS,
        on_start=report_where,
        backend="mpi",
        timeout=timeout,
        processes_per_worker=2,
        **backend_options(),
    )
    print(
        f"OK agents: {STEPS} steps x 8 envs identical on 2 node agents of 2 local processes, {episodes} episodes, "
        f"{STEPS / seconds:.0f} steps/s, {time.monotonic() - started:.1f} s in all",
        flush=True,
    )


class SlowActionCartPole(gym.Wrapper):
    """CartPole with a third action: sleep ``SLOW_STEP`` seconds, then push left (a slow step)."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.action_space = gym.spaces.Discrete(3)

    def step(self, action):
        if action == 2:
            time.sleep(SLOW_STEP)
            action = 0
        return self.env.step(action)


def step_until_lost(pool: EnvPool, bound: float, scenario: str) -> None:
    """Step until a step raises WorkerTimeoutError/WorkerLostError, within ``bound`` (+2 s) of its
    start; prints ``OK <scenario> <error> after <s> s``. Bounded: 30 s more than that in all."""
    deadline = time.monotonic() + bound + 30.0
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            step(pool)
        except (WorkerTimeoutError, WorkerLostError) as error:
            waited = time.monotonic() - started
            print(
                f"OK {scenario} {type(error).__name__} after {waited:.2f} s (bound {bound:g} s, the pool's "
                f"timeout {pool.timeout:g} s): {error}",
                flush=True,
            )
            assert waited <= bound + 2.0, waited
            return
        time.sleep(0.002)
    raise AssertionError("no error within the bound")


def backend_options() -> dict:
    options = {"heartbeat_interval": HEARTBEAT_INTERVAL, "heartbeat_timeout": HEARTBEAT_TIMEOUT}
    if SPAWN:
        options.update(launch="spawn", spawn_info={"hosts": "w1,w2"})
    return options


def make_pool(timeout: float, env_fn=CARTPOLE) -> EnvPool:
    pool = EnvPool([env_fn] * 4, backend="mpi", num_workers=2, timeout=timeout, backend_options=backend_options())
    print("HOSTS", *pool._transport.hosts, flush=True)
    pool.reset(seeds=[0, 1, 2, 3])
    return pool


def step(pool: EnvPool) -> None:
    pool.step(np.zeros(pool.num_envs, dtype=np.int64))


def step_until(pool: EnvPool, done, seconds: float) -> tuple[int, float]:
    """Step until ``done()`` (checked between steps) or ``seconds`` pass; (steps, longest step)."""
    deadline = time.monotonic() + seconds
    count, longest = 0, 0.0
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {seconds:g} s")
        started = time.monotonic()
        step(pool)
        longest = max(longest, time.monotonic() - started)
        count += 1
        time.sleep(0.002)
    return count, longest


def partition(timeout: float) -> None:
    pool = make_pool(timeout, SlowActionCartPole)
    for _ in range(50):
        step(pool)
    started = time.monotonic()
    pool.step(np.array([0, 0, 2, 0]))  # env 2, on w2, sleeps: its worker beats on
    took = time.monotonic() - started
    assert SLOW_STEP <= took < timeout, took
    print(f"OK slow step: {took:.1f} s, longer than the heartbeat timeout ({HEARTBEAT_TIMEOUT:g} s)", flush=True)
    open(signal_file("ready-blip"), "w").close()
    count, longest = step_until(pool, lambda: os.path.exists(signal_file("blip-over")), 30.0)
    # Steps go on for a little while after the link is back (TCP retransmits), still fine.
    for _ in range(200):
        step(pool)
    print(f"OK blip survived: the longest of {count} steps around the 1 s cut took {longest:.2f} s", flush=True)

    open(signal_file("ready-cut"), "w").close()
    step_until_lost(pool, HEARTBEAT_TIMEOUT, "partition")
    try:
        step(pool)
    except ClusterEnvError as error:
        print(f"OK next call: {type(error).__name__}: {error}", flush=True)
    started = time.monotonic()
    pool.close()
    print(f"OK closed in {time.monotonic() - started:.2f} s", flush=True)
    print("learner: leaving", flush=True)


def kill(timeout: float) -> None:
    """Steps until a worker rank is gone. With hydra's default the launcher kills this process first;
    under ``mpiexec -disable-auto-cleanup`` the step waiting for the dead rank times out."""
    pool = make_pool(timeout)
    for _ in range(50):
        step(pool)
    open(signal_file("ready-kill"), "w").close()
    step_until_lost(pool, min(timeout, HEARTBEAT_TIMEOUT), "kill")
    started = time.monotonic()
    pool.close()
    print(f"OK closed in {time.monotonic() - started:.2f} s", flush=True)


SCENARIOS = {"contract": contract, "agents": agents, "partition": partition, "kill": kill}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--timeout", type=float, default=30.0, help="the pool's timeout, seconds")
    parser.add_argument("--spawn", action="store_true", help="spawn the worker ranks on w1 and w2 (no mpiexec)")
    args = parser.parse_args()
    SPAWN = args.spawn
    SCENARIOS[args.scenario](args.timeout)
