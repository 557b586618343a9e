"""Node agents (``processes_per_worker=2``) on the MPI backend: ``tests/test_node_agents.py``'s checks.

    python node_agents.py                               # spawn: every check, in turn
    mpiexec -n 3 python node_agents.py spmd             # SPMD: the worker ranks are node agents

Prints ``OK <check>`` for each check that passed; a failed check raises.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests import test_node_agent_recovery, test_node_agents
from tests.envs import cartpole_in_process
from tests.helpers import run_side_by_side
from tests.test_async_batches import check_trajectories_match_envs_alone


def check_on_local_processes_of_their_own(venv) -> None:
    """Each worker rank steps its envs on 2 local processes (blocks 0-2 and 3-4: envs 0-1, 2; 3, 4)."""
    pids = venv.env_method("process_id")
    assert pids[0] == pids[1] and len(set(pids)) == 4, pids
    assert not set(pids) & set(venv.pool.worker_pids), (pids, venv.pool.worker_pids)


if __name__ == "__main__":
    if sys.argv[1:] == ["spmd"]:
        # The ranks above 0 turn into the pool's workers in its constructor, each a node agent; a
        # world launch serves one pool.
        run_side_by_side(
            [cartpole_in_process] * 5,
            steps=300,
            on_start=check_on_local_processes_of_their_own,
            backend="mpi",
            num_workers=2,
            processes_per_worker=2,
        )
        print("OK spmd dummy uneven", flush=True)
        sys.exit(0)
    test_node_agents.check_vec_env_is_dummy_vec_env(2, 8, backend="mpi")
    print("OK dummy even", flush=True)
    test_node_agents.check_vec_env_is_dummy_vec_env(2, 5, backend="mpi")
    print("OK dummy uneven", flush=True)
    for mode in ["NextStep", "SameStep"] if test_node_agents.GYMNASIUM_1 else [None]:
        test_node_agents.check_vector_env_is_sync_vector_env(mode, backend="mpi")
        print(f"OK vector {mode}", flush=True)
    check_trajectories_match_envs_alone(4, recvs=150, backend="mpi", processes_per_worker=2)
    print("OK async trajectories", flush=True)
    test_node_agents.check_a_failing_env_names_its_global_index_and_worker_and_the_agent_lives_on(backend="mpi")
    print("OK env error", flush=True)
    test_node_agent_recovery.check_a_local_process_lost_mid_steps_is_replaced_as_a_flat_pools_worker(
        "next_step", backend="mpi"
    )
    print("OK local process replaced", flush=True)
