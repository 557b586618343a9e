"""Fault scenarios of the MPI backend, one per run, in whatever launch mode this script runs in.

    python faults.py <scenario>                                                   # spawn
    mpiexec -n 1 python faults.py <scenario> : -n 2 python -m clusterenv_core.worker   # MPMD
    mpiexec -n 3 python faults.py <scenario>                                      # SPMD

Rank 0 prints ``OK <scenario> ...`` lines the tests look for, and ``WORKERS <pid> <pid>`` with the
worker ranks' pids (so a test can check they are gone). The pool is created first, so in SPMD
launches worker ranks turn into workers before anything else happens.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

from clusterenv_core import ClusterEnvError, EnvError, EnvPool, WorkerLostError, WorkerTimeoutError  # noqa: E402
from tests.envs import FailingEnv, HangingEnv, SlowCartPole, SuicidalEnv  # noqa: E402


def wrapped(wrapper, **kwargs):
    return wrapper(gym.make("CartPole-v1"), **kwargs)


CARTPOLE = functools.partial(gym.make, "CartPole-v1")


def make_pool(last_env=CARTPOLE, **kwargs) -> EnvPool:
    pool = EnvPool([CARTPOLE] * 3 + [last_env], backend="mpi", num_workers=2, **kwargs)
    print("WORKERS", *pool._transport.pids, flush=True)
    return pool


def ranks_left(pids: list[int]) -> list[int]:
    """The ranks among ``pids`` still alive after up to 3 s (a killed rank takes moments to be gone),
    printed as ``RANKS LEFT``."""
    from clusterenv_core.transports.mpi.runtime import pid_alive

    deadline = time.monotonic() + 3.0
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if pid_alive(pid)]
    print("RANKS LEFT", left, flush=True)
    return left


def step(pool: EnvPool):
    return pool.step(np.zeros(pool.num_envs, dtype=np.int64))


def env_exception() -> None:
    pool = make_pool(functools.partial(wrapped, FailingEnv, fail_at=3))
    pool.reset(seeds=[0, 1, 2, 3])
    step(pool)
    step(pool)
    try:
        step(pool)
    except EnvError as error:
        assert error.env_index == 3 and error.worker_index == 1, error
        assert "injected failure at step 3" in error.remote_traceback, error.remote_traceback
        assert "Traceback (most recent call last)" in error.remote_traceback
    else:
        raise AssertionError("no EnvError")
    # The pool stays usable and closeable.
    pool.reset(seeds=[0, 1, 2, 3])
    step(pool)
    assert pool.get_attr("total_steps", indices=[3]) == [4]
    pool.close()
    print("OK env_exception", flush=True)


def worker_death() -> None:
    pool = make_pool(functools.partial(wrapped, SuicidalEnv, die_at=3), timeout=30.0)
    pool.reset(seeds=[0, 1, 2, 3])
    step(pool)
    step(pool)
    started = time.monotonic()
    try:
        step(pool)
    except (WorkerLostError, WorkerTimeoutError) as error:
        print(f"OK worker_death {type(error).__name__} after {time.monotonic() - started:.2f} s: {error}", flush=True)
    else:
        raise AssertionError("no error")
    pool.close()
    print("OK closed", flush=True)


def first_rank_dies() -> None:
    """Worker 0's env kills its rank while worker 1 still steps (spawn: MPICH then ends every rank)."""
    env_fns = [functools.partial(wrapped, SuicidalEnv, die_at=3), CARTPOLE, CARTPOLE, functools.partial(SlowCartPole, 0.3)]
    pool = EnvPool(env_fns, backend="mpi", num_workers=2, timeout=30.0)
    print("WORKERS", *pool._transport.pids, flush=True)
    pool.reset(seeds=[0, 1, 2, 3])
    step(pool)
    step(pool)
    try:
        step(pool)
    except WorkerLostError as error:
        print(f"OK first_rank_dies WorkerLostError: {error}", flush=True)
    else:
        raise AssertionError("no WorkerLostError")
    pool.close()


def spawn_after_a_killed_rank() -> None:
    """close() kills a stuck spawned rank, which ends MPICH's process manager: the next pool is
    refused at once instead of spawning through a manager on its way out."""
    pool = make_pool(functools.partial(wrapped, HangingEnv, hang_at=2), timeout=2.0)
    pool.reset(seeds=[0, 1, 2, 3])
    step(pool)
    try:
        step(pool)
    except WorkerTimeoutError:
        pass
    pool.close()
    started = time.monotonic()
    try:
        EnvPool([CARTPOLE] * 2, backend="mpi", num_workers=2, timeout=10.0)
    except ClusterEnvError as error:
        print(f"OK spawn_after_a_killed_rank {type(error).__name__} after {time.monotonic() - started:.2f} s: {error}", flush=True)
    else:
        raise AssertionError("a pool was spawned")


