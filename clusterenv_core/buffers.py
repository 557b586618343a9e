"""Preallocated batch buffers: every per-step array of the pool, laid out in one block of memory.

The local backend places the block in shared memory, so workers write results where the learner
reads them; the MPI backend keeps one block on each side and moves a worker's rows with buffer
messages. Either way each field is a ``(num_envs, *shape)`` C-contiguous array, so one worker's
contiguous block of envs is a contiguous slice of every field.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from gymnasium import spaces

from clusterenv_core.spaces import GYMNASIUM_DICT, Field, SpaceLayout, action_buffer_dtype

_ALIGN = 64  # cache-line alignment keeps two workers' writes to neighbouring fields apart


@dataclass(frozen=True)
class BatchSpec:
    """Everything needed to lay out the buffers; small and picklable, sent to workers."""

    num_envs: int
    observation_space: spaces.Space
    action_space: spaces.Space

    def layouts(self) -> tuple[SpaceLayout, SpaceLayout, SpaceLayout]:
        """Layouts of observations, final observations and actions (envs get Dict actions as
        gymnasium's vector envs hand them over)."""
        return (
            SpaceLayout(self.observation_space, "obs"),
            SpaceLayout(self.observation_space, "final_obs"),
            SpaceLayout(self.action_space, "act", dict_type=GYMNASIUM_DICT),
        )

    def fields(self) -> list[Field]:
        """All fields in block order: results first (written by workers), then actions."""
        obs, final_obs, act = self.layouts()
        scalars = [
            Field("rewards", (), np.dtype(np.float64)),
            Field("terminated", (), np.dtype(np.bool_)),
            Field("truncated", (), np.dtype(np.bool_)),
        ]
        actions = [replace(field, dtype=action_buffer_dtype(field.dtype)) for field in act.fields]
        return [*obs.fields, *final_obs.fields, *scalars, *actions]

    def nbytes(self) -> int:
        return fields_nbytes(self.fields(), self.num_envs)


def _padded(nbytes: int) -> int:
    return -(-max(nbytes, 1) // _ALIGN) * _ALIGN


def _count(field: Field, num_envs: int) -> int:
    return num_envs * int(np.prod(field.shape, dtype=np.int64))


def fields_nbytes(fields: list[Field], num_envs: int) -> int:
    """Bytes needed by :func:`field_views` for ``fields`` with a leading ``num_envs`` dimension."""
    return sum(_padded(_count(field, num_envs) * field.dtype.itemsize) for field in fields)


def field_views(fields: list[Field], num_envs: int, memory: memoryview | bytearray) -> dict[str, np.ndarray]:
    """One ``(num_envs, *field.shape)`` array per field, laid out one after the other in ``memory``."""
    arrays, offset = {}, 0
    for field in fields:
        count = _count(field, num_envs)
        array = np.frombuffer(memory, dtype=field.dtype, count=count, offset=offset)
        arrays[field.name] = array.reshape((num_envs, *field.shape))
        offset += _padded(count * field.dtype.itemsize)
    return arrays


class BatchBuffers:
    """Numpy views of every field over one memory block.

    :param spec: the layout description
    :param memory: a writable buffer of at least ``spec.nbytes()`` bytes (mmap, bytearray, ...)
    """

    def __init__(self, spec: BatchSpec, memory: memoryview | bytearray) -> None:
        self.spec = spec
        self.obs_layout, self.final_obs_layout, self.act_layout = spec.layouts()
        self.arrays = field_views(spec.fields(), spec.num_envs, memory)
        self.obs = [self.arrays[f.name] for f in self.obs_layout.fields]
        self.final_obs = [self.arrays[f.name] for f in self.final_obs_layout.fields]
        self.actions = [self.arrays[f.name] for f in self.act_layout.fields]
        self.rewards = self.arrays["rewards"]
        self.terminated = self.arrays["terminated"]
        self.truncated = self.arrays["truncated"]

    def release(self) -> None:
        """Drop the views, so that the memory can be unmapped (a mapping with views still exported
        stays, and holds its memory, for as long as they live); the buffers are unusable after."""
        self.arrays = {}
        self.obs, self.final_obs, self.actions = [], [], []
        self.rewards = self.terminated = self.truncated = None
