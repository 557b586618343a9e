"""How the learner ends worker ranks that did not part cleanly: spawned ranks on this host are
killed (MPICH's process manager then ends the rest of the spawn, and itself), and a world job whose
ranks did not close is aborted at exit, as ``MPI_Finalize`` would wait for them forever.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from typing import Any

from clusterenv_core.transports.mpi.runtime import HOST, State, pid_alive


def kill_spawned(comm: Any, hosts: list[str], pids: list[int], workers: Iterable[int]) -> None:
    """Kill those of the spawned ``workers`` on this host that still run, and let go of the
    communicator ``comm``: MPICH's process manager then ends the others, and itself.

    :param hosts: each worker's host
    :param pids: each worker's process id on its host
    """
    killed = False
    for worker in workers:
        if hosts[worker] == HOST and pid_alive(pids[worker]):
            try:
                os.kill(pids[worker], signal.SIGKILL)
                killed = True
            except OSError:
                pass
    if not killed and not comm:
        return  # they disconnected and exited: the process manager lives on
    State.finalize_unsafe = True
    if comm:
        try:
            comm.Free()
        except Exception:
            pass


def wait_for_exits(hosts: list[str], pids: list[int], deadline: float) -> None:
    """Wait until the worker ranks on this host have exited, or ``deadline``."""
    for worker, host in enumerate(hosts):
        if host != HOST:
            continue
        while pid_alive(pids[worker]) and time.monotonic() < deadline:
            time.sleep(0.01)


def abort_at_exit(ranks: list[int], unclosed: list[int]) -> None:
    """Have this process abort the MPI job at exit: the world ranks of the ``unclosed`` workers
    did not close, and would keep ``MPI_Finalize`` waiting forever."""
    State.abort_at_exit = f"worker rank(s) {', '.join(str(ranks[worker]) for worker in unclosed)} did not close"
