"""What an env may return, checked on the worker where the data is used anyway.

A step must return ``(obs, reward, terminated, truncated, info)`` with one number as reward, bools
as flags and a dict as info; a reset ``(obs, info)``. Whether the observation fits its space is
found by writing it into the buffers (:meth:`SpaceLayout.mismatch <clusterenv_core.spaces.SpaceLayout.mismatch>`
then says what is wrong), and whether infos can be pickled by pickling the reply
(:func:`unpicklable_part` then finds the env and key). A failure is an
:class:`~clusterenv_core.errors.InvalidEnvOutput` on the worker, an ``EnvError`` on the learner.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from clusterenv_core.errors import InvalidEnvOutput
from clusterenv_core.protocol import dumps
from clusterenv_core.spaces import describe


def checked_env(env: Any) -> Any:
    """What an env factory built, checked to be an environment: the learner needs its spaces."""
    missing = [name for name in ("reset", "step", "observation_space", "action_space") if not hasattr(env, name)]
    if missing:
        raise InvalidEnvOutput(f"the env factory returned {describe(env)}, not an environment (it has no {', '.join(missing)})")
    return env


def checked_step(result: Any) -> tuple:
    """An env's step result, checked as far as the buffers and the Gymnasium API need it."""
    if not isinstance(result, (tuple, list)) or len(result) != 5:
        raise InvalidEnvOutput(f"step must return (obs, reward, terminated, truncated, info), got {describe(result)}")
    _, reward, terminated, truncated, info = result
    if reward.__class__ is not float and not _is_number(reward):
        raise InvalidEnvOutput(f"the reward must be one number, got {describe(reward)}: {reward!r}")
    if not (terminated is True or terminated is False or _is_flag(terminated)):
        raise InvalidEnvOutput(f"terminated must be a bool, got {describe(terminated)}: {terminated!r}")
    if not (truncated is True or truncated is False or _is_flag(truncated)):
        raise InvalidEnvOutput(f"truncated must be a bool, got {describe(truncated)}: {truncated!r}")
    if info.__class__ is not dict and not isinstance(info, dict):
        raise InvalidEnvOutput(f"the info must be a dict, got {describe(info)}")
    return result


def checked_reset(result: Any) -> tuple:
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise InvalidEnvOutput(f"reset must return (obs, info), got {describe(result)}")
    if not isinstance(result[1], dict):
        raise InvalidEnvOutput(f"the info of reset must be a dict, got {describe(result[1])}")
    return result


def _is_flag(value: Any) -> bool:
    """A bool, an int (0/1 from older envs) or a numpy scalar or 0-d array of either: what
    DummyVecEnv and SyncVectorEnv store as a flag."""
    if isinstance(value, (bool, int, np.bool_, np.integer)):
        return True
    return isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "biu"


def _is_number(value: Any) -> bool:
    """One real number: a Python number, or a numpy scalar or 0-d array of one (DummyVecEnv stores those)."""
    if isinstance(value, (int, float)):
        return True
    return isinstance(value, (np.generic, np.ndarray)) and value.ndim == 0 and value.dtype.kind in "biuf"


def unpicklable_part(result: Any, indices: list[int] | None = None, label: str = "") -> tuple[int | None, str]:
    """Where a result that could not be pickled holds what cannot be: ``(env index, description)``.

    :param indices: for a per-env list (``call``, ``get_attr``), the env of each item
    :param label: what those items are (``"attribute 'lock'"``)
    """
    if indices is not None and isinstance(result, list):
        for index, value in zip(indices, result):
            if not _picklable(value):
                return index, f"the {label} of env {index} ({describe(value)})"
    parts_by_step = result.get("steps") if isinstance(result, dict) and "steps" in result else None
    for parts in parts_by_step.values() if parts_by_step else [result]:
        if not isinstance(parts, dict):
            continue
        for part, label in (("infos", "info"), ("reset_infos", "reset info"), ("final_obs", "final observation"), ("obs", "observation")):
            for index, value in (parts.get(part) or {}).items():
                if _picklable(value):
                    continue
                if isinstance(value, dict):
                    key = next((key for key, item in value.items() if not _picklable(item)), None)
                    if key is not None:
                        return index, f"the {label} of env {index} holds, under key {key!r}, {describe(value[key])}, which"
                return index, f"the {label} of env {index} ({describe(value)})"
    return None, f"the reply ({describe(result)})"


def _picklable(value: Any) -> bool:
    try:
        dumps(value)
    except Exception:
        return False
    return True
