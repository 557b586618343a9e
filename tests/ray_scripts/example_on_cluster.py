"""Runs examples/ray/train_sb3_ppo_ray.py against a simulated Ray cluster (a head without CPUs and
three nodes of one CPU, ``ray.cluster_utils.Cluster``), as a user runs it on a cluster started by
``ray up`` or KubeRay: ``--address`` names the cluster. The example's arguments follow this
script's; its output is passed through, and its exit status returned.

Run by tests/test_ray_backend.py in a process of its own (one Ray cluster per process).
"""

from __future__ import annotations

import os
import subprocess
import sys

from ray.cluster_utils import Cluster

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "ray", "train_sb3_ppo_ray.py")


def main() -> int:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        done = subprocess.run(
            [sys.executable, EXAMPLE, "--address", cluster.address, *sys.argv[1:]], timeout=240, text=True
        )
        return done.returncode
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
