"""ClusterEnv core: Gymnasium environments on worker processes or MPI ranks, learning in your process.

No Stable-Baselines3 or CleanRL here; the adapters in ``clusterenv_sb3`` and ``clusterenv_cleanrl``
translate this pool into their libraries' vector-env APIs.
"""

from clusterenv_core.errors import (
    ClusterEnvError,
    EnvAttributeError,
    EnvError,
    SpaceMismatchError,
    WorkerLostError,
    WorkerTimeoutError,
)
from clusterenv_core.pool import DEFAULT_TIMEOUT, EnvPool, ResetResult, StepResult

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT",
    "ClusterEnvError",
    "EnvAttributeError",
    "EnvError",
    "EnvPool",
    "ResetResult",
    "SpaceMismatchError",
    "StepResult",
    "WorkerLostError",
    "WorkerTimeoutError",
    "__version__",
]
