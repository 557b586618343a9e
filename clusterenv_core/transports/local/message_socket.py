"""The local backend's socket protocol: length-prefixed pickled messages over a worker's socket.

Learner and worker each hold one end of an ``AF_UNIX`` socket pair per worker. A message is framed
as its 8-byte length and its pickle; the step's request and its bare reply are framed once, so a
step costs no pickling when there is nothing but them.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import Any

from clusterenv_core.protocol import OK_NONE, STEP, dumps, loads

_HEADER = struct.Struct("<Q")
LIVENESS_INTERVAL = 0.25  # seconds between checks that a silent worker process still exists
_KEPT_BUFFER = 1 << 16  # bytes of a receive buffer kept between messages


def frame_message(message: Any) -> bytes:
    """``message`` pickled, behind its length."""
    payload = dumps(message)
    return _HEADER.pack(len(payload)) + payload


# The messages of every step, framed once: a step costs no pickling when there is nothing but them,
# and a frame that equals one of them is that message without unpickling.
STEP_FRAME = frame_message(STEP)
OK_NONE_FRAME = frame_message(OK_NONE)
_STEP_FRAME_SIZE = len(STEP_FRAME)
_OK_NONE_FRAME_SIZE = len(OK_NONE_FRAME)


class MessageSocket:
    """Length-prefixed messages over a connected stream socket.

    Several messages may arrive in one read (a worker's progress reports queue up while the learner
    trains): bytes past the message returned stay buffered for the next call.

    :param receiver: who receives, for the error of a message that cannot be unpickled here
    :param spin: seconds a receive polls before it sleeps in the kernel
    """

    def __init__(self, sock: socket.socket, receiver: str, spin: float = 0.0) -> None:
        self.sock = sock
        self.receiver = receiver
        self.spin = spin
        self.last_contact = time.monotonic()  # of the last message sent or received: timeouts count from it
        self._buffer = bytearray(_KEPT_BUFFER)
        self._start = 0  # buffered bytes not yet returned: self._buffer[self._start : self._end]
        self._end = 0
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)

    def send_frame(self, frame: bytes) -> None:
        self.sock.sendall(frame)
        self.last_contact = time.monotonic()

    def recv(self, timeout: float | None = None, still_alive=None) -> Any:
        """The next message; ``EOFError`` if the peer closed. With ``timeout``, ``TimeoutError`` when
        nothing came for ``timeout`` seconds since the last message sent or received: a peer serving
        several requests at once (a pool's workers stepping together) has that long for each, however
        late its reply is read. ``still_alive()`` is consulted while waiting and may raise."""
        message = self._take()
        while message is None:
            # Bytes count as contact: a large reply that came in time is read however late.
            self._read(None if timeout is None else self.last_contact + timeout, still_alive)
            message = self._take()
        self.last_contact = time.monotonic()
        return message[0]

    def _read(self, deadline: float | None, still_alive) -> None:
        """Wait for bytes (until ``deadline``, if any) and append what arrived to the buffer."""
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buffer) > _KEPT_BUFFER:
                self._buffer = bytearray(_KEPT_BUFFER)  # a large message (an env factory) is not kept
        elif self._start > 0:  # move the partial message to the front
            pending = self._end - self._start
            self._buffer[:pending] = self._buffer[self._start : self._end]
            self._start, self._end = 0, pending
        if len(self._buffer) - self._end < 4096:
            self._buffer.extend(bytes(len(self._buffer)))
        view = memoryview(self._buffer)[self._end :]
        try:
            count = self._spin_recv(view) if self.spin else None
            if count is None:
                if deadline is not None:
                    self._wait_readable(deadline, still_alive)
                count = self.sock.recv_into(view)
        finally:
            view.release()
        if count == 0:
            raise EOFError("connection closed")
        self._end += count
        self.last_contact = time.monotonic()

    def _spin_recv(self, view: memoryview) -> int | None:
        """Poll for up to ``spin`` seconds; the bytes read, or ``None`` if nothing came."""
        end = time.perf_counter() + self.spin
        while True:
            try:
                return self.sock.recv_into(view, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() > end:
                    return None

    def _take(self) -> tuple[Any] | None:
        """The next whole buffered message (in a 1-tuple), or None; grows the buffer for a long one."""
        start = self._start
        available = self._end - start
        if available < _HEADER.size:
            return None
        buffer = self._buffer
        if available >= _STEP_FRAME_SIZE and buffer.startswith(STEP_FRAME, start):
            self._start = start + _STEP_FRAME_SIZE
            return (STEP,)
        if available >= _OK_NONE_FRAME_SIZE and buffer.startswith(OK_NONE_FRAME, start):
            self._start = start + _OK_NONE_FRAME_SIZE
            return (OK_NONE,)
        (length,) = _HEADER.unpack_from(self._buffer, self._start)
        total = _HEADER.size + length
        if available < total:
            if self._start + total > len(self._buffer):
                self._buffer.extend(bytes(self._start + total - len(self._buffer)))
            return None
        body = memoryview(self._buffer)[self._start + _HEADER.size : self._start + total]
        try:
            message = loads(body, self.receiver)
        finally:
            body.release()
        self._start += total
        return (message,)

    def peer_closed(self) -> bool:
        """Whether the peer closed its end (the socket hangs up), without reading anything."""
        return any(events & select.POLLHUP for _, events in self._poller.poll(0))

    def has_data(self) -> bool:
        """Whether bytes of a message are buffered (the rest follows without waiting for the peer)."""
        return self._end > self._start

    def readable(self) -> bool:
        """Whether bytes are buffered or have arrived, or the peer closed: :meth:`recv` would not wait
        for the peer to send anything."""
        return self.has_data() or bool(self._poller.poll(0))

    def _wait_readable(self, deadline: float, still_alive) -> None:
        while True:
            remaining = deadline - time.monotonic()
            # Polled at least once, also past the deadline: bytes that came in time are read.
            if self._poller.poll(max(min(remaining, LIVENESS_INTERVAL), 0.0) * 1000.0):
                return
            if remaining <= 0:
                raise TimeoutError
            if still_alive is not None:
                still_alive()
