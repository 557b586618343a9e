"""RemoteFailure: a failure inside the worker, with the env it happened in, and the error reply it becomes.

The env block raises it where an env fails (creating, stepping, resetting, a call); the serving
loop turns it into the ``ERROR`` reply the learner raises as an :class:`~clusterenv_core.errors.EnvError`.
"""

from __future__ import annotations

import traceback

from clusterenv_core.protocol import ERROR, ErrorDetails


class RemoteFailure(Exception):
    """Raised inside the worker to report a failure with the env it happened in.

    :param slot: the env's slot in the block, or ``None`` for the worker as a whole
    """

    def __init__(self, slot: int | None, operation: str, error: BaseException) -> None:
        super().__init__(operation)
        self.slot = slot
        self.operation = operation
        self.error = error

    def reply(self, first_index: int, env_restarts: list[int] | None = None) -> tuple:
        """The error reply; ``env_restarts``: the envs replaced in the request before it failed."""
        error = self.error
        return (
            ERROR,
            ErrorDetails(
                env_index=None if self.slot is None else first_index + self.slot,
                operation=self.operation,
                exc_type=f"{type(error).__module__}.{type(error).__qualname__}",
                message=_message_of(error),
                traceback="".join(traceback.format_exception(type(error), error, error.__traceback__)),
                env_restarts=tuple(env_restarts or ()),
            ),
        )


def _message_of(error: BaseException) -> str:
    try:
        return str(error)
    except Exception as str_error:  # an exception's own __str__ may fail; the worker must not
        return f"<str() of the {type(error).__name__} failed: {type(str_error).__name__}: {str_error}>"
