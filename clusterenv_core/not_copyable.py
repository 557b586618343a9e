"""NotCopyable: what holds worker processes refuses to be copied or pickled, and says why."""

from __future__ import annotations

from typing import Any


class NotCopyable:
    """Refuses ``copy.copy``, ``copy.deepcopy`` and pickling with a ``TypeError`` that says why: what
    holds a pool holds worker processes, which a copy could neither take along nor safely share
    (closing one would stop the other's workers)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        name = type(self).__name__
        raise TypeError(
            f"this {name} cannot be copied or pickled: its envs live in worker processes, which a copy could "
            f"neither take along nor safely share; build another {name} from the env factories instead"
        )
