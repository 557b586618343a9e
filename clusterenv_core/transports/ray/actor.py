"""The worker side of the Ray backend: :class:`WorkerActor`, one Ray actor per worker, serving the
worker program's :class:`~clusterenv_core.worker.serving.Worker` over a :class:`RayWorkerConnection`.

The learner reaches an actor with one Ray call per request: :meth:`WorkerActor.request` carries the
pickled request and returns everything the worker sent in answer (interim and final replies, the
result rows and segment arrays that follow one); :meth:`WorkerActor.step` carries the block's
action rows and returns the result rows. The envs run on the actor's request thread (the default
concurrency group: one thread, always the same one). A second group, ``control``, serves the learner
while the request thread is busy: the arrays that follow a request (policy weights, put in Ray's
object store once for all actors), the interim replies of a long call (a rollout segment's
progress, which restarts the learner's timeout), and word that another request is waiting (the
worker then ends its segment early).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from clusterenv_core.buffers import BatchBuffers, BatchSpec, Field, field_views, fields_nbytes
from clusterenv_core.protocol import OK_NONE, STEP, dumps, loads
from clusterenv_core.transports.base import WorkerConnection
from clusterenv_core.worker.serving import Worker

#: how long a worker waits for the arrays that follow its request (the learner sends them right after)
ARRAYS_TIMEOUT = 300.0

#: what an actor's outbox holds: ``("reply", pickled reply)``, ``("rows", result rows)`` or
#: ``("arrays", arrays)``, in the order the worker sent them
Item = tuple[str, Any]


def result_rows(buffers: BatchBuffers, ended: bool) -> list[np.ndarray]:
    """The arrays a step returns, in order: observations, rewards, terminated, truncated, and the
    final observations when an episode ``ended``."""
    rows = [*buffers.obs, buffers.rewards, buffers.terminated, buffers.truncated]
    return rows + list(buffers.final_obs) if ended else rows


class RayWorkerConnection(WorkerConnection):
    """Worker side of the Ray backend: what one call of the learner brought, and what the worker
    sent in answer, for the actor's call to return."""

    def __init__(self) -> None:
        self._lock = threading.Condition()  # the control group's thread reads the outbox and delivers arrays
        self._request: bytes | None = None
        self._delivered: dict[int, list[list[np.ndarray]]] = {}  # by call
        self._outbox: list[tuple[int, Item]] = []  # (call, item)
        self._call = 0
        self._interrupted = threading.Event()
        self._step_reply: bytes | None = None
        self.buffers: BatchBuffers | None = None

    # -- driven by the actor -----------------------------------------------------------------------

    def begin(self, call: int, request: bytes) -> None:
        """A call of the learner starts: number ``call``, carrying ``request``."""
        with self._lock:
            self._call = call
            self._interrupted.clear()
            for earlier in [number for number in self._delivered if number < call]:
                del self._delivered[earlier]  # arrays of a request that failed before reading them
        self._request = request

    def end(self) -> list[Item]:
        """What the worker sent during the call (less what :meth:`interim` handed out already)."""
        with self._lock:
            items = [item for _, item in self._outbox]
            self._outbox = []
        return items

    def deliver(self, call: int, arrays: list[np.ndarray]) -> None:
        """Arrays that follow the request of call ``call``, which may be running, or yet to run."""
        with self._lock:
            self._delivered.setdefault(call, []).append(arrays)
            self._lock.notify_all()

    def interim(self, call: int) -> list[Item]:
        """What call ``call`` sent so far, taken out of the outbox (nothing once another call runs)."""
        with self._lock:
            items = [item for number, item in self._outbox if number == call]
            self._outbox = [entry for entry in self._outbox if entry[0] != call]
        return items

    def interrupt(self, call: int) -> None:
        """Another request waits behind call ``call``; a later call is not affected."""
        with self._lock:
            if self._call == call:
                self._interrupted.set()

    def step_reply(self) -> bytes | None:
        """The pickled reply of the last step, ``None`` for ``(OK, None)``."""
        return self._step_reply

    # -- the WorkerConnection interface ------------------------------------------------------------

    def recv(self) -> Any:
        request, self._request = self._request, None
        return None if request is None else loads(request, "the worker")

    def request_waiting(self) -> bool:
        return self._interrupted.is_set()

    def send(self, message: Any) -> None:
        data = dumps(message)  # first, so an unpicklable reply raises with nothing sent
        self._put(("reply", data))

    def send_rows(self) -> None:
        self._put(("rows", [array.copy() for array in result_rows(self.buffers, ended=True)]))

    def _put(self, item: Item) -> None:
        with self._lock:
            self._outbox.append((self._call, item))

    def attach(self, spec: BatchSpec, block: range) -> tuple[BatchBuffers, int]:
        # The block's rows only: the learner's buffers are in another process, maybe on another node.
        local = BatchSpec(len(block), spec.observation_space, spec.action_space)
        self.buffers = BatchBuffers(local, memoryview(bytearray(local.nbytes())))
        return self.buffers, 0

    def send_step(self, reply: Any) -> None:
        self._step_reply = None if reply is OK_NONE else dumps(reply)

    def map_region(self, handle: Any, fields: list[Field], num_envs: int, block: range) -> tuple[dict, int]:
        # The views keep the memory: it goes with them when a later deploy replaces the policy.
        return field_views(fields, len(block), bytearray(fields_nbytes(fields, len(block)))), 0

    def send_arrays(self, arrays: list) -> None:
        self._put(("arrays", [np.array(array) for array in arrays]))

    def recv_arrays(self, arrays: list) -> None:
        deadline = time.monotonic() + ARRAYS_TIMEOUT
        with self._lock:
            while not self._delivered.get(self._call):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the arrays that follow the request did not come within {ARRAYS_TIMEOUT:g} s")
                self._lock.wait(left)
            delivered = self._delivered[self._call].pop(0)
        for array, values in zip(arrays, delivered):
            array[...] = values


