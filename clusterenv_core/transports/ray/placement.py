"""Where the Ray backend's actors go: the Ray connection, the cluster's nodes, the placement group.

The pool uses the Ray the user's process already has (``ray.is_initialized()``), else connects with
``ray.init(address=..., **init_options)`` (``address=None``: Ray's own choice, ``RAY_ADDRESS`` or a
new local instance). One placement group holds a bundle per worker: ``STRICT_SPREAD`` (one worker
per node) when the cluster has a node with CPUs for every worker, else ``SPREAD``. Ray places a
lost node's bundles again on nodes with room; a replacement that finds none in time runs outside
its bundle, on the surviving node with the fewest of the pool's actors.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from clusterenv_core.errors import WorkerTimeoutError

PLACEMENT_STRATEGIES = ("auto", "STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")


def connect(address: str | None, init_options: dict[str, Any]) -> None:
    """Connect this process to Ray, unless it is already."""
    if ray.is_initialized():
        return
    ray.init(address=address, **init_options)


def cpu_nodes() -> list[dict[str, Any]]:
    """The cluster's alive nodes that offer CPUs."""
    return [node for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) > 0]


def strategy_for(num_workers: int, requested: str) -> str:
    """The placement strategy: ``requested``, or for ``"auto"`` one worker per node when there
    are enough nodes, else spread as evenly as Ray can."""
    if requested != "auto":
        return requested
    return "STRICT_SPREAD" if num_workers <= len(cpu_nodes()) else "SPREAD"


def place(num_workers: int, cpus_per_actor: float, strategy: str, timeout: float) -> PlacementGroup:
    """A placement group of a bundle per worker, ready (its resources reserved) within ``timeout``."""
    group = placement_group([{"CPU": cpus_per_actor}] * num_workers, strategy=strategy)
    if not group.wait(timeout_seconds=max(int(timeout), 1)):
        remove_placement_group(group)
        nodes = cpu_nodes()
        cpus = sum(node["Resources"]["CPU"] for node in nodes)
        raise WorkerTimeoutError(
            f"Ray could not place {num_workers} actors of {cpus_per_actor:g} CPUs ({strategy}) within {timeout:g} s: "
            f"the cluster has {len(nodes)} nodes with CPUs, {cpus:g} CPUs in all (lower num_workers or "
            "cpus_per_actor, or choose another placement)"
        )
    return group


def bundle_node(group: PlacementGroup, index: int) -> str | None:
    """The node holding bundle ``index`` of ``group``, ``None`` while it is not placed (its node
    was lost and no node has had room for it since)."""
    return placement_group_table(group)["bundles_to_node_id"].get(index) or None


def least_loaded_node(actors_per_node: Counter) -> str | None:
    """The alive node with CPUs that runs the fewest of the pool's actors (``actors_per_node``, by
    node id), the one with the most CPUs among equals; ``None`` when no node with CPUs is left."""
    nodes = cpu_nodes()
    if not nodes:
        return None
    return min(nodes, key=lambda node: (actors_per_node[node["NodeID"]], -node["Resources"]["CPU"]))["NodeID"]
