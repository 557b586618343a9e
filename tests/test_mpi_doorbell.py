"""The MPI backend's doorbell (a Unix socket next to MPI that wakes same-host peers), without MPI.

The doorbell decides when a waiting side sleeps and when it polls: a ring beyond the messages
already received announces one on its way (poll briefly), a ring left over from a message received
before its ring was read does not (sleep), and an end-of-file means the peer is gone.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from clusterenv_core.transports.mpi.waiting import Doorbell, PeerGone


@pytest.fixture(params=[False, True], ids=["poll", "recv"])
def bells(request):
    """Two connected doorbells: (waiting side, ringing side); the waiting side sleeps either way."""
    a, b = socket.socketpair()
    waiter, ringer = Doorbell(a, sleep_in_recv=request.param), Doorbell(b, sleep_in_recv=False)
    yield waiter, ringer
    for bell in (waiter, ringer):
        bell.sock.close()


class Counter:
    """A ``ready()`` that counts its calls and becomes true when told."""

    def __init__(self) -> None:
        self.calls = 0
        self.is_ready = False

    def __call__(self) -> bool:
        self.calls += 1
        return self.is_ready


def test_left_over_ring_is_slept_on_not_polled(bells):
    waiter, ringer = bells
    ringer.ring()  # the ring of a message already received...
    waiter.received()  # ...without waiting for it
    ready = Counter()
    started = time.perf_counter()
    assert waiter.wait(ready, timeout=0.3, max_sleep=1e-3, interval=0.1) is False
    assert time.perf_counter() - started >= 0.3
    # Sleeping: one look per nap (0.1 s here), not thousands of polls of a spin.
    assert ready.calls < 20
    assert waiter.rings == waiter.messages == 1


def test_ring_of_a_message_not_yet_received_is_polled(bells):
    waiter, ringer = bells
    ready = Counter()

    def send_then_show() -> None:
        ringer.ring()  # MPI shows the message a little after its ring arrives
        time.sleep(0.02)
        ready.is_ready = True

    thread = threading.Thread(target=send_then_show)
    started = time.perf_counter()
    thread.start()
    assert waiter.wait(ready, timeout=5.0, max_sleep=1e-3, interval=1.0) is True
    waited = time.perf_counter() - started
    thread.join()
    # Found within a few naps of its showing, not at the next liveness check (1 s).
    assert waited < 0.5, waited
    assert waiter.rings == 1


def test_wait_wakes_on_a_ring(bells):
    waiter, ringer = bells
    ready = Counter()

    def send() -> None:
        time.sleep(0.05)
        ready.is_ready = True
        ringer.ring()

    thread = threading.Thread(target=send)
    thread.start()
    started = time.perf_counter()
    assert waiter.wait(ready, timeout=5.0, max_sleep=1e-3, interval=2.0) is True
    thread.join()
    assert time.perf_counter() - started < 0.5
    assert ready.calls <= 4  # slept until the ring: no polling meanwhile


def test_ring_first_rings_the_peer_once(bells):
    waiter, ringer = bells
    ready = Counter()
    ready.is_ready = True
    assert waiter.wait(ready, timeout=1.0, max_sleep=1e-3, ring_first=True) is True
    assert ringer.wait(lambda: ringer.rings == 1, timeout=1.0, max_sleep=1e-3) is True


def test_closed_peer_ends_the_wait(bells):
    waiter, ringer = bells
    ringer.sock.close()
    started = time.perf_counter()
    with pytest.raises(PeerGone):
        waiter.wait(Counter(), timeout=30.0, max_sleep=1e-3, interval=0.1)
    assert time.perf_counter() - started < 5.0


def test_timeout_is_kept(bells):
    waiter, _ = bells
    started = time.perf_counter()
    assert waiter.wait(Counter(), timeout=0.2, max_sleep=1e-3, interval=0.05) is False
    assert 0.2 <= time.perf_counter() - started < 1.0
