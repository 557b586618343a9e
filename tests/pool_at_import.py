"""A user's module that builds a pool when imported: a script without ``if __name__ == "__main__":``.

Workers of a pool whose env factory is :func:`cartpole_from_this_module` import this module to unpickle it. It
builds its pool only where the environment variable :data:`DEPTH` is above 0 (the test sets it for
its pool's workers), and gives that pool's workers one less: without ClusterEnv's refusal, importing
it builds a bounded chain of pools instead of workers without end.
"""

from __future__ import annotations

import os

import gymnasium as gym

from clusterenv_core import EnvPool

DEPTH = "CLUSTERENV_TEST_POOL_AT_IMPORT_DEPTH"


def cartpole_from_this_module() -> gym.Env:
    """CartPole; defined here (not taken from tests/envs.py) so that unpickling it imports this module."""
    return gym.make("CartPole-v1")


def worker_options(depth: int) -> dict:
    """Backend options of a pool whose workers, as they import this module, build pools ``depth`` deep."""
    return {"env": {DEPTH: str(depth)}}


_depth = int(os.environ.get(DEPTH, "0"))
if _depth > 0:
    pool = EnvPool([cartpole_from_this_module], num_workers=1, backend_options=worker_options(_depth - 1))
