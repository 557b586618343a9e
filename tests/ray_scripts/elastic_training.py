"""Training on a simulated Ray cluster (a head without CPUs and three nodes of one CPU) that loses a
node in the middle of ``learn()``, with ``restart_failed_workers``:

1. SB3's PPO (actions chosen by the learner): the lost actor's envs end their episodes truncated
   and start over on a replacement placed on a node added after the loss; training finishes;
2. ``clusterenv_sb3.PPO`` with ``AAPSCallback`` (the workers act and return segments): a node is
   lost while a segment is being collected; its block collects its part anew on a replacement;
   training finishes;
3. a node lost with no node left with room: the lost bundle waits ``replace_timeout`` (3 s), then
   its envs run on a surviving node outside the bundle and stepping goes on; a node added later
   takes them back at the next ``reset()`` (node agents of 2 processes);
4. every node lost: the pool fails after ``replace_timeout`` with an error saying what to do.

Prints one JSON line: per phase, which envs were rebuilt where (``EnvPool.worker_replacements``)
and the seconds from the loss to the next full step. Run by tests/test_ray_backend.py in a process
of its own (one Ray cluster per process).
"""

from __future__ import annotations

import functools
import json
import sys
import time

import gymnasium as gym
import numpy as np
import ray
import torch
from ray.cluster_utils import Cluster
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback, CallbackList

import clusterenv_sb3
from clusterenv_core import EnvPool, WorkerLostError
from clusterenv_core.protocol import RESTART_INFO_KEY
from clusterenv_sb3 import AAPSCallback, ClusterVecEnv

NUM_ENVS = 6
OPTIONS = {"backend": "ray", "timeout": 30, "restart_failed_workers": True, "max_restarts": 2}


class LoseANode(BaseCallback):
    """Removes ``node`` from ``cluster`` at the ``at``-th step (or, ``per_segment``, as the ``at``-th
    segment is being collected) and adds a node; notes what the next full step brought."""

    def __init__(self, cluster: Cluster, node, at: int, per_segment: bool = False) -> None:
        super().__init__()
        self.cluster, self.node, self.at, self.per_segment = cluster, node, at, per_segment
        self.lost_at: float | None = None
        self.report: dict = {}
        self._segments = 0
        self.added = None  # the node added after the loss

    def _lose(self) -> None:
        self.cluster.remove_node(self.node)
        self.lost_at = time.monotonic()
        self.added = self.cluster.add_node(num_cpus=1)  # as an autoscaler would: a node with room, after the loss

    def _on_rollout_start(self) -> None:
        self._segments += 1
        if self.per_segment and self._segments == self.at:
            self._lose()  # the segment started at the end of the last one is being collected

    def _on_step(self) -> bool:
        if not self.per_segment and self.n_calls == self.at:
            self._lose()
        elif self.lost_at is not None and not self.report:
            self.report["seconds_to_next_full_step"] = round(time.monotonic() - self.lost_at, 2)
            infos = self.locals["infos"]
            self.report["restart_infos"] = [i for i, info in enumerate(infos) if RESTART_INFO_KEY in info]
            self.report["dones"] = np.asarray(self.locals["dones"]).tolist()
            if "rollout" in self.locals:  # worker-side: the envs whose part of the segment was collected anew
                self.report["restarted_envs"] = sorted(int(i) for i in self.locals["rollout"].restarted_envs)
        return True


def _replacements(replacements: list[dict]) -> list[dict]:
    return [
        {
            "worker": r["worker"],
            "envs": r["envs"],
            "cause": r["cause"],
            "from": r["from"]["node"][:8],
            "to": r["to"]["node"][:8],
            "in_bundle": r["in_bundle"],
            "seconds": r["seconds"],
        }
        for r in replacements
    ]


