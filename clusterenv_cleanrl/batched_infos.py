"""Gymnasium's batched infos (one array per key, with a ``_key`` mask) built in one go where they can be.

``ClusterVectorEnv`` (through gymnasium's ``VectorEnv._add_info``) and ``ClusterEnvPool`` (through
its own copy of that loop, by batch position) batch per-env infos one env and key at a time.
Both go through :func:`batch_infos`, which batches infos of numeric scalars with the same keys in
every env, the common case, in one go instead (:func:`numeric_infos`), with the same result.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np


def batch_infos(
    infos_by_index: dict[int, dict], num_envs: int, add_info: Callable[[dict[str, Any], dict, int], dict[str, Any]]
) -> dict[str, Any]:
    """The per-env infos batched: by :func:`numeric_infos` where it applies, else one
    ``add_info(batched, info, index)`` per env in index order (gymnasium's ``_add_info`` or an equal).

    :param infos_by_index: the non-empty infos, by env index (or batch position)
    :param num_envs: the length of the arrays
    :param add_info: adds one env's info to the batched dict and returns that dict
    """
    if not infos_by_index:
        return {}
    batched = numeric_infos(infos_by_index, num_envs)
    if batched is None:
        batched = {}
        for index in sorted(infos_by_index):
            batched = add_info(batched, infos_by_index[index], index)
    return batched


def numeric_infos(infos_by_index: dict[int, dict], num_envs: int) -> dict[str, Any] | None:
    """What gymnasium's ``VectorEnv._add_info`` builds from these infos, one array per key at once;
    or ``None`` unless every info has the same keys and each key's values are one numeric scalar
    type (MuJoCo's infos, Atari's). ``_add_info`` is a Python loop over envs and keys, about a
    microsecond per value, paid on the learner between two steps.

    Both gymnasium versions give such a key ``np.zeros(num_envs, dtype=type(value))`` filled with
    its values and a boolean mask, inserted key then mask, in the order the first env has them;
    with one type per key, converting the values at once stores the same bits (and raises the same
    ``OverflowError`` for a Python int past int64). Keys named as another key's mask, and
    ``final_obs`` (1.x batches it as objects), are left to ``_add_info``.

    :param infos_by_index: the non-empty infos, by env index (or batch position)
    :param num_envs: the length of the arrays
    """
    indices = sorted(infos_by_index)
    env_infos = [infos_by_index[index] for index in indices]
    keys = env_infos[0].keys()
    if "final_obs" in keys or any(f"_{key}" in keys for key in keys) or any(info.keys() != keys for info in env_infos):
        return None
    every_env = len(indices) == num_envs
    infos: dict[str, Any] = {}
    for key in keys:
        values = list(map(operator.itemgetter(key), env_infos))
        value_type = type(values[0])
        if not _batchable(value_type) or set(map(type, values)) != {value_type}:
            return None
        mask = np.zeros(num_envs, dtype=np.bool_)
        if every_env:
            array = np.array(values, dtype=value_type)
            mask.fill(True)
        else:
            array = np.zeros(num_envs, dtype=value_type)
            array[indices], mask[indices] = values, True
        infos[key], infos[f"_{key}"] = array, mask
    return infos


def _batchable(value_type: type) -> bool:
    """The test both gymnasium versions apply before batching a value in an array of its own type,
    less ``timedelta64``, whose array would take its unit from the values instead of staying generic."""
    if value_type in (int, float, bool):
        return True
    return issubclass(value_type, np.number) and not issubclass(value_type, np.timedelta64)
