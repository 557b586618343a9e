"""The worker side of a rollout: a segment of steps collected with the worker's policy copy.

Per step the policy copy takes the block's observations (after fetching newer weights) and chooses
the actions; the block steps with them as in a learner-driven step, and the step's data goes into
the segment arrays the learner reads (:class:`~clusterenv_core.rollout.RolloutArrays`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from clusterenv_core.spaces import delivered_dtype
from clusterenv_core.worker.remote_failure import RemoteFailure

if TYPE_CHECKING:
    from clusterenv_core.inference import PolicyHost
    from clusterenv_core.rollout import RolloutArrays
    from clusterenv_core.worker.env_block import EnvBlock

# How often a worker collecting a segment looks for a request from the learner (a close): a system
# call or MPI probe, so not after every step of a fast env.
_REQUEST_LOOK_EVERY = 0.01


def collect_segment(
    block: EnvBlock,
    n_steps: int,
    context: dict,
    host: PolicyHost,
    arrays: RolloutArrays,
    report: Callable[[int], None],
    report_every: float,
    request_waiting: Callable[[], bool],
) -> dict:
    """Run ``n_steps`` steps of every env of ``block``, acting with the local policy copy ``host``,
    into ``arrays`` (whose rows start at ``arrays.row0``).

    Each step goes through :meth:`EnvBlock.step`, so autoreset, restarts and infos behave as in a
    learner-driven step; returns the seconds the segment took (``"seconds"``) and the
    non-empty step results by step index (``"steps"``, when there are any). ``report(steps)``
    runs after a step when ``report_every`` seconds passed since the start or the last report.
    The segment ends early, after the step in progress, once ``request_waiting()`` (asked every
    ``_REQUEST_LOOK_EVERY`` seconds) says the learner sent a request: it only does so to close.
    """
    started = time.perf_counter()
    next_report = time.monotonic() + report_every
    next_look = time.monotonic() + _REQUEST_LOOK_EVERY
    buffers, rows = block.buffers, block.rows
    segment = slice(arrays.row0, arrays.row0 + len(block.envs))
    (actions,) = buffers.actions  # deploying checked that the action space is one field
    (field,) = buffers.act_layout.fields
    learner_reader = block.read_action
    block.replaced_in_segment = []
    steps: dict[int, dict] = {}
    try:
        for t in range(n_steps):
            version = host.refresh()
            current = [array[rows] for array in buffers.obs]
            for kept, now in zip(arrays.obs, current):
                kept[segment, t] = now
            try:
                out = host.act(block.obs_layout.batch(current), context)
            except Exception as error:
                raise RemoteFailure(None, "policy act", error) from error
            env_actions = out.get("env_actions", out["actions"])
            if t == 0:  # envs get the policy's dtype, as from SB3's and CleanRL's own loops
                block.set_action_dtypes([delivered_dtype(field.dtype, np.asarray(env_actions).dtype)])
            actions[rows] = env_actions
            arrays.actions[0][segment, t] = out["actions"]
            for name in ("log_probs", "values"):
                if name in out:
                    getattr(arrays, name)[segment, t] = out[name].reshape(-1)
            parts = block.step()
            for name in ("rewards", "terminated", "truncated"):
                getattr(arrays, name)[segment, t] = getattr(buffers, name)[rows]
            for kept, final in zip(arrays.final_obs, buffers.final_obs):
                kept[segment, t] = final[rows]
            arrays.versions[segment, t] = version
            if parts:
                steps[t] = parts
            if t + 1 < n_steps:
                clock = time.monotonic()
                if clock >= next_look:
                    if request_waiting():
                        break
                    next_look = clock + _REQUEST_LOOK_EVERY
                if clock >= next_report:
                    report(t + 1)
                    next_report = time.monotonic() + report_every
    finally:
        block.read_action = learner_reader  # learner-driven steps read in the dtypes the learner set
    for kept, now in zip(arrays.last_obs, buffers.obs):
        kept[segment] = now[rows]
    result: dict[str, Any] = {"seconds": time.perf_counter() - started}
    if steps:
        result["steps"] = steps
    return result
