"""The differential fuzzer's properties (``tests/test_fuzz.py``) on the MPI backend, spawn mode:
flat ranks, then node agents (each rank stepping its block on two local processes).

    python fuzz.py [examples]

Prints ``OK fuzz`` when every example agreed with the single-process baselines.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

os.environ.setdefault("CLUSTERENV_FUZZ_EXAMPLES", sys.argv[1] if len(sys.argv) > 1 else "4")

from hypothesis import given  # noqa: E402

from tests import test_fuzz  # noqa: E402


@test_fuzz.FUZZ
@given(test_fuzz.SB3_SCENARIOS)
def vec_env(scenario):
    test_fuzz.check_vec_env(scenario, backend="mpi")


@test_fuzz.FUZZ
@given(test_fuzz.SCENARIOS)
def vector_env(scenario):
    test_fuzz.check_vector_env(scenario, test_fuzz.AUTORESET_MODES[0], backend="mpi")


@test_fuzz.FUZZ
@given(test_fuzz.SB3_AGENT_SCENARIOS)
def vec_env_through_agents(scenario):
    test_fuzz.check_vec_env(scenario, backend="mpi", processes_per_worker=2)


@test_fuzz.FUZZ
@given(test_fuzz.AGENT_SCENARIOS)
def vector_env_through_agents(scenario):
    test_fuzz.check_vector_env(scenario, test_fuzz.AUTORESET_MODES[0], backend="mpi", processes_per_worker=2)


if __name__ == "__main__":
    vec_env()
    vector_env()
    vec_env_through_agents()
    vector_env_through_agents()
    print("OK fuzz", flush=True)
