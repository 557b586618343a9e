"""The process manager of a spawning learner: MPICH's ``mpiexec``, started so that it cannot take the learner down.

A singleton MPICH process (plain ``python train.py``) starts ``mpiexec`` from ``PATH`` when it first
spawns. When a spawned rank dies, that process manager kills its process group -- the learner's, by
default. :func:`process_manager` puts a shim first on ``PATH`` for the first spawn: it records the
manager's pid and (``isolate``) starts it in a session of its own.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
import tempfile

from clusterenv_core.errors import ClusterEnvError
from clusterenv_core.process import launched_by_mpi
from clusterenv_core.transports.mpi.runtime import State


def find_mpiexec() -> str | None:
    """MPICH's mpiexec for singleton init: the one next to this interpreter (the mpich wheel), else PATH's."""
    beside = os.path.join(sys.prefix, "bin", "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


@contextlib.contextmanager
def process_manager(mpiexec: str | None, isolate: bool):
    """Around the first spawn of a singleton MPICH process: make MPICH find its ``mpiexec`` through a
    shim that records the process manager's pid and (``isolate``) starts it in a new session.

    MPICH starts ``mpiexec`` from ``PATH`` when a singleton first spawns. When a spawned rank dies,
    that process manager kills its process group; in the learner's group that is the learner itself
    and the shell that started it. In a session of its own it only takes its own ranks down.
    """
    MPI = State.MPI
    if State.pm_started or MPI.get_vendor()[0] != "MPICH" or launched_by_mpi():
        yield
        return
    real = mpiexec or find_mpiexec()
    if real is None:
        raise ClusterEnvError(
            "backend='mpi' spawns its workers through MPICH's mpiexec, which was found neither next to "
            f"{sys.executable} nor on PATH: install the mpich wheel (pip install mpich), put mpiexec on PATH, "
            "pass mpiexec=<path>, or launch the job with mpiexec"
        )
    directory = tempfile.mkdtemp(prefix="clusterenv-mpiexec-")
    pid_file = os.path.join(directory, "pid")
    starter = "import os, sys\n" + ("try:\n    os.setsid()\nexcept OSError:\n    pass\n" if isolate else "")
    starter += "os.execv(sys.argv[1], sys.argv[1:])\n"
    shim = os.path.join(directory, "mpiexec")
    with open(shim, "w") as file:
        file.write(
            "#!/bin/sh\n"
            f"echo $$ > {shlex.quote(pid_file)}\n"
            f"exec {shlex.quote(sys.executable)} -S -c {shlex.quote(starter)} {shlex.quote(real)} \"$@\"\n"
        )
    os.chmod(shim, 0o755)
    saved = {name: os.environ.get(name) for name in ("PATH", "PYTHONPATH")}
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    os.environ["PATH"] = os.pathsep.join(filter(None, [directory, saved["PATH"]]))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, saved["PYTHONPATH"]]))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        try:
            with open(pid_file) as file:
                State.pm_pid = int(file.read().strip())
            State.pm_started = True
        except (OSError, ValueError):
            pass
        shutil.rmtree(directory, ignore_errors=True)
