"""StderrTails: the worker processes' stderr, forwarded to the learner's, the last lines of each kept."""

from __future__ import annotations

import os
import select
import threading
import time


class StderrTails:
    """Forwards each worker's stderr to the learner's and keeps its last lines, so that a worker that
    dies can say why (a Python traceback, or faulthandler's dump after a segfault in a C extension).

    One thread reads every worker's pipe; a write end is handed to each worker process as its stderr.
    """

    def __init__(self, keep_bytes: int = 8192) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._worker_of: dict[int, int] = {}  # read end -> worker
        self._current: dict[int, int] = {}  # worker -> read end of its current process
        self._tails: dict[int, bytearray] = {}  # read end -> the last bytes read
        self._finished: set[int] = set()  # read ends that reached end-of-file
        # Opened with the first worker's pipe: a transport that never starts holds no descriptor.
        self._wake_read = self._wake_write = -1
        self._thread: threading.Thread | None = None
        self._closed = False

    def new_pipe(self, worker: int) -> int:
        """A write end for a new process of ``worker`` (the caller closes it once the process has it)."""
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        with self._lock:
            # The number may be that of an earlier pipe, closed at its end-of-file: this one is open.
            self._finished.discard(read_end)
            self._worker_of[read_end] = worker
            self._current[worker] = read_end
            self._tails[read_end] = bytearray()
        if self._thread is None:
            self._wake_read, self._wake_write = os.pipe()
            self._thread = threading.Thread(target=self._forward, name="clusterenv-worker-stderr", daemon=True)
            self._thread.start()
        os.write(self._wake_write, b"n")
        return write_end

    def _forward(self) -> None:
        poller = select.poll()
        poller.register(self._wake_read, select.POLLIN)
        watched: set[int] = set()
        while True:
            with self._lock:
                for read_end in set(self._worker_of) - watched - self._finished:
                    poller.register(read_end, select.POLLIN)
                    watched.add(read_end)
            for fd, _ in poller.poll():
                if fd == self._wake_read:
                    if os.read(self._wake_read, 4096).endswith(b"q"):
                        for read_end in list(watched):  # what the exited workers wrote last
                            while self._read(read_end):
                                pass
                        return
                elif not self._read(fd):
                    poller.unregister(fd)
                    watched.discard(fd)

    def _read(self, fd: int) -> bool:
        """Forward and keep what ``fd`` has; False once it has nothing now or reached end-of-file."""
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not data:
            with self._lock:
                self._finished.add(fd)
            os.close(fd)
            return False
        _write_all(2, data)
        with self._lock:
            tail = self._tails[fd]
            tail += data
            del tail[: max(len(tail) - self.keep_bytes, 0)]
        return True

    def last_lines(self, worker: int, wait: float = 1.0, lines: int = 30) -> str:
        """The last ``lines`` lines the current process of ``worker`` wrote, once its stderr closed
        (or after ``wait`` seconds)."""
        with self._lock:
            read_end = self._current.get(worker)
        if read_end is None:
            return ""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with self._lock:
                if read_end in self._finished:
                    break
            time.sleep(0.01)
        with self._lock:
            text = bytes(self._tails.get(read_end, b"")).decode(errors="replace")
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        wake_ends = ()
        if self._thread is not None:
            os.write(self._wake_write, b"q")
            self._thread.join(timeout=1.0)
            wake_ends = (self._wake_read, self._wake_write)
        with self._lock:
            still_open = set(self._worker_of) - self._finished
            self._finished |= still_open
        for fd in (*still_open, *wake_ends):
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass  # the learner's stderr is gone; the tail is still kept
