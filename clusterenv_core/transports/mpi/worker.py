"""The worker side of the MPI backend: a rank that serves the learner (rank 0 of its communicator).

A rank becomes a worker in one of three ways: spawned by the learner (``python -m
clusterenv_core.worker mpi spawn``), as the worker program of an MPMD launch (``python -m
clusterenv_core.worker``), or, in an SPMD launch, when a rank above 0 constructs a pool
(:func:`serve_as_worker`). It waits for requests in a :class:`~.waiting.Doorbell` when the learner
shares its host, else it polls and sends the learner heartbeats; a learner that vanishes (its pid
or doorbell on the same host, its receipt of the heartbeats from another) ends it.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from clusterenv_core.buffers import BatchBuffers, BatchSpec, Field, field_views, fields_nbytes
from clusterenv_core.process import flush_standard_streams
from clusterenv_core.protocol import OK, STEP, dumps, loads
from clusterenv_core.transports.base import WorkerConnection
from clusterenv_core.transports.mpi.heartbeat import GOODBYE_TIMEOUT, BeatSender, holding_mpi_lock, threads_allowed
from clusterenv_core.transports.mpi.runtime import (
    HOST,
    State,
    connect_timeout,
    mpi,
    pid_alive,
    unlink_shared_memory_names,
)
from clusterenv_core.transports.mpi.waiting import Doorbell, PeerGone, Probe, poll
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
)


class MPIWorkerConnection(WorkerConnection):
    """Worker side of the MPI backend.

    :param comm: the communicator to the learner (the spawn intercommunicator or ``COMM_WORLD``)
    :param kind: ``"spawn"``, ``"mpmd"`` or ``"spmd"`` (how this rank became a worker)
    """

    def __init__(self, comm: Any, kind: str) -> None:
        MPI = State.MPI
        self.comm, self.kind = comm, kind
        self.mpi_lock = threading.RLock()  # held in every method that calls MPI (heartbeat.py)
        self.learner = 0
        data = dumps({"pid": os.getpid(), "host": HOST, "threads": threads_allowed(MPI)})
        request = comm.Isend(data, dest=self.learner, tag=TAG_HELLO)
        probe = Probe(MPI, comm, self.learner, TAG_CONFIG)
        poll(probe, float("inf"), 0.0, 5e-3)
        buffer = bytearray(probe.status.Get_count(MPI.BYTE))
        probe.message.Recv(buffer)
        poll(request.Test, float("inf"), 0.0, 5e-3)
        config = pickle.loads(buffer)
        unlink_shared_memory_names()  # the learner sends the config once every rank has said hello
        self.bell: Doorbell | None = None
        if config["doorbell"] is not None:
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(config["doorbell"])
                self.bell = Doorbell(sock, sleep_in_recv=True)
            except OSError:
                pass  # poll instead (e.g. another network namespace)
            connected = dumps(self.bell is not None)
            poll(comm.Isend(connected, dest=self.learner, tag=TAG_BELL).Test, float("inf"), 0.0, 5e-3)
        self.index = config["worker"]
        self.learner_pid, self.learner_host = config["learner_pid"], config["learner_host"]
        self.spin, self.max_sleep = config["spin"], config["max_sleep"]
        self.liveness_interval = config["liveness_interval"]
        self.learner_gone = False
        self.ring_owed = False
        self.probe = Probe(MPI, comm, self.learner, MPI.ANY_TAG)
        self.full_message = None
        self.datatypes: list = []
        self.heartbeat: BeatSender | None = None
        if config["heartbeat"] is not None:
            interval, self.heartbeat_timeout = config["heartbeat"]
            self.heartbeat = BeatSender(comm, self.learner, interval, self.mpi_lock, self._check_heartbeat)
            self.heartbeat.start()

    def _check_heartbeat(self) -> None:
        """A learner that received no beat for the heartbeat timeout is gone, or cut off: exit."""
        silent = self.heartbeat.silent_for()
        if silent <= self.heartbeat_timeout:
            return
        print(
            f"clusterenv worker {self.index} (pid {os.getpid()} on {HOST}): the learner (pid {self.learner_pid} "
            f"on {self.learner_host}) received no heartbeat for {silent:.1f} s (heartbeat_timeout "
            f"{self.heartbeat_timeout:g} s): it is gone or unreachable; exiting",
            file=sys.stderr,
            flush=True,
        )
        flush_standard_streams()
        os._exit(1)  # MPI_Finalize would wait for the unreachable learner

    def _check_learner(self) -> None:
        if self.learner_host == HOST and not pid_alive(self.learner_pid):
            self.learner_gone = True
            raise EOFError
        if self.heartbeat is not None:
            self.heartbeat.beat()
            self._check_heartbeat()

    def _complete(self, request: Any) -> None:
        """Wait for one of our sends; a learner that disappears meanwhile ends the worker."""
        if not request.Test():
            # EOFError (learner gone) ends the worker loop; close() then exits.
            poll(request.Test, float("inf"), self.spin, self.max_sleep, self._check_learner, self.liveness_interval)

    def _await(self, ready) -> None:
        """Wait for something the learner sends (and rings for); EOFError when the learner is gone."""
        bell = self.bell
        if bell is None:
            poll(ready, float("inf"), self.spin, self.max_sleep, self._check_learner, self.liveness_interval)
            return
        ring_first, self.ring_owed = self.ring_owed, False
        try:
            bell.wait(ready, float("inf"), self.max_sleep, self._check_learner, self.liveness_interval, ring_first)
        except PeerGone:
            self.learner_gone = True
            raise EOFError from None

    def _ring(self) -> None:
        if self.bell is not None:
            self.bell.ring()

    def _received(self) -> None:
        if self.bell is not None:
            self.bell.received()

    @holding_mpi_lock
    def recv(self) -> Any:
        probe = self.probe
        while True:
            if probe():
                if self.ring_owed:
                    self.ring_owed = False
                    self.bell.ring()
            else:
                try:
                    self._await(probe)
                except EOFError:
                    return None
            self._received()
            tag = probe.status.Get_tag()
            if tag == TAG_STEP:
                probe.message.Recv(self.action_message)
                return STEP
            buffer = bytearray(probe.status.Get_count(State.MPI.BYTE))
            probe.message.Recv(buffer)
            if tag == TAG_REQUEST:
                return loads(buffer, "the worker")
            # Anything else (arrays of an interrupted exchange) is dropped.

    @holding_mpi_lock
    def request_waiting(self) -> bool:
        # Iprobe, not the matched probe recv() uses: the message stays queued for recv().
        return self.comm.Iprobe(source=self.learner, tag=TAG_REQUEST)

    @holding_mpi_lock
    def send(self, message: Any) -> None:
        request = self.comm.Isend(dumps(message), dest=self.learner, tag=TAG_REPLY)
        self._ring()
        self._complete(request)

    @holding_mpi_lock
    def send_rows(self) -> None:
        self.header[0] = 0  # no pickled reply follows these rows
        request = self.comm.Isend(self.full_message, dest=self.learner, tag=TAG_RESULT)
        self._ring()
        self._complete(request)

    @holding_mpi_lock
    def attach(self, spec: BatchSpec, block: range) -> tuple[BatchBuffers, int]:
        MPI = State.MPI
        local = BatchSpec(len(block), spec.observation_space, spec.action_space)
        self.memory = memory = bytearray(ALIGN + local.nbytes())
        buffers = BatchBuffers(local, memoryview(memory)[ALIGN:])
        self.header = np.frombuffer(memory, dtype=np.int64, count=2)
        base = address(memory)

        def rows(arrays: list[np.ndarray]) -> list[tuple[int, int]]:
            return [(array.ctypes.data - base, array.nbytes) for array in arrays]

        always, when_done = result_arrays(buffers)
        short = block_type(MPI, [(0, HEADER), *rows(always)])
        full = block_type(MPI, [(0, HEADER), *rows(always), *rows(when_done)])
        actions = block_type(MPI, rows(buffers.actions))
        for datatype in self.datatypes:
            datatype.Free()
        self.datatypes = [short, full, actions]
        self.short_message, self.full_message = [memory, 1, short], [memory, 1, full]
        self.action_message = [memory, 1, actions]
        self.has_final = bool(when_done)
        # Byte views compared with zeros: a fifth of the cost of ndarray.any() on every step.
        self.terminated_bytes = memoryview(buffers.terminated).cast("B")
        self.truncated_bytes = memoryview(buffers.truncated).cast("B")
        self.no_flags = bytes(len(block))
        return buffers, 0

    @holding_mpi_lock
    def send_step(self, reply: Any) -> None:
        comm, learner = self.comm, self.learner
        data = None
        if reply[1] is None and reply[0] == OK:
            self.header[0] = 0
        else:
            data = dumps(reply)
            self.header[0] = len(data)
        ended = self.has_final and (self.terminated_bytes != self.no_flags or self.truncated_bytes != self.no_flags)
        request = comm.Isend(self.full_message if ended else self.short_message, dest=learner, tag=TAG_RESULT)
        payload = None if data is None else comm.Isend(data, dest=learner, tag=TAG_PAYLOAD)
        if self.bell is not None:
            if request.Test() and (payload is None or payload.Test()):
                # Sent: ring when about to sleep, so the learner does not wake while this worker
                # still holds a core (with more processes than cores, that wake-up would wait).
                self.ring_owed = True
                return
            self.bell.ring()  # the sends need the learner's progress (a large message): now
        if payload is not None:
            self._complete(payload)
        self._complete(request)

    def map_region(self, handle: Any, fields: list[Field], num_envs: int, block: range) -> tuple[dict, int]:
        # The views keep the memory: it goes with them when a later deploy replaces the policy.
        region = bytearray(fields_nbytes(fields, len(block)))
        return field_views(fields, len(block), region), 0

    @holding_mpi_lock
    def send_arrays(self, arrays: list) -> None:
        for array in arrays:
            request = self.comm.Isend(np.ascontiguousarray(array), dest=self.learner, tag=TAG_ARRAYS)
            self._ring()
            self._complete(request)

    @holding_mpi_lock
    def recv_arrays(self, arrays: list) -> None:
        for array in arrays:
            target = array if array.flags.c_contiguous else np.empty_like(array)
            self._await(self.comm.Irecv(target, source=self.learner, tag=TAG_ARRAYS).Test)
            self._received()
            if target is not array:
                array[...] = target

    @holding_mpi_lock
    def close(self) -> None:
        """Leave MPI and end the process with code 0 (never returns)."""
        MPI = State.MPI
        if self.heartbeat is not None and not self.heartbeat.goodbye(GOODBYE_TIMEOUT):
            self.learner_gone = True  # unreachable: MPI_Finalize would wait for it forever
        self.heartbeat = None
        for datatype in self.datatypes:
            try:
                datatype.Free()
            except Exception:
                pass
        self.datatypes = []
        if self.bell is not None:
            self.bell.close()
        flush_standard_streams()
        if not self.learner_gone:
            if self.kind == "spawn":
                # With the learner's Disconnect: MPICH's process manager treats an exit without it as a failure.
                self.comm.Disconnect()
            # World ranks wait here, idle, until the learner finalizes too.
            MPI.Finalize()
            flush_standard_streams()
            # C exit(), not os._exit(): MPICH finishes leaving its process manager in an exit handler
            # (without it the manager counts the rank as failed); Python's own exit would run the
            # script's finally blocks and atexit handlers, which an SPMD worker must not.
            import ctypes

            ctypes.CDLL(None).exit(0)
        flush_standard_streams()
        os._exit(0)


def _connect(kind: str) -> MPIWorkerConnection:
    """Become a worker: initialize MPI (waiting at most the connect timeout for the learner)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the learner's to handle
    watchdog = kind != "spawn" and connect_timeout() > 0
    if watchdog:
        # MPI_Init and the handshake block in C until the learner takes part; a learner that never
        # creates its pool must not leave this rank waiting forever.
        faulthandler.dump_traceback_later(connect_timeout(), exit=True)
    try:
        MPI = mpi(worker=True)
        if kind == "spawn":
            comm = MPI.Comm.Get_parent()
            if comm == MPI.COMM_NULL:
                raise SystemExit("clusterenv worker (mpi spawn): not started by MPI_Comm_spawn")
        else:
            comm = MPI.COMM_WORLD
            if comm.Get_size() == 1 or comm.Get_rank() == 0:
                raise SystemExit(
                    "clusterenv worker (mpi): run the worker program as ranks 1.. of an MPI job whose rank 0 is "
                    "the learner, e.g. mpiexec -n 1 python train.py : -n 4 python -m clusterenv_core.worker"
                )
        return MPIWorkerConnection(comm, kind)
    finally:
        if watchdog:
            faulthandler.cancel_dump_traceback_later()


def serve_as_worker(agent_block: Callable[..., Any] | None) -> None:
    """SPMD: a rank above 0 that constructs a pool serves rank 0 instead, then exits.

    :param agent_block: what makes a node agent's block, handed down by that pool (see
        :class:`~clusterenv_core.worker.serving.Worker`)
    """
    from clusterenv_core.worker.serving import serve

    connection = _connect("spmd")
    try:
        serve(connection, agent_block)  # its close() finalizes MPI and exits
    finally:
        flush_standard_streams()
        os._exit(0)


def worker_connection(argv: list[str]) -> MPIWorkerConnection:
    """Build the worker side from ``python -m clusterenv_core.worker [mpi [spawn]]``.

    Without arguments (MPMD launches) the rank serves rank 0 of ``COMM_WORLD``; ``spawn`` is what
    spawned ranks get and serves the parent.
    """
    kind = argv[0] if argv else "mpmd"
    if kind == "world":
        kind = "mpmd"
    if kind not in ("spawn", "mpmd"):
        raise SystemExit(f"clusterenv worker (mpi): unknown argument {kind!r}; expected nothing or 'spawn'")
    return _connect(kind)
