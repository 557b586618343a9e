"""The learner's torch threads beside workers on its machine.

torch runs its operations on one thread per core by default, and its idle threads (OpenMP) keep
spinning for a while after each parallel operation. Beside workers that take every core, those
threads spin on the workers' cores, which made SB3 PPO with ClusterVecEnv up to twice as slow here
(see "One torch thread in the learner" in docs/guides/sb3_quickstart.md).

ClusterEnv does not change the setting itself: the thread count changes how torch splits its sums,
hence the last bits of its results (a seeded PPO run gave other parameters with one thread than
with two), and a seeded run on ClusterEnv must give the parameters it gives on one process. It
warns instead, with :class:`LearnerThreadsWarning`. torch is never imported here; a process
without it gets no warning.
"""

from __future__ import annotations

import os
import sys
import warnings

from clusterenv_core.errors import user_stacklevel


class LearnerThreadsWarning(UserWarning):
    """torch uses more threads in the learner's process than its workers leave cores."""


def spare_cores(workers_on_this_host: int) -> int:
    """The cores this machine's workers leave to the learner (at least one)."""
    return max(1, (os.cpu_count() or 1) - workers_on_this_host)


def warn_if_torch_threads_contend(workers_on_this_host: int) -> None:
    """Warn, once per process, when torch, imported in this process, runs more threads than
    :func:`spare_cores` leaves it."""
    global _warned
    torch = sys.modules.get("torch")
    if _warned or torch is None or not hasattr(torch, "get_num_threads"):
        return
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    spare = spare_cores(workers_on_this_host)
    if threads <= spare:
        return
    _warned = True
    warnings.warn(
        f"torch runs {threads} threads beside {workers_on_this_host} ClusterEnv workers on {cores} cores, which can "
        f"slow training up to 2x: call torch.set_num_threads({spare}) "
        "(docs/guides/sb3_quickstart.md: 'One torch thread in the learner')",
        LearnerThreadsWarning,
        stacklevel=user_stacklevel(),
    )


_warned = False  # the warning was given in this process
