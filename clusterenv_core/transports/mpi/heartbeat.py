"""Heartbeats from worker ranks on other hosts to the learner.

A peer on the same host is watched through its pid and the doorbell's end-of-file. Across hosts
neither exists, and a partition or a host that lost power closes no connection: MPI's messages just
stop. So each worker rank on another host sends the learner a one-byte beat at an interval, as a
synchronous send (``Issend``): it completes only once the learner has received it, which tells the
worker that its learner is alive and reachable. The learner (:class:`BeatListener`) receives the
beats and raises ``WorkerLostError`` for a worker that fell silent while it waits for it; a worker
(:class:`BeatSender`) whose beats go unreceived exits. Silence is told from a slow step: a worker
busy in a long ``env.step`` still beats, a cut-off host does not. The learner never sends a beat:
MPICH crashed sending to a rank it knew had failed (``mpiexec -disable-auto-cleanup``). A closing
worker's last beat says goodbye, and the learner receives every goodbye before it disconnects: an
unreceived synchronous send would keep both sides in ``MPI_Comm_disconnect``/``MPI_Finalize``.

Only one thread is ever inside MPI (``MPI_THREAD_SERIALIZED``). The owner holds ``mpi_lock``
(:func:`holding_mpi_lock`) in every method that calls MPI; a daemon thread beats while the owner is
elsewhere (stepping envs, training). When the owner holds the lock, the thread marks a beat due
instead, and the owner beats when it next enters one of those methods, or from its wait if that
lasts.
"""

from __future__ import annotations

import abc
import functools
import threading
import time
from typing import Any, Callable

from clusterenv_core.transports.mpi.wire import TAG_HEARTBEAT

DEFAULT_INTERVAL = 1.0
DEFAULT_TIMEOUT = 30.0
_BEAT, _GOODBYE = 0, 1  # the beat's one byte
_GOODBYE_POLL = 1e-3
GOODBYE_TIMEOUT = 10.0  # longest wait for a goodbye, each side


def threads_allowed(MPI: Any) -> bool:
    """Whether this process may call MPI from a second thread, one thread at a time."""
    return MPI.Query_thread() >= MPI.THREAD_SERIALIZED


def holding_mpi_lock(method):
    """Run ``method`` holding ``self.mpi_lock`` while ``self.heartbeat`` (a :class:`Heartbeat` or
    ``None``: no thread, no lock) runs, so that no beat enters MPI meanwhile; first beat if one is due."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        heartbeat = self.heartbeat
        if heartbeat is None:
            return method(self, *args, **kwargs)
        with self.mpi_lock:
            if heartbeat.due:
                heartbeat.beat()
            return method(self, *args, **kwargs)

    return locked


class Heartbeat(abc.ABC):
    """What both sides share: a daemon thread that calls :meth:`beat` every half interval, taking
    turns with the owner in MPI.

    :param comm: the communicator the peers are on
    :param interval: seconds between beats
    :param mpi_lock: the owner's lock, held by whoever calls MPI
    :param on_beat: called after each round of the thread
    """

    def __init__(
        self, comm: Any, interval: float, mpi_lock: threading.RLock, on_beat: Callable[[], None] | None = None
    ) -> None:
        self.comm, self.interval = comm, interval
        self.mpi_lock = mpi_lock
        self.on_beat = on_beat
        self.due = False  # the thread found the owner inside MPI when a round was due
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="clusterenv-mpi-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @abc.abstractmethod
    def beat(self) -> None:
        """One round (the caller holds ``mpi_lock``)."""

    def _run(self) -> None:
        while not self._stop.wait(self.interval / 2):
            if not self.mpi_lock.acquire(blocking=False):
                self.due = True  # the owner is inside MPI: it beats
                continue
            try:
                if self._stop.is_set():
                    return
                self.beat()
                if self.on_beat is not None:
                    self.on_beat()
            finally:
                self.mpi_lock.release()

    def stop(self) -> None:
        """Stop the thread (waits for its current round)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.interval + 5.0)


class BeatSender(Heartbeat):
    """A worker's beats to its learner; :meth:`silent_for` says how long none was received.

    :param learner: the learner's rank in ``comm``
    """

    def __init__(self, comm: Any, learner: int, interval: float, mpi_lock: threading.RLock, on_beat=None) -> None:
        super().__init__(comm, interval, mpi_lock, on_beat)
        self.learner = learner
        self.last_received = time.monotonic()  # when a beat was last known to be received
        self.next_beat = 0.0
        self._request: Any = None  # the beat in flight
        self._data = bytearray([_BEAT])

    def beat(self) -> None:
        self.due = False
        now = time.monotonic()
        if self._request is not None:
            if not self._request.Test():
                return  # not received yet: the learner is busy, or gone
            self._request = None
            self.last_received = now
        if now >= self.next_beat:
            self.next_beat = now + self.interval
            self._request = self.comm.Issend(self._data, dest=self.learner, tag=TAG_HEARTBEAT)

    def silent_for(self) -> float:
        """Seconds since a beat was last received by the learner (call after :meth:`beat`)."""
        return time.monotonic() - self.last_received

    def goodbye(self, timeout: float) -> bool:
        """Stop beating and send the last beat, which says goodbye; whether the learner received it
        within ``timeout`` (the caller holds ``mpi_lock``)."""
        self.stop()
        deadline = time.monotonic() + timeout
        if self._request is not None and not _completes(self._request, deadline):
            return False
        self._data[0] = _GOODBYE
        self._request = self.comm.Issend(self._data, dest=self.learner, tag=TAG_HEARTBEAT)
        return _completes(self._request, deadline)


class BeatListener(Heartbeat):
    """The learner's side: receives the beats of some workers.

    :param ranks: the beating workers' ranks in ``comm``, by worker index
    """

    def __init__(self, comm: Any, ranks: dict[int, int], interval: float, mpi_lock: threading.RLock) -> None:
        super().__init__(comm, interval, mpi_lock)
        self.ranks = dict(ranks)
        now = time.monotonic()
        self.last_heard = {worker: now for worker in self.ranks}
        self.said_goodbye: set[int] = set()
        self._sink = bytearray(1)

    def beat(self) -> None:
        self.due = False
        comm = self.comm
        for worker, rank in self.ranks.items():
            while True:
                message = comm.Improbe(rank, TAG_HEARTBEAT)
                if message is None:
                    break
                message.Recv(self._sink)
                self.last_heard[worker] = time.monotonic()
                if self._sink[0] == _GOODBYE:
                    self.said_goodbye.add(worker)

    def await_goodbyes(self, workers: set[int], timeout: float) -> None:
        """Stop the thread and receive beats until each of ``workers`` (those among ours) has said
        goodbye, or ``timeout`` passes (the caller holds ``mpi_lock``)."""
        self.stop()
        waiting = set(workers) & set(self.ranks)
        deadline = time.monotonic() + timeout
        while True:
            self.beat()
            if waiting <= self.said_goodbye or time.monotonic() >= deadline:
                return
            time.sleep(_GOODBYE_POLL)

    def silent_for(self, worker: int) -> float:
        """Seconds since ``worker`` was last heard from (call after :meth:`beat`)."""
        return time.monotonic() - self.last_heard[worker]


def _completes(request: Any, deadline: float) -> bool:
    """Whether ``request`` completes before ``deadline`` (polled)."""
    while not request.Test():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_GOODBYE_POLL)
    return True
