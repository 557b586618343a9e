"""RayTransport: the learner side of the Ray backend.

Each worker is a :class:`~clusterenv_core.transports.ray.actor.WorkerActor` in a bundle of the
pool's placement group. A request is one Ray call per actor (``request``); a step is one call per
actor (``step``) carrying the block's action rows as numpy arrays and returning the result rows.
Ray serializes numpy arrays without pickling their data (pickle protocol 5 buffers; inline in the
call below 100 KB, through the object store above). Measured on this machine (2 cores, busy), a
step of an actor holding 4 CartPole envs costs about 1.4 ms per round trip, as much as a call that
carries no arrays: the rows add nothing noticeable. The arrays that follow a request (policy
weights) are put into the object store and handed to the actor by reference in a second call, to
the actor's ``control`` group (the request may already be running and waiting for them); equal
arrays sent to several workers in a row (the weights of one sync) are put once, and every actor
reads that one copy.

Every wait is bounded by the pool's timeout counted from the last contact with the worker: a call
still running then is asked for what it sent so far (a rollout segment's progress, which restarts
the timeout), and without any, the worker timed out. An actor whose process or node is gone fails
its calls at once (``RayActorError``): :class:`~clusterenv_core.errors.WorkerLostError`.
"""

from __future__ import annotations

import atexit
import collections
import os
import time
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from clusterenv_core.buffers import BatchBuffers, BatchSpec
from clusterenv_core.checks import check_seconds
from clusterenv_core.errors import ClusterEnvError, WorkerLostError, WorkerTimeoutError
from clusterenv_core.protocol import OK_NONE, dumps, loads
from clusterenv_core.transports.base import RequestNotSent, Transport, ctrl_c_held
from clusterenv_core.transports.learner_regions import LearnerRegions
from clusterenv_core.transports.ray.actor import WorkerActor, result_rows
from clusterenv_core.transports.ray.placement import (
    PLACEMENT_STRATEGIES,
    bundle_node,
    connect,
    cpu_nodes,
    least_loaded_node,
    place,
    strategy_for,
)

_START_TIMEOUT = 60.0  # at least this long for actors to start (a Ray worker process, imports)
_INTERIM_TIMEOUT = 5.0  # how long a busy actor may take to say what it sent so far
_WAIT_SLICE = 0.5  # the longest single Ray wait, so that Ctrl-C is taken promptly
_EXIT_GRACE = 5.0  # how long killed actors may take to be gone
_NICENESS = "RAY_worker_niceness"  # the environment variable Ray starts a worker process's niceness from
_REPLACE_TIMEOUT = 10.0  # how long a lost actor's bundle waits for a node with room, by default


