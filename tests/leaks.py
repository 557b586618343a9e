"""What a closed pool must not leave behind, told apart from the fork server, which outlives pools
by design (it holds nothing of theirs and ends by itself; tests/test_fork_server.py checks that)."""

from __future__ import annotations

import threading

import psutil

from clusterenv_core.transports.local import fork_server


def _fork_server_pids() -> set[int]:
    return {server.process.pid for server in fork_server._servers.values()}


def descendants() -> set[int]:
    """This process's descendants (worker processes and what their envs started), fork servers aside."""
    return {child.pid for child in psutil.Process().children(recursive=True)} - _fork_server_pids()


def clusterenv_threads() -> set[threading.Thread]:
    """ClusterEnv's threads in this process, the fork servers' reapers aside."""
    return {
        thread
        for thread in threading.enumerate()
        if thread.name.startswith("clusterenv") and thread.name != fork_server.REAPER_THREAD
    }
