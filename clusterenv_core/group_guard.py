"""A guard that ends what a worker's envs started once the worker is gone, however it went.

Real envs start helper processes (a simulator, a game binary, a co-simulation) and stop them in
``close()``. The local backend starts each worker as the leader of a process group of its own, which
those helpers join, and ends that group when the worker closes or the learner finds it lost. Neither
happens when the worker is SIGKILLed (the OOM killer) and its learner dies before it noticed (a
preempted job): the helpers would live on under PID 1. So each worker forks a guard as it starts, a
process that only waits for the worker to end and then ends the group: SIGTERM, so that the helpers
can clean up, and SIGKILL :data:`GRACE_SECONDS` later for those still there.

The guard leaves the group (it would otherwise outlive its own SIGTERM only to find itself in the
group), closes every descriptor but a pidfd of the worker (holding the worker's socket or stderr
would hide the worker's end from the learner), and ignores the signals a group gets.
"""

from __future__ import annotations

import os
import select
import signal
import time

#: seconds the helpers get between SIGTERM and SIGKILL
GRACE_SECONDS = 2.0


def start_group_guard() -> int | None:
    """Fork the guard of this process's group, if this process leads it; returns the guard's pid."""
    worker, group = os.getpid(), os.getpgrp()
    if group != worker:
        return None  # not this process's group to end (an MPI rank shares its launcher's)
    try:
        worker_pidfd = os.pidfd_open(worker)
    except (AttributeError, OSError):
        worker_pidfd = -1  # no pidfds (Linux before 5.3): the guard watches its parent instead
    pid = os.fork()
    if pid != 0:
        if worker_pidfd >= 0:
            os.close(worker_pidfd)
        return pid
    try:
        _guard(worker, group, worker_pidfd)
    finally:
        os._exit(0)


def _guard(worker: int, group: int, worker_pidfd: int) -> None:
    os.setpgid(0, 0)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    for standard in (0, 1, 2):
        os.dup2(devnull, standard)
    keep = sorted({devnull, worker_pidfd} - {-1})
    start = 3
    for fd in keep:
        os.closerange(start, fd)
        start = fd + 1
    os.closerange(start, os.sysconf("SC_OPEN_MAX"))
    if worker_pidfd >= 0:
        select.select([worker_pidfd], [], [])  # readable once the worker ended
    else:
        while os.getppid() == worker:
            time.sleep(0.25)
    end_group(group)


def end_group(group: int, grace: float = GRACE_SECONDS) -> None:
    """SIGTERM the process group ``group``, then SIGKILL what is left of it after ``grace`` seconds."""
    try:
        os.killpg(group, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return  # nobody left
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.02)
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
