"""How the MPI backend waits: polling MPI under a deadline, and a doorbell beside it on one host.

No MPI call here blocks: every wait tests its request or probe (``Test``/``Improbe``) under a
deadline. MPICH's own blocking calls spin, and on a busy host a spinning or timer-napping waiter
loses to a kernel wake-up, so peers on the same host also share a :class:`Doorbell`. Peers on other
hosts :func:`poll`: a spin, then naps doubling up to a limit, with a liveness check at intervals.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import Any

MIN_NAP = 20e-6
_RUNG_SPIN = 50e-6  # after a ring, poll this long without sleeping: the message is on its way
_SLOW_MESSAGE_SLEEP = 1e-3  # first sleep when a rung message does not show within _RUNG_SPIN
_RING_FLAGS = int(socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
_CLOSED_GRACE = 1.0  # how long messages may trail the close of the sender's doorbell


def poll(ready, timeout: float, spin: float, max_sleep: float, check=None, interval: float = 0.25) -> bool:
    """Call ``ready()`` until it is true (then True) or ``timeout`` passes (then False): spin for
    ``spin`` seconds, then sleep with doubling naps up to ``max_sleep``; ``check()`` runs every
    ``interval`` seconds and may raise."""
    now = time.perf_counter()
    deadline, spin_end, next_check = now + timeout, now + spin, now + interval
    nap = MIN_NAP
    while True:
        if ready():
            return True
        now = time.perf_counter()
        if now >= deadline:
            return False
        if check is not None and now >= next_check:
            check()
            next_check = now + interval
        if now >= spin_end:
            time.sleep(nap)
            if nap < max_sleep:
                nap = min(nap * 2.0, max_sleep)


class PeerGone(Exception):
    """The process at the other end of a doorbell exited."""


class Doorbell:
    """A same-host wake-up channel next to MPI: one byte after each message sent to the peer.

    MPICH's waits spin, and sleeping between polls costs a timer wake-up each time; on a busy
    host both lose to a kernel wake-up. Peers on one host therefore also share a Unix socket: the
    sender rings it once per message (a step's result, a control message, one array), after the
    MPI sends, and the receiver sleeps on it. MPI still carries every byte of data; the doorbell
    only says "look now", and its end-of-file says the peer exited.

    A message is often received before its ring is read. Both ends therefore count: the receiver
    calls :meth:`received` for each message, so rings beyond that count announce a message that
    was sent but is not received yet (MPI may show it a few polls late: poll briefly), and the
    rest are left over (sleep).

    :param sock: this side's end of the connected Unix socket
    :param sleep_in_recv: sleep in a ``recv`` bounded by ``SO_RCVTIMEO`` instead of ``poll()``.
        A receiving sleeper wakes sooner (about 10 µs per round trip measured here), and workers
        use it; the learner polls, which measured faster for it: it rings several workers before it
        sleeps, and wake-ups of receivers pull the workers onto the learner's busy CPU.
    """

    __slots__ = ("sock", "sleep_in_recv", "sleep_limit", "poller", "rings", "messages", "closed")

    def __init__(self, sock: socket.socket, sleep_in_recv: bool) -> None:
        sock.setblocking(True)  # Python's own socket timeouts would wait in poll()
        self.sock = sock
        self.sleep_in_recv = sleep_in_recv
        self.sleep_limit = -1.0  # SO_RCVTIMEO currently set, in seconds
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)
        self.rings = 0  # rings read
        self.messages = 0  # messages received
        self.closed = False  # the peer closed its end

    def ring(self) -> None:
        try:
            self.sock.send(b"\0", _RING_FLAGS)
        except (BlockingIOError, InterruptedError):
            pass  # cannot happen while the peer reads its rings (each is one byte)
        except OSError:
            pass  # the peer is gone; its end-of-file tells the waiting side

    def received(self) -> None:
        """Count one message received from the peer."""
        self.messages += 1

    def _read(self, flags: int) -> None:
        """Read rings (``flags``: MSG_DONTWAIT, or 0 to wait up to SO_RCVTIMEO) and count them."""
        try:
            while True:
                data = self.sock.recv(4096, flags)
                if not data:
                    self.closed = True
                    return
                self.rings += len(data)
                if len(data) < 4096:
                    return
                flags = socket.MSG_DONTWAIT
        except (BlockingIOError, InterruptedError):
            pass  # nothing (more) to read, or the time limit passed
        except OSError:
            self.closed = True

    def _sleep(self, seconds: float) -> None:
        """Sleep until a ring arrives or ``seconds`` pass, and read the rings."""
        if not self.sleep_in_recv:
            if self.poller.poll(seconds * 1000.0):
                self._read(socket.MSG_DONTWAIT)
            return
        # Whole microseconds, at least one: a zero SO_RCVTIMEO would mean no limit at all.
        seconds = max(round(seconds, 6), 1e-6)
        if seconds != self.sleep_limit:
            whole = int(seconds)
            limit = struct.pack("@ll", whole, round((seconds - whole) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            self.sleep_limit = seconds
        self._read(0)

    def wait(
        self, ready, timeout: float, max_sleep: float, check=None, interval: float = 0.25, ring_first: bool = False
    ) -> bool:
        """Like :func:`poll`, sleeping in the kernel until the peer rings; :class:`PeerGone` when
        the peer closed the doorbell and the awaited message does not follow. ``ring_first`` rings
        the peer once this side has looked for the message (a ring owed for a message sent earlier),
        so the peer wakes when this side is about to sleep rather than while it still runs."""
        now = time.perf_counter()
        deadline, next_check = now + timeout, now + interval
        nap = interval  # longest sleep in the kernel before looking again
        if self.rings <= self.messages:
            self._read(socket.MSG_DONTWAIT)
        while True:
            if ready():
                break
            if ring_first:
                self.ring()
                ring_first = False
            if self.rings > self.messages:
                # Rung for this message: it was sent, and MPI shows it within a few polls.
                spin = min(_RUNG_SPIN, max(deadline - time.perf_counter(), 0.0))
                if ready() or poll(ready, spin, spin, max_sleep):
                    break
                nap = _SLOW_MESSAGE_SLEEP  # slower than that: look again soon, then less often
            if self.closed:
                return self._closed_wait(ready, deadline - time.perf_counter(), max_sleep, check)
            now = time.perf_counter()
            if now >= deadline:
                return False
            if now >= next_check:
                if check is not None:
                    check()
                next_check = now + interval
            rings = self.rings
            self._sleep(min(deadline, next_check, now + nap) - now)
            if self.rings == rings:
                nap = min(nap * 2.0, interval)
        if ring_first:
            self.ring()
        return True

    @staticmethod
    def _closed_wait(ready, remaining: float, max_sleep: float, check) -> bool:
        # A peer closes its doorbell right after its last sends (a worker after its "close" reply):
        # give those a moment to arrive; a dead peer shows in check() sooner.
        if poll(ready, min(remaining, _CLOSED_GRACE), 0.0, max_sleep, check, 0.01):
            return True
        raise PeerGone

    def close(self) -> None:
        self.sock.close()


class Probe:
    """A matched probe for one source and tag, usable as ``ready()`` of :func:`poll`."""

    __slots__ = ("comm", "source", "tag", "status", "message")

    def __init__(self, MPI: Any, comm: Any, source: int, tag: int) -> None:
        self.comm, self.source, self.tag = comm, source, tag
        self.status = MPI.Status()
        self.message = None

    def __call__(self) -> bool:
        self.message = self.comm.Improbe(self.source, self.tag, self.status)
        return self.message is not None


def accept_doorbells(
    listener: socket.socket, by_pid: dict[int, Any], expected: int, timeout: float
) -> dict[Any, Doorbell]:
    """The learner's ends of the doorbells of ``expected`` peers connecting to ``listener``, each
    known by its process id (``by_pid``: pid to peer); a connection from another process is
    closed. Peers that do not connect within ``timeout`` poll instead."""
    bells = {}
    listener.settimeout(timeout)
    while expected > 0:
        try:
            sock, _ = listener.accept()
        except OSError:
            break
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer = by_pid.pop(struct.unpack("3i", credentials)[0], None)
        if peer is None:  # not one of ours
            sock.close()
            continue
        bells[peer] = Doorbell(sock, sleep_in_recv=False)
        expected -= 1
    return bells
