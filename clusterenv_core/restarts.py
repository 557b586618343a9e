"""Replacing workers lost during a step or a rollout segment (``restart_failed_workers``), so long
runs survive a crash.

A worker that dies or exceeds the timeout during a step is killed and replaced by a new process
that rebuilds its block of envs; the interrupted episodes end truncated, with their last
observation from before the step, and the reason under the info key
:data:`~clusterenv_core.protocol.RESTART_INFO_KEY`. One lost during a segment is replaced likewise,
and the replacement collects that block's part of the segment anew, from new episodes. Only
backends that can replace a worker do (the local and Ray ones; MPI is fail-stop), though a node agent's
inner pool, a local one, replaces the agent's local processes on any backend. The pool holds one
:class:`WorkerRestarts` when restarts are on and consults it only when a worker is lost, plus one
copy per step of the observations (and, in ``next_step`` mode, of which envs the step resets). The
:class:`~clusterenv_core.channel.WorkerChannel` notes which workers were lost (``channel.lost``)
and counts the replacements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from clusterenv_core import protocol
from clusterenv_core.channel import WorkerChannel
from clusterenv_core.errors import ClusterEnvError
from clusterenv_core.protocol import RESTART_INFO_KEY
from clusterenv_core.replies import START_TIMEOUT

TakeOver = TypeVar("TakeOver")


class WorkerRestarts:
    """The restart bookkeeping of one pool.

    :param channel: the pool's messaging (its buffers exist; it was made with ``max_worker_restarts``)
    :param autoreset_mode: the pool's
    :param init_requests: each worker's first request, which its replacements get again (marked
        restarted, with the restart counts of its envs then)
    :param current_obs: the pool's per-env observations, for spaces without buffers
    """

    def __init__(
        self,
        channel: WorkerChannel,
        autoreset_mode: str,
        init_requests: list[protocol.Init],
        current_obs: Callable[[], list],
    ) -> None:
        self.channel = channel
        self.autoreset_mode = autoreset_mode
        self._init_requests = init_requests
        self._current_obs = current_obs
        # Each lost worker stays in channel.lost until its replacement took over, so that one
        # interrupted (Ctrl-C) is done again; counted once.
        self._counted: set[int] = set()  # lost workers whose replacement is counted already
        self._taken_over: dict[int, dict] = {}  # step results of replacements not yet returned
        buffers = channel.buffers
        # Observations before the current step, to end the episodes of a replaced worker with.
        self.obs_before_step: list = (
            [np.empty_like(array) for array in buffers.obs] if buffers.obs_layout.buffered else []
        )
        # next_step mode: the envs whose current step is a reset (their flags say that their episode
        # ended; a reset by the learner clears them), which a replacement resets instead of ending a
        # second time.
        self.reset_step_due = np.zeros(channel.num_envs, dtype=bool)

    def remember_step_start(self, block: range | None = None) -> None:
        """Keep what a replacement needs of the state the coming step starts from (of one worker's
        ``block`` of envs when only that one steps: asynchronous batches): the observations and,
        in ``next_step`` mode, which envs the step resets."""
        buffers = self.channel.buffers
        rows = slice(None) if block is None else slice(block.start, block.stop)
        if buffers.obs_layout.buffered:
            for kept, current in zip(self.obs_before_step, buffers.obs):
                np.copyto(kept[rows], current[rows])
        else:
            self.obs_before_step = list(self._current_obs())
        if self.autoreset_mode == "next_step":
            np.logical_or(buffers.terminated[rows], buffers.truncated[rows], out=self.reset_step_due[rows])

    def replace_lost(self) -> dict[int, dict]:
        """Replace every worker lost in this step; returns each one's step result."""
        lost = self.channel.lost
        for worker in sorted(lost):
            self._taken_over[worker] = self._replace(worker, lost[worker], self._take_over_step)
            del lost[worker]
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

        lost = self.channel.lost
        for worker in sorted(lost):
            self._replace(worker, lost[worker], take_over)
            del lost[worker]

    def move_back(self, workers: list[int]) -> None:
        """At a reset of all their envs, move each of ``workers`` whose replacement had to run
        outside its place (a lost node's, with no node then to take it) back to that place, now
        that it has room: its envs are rebuilt there, with the deployed policy, ready for the
        reset. Not counted as a restart: nothing failed."""
        channel = self.channel
        try:
            for worker in channel.move_back(workers):
                self._rebuild(worker)
        except ClusterEnvError as failure:  # no place and no node left for the envs: the pool cannot go on
            raise channel.fail(failure) from None

    def _replace(
        self, worker: int, error: ClusterEnvError, take_over: Callable[[int, ClusterEnvError], TakeOver]
    ) -> TakeOver:
        """Start a new worker for a lost one's envs and count it; returns what ``take_over(worker,
        error)`` returns, which has the new worker take the lost one's place."""
        channel = self.channel
        try:
            channel.restart(worker, error)
        except ClusterEnvError as failure:  # no replacement within the backend's bound: the pool cannot go on
            raise channel.fail(failure) from error
        if worker not in self._counted:
            self._counted.add(worker)
            channel.count_restart(worker)
        try:
            result = take_over(worker, error)
        except ClusterEnvError as failure:  # e.g. the factories raise now: the pool cannot go on
            raise channel.fail(failure) from error
        self._counted.discard(worker)
        return result

    def _rebuild(self, worker: int) -> None:
        """Build a lost worker's envs on its replacement, ready to step as the lost one was: attached
        to the buffers, reading actions as the lost one did, with the deployed policy if there is one."""
        channel = self.channel
        start_timeout = max(channel.timeout, START_TIMEOUT)
        env_restarts = [channel.env_restarts[index] for index in channel.blocks[worker]]
        request = dataclasses.replace(self._init_requests[worker], restarted=True, env_restarts=env_restarts)
        channel.send(worker, request)
        channel.gather([worker], "recreating the envs of a lost worker", timeout=start_timeout)
        channel.attach([worker], start_timeout)
        channel.tell_replacement_dtypes(worker)
        if channel.deployed is not None:
            channel.deployed.deploy_on_replacement(worker)

    def _reason(self, worker: int, error: ClusterEnvError) -> str:
        channel = self.channel
        count, most = channel.worker_restarts[worker], channel.max_worker_restarts
        return f"{channel.transport.names.worker(worker)} was replaced (restart {count} of {most}) after: {error}"

    def _take_over_step(self, worker: int, error: ClusterEnvError) -> dict:
        """Build the lost worker's envs on its replacement and end their interrupted episodes as
        truncated; returns the block's step result.

        The episodes' last observations are those from before the step. In ``same_step`` mode the
        new envs are reset now (unseeded); in ``next_step`` mode they reset at their next step,
        except those whose step was the reset after an episode end, which reset now and return that
        step; in ``disabled`` mode the caller resets them.
        """
        buffers = self.channel.buffers
        self._rebuild(worker)
        block = self.channel.blocks[worker]
        layout, rows = buffers.obs_layout, slice(block.start, block.stop)
        if layout.buffered:
            previous: dict[int, Any] = {i: layout.read(self.obs_before_step, i) for i in block}
        else:
            previous = {i: self.obs_before_step[i] for i in block}
        reason = self._reason(worker, error)
        infos = {i: {RESTART_INFO_KEY: reason} for i in block}
        result: dict[str, dict] = {"infos": infos}
        starting = np.zeros(len(block), dtype=bool)  # envs whose step was a reset: they start an episode
        if self.autoreset_mode == "same_step":
            result["final_obs"] = previous
            reset = self._reset_replacement(worker, None)
            result["reset_infos"] = reset.get("infos", {})
            if "obs" in reset:
                result["obs"] = reset["obs"]
        else:
            if layout.buffered:
                for kept, current in zip(self.obs_before_step, buffers.obs):
                    current[rows] = kept[rows]
            else:
                result["obs"] = previous
            if self.autoreset_mode == "next_step":
                starting = self.reset_step_due[rows].copy()
            if starting.any():
                # Their episodes ended at the last step, which the user has seen: ending them again
                # would add an episode of no steps. They take the reset step they were due.
                reset = self._reset_replacement(worker, starting.tolist())
                for index, info in reset.get("infos", {}).items():
                    infos[index] = {**info, RESTART_INFO_KEY: reason}
                if "obs" in reset:  # spaces without buffers
                    result["obs"].update(reset["obs"])
        buffers.rewards[rows] = 0.0
        buffers.terminated[rows] = False
        buffers.truncated[rows] = ~starting
        return result

    def _reset_replacement(self, worker: int, mask: list[bool] | None) -> dict:
        """Reset the replacement's envs selected by ``mask`` (all when ``None``) with ``reset()``, as
        autoresets and a worker's own env replacements reset; returns the reply's parts (infos,
        observations of spaces without buffers)."""
        size = len(self.channel.blocks[worker])
        self.channel.send(worker, protocol.Reset([None] * size, [None] * size, mask, protocol.RESET_KEYWORDS))
        return self.channel.gather([worker], "resetting the envs of a lost worker")[worker] or {}