def _summary(env: ClusterVecEnv, lose: LoseANode, node_id: str) -> dict:
    replacements = env.pool.worker_replacements
    return {
        **lose.report,
        "lost_node_held_a_worker": any(r["from"]["node"] == node_id for r in replacements),
        "replacements": _replacements(replacements),
        "restarts": env.pool.restarts,
        "blocks": [[block.start, block.stop] for block in env.pool.blocks],
    }


def main() -> None:
    torch.set_num_threads(1)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="warning")
    env_fns = [functools.partial(gym.make, "CartPole-v1")] * NUM_ENVS
    report: dict = {}
    try:
        # 1. SB3's PPO, actions from the learner.
        env = ClusterVecEnv(env_fns, **OPTIONS)
        assert env.pool.num_workers == 3, env.pool.num_workers  # one actor per node with CPUs
        lose = LoseANode(cluster, nodes[1], at=40)
        model = PPO("MlpPolicy", env, n_steps=32, batch_size=96, n_epochs=1, seed=0, device="cpu")
        model.learn(total_timesteps=NUM_ENVS * 32 * 4, callback=lose)
        first_added = lose.added
        report["sb3_ppo"] = {**_summary(env, lose, nodes[1].node_id), "timesteps": model.num_timesteps}
        env.close()

        # 2. clusterenv_sb3.PPO with AAPS, actions from the workers.
        env = ClusterVecEnv(env_fns, **OPTIONS)
        lose = LoseANode(cluster, nodes[0], at=2, per_segment=True)
        model = clusterenv_sb3.PPO("MlpPolicy", env, n_steps=32, batch_size=96, n_epochs=1, seed=0, device="cpu")
        model.learn(total_timesteps=NUM_ENVS * 32 * 4, callback=CallbackList([AAPSCallback(kl_threshold=0.01), lose]))
        report["aaps_ppo"] = {**_summary(env, lose, nodes[0].node_id), "timesteps": model.num_timesteps}
        env.close()

        # 3. No node with room: after replace_timeout the lost envs run on a surviving node, outside
        # their bundle; a node added later takes them back at the next reset. Node agents of 2
        # local processes: a displaced actor brings its processes along.
        alive = [nodes[2], first_added, lose.added]
        actions = np.zeros(NUM_ENVS, dtype=np.int64)
        with EnvPool(env_fns, backend_options={"replace_timeout": 3}, processes_per_worker=2, **OPTIONS) as pool:
            pool.reset(seeds=list(range(NUM_ENVS)))
            cluster.remove_node(alive.pop(0))
            lost_at = time.monotonic()
            truncated = pool.step(actions).truncated.tolist()
            seconds = round(time.monotonic() - lost_at, 2)
            for _ in range(50):
                pool.step(actions)
            alive.append(cluster.add_node(num_cpus=1))
            added_at = time.monotonic()
            while not any(r["cause"] == "moved back" for r in pool.worker_replacements):
                assert time.monotonic() - added_at < 30, "the displaced envs did not move back within 30 s"
                time.sleep(0.5)
                pool.reset(seeds=list(range(NUM_ENVS)))
            moved_back_after = round(time.monotonic() - added_at, 2)
            rewards = pool.step(actions).rewards.tolist()
            report["no_room"] = {
                "seconds_to_next_full_step": seconds,
                "truncated": truncated,
                "replacements": _replacements(pool.worker_replacements),
                "blocks": [[block.start, block.stop] for block in pool.blocks],
                "restarts": pool.restarts,
                "seconds_to_move_back": moved_back_after,
                "rewards_after_move": rewards,
            }

        # 4. Every node lost: a bounded wait, then a clear error.
        with EnvPool(env_fns, backend_options={"replace_timeout": 3}, **OPTIONS) as pool:
            pool.reset(seeds=list(range(NUM_ENVS)))
            for node in alive:
                cluster.remove_node(node)
            lost_at = time.monotonic()
            try:
                pool.step(actions)
                error = ""
            except WorkerLostError as lost:
                error = str(lost)
            report["no_node"] = {"error": error, "seconds_to_error": round(time.monotonic() - lost_at, 2)}
        print(json.dumps(report), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
