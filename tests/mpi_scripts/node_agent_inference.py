"""Worker-side inference through node agents (``processes_per_worker=2``) on MPI spawn:
``tests/test_node_agent_inference.py``'s checks, the learner's weights travelling as messages.

    python node_agent_inference.py

Prints ``OK <check>`` for each check that passed; a failed check raises.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests import test_node_agent_inference as checks
from tests.policies import LinearPolicy

if __name__ == "__main__":
    checks.check_sampled_rollouts_are_those_of_flat_workers(LinearPolicy, backend="mpi")
    print("OK sampled rollouts", flush=True)
    checks.check_seeded_sb3_ppo_learns_the_parameters_flat_workers_give(backend="mpi")
    print("OK seeded ppo", flush=True)
    checks.check_an_env_error_mid_rollout_names_env_agent_and_local_process(backend="mpi")
    print("OK env error", flush=True)
