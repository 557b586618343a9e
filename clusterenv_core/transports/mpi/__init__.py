"""The MPI backend: workers are MPI ranks, reached with mpi4py buffer messages.

``backend="mpi"`` needs ``mpi4py`` (tested with MPICH 5 from the ``mpich`` wheel). Only this
package imports it, and only when a pool or a worker uses it (importing mpi4py initializes MPI).

The launch mode is chosen when the pool starts (``launch="auto"``, the default):

- **spawn**: ``COMM_WORLD`` has one rank (plain ``python train.py``): the learner spawns
  ``num_workers`` ranks running ``python -m clusterenv_core.worker mpi spawn`` and talks to them over
  the intercommunicator. Every pool spawns its own ranks.
- **world**: ``COMM_WORLD`` has more than one rank: rank 0 is the learner and every other rank is a
  worker (worker ``w`` is rank ``w + 1``), whether it runs the worker program (MPMD: ``mpiexec -n 1
  python train.py : -n W python -m clusterenv_core.worker``) or the user's script (SPMD: ``mpiexec
  -n W+1 python train.py``; constructing the pool turns ranks above 0 into workers). One pool per
  world job: its worker ranks exit when it closes.

Modules, one concept each: :mod:`~.runtime` (initializing and leaving MPI), :mod:`~.launcher` (the
spawning learner's process manager), :mod:`~.wire` (tags and the step's message layout),
:mod:`~.waiting` (polling and the same-host doorbell), :mod:`~.heartbeat` (liveness across hosts),
:mod:`~.learner` (:class:`MPITransport`) and
:mod:`~.worker` (:class:`MPIWorkerConnection`). What happens on each fault, and how a job ends, is
in ``docs/mpi.md``.
"""

from clusterenv_core.transports.mpi.learner import MPITransport
from clusterenv_core.transports.mpi.worker import MPIWorkerConnection, worker_connection

__all__ = ["MPITransport", "MPIWorkerConnection", "worker_connection"]
