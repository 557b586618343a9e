"""Asynchronous batches (``tests/test_async_batches.py``'s checks) on the MPI backend, spawn mode.

    python async_batches.py

Prints ``OK async <check>`` for each check that passed; a failed check raises.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests import test_async_batches  # noqa: E402

if __name__ == "__main__":
    test_async_batches.check_trajectories_match_envs_alone(4, recvs=200, backend="mpi")
    print("OK async trajectories", flush=True)
    test_async_batches.check_trajectories_match_envs_alone(2, recvs=200, backend="mpi")
    print("OK async partial blocks", flush=True)
    if test_async_batches.GYMNASIUM_1:
        test_async_batches.check_full_batch_is_sync_vector_env(steps=200, backend="mpi")
        print("OK async full batch", flush=True)
    test_async_batches.check_no_env_starves(backend="mpi")
    print("OK async no starvation", flush=True)
    test_async_batches.check_reply_left_unread_is_no_timeout(backend="mpi")
    print("OK async unread reply", flush=True)
    test_async_batches.check_reset_envs_leaves_the_rest_of_the_block_as_reset(backend="mpi")
    print("OK async reset_envs rows", flush=True)
    # Last: a dead spawned rank takes MPICH's process manager (and every spawn of this process) down.
    test_async_batches.check_lost_or_stuck_worker_is_reported("dies", lost_within=2.0, backend="mpi")
    print("OK async lost rank", flush=True)
