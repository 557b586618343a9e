"""Worker: one worker's serving loop, and one handler per request type.

It is backend-agnostic: a :class:`~clusterenv_core.transports.base.WorkerConnection` brings the
requests of :mod:`clusterenv_core.protocol`, and results are written into the batch buffers the
connection maps. :data:`HANDLERS` maps each request type to its handler; the step is the one fast
path beside it. The envs are the :class:`~clusterenv_core.worker.env_block.EnvBlock`'s; a rollout
segment is collected by :func:`~clusterenv_core.worker.rollout_collection.collect_segment`. A node
agent's block (``agent_block``) steps its envs, holds the policy copies and collects segments on
its local processes instead.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from clusterenv_core import protocol, registry
from clusterenv_core.env_output import unpicklable_part
from clusterenv_core.errors import InvalidEnvOutput
from clusterenv_core.inference import LearnerGone
from clusterenv_core.protocol import OK, OK_NONE, PROGRESS
from clusterenv_core.transports.base import WorkerConnection
from clusterenv_core.worker.env_block import EnvBlock
from clusterenv_core.worker.remote_failure import RemoteFailure
from clusterenv_core.worker.rollout_collection import collect_segment


class Worker:
    """One worker process's state: its connection, and its block of envs once created.

    :param connection: the worker side of the backend
    :param agent_block: makes the block of a node agent (``processes_per_worker`` > 1) from the
        block's factories and the ``Init`` request: an :class:`~clusterenv_core.node_agent.AgentBlock`,
        given by the worker program's entry, or by the pool of an MPI SPMD rank that turns worker (this
        module cannot import it: it stands above the pool); ``None``: this worker runs none
    """

    def __init__(self, connection: WorkerConnection, agent_block: Callable[..., Any] | None = None) -> None:
        self.connection = connection
        self.agent_block = agent_block
        self.block: Any = None  # an EnvBlock, or the agent_block's on a node agent
        self.agent = False  # whether this worker is a node agent
        self.first_index = 0  # global index of the block's first env
        # The deployed policy copy (clusterenv_core.inference.PolicyHost); on a node agent, the copies
        # on its local processes (the block's deploy makes them).
        self.host: Any = None
        self.rollout_regions: dict[str, Any] = {}  # mapped segment regions, by handle

    def serve(self) -> int:
        """Answer requests until the learner says close or goes away; returns the exit code."""
        connection = self.connection
        while True:
            request = connection.recv()
            try:
                if request is None or self.handle(request):  # learner gone, or told to close
                    return 0
            except LearnerGone:  # noticed while collecting a rollout
                return 0

    def handle(self, request: Any) -> bool:
        """Answer one request through the connection; returns whether it was the last (close)."""
        connection = self.connection
        if type(request) is str:  # STEP, the fast path
            try:
                parts = self.block.step()
                reply = OK_NONE if parts is None else (OK, parts)
            except RemoteFailure as failure:
                reply = failure.reply(self.first_index, self.block.replaced)
            self._send_reply(connection.send_step, reply, "step")
            return False
        if type(request) is protocol.Unreadable:  # already shaped as the error reply it gets
            connection.send(request)
            return False
        arrays = None
        try:
            handler = HANDLERS.get(type(request))
            if handler is None:
                raise ValueError(f"unknown request {request!r}")
            result = handler(self, request)
            if request.REPLY_ARRAYS:
                result, arrays = result
            reply = (OK, result)
        except RemoteFailure as failure:
            # A failed segment's reply still says which envs were replaced in it, to be counted.
            replaced = self.block.replaced_in_segment if isinstance(request, protocol.Rollout) else None
            reply = failure.reply(self.first_index, replaced)
        except LearnerGone:
            raise  # nobody to reply to
        except Exception as error:  # a bug or a bad message: report it rather than die silently
            reply = RemoteFailure(None, type(request).__name__, error).reply(0)
        reply = self._send_reply(connection.send, reply, *self._reply_parts(request))
        if reply[0] == OK:
            if request.REPLY_ROWS:
                connection.send_rows()
            if arrays is not None:
                connection.send_arrays(arrays)
        return isinstance(request, protocol.Close)

    def _reply_parts(self, request: protocol.Request) -> tuple[str, list[int] | None, str]:
        """How errors name ``request`` (the operation), and for per-env results, the env of each
        item and what the items are."""
        if isinstance(request, protocol.Call):
            return (
                f"call {request.name}",
                [self.first_index + slot for slot in request.slots],
                f"result of {request.name!r}",
            )
        if isinstance(request, protocol.GetAttr):
            return (
                f"get_attr {request.name}",
                [self.first_index + slot for slot in request.slots],
                f"attribute {request.name!r}",
            )
        return type(request).__name__.lower(), None, ""

    def _send_reply(
        self,
        send: Callable[[tuple], None],
        reply: tuple,
        operation: str,
        indices: list[int] | None = None,
        label: str = "",
    ) -> tuple:
        """Send ``reply``; returns what was sent. Backends pickle before sending anything, so a reply
        that cannot be pickled becomes an error reply naming the env and the info key, attribute or
        method responsible (``indices``: the env of each item of a per-env result, ``label`` what
        the items are)."""
        try:
            send(reply)
        except Exception as error:
            index, what = unpicklable_part(reply[1], indices, label)
            slot = None if index is None else index - self.first_index
            failure = InvalidEnvOutput(
                f"{what} cannot be pickled to reach the learner ({type(error).__name__}: {error})"
            )
            reply = RemoteFailure(slot, operation, failure).reply(self.first_index)
            send(reply)
        return reply

    def shutdown(self) -> None:
        """Close whatever envs are left and the connection, however serving ended."""
        if self.block is not None:
            try:
                self.block.close()
            except RemoteFailure:
                pass
        self.connection.close()

    # -- handlers, one per request type ------------------------------------------------------------

    def init(self, request: protocol.Init) -> protocol.BlockDescription:
        # The learner's import path, module files and warning filters, so that factories pickled by
        # reference find the learner's modules and envs warn as they would there; then its env
        # registry, so that ids registered there build here.
        self.first_index = request.first_index
        try:
            request.interpreter.adopt()
        except Exception as error:
            raise RemoteFailure(None, "taking over the learner's import path and warning filters", error) from error
        registry.install(request.registry)
        try:
            factories = pickle.loads(request.env_fns)
        except Exception as error:
            # One factory for the whole block: it is that of the block's first env.
            slot = 0 if max(request.env_factories) == 0 else None
            raise RemoteFailure(slot, "unpickling the env factory", error) from error
        env_fns = [factories[factory] for factory in request.env_factories]
        if request.processes > 1:
            if self.agent_block is None:
                error = ValueError("this worker was started without what makes a node agent's block")
                raise RemoteFailure(None, "building a node agent", error)
            self.agent = True
            self.block = self.agent_block(env_fns, request)
            return self.block.describe()
        self.block = EnvBlock(
            env_fns,
            request.first_index,
            request.autoreset_mode,
            request.max_env_restarts,
            request.restarted,
            request.env_restarts,
        )
        return self.block.describe()

    def attach(self, request: protocol.Attach) -> None:
        buffers, row0 = self.connection.attach(request.spec, request.block)
        self.block.attach(buffers, row0)

    def actions(self, request: protocol.Actions) -> None:
        self.block.pending_actions = request.actions

    def action_dtypes(self, request: protocol.ActionDtypes) -> None:
        self.block.set_action_dtypes(request.dtypes)

    def reset(self, request: protocol.Reset) -> dict | None:
        return self.block.reset(request.seeds, request.options, request.mask, request.omit_if_none)

    def preload(self, request: protocol.Preload) -> None:
        if self.agent:  # its local processes import them meanwhile
            self.block.preload(request.modules)
        for name in request.modules:
            importlib.import_module(name)

    def deploy(self, request: protocol.Deploy) -> None:
        from clusterenv_core.inference import PolicyHost, WeightsRegion, weights_fields

        views, _ = self.connection.map_region(request.weights_handle, weights_fields(request.count), 1, range(1))
        weights = WeightsRegion(views, writer_alive=self.connection.learner_alive)
        if request.deliver:
            self.connection.recv_arrays(weights.arrays)
        if self.agent:
            self.host = self.block.deploy(request.policy, weights, request.seed)
        else:
            try:
                self.host = PolicyHost(request.policy, weights, request.seed)
            except Exception as error:
                raise RemoteFailure(None, "deploying the policy", error) from error
        self.rollout_regions = {}

    def weights(self, request: protocol.Weights) -> None:
        self.connection.recv_arrays(self.host.weights.arrays)

    def rollout(self, request: protocol.Rollout) -> tuple[dict, list[np.ndarray]]:
        arrays = self._segment_region(request)

        def report(steps: int) -> None:
            self.connection.send((PROGRESS, steps))

        n_steps, context, report_every, waiting = (
            request.n_steps,
            request.context,
            request.report_every,
            self.connection.request_waiting,
        )
        if self.agent:  # on the local processes' copies
            result = self.block.rollout(
                self.host, n_steps, context, arrays, report, report_every, waiting, request.timeout
            )
        else:
            result = collect_segment(self.block, n_steps, context, self.host, arrays, report, report_every, waiting)
        mine = slice(arrays.row0, arrays.row0 + len(request.block))
        return result, [array[mine] for array in arrays.all]

    def _segment_region(self, request: protocol.Rollout):
        """The segment region the learner named, mapped on first use."""
        from clusterenv_core.rollout import RolloutArrays, rollout_fields

        key = repr(request.handle)
        if key not in self.rollout_regions:
            buffers = self.block.buffers
            fields = rollout_fields(buffers.spec, request.n_steps)
            views, row0 = self.connection.map_region(request.handle, fields, request.num_envs, request.block)
            self.rollout_regions[key] = RolloutArrays(views, buffers.obs_layout, buffers.act_layout, row0=row0)
        return self.rollout_regions[key]

    def call(self, request: protocol.Call) -> list:
        return self.block.call(
            request.name,
            request.args,
            request.kwargs,
            request.slots,
            request.require_callable,
            request.through_wrappers,
        )

    def get_attr(self, request: protocol.GetAttr) -> list:
        return self.block.get_attr(request.name, request.slots, request.through_wrappers)

    def set_attr(self, request: protocol.SetAttr) -> None:
        self.block.set_attr(request.name, request.values, request.slots, request.through_wrappers)

    def is_wrapped(self, request: protocol.IsWrapped) -> list[bool]:
        return self.block.is_wrapped(request.wrapper_class, request.slots)

    def close(self, request: protocol.Close) -> None:
        block, self.block = self.block, None
        if block is not None:
            # Which env is closing, so that a close() that hangs can be named at the learner.
            block.close(lambda index: self.connection.send((PROGRESS, index)))


HANDLERS: dict[type, Callable[[Worker, Any], Any]] = {
    protocol.Init: Worker.init,
    protocol.Attach: Worker.attach,
    protocol.Actions: Worker.actions,
    protocol.ActionDtypes: Worker.action_dtypes,
    protocol.Reset: Worker.reset,
    protocol.Preload: Worker.preload,
    protocol.Deploy: Worker.deploy,
    protocol.Weights: Worker.weights,
    protocol.Rollout: Worker.rollout,
    protocol.Call: Worker.call,
    protocol.GetAttr: Worker.get_attr,
    protocol.SetAttr: Worker.set_attr,
    protocol.IsWrapped: Worker.is_wrapped,
    protocol.Close: Worker.close,
}


def serve(connection: WorkerConnection, agent_block: Callable[..., Any] | None = None) -> int:
    """Run a worker on ``connection`` until the learner says close or goes away; returns the exit code.

    :param agent_block: what makes a node agent's block (see :class:`Worker`)
    """
    worker = Worker(connection, agent_block)
    try:
        return worker.serve()
    finally:
        worker.shutdown()
