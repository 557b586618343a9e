"""Exact comparison of nested results (observations, infos) for contract tests."""

from __future__ import annotations

from typing import Any

import numpy as np


# Wall-clock episode durations (SB3 Monitor, gymnasium RecordEpisodeStatistics) cannot match.
WALL_CLOCK_KEYS = {"t", "_t"}


def assert_same(actual: Any, expected: Any, path: str = "value") -> None:
    """Equal values, dtypes and container types, recursively; arrays compared element-wise and exactly.

    The wall-clock entries of episode statistics are compared for presence and type only.
    """
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{path}: {type(actual)} is not an ndarray"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        if expected.dtype == object:
            for i, (a, e) in enumerate(zip(actual.ravel(), expected.ravel())):
                assert_same(a, e, f"{path}[{i}]")
        else:
            assert np.array_equal(actual, expected, equal_nan=expected.dtype.kind in "fc"), f"{path}: {actual} != {expected}"
    elif isinstance(expected, dict):
        assert type(actual) is type(expected), f"{path}: {type(actual)} is not {type(expected)}"
        assert list(actual) == list(expected) or set(actual) == set(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            if key in WALL_CLOCK_KEYS and path.endswith("['episode']"):
                assert type(actual[key]) is type(expected[key]), f"{path}[{key!r}]: type differs"
                continue
            assert_same(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{path}: {type(actual)} is not {type(expected)}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}[{i}]")
    elif isinstance(expected, np.generic):
        assert type(actual) is type(expected) and actual == expected, f"{path}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
        assert type(actual) is type(expected), f"{path}: {type(actual)} is not {type(expected)}"
