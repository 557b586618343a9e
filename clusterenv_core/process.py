"""This process: whether an MPI launcher started it, and its standard streams at an exit that skips
Python's own. Standard library only: the worker program asks before anything else imports.
"""

from __future__ import annotations

import os
import sys

# Set for the processes of an MPI launch by hydra (MPICH), Slurm's PMI-2, PMIx and Open MPI.
_MPI_LAUNCH_VARIABLES = ("PMI_RANK", "PMI_FD", "PMI_PORT", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")


def launched_by_mpi() -> bool:
    """Whether an MPI launcher (``mpiexec``, ``srun``) started this process."""
    return any(name in os.environ for name in _MPI_LAUNCH_VARIABLES)


def flush_standard_streams() -> None:
    """Flush stdout and stderr before a process ends without Python's own exit, whatever became of
    them (replaced, closed, or their reader gone)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
