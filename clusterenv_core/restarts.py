"""Replacing workers lost during a step or a rollout segment (``restart_failed_workers``), so long
runs survive a crash.

A worker that dies or exceeds the timeout during a step is killed and replaced by a new process
that rebuilds its block of envs; the interrupted episodes end truncated, with their last
observation from before the step, and the reason under the info key
:data:`~clusterenv_core.protocol.RESTART_INFO_KEY`. One lost during a segment is replaced likewise,
and the replacement collects that block's part of the segment anew, from new episodes. Only
backends that can replace a worker do (the local one; MPI is fail-stop). The pool holds one
:class:`WorkerRestarts` when restarts are on and consults it only when a worker is lost, plus one
copy per step of the observations (and, in ``next_step`` mode, of which envs the step resets).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from clusterenv_core import protocol
from clusterenv_core.errors import ClusterEnvError
from clusterenv_core.protocol import RESTART_INFO_KEY

if TYPE_CHECKING:
    from clusterenv_core.pool import EnvPool

TakeOver = TypeVar("TakeOver")


class WorkerRestarts:
    """The restart bookkeeping of one pool.

    :param pool: the pool whose workers are replaced (its buffers exist)
    """

    def __init__(self, pool: EnvPool) -> None:
        self.pool = pool
        self.counts = [0] * pool.num_workers  # replacements of each worker so far
        #: workers lost during the pending step, to replace before it completes; each stays listed
        #: until its replacement took over, so that one interrupted (Ctrl-C) is done again
        self.lost: dict[int, ClusterEnvError] = {}
        self._counted: set[int] = set()  # lost workers whose replacement is counted already
        self._taken_over: dict[int, dict] = {}  # step results of replacements not yet returned
        layout = pool.buffers.obs_layout
        # Observations before the current step, to end the episodes of a replaced worker with.
        self.obs_before_step: list = [np.empty_like(array) for array in pool.buffers.obs] if layout.buffered else []
        # next_step mode: the envs whose current step is a reset (their flags say that their episode
        # ended; a reset by the learner clears them), which a replacement resets instead of ending a
        # second time.
        self.reset_step_due = np.zeros(pool.num_envs, dtype=bool)

    def may_replace(self, worker: int) -> bool:
        return self.counts[worker] < self.pool.max_restarts

    def remember_step_start(self, block: range | None = None) -> None:
        """Keep what a replacement needs of the state the coming step starts from (of one worker's
        ``block`` of envs when only that one steps: asynchronous batches): the observations and,
        in ``next_step`` mode, which envs the step resets."""
        pool = self.pool
        buffers = pool.buffers
        rows = slice(None) if block is None else slice(block.start, block.stop)
        if buffers.obs_layout.buffered:
            for kept, current in zip(self.obs_before_step, buffers.obs):
                np.copyto(kept[rows], current[rows])
        else:
            self.obs_before_step = list(pool._obs)
        if pool.autoreset_mode == "next_step":
            np.logical_or(buffers.terminated[rows], buffers.truncated[rows], out=self.reset_step_due[rows])

    def replace_lost(self) -> dict[int, dict]:
        """Replace every worker lost in this step; returns each one's step result."""
        for worker in sorted(self.lost):
            self._taken_over[worker] = self._replace(worker, self.lost[worker], self._take_over_step)
            del self.lost[worker]
        results, self._taken_over = self._taken_over, {}
        return results

    def replace_lost_in_segment(self, start_segment: Callable[[int, str], None]) -> None:
        """Replace every worker lost during a rollout segment.

        A replacement builds the lost worker's envs, takes the deployed policy and resets the envs
        (unseeded, as automatic resets do); ``start_segment(worker, reason)`` then sends it the
        segment's request, so that it collects the block's part of the segment anew, from new
        episodes. The episodes the lost worker was in end where the previous segment ended, which
        the learner has bootstrapped as any segment's end; their steps in this segment are dropped
        with the lost worker.
        """

        def take_over(worker: int, error: ClusterEnvError) -> None:
            self._rebuild(worker)
            # The reset's infos are dropped: a segment has no place for those of a reset before its first step.
            self._reset_replacement(worker, None)
            start_segment(worker, self._reason(worker, error))

        for worker in sorted(self.lost):
            self._replace(worker, self.lost[worker], take_over)
            del self.lost[worker]

    def _replace(
        self, worker: int, error: ClusterEnvError, take_over: Callable[[int, ClusterEnvError], TakeOver]
    ) -> TakeOver:
        """Start a new worker for a lost one's envs and count it; returns what ``take_over(worker,
        error)`` returns, which has the new worker take the lost one's place."""
        pool = self.pool
        pool._not_awaiting(worker)  # a request of an interrupted replacement, whose process goes
        try:
            pool._transport.restart(worker, pool.timeout)
        except NotImplementedError:
            raise pool._fail(error) from None
        if worker not in self._counted:
            self._counted.add(worker)
            self.counts[worker] += 1
            pool.restarts["workers"] += 1
        try:
            result = take_over(worker, error)
        except ClusterEnvError as failure:  # e.g. the factories raise now: the pool cannot go on
            raise pool._fail(failure) from error
        self._counted.discard(worker)
        return result

    def _rebuild(self, worker: int) -> None:
        """Build the lost worker's envs on its replacement, attach it to the buffers and give it
        the deployed policy, if there is one."""
        pool = self.pool
        from clusterenv_core.pool import START_TIMEOUT

        start_timeout = max(pool.timeout, START_TIMEOUT)
        block = pool.blocks[worker]
        env_restarts = [pool.env_restarts[index] for index in block]
        pool._send(worker, dataclasses.replace(pool._init_requests[worker], restarted=True, env_restarts=env_restarts))
        pool._gather([worker], "recreating the envs of a lost worker", timeout=start_timeout)
        pool._attach([worker], start_timeout)
        if pool._act_layout.buffered:  # the new worker reads actions in the space's dtypes: as the lost one did
            wanted = pool._worker_action_dtypes[worker]
            pool._worker_action_dtypes[worker] = pool._space_action_dtypes
            pool._set_action_dtypes(wanted or pool._space_action_dtypes, [worker])
        if pool.actors is not None:
            pool.actors.deploy_on_replacement(worker)

    def _reason(self, worker: int, error: ClusterEnvError) -> str:
        return f"worker {worker} was replaced (restart {self.counts[worker]} of {self.pool.max_restarts}) after: {error}"

    def _take_over_step(self, worker: int, error: ClusterEnvError) -> dict:
        """Build the lost worker's envs on its replacement and end their interrupted episodes as
        truncated; returns the block's step result.

        The episodes' last observations are those from before the step. In ``same_step`` mode the
        new envs are reset now (unseeded); in ``next_step`` mode they reset at their next step,
        except those whose step was the reset after an episode end, which reset now and return that
        step; in ``disabled`` mode the caller resets them.
        """
        pool = self.pool
        self._rebuild(worker)
        block = pool.blocks[worker]
        layout, rows = pool.buffers.obs_layout, slice(block.start, block.stop)
        if layout.buffered:
            previous: dict[int, Any] = {i: layout.read(self.obs_before_step, i) for i in block}
        else:
            previous = {i: self.obs_before_step[i] for i in block}
        reason = self._reason(worker, error)
        infos = {i: {RESTART_INFO_KEY: reason} for i in block}
        result: dict[str, dict] = {"infos": infos}
        starting = np.zeros(len(block), dtype=bool)  # envs whose step was a reset: they start an episode
        if pool.autoreset_mode == "same_step":
            result["final_obs"] = previous
            reset = self._reset_replacement(worker, None)
            result["reset_infos"] = reset.get("infos", {})
            if "obs" in reset:
                result["obs"] = reset["obs"]
        else:
            if layout.buffered:
                for kept, current in zip(self.obs_before_step, pool.buffers.obs):
                    current[rows] = kept[rows]
            else:
                result["obs"] = previous
            if pool.autoreset_mode == "next_step":
                starting = self.reset_step_due[rows].copy()
            if starting.any():
                # Their episodes ended at the last step, which the user has seen: ending them again
                # would add an episode of no steps. They take the reset step they were due.
                reset = self._reset_replacement(worker, starting.tolist())
                for index, info in reset.get("infos", {}).items():
                    infos[index] = {**info, RESTART_INFO_KEY: reason}
                if "obs" in reset:  # spaces without buffers
                    result["obs"].update(reset["obs"])
        pool.buffers.rewards[rows] = 0.0
        pool.buffers.terminated[rows] = False
        pool.buffers.truncated[rows] = ~starting
        return result

    def _reset_replacement(self, worker: int, mask: list[bool] | None) -> dict:
        """Reset the replacement's envs selected by ``mask`` (all when ``None``) with ``reset()``, as
        autoresets and a worker's own env replacements reset; returns the reply's parts (infos,
        observations of spaces without buffers)."""
        size = len(self.pool.blocks[worker])
        self.pool._send(worker, protocol.Reset([None] * size, [None] * size, mask, protocol.RESET_KEYWORDS))
        return self.pool._gather([worker], "resetting the envs of a lost worker")[worker] or {}
