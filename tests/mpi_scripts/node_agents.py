"""Node agents (``processes_per_worker=2``) on the MPI backend: ``tests/test_node_agents.py``'s checks.

    python node_agents.py                               # spawn: every check, in turn
    mpiexec -n 3 python node_agents.py spmd             # SPMD: refused by the worker ranks

Prints ``OK <check>`` for each check that passed; a failed check raises.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from clusterenv_core import EnvError, EnvPool
from tests import test_node_agents
from tests.envs import make_cartpole
from tests.test_async_batches import check_trajectories_match_envs_alone


def spmd_refused() -> None:
    try:
        EnvPool([make_cartpole] * 4, backend="mpi", num_workers=2, processes_per_worker=2)
    except EnvError as error:
        assert "not supported on this worker (an MPI SPMD rank)" in str(error), error
    else:
        raise AssertionError("an SPMD launch took processes_per_worker=2")


if __name__ == "__main__":
    if sys.argv[1:] == ["spmd"]:
        spmd_refused()
        print("OK spmd refused", flush=True)
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
