"""Exceptions raised by the learner-side pool.

Every failure that happens on a worker reaches the learner as one of these, so user code can catch
``ClusterEnvError`` to handle anything that went wrong remotely.
"""

from __future__ import annotations

import sys


class ClusterEnvError(RuntimeError):
    """Base class of every error ClusterEnv raises about its workers or remote environments."""


class EnvError(ClusterEnvError):
    """A remote environment raised an exception.

    :param env_index: global index of the environment that raised
    :param worker_index: index of the worker that runs it
    :param operation: what the worker was doing (``"step"``, ``"reset"``, ``"call render"``, ...)
    :param exc_type: qualified name of the remote exception's type
    :param message: ``str()`` of the remote exception
    :param remote_traceback: the formatted remote traceback
    """

    def __init__(
        self,
        env_index: int | None,
        worker_index: int,
        operation: str,
        exc_type: str,
        message: str,
        remote_traceback: str,
    ) -> None:
        self.env_index = env_index
        self.worker_index = worker_index
        self.operation = operation
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        where = f"env {env_index} on worker {worker_index}" if env_index is not None else f"worker {worker_index}"
        super().__init__(
            f"{operation} failed in {where}: {exc_type}: {message}\n\nRemote traceback:\n{remote_traceback.rstrip()}"
        )

    def __reduce__(self):
        return (
            type(self),
            (
                self.env_index,
                self.worker_index,
                self.operation,
                self.exc_type,
                self.remote_message,
                self.remote_traceback,
            ),
        )


class EnvAttributeError(EnvError, AttributeError):
    """A remote environment has no attribute of the requested name.

    Also an ``AttributeError``, so ``hasattr``-style probing (SB3's ``VecEnv.has_attr``) works remotely.
    """


class EnvTypeError(EnvError, TypeError):
    """A remote environment raised a ``TypeError`` (calling a method that is not callable, say);
    also a ``TypeError``, as with DummyVecEnv and SyncVectorEnv."""


class EnvValueError(EnvError, ValueError):
    """A remote environment raised a ``ValueError``; also a ``ValueError``, as with DummyVecEnv and
    SyncVectorEnv."""


#: EnvError classes that are also the builtin exception the remote env raised, by its qualified name
ENV_ERROR_CLASSES: dict[str, type[EnvError]] = {
    "builtins.AttributeError": EnvAttributeError,
    "builtins.TypeError": EnvTypeError,
    "builtins.ValueError": EnvValueError,
}


class InvalidEnvOutput(ValueError):
    """An env returned something its spaces or the Gymnasium API do not allow (raised on the worker;
    the learner gets an :class:`EnvError` whose ``exc_type`` names this class)."""


class SpaceMismatchError(ValueError):
    """The envs of one pool do not all have the same observation and action spaces."""


class WorkerLostError(ClusterEnvError):
    """A worker process (or MPI rank) died or its connection closed while the learner needed it."""


class WorkerTimeoutError(ClusterEnvError):
    """A worker did not answer within the configured timeout."""


class CloseTimeoutWarning(RuntimeWarning):
    """``close()`` ended a worker that did not finish in time: an env whose own ``close()`` hangs, or
    a request still running when the pool closed."""


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning given here at the first caller outside ClusterEnv
    (and the ``weakref.finalize`` a pool's ``close()`` calls)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(("clusterenv_", "weakref")):
        frame, level = frame.f_back, level + 1
    return level
