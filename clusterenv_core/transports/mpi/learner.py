"""The learner side of the MPI backend: starting (or finding) the worker ranks and talking to them."""

from __future__ import annotations

import functools
import os
import pickle
import secrets
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from clusterenv_core.buffers import BatchBuffers, BatchSpec
from clusterenv_core.checks import check_seconds
from clusterenv_core.errors import ClusterEnvError, WorkerLostError, WorkerTimeoutError
from clusterenv_core.interpreter import interpreter_flags
from clusterenv_core.protocol import OK_NONE, dumps, loads
from clusterenv_core.transports.base import RequestNotSent, Transport, ctrl_c_held
from clusterenv_core.transports.learner_regions import LearnerRegions
from clusterenv_core.transports.mpi.heartbeat import (
    DEFAULT_INTERVAL,
    DEFAULT_TIMEOUT,
    GOODBYE_TIMEOUT,
    BeatListener,
    holding_mpi_lock,
    threads_allowed,
)
from clusterenv_core.transports.mpi.launcher import process_manager
from clusterenv_core.transports.mpi.parting import abort_at_exit, kill_spawned, wait_for_exits
from clusterenv_core.transports.mpi.runtime import HOST, State, mpi, pid_alive, pm_exited, unlink_shared_memory_names
from clusterenv_core.transports.mpi.waiting import MIN_NAP, Doorbell, PeerGone, Probe, accept_doorbells, poll
from clusterenv_core.transports.mpi.wire import (
    ALIGN,
    HEADER,
    TAG_ARRAYS,
    TAG_BELL,
    TAG_CONFIG,
    TAG_HELLO,
    TAG_PAYLOAD,
    TAG_REPLY,
    TAG_REQUEST,
    TAG_RESULT,
    TAG_STEP,
    address,
    block_type,
    result_arrays,
    row_bytes,
)
from clusterenv_core.transports.mpi.worker import serve_as_worker

_ARRAYS_TIMEOUT = 60.0
_START_TIMEOUT = 60.0  # at least this long for ranks to start (interpreters, imports): slow is not stuck
# After Ctrl-C in close(): how long disconnected ranks may take to exit (they do in some 30 ms)
# before they are killed, which would keep this process from spawning again.
_EXIT_GRACE = 1.0


