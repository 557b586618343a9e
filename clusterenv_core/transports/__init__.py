"""Backends, a package each: ``local`` (processes + shared memory), ``mpi`` (mpi4py ranks) and
``ray`` (Ray actors).

A backend defines a :class:`~clusterenv_core.transports.base.Transport` subclass for the learner
and a ``worker_connection(argv)`` function for ``python -m clusterenv_core.worker <backend>``. They
are imported on first use, so ``mpi4py`` is needed only by the MPI backend, and Ray only by the
Ray backend.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from clusterenv_core.transports.base import Transport, WorkerConnection, WorkerNames

_BACKENDS = {
    "local": ("clusterenv_core.transports.local", "LocalTransport"),
    "mpi": ("clusterenv_core.transports.mpi", "MPITransport"),
    "ray": ("clusterenv_core.transports.ray", "RayTransport"),
}


def make_transport(backend: str, **options: Any) -> Transport:
    """The learner side of ``backend``, constructed with the backend's ``options``."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(_BACKENDS)}")
    module_name, class_name = _BACKENDS[backend]
    transport_class = getattr(importlib.import_module(module_name), class_name)
    try:
        inspect.signature(transport_class).bind(**options)
    except TypeError as error:  # an unknown keyword (a misspelt option): a TypeError, as for any call
        raise TypeError(f"bad options for backend {backend!r}: {error}") from None
    try:
        return transport_class(**options)
    except TypeError as error:  # a value of the wrong type: bad configuration, as any other bad value
        raise ValueError(f"bad options for backend {backend!r}: {error}") from None


def worker_connection(backend: str, argv: list[str]) -> WorkerConnection:
    """The worker side of ``backend``, from the worker's command-line arguments."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")
    return importlib.import_module(_BACKENDS[backend][0]).worker_connection(argv)


__all__ = ["Transport", "WorkerConnection", "WorkerNames", "make_transport", "worker_connection"]
