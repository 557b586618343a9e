"""What the MPI backend's messages look like: tags, the step reply's header, and the datatypes that
move a worker's rows of the batch buffers in one message.

Each side keeps its batch buffers in one private block. A step is two messages per worker, built
from derived datatypes (``hindexed`` over bytes) made once at attach: the learner sends the worker's
action rows of every action field in one message (the step request itself), and the worker answers
with one message holding a :data:`HEADER`-byte header and its result rows of every result field; the
learner posts that receive before sending, so the rows land directly in its buffers. Final
observations ride along only when an env of the block finished. Nothing on the hot path is pickled;
a step whose reply is not ``(OK, None)`` (non-empty infos, errors) sends the pickled reply in a
third message, whose size the header announces. Requests and other replies are pickled.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from clusterenv_core.buffers import BatchBuffers

# Message tags; the range keeps clear of small tags a user's own messages would use.
TAG_REQUEST = 7101  # learner -> worker: a pickled request
TAG_STEP = 7102  # learner -> worker: the block's action rows; this is the step request
TAG_REPLY = 7103  # worker -> learner: the pickled reply to a request
TAG_RESULT = 7104  # worker -> learner: header and result rows (of a step, or after a reply that has rows)
TAG_PAYLOAD = 7105  # worker -> learner: the pickled step reply, when it is not (OK, None)
TAG_ARRAYS = 7106  # either way: the arrays of a region (policy weights, rollout segments)
TAG_HELLO = 7107  # worker -> learner, once: pid and host
TAG_CONFIG = 7108  # learner -> worker, once: its index, the learner's pid and host, polling
TAG_BELL = 7109  # worker -> learner, once: whether it connected to the learner's doorbell
TAG_HEARTBEAT = 7110  # worker -> learner, across hosts, every heartbeat interval: one byte (heartbeat.py)

HEADER = 16  # bytes: int64 length of the pickled reply that follows (0: (OK, None)), int64 spare
ALIGN = 64


def address(buffer: Any) -> int:
    """The memory address of a writable buffer."""
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def row_bytes(array: np.ndarray) -> int:
    return array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))


def block_type(MPI: Any, blocks: list[tuple[int, int]]) -> Any:
    """A committed datatype of the ``(displacement, length)`` byte ranges, in order."""
    blocks = [(offset, length) for offset, length in blocks if length > 0]
    datatype = MPI.BYTE.Create_hindexed([length for _, length in blocks], [offset for offset, _ in blocks])
    return datatype.Commit()


def result_arrays(buffers: BatchBuffers) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The arrays a step returns, in message order: always sent, and sent when an episode ended."""
    return [*buffers.obs, buffers.rewards, buffers.terminated, buffers.truncated], list(buffers.final_obs)