def hang() -> None:
    pool = make_pool(functools.partial(wrapped, HangingEnv, hang_at=2), timeout=2.0)
    pool.reset(seeds=[0, 1, 2, 3])
    step(pool)
    started = time.monotonic()
    try:
        step(pool)
    except WorkerTimeoutError as error:
        print(f"OK hang WorkerTimeoutError after {time.monotonic() - started:.2f} s: {error}", flush=True)
    else:
        raise AssertionError("no WorkerTimeoutError")
    started = time.monotonic()
    pool.close()
    print(f"OK closed in {time.monotonic() - started:.2f} s", flush=True)


def close_exit() -> None:
    pool = make_pool()
    assert pool.workers_on_this_host == 2  # every rank of this launch runs here
    pool.reset(seeds=[0, 1, 2, 3])
    for _ in range(10):
        step(pool)
    pool.close()
    print("OK close_exit", flush=True)
    time.sleep(0.5)
    from mpi4py import MPI

    # Only the learner gets here: SPMD worker ranks exited inside the env's construction.
    print(f"AFTER CLOSE rank {MPI.COMM_WORLD.Get_rank()}", flush=True)


def learner_kill() -> None:
    pool = make_pool()
    pool.reset(seeds=[0, 1, 2, 3])
    step(pool)
    os.kill(os.getpid(), signal.SIGKILL)


def learner_exception() -> None:
    pool = make_pool()
    pool.reset(seeds=[0, 1, 2, 3])
    step(pool)
    raise RuntimeError("the learner crashed")


def wrong_num_workers() -> None:
    from mpi4py import MPI

    asked = MPI.COMM_WORLD.Get_size()  # one more than there are worker ranks
    try:
        EnvPool([CARTPOLE] * 4, backend="mpi", num_workers=asked)
    except ValueError as error:
        assert f"pass num_workers={asked - 1}" in str(error), error
        print(f"OK wrong_num_workers: {error}", flush=True)
    else:
        raise AssertionError("no ValueError")


def rollout_progress() -> None:
    from tests.test_inference import run_rollout_timeout_checks

    run_rollout_timeout_checks("mpi")
    print("OK rollout_progress", flush=True)


def ctrl_c_receiving_rows_and_arrays() -> None:
    import torch

    from tests.test_inference import run_ctrl_c_receiving_rows_and_arrays_checks

    torch.set_num_threads(1)
    for interrupted in ("rollout_wait", "reset"):
        run_ctrl_c_receiving_rows_and_arrays_checks("mpi", interrupted)
        print(f"OK ctrl_c_receiving_rows_and_arrays {interrupted}", flush=True)


def close_pending_rollout() -> None:
    """close() with a rollout started and not waited for, as an overlapped collection leaves one at
    the end of training: the segments are received and dropped. Left unreceived, a small segment
    made UCX warn of unmatched messages ("unexpected tag-receive descriptor") as the process ended,
    and a large one, which MPI sends only once it is received, kept its worker from reading the
    close request: close() killed the rank, and this process could spawn no pool after that."""
    import torch

    from tests.policies import LinearPolicy

    torch.set_num_threads(1)
    for n_steps in (64, 3000):
        pool = make_pool()
        pool.reset(seeds=[0, 1, 2, 3])
        pool.deploy(LinearPolicy()).rollout_async(n_steps)
        started = time.monotonic()
        pool.close()
        print(f"closed with a pending rollout of {n_steps} steps in {time.monotonic() - started:.2f} s", flush=True)
    with make_pool() as pool:
        pool.reset(seeds=[0, 1, 2, 3])
        step(pool)
    print("OK close_pending_rollout", flush=True)


class _InterruptedDisconnect:
    """A communicator whose first Disconnect meets Ctrl-C instead, as when it lands just before it
    (in the wait for heartbeat goodbyes, say); everything else is the communicator's."""

    def __init__(self, comm) -> None:
        self._comm = comm
        self._interrupted = False

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def __bool__(self) -> bool:
        return bool(self._comm)

    def Disconnect(self) -> None:
        if not self._interrupted:
            self._interrupted = True
            raise KeyboardInterrupt
        self._comm.Disconnect()


