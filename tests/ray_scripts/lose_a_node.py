"""A pool on a simulated Ray cluster (a head without CPUs and three nodes of one CPU) loses a node
in the middle of its steps: with ``restart_failed_workers`` the lost actor's envs end their
episodes and start over on an actor placed on a node added afterwards, and stepping goes on.
Prints one JSON line: what was replaced where, and the seconds from the loss to the next full step.

Run by tests/test_ray_backend.py in a process of its own (one Ray cluster per process)."""

from __future__ import annotations

import functools
import json
import sys
import time

import gymnasium as gym
import numpy as np
import ray
from ray.cluster_utils import Cluster

from clusterenv_core import EnvPool
from clusterenv_core.protocol import RESTART_INFO_KEY


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="warning")
    env_fns = [functools.partial(gym.make, "CartPole-v1")] * 6
    pool = EnvPool(env_fns, backend="ray", timeout=30, restart_failed_workers=True, max_restarts=2)
    try:
        assert pool.num_workers == 3, pool.num_workers  # one actor per node with CPUs
        zeros = np.zeros(6, dtype=np.int64)
        pool.reset(seeds=list(range(6)))
        for _ in range(5):
            pool.step(zeros)
        actors = pool._transport.actors
        node_of_actor = {ray.get(actor.hello.remote())["node"]: worker for worker, actor in enumerate(actors)}
        lost = node_of_actor[nodes[1].node_id]
        old_pid = pool.worker_pids[lost]
        cluster.remove_node(nodes[1])
        lost_at = time.monotonic()
        cluster.add_node(num_cpus=1)
        result = pool.step(zeros)
        recovered = time.monotonic() - lost_at
        block = pool.blocks[lost]
        replaced = [index for index in range(6) if RESTART_INFO_KEY in result.infos.get(index, {})]
        truncated = result.truncated.tolist()  # a view of the buffers: read before the next step
        for _ in range(20):
            pool.step(zeros)
        print(
            json.dumps(
                {
                    "lost_worker": lost,
                    "replaced_envs": replaced,
                    "block": [block.start, block.stop],
                    "truncated": truncated,
                    "restarts": pool.restarts,
                    "new_pid": pool.worker_pids[lost] != old_pid,
                    "seconds_to_next_full_step": round(recovered, 2),
                }
            ),
            flush=True,
        )
    finally:
        pool.close()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
