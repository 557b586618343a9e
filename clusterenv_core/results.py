"""What the pool's reset and step return: views of its buffers plus what could not go through them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clusterenv_core.buffers import BatchBuffers


@dataclass
class ResetResult:
    """What a reset returns. Arrays are views of the pool's buffers, valid until the next call."""

    obs: Any
    infos: dict[int, dict] = field(default_factory=dict)  # only non-empty infos, by env index


@dataclass
class BatchResult:
    """What :meth:`AsyncBatches.recv <clusterenv_core.batches.AsyncBatches.recv>` returns: the rows of
    the envs ``env_ids`` (ascending), in buffers that the next ``recv`` reuses."""

    env_ids: np.ndarray
    obs: Any
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    infos: dict[int, dict]  # only non-empty infos, by env id


@dataclass
class StepResult:
    """What a step returns. Arrays are views of the pool's buffers, valid until the next call.

    ``infos`` holds the non-empty step infos by env index. In ``same_step`` mode, ``reset_infos``
    holds the non-empty infos of the automatic resets, and :meth:`final_observation` gives the last
    observation of each env whose episode ended.
    """

    obs: Any
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    infos: dict[int, dict]
    reset_infos: dict[int, dict]
    pickled_final_obs: dict[int, Any]
    _buffers: BatchBuffers

    def final_observation(self, index: int) -> Any:
        """The observation env ``index`` ended its episode with (``same_step`` mode, done envs only)."""
        if index in self.pickled_final_obs:
            return self.pickled_final_obs[index]
        return self._buffers.final_obs_layout.read(self._buffers.final_obs, index)
