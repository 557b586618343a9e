"""Validation of arguments, shared by the core and the adapters: one message style, before anything is sent."""

from __future__ import annotations

from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (Python or numpy), ``bool`` excluded."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as an int, or ``ValueError`` naming ``name`` (``TypeError`` if it is no integer at all).

    :param minimum: the smallest value allowed, if any
    """
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool, or ``TypeError`` naming ``name``: a string such as ``"False"`` is no
    switch, and ``bool()`` of it would turn the option on."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_seconds(name: str, value: Any, *, allow_zero: bool = False, below: float = float("inf")) -> float:
    """A finite number of seconds, positive (or zero with ``allow_zero``) and less than ``below``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        ok = False
    else:
        ok = (value >= 0 if allow_zero else value > 0) and value < below and value != float("inf")
    if not ok:
        sign = "non-negative" if allow_zero else "positive"
        limit = f" below {below:g}" if below != float("inf") else ""
        raise ValueError(f"{name} must be a {sign} number of seconds{limit}, got {value!r}")
    return float(value)


def check_indices(indices: Any, num_envs: int) -> list[int]:
    """Env indices (``None``: all, an int: one; negative ones count from the end) as a list of ints."""
    if indices is None:
        return list(range(num_envs))
    if is_int(indices):
        indices = [indices]
    result = []
    for index in indices:
        if not is_int(index):
            raise TypeError(f"env indices must be ints, got {index!r}")
        if not -num_envs <= index < num_envs:
            raise IndexError(f"env index {index} out of range for {num_envs} envs")
        result.append(int(index) % num_envs)
    return result


def per_env_values(values: Any, num_envs: int, what: str) -> list:
    """One value per env (``None``: ``None`` for each), or ``ValueError`` naming ``what``."""
    if values is None:
        return [None] * num_envs
    values = list(values)
    if len(values) != num_envs:
        raise ValueError(f"{what}: expected {num_envs} values (one per env), got {len(values)}")
    return values


def check_names(what: str, names: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``names``, some of ``allowed``, as a tuple; ``TypeError`` naming ``what`` for a string or a
    non-iterable, ``ValueError`` for a name not allowed."""
    if isinstance(names, str) or not hasattr(names, "__iter__"):
        raise TypeError(f"{what} must be a sequence of names from {allowed}, got {names!r}")
    names = tuple(names)
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise ValueError(f"{what} may name only {allowed}, got {unknown!r}")
    return names


def check_processes_per_worker(value: Any, smallest_block: int, inline_worker: bool) -> int:
    """``processes_per_worker`` as an int between 1 and the envs of the smallest block.

    :param inline_worker: the local backend's ``inline_worker`` is set
    :raises ValueError: out of range, or more than 1 with ``inline_worker``
    """
    value = check_int("processes_per_worker", value, minimum=1)
    if value > smallest_block:
        raise ValueError(
            f"processes_per_worker={value} is more than the {smallest_block} env(s) of the smallest worker's "
            "block: each local process needs at least one env"
        )
    if value > 1 and inline_worker:
        raise ValueError(
            "inline_worker=True runs the last worker's block in the learner's own process, and with "
            f"processes_per_worker={value} each worker is a node agent stepping its block on local processes "
            "of its own: the two exclude each other; to use node agents, run the pool without inline_worker"
        )
    return value
