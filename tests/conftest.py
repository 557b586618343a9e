import os
import sys
import time

import pytest

# Tests import helpers as ``tests.envs``; workers find them through the learner's sys.path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def ctrl_c_after_send(monkeypatch):
    """``arm(sends=1)``: Ctrl-C (a ``KeyboardInterrupt``) right after the learner writes its
    ``sends``-th next frame to a local worker, as CPython's ``sendall`` runs signal handlers after
    writing: that request is out when the call is cut short."""
    from clusterenv_core.transports.local.message_socket import MessageSocket

    send_frame = MessageSocket.send_frame
    sends_left = 0

    def interrupted_after_sending(self, frame):
        nonlocal sends_left
        send_frame(self, frame)
        if sends_left:
            sends_left -= 1
            if not sends_left:
                raise KeyboardInterrupt

    def arm(sends: int = 1) -> None:
        nonlocal sends_left
        sends_left = sends

    monkeypatch.setattr(MessageSocket, "send_frame", interrupted_after_sending)
    return arm


@pytest.fixture
def ctrl_c_at_call(monkeypatch):
    """``arm(owner, name, calls=1)``: Ctrl-C (a ``KeyboardInterrupt``) at the ``calls``-th call of
    ``owner.name`` from now, as the call starts (CPython runs signal handlers at calls), instead of
    running it; the calls after it run as before."""

    def arm(owner, name: str, calls: int = 1) -> None:
        function = getattr(owner, name)
        calls_left = calls

        def interrupted_at_start(*args, **kwargs):
            nonlocal calls_left
            calls_left -= 1
            if calls_left == 0:
                raise KeyboardInterrupt
            return function(*args, **kwargs)

        monkeypatch.setattr(owner, name, interrupted_at_start)

    return arm


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance for every Ray test (tests/test_ray_backend.py), started when the first of
    them runs (a few seconds) and stopped when the session ends; the pools connect to it."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def no_leaks():
    """The test leaves no child process and no /dev/shm entry behind (a Ray the tests started has
    processes of its own: they are not counted, its actors are)."""
    from tests.helpers import descendants, shm_entries

    children, shm = descendants(), shm_entries()
    yield
    deadline = time.monotonic() + 5
    while descendants() - children and time.monotonic() < deadline:
        time.sleep(0.05)
    assert descendants() - children == set(), "worker processes left behind"
    assert shm_entries() - shm == set(), "shared-memory segments left behind"


@pytest.fixture
def one_torch_thread():
    """One learner thread: reproducible floats, and no thread oversubscription on a shared machine
    (the workers take the other cores)."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
