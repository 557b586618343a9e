"""What the learner and its workers say to each other, shared by the pool, the worker and backends.

Control messages are ``(op, payload)`` tuples, replies ``("ok", result)`` or ``("error", details)``;
a step request is the bare :data:`STEP` so backends can send it without pickling anything. A long
operation (a rollout segment) may send interim ``(PROGRESS, steps_done)`` replies before its reply.
"""

from __future__ import annotations

import pickle
from typing import Any

STEP = "step"

PROGRESS = "progress"
"""Status of an interim reply: the worker is still working (and how far it got). Waits on it
restart their timeout, so a timeout bounds the time without progress, not the whole operation."""

AUTORESET_MODES = ("same_step", "next_step", "disabled")

RESTART_INFO_KEY = "clusterenv_restart"
"""Info key of a step whose episode was cut short because its env or worker was replaced; the value says why."""


def dumps(obj: Any) -> bytes:
    """Pickle with the standard pickler, falling back to cloudpickle for closures and lambdas."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        import cloudpickle

        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
