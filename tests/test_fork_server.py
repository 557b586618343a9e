"""The local backend's fork server: workers forked from it behave as fresh ones, and it keeps no process."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time

import gymnasium as gym
import numpy as np
import psutil
import pytest

from clusterenv_core import EnvPool, WorkerLostError
from clusterenv_core.transports.local import fork_server
from clusterenv_core.transports.local.fork_server import ForkedWorker
from clusterenv_core.transports.local.fork_server_program import IDLE_SECONDS
from tests.helpers import assert_same

pytestmark = pytest.mark.skipif(not fork_server.pidfd_supported(), reason="no pidfds on this system")

CARTPOLE = functools.partial(gym.make, "CartPole-v1")
ORPHAN_GRACE = 1.0  # seconds an orphaned worker gets to end by itself (the backend's orphan_grace)


class GlobalRandomEnv(gym.Wrapper):
    """CartPole whose reset reports a draw of numpy's legacy global generator (which old envs use)."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))

    def reset(self, **kwargs):
        observation, info = self.env.reset(**kwargs)
        return observation, {"draw": np.random.randint(2**31)}


class PrintingEnv(gym.Wrapper):
    """CartPole that prints to its process's stdout when reset."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))

    def reset(self, **kwargs):
        print("a worker's env speaks", flush=True)
        return self.env.reset(**kwargs)


def _server_of(pool: EnvPool) -> psutil.Process:
    parents = {psutil.Process(pid).ppid() for pid in pool.worker_pids}
    assert len(parents) == 1
    return psutil.Process(parents.pop())


def _copied(result) -> tuple:
    """A step's results, out of the pool's buffers."""
    return result.obs.copy(), result.rewards.copy(), result.terminated.copy(), result.truncated.copy(), result.infos


def test_workers_fork_from_one_server_that_every_pool_of_the_learner_reuses():
    with EnvPool([CARTPOLE] * 4, num_workers=2) as first:
        server = _server_of(first)
        assert "clusterenv_core.transports.local.fork_server_program" in server.cmdline()
        assert server.ppid() == os.getpid()
        assert all(isinstance(process, ForkedWorker) for process in first._transport.processes)
        # Each worker leads a session of its own, as a fresh worker does.
        assert all(os.getsid(pid) == pid for pid in first.worker_pids)
        first.reset(seeds=[0, 1, 2, 3])
        forked = _copied(first.step(np.ones(4, np.int64)))
    with EnvPool([CARTPOLE] * 4, num_workers=2) as second:
        assert _server_of(second).pid == server.pid
    with EnvPool([CARTPOLE] * 4, num_workers=2, backend_options={"fork_server": False}) as fresh:
        assert all(isinstance(process, subprocess.Popen) for process in fresh._transport.processes)
        assert {psutil.Process(pid).ppid() for pid in fresh.worker_pids} == {os.getpid()}
        fresh.reset(seeds=[0, 1, 2, 3])
        assert_same(_copied(fresh.step(np.ones(4, np.int64))), forked)


def test_forked_workers_draw_from_numpy_global_generators_of_their_own():
    with EnvPool([GlobalRandomEnv] * 4, num_workers=4) as pool:
        infos = pool.reset().infos
    assert len({infos[index]["draw"] for index in range(4)}) == 4


def test_a_forked_workers_stdout_is_the_learners_at_its_start(capfd):
    with EnvPool([PrintingEnv] * 2, num_workers=2) as pool:
        pool.reset()
    assert capfd.readouterr().out.count("a worker's env speaks") == 2


def test_a_killed_forked_worker_is_reported_with_its_signal():
    with EnvPool([CARTPOLE] * 2, num_workers=2, timeout=10) as pool:
        pool.reset()
        os.kill(pool.worker_pids[1], signal.SIGKILL)
        with pytest.raises(WorkerLostError, match=r"worker 1 \(pid \d+, env 1\) was killed by SIGKILL"):
            pool.step(np.zeros(2, np.int64))


@pytest.mark.slow
def test_the_server_ends_once_it_had_no_worker_for_a_while():
    with EnvPool([CARTPOLE] * 2, num_workers=2) as pool:
        server = _server_of(pool)
    assert server.is_running()
    deadline = time.monotonic() + IDLE_SECONDS + 10
    while server.is_running() and server.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, "the idle fork server is still running"
    with EnvPool([CARTPOLE] * 2, num_workers=2) as pool:  # a new one serves the next pool
        assert _server_of(pool).pid != server.pid
        pool.reset()


def test_a_server_that_cannot_fork_leaves_fresh_interpreters_to_serve(monkeypatch):
    def broken(*args, **kwargs):
        raise ConnectionError("the fork server ended")

    monkeypatch.setattr("clusterenv_core.transports.local.transport.launch_worker", broken)
    with EnvPool([CARTPOLE] * 2, num_workers=2) as pool:
        assert all(isinstance(process, subprocess.Popen) for process in pool._transport.processes)
        pool.reset()


def test_the_server_and_its_workers_end_with_a_killed_learner(tmp_path):
    script = tmp_path / "learner.py"
    script.write_text(
        textwrap.dedent(
            """
            import functools, os, time
            import gymnasium as gym
            import psutil
            from clusterenv_core import EnvPool

            pool = EnvPool([functools.partial(gym.make, "CartPole-v1")] * 2, num_workers=2)
            pool.reset()
            server = psutil.Process(pool.worker_pids[0]).ppid()
            print(server, *pool.worker_pids, flush=True)
            time.sleep(600)
            """
        )
    )
    learner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in learner.stdout.readline().split()]
    finally:
        learner.kill()
        learner.wait()
    deadline = time.monotonic() + 15
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if psutil.pid_exists(pid)], "the fork server or workers outlived their learner"


def test_workers_serve_on_when_their_server_is_killed():
    """Workers watch their learner, not their server: a server that is gone ends no pool."""
    with EnvPool([CARTPOLE] * 2, num_workers=2, timeout=10, backend_options={"orphan_grace": ORPHAN_GRACE}) as pool:
        pool.reset()
        server = _server_of(pool)
        server.kill()
        server.wait(5)
        time.sleep(ORPHAN_GRACE + 1.0)  # a worker that watched its parent would have ended itself by now
        pool.step(np.zeros(2, np.int64))
        assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pool.worker_pids)
        os.kill(pool.worker_pids[0], signal.SIGKILL)
        with pytest.raises(WorkerLostError, match=r"worker 0 \(pid \d+, env 0\) ended \(its exit status was lost"):
            pool.step(np.zeros(2, np.int64))
    with EnvPool([CARTPOLE] * 2, num_workers=2) as pool:  # the next pool gets a new server
        assert _server_of(pool).pid != server.pid
