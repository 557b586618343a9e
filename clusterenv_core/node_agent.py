"""AgentBlock: a node agent's envs, stepped on local processes of the worker's own.

With ``processes_per_worker`` > 1 the worker (an MPI rank, or a local worker process) is a *node
agent*: it runs its block on an inner :class:`~clusterenv_core.pool.EnvPool` of the local backend
(``processes`` worker processes over shared memory) and answers the learner once per request for
the whole block, so the learner's cost per step grows with the agents, not with the processes.

It offers what :class:`~clusterenv_core.worker.serving.Worker` uses of an
:class:`~clusterenv_core.worker.env_block.EnvBlock`. A step reads the action rows the learner wrote
in the dtypes :meth:`set_action_dtypes` named (those an ``EnvBlock`` would give the envs), hands
them to the inner pool as a batch in exactly those dtypes (its
:meth:`~clusterenv_core.channel.WorkerChannel.set_batch_dtypes` then delivers the same ones: the
delivered dtype of a delivered dtype is itself), and copies every result field of the inner buffers
into the rows the learner reads. What does not fit the buffers comes back keyed by global env index.

The inner pool's env indices are this block's slots. An env's failure in a local process is
reported as the env's own (:class:`RelayedEnvFailure`); a lost or silent local process as the
worker's failure, naming the process and its envs by global index, unless the learner's pool
replaces lost workers (``restart_failed_workers``): then the inner pool replaces a local process
lost in a step or a rollout segment, or silent past the timeout there, as a pool replaces a worker,
and the reply names the local processes replaced (``process_restarts``), which the learner counts
as replaced workers; their envs' episodes end as a lost worker's do, the reason naming the local
process and this worker. A block that replaces a lost agent's starts new local processes, its envs
carrying their restart counts over.

The inner pool waits for a local process the learner's ``timeout``, and the learner waits for the
agent longer (:func:`agent_allowance`), so a stuck local process is always the agent's to report or
replace: the learner never takes its agent for the stuck one.

The inner pool is made by ``make_pool`` (:class:`~clusterenv_core.pool.EnvPool`), which is handed
in, so this module imports no pool and the pool may import it: an MPI SPMD rank turns worker inside
the pool's constructor, which hands its transport what makes an agent's block. The worker program's
entry hands the same to :func:`~clusterenv_core.worker.serving.serve`; serving never imports this
module, as it stands below the pool (the local backend's inline worker runs it).

Worker-side inference runs on the local processes too: :meth:`AgentBlock.deploy` deploys the
learner's policy on the inner pool (:mod:`clusterenv_core.node_agent_actors`), and
:meth:`AgentBlock.rollout` collects each segment there.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from clusterenv_core import protocol
from clusterenv_core.errors import ClusterEnvError, EnvError
from clusterenv_core.learner_threads import LearnerThreadsWarning
from clusterenv_core.node_agent_actors import AgentActors, with_env_restarts
from clusterenv_core.replies import START_TIMEOUT
from clusterenv_core.transports import WorkerNames
from clusterenv_core.worker.env_block import step_parts
from clusterenv_core.worker.remote_failure import RemoteFailure

if TYPE_CHECKING:
    from clusterenv_core.inference import WeightsRegion
    from clusterenv_core.rollout import RolloutArrays

#: Seconds an agent may take to reply once its inner pool gave up on a local process, on a busy
#: machine: generous, as it only delays the report of an agent that is stuck itself.
AGENT_REACTION = 5.0


def agent_allowance(timeout: float, replaces_processes: bool) -> float:
    """How much longer than ``timeout`` the learner waits for a node agent, which waits ``timeout``
    for each of its local processes: long enough for the agent's own wait to end first, so that it
    reports a stuck local process (or replaces it), whatever the load of the machine.

    Beyond the agent's reply (:data:`AGENT_REACTION`), a quarter of ``timeout``: in a rollout segment
    the agent forwards its local processes' progress every quarter of the timeout at most, so its
    learner may have heard from it that much earlier than it heard from its stuck process.

    :param timeout: how long the agent waits for a local process: the pool's ``timeout``, a rollout's,
        or the longer wait of a starting worker
    :param replaces_processes: the agent replaces a lost or stuck local process
        (``restart_failed_workers``) before it replies: as long again as a starting worker is given
        (``START_TIMEOUT``, or ``timeout`` if longer) for the replacement to build its envs
    """
    allowance = AGENT_REACTION + timeout / 4
    if replaces_processes:
        allowance += max(timeout, START_TIMEOUT)
    return allowance


class RelayedEnvFailure(RemoteFailure):
    """An env's failure in one of the agent's local processes, replied as the env's own: its
    exception type (so the learner raises ``EnvValueError`` for a ``ValueError``), message and
    traceback, with the local process named in the operation.

    :param error: the inner pool's error, whose ``env_index`` is the env's slot in this block
    :param operation: what failed, if not the error's own operation
    """

    def __init__(self, error: EnvError, operation: str | None = None) -> None:
        operation = f"{operation or error.operation} (in local process {error.worker_index} of the node agent)"
        super().__init__(error.env_index, operation, error)

    def reply(self, first_index: int, env_restarts: list[int] | None = None) -> tuple:
        status, details = super().reply(first_index, env_restarts)
        error = self.error
        return status, details._replace(
            exc_type=error.exc_type, message=error.remote_message, traceback=error.remote_traceback
        )


class AgentBlock:
    """A worker's block of envs stepped on ``request.processes`` local processes (an inner local pool).

    :param env_fns: factories of this block's environments
    :param request: the worker's ``Init``: the block's first env, worker index, autoreset mode, how
        often envs and local processes may be replaced, whether it replaces a lost agent's block
        (with its envs' restart counts), the local processes to run it on and the learner's timeout
    :param make_pool: :class:`~clusterenv_core.pool.EnvPool`, handed down (see the module's docstring)
    """

    def __init__(self, env_fns: list, request: protocol.Init, *, make_pool: Callable[..., Any]) -> None:
        first_index = request.first_index
        self.first_index = first_index
        self.worker = request.worker
        self.replaced: list[int] = []  # env indices replaced in the current step
        self.replaced_in_segment: list[int] = []  # env indices replaced in the current rollout segment
        self.pending_actions: list | None = None  # actions of spaces without buffers, sent before the step
        self.buffers: Any = None
        self._action_rows: list[np.ndarray] = []  # the block's rows of each action field
        self._action_dtypes: list[np.dtype] = []
        self._result_copies: list[tuple[np.ndarray, np.ndarray]] = []  # (the learner's rows, the inner field)
        # Local processes replaced and not yet reported to the learner (a step's reply reports them).
        self._replaced_processes: list[int] = []
        max_env_restarts, max_process_restarts = request.max_env_restarts, request.max_process_restarts
        try:
            with warnings.catch_warnings():
                # The warning is the learner's, about its torch threads; an agent trains nothing (its
                # factories may import torch, through SB3's make_vec_env say).
                warnings.simplefilter("ignore", LearnerThreadsWarning)
                self.pool = make_pool(
                    env_fns,
                    backend="local",
                    num_workers=request.processes,
                    timeout=request.timeout,
                    autoreset_mode=request.autoreset_mode,
                    restart_failed_envs=max_env_restarts > 0,
                    restart_failed_workers=max_process_restarts is not None,
                    # Both are the learner's max_restarts where they apply: per env, and per local process.
                    max_restarts=max(max_env_restarts, max_process_restarts or 0),
                    carried_env_restarts=request.env_restarts if request.restarted else None,
                    # The learner checks each env's space with its own test once they are described; here
                    # the buffers are laid out by the block's first env's, as the learner's by env 0's.
                    observation_spaces_fit=_any_space_fits,
                    # Its errors and restart reasons name the local processes, and the envs by the
                    # learner's indices: they reach the learner as they are.
                    worker_names=WorkerNames(agent=request.worker, first_env=first_index),
                )
        except EnvError as error:
            raise RelayedEnvFailure(error) from error
        except Exception as error:
            raise RemoteFailure(None, "starting the node agent's local processes", error) from error
        self._pids = self.pool.worker_pids

    def describe(self) -> protocol.BlockDescription:
        """Spaces of every env and the metadata of the first, as :meth:`EnvBlock.describe` says them."""
        pool = self.pool
        spaces = [(observation_space, pool.action_space) for observation_space in pool.observation_spaces]
        return protocol.BlockDescription(spaces, pool.metadata, pool.render_mode, pool.spec)

    def attach(self, buffers: Any, row0: int) -> None:
        self.buffers = buffers
        rows = slice(row0, row0 + self.pool.num_envs)
        inner = self.pool.buffers
        names = [field.name for field in [*buffers.obs_layout.fields, *buffers.final_obs_layout.fields]]
        self._result_copies = [
            (buffers.arrays[name][rows], inner.arrays[name]) for name in [*names, "rewards", "terminated", "truncated"]
        ]
        self._action_rows = [array[rows] for array in buffers.actions]
        if buffers.act_layout.buffered:
            self.set_action_dtypes([field.dtype for field in buffers.act_layout.fields])

    def set_action_dtypes(self, dtypes: list[np.dtype]) -> None:
        """Give envs their actions in ``dtypes``, one per action field (the buffers' are wider)."""
        self._action_dtypes = [np.dtype(dtype) for dtype in dtypes]

    def step(self) -> dict | None:
        """Step every env with its action row on the local processes; returns what could not go
        through the buffers, keyed by global env index."""
        pool, first = self.pool, self.first_index
        if self.buffers.act_layout.buffered:
            leaves = [rows.astype(dtype) for rows, dtype in zip(self._action_rows, self._action_dtypes)]
            actions, per_env = self.buffers.act_layout.batch(leaves), False
        else:
            actions, per_env = self.pending_actions, True
        result = self._run("step", lambda: pool.step(actions, per_env=per_env))
        self._copy_results()
        obs = {} if self.buffers.obs_layout.buffered else {first + slot: obs for slot, obs in enumerate(result.obs)}
        replaced_processes, self._replaced_processes = self._replaced_processes, []
        return step_parts(
            infos=_shifted(result.infos, first),
            reset_infos=_shifted(result.reset_infos, first),
            final_obs=_shifted(result.pickled_final_obs, first),
            obs=obs,
            env_restarts=self.replaced,
            process_restarts=replaced_processes,
        )

    def reset(self, seeds: list, options: list, mask: list[bool] | None, omit_if_none: tuple[str, ...]) -> dict | None:
        """Reset the envs selected by ``mask`` (all when ``None``), as :meth:`EnvBlock.reset` does."""
        inner_mask = None if mask is None else np.array(mask, dtype=bool)
        result = self._run("reset", lambda: self.pool.reset(seeds, options, inner_mask, omit_if_none))
        # The selected rows only: the others' may differ from the learner's (those of a lost agent's
        # envs, which its replacement's new local processes never had, until they step).
        self._copy_results(slice(None) if inner_mask is None else inner_mask)
        obs = {}
        if not self.buffers.obs_layout.buffered:
            obs = {
                self.first_index + slot: result.obs[slot]
                for slot in range(self.pool.num_envs)
                if mask is None or mask[slot]
            }
        return step_parts(infos=_shifted(result.infos, self.first_index), obs=obs)

    def call(
        self, name: str, args: tuple, kwargs: dict, slots: list[int], require_callable: bool, through_wrappers: bool
    ) -> list:
        return self._run(
            f"call {name}", lambda: self.pool.call(name, args, kwargs, slots, require_callable, through_wrappers)
        )

    def get_attr(self, name: str, slots: list[int], through_wrappers: bool) -> list:
        return self._run(f"get_attr {name}", lambda: self.pool.get_attr(name, slots, through_wrappers))

    def set_attr(self, name: str, values: list, slots: list[int], through_wrappers: bool) -> None:
        self._run(f"set_attr {name}", lambda: self.pool.set_attr(name, values, slots, through_wrappers))

    def is_wrapped(self, wrapper_class: type, slots: list[int]) -> list[bool]:
        return self._run("env_is_wrapped", lambda: self.pool.env_is_wrapped(wrapper_class, slots))

    def preload(self, modules: tuple[str, ...]) -> None:
        """Have the local processes import ``modules`` too, in the background."""
        self._run("preload", lambda: self.pool.preload(modules))

    def deploy(self, policy: bytes, weights: WeightsRegion, seed: int | None) -> AgentActors:
        """Deploy the learner's cloudpickled ``policy`` on the local processes (the agent's seed
        ``seed`` is that of its first process), fed from the learner's ``weights``."""
        # The local processes start torch while this process does, to unpickle the policy.
        self.preload(("torch",))
        try:
            unpickled = pickle.loads(policy)
        except Exception as error:
            raise RemoteFailure(None, "deploying the policy", error) from error
        try:
            return self._run(
                "deploying the policy", lambda: AgentActors(self.pool, self.first_index, unpickled, weights, seed)
            )
        except RelayedEnvFailure as failure:
            # A local process refused it. The inner pool's error says which others took it; to the
            # learner, this agent as a whole did not.
            raise RelayedEnvFailure(failure.error, "deploying the policy") from failure.error

    def rollout(
        self,
        actors: AgentActors,
        n_steps: int,
        context: dict,
        arrays: RolloutArrays,
        report: Callable[[int], None],
        report_every: float,
        request_waiting: Callable[[], bool],
        timeout: float,
    ) -> dict:
        """Collect a segment with the deployed ``actors`` (see :meth:`AgentActors.collect`), and leave
        the learner's buffers as a flat worker's segment leaves them: the rows after its last step."""
        try:
            result = self._run(
                "rollout",
                lambda: actors.collect(n_steps, context, arrays, report, report_every, request_waiting, timeout),
            )
        finally:
            self.replaced_in_segment = self.replaced  # also what a failed segment's reply says
        self._copy_results()
        result = with_env_restarts(result, self.replaced)
        replaced_processes, self._replaced_processes = self._replaced_processes, []
        if replaced_processes:
            result["process_restarts"] = replaced_processes
        return result

    def close(self, starting: Callable[[int], None] | None = None) -> None:
        """Close the inner pool: every env, then the local processes; the first env's error raised.

        :param starting: unused: the local processes close their envs at once, so no env is the one closing
        """
        self._run("close", self.pool.close)

    def _run(self, operation: str, call: Callable[[], Any]) -> Any:
        """``call()`` on the inner pool, its failures turned into the worker's, and the envs it
        replaced noted in :attr:`replaced` (also when it failed)."""
        # Envs are replaced only with restart_failed_envs: no per-env count to compare on every step otherwise.
        before = list(self.pool.env_restarts) if self.pool.restart_failed_envs else None
        processes_before = self.pool.restarts["workers"]
        self.replaced = []
        try:
            return call()
        except EnvError as error:
            raise RelayedEnvFailure(error) from error
        except ClusterEnvError as error:  # a local process lost or silent, or the inner pool unusable since
            # The error names the local process and its envs as the learner knows them (worker_names).
            raise RemoteFailure(None, f"{operation} in the node agent's local processes", error) from error
        finally:
            if before is not None:
                for slot, (was, now) in enumerate(zip(before, self.pool.env_restarts)):
                    self.replaced.extend([self.first_index + slot] * (now - was))
            if self.pool.restarts["workers"] != processes_before:
                self._note_replaced_processes()

    def _note_replaced_processes(self) -> None:
        """Note the local processes the inner pool replaced (by their new process ids), for the next
        step's reply: also those replaced in a call other than a step, which finished a step that
        had failed (the inner pool replaces the lost once the others' replies are in)."""
        pids, before = self.pool.worker_pids, self._pids
        self._replaced_processes.extend(process for process, pid in enumerate(pids) if pid != before[process])
        self._pids = pids

    def _copy_results(self, selected: slice | np.ndarray = slice(None)) -> None:
        for rows, inner in self._result_copies:
            rows[selected] = inner[selected]


def _any_space_fits(space: Any, first: Any) -> bool:
    return True


def _shifted(by_slot: dict[int, Any], first_index: int) -> dict[int, Any]:
    """``by_slot`` keyed by global env index instead."""
    return {first_index + slot: value for slot, value in by_slot.items()}
