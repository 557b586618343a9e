"""AgentActors: a node agent's policy copies, one on each of its local processes.

A node agent (:mod:`clusterenv_core.node_agent`) does not act itself: it deploys the learner's
policy on its inner pool, so that each local process acts for its part of the block as the flat
worker it stands for would (same envs, same seed); it relays the learner's weights to them, and runs
each rollout segment on them with the inner pool's :class:`~clusterenv_core.actors.WorkerActors`,
then copies the block's segment into the learner's region and answers once for the block, in the
layout a flat worker's reply has.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from clusterenv_core.protocol import RESTART_INFO_KEY
from clusterenv_core.worker.env_block import step_parts

if TYPE_CHECKING:
    from clusterenv_core.inference import WeightsRegion
    from clusterenv_core.rollout import Rollout, RolloutArrays

# How often the local processes report progress to the agent during a segment: the agent looks for
# its learner's requests (a close) and for newer weights then, and forwards every report_every.
_LOOK_EVERY = 0.05


class _LearnerAsks(Exception):
    """The learner sent a request while a segment was collected: it does so only to close."""


class AgentActors:
    """The learner's policy deployed on a node agent's local processes.

    The agent unpickles the policy and deploys it on its inner pool again, rather than forwarding the
    pickled bytes to each local process: the inner pool's deploy then checks it, lays out the
    weights region the local processes share with the agent, seeds each process and leaves no
    policy acting where one process refuses it, as for any pool, with none of that written twice.
    The cost is the agent's: torch imported, and one more copy of the policy, once per host.

    :param pool: the agent's inner pool (an :class:`~clusterenv_core.pool.EnvPool`, not imported: the
        pool imports the node agent)
    :param first_index: global index of the block's first env
    :param policy: the learner's policy, unpickled
    :param weights: the learner's weights region as the agent maps it (or receives it, on a backend
        without shared memory), holding version 0, the policy's own weights
    :param seed: local process ``p`` seeds with ``seed + p`` (``None``: unseeded)
    """

    def __init__(self, pool: Any, first_index: int, policy: Any, weights: WeightsRegion, seed: int | None) -> None:
        self.pool = pool
        self.first_index = first_index
        self.weights = weights
        self.actors = pool.deploy(policy, seed)
        self._flat = np.empty_like(weights.weights)

    def relay_weights(self) -> None:
        """Publish the learner's newer weights, if any, to the local processes, as the learner's version."""
        actors = self.actors
        version = self.weights.read_newer(actors.policy_version, self._flat)
        if version is not None:
            actors.publish_weights(self._flat, version=version)

    def collect(
        self,
        n_steps: int,
        context: dict,
        arrays: RolloutArrays,
        report: Callable[[int], None],
        report_every: float,
        request_waiting: Callable[[], bool],
        timeout: float,
    ) -> dict:
        """Collect a segment of ``n_steps`` on the local processes into ``arrays`` (the learner's
        region, whose rows start at ``arrays.row0``); returns what
        :func:`~clusterenv_core.worker.rollout_collection.collect_segment` returns for a flat worker,
        less the envs replaced in the segment, which :func:`with_env_restarts` adds. A local process
        may go ``timeout`` seconds without progress, as a flat worker may.

        ``report(steps)`` forwards the local processes' progress every ``report_every`` seconds;
        weights the learner publishes meanwhile reach them at their next report. Once
        ``request_waiting()`` says the learner sent a request (a close), the segment is left to the
        inner pool's close, which ends it at each process's next step, and the learner gets an
        unfinished one, as from a flat worker that its close cut short.
        """
        started = time.perf_counter()
        next_report = time.monotonic() + report_every

        def on_progress(process: int, steps: int) -> None:
            nonlocal next_report
            if request_waiting():
                raise _LearnerAsks
            self.relay_weights()
            if time.monotonic() >= next_report:
                report(steps)
                next_report = time.monotonic() + report_every

        self.relay_weights()
        self.actors.rollout_async(n_steps, context, timeout=timeout, progress_every=_LOOK_EVERY)
        try:
            rollout = self.actors.rollout_wait(on_progress=on_progress)
        except _LearnerAsks:
            return {"seconds": time.perf_counter() - started}
        segment = slice(arrays.row0, arrays.row0 + self.pool.num_envs)
        for mine, collected in zip(arrays.all, rollout.arrays.all):
            mine[segment] = collected
        result: dict[str, Any] = {"seconds": time.perf_counter() - started}
        steps = _steps(rollout, self.first_index)
        if steps:
            result["steps"] = steps
        if rollout.restarted_envs:  # a local process lost in the segment, replaced by the inner pool
            result["restarted_envs"] = [self.first_index + slot for slot in rollout.restarted_envs]
        return result


def _steps(rollout: Rollout, first_index: int) -> dict[int, dict]:
    """The step parts a flat worker's segment result holds, by step: what did not fit the buffers,
    keyed by global env index."""
    final_obs: dict[int, dict[int, Any]] = {}
    for (step, slot), obs in rollout.pickled_final_obs.items():
        final_obs.setdefault(step, {})[first_index + slot] = obs
    steps = {}
    for step, (infos, reset_infos) in enumerate(zip(rollout.infos, rollout.reset_infos)):
        if infos or reset_infos or step in final_obs:
            steps[step] = step_parts(
                infos={first_index + slot: info for slot, info in infos.items()},
                reset_infos={first_index + slot: info for slot, info in reset_infos.items()},
                final_obs=final_obs.get(step),
            )
    return steps


def with_env_restarts(result: dict, replaced: list[int]) -> dict:
    """A segment's ``result`` with the envs the inner pool replaced in it (``replaced``, by global
    index, as often as each was) under ``"env_restarts"`` of the step each was replaced at, where a
    flat worker's parts name them: the step whose info says so (:data:`RESTART_INFO_KEY`)."""
    if not replaced:
        return result
    steps = result.setdefault("steps", {})
    left = Counter(replaced)
    last_said: dict[int, int] = {}
    for step in sorted(steps):
        for index, info in steps[step].get("infos", {}).items():
            if left[index] and isinstance(info, dict) and RESTART_INFO_KEY in info:
                steps[step].setdefault("env_restarts", []).append(index)
                left[index] -= 1
                last_said[index] = step
    # An env replaced twice in one step (its replacement's reset failed too) is said once there.
    for index in sorted(left.elements()):
        steps.setdefault(last_said.get(index, 0), {}).setdefault("env_restarts", []).append(index)
    return result