def ctrl_c_during_close(where: str) -> None:
    """Ctrl-C while the envs close (for 60 s), just before the learner disconnects from the ranks,
    or while it waits for the disconnected ranks to exit: close() raises KeyboardInterrupt at once,
    and leaves no rank running, no thread, no descriptor; a second close() does nothing."""
    import threading

    from clusterenv_core.transports.mpi import parting
    from tests.envs import SlowCloseEnv
    from tests.helpers import interrupt_soon

    with make_pool() as pool:  # MPI and its process manager start with the first pool
        pool.reset(seeds=[0, 1, 2, 3])
    descriptors = len(os.listdir("/proc/self/fd"))
    threads = set(threading.enumerate())
    if where == "closing envs":
        pool = make_pool(functools.partial(wrapped, SlowCloseEnv, seconds=60.0, path=os.devnull), timeout=30.0)
    else:
        pool = make_pool()
    pool.reset(seeds=[0, 1, 2, 3])
    transport = pool._transport
    pids = list(transport.pids)
    if where == "closing envs":
        interrupt_soon(1.0)
    elif where == "disconnecting":
        transport.comm = _InterruptedDisconnect(transport.comm)
    else:  # waiting for the ranks to exit: they disconnected and are finalizing

        def interrupted_once_disconnected(pid: int, pid_alive=parting.pid_alive) -> bool:
            if not transport.comm and not interrupted:
                interrupted.append(True)
                raise KeyboardInterrupt
            return pid_alive(pid)

        interrupted: list[bool] = []
        parting.pid_alive = interrupted_once_disconnected
    started = time.monotonic()
    try:
        pool.close()
    except KeyboardInterrupt:
        print(f"OK interrupted after {time.monotonic() - started:.2f} s", flush=True)
    pool.close()  # nothing left to do
    ranks_left(pids)
    left = [thread.name for thread in set(threading.enumerate()) - threads if thread.name.startswith("clusterenv")]
    print("THREADS LEFT", left, flush=True)
    print("DESCRIPTORS LEFT", len(os.listdir("/proc/self/fd")) - descriptors, flush=True)
    try:
        with make_pool() as pool:
            pool.reset(seeds=[0, 1, 2, 3])
            step(pool)
        print("NEXT POOL spawned", flush=True)
    except ClusterEnvError as error:
        print(f"NEXT POOL refused: {error}", flush=True)


def second_ctrl_c_during_close() -> None:
    """Ctrl-C while the learner waits for the disconnected ranks to exit, and again while close()
    gives them their last second: the ranks that did not exit are killed all the same, and the
    KeyboardInterrupt comes once that is done. The ranks are stopped (SIGSTOP) at the first Ctrl-C,
    so that they are still there when the last second is over, as ranks slow to finalize would be."""
    from clusterenv_core.transports.mpi import learner
    from clusterenv_core.transports.mpi.runtime import State

    pool = make_pool()
    pool.reset(seeds=[0, 1, 2, 3])
    transport = pool._transport
    pids = list(transport.pids)
    wait_for_exits = learner.wait_for_exits
    ctrl_c = []

    def interrupted_wait_for_exits(hosts: list[str], pids_of_workers: list[int], deadline: float) -> None:
        if len(ctrl_c) < 2:
            if not ctrl_c:
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
            ctrl_c.append(True)
            signal.raise_signal(signal.SIGINT)
        wait_for_exits(hosts, pids_of_workers, deadline)

    learner.wait_for_exits = interrupted_wait_for_exits
    started = time.monotonic()
    try:
        pool.close()
    except KeyboardInterrupt:
        print(f"OK interrupted {len(ctrl_c)} times, after {time.monotonic() - started:.2f} s", flush=True)
    for pid in ranks_left(pids):  # so that a failing run leaves nothing behind either
        os.kill(pid, signal.SIGKILL)
        State.finalize_unsafe = True


SCENARIOS = {
    "env_exception": env_exception,
    "worker_death": worker_death,
    "hang": hang,
    "close_exit": close_exit,
    "learner_kill": learner_kill,
    "learner_exception": learner_exception,
    "wrong_num_workers": wrong_num_workers,
    "rollout_progress": rollout_progress,
    "ctrl_c_receiving_rows_and_arrays": ctrl_c_receiving_rows_and_arrays,
    "first_rank_dies": first_rank_dies,
    "spawn_after_a_killed_rank": spawn_after_a_killed_rank,
    "close_pending_rollout": close_pending_rollout,
    "ctrl_c_during_close": ctrl_c_during_close,
    "second_ctrl_c_during_close": second_ctrl_c_during_close,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
