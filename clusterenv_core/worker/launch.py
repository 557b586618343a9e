"""The worker program's entry and exit: choose the backend, connect, serve -- or end an MPI job that it cannot serve.

``python -m clusterenv_core.worker [<backend> [backend arguments]]`` lands here (from :mod:`~.__main__`).
Without arguments the backend is the launcher's: a process started by ``mpiexec``/``srun`` serves as
an MPI worker (``mpiexec -n 1 python train.py : -n W python -m clusterenv_core.worker``).

Every other rank of an MPI job waits in ``MPI_Init`` for this one, and a launcher does not end a
job whose rank exits before it initialized MPI: a worker rank that exits with a usage message
would leave the learner waiting forever. So under an MPI launch any failure to start serving --
bad arguments, a dependency that does not import, a failed connection -- prints its reason and
aborts the whole job. This module imports only the standard library, so that it still runs when
the worker's dependencies do not import.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import socket
import sys
import threading
import time
import traceback
from typing import NoReturn

from clusterenv_core.group_guard import start_group_guard
from clusterenv_core.process import flush_standard_streams, launched_by_mpi

USAGE = "usage: python -m clusterenv_core.worker [<backend> [backend arguments]]  (no backend: the MPI launcher's)"

_ABORT_GRACE_SECONDS = 10.0  # how long an aborting rank waits for the launcher to end it


def run_worker_program(argv: list[str]) -> int:
    """Serve as a worker with the backend ``argv`` names (or the MPI launcher's); returns the exit code."""
    under_mpi = launched_by_mpi()
    if not argv and not under_mpi:
        print(USAGE, file=sys.stderr)
        return 2
    backend, backend_argv = (argv[0], argv[1:]) if argv else ("mpi", [])
    # A crash in an env's C code (MuJoCo, ALE, ...) then leaves a Python traceback on stderr, which
    # the learner shows in its WorkerLostError (local backend) or the launcher forwards (MPI). The
    # crashing thread's alone: the worker's own threads would push the env's last words out of it.
    faulthandler.enable(all_threads=False)
    # Before any thread, and before MPI is initialized (the guard is a fork): what the envs start dies
    # with this worker, however it dies.
    start_group_guard()
    try:
        from clusterenv_core.transports import worker_connection
        from clusterenv_core.worker.serving import serve

        connection = worker_connection(backend, backend_argv)
    except (Exception, SystemExit) as error:
        if under_mpi:
            abort_mpi_job(_reason(error))
        if isinstance(error, SystemExit):
            raise
        print(f"clusterenv worker: {_reason(error)}\n{USAGE}", file=sys.stderr)
        return 2
    return serve(connection, agent_block=_agent_block)


def _agent_block(env_fns: list, request: object) -> object:
    """A node agent's :class:`~clusterenv_core.node_agent.AgentBlock` on an inner pool, imported by
    the workers that run one only: the pool and the local backend, which the others never need."""
    from clusterenv_core.node_agent import AgentBlock
    from clusterenv_core.pool import EnvPool

    return AgentBlock(env_fns, request, make_pool=EnvPool)


def end_worker_program(code: int) -> NoReturn:
    """End the worker program with exit code ``code`` once it has served, without the interpreter's teardown.

    Its envs are closed by then. What Python does at exit still happens -- it waits for the threads
    an env left running (unless daemon; the learner's ``close`` timeout bounds the wait), runs the
    atexit handlers and flushes the standard streams -- except the teardown of every module, which
    releases nothing the OS would not and takes about a second once torch is imported: a second
    every ``close()`` would wait for. multiprocessing's forked children end with ``os._exit`` too. An
    MPI rank exits as usual: mpi4py finalizes MPI in that teardown, below atexit.
    """
    if "mpi4py.MPI" in sys.modules:
        sys.exit(code)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    flush_standard_streams()
    os._exit(code)


def abort_mpi_job(reason: str, code: int = 1) -> NoReturn:
    """Print ``reason`` and end this rank's whole MPI job (never returns).

    With MPI initialized, ``MPI_Abort``. Before that, MPICH's launcher (hydra) takes a PMI abort
    on the rank's PMI socket at once; elsewhere MPI is initialized to abort, which works once the
    other ranks reach ``MPI_Init`` too (this rank's fellow workers come to abort as well).
    """
    print(f"clusterenv worker: {reason}", file=sys.stderr)
    print(
        "clusterenv worker: this rank cannot serve; aborting the MPI job so that no rank waits for it",
        file=sys.stderr,
        flush=True,
    )
    # The launcher forwards output through its proxies and stops once it hears of the abort.
    time.sleep(0.3)
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(code)
    if _hydra_pmi_abort(code):
        time.sleep(_ABORT_GRACE_SECONDS)
    try:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    except Exception:
        pass
    os._exit(code)


def _hydra_pmi_abort(code: int) -> bool:
    """Ask hydra to end the job over its PMI-1 socket, which needs no MPI library."""
    if "HYDI_CONTROL_FD" not in os.environ or "PMI_FD" not in os.environ:
        return False
    try:
        pmi = socket.socket(fileno=int(os.environ["PMI_FD"]))
        pmi.sendall(f"cmd=abort exitcode={code}\n".encode())
    except (OSError, ValueError):
        return False
    return True


def _reason(error: BaseException) -> str:
    if isinstance(error, SystemExit) and isinstance(error.code, str):
        return error.code
    if isinstance(error, ImportError):
        return f"cannot import what the worker needs: {type(error).__name__}: {error}"
    return "".join(traceback.format_exception_only(type(error), error)).strip()