class RayTransport(Transport):
    """Learner side of the Ray backend.

    :param address: the Ray cluster to connect to when this process is not connected yet
        (``ray.init(address=...)``: ``"auto"``, ``"ray://head:10001"``, ...; default: Ray's own
        choice, ``RAY_ADDRESS`` or a new local Ray)
    :param init_options: further keywords of that ``ray.init`` (``num_cpus``, ``runtime_env``, ...)
    :param cpus_per_actor: the CPUs each actor's bundle reserves (raise it to ``processes_per_worker``
        to reserve a node agent's cores in Ray's accounting)
    :param placement: the placement group's strategy; ``"auto"``: ``STRICT_SPREAD`` (an actor per
        node) when the cluster has enough nodes with CPUs, else ``SPREAD``
    :param actor_options: further keywords of the actors' ``.options()`` (``runtime_env``,
        ``memory``, custom ``resources``, ...). The actors run at this process's niceness, as a
        local worker would, not at the niceness 15 Ray gives its workers (at which they all but
        stop while other processes keep their node's cores busy, and miss the pool's timeout); a
        ``RAY_worker_niceness`` among the runtime env's ``env_vars`` sets another
    :param replace_timeout: how long, in seconds, a lost actor's bundle (``restart_failed_workers``)
        waits for a node with room before its replacement starts outside it, on the surviving node
        running the fewest of the pool's actors, without reserving CPUs there; the worker returns
        to its bundle at the first reset of all its envs that finds the bundle placed again. With no
        node with CPUs left the pool fails with a :class:`~clusterenv_core.errors.WorkerLostError`
        saying what to do
    """

    shares_memory = False

    def __init__(
        self,
        address: str | None = None,
        init_options: dict[str, Any] | None = None,
        cpus_per_actor: float = 1.0,
        placement: str = "auto",
        actor_options: dict[str, Any] | None = None,
        replace_timeout: float = _REPLACE_TIMEOUT,
    ) -> None:
        if address is not None and not isinstance(address, str):
            raise ValueError(f"address must be a string or None, got {address!r}")
        if placement not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement must be one of {PLACEMENT_STRATEGIES}, got {placement!r}")
        for name, options in (("init_options", init_options), ("actor_options", actor_options)):
            if options is not None and not isinstance(options, dict):
                raise ValueError(f"{name} must be a dict, got {options!r}")
        reserved = {"num_cpus", "scheduling_strategy", "max_restarts"} & set(actor_options or {})
        if reserved:
            raise ValueError(f"actor_options may not set {', '.join(sorted(reserved))}: the pool sets them")
        self.address = address
        self.init_options = dict(init_options or {})
        number = isinstance(cpus_per_actor, (int, float)) and not isinstance(cpus_per_actor, bool)
        if not number or not 0 < cpus_per_actor < 1e9:
            raise ValueError(f"cpus_per_actor must be a positive number, got {cpus_per_actor!r}")
        self.cpus_per_actor = float(cpus_per_actor)
        self.replace_timeout = check_seconds("replace_timeout", replace_timeout, below=1e9)
        self.placement = placement
        self.actor_options = dict(actor_options or {})
        self.failed: set[int] = set()
        self._closed = False
        self._group: Any = None
        #: the Ray actor of each worker (for Ray's own tools)
        self.actors: list[Any] = []
        self._replacements: list[dict[str, Any]] = []  # each actor's replacement (replacements())
        self._displaced: set[int] = set()  # workers whose actor runs outside its bundle
        self._where: list[dict[str, Any]] = []  # per worker: pid, host, node
        self._calls: list[collections.deque] = []  # per worker: (call number, ref) of unread requests
        self._inbox: list[collections.deque] = []  # per worker: what finished calls sent, not yet read
        self._steps: list[Any] = []  # per worker: the ref of the step in flight
        self._last_contact: list[float] = []
        self._call = 0
        self._shared: tuple[Any, list[np.ndarray]] | None = None  # the last arrays put, and their ref
        self._buffers: BatchBuffers | None = None
        self._rows: list[np.ndarray] = []  # the learner's result arrays, in the order steps return them
        self._buffer_blocks: list[range] = []
        self._regions = LearnerRegions()

    @property
    def num_workers(self) -> int:
        return len(self.actors)

    def default_num_workers(self) -> int | None:
        """One actor per alive node with CPUs (connecting to Ray, or starting it, to count them)."""
        connect(self.address, self.init_options)
        return len(cpu_nodes()) or None

    def default_processes_per_worker(self) -> int | None:
        """The CPUs of the smallest alive node with CPUs: with an actor per node, each uses its
        node's cores (the smallest's, where the nodes differ)."""
        connect(self.address, self.init_options)
        cpus = [node["Resources"]["CPU"] for node in cpu_nodes()]
        return max(int(min(cpus)), 1) if cpus else None

    def worker_pids(self) -> list[int]:
        return [where["pid"] for where in self._where]

    def replacements(self) -> list[dict[str, Any]]:
        """Each replacement of an actor: the ``worker``, its ``envs``, the ``cause`` (``"lost"``, or
        ``"moved back"`` to its bundle), where the old actor ran and the new one runs (``from``,
        ``to``: pid, host, Ray node), whether the new one runs ``in_bundle``, and the ``seconds``
        the new one took to start."""
        return [dict(record) for record in self._replacements]

    def displaced_workers(self) -> list[int]:
        if not self._displaced:
            return []
        return sorted(worker for worker in self._displaced if bundle_node(self._group, worker) is not None)

    def workers_on_this_host(self) -> int:
        node = ray.get_runtime_context().get_node_id()
        return sum(where["node"] == node for where in self._where)

    # -- start ------------------------------------------------------------------------------------

    def start(self, num_workers: int, timeout: float) -> None:
        connect(self.address, self.init_options)
        # Reserving the resources is bounded by the pool's timeout (raise it on a cluster that scales
        # up); starting an actor's process and its imports at least by the start timeout.
        self._group = place(num_workers, self.cpus_per_actor, strategy_for(num_workers, self.placement), timeout)
        timeout = max(timeout, _START_TIMEOUT)
        self.actors = [None] * num_workers
        self._where = [{"pid": 0, "host": "?", "node": None} for _ in range(num_workers)]
        self._calls = [collections.deque() for _ in range(num_workers)]
        self._inbox = [collections.deque() for _ in range(num_workers)]
        self._steps = [None] * num_workers
        self._last_contact = [time.monotonic()] * num_workers
        atexit.register(self._at_exit)  # after ray.init's own: runs before Ray shuts down
        for worker in range(num_workers):
            self.actors[worker] = self._new_actor(worker)
        hellos = [actor.hello.remote() for actor in self.actors]
        for worker, hello in enumerate(hellos):
            self._where[worker] = self._result(worker, hello, timeout, "start")

    def _new_actor(self, worker: int, node: str | None = None) -> Any:
        """The worker's actor, in its bundle; or on ``node`` outside it, reserving no CPUs."""
        if node is None:
            strategy: Any = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=worker)
            cpus = self.cpus_per_actor
        else:
            strategy, cpus = NodeAffinitySchedulingStrategy(node, soft=True), 0.0
        options = dict(self.actor_options, num_cpus=cpus, scheduling_strategy=strategy, max_restarts=0)
        runtime_env = dict(options.get("runtime_env") or {})
        learner_niceness = str(os.getpriority(os.PRIO_PROCESS, 0))
        runtime_env["env_vars"] = {_NICENESS: learner_niceness, **(runtime_env.get("env_vars") or {})}
        options["runtime_env"] = runtime_env
        return WorkerActor.options(**options).remote(worker, self.agent_block)

    def _at_exit(self) -> None:
        if self.exit_hook is not None and ray.is_initialized():
            self.exit_hook()  # the pool's shutdown: its actors close their envs before Ray goes

    # -- calls ------------------------------------------------------------------------------------

    def _check_open(self, worker: int) -> None:
        if self._closed:
            raise WorkerLostError(f"worker {worker}: the Ray transport is closed")
        if worker in self.failed:
            raise WorkerLostError(f"worker {worker} ({self._describe(worker)}) was lost before")

    def send(self, worker: int, message: Any) -> None:
        self._check_open(worker)
        try:
            data = dumps(message)
        except KeyboardInterrupt:
            raise RequestNotSent from None
        self._call += 1
        actor, calls = self.actors[worker], self._calls[worker]
        if calls:
            # Queued behind a call that may be collecting a segment: the worker ends it early.
            actor.interrupt.remote(calls[-1][0])
        calls.append((self._call, actor.request.remote(self._call, data)))
        self._last_contact[worker] = time.monotonic()

    def send_arrays(self, worker: int, arrays: list) -> None:
        calls = self._calls[worker]
        if not calls:
            raise ClusterEnvError(f"arrays for worker {worker} without a request before them")
        self.actors[worker].deliver.remote(calls[-1][0], self._put(arrays))

    def _put(self, arrays: list) -> Any:
        """An object holding copies of ``arrays``: the last one put if its arrays are equal (the
        same weights sent to every worker), else a new one."""
        shared = self._shared
        if shared is not None and len(shared[1]) == len(arrays):
            if all(
                kept.dtype == array.dtype and kept.shape == array.shape and np.array_equal(kept, array)
                for kept, array in zip(shared[1], arrays)
            ):
                return shared[0]
        copies = [np.array(array) for array in arrays]
        ref = ray.put(copies)
        self._shared = (ref, copies)
        return ref

    def _describe(self, worker: int) -> str:
        where = self._where[worker]
        return f"Ray actor, pid {where['pid']} on {where['host']}{self.envs_of(worker)}"

    def _wait(self, worker: int, refs: list, timeout: float) -> bool:
        """Wait until one of ``refs`` is ready, or ``timeout`` after the worker's last contact."""
        deadline = self._last_contact[worker] + timeout
        while True:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(refs, num_returns=1, timeout=max(min(left, _WAIT_SLICE), 0.0))
            if ready:
                return True
            if left <= _WAIT_SLICE:
                return False

    def _result(self, worker: int, ref: Any, timeout: float, what: str) -> Any:
        """The result of a call, or the learner's error for its worker."""
        try:
            return ray.get(ref, timeout=timeout)
        except GetTimeoutError:
            self.failed.add(worker)
            raise WorkerTimeoutError(
                f"worker {worker} ({self._describe(worker)}) did not answer ({what}) within {timeout:g} s"
            ) from None
        except RayActorError as error:
            self.failed.add(worker)
            cause = " ".join(str(error).split())[:600]
            raise WorkerLostError(f"worker {worker} ({self._describe(worker)}) died: {cause}") from None
        except RayError as error:  # a failure of the actor's own code or of Ray: the worker is unusable
            self.failed.add(worker)
            raise WorkerLostError(f"worker {worker} ({self._describe(worker)}) failed: {error}") from None

    def _timed_out(self, worker: int, timeout: float) -> WorkerTimeoutError:
        self.failed.add(worker)
        return WorkerTimeoutError(f"worker {worker} ({self._describe(worker)}) did not answer within {timeout:g} s")

    def _next(self, worker: int, kind: str, timeout: float) -> Any:
        """The next thing the worker sent, which must be of ``kind``."""
        self._check_open(worker)
        inbox = self._inbox[worker]
        while not inbox:
            calls = self._calls[worker]
            if not calls:
                raise ClusterEnvError(f"a receive from worker {worker}, which was sent no request")
            number, ref = calls[0]
            if self._wait(worker, [ref], timeout):
                calls.popleft()
                inbox.extend(self._result(worker, ref, 0.0, "a request"))
            else:
                # What the call sent so far: progress restarts the timeout.
                sent = self._result(worker, self.actors[worker].interim.remote(number), _INTERIM_TIMEOUT, "progress")
                if not sent:
                    raise self._timed_out(worker, timeout)
                inbox.extend(sent)
        got, value = inbox.popleft()
        self._last_contact[worker] = time.monotonic()
        if got != kind:
            self.failed.add(worker)
            raise ClusterEnvError(f"worker {worker} sent {got} where {kind} were due")
        return value

    def recv(self, worker: int, timeout: float) -> Any:
        if self._steps and self._steps[worker] is not None and not self._inbox[worker]:
            return self.recv_step(worker, timeout)
        return loads(self._next(worker, "reply", timeout), "the learner")

    def recv_rows(self, worker: int, timeout: float) -> None:
        self._copy_rows(worker, self._next(worker, "rows", timeout))

    def _copy_rows(self, worker: int, rows: list[np.ndarray]) -> None:
        block = self._buffer_blocks[worker]
        for target, values in zip(self._rows, rows):
            target[block.start : block.stop] = values

    # -- buffers and steps ------------------------------------------------------------------------

    def share_buffers(self, spec: BatchSpec, blocks: list[range]) -> BatchBuffers:
        self._buffers = buffers = BatchBuffers(spec, memoryview(bytearray(spec.nbytes())))
        self._rows = result_rows(buffers, ended=True)
        self._buffer_blocks = list(blocks)
        return buffers

    def send_step(self, worker: int) -> None:
        self._check_open(worker)
        block = self._buffer_blocks[worker]
        # Ray serializes the arguments here: the learner may write the next actions at once.
        actions = [array[block.start : block.stop] for array in self._buffers.actions]
        self._steps[worker] = self.actors[worker].step.remote(actions)
        self._last_contact[worker] = time.monotonic()

    def recv_step(self, worker: int, timeout: float) -> Any:
        self._check_open(worker)
        ref = self._steps[worker]
        if ref is None:
            raise ClusterEnvError(f"recv_step without send_step for worker {worker}")
        if not self._wait(worker, [ref], timeout):
            raise self._timed_out(worker, timeout)
        self._steps[worker] = None
        reply, rows = self._result(worker, ref, 0.0, "a step")
        self._copy_rows(worker, rows)
        self._last_contact[worker] = time.monotonic()
        return OK_NONE if reply is None else loads(reply, "the learner")

    def wait_steps(self, workers: list[int], timeout: float) -> list[int]:
        refs = {}
        for worker in workers:
            if self._steps[worker] is None:
                raise ClusterEnvError(f"wait_steps without send_step for worker {worker}")
            refs[self._steps[worker]] = worker
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=max(min(left, _WAIT_SLICE), 0.0))
            if ready or left <= _WAIT_SLICE:
                done = {refs[ref] for ref in ready}
                return [worker for worker in workers if worker in done]

    # -- regions (worker-side inference) ----------------------------------------------------------

    def share_region(self, nbytes: int) -> tuple[Any, memoryview]:
        return self._regions.share(nbytes)

    def release_region(self, handle: Any) -> None:
        self._regions.release(handle)

    def recv_arrays(self, worker: int, arrays: list, timeout: float) -> None:
        for array, values in zip(arrays, self._next(worker, "arrays", timeout)):
            array[...] = values

    # -- replacing and ending ---------------------------------------------------------------------

    def restart(self, worker: int, timeout: float) -> None:
        """Replace the worker's actor, lost or stuck (see :meth:`_replace`)."""
        self._replace(worker, timeout, "lost")

    def move_back(self, worker: int, timeout: float) -> None:
        self._replace(worker, timeout, "moved back")

    def _replace(self, worker: int, timeout: float, cause: str) -> None:
        """Kill the worker's actor and start a new one in its bundle, which Ray places again on a
        node with room when its node was lost. If none has room within ``replace_timeout``, the new
        actor starts outside the bundle on the surviving node running the fewest of the pool's
        actors, and the worker is displaced until its bundle is placed again."""
        if self._closed:
            raise WorkerLostError(f"worker {worker}: the Ray transport is closed")
        began = time.monotonic()
        previous = self._where[worker]
        ray.kill(self.actors[worker], no_restart=True)
        self._steps[worker] = None
        self._calls[worker].clear()
        self._inbox[worker].clear()
        self._where[worker] = {"pid": 0, "host": "?", "node": None}
        self.failed.discard(worker)
        self._displaced.discard(worker)
        self._last_contact[worker] = began
        self.actors[worker] = self._new_actor(worker)
        hello = self.actors[worker].hello.remote()
        started = False
        while not started and bundle_node(self._group, worker) is None:
            if time.monotonic() - began >= self.replace_timeout:
                hello = self._start_outside_bundle(worker)
                break
            started = bool(ray.wait([hello], timeout=_WAIT_SLICE)[0])
        self._where[worker] = self._result(worker, hello, max(timeout, _START_TIMEOUT), "start")
        in_bundle = worker not in self._displaced
        self._replacements.append(
            {
                "worker": worker,
                "envs": list(self.blocks[worker]) if worker < len(self.blocks) else [],
                "cause": cause,
                "from": dict(previous),
                "to": dict(self._where[worker]),
                "in_bundle": in_bundle,
                "seconds": round(time.monotonic() - began, 3),
            }
        )

    def _start_outside_bundle(self, worker: int) -> Any:
        """Start the worker's actor on the surviving node running the fewest of the pool's actors,
        its bundle having found no room; returns the ref of its ``hello``."""
        ray.kill(self.actors[worker], no_restart=True)
        others = collections.Counter(self._where[other]["node"] for other in range(len(self.actors)) if other != worker)
        node = least_loaded_node(others)
        if node is None:
            self.failed.add(worker)
            raise WorkerLostError(self._not_replaced(worker))
        self._displaced.add(worker)
        self.actors[worker] = self._new_actor(worker, node)
        return self.actors[worker].hello.remote()

    def _not_replaced(self, worker: int) -> str:
        """Why a lost worker cannot be replaced (no node with CPUs is left), and what to do."""
        state = placement_group_table(self._group).get("state", "?")
        return (
            f"worker {worker}{self.envs_of(worker)}: lost, and no node can take its envs: none had room for "
            f"its bundle of {self.cpus_per_actor:g} CPUs within replace_timeout ({self.replace_timeout:g} s, "
            f"placement group {state}) and no node with CPUs is left. Add a node (ray start --address=..., "
            "or let the autoscaler add one) or start again when the cluster has nodes"
        )

    def close(self, timeout: float, closed: set[int]) -> None:
        """Kill every actor (those in ``closed`` have closed their envs) and remove the placement
        group; waits up to a few seconds for the actors to be gone."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        with ctrl_c_held():
            self._release()

    def _release(self) -> None:
        actors, self.actors = [actor for actor in self.actors if actor is not None], []
        group, self._group = self._group, None
        self._displaced = set()
        self._calls, self._inbox, self._steps = [], [], []
        self._shared, self._buffers, self._rows = None, None, []
        self._regions.release_all()
        if not ray.is_initialized():
            return  # Ray was shut down first, which ended the actors and the placement group
        for actor in actors:
            ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + _EXIT_GRACE
        # A call to a killed actor fails once Ray knows it is dead.
        probes = [actor.hello.remote() for actor in actors]
        if probes:
            ray.wait(probes, num_returns=len(probes), timeout=_EXIT_GRACE)
        # Its process may still be exiting then, on a busy machine: on this node, wait until it is gone.
        node = ray.get_runtime_context().get_node_id()
        _wait_until_gone([where["pid"] for where in self._where if where["node"] == node and where["pid"]], deadline)
        if group is not None:
            remove_placement_group(group)


def _wait_until_gone(pids: list[int], deadline: float) -> None:
    """Wait until no process of ``pids`` exists, or ``deadline`` (``time.monotonic()``) passed."""
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:  # the pid is another user's now: ours is gone
                break
            time.sleep(0.02)
