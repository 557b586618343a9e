"""The interface every backend implements: how the learner reaches its workers and back.

A backend is one module (or package) with a :class:`Transport` (learner side) and a
:class:`WorkerConnection` (worker side). It carries the requests and replies of
:mod:`clusterenv_core.protocol` without knowing what any of them means: requests and replies are
picklable objects, and the protocol itself says when rows or arrays follow one. A step is special:
it moves the action rows of a worker's block to the worker and the result rows back, and must be
as cheap as the backend allows, so it has its own calls. Arrays travel in
:class:`~clusterenv_core.buffers.BatchBuffers`: the local backend shares them, the MPI backend ships
the rows with buffer messages; the pool and the worker never see the difference.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from clusterenv_core.buffers import BatchBuffers, BatchSpec, Field


@dataclasses.dataclass(frozen=True)
class WorkerNames:
    """How a pool's messages name its workers and their envs.

    A learner's pool says ``worker 3 (pid 4211, envs 4-7)``. The inner pool of a node agent names
    its workers as the agent's local processes, and their envs by the learner's indices, so that
    its errors and restart reasons reach the learner as they are:
    ``local process 1 of worker 0 (a node agent; pid 977, envs 2-3)``.

    :param agent: the worker whose node agent runs the pool (``None``: the learner's pool)
    :param first_env: the learner's index of the pool's env 0
    """

    agent: int | None = None
    first_env: int = 0

    def worker(self, worker: int) -> str:
        """``worker 3``, or ``local process 3 of worker 0 (a node agent)``."""
        if self.agent is None:
            return f"worker {worker}"
        return f"local process {worker} of worker {self.agent} (a node agent)"

    def envs(self, block: range) -> str:
        """``", envs 4-7"`` (``", env 4"`` for one): the envs of ``block`` (the pool's indices) by
        the learner's indices (empty for no envs)."""
        if not block:
            return ""
        first, last = self.first_env + block.start, self.first_env + block.stop - 1
        return f", env {first}" if first == last else f", envs {first}-{last}"

    def process(self, worker: int, pid: int, block: range) -> str:
        """``worker 3 (pid 4211, envs 4-7)``, or
        ``local process 1 of worker 0 (a node agent; pid 977, envs 2-3)``."""
        if self.agent is None:
            return f"worker {worker} (pid {pid}{self.envs(block)})"
        return f"local process {worker} of worker {self.agent} (a node agent; pid {pid}{self.envs(block)})"


class RequestNotSent(KeyboardInterrupt):
    """Ctrl-C while a request was being pickled, before any of it was sent: no reply will come.
    (Ctrl-C while it is written raises a plain ``KeyboardInterrupt``: it may be out.)"""


@contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back while the body runs, then deliver it once, as its handler takes it
    (``KeyboardInterrupt`` by default), also if the body raised.

    For what must be short and bounded and not be cut short: the release at the end of ``close()``
    (run after a first Ctrl-C, a second one, the user pressing again while it waits for the workers
    to exit, would leave workers running), and the receive of the rows and arrays that follow a
    reply already read (the reply would be lost). Only the main thread runs Python's signal
    handlers and can set them; elsewhere, or with a SIGINT handler set outside Python, the body
    runs as is.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    held: list[int] = []
    handler = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if held:
            signal.raise_signal(signal.SIGINT)


class Transport(ABC):
    """Learner side of a backend: starts the workers and talks to each of them.

    Every receive takes a ``timeout`` in seconds and raises
    :class:`~clusterenv_core.errors.WorkerTimeoutError` when it expires, or
    :class:`~clusterenv_core.errors.WorkerLostError` as soon as the backend knows the worker is gone.
    """

    num_workers: int
    #: workers that timed out or were lost; they get no more messages and ``close`` kills them at once
    failed: set[int]
    #: whether workers see the learner's regions directly (else ``send_arrays``/``recv_arrays`` copy them)
    shares_memory: bool = False
    #: set by the pool that owns the transport: shuts that pool down. A backend whose own exit
    #: handling must come after its pools have closed (MPI finalization) calls it at exit.
    exit_hook: Callable[[], None] | None = None
    #: set by the pool that owns the transport: the env indices of each worker (for error messages)
    blocks: tuple[range, ...] = ()
    #: set by the pool that owns the transport: how error messages name its workers and envs
    names: WorkerNames = WorkerNames()
    #: set by the pool that owns the transport: modules the workers' env factories name, which every
    #: worker will import (a backend may import them ahead, for all its workers at once)
    worker_modules: tuple[str, ...] = ()
    #: whether a worker runs inside the learner's process (where a policy copy would set torch's
    #: threads and seed for the learner)
    has_inline_worker: bool = False
    #: set by the pool that owns the transport: what makes a node agent's block (``processes_per_worker``
    #: > 1) for workers the transport starts without the worker program's entry (an MPI SPMD rank
    #: turning worker in this process, a Ray actor): a transport cannot import it, as it stands
    #: above the pool
    agent_block: Callable[..., Any] | None = None

    def envs_of(self, worker: int) -> str:
        """``", envs 4-7"``: the envs of ``worker``, for error messages (empty without blocks)."""
        return self.names.envs(self._block(worker))

    def process_named(self, worker: int, pid: int) -> str:
        """``worker 3 (pid 4211, envs 4-7)``: the worker, process ``pid``, as :attr:`names` says it."""
        return self.names.process(worker, pid, self._block(worker))

    def _block(self, worker: int) -> range:
        return self.blocks[worker] if worker < len(self.blocks) else range(0)

    def default_num_workers(self) -> int | None:
        """How many workers this backend has to offer (e.g. the worker ranks of an MPI launch), or
        ``None`` to let the pool choose."""
        return None

    def default_processes_per_worker(self) -> int | None:
        """How many local processes each of :meth:`default_num_workers`'s workers should run (e.g.
        the CPUs of a Ray node, for one node agent per node), or ``None`` for one."""
        return None

    @abstractmethod
    def worker_pids(self) -> list[int]:
        """The process id of each worker (on its own host), for monitoring."""

    def replacements(self) -> list[dict[str, Any]]:
        """Each replacement of a lost worker so far, where the backend records where the lost and
        the new worker ran (the Ray backend does); empty otherwise."""
        return []

    def workers_on_this_host(self) -> int:
        """How many workers run on the learner's machine and share its cores (all, unless the
        backend knows better)."""
        return self.num_workers

    @abstractmethod
    def start(self, num_workers: int, timeout: float) -> None:
        """Launch (or attach to) ``num_workers`` workers that wait for their first message."""

    @abstractmethod
    def send(self, worker: int, message: Any) -> None:
        """Send a request to one worker (:class:`RequestNotSent` for Ctrl-C while it is pickled)."""

    @abstractmethod
    def recv(self, worker: int, timeout: float) -> Any:
        """Receive the next reply of one worker.

        Every receive raises :class:`~clusterenv_core.errors.WorkerTimeoutError` when the worker sent
        nothing for ``timeout`` seconds since the last message sent to or received from it: workers
        serving requests at once have that long each, however late their replies are read, and a
        reply that came is read however late.
        """

    def recv_rows(self, worker: int, timeout: float) -> None:
        """Receive the result rows that follow a reply (see :mod:`clusterenv_core.protocol`); afterwards
        they are in the buffers. Nothing to do where the buffers are shared."""

    @abstractmethod
    def share_buffers(self, spec: BatchSpec, blocks: list[range]) -> BatchBuffers:
        """Allocate the learner's batch buffers; ``blocks[w]`` are the env rows of worker ``w``.

        Workers map their side when they receive the ``attach`` message that follows.
        """

    @abstractmethod
    def send_step(self, worker: int) -> None:
        """Start a step on one worker: its action rows are in the buffers."""

    @abstractmethod
    def recv_step(self, worker: int, timeout: float) -> Any:
        """Wait for one worker's step reply; afterwards its result rows are in the buffers."""

    @abstractmethod
    def wait_steps(self, workers: list[int], timeout: float) -> list[int]:
        """Wait up to ``timeout`` until the step reply of at least one of ``workers`` (each stepping)
        can be received; those whose replies can, in the order of ``workers`` (empty when none
        could in time: the caller decides who timed out). A lost worker is returned at once: its
        receive reports it."""

    def share_region(self, nbytes: int) -> tuple[Any, memoryview]:
        """Extra memory for the workers (rollout segments, policy weights): ``(handle, memory)``.

        Workers map it with :meth:`WorkerConnection.map_region`. Where memory is not shared, the
        contents move with :meth:`send_arrays` and :meth:`recv_arrays`, and the region is the
        learner's own memory (a :class:`~clusterenv_core.transports.learner_regions.LearnerRegions`
        holds such regions).
        """
        raise NotImplementedError(f"{type(self).__name__} has no extra regions")

    def release_region(self, handle: Any) -> None:
        """Free a region of :meth:`share_region` that the learner no longer uses; its memory goes
        once no view of it is left. Workers drop theirs when they no longer use it."""
        raise NotImplementedError(f"{type(self).__name__} has no extra regions")

    def send_arrays(self, worker: int, arrays: list) -> None:
        """Make the worker's copies of ``arrays`` (numpy views of a region) equal the learner's."""
        raise NotImplementedError(f"{type(self).__name__} cannot move arrays")

    def recv_arrays(self, worker: int, arrays: list, timeout: float) -> None:
        """Receive the worker's copies of ``arrays`` into them (sent with ``WorkerConnection.send_arrays``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot move arrays")

    def restart(self, worker: int, timeout: float) -> None:
        """Replace a lost or stuck worker by a new one waiting for its first message.

        :raises NotImplementedError: the backend cannot replace workers
        """
        raise NotImplementedError(f"{type(self).__name__} cannot replace workers")

    def displaced_workers(self) -> list[int]:
        """Workers whose replacement had to start outside the place reserved for them (no node had
        room), where that place has room again; empty on backends that reserve no places."""
        return []

    def move_back(self, worker: int, timeout: float) -> None:
        """Replace a displaced worker (:meth:`displaced_workers`) by a new one in its own place,
        waiting for its first message.

        :raises NotImplementedError: the backend reserves no places
        """
        raise NotImplementedError(f"{type(self).__name__} reserves no places for workers")

    @abstractmethod
    def close(self, timeout: float, closed: set[int]) -> None:
        """Make every worker exit (killing those that do not within ``timeout``) and free resources.

        Idempotent. ``closed`` are the workers that answered their close request; the others may be
        stuck or gone.
        """


class WorkerConnection(ABC):
    """Worker side of a backend."""

    @abstractmethod
    def recv(self) -> Any:
        """Block for the next message; :data:`~clusterenv_core.protocol.STEP` for a step (action rows are then in the buffers).

        Returns ``None`` when the learner is gone, so the worker exits.
        """

    @abstractmethod
    def send(self, message: Any) -> None:
        """Send a reply (interim or final) to the last request.

        Pickle it before sending anything: a reply that cannot be pickled must raise with nothing
        sent, so the worker can send an error reply in its place.
        """

    def learner_alive(self) -> bool:
        """Whether the learner still holds its end, for a worker that waits on it outside :meth:`recv`
        (on weights the learner is writing into shared memory). ``True`` where the backend shares no
        such memory."""
        return True

    def request_waiting(self) -> bool:
        """Whether a request from the learner came in that :meth:`recv` would return without waiting
        (or the learner is gone, which :meth:`recv` then reports): a worker collecting a rollout
        segment asks now and then, and ends the segment early if so. ``False`` where the worker
        never collects one (a worker in the learner's process)."""
        return False

    def send_rows(self) -> None:
        """Send this worker's result rows after a reply (see :mod:`clusterenv_core.protocol`).
        Nothing to do where the buffers are shared."""

    @abstractmethod
    def attach(self, spec: BatchSpec, block: range) -> tuple[BatchBuffers, int]:
        """Map this worker's buffers; returns them and the row of the block's first env in them."""

    @abstractmethod
    def send_step(self, reply: Any) -> None:
        """Reply to a step: the result rows of this worker's block are in the buffers. As with
        :meth:`send`, a reply that cannot be pickled raises before anything is sent."""

    def map_region(self, handle: Any, fields: list[Field], num_envs: int, block: range) -> tuple[dict, int]:
        """Views of a region the learner laid out with ``fields`` for ``num_envs`` envs, and the row
        of this worker's first env in them (the region may hold only this worker's rows)."""
        raise NotImplementedError(f"{type(self).__name__} has no extra regions")

    def send_arrays(self, arrays: list) -> None:
        """Send this worker's rows of a region's arrays to the learner."""
        raise NotImplementedError(f"{type(self).__name__} cannot move arrays")

    def recv_arrays(self, arrays: list) -> None:
        """Receive arrays sent with :meth:`Transport.send_arrays`."""
        raise NotImplementedError(f"{type(self).__name__} cannot move arrays")

    def close(self) -> None:
        """Release the connection before the worker exits."""