@ray.remote(concurrency_groups={"control": 1})
class WorkerActor:
    """One worker of a pool, as a Ray actor.

    :param index: the worker's index in the pool (for the actor's name in Ray's tools)
    :param agent_block: what makes a node agent's block (``processes_per_worker`` > 1), handed down
        by the pool (:attr:`~clusterenv_core.transports.base.Transport.agent_block`), as to an MPI
        SPMD rank: this module cannot import the pool, which stands above the transports
    """

    def __init__(self, index: int, agent_block: Callable[..., Any] | None) -> None:
        self.index = index
        self.connection = RayWorkerConnection()
        self.worker = Worker(self.connection, agent_block=agent_block)

    def hello(self) -> dict[str, Any]:
        """Where this actor runs: its pid, host name and Ray node id."""
        return {"pid": os.getpid(), "host": socket.gethostname(), "node": ray.get_runtime_context().get_node_id()}

    def request(self, call: int, request: bytes) -> list[Item]:
        """Serve one request (call number ``call``); returns what the worker sent in answer."""
        connection = self.connection
        connection.begin(call, request)
        if self.worker.handle(connection.recv()):
            self.worker.shutdown()  # told to close: the envs are closed, the learner ends the actor
        return connection.end()

    def step(self, actions: list[np.ndarray]) -> tuple[bytes | None, list[np.ndarray]]:
        """Step the block with its action rows; returns the pickled reply (``None``: ``(OK, None)``)
        and the result rows. Ray serializes them before the next call can overwrite them."""
        buffers = self.connection.buffers
        for rows, new in zip(buffers.actions, actions):
            rows[...] = new
        self.worker.handle(STEP)
        ended = bool(buffers.final_obs) and bool(buffers.terminated.any() or buffers.truncated.any())
        return self.connection.step_reply(), result_rows(buffers, ended)

    @ray.method(concurrency_group="control")
    def deliver(self, call: int, arrays: list[np.ndarray]) -> None:
        self.connection.deliver(call, arrays)

    @ray.method(concurrency_group="control")
    def interim(self, call: int) -> list[Item]:
        return self.connection.interim(call)

    @ray.method(concurrency_group="control")
    def interrupt(self, call: int) -> None:
        self.connection.interrupt(call)
