"""A worker inside the learner's process: the local backend's ``inline_worker`` option.

With one worker per core, the learner is one process more than there are cores: its own work each
step (the adapter, the messages) shares a core with a worker, and that worker waits for a wake-up
every step. An inline worker puts the last block of envs in the learner's process instead. The
learner steps that block itself, right after it has sent the worker processes their step, so the
machine runs as many busy processes as it has cores.

What that costs, and why it is an option: the inline block's envs share the learner's fate, as
under ``DummyVecEnv``. No timeout applies to them (an env that hangs, hangs the learner), and an
env that crashes the interpreter takes the learner with it. A policy copy would set torch's threads
and seed for the learner's whole process, so worker-side inference is refused. Replies still go
through pickle, as a worker process's do: the learner gets copies of the infos, never the envs' own
objects, which an env may change at its next step (``DummyVecEnv`` deep-copies them for that reason).
A step's infos of plain values only (MuJoCo's and Atari's) are copied as dicts instead, which gives
the same result at half the cost.
"""

from __future__ import annotations

import _signal  # signal's own functions without its wrappers' enum lookups: 1 µs a step instead of 15
import signal
import threading
from collections import deque
from typing import Any

from clusterenv_core.protocol import OK_NONE, SCALAR_TYPES, dumps, loads
from clusterenv_core.transports.local.memory_file import MemoryFileConnection
from clusterenv_core.worker.serving import Worker


class InlineConnection(MemoryFileConnection):
    """The worker side of an inline worker: requests come by call, replies wait in a queue.

    :param memory_fd: the local backend's memory file (mapped again, as a worker process maps it)
    """

    def __init__(self, memory_fd: int) -> None:
        super().__init__(memory_fd)
        self.replies: deque = deque()

    def recv(self) -> Any:
        raise RuntimeError("an inline worker gets its requests by call (InlineWorker.request)")

    def send(self, message: Any) -> None:
        # A reply that cannot be pickled raises here, as with the other backends, and becomes an
        # error reply naming its env.
        if message is not OK_NONE:
            message = _copy_of_plain_infos(message) or loads(dumps(message), "the learner")
        self.replies.append(message)

    send_step = send

    def close(self) -> None:
        if self.memory is not None:
            try:
                self.memory.close()
            except BufferError:  # the block's views still exist; the mapping goes with them
                pass


# Immutable values: a new dict holding the same ones is as much a copy as pickle's.
_PLAIN_VALUE_TYPES = frozenset((bool, int, float, str, type(None), *SCALAR_TYPES))


def _copy_of_plain_infos(reply: tuple) -> tuple | None:
    """A copy of a step reply that carries nothing but infos, each a plain dict of string keys and
    immutable values; ``None`` for any other reply."""
    status, parts = reply
    if type(parts) is not dict or len(parts) != 1 or "infos" not in parts:
        return None
    infos = {}
    for index, info in parts["infos"].items():
        if type(info) is not dict:
            return None
        for key, value in info.items():
            if type(key) is not str or type(value) not in _PLAIN_VALUE_TYPES:
                return None
        infos[index] = info.copy()
    return status, {"infos": infos}


class InlineWorker:
    """A :class:`~clusterenv_core.worker.serving.Worker` run by the learner, one request at a time.

    Ctrl-C while it runs one is held until the request is done and delivered when the learner
    next takes one of its replies, so it interrupts the learner's wait, as with worker processes,
    and never an env half-way (which the env's failure handling would take for the env's failure).

    :param memory_fd: the local backend's memory file
    """

    def __init__(self, memory_fd: int) -> None:
        self.connection = InlineConnection(memory_fd)
        self.worker = Worker(self.connection)
        self._held_interrupt: Any = None  # the SIGINT handler to call for an interrupt held back

    def request(self, message: Any) -> None:
        """Run ``message`` now; its replies wait for :meth:`reply`."""
        if threading.current_thread() is not threading.main_thread() or _signal.getsignal(signal.SIGINT) is None:
            self.worker.handle(message)  # signals reach the main thread only; None: a handler set outside Python
            return
        held = []
        handler = _signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
        try:
            self.worker.handle(message)
        finally:
            _signal.signal(signal.SIGINT, handler)
            if held:
                self._held_interrupt = handler

    def has_reply(self) -> bool:
        return bool(self.connection.replies)

    def reply(self) -> Any:
        """The oldest reply not yet taken (after delivering a held interrupt: it stays queued then)."""
        handler, self._held_interrupt = self._held_interrupt, None
        if callable(handler):
            handler(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt
        elif handler is not None:
            signal.raise_signal(signal.SIGINT)  # SIG_DFL or SIG_IGN, as the learner set it
        if not self.connection.replies:
            raise RuntimeError("the inline worker has no reply waiting: a receive without its request")
        return self.connection.replies.popleft()

    def close(self) -> None:
        """Close the envs the worker still has, however the pool ended."""
        self.worker.shutdown()