class MPITransport(Transport):
    """Learner side of the MPI backend (launch modes: see :mod:`clusterenv_core.transports.mpi`).

    :param launch: ``"auto"`` (spawn when ``COMM_WORLD`` has one rank, else world), ``"spawn"`` or ``"world"``
    :param python: interpreter of spawned workers (default: this one)
    :param spawn_info: MPI info keys for ``Spawn`` (e.g. ``{"hosts": "node1,node2"}``)
    :param mpiexec: MPICH's ``mpiexec`` for the first spawn of a singleton (default: found)
    :param isolate: start that process manager in its own session, so a dying worker cannot kill the learner
    :param spin: seconds the learner polls a reply without sleeping
    :param max_sleep: longest nap of the learner while it polls
    :param worker_spin: seconds a worker polls for the next message without sleeping
    :param worker_max_sleep: longest nap of an idle worker
    :param liveness_interval: seconds between checks that a silent peer still exists
    :param doorbell: wake peers on the learner's host through a Unix socket instead of polling
    :param heartbeat_interval: seconds between the heartbeats of worker ranks on other hosts
    :param heartbeat_timeout: a worker rank on another host silent this long is lost (``WorkerLostError``
        while the learner waits for it, sooner than the pool's ``timeout``), and a worker rank whose
        beats the learner has not received this long exits; 0 turns heartbeats off
    """

    shares_memory = False

    def __init__(
        self,
        launch: str = "auto",
        python: str | None = None,
        spawn_info: dict[str, str] | None = None,
        mpiexec: str | None = None,
        isolate: bool = True,
        spin: float = 50e-6,
        max_sleep: float = 200e-6,
        worker_spin: float = 1e-3,
        worker_max_sleep: float = 1e-3,
        liveness_interval: float = 0.25,
        doorbell: bool = True,
        heartbeat_interval: float = DEFAULT_INTERVAL,
        heartbeat_timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if launch not in ("auto", "spawn", "world"):
            raise ValueError(f"launch must be 'auto', 'spawn' or 'world', got {launch!r}")
        for name, value in (
            ("spin", spin),
            ("max_sleep", max_sleep),
            ("worker_spin", worker_spin),
            ("worker_max_sleep", worker_max_sleep),
            ("liveness_interval", liveness_interval),
            ("heartbeat_timeout", heartbeat_timeout),
        ):
            check_seconds(name, value, allow_zero=True)
        check_seconds("heartbeat_interval", heartbeat_interval)
        if heartbeat_timeout and heartbeat_timeout < 2 * heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({heartbeat_timeout:g} s) must be at least twice heartbeat_interval "
                f"({heartbeat_interval:g} s), or 0 for no heartbeats"
            )
        self.launch = launch
        self.python = python or sys.executable
        self.spawn_info = dict(spawn_info or {})
        self.mpiexec = mpiexec
        self.isolate = bool(isolate)
        self.spin, self.max_sleep = float(spin), max(float(max_sleep), MIN_NAP)
        self.worker_spin, self.worker_max_sleep = float(worker_spin), max(float(worker_max_sleep), MIN_NAP)
        self.liveness_interval = max(float(liveness_interval), 0.01)
        self.doorbell = bool(doorbell)
        self.heartbeat_interval, self.heartbeat_timeout = float(heartbeat_interval), float(heartbeat_timeout)
        self.heartbeat: BeatListener | None = None
        self.mpi_lock = threading.RLock()  # held in every method that calls MPI (heartbeat.py)
        self._bells: list[Doorbell | None] = []
        self.failed: set[int] = set()
        self.mode: str | None = None
        self.comm: Any = None
        self.ranks: list[int] = []
        self.pids: list[int] = []
        self.hosts: list[str] = []
        self._closed = False
        self._sends: list[list] = []  # per worker: (request, buffer) of sends not known complete
        self._result_requests: list = []
        self._action_requests: list = []
        self._result_messages: list = []
        self._action_messages: list = []
        self._datatypes: list = []
        self._memory: bytearray | None = None
        self._headers: np.ndarray | None = None
        self._regions = LearnerRegions()

    @property
    def num_workers(self) -> int:
        return len(self.ranks)

    def worker_pids(self) -> list[int]:
        return list(self.pids)  # reported by the ranks at the handshake

    def workers_on_this_host(self) -> int:
        return sum(host == HOST for host in self.hosts)

    def default_num_workers(self) -> int | None:
        """The number of worker ranks a world launch provides (``None`` in spawn mode)."""
        MPI = mpi()
        size = MPI.COMM_WORLD.Get_size()
        if self.launch == "spawn" or (self.launch == "auto" and size == 1):
            return None
        return size - 1

    # -- start ------------------------------------------------------------------------------------

    @holding_mpi_lock
    def start(self, num_workers: int, timeout: float) -> None:
        timeout = max(timeout, _START_TIMEOUT)
        MPI = mpi()
        world = MPI.COMM_WORLD
        mode = self.launch
        if mode == "auto":
            mode = "spawn" if world.Get_size() == 1 else "world"
        if mode == "world":
            if world.Get_size() == 1:
                raise ValueError(
                    "launch='world' needs worker ranks: run under mpiexec with more than one rank "
                    "(e.g. mpiexec -n 1 python train.py : -n 4 python -m clusterenv_core.worker)"
                )
            if world.Get_rank() != 0:
                serve_as_worker(self.agent_block)  # SPMD: this rank becomes a worker and never returns
            self._start_world(num_workers, timeout)
        else:
            self._start_spawn(num_workers, timeout)
        State.live.add(self)

    def _start_spawn(self, num_workers: int, timeout: float) -> None:
        MPI = State.MPI
        # Once a spawned rank died or was killed, MPICH's process manager ends every spawned rank and
        # then itself; a spawn in the meantime can hang or crash in MPI_Comm_spawn.
        if State.finalize_unsafe or pm_exited():
            raise ClusterEnvError(
                "MPI's process manager of this process ended, or is ending, after an earlier worker loss "
                "(a spawned rank died, or close() killed a stuck one); this process cannot spawn MPI workers "
                "anymore (start a new process)"
            )
        info = MPI.Info.Create()
        try:
            info.Set("wdir", os.getcwd())
            for key, value in self.spawn_info.items():
                info.Set(str(key), str(value))
            # The learner's interpreter flags (-W, -X dev, -O, ...), as the local backend's workers get them.
            args = [*interpreter_flags(self.python), "-m", "clusterenv_core.worker", "mpi", "spawn"]
            with process_manager(self.mpiexec, self.isolate):
                self.comm = MPI.COMM_SELF.Spawn(self.python, args, maxprocs=num_workers, info=info)
        finally:
            info.Free()
        self.mode = "spawn"
        self._handshake(list(range(num_workers)), timeout)

    def _start_world(self, num_workers: int, timeout: float) -> None:
        MPI = State.MPI
        if State.world_used:
            raise ClusterEnvError(
                "the worker ranks of this MPI job already served a pool and have exited: a world launch "
                "(mpiexec with several ranks) serves one pool; use launch='spawn' for more"
            )
        State.world_used = True
        self.comm = MPI.COMM_WORLD
        self.mode = "world"
        available = self.comm.Get_size() - 1
        self._handshake(list(range(1, available + 1)), timeout)
        if num_workers != available:
            # Raised with the ranks connected, so the pool's shutdown can still close them.
            raise ValueError(
                f"this MPI job has {available} worker ranks (COMM_WORLD size {available + 1}) but the pool asked "
                f"for num_workers={num_workers}: pass num_workers={available}"
            )

    def _handshake(self, ranks: list[int], timeout: float) -> None:
        """Learn each worker's pid and host, then tell it its index and how to poll."""
        MPI = State.MPI
        self.ranks = ranks
        count = len(ranks)
        self.pids, self.hosts = [0] * count, [""] * count
        threads = [False] * count
        self._sends = [[] for _ in range(count)]
        self._result_requests = [None] * count
        self._action_requests = [None] * count
        # Of the last message sent to or received from each worker: its timeouts count from there.
        self._last_contact = [time.monotonic()] * count
        for worker, rank in enumerate(ranks):
            probe = Probe(MPI, self.comm, rank, TAG_HELLO)
            if not poll(probe, timeout, self.spin, self.max_sleep, self._check_manager, self.liveness_interval):
                self.failed.add(worker)
                raise WorkerTimeoutError(
                    f"worker {worker} (MPI rank {rank}) did not start within {timeout:g} s"
                    + (" (is its rank running python -m clusterenv_core.worker?)" if self.mode == "world" else "")
                )
            hello = self._receive_pickled(probe)
            self.pids[worker], self.hosts[worker] = hello["pid"], hello["host"]
            threads[worker] = hello["threads"]
        unlink_shared_memory_names()  # every rank has passed MPI_Init
        self._bells = [None] * count
        listener = name = None
        if self.doorbell and HOST in self.hosts and sys.platform.startswith("linux"):
            # An abstract socket: no file anywhere, gone when closed.
            name = f"\0clusterenv-mpi-{os.getpid()}-{secrets.token_hex(8)}"
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(name)
            listener.listen(count)
        config = {
            "learner_pid": os.getpid(),
            "learner_host": HOST,
            "spin": self.worker_spin,
            "max_sleep": self.worker_max_sleep,
            "liveness_interval": self.liveness_interval,
        }
        # Heartbeats from the workers on other hosts, where both sides may call MPI from a thread.
        beating = {}
        if self.heartbeat_timeout > 0 and threads_allowed(MPI):
            beating = {w: rank for w, rank in enumerate(ranks) if threads[w] and self.hosts[w] != HOST}
        try:
            for worker, rank in enumerate(ranks):
                bell = name if self.hosts[worker] == HOST else None
                heartbeat = (self.heartbeat_interval, self.heartbeat_timeout) if worker in beating else None
                data = dumps(dict(config, worker=worker, doorbell=bell, heartbeat=heartbeat))
                self._sends[worker].append((self.comm.Isend(data, dest=rank, tag=TAG_CONFIG), data))
            if listener is not None:
                self._accept_doorbells(listener, timeout)
            if beating:
                self.heartbeat = BeatListener(self.comm, beating, self.heartbeat_interval, self.mpi_lock)
                self.heartbeat.start()
        finally:
            if listener is not None:
                listener.close()

    def _accept_doorbells(self, listener: socket.socket, timeout: float) -> None:
        """Each worker on this host says whether it connected; accept those that did, known by pid."""
        MPI = State.MPI
        expected = 0
        for worker, rank in enumerate(self.ranks):
            if self.hosts[worker] != HOST:
                continue
            probe = Probe(MPI, self.comm, rank, TAG_BELL)
            if not poll(probe, timeout, self.spin, self.max_sleep, self._check_manager, self.liveness_interval):
                self.failed.add(worker)
                raise WorkerTimeoutError(f"worker {worker} (MPI rank {rank}) did not finish starting within {timeout:g} s")
            expected += bool(self._receive_pickled(probe))
        by_pid = {pid: worker for worker, pid in enumerate(self.pids) if self.hosts[worker] == HOST}
        for worker, bell in accept_doorbells(listener, by_pid, expected, timeout).items():
            self._bells[worker] = bell

    # -- control messages -------------------------------------------------------------------------

    @holding_mpi_lock
    def send(self, worker: int, message: Any) -> None:
        if self._closed:
            raise WorkerLostError(f"worker {worker}: the MPI transport is closed")
        try:
            data = dumps(message)
        except KeyboardInterrupt:
            raise RequestNotSent from None
        pending = self._sends[worker]
        if pending:
            pending[:] = [(request, buffer) for request, buffer in pending if not request.Test()]
        pending.append((self.comm.Isend(data, dest=self.ranks[worker], tag=TAG_REQUEST), data))
        self._last_contact[worker] = time.monotonic()
        bell = self._bells[worker]
        if bell is not None:
            bell.ring()

    @holding_mpi_lock
    def recv(self, worker: int, timeout: float) -> Any:
        if self._closed:
            raise WorkerLostError(f"worker {worker}: the MPI transport is closed")
        if self._result_requests[worker] is not None:
            return self.recv_step(worker, timeout)
        probe = Probe(State.MPI, self.comm, self.ranks[worker], TAG_REPLY)
        self._wait(worker, probe, timeout)
        reply = self._receive_reply(probe)
        self._received(worker)
        return reply

    @holding_mpi_lock
    def recv_rows(self, worker: int, timeout: float) -> None:
        rank = self.ranks[worker]
        self._wait(worker, self.comm.Irecv(self._result_messages[worker], source=rank, tag=TAG_RESULT).Test, timeout)
        self._received(worker)

    def _receive_bytes(self, probe: Probe) -> bytearray:
        buffer = bytearray(probe.status.Get_count(State.MPI.BYTE))
        probe.message.Recv(buffer)
        return buffer

    def _receive_pickled(self, probe: Probe) -> Any:
        """A message of the handshake, which only ClusterEnv's own types make."""
        return pickle.loads(self._receive_bytes(probe))

    def _receive_reply(self, probe: Probe) -> Any:
        return loads(self._receive_bytes(probe), "the learner")

    def _wait(self, worker: int, ready, timeout: float, bell: bool = True) -> None:
        """Wait for ``ready()`` (a receive the worker rings for, unless ``bell`` is false) until
        ``timeout`` seconds after the last message sent to or received from the worker: workers
        serving requests at once have that long each, however late their replies are read."""
        if ready():
            return
        timeout_left = max(self._last_contact[worker] + timeout - time.monotonic(), 0.0)
        check = functools.partial(self._check_alive, worker)
        doorbell = self._bells[worker] if bell else None
        try:
            if doorbell is not None:
                ok = doorbell.wait(ready, timeout_left, self.max_sleep, check, self.liveness_interval)
            else:
                ok = poll(ready, timeout_left, self.spin, self.max_sleep, check, self.liveness_interval)
        except PeerGone:
            self._check_alive(worker)  # names the cause when it can
            raise self._dead(worker) from None
        if not ok:
            self.failed.add(worker)
            raise WorkerTimeoutError(f"worker {worker} ({self._describe(worker)}) did not answer within {timeout:g} s")

    def _received(self, worker: int) -> None:
        self._last_contact[worker] = time.monotonic()
        bell = self._bells[worker]
        if bell is not None:
            bell.received()

    def _describe(self, worker: int) -> str:
        return f"MPI rank {self.ranks[worker]}, pid {self.pids[worker]} on {self.hosts[worker]}{self.envs_of(worker)}"

    def _check_manager(self) -> None:
        if self.mode == "spawn" and pm_exited():
            raise self._lost_all("MPI's process manager ended (a spawned worker rank died and MPICH ended its job)")

    def _check_alive(self, *workers: int) -> None:
        """Raise for the first of ``workers`` known to be gone: its pid (same host), its heartbeats
        (other hosts), or MPICH's process manager (spawn mode)."""
        heartbeat = self.heartbeat
        if heartbeat is not None:
            heartbeat.beat()  # receive the beats that came in, once for all the workers
        for worker in workers:
            if self.hosts[worker] == HOST and not pid_alive(self.pids[worker]):
                raise self._dead(worker)
            if heartbeat is not None and worker in heartbeat.ranks:
                silent = heartbeat.silent_for(worker)
                if silent > self.heartbeat_timeout:
                    self.failed.add(worker)
                    raise WorkerLostError(
                        f"worker {worker} ({self._describe(worker)}) sent no heartbeat for {silent:.1f} s "
                        f"(heartbeat_timeout {self.heartbeat_timeout:g} s): its host is down or unreachable"
                    )
        self._check_manager()

    def _dead(self, worker: int) -> WorkerLostError:
        if self.mode == "spawn":
            # MPICH ends the spawned ranks, its process manager exits: no more spawns, no MPI_Finalize.
            State.finalize_unsafe = True
            gone = [w for w in range(self.num_workers) if self.hosts[w] == HOST and not pid_alive(self.pids[w])]
            if pm_exited() or len(gone) > 1:
                # Every rank ended with the first to die, and nothing tells which that was.
                return self._lost_all(
                    "a spawned worker rank died and MPICH's process manager ended every spawned rank of this "
                    "process (which rank died first cannot be told)"
                )
        self.failed.add(worker)
        return WorkerLostError(f"worker {worker} ({self._describe(worker)}) died")

    def _lost_all(self, why: str) -> WorkerLostError:
        self.failed.update(range(self.num_workers))
        return WorkerLostError(f"all MPI workers of this pool ({self.num_workers}) are lost: {why}")

    # -- buffers and steps ------------------------------------------------------------------------

    @holding_mpi_lock
    def share_buffers(self, spec: BatchSpec, blocks: list[range]) -> BatchBuffers:
        MPI = State.MPI
        count = len(blocks)
        header_bytes = -(-HEADER * count // ALIGN) * ALIGN
        self._memory = memory = bytearray(header_bytes + spec.nbytes())
        buffers = BatchBuffers(spec, memoryview(memory)[header_bytes:])
        self._headers = np.frombuffer(memory, dtype=np.int64, count=2 * count).reshape(count, 2)
        base = address(memory)
        always, when_done = result_arrays(buffers)
        self._result_messages, self._action_messages = [], []
        for worker, block in enumerate(blocks):

            def rows(arrays: list[np.ndarray], block: range = block) -> list[tuple[int, int]]:
                return [
                    (array.ctypes.data - base + block.start * row_bytes(array), len(block) * row_bytes(array))
                    for array in arrays
                ]

            results = block_type(MPI, [(HEADER * worker, HEADER), *rows(always), *rows(when_done)])
            actions = block_type(MPI, rows(buffers.actions))
            self._datatypes += [results, actions]
            self._result_messages.append([memory, 1, results])
            self._action_messages.append([memory, 1, actions])
        return buffers

    @holding_mpi_lock
    def send_step(self, worker: int) -> None:
        if self._closed:
            raise WorkerLostError(f"worker {worker}: the MPI transport is closed")
        rank = self.ranks[worker]
        comm = self.comm
        # The receive goes first, so the result rows land directly in the buffers.
        self._result_requests[worker] = comm.Irecv(self._result_messages[worker], source=rank, tag=TAG_RESULT)
        self._action_requests[worker] = comm.Isend(self._action_messages[worker], dest=rank, tag=TAG_STEP)
        self._last_contact[worker] = time.monotonic()
        bell = self._bells[worker]
        if bell is not None:
            bell.ring()

    @holding_mpi_lock
    def recv_step(self, worker: int, timeout: float) -> Any:
        request = self._result_requests[worker]
        if request is None:
            raise ClusterEnvError(f"recv_step without send_step for worker {worker}")
        self._wait(worker, request.Test, timeout)
        self._last_contact[worker] = time.monotonic()
        self._result_requests[worker] = None
        self._wait(worker, self._action_requests[worker].Test, timeout, bell=False)  # done: the worker answered
        self._action_requests[worker] = None
        if self._headers[worker, 0] == 0:
            self._received(worker)
            return OK_NONE
        probe = Probe(State.MPI, self.comm, self.ranks[worker], TAG_PAYLOAD)
        self._wait(worker, probe, timeout)
        self._received(worker)
        return self._receive_reply(probe)

    @holding_mpi_lock
    def wait_steps(self, workers: list[int], timeout: float) -> list[int]:
        requests = self._result_requests
        for worker in workers:
            if requests[worker] is None:
                raise ClusterEnvError(f"wait_steps without send_step for worker {worker}")
        ready: list[int] = []

        def any_ready() -> bool:
            # A completed request stays complete (mpi4py nulls it): recv_step then returns at once.
            ready.extend(worker for worker in workers if requests[worker].Test())
            return bool(ready)

        check = functools.partial(self._check_alive, *workers)
        poll(any_ready, timeout, self.spin, self.max_sleep, check, self.liveness_interval)
        return ready

    # -- regions (worker-side inference) ----------------------------------------------------------

    def share_region(self, nbytes: int) -> tuple[Any, memoryview]:
        return self._regions.share(nbytes)

    def release_region(self, handle: Any) -> None:
        self._regions.release(handle)

    @holding_mpi_lock
    def send_arrays(self, worker: int, arrays: list) -> None:
        rank = self.ranks[worker]
        for array in arrays:
            data = np.ascontiguousarray(array)
            request = self.comm.Isend(data, dest=rank, tag=TAG_ARRAYS)
            self._last_contact[worker] = time.monotonic()
            bell = self._bells[worker]
            if bell is not None:
                bell.ring()
            self._wait(worker, request.Test, _ARRAYS_TIMEOUT, bell=False)

    @holding_mpi_lock
    def recv_arrays(self, worker: int, arrays: list, timeout: float) -> None:
        for array in arrays:
            target = array if array.flags.c_contiguous else np.empty_like(array)
            self._wait(worker, self.comm.Irecv(target, source=self.ranks[worker], tag=TAG_ARRAYS).Test, timeout)
            self._received(worker)
            if target is not array:
                array[...] = target

    # -- end --------------------------------------------------------------------------------------

    @holding_mpi_lock
    def close(self, timeout: float, closed: set[int]) -> None:
        if self._closed:
            return
        self._closed = True
        State.live.discard(self)
        parted = False
        try:
            if self.comm is not None:
                self._part(time.monotonic() + timeout, closed)
            parted = True
        finally:
            # Also after Ctrl-C, which is raised once everything is released; a second one waits for
            # that too, or ranks that had yet to exit would be left running.
            with ctrl_c_held():
                self._release(parted, closed)

    def _part(self, deadline: float, closed: set[int]) -> None:
        """Leave the workers: with those that answered their close request all, disconnect (they
        finalize and exit; those on this host are waited for until ``deadline``), else kill the
        others (spawn mode)."""
        for request in self._result_requests:
            if request is not None:
                try:
                    request.Cancel()
                    poll(request.Test, 1.0, 0.0, 1e-3)
                except Exception:
                    pass
        if self.heartbeat is not None:
            self.heartbeat.await_goodbyes(closed, min(max(deadline - time.monotonic(), 0.0), GOODBYE_TIMEOUT))
        unclosed = [worker for worker in range(self.num_workers) if worker not in closed]
        if self.mode == "spawn":
            if unclosed:
                kill_spawned(self.comm, self.hosts, self.pids, unclosed)  # stuck or lost ranks; MPICH then ends the rest of the spawn
            else:
                # Every worker answered its close request and disconnects too (a collective call).
                self.comm.Disconnect()
            # Closed workers finalize and exit at once; wait for those on this host.
            wait_for_exits(self.hosts, self.pids, deadline)
        elif unclosed:
            abort_at_exit(self.ranks, unclosed)

    def _release(self, parted: bool, closed: set[int]) -> None:
        """Free every thread, MPI object, descriptor and buffer of the transport. Not ``parted``
        (Ctrl-C in :meth:`_part`), it parts at once: spawned ranks that all answered their close
        request are disconnected from and have ``_EXIT_GRACE`` seconds to exit, and the others are
        killed (which ends MPICH's process manager: this process spawns no more); world ranks that
        did not close abort the job at exit."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        for datatype in self._datatypes:
            try:
                datatype.Free()
            except Exception:
                pass
        self._datatypes = []
        self._result_requests = [None] * self.num_workers
        self._action_requests = [None] * self.num_workers
        self._sends = [[] for _ in range(self.num_workers)]
        for bell in self._bells:
            if bell is not None:
                bell.close()
        self._bells = [None] * self.num_workers
        self._regions.release_all()
        self._memory = self._headers = None
        self._result_messages, self._action_messages = [], []
        if parted or self.comm is None:
            return
        unclosed = [worker for worker in range(self.num_workers) if worker not in closed]
        if self.mode == "spawn":
            if self.comm and not unclosed:
                self.comm.Disconnect()  # they answered and disconnect at once: the one wait not cut short
            if self.comm:
                kill_spawned(self.comm, self.hosts, self.pids, unclosed)
            wait_for_exits(self.hosts, self.pids, time.monotonic() + _EXIT_GRACE)
            kill_spawned(self.comm, self.hosts, self.pids, range(self.num_workers))  # those on this host still running
        elif unclosed:
            abort_at_exit(self.ranks, unclosed)
