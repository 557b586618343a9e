"""The pool's messaging: one owner of what was asked of which worker, and of what the pool is doing.

:class:`WorkerChannel` sits between the pool's objects (:class:`~clusterenv_core.pool.EnvPool`,
:class:`~clusterenv_core.actors.WorkerActors`, :class:`~clusterenv_core.batches.AsyncBatches`,
:class:`~clusterenv_core.restarts.WorkerRestarts`) and the transport. It owns

- the transport, and the batch buffers it maps;
- what is awaited from which worker, the replies read and not yet reported (Ctrl-C can cut a wait
  short between the two), and the arrays that follow a reply;
- the failure that made the pool unusable, and the workers lost during a step (to be replaced);
- the restart counts that replies report;
- the dtypes each worker gives its envs actions in;
- one explicit :class:`PoolState`: idle, or a step, a rollout or asynchronous batches pending,
  and whether the wait for it was interrupted.

Every request goes out through :meth:`WorkerChannel.send` (a step through
:meth:`WorkerChannel.send_steps`) and every reply comes in through :meth:`WorkerChannel.gather` or
:meth:`WorkerChannel.drain`, so requests and replies stay paired whatever is interrupted.
"""

from __future__ import annotations

import enum
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from clusterenv_core import protocol
from clusterenv_core.buffers import BatchBuffers, BatchSpec
from clusterenv_core.errors import ClusterEnvError, EnvError, WorkerLostError, WorkerTimeoutError
from clusterenv_core.protocol import ERROR
from clusterenv_core.replies import read_reply, remote_error, replaced_envs, replaced_processes, reply_timeout
from clusterenv_core.shutdown import shutdown
from clusterenv_core.spaces import delivered_dtype
from clusterenv_core.transports import Transport
from clusterenv_core.transports.base import RequestNotSent


class PoolState(enum.Enum):
    """What the pool is doing: the one state its calls check (misuse raises ``ClusterEnvError``)."""

    IDLE = "idle"
    #: a synchronous step was started and its results not yet returned
    STEP = "step"
    #: a rollout segment was started and not yet returned
    ROLLOUT = "rollout"
    #: asynchronous batches have workers stepping
    BATCHES = "batches"


_PENDING = {
    PoolState.STEP: "a step is pending: call step_wait first",
    PoolState.ROLLOUT: "a rollout is pending: call rollout_wait first",
    PoolState.BATCHES: "asynchronous steps are pending: recv their results first",
}


