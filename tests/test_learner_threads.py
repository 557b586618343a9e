"""The warning about torch threads in the learner's process that the workers' cores cannot spare.

ClusterEnv never sets them itself (the thread count changes torch's results, and a seeded run must
match one on DummyVecEnv); it tells the user the one line that fixes the slowdown.
"""

from __future__ import annotations

import functools
import sys
import warnings

import gymnasium as gym
import pytest

from clusterenv_core import EnvPool, LearnerThreadsWarning, learner_threads

torch = pytest.importorskip("torch")

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


@pytest.fixture
def two_cores_two_threads(monkeypatch):
    """A 2-core machine as the pool sees it, with torch on its default of one thread per core."""
    monkeypatch.setattr(learner_threads.os, "cpu_count", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _make_pool(num_workers: int, **options) -> list[warnings.WarningMessage]:
    """Build and close a pool of ``num_workers`` workers; the LearnerThreadsWarnings it gave."""
    learner_threads._warned = False  # it warns once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = EnvPool([CARTPOLE] * 4, num_workers=num_workers, **options)
        pool.close()
    return [warning for warning in caught if issubclass(warning.category, LearnerThreadsWarning)]


def test_warns_when_torch_threads_outnumber_the_cores_the_workers_leave(two_cores_two_threads):
    (warning,) = _make_pool(2)
    message = str(warning.message)
    assert "torch runs 2 threads" in message and "2 ClusterEnv workers" in message
    assert "torch.set_num_threads(1)" in message
    assert warning.filename == __file__  # points at the code that made the pool, not at ClusterEnv
    assert torch.get_num_threads() == 2  # told, not changed
    assert len(_make_pool(1)) == 1  # one worker leaves one core, for two threads


def test_an_inline_worker_counts_as_one_of_the_workers(two_cores_two_threads):
    assert len(_make_pool(2, backend_options={"inline_worker": True})) == 1


def test_no_warning_within_the_cores_the_workers_leave(two_cores_two_threads, monkeypatch):
    torch.set_num_threads(1)
    assert _make_pool(2) == []
    torch.set_num_threads(2)
    monkeypatch.setattr(learner_threads.os, "cpu_count", lambda: 4)
    assert _make_pool(2) == []


def test_a_node_agents_processes_count_as_workers(two_cores_two_threads, monkeypatch):
    # 3 cores: one flat worker leaves the learner's 2 threads 2 cores, one agent of 2 processes 1.
    monkeypatch.setattr(learner_threads.os, "cpu_count", lambda: 3)
    assert not _make_pool(1)
    assert len(_make_pool(1, processes_per_worker=2)) == 1


def test_no_warning_without_torch_in_the_process(two_cores_two_threads, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")
    assert _make_pool(2) == []


def test_sb3_adapter_points_the_warning_at_the_caller(two_cores_two_threads):
    pytest.importorskip("stable_baselines3")
    from clusterenv_sb3 import ClusterVecEnv

    learner_threads._warned = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ClusterVecEnv([CARTPOLE] * 2).close()
    (warning,) = [warning for warning in caught if issubclass(warning.category, LearnerThreadsWarning)]
    assert warning.filename == __file__
