"""Process-wide MPI state of the backend: initializing MPI, and leaving it at exit.

Importing mpi4py initializes MPI, so only this module imports it, on first use (:func:`mpi`). A
learner that may spawn (a plain ``python train.py``) finalizes MPI itself at exit, after its pools
have closed, and skips finalization when a lost worker took MPICH's process manager down (it would
crash). A learner whose world rank could not be closed aborts the job instead of waiting for it in
``MPI_Finalize`` forever. Once every rank of a job has started, each removes the names of MPICH's
shared-memory segments it maps (:func:`unlink_shared_memory_names`), so that a killed rank leaves
nothing in ``/dev/shm``. See ``docs/mpi.md``.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import socket
import sys
import time
import weakref
from typing import Any

from clusterenv_core.process import flush_standard_streams, launched_by_mpi

CONNECT_TIMEOUT_VARIABLE = "CLUSTERENV_MPI_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT = 600.0
SHARED_MEMORY_DIRECTORY = "/dev/shm/"
MPICH_SEGMENT_PREFIX = "mpich_shm_"
ABORT_REPORT_SECONDS = 0.3  # before MPI_Abort at exit: time for the launcher to forward the reason
HOST = socket.gethostname()


class State:
    """Process-wide MPI state of the backend."""

    MPI: Any = None
    owns_finalize = False  # we set mpi4py.rc.finalize = False and finalize at exit ourselves
    world_used = False  # the world's worker ranks served a pool (they exit when it closes)
    pm_started = False  # MPICH's singleton process manager was started by our first spawn
    pm_pid: int | None = None
    pm_gone = False  # that process manager has exited
    finalize_unsafe = False  # MPI_Finalize would crash (process manager gone)
    abort_at_exit = ""  # why: a world rank could not be closed, so MPI_Finalize would wait for it forever
    live: weakref.WeakSet = weakref.WeakSet()


def mpi(worker: bool = False) -> Any:
    """mpi4py's MPI module, imported (MPI initialized) on first use with the backend's settings."""
    if State.MPI is not None:
        return State.MPI
    import mpi4py

    watchdog = False
    if "mpi4py.MPI" not in sys.modules:
        if worker:
            # Worker ranks call MPI from one thread at a time (their heartbeat takes turns: heartbeat.py).
            mpi4py.rc.thread_level = "serialized"
        elif not launched_by_mpi():
            # A singleton that may spawn: finalize ourselves, so a lost worker can skip it.
            mpi4py.rc.finalize = False
            State.owns_finalize = True
        elif connect_timeout() > 0:
            # The learner of an MPI job waits in MPI_Init (in C) for every rank; a rank whose program
            # died before reaching MPI must not leave it there forever.
            faulthandler.dump_traceback_later(connect_timeout(), exit=True)
            watchdog = True
    try:
        from mpi4py import MPI
    finally:
        if watchdog:
            faulthandler.cancel_dump_traceback_later()

    State.MPI = MPI
    if not worker:
        atexit.register(at_exit)
    return MPI


def at_exit() -> None:
    """Shut down the pools still open, then finalize MPI when that is safe (learner side)."""
    for transport in list(State.live):
        if transport.exit_hook is not None:
            try:
                transport.exit_hook()  # its pool's shutdown: the workers close before MPI finalizes
            except Exception:
                pass
    MPI = State.MPI
    if MPI is None or MPI.Is_finalized():
        return
    if State.abort_at_exit:
        flush_standard_streams()
        print(
            f"clusterenv: {State.abort_at_exit}; aborting the MPI job instead of waiting for it forever in MPI_Finalize",
            file=sys.stderr,
            flush=True,
        )
        # The launcher forwards our output through its proxies and stops forwarding once it hears
        # of the abort: give it a moment to pass on why the job ends.
        time.sleep(ABORT_REPORT_SECONDS)
        MPI.COMM_WORLD.Abort(1)
    if State.finalize_unsafe or pm_exited():
        if not State.owns_finalize:
            # mpi4py would call MPI_Finalize after us and crash: end the process here instead.
            flush_standard_streams()
            print(
                "clusterenv: MPI's process manager ended after a lost worker; exiting without MPI_Finalize",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
        return
    if State.owns_finalize:
        MPI.Finalize()


def unlink_shared_memory_names() -> None:
    """Remove the names of MPICH's shared-memory segments this process maps (Linux; others: nothing).

    The ranks of a host attach them by name while they start, and MPICH (5.0.2 here) removes some
    of the names only in ``MPI_Finalize``: a rank that is killed (by us, by MPICH's process manager
    after another rank died, by a scheduler) leaves those in ``/dev/shm`` for good. Called once
    every rank of the pool has started (the learner has each one's hello), when they are attached;
    the memory stays mapped and is freed when the last rank unmaps it, however it ends. MPICH's
    ``MPI_Finalize`` does not mind that the name is gone.
    """
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return
    prefix = SHARED_MEMORY_DIRECTORY + MPICH_SEGMENT_PREFIX
    paths = {line.split(maxsplit=5)[-1].rstrip("\n") for line in lines}
    for path in paths:
        if path.startswith(prefix) and not path.endswith(" (deleted)"):
            try:
                os.unlink(path)
            except OSError:
                pass  # removed by another rank of this host meanwhile


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return True


def pm_exited() -> bool:
    """Whether the singleton process manager our first spawn started has ended (reaping it)."""
    if State.pm_gone or State.pm_pid is None:
        return State.pm_gone
    try:
        pid, _ = os.waitpid(State.pm_pid, os.WNOHANG)
        exited = pid != 0
    except ChildProcessError:
        exited = not pid_alive(State.pm_pid)
    if exited:
        State.pm_gone = True
        State.finalize_unsafe = True
    return exited


def connect_timeout() -> float:
    """Seconds a rank may wait for the rest of its job in ``MPI_Init`` and the handshake."""
    value = os.environ.get(CONNECT_TIMEOUT_VARIABLE, "")
    try:
        return float(value) if value else DEFAULT_CONNECT_TIMEOUT
    except ValueError:
        return DEFAULT_CONNECT_TIMEOUT