class WorkerChannel:
    """The conversation of one pool with its workers.

    :param transport: the backend's transport (not started yet)
    :param blocks: the global env indices of each worker's block
    :param timeout: the pool's ``timeout``: seconds a worker may take to answer (or to report
        progress), the waits for its reply bounded by :meth:`reply_wait`
    :param max_worker_restarts: how many times one worker may be replaced when lost in a step or a
        segment; ``None``: lost workers are not replaced (the pool fails)
    :param agent_allowance: where the workers are node agents, ``allowance(timeout)``: how much longer
        than ``timeout`` to wait for one (:func:`~clusterenv_core.node_agent.agent_allowance`)
    """

    def __init__(
        self,
        transport: Transport,
        blocks: list[range],
        timeout: float,
        max_worker_restarts: int | None,
        agent_allowance: Callable[[float], float] | None = None,
    ) -> None:
        self.transport = transport
        self.blocks = blocks
        self.num_workers = len(blocks)
        self.num_envs = blocks[-1].stop
        self.timeout = timeout
        self._agent_allowance = agent_allowance
        #: the state the pool's calls check; :attr:`interrupted`: Ctrl-C cut the wait for it short
        self.state = PoolState.IDLE
        self.interrupted = False
        self._finish: Callable[[], Any] | None = None  # completes the pending step or rollout
        #: how many envs and workers (node agents' local processes too) were replaced so far
        self.restarts = {"envs": 0, "workers": 0}
        #: how often each env was replaced so far
        self.env_restarts = [0] * self.num_envs
        #: how often each worker was replaced so far (``None``: workers are not replaced)
        self.worker_restarts: list[int] | None = None if max_worker_restarts is None else [0] * self.num_workers
        self.max_worker_restarts = max_worker_restarts
        #: workers lost during the pending step or segment, to replace before it completes
        self.lost: dict[int, ClusterEnvError] = {}
        #: the deployed policy (a :class:`~clusterenv_core.actors.WorkerActors`) every worker holds, if any
        self.deployed: Any = None
        self.buffers: BatchBuffers | None = None
        self.closed = False
        # Per worker whose reply is still unread: the type of its request (None: a step).
        self._awaiting: dict[int, type | None] = {}
        # Per worker whose unread reply is followed by arrays (REPLY_ARRAYS): the arrays they go into.
        self._reply_arrays: dict[int, list] = {}
        # Per worker, a reply read and not yet reported (request type, status, result): by gather or
        # drain until all the replies they wait for are in (_report). Ctrl-C that cuts a wait short
        # leaves them here, for the wait that resumes it or the next call's drain to report.
        self._read_replies: dict[int, tuple[type | None, str, Any]] = {}
        self._failure: ClusterEnvError | None = None
        # Envs get their actions in the dtypes of the last batch (see spaces.delivered_dtype): the
        # dtypes each worker reads actions in (None while unknown: Ctrl-C while it is told), those of
        # the last batch of a synchronous step they were set for, and the action space's; once the
        # buffers exist.
        self._worker_action_dtypes: list[list | None] = []
        self._batch_dtypes: list | None = None
        self.space_action_dtypes: list[np.dtype] = []
        self._finalizer = weakref.finalize(
            self, shutdown, transport, self._awaiting, self._reply_arrays, timeout, os.getpid()
        )
        transport.exit_hook = self._finalizer
        transport.blocks = tuple(blocks)

    # -- the pool's state -------------------------------------------------------------------------

    def check_usable(self) -> None:
        """Raise ``ClusterEnvError`` if the pool is closed or failed."""
        if self.closed:
            raise ClusterEnvError("the pool is closed")
        if self._failure is not None:
            raise ClusterEnvError(f"the pool is unusable after an earlier failure: {self._failure}") from self._failure

    def fail(self, error: ClusterEnvError) -> ClusterEnvError:
        """Remember that the pool is unusable; returns ``error`` for raising."""
        if self._failure is None:
            self._failure = error
        return error

    def begin(self, state: PoolState, finish: Callable[[], Any] | None = None) -> None:
        """Enter ``state``; ``finish()`` completes it (dropping its results) if its wait is interrupted."""
        self.state, self.interrupted, self._finish = state, False, finish

    def end(self) -> None:
        """Back to idle."""
        self.state, self.interrupted, self._finish = PoolState.IDLE, False, None

    def settle_wait(self) -> None:
        """After a wait for the pending step or rollout, also one cut short: idle if every reply it
        awaited was read and reported and no lost worker waits to be replaced, else it stays pending,
        interrupted, for its wait to resume or the next call to finish it (:meth:`check_idle`)."""
        if self._awaiting or self._read_replies or self.lost:
            self.interrupted = True
        else:
            self.end()

    def check_idle(self) -> None:
        """Raise ``ClusterEnvError`` if a step, a rollout or asynchronous steps are pending. A step or
        rollout whose wait was interrupted (Ctrl-C) is finished instead and its results dropped: after
        an interrupt, the envs stand stepped and usable, as DummyVecEnv's and SyncVectorEnv's do."""
        if self.interrupted and self._finish is not None:
            self._finish()
        if self.state is not PoolState.IDLE:
            raise ClusterEnvError(_PENDING[self.state])

    @property
    def unsettled(self) -> bool:
        """Whether replies are unread, or read and unreported (an interrupted call's)."""
        return bool(self._awaiting or self._read_replies)

    def answering(self, reverse: bool = False) -> list[int]:
        """The workers whose replies are awaited, or read and unreported, less those lost; sorted."""
        workers: Iterable[int] = self._awaiting
        if self._read_replies:
            workers = {*self._awaiting, *self._read_replies}
        if self.lost:
            workers = [worker for worker in workers if worker not in self.lost]
        return sorted(workers, reverse=reverse)

    def awaited(self, worker: int) -> type | None:
        """The type of the request whose reply ``worker`` owes (``None``: a step, or nothing)."""
        return self._awaiting.get(worker)

    # -- requests and replies ---------------------------------------------------------------------

    def reply_wait(self, request_type: type | None, timeout: float | None = None) -> float:
        """How long to wait for a worker's reply to a request of ``request_type`` (``None``: a step)
        that it may take ``timeout`` to answer (default: the pool's): longer for requests that import
        (:func:`~clusterenv_core.replies.reply_timeout`), and for node agents, whose own wait for a
        stuck local process must end first."""
        wait = reply_timeout(request_type, self.timeout if timeout is None else timeout)
        return wait if self._agent_allowance is None else wait + self._agent_allowance(wait)

    def send(
        self,
        worker: int,
        request: protocol.Request,
        reply_arrays: list | None = None,
        step: bool = False,
        arrays: list | None = None,
    ) -> None:
        """Send ``request`` to ``worker``; its reply is read by :meth:`gather` or :meth:`drain`.

        :param reply_arrays: for a request whose reply is followed by arrays (``REPLY_ARRAYS``), the
            arrays (views of a region) they are received into, whoever reads the reply
        :param step: the request prepares a step or starts a segment: a lost worker is handled as
            in a step (:meth:`lose_in_step`), and nothing is awaited from it
        :param arrays: arrays that follow the request (weights for a worker without shared memory)
        """
        # Awaited before it is sent: Ctrl-C while it is written may raise once it is out (sendall
        # runs signal handlers after writing), and its reply must still be read as this request's.
        self._awaiting[worker] = type(request)
        if reply_arrays is not None:
            self._reply_arrays[worker] = reply_arrays
        try:
            self.transport.send(worker, request)
            if arrays is not None:
                self.transport.send_arrays(worker, arrays)
        except ClusterEnvError as error:
            self.forget(worker)
            if step and isinstance(error, (WorkerLostError, WorkerTimeoutError)):
                self.lose_in_step(worker, error)
                return
            raise self.fail(error)
        except RequestNotSent:
            self.forget(worker)
            raise
        except KeyboardInterrupt:
            raise
        except BaseException:  # it could not be pickled: nothing was sent
            self.forget(worker)
            raise

    def send_steps(self, workers: Iterable[int]) -> None:
        """Start ``workers`` stepping with the actions in the buffers (a worker lost meanwhile, while
        told the dtypes say, is left to be replaced)."""
        transport, awaiting, lost = self.transport, self._awaiting, self.lost
        for worker in workers:
            if worker in lost:
                continue
            awaiting[worker] = None  # before the send, as in send()
            try:
                transport.send_step(worker)
            except (WorkerLostError, WorkerTimeoutError) as error:
                del awaiting[worker]
                self.lose_in_step(worker, error)

    def forget(self, worker: int) -> None:
        """Await nothing more from ``worker`` (its request was not sent, or its process goes)."""
        self._awaiting.pop(worker, None)
        self._reply_arrays.pop(worker, None)

    def gather(
        self,
        workers: Iterable[int],
        what: str,
        step: bool = False,
        timeout: float | None = None,
        on_reply: Callable[[int, Any], None] | None = None,
        on_progress: Callable[[int, Any], None] | None = None,
    ) -> dict[int, Any]:
        """Every listed worker's reply result, once all have answered (see :meth:`_report`: the envs
        the replies say were replaced are counted, and the remote error of the lowest-numbered worker,
        the first env, is raised). A reply read before Ctrl-C cut an earlier wait short is not read
        again.

        Rows and arrays that follow a reply (see :mod:`clusterenv_core.protocol`) land in the
        buffers and in the arrays given to :meth:`send` first. ``on_reply(worker, result)`` runs
        after each successful reply, also when another worker's error is raised (who took a deployed
        policy). ``on_progress(worker, report)`` runs at each progress report read meanwhile (see
        :func:`~clusterenv_core.replies.read_reply`).

        :param step: the replies end a step or segment: a worker lost meanwhile is left to be
            replaced (:meth:`lose_in_step`), and its result is missing
        """
        transport = self.transport
        workers = list(workers)
        awaiting, reply_arrays, read = self._awaiting, self._reply_arrays, self._read_replies
        for worker in workers:
            if worker in read:
                continue
            request_type = awaiting.get(worker)
            try:
                read_reply(
                    transport,
                    worker,
                    request_type,
                    self.reply_wait(request_type, timeout),
                    reply_arrays.get(worker),
                    self._keep_reply,
                    on_progress,
                )
            except (WorkerLostError, WorkerTimeoutError) as error:
                if not step:
                    raise self.fail(error)
                awaiting.pop(worker, None)
                self.lose_in_step(worker, error)
        return self._report(workers, what, on_reply)

    def _keep_reply(self, worker: int, request_type: type | None, status: str, result: Any) -> None:
        """Keep a reply just read for :meth:`_report`; it no longer counts as awaited. :func:`read_reply`
        calls it as soon as the reply is in."""
        # Kept before it counts as read (CPython runs signal handlers at calls and loop jumps):
        # Ctrl-C at the calls below leaves the reply kept, not lost.
        self._read_replies[worker] = (request_type, status, result)
        self._awaiting.pop(worker, None)
        self._reply_arrays.pop(worker, None)

    def lose_in_step(self, worker: int, error: ClusterEnvError) -> None:
        """A worker lost during a step or segment: replaced when it completes, if it may be, else fatal."""
        restarts = self.worker_restarts
        if restarts is None:
            raise self.fail(error)
        if restarts[worker] >= self.max_worker_restarts:
            spent = f"not replaced again: replaced {restarts[worker]} time(s), max_restarts={self.max_worker_restarts}"
            raise self.fail(type(error)(f"{error}\n\n({spent})")) from error
        self.lost[worker] = error

    def drain(self, keep_steps: bool = False) -> None:
        """Read replies left unread by an interrupted call, so requests and replies stay paired
        (``keep_steps``: not those of steps, which asynchronous batches still wait for). Their
        results are dropped, but a step or segment whose request went out before Ctrl-C did run on
        its worker, so they are reported as :meth:`gather` reports them once all are read (see
        :meth:`_report`), also after Ctrl-C cut a drain short, with the replies an interrupted call
        had read."""
        read = self._read_replies
        for worker in sorted(self._awaiting):
            request_type = self._awaiting[worker]
            if (keep_steps and request_type is None) or worker in read:
                continue
            try:
                read_reply(
                    self.transport,
                    worker,
                    request_type,
                    self.reply_wait(request_type),
                    self._reply_arrays.get(worker),
                    self._keep_reply,
                )
            except (WorkerLostError, WorkerTimeoutError) as error:
                raise self.fail(error)
        if read:
            # Not the replies of steps that asynchronous batches still wait for (keep_steps).
            drained = [worker for worker, reply in read.items() if not (keep_steps and reply[0] is None)]
            self._report(drained, None)

    def _report(
        self, workers: list[int], what: str | None, on_reply: Callable[[int, Any], None] | None = None
    ) -> dict[int, Any]:
        """Report the read replies of ``workers``: count the envs they say were replaced, return each
        successful one's result, and raise the remote error of the lowest-numbered worker (its worker
        lives on; the env may be left broken).

        Each reply is reported once, also when Ctrl-C cuts this short: nothing changes until the
        lines that take the replies out and count the envs, which make no call and run no loop, so
        Ctrl-C cannot land among them.

        :param what: how a failed step is named; ``None`` for replies that :meth:`drain` read, of
            calls that Ctrl-C cut short: their results are dropped, their errors say so, and a
            preload's error is left to the call that needs the module
        """
        read = self._read_replies
        results: dict[int, Any] = {}
        first_error: EnvError | None = None
        replaced: list[int] = []
        processes_replaced = 0  # node agents' local processes
        reported: set[int] = set()
        for worker in workers:
            if worker not in read:  # lost in a step: replaced once the step's replies are in
                continue
            reported.add(worker)
            request_type, status, result = read[worker]
            replaced.extend(replaced_envs(request_type, status, result))
            processes_replaced += replaced_processes(request_type, status, result)
            if status != ERROR:
                results[worker] = result
            elif first_error is None or worker < first_error.worker_index:
                if what is not None:
                    first_error = remote_error(worker, result, what)
                elif request_type is not protocol.Preload:
                    named = "rollout" if request_type is protocol.Rollout else "step"
                    first_error = remote_error(worker, result, named, sent_before_ctrl_c=True)
        remaining = {}
        if len(read) > len(reported):
            remaining = {worker: reply for worker, reply in read.items() if worker not in reported}
        if replaced:  # counted in all and per env: an env's budget of max_restarts follows it to new workers
            env_restarts = list(self.env_restarts)
            for index in replaced:
                env_restarts[index] += 1
            replaced_total = self.restarts["envs"] + len(replaced)
        workers_replaced = self.restarts["workers"] + processes_replaced
        self._read_replies = remaining
        if replaced:
            self.restarts["envs"] = replaced_total
            self.env_restarts[:] = env_restarts
        self.restarts["workers"] = workers_replaced
        if on_reply is not None:
            for worker in results:
                on_reply(worker, results[worker])
        if first_error is not None:
            raise first_error
        return results

    def wait_steps(self, workers: list[int], timeout: float) -> list[int]:
        """The stepping ``workers`` whose replies are in, waiting up to ``timeout`` for one."""
        try:
            return self.transport.wait_steps(workers, timeout)
        except (WorkerLostError, WorkerTimeoutError) as error:  # the backend saw a loss while waiting (MPI)
            raise self.fail(error) from None

    # -- buffers and actions ----------------------------------------------------------------------

    def share_buffers(self, batch_spec: BatchSpec) -> BatchBuffers:
        """Map the batch buffers laid out by ``batch_spec``; workers attach to them with :meth:`attach`."""
        self.batch_spec = batch_spec
        self.buffers = self.transport.share_buffers(batch_spec, self.blocks)
        self.space_action_dtypes = [field.dtype for field in self.buffers.act_layout.fields]
        self._worker_action_dtypes = [self.space_action_dtypes] * self.num_workers
        self._batch_dtypes = self.space_action_dtypes
        return self.buffers

    def attach(self, workers: Iterable[int], timeout: float) -> None:
        """Have ``workers`` map the batch buffers."""
        workers = list(workers)
        for worker in workers:
            self.send(worker, protocol.Attach(self.batch_spec, self.blocks[worker]))
        self.gather(workers, "attaching buffers", timeout=timeout)

    def set_action_dtypes(
        self, dtypes: list[np.dtype], workers: Iterable[int] | None = None, step: bool = False
    ) -> None:
        """Have ``workers`` (all by default) give envs their actions in ``dtypes``, one per action
        field; only the workers that read them in others are told.

        :param step: they are told for a step about to start: a worker lost meanwhile is, as in the
            step, left to be replaced (:meth:`lose_in_step`), and its replacement is told ``dtypes``
        """
        known = self._worker_action_dtypes
        if workers is not None:
            self._batch_dtypes = None  # the synchronous step's workers may read in others now
        told = [
            worker for worker in (range(self.num_workers) if workers is None else workers) if known[worker] != dtypes
        ]
        if not told:
            return
        request = protocol.ActionDtypes(tuple(dtypes))
        for worker in told:
            known[worker] = None
            self.send(worker, request, step=step)
        answering = [worker for worker in told if worker in self._awaiting]  # not those lost at the send
        self.gather(answering, "setting the dtypes of actions", step=step)
        for worker in told:  # a lost one's replacement is told them as it takes over (tell_replacement_dtypes)
            known[worker] = dtypes

    def set_batch_dtypes(self, batch_dtypes: list[np.dtype]) -> None:
        """Before a synchronous step of a batch of actions in ``batch_dtypes`` (one per action field):
        have every worker give envs their actions in the dtypes a batch of those delivers
        (:func:`~clusterenv_core.spaces.delivered_dtype`); nothing to tell for the same dtypes as the
        last batch's."""
        if batch_dtypes == self._batch_dtypes:
            return
        self._batch_dtypes = None
        fields = self.buffers.act_layout.fields
        self.set_action_dtypes([delivered_dtype(f.dtype, b) for f, b in zip(fields, batch_dtypes)], step=True)
        self._batch_dtypes = batch_dtypes

    def tell_replacement_dtypes(self, worker: int) -> None:
        """Have a worker that replaced a lost one read actions as the lost one did (a replacement
        reads them in the space's dtypes)."""
        if not self.buffers.act_layout.buffered:
            return
        wanted = self._worker_action_dtypes[worker]
        self._worker_action_dtypes[worker] = self.space_action_dtypes
        self.set_action_dtypes(wanted or self.space_action_dtypes, [worker])

    # -- regions ----------------------------------------------------------------------------------

    @property
    def shares_memory(self) -> bool:
        """Whether the workers map the learner's regions (else arrays are sent with requests)."""
        return self.transport.shares_memory

    def share_region(self, nbytes: int) -> tuple[Any, memoryview]:
        """A region of ``nbytes`` the workers can map: its handle and its memory."""
        return self.transport.share_region(nbytes)

    def release_region(self, handle: Any) -> None:
        self.transport.release_region(handle)

    # -- restarts and lifetime --------------------------------------------------------------------

    def restart(self, worker: int, error: ClusterEnvError) -> None:
        """Start a new process for ``worker``, lost with ``error`` (which is raised, the pool failed,
        where the backend cannot replace a worker); it is counted once it took over (:meth:`count_restart`)."""
        self.forget(worker)  # a request of an interrupted replacement, whose process goes
        try:
            self.transport.restart(worker, self.timeout)
        except NotImplementedError:
            raise self.fail(error) from None

    def move_back(self, workers: Iterable[int]) -> list[int]:
        """Put those of ``workers`` whose replacement runs outside its place, which has room again,
        back in it: a new worker each, waiting for its first message; returns them."""
        displaced = set(self.transport.displaced_workers())
        moved = [worker for worker in workers if worker in displaced]
        for worker in moved:
            self.transport.move_back(worker, self.timeout)
        return moved

    def count_restart(self, worker: int) -> None:
        self.worker_restarts[worker] += 1
        self.restarts["workers"] += 1

    def close(self) -> EnvError | None:
        """Stop every worker and free the transport (see :func:`~clusterenv_core.shutdown.shutdown`);
        returns the error of the first env whose ``close()`` raised. Idempotent."""
        self.closed = True
        self.state, self._finish = PoolState.IDLE, None
        return self._finalizer()
