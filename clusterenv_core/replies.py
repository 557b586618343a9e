"""Reading a worker's reply, and what the learner makes of it: the reply's wait, the envs it says
were replaced, the learner's exception for an error reply.

The functions of :class:`~clusterenv_core.channel.WorkerChannel` and of the pool's shutdown
(:mod:`clusterenv_core.shutdown`), which read replies the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from clusterenv_core import protocol
from clusterenv_core.errors import ENV_ERROR_CLASSES, EnvError
from clusterenv_core.protocol import ERROR, OK, PROGRESS
from clusterenv_core.transports import Transport
from clusterenv_core.transports.base import ctrl_c_held

# Starting a worker (interpreter, imports, env construction) may take longer than a step may.
START_TIMEOUT = 60.0

#: ``keep(worker, request_type, status, result)``: stores a reply as read.
KeepReply = Callable[[int, "type | None", str, Any], None]


def reply_timeout(request_type: type | None, timeout: float) -> float:
    """How long to wait for the reply to a request of ``request_type``: at least as long as for a
    starting worker where answering may mean importing large modules."""
    return max(timeout, START_TIMEOUT) if request_type is not None and request_type.IMPORTS else timeout


def replaced_envs(request_type: type | None, status: str, result: Any) -> list[int]:
    """The envs that a worker's reply to a request of ``request_type`` (``None``: a step) says were
    replaced (``restart_failed_envs``): an error reply's, a step's, a rollout segment's."""
    if status == ERROR:
        return list(result.env_restarts)
    if result is None:
        return []
    if request_type is None:
        return list(result.get("env_restarts", ()))
    if request_type is protocol.Rollout:
        return [index for parts in result.get("steps", {}).values() for index in parts.get("env_restarts", ())]
    return []


def replaced_processes(request_type: type | None, status: str, result: Any) -> int:
    """How many local processes a node agent's reply to a step (``request_type`` ``None``) or a
    rollout segment says it replaced (``restart_failed_workers``): each counts as a replaced worker,
    as on a flat pool."""
    if request_type not in (None, protocol.Rollout) or status == ERROR or result is None:
        return 0
    return len(result.get("process_restarts", ()))


def remote_error(worker: int, details: protocol.ErrorDetails, what: str, sent_before_ctrl_c: bool = False) -> EnvError:
    """The learner's exception for a worker's error reply (``what`` names a failed step).

    :param sent_before_ctrl_c: the request went out before Ctrl-C cut its call short, and a later
        call read the reply (:meth:`WorkerChannel.drain <clusterenv_core.channel.WorkerChannel.drain>`):
        the error says so
    """
    error_class = ENV_ERROR_CLASSES.get(details.exc_type, EnvError)
    operation = details.operation if details.operation != "step" else what
    if sent_before_ctrl_c:
        operation += " sent before Ctrl-C"
    return error_class(details.env_index, worker, operation, details.exc_type, details.message, details.traceback)


def read_reply(
    transport: Transport,
    worker: int,
    request_type: type | None,
    timeout: float,
    arrays: list | None = None,
    keep: KeepReply | None = None,
    on_progress: Callable[[int, Any], None] | None = None,
) -> None:
    """Read the worker's reply to a request of ``request_type`` (``None``: a step) past its progress
    reports (each restarts the ``timeout``), with the result rows and arrays that follow it.

    Once a reply followed by rows or arrays is read, they are received and the reply kept with
    Ctrl-C held (:func:`~clusterenv_core.transports.base.ctrl_c_held`), which is delivered right
    after: Ctrl-C in their receive (MPI waits for their messages, milliseconds for a large segment)
    would lose the reply and leave them unreceived, for a later receive to take. Other replies,
    steps' among them, are kept at once, with nothing held.

    :param arrays: where the arrays that follow the reply of a ``REPLY_ARRAYS`` request go (the
        arrays given to ``WorkerChannel.send``); left unreceived, they would stay queued in the
        transport, and a large one keeps the worker from reading its next request (MPI)
    :param keep: stores the reply as read, before Ctrl-C can take effect where it is held
    :param on_progress: ``on_progress(worker, report)`` runs at each progress report (a node agent
        forwards them to its learner); what it raises ends the wait, the reply still awaited
    """
    recv = transport.recv_step if request_type is None else transport.recv
    status, result = recv(worker, timeout)
    while status == PROGRESS:
        if on_progress is not None:
            on_progress(worker, result)
        status, result = recv(worker, timeout)
    if status == OK and request_type is not None and (request_type.REPLY_ROWS or request_type.REPLY_ARRAYS):
        with ctrl_c_held():
            if request_type.REPLY_ROWS:
                transport.recv_rows(worker, timeout)
            if request_type.REPLY_ARRAYS:
                transport.recv_arrays(worker, arrays, timeout)
            if keep is not None:
                keep(worker, request_type, status, result)
    elif keep is not None:
        keep(worker, request_type, status, result)
