"""ClusterEnv core: Gymnasium environments on worker processes or MPI ranks, learning in your process.

No Stable-Baselines3 or CleanRL here; the adapters in ``clusterenv_sb3`` and ``clusterenv_cleanrl``
translate this pool into their libraries' vector-env APIs.

The pool is imported on first use, so that the worker program (``python -m clusterenv_core.worker``)
starts with the standard library only and can still end an MPI job when its dependencies fail to
import (see :mod:`clusterenv_core.worker.launch`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clusterenv_core.errors import (
    CloseTimeoutWarning,
    ClusterEnvError,
    EnvAttributeError,
    EnvError,
    EnvTypeError,
    EnvValueError,
    SpaceMismatchError,
    WorkerLostError,
    WorkerTimeoutError,
)
from clusterenv_core.learner_threads import LearnerThreadsWarning

if TYPE_CHECKING:
    from clusterenv_core.pool import DEFAULT_TIMEOUT, EnvPool, ResetResult, StepResult

__version__ = "0.1.0"

_FROM_POOL = ("DEFAULT_TIMEOUT", "EnvPool", "ResetResult", "StepResult")


def __getattr__(name: str) -> Any:
    if name in _FROM_POOL:
        from clusterenv_core import pool

        return getattr(pool, name)
    raise AttributeError(f"module 'clusterenv_core' has no attribute {name!r}")


__all__ = [
    "DEFAULT_TIMEOUT",
    "ClusterEnvError",
    "CloseTimeoutWarning",
    "EnvAttributeError",
    "EnvError",
    "EnvPool",
    "EnvTypeError",
    "EnvValueError",
    "LearnerThreadsWarning",
    "ResetResult",
    "SpaceMismatchError",
    "StepResult",
    "WorkerLostError",
    "WorkerTimeoutError",
    "__version__",
]
