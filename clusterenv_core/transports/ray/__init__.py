"""The Ray backend: each worker is a Ray actor, placed on the cluster's nodes by a placement group.

``backend="ray"`` needs Ray (``pip install clusterenv-rl[ray]``), imported only when a pool uses
it. The pool uses the Ray connection this process already has, else connects (the ``address``
and ``init_options`` options), else starts a local Ray. By default there is one actor per alive
node with CPUs, each a worker serving its block of envs; with ``processes_per_worker`` > 1 each
actor is a node agent stepping its block on that many local processes. Env factories, the
learner's interpreter state and registered env ids reach the actors in the ``Init`` request, as
they reach MPI ranks. ClusterEnv opens no port of its own: everything travels as Ray calls.

Modules: :mod:`~.placement` (connecting, the nodes, the placement group), :mod:`~.learner`
(:class:`RayTransport`) and :mod:`~.actor` (:class:`WorkerActor` and its
:class:`RayWorkerConnection`). Ray starts the actors; the worker program (``python -m
clusterenv_core.worker``) does not serve this backend.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as error:
    raise ImportError(f"backend='ray' needs Ray: pip install 'clusterenv-rl[ray]' ({error})") from error

from clusterenv_core.transports.ray.actor import RayWorkerConnection, WorkerActor
from clusterenv_core.transports.ray.learner import RayTransport


def worker_connection(argv: list[str]) -> RayWorkerConnection:
    """Refuse: Ray's actors are started by the learner's pool, not by the worker program."""
    raise SystemExit("clusterenv worker (ray): Ray actors are started by the pool (backend='ray'), not by this program")


__all__ = ["RayTransport", "RayWorkerConnection", "WorkerActor", "worker_connection"]
