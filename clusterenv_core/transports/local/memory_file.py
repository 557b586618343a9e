"""The local backend's memory file: the batch buffers and the policy regions, shared by the learner and every worker.

It is an anonymous memory file (``memfd``), with no name in ``/dev/shm``, so nothing is left
behind however the processes end. The learner creates it (:func:`anonymous_file`), lays out the
buffers at its start and appends regions (weights, rollout segments) page-aligned; a worker maps
them through its :class:`MemoryFileConnection`, whether it is a worker process or the inline
worker in the learner's own process.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import Any

from clusterenv_core.buffers import BatchBuffers, BatchSpec, Field, field_views
from clusterenv_core.transports.base import WorkerConnection


def anonymous_file() -> int:
    """A file descriptor of memory with no name anywhere in the file system."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("clusterenv-buffers", os.MFD_CLOEXEC)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryFile(dir=shm) as file:  # unlinked at once; the descriptor keeps it alive
        return os.dup(file.fileno())


def unmap(mapping: mmap.mmap) -> bool:
    """Close ``mapping``; ``False`` if views of it are still exported (it then goes with them)."""
    try:
        mapping.close()
    except BufferError:
        return False
    return True


def free_pages(memory_fd: int, offset: int, nbytes: int) -> None:
    """Give the pages of a released region back to the system (a hole in the memory file, which
    keeps its size, so the regions after it keep their offsets). Only for a region nothing reads
    any more: a mapping that still has it sees zeros."""
    try:
        mapping = mmap.mmap(memory_fd, nbytes, offset=offset)
    except OSError:
        return
    try:
        mapping.madvise(mmap.MADV_REMOVE)
    except (AttributeError, OSError):  # not Linux, or memory that cannot have holes
        pass
    finally:
        mapping.close()


class MemoryFileConnection(WorkerConnection):
    """What every worker of the local backend shares: the buffers and regions of the memory file.

    :param memory_fd: the memory file holding the batch buffers and the regions
    """

    def __init__(self, memory_fd: int) -> None:
        self.memory_fd = memory_fd
        self.memory: mmap.mmap | None = None

    def attach(self, spec: BatchSpec, block: range) -> tuple[BatchBuffers, int]:
        self.memory = mmap.mmap(self.memory_fd, spec.nbytes())
        return BatchBuffers(spec, self.memory), block.start

    def map_region(self, handle: Any, fields: list[Field], num_envs: int, block: range) -> tuple[dict, int]:
        offset, nbytes = handle
        region = mmap.mmap(self.memory_fd, nbytes, offset=offset)
        return field_views(fields, num_envs, region), block.start

    def send_arrays(self, arrays: list) -> None:
        pass  # shared memory: the learner sees the worker's arrays

    def recv_arrays(self, arrays: list) -> None:
        pass
