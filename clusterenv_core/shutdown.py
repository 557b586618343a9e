"""Ending a pool's workers: each closes its envs and exits, or is ended.

:func:`shutdown` runs when the pool closes, or as the finalizer of its
:class:`~clusterenv_core.channel.WorkerChannel` (at interpreter exit, or when the pool is dropped
unclosed); so it takes the transport and the channel's bookkeeping, never the channel itself.
"""

from __future__ import annotations

import os
import time
import warnings

from clusterenv_core import protocol
from clusterenv_core.errors import CloseTimeoutWarning, ClusterEnvError, EnvError, WorkerTimeoutError, user_stacklevel
from clusterenv_core.protocol import ERROR, PROGRESS
from clusterenv_core.replies import read_reply, remote_error
from clusterenv_core.transports import Transport

CLOSE_TIMEOUT = 5.0


def _warn_close_timeout(what: str) -> None:
    warnings.warn(f"{what}; its worker was ended", CloseTimeoutWarning, stacklevel=user_stacklevel())


def shutdown(
    transport: Transport, awaiting: dict[int, type | None], reply_arrays: dict[int, list], timeout: float, owner: int
) -> EnvError | None:
    """Ask every worker to close its envs and exit, then make sure they have; returns the error of
    the first env whose ``close()`` raised.

    :param transport: the pool's transport
    :param awaiting: the channel's unread replies: the type of each worker's request (``None``: a step)
    :param reply_arrays: where the arrays that follow some of those replies go (a rollout's segment)
    :param timeout: the pool's timeout
    :param owner: the process id of the pool's process

    Workers collecting a rollout segment are asked to close first, and end the segment at their next
    step. Workers still busy with a request (a stuck step, say) have ``CLOSE_TIMEOUT`` seconds to
    answer it, one deadline for all however many are stuck; the workers asked to close then have
    ``timeout`` seconds (at least as long), again one deadline for all, as closing an env may take
    a while (a video recorder finishing its file). Those that do not are killed. At interpreter exit
    it runs as the channel's finalizer, which drops what it returns.
    In a process forked from the ``owner`` (a data loader's worker, say) it does nothing: the
    workers are the owner's.
    """
    if os.getpid() != owner:
        return None
    deadline = time.monotonic() + CLOSE_TIMEOUT

    def remaining(floor: float = 0.01) -> float:  # the floor still reads replies already there
        return max(deadline - time.monotonic(), floor)

    names = transport.names
    asked: dict[int, float] = {}  # the workers asked to close, and when
    closed: set[int] = set()
    first_error = None
    interrupted = False
    try:
        # Workers collecting a segment are asked first: they end it at their next step instead of
        # running out the deadline (and being killed, which leaves an MPI process unable to spawn).
        for worker, request_type in list(awaiting.items()):
            if request_type is not None and request_type.ENDED_BY_NEXT_REQUEST and worker not in transport.failed:
                try:
                    transport.send(worker, protocol.Close())
                    asked[worker] = time.monotonic()
                except ClusterEnvError:
                    awaiting.pop(worker, None)
        for worker in range(transport.num_workers):
            if worker in transport.failed:
                continue
            try:
                # A pending reply first, so the close reply is the next one; Ctrl-C in the receive
                # of its rows or arrays waits for them (until the deadline), as in the pool's calls.
                if worker in awaiting:
                    request_type = awaiting.pop(worker)
                    try:
                        read_reply(transport, worker, request_type, remaining(), reply_arrays.pop(worker, None))
                    except WorkerTimeoutError:
                        doing = "a step" if request_type is None else f"a {request_type.__name__} request"
                        _warn_close_timeout(
                            f"{names.worker(worker)} was still in {doing} {CLOSE_TIMEOUT:g} s after close() began"
                        )
                        raise
                if worker not in asked:
                    transport.send(worker, protocol.Close())
                    asked[worker] = time.monotonic()
            except ClusterEnvError:
                awaiting.pop(worker, None)
                asked.pop(worker, None)  # its pending reply never came: no close reply to wait for
        deadline = time.monotonic() + max(timeout, CLOSE_TIMEOUT)
        for worker, asked_at in asked.items():
            closing = None  # the env whose close() the worker started last
            # A receive's timeout counts from its last contact: to the deadline from there.
            last_contact = asked_at
            try:
                status, result = transport.recv(worker, max(deadline - last_contact, 0.01))
                while status == PROGRESS:
                    closing, last_contact = result, time.monotonic()
                    status, result = transport.recv(worker, max(deadline - last_contact, 0.01))
            except WorkerTimeoutError:
                what = f"env {names.first_env + closing}" if closing is not None else "its envs"
                took = time.monotonic() - asked_at
                _warn_close_timeout(f"{what} on {names.worker(worker)} did not finish close() within {took:.3g} s")
                continue
            except ClusterEnvError:
                continue
            closed.add(worker)
            if status == ERROR and first_error is None:
                first_error = remote_error(worker, result, "close")
    except KeyboardInterrupt:
        interrupted = True  # Ctrl-C at a close that takes long: the workers are killed now
        raise
    finally:
        awaiting.clear()
        reply_arrays.clear()  # views of regions that the transport unmaps
        transport.close(0.0 if interrupted else remaining(floor=1.0), closed)  # a second for the closed ones to exit
    return first_error
