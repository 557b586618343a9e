"""The local backend: worker processes on this machine, batch buffers in shared memory.

Each worker is a fork of the learner's fork server (:mod:`clusterenv_core.transports.fork_server`),
a fresh interpreter that imported the installed modules the env factories name, once for all
workers; or, with ``fork_server=False`` or where forking fails, a fresh interpreter of its own
(``python -m clusterenv_core.worker local ...``). Either way it imports only what its env factories
need and never re-runs the user's ``__main__``. It gets two file descriptors:

- one end of an ``AF_UNIX`` socket pair, carrying length-prefixed pickled control messages and the
  step wake-ups and replies. No network port is ever opened, and when either side dies the other
  reads end-of-file at once, so a dead worker is reported immediately and an orphaned worker exits.
- an anonymous memory file (``memfd``) holding the batch buffers. It has no name in ``/dev/shm``,
  so nothing is left behind however the processes end.

Signalling went through measurement (``benchmarks/signalling.py``, ``benchmarks/throughput.py``);
see the README. Workers sleep in the kernel between requests, except that the first ``cores - 1``
of them poll for up to ``worker_spin`` seconds after each reply before they sleep: a learner that
answers within that time reaches them without a wake-up, and with at most ``cores - 1`` spinners
the learner always has a core of its own. With ``inline_worker`` the last worker runs in the
learner's process instead (:mod:`clusterenv_core.transports.inline`), and the learner polls for
replies as those workers poll for requests.
"""

from __future__ import annotations

import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from clusterenv_core.buffers import BatchBuffers, BatchSpec, Field, field_views
from clusterenv_core.checks import check_bool, check_int, check_seconds
from clusterenv_core.errors import WorkerLostError, WorkerTimeoutError
from clusterenv_core.interpreter import child_command
from clusterenv_core.protocol import OK_NONE, STEP, dumps, loads
from clusterenv_core.transports.base import RequestNotSent, Transport, WorkerConnection, ctrl_c_held
from clusterenv_core.transports.fork_server import ForkedWorker, installed, launch_worker, pidfd_supported

if TYPE_CHECKING:
    from clusterenv_core.transports.inline import InlineWorker

_HEADER = struct.Struct("<Q")
_LIVENESS_INTERVAL = 0.25  # seconds between checks that a silent worker process still exists
# Seconds a worker whose learner is gone has to end by itself (its loop reads end-of-file and
# closes its envs) before it is ended: an env that hangs, or a thread it left running, would keep
# it forever.
_ORPHAN_GRACE = 10.0
_KEPT_BUFFER = 1 << 16  # bytes of a receive buffer kept between messages
_IMPORT_TIMEOUT = 60.0  # at least this long for the fork server to import the workers' modules: slow is not stuck


def _frame(message: Any) -> bytes:
    payload = dumps(message)
    return _HEADER.pack(len(payload)) + payload


# The messages of every step, framed once: a step costs no pickling when there is nothing but them,
# and a frame that equals one of them is that message without unpickling.
_STEP_FRAME = _frame(STEP)
_OK_NONE_FRAME = _frame(OK_NONE)
_STEP_FRAME_SIZE = len(_STEP_FRAME)
_OK_NONE_FRAME_SIZE = len(_OK_NONE_FRAME)


class _MessageSocket:
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
        if available >= _STEP_FRAME_SIZE and buffer.startswith(_STEP_FRAME, start):
            self._start = start + _STEP_FRAME_SIZE
            return (STEP,)
        if available >= _OK_NONE_FRAME_SIZE and buffer.startswith(_OK_NONE_FRAME, start):
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
            if self._poller.poll(max(min(remaining, _LIVENESS_INTERVAL), 0.0) * 1000.0):
                return
            if remaining <= 0:
                raise TimeoutError
            if still_alive is not None:
                still_alive()


class _StderrTails:
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


def _end_process_group(process: subprocess.Popen) -> None:
    """Kill what the envs of an ended worker process started and left running (helper processes,
    simulators): they share the worker's process group, whose id is the worker's pid. PIDs are
    handed out in sequence, so the id names no other group this soon after the worker ended."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in the group


def _unmap(mapping: mmap.mmap) -> bool:
    """Close ``mapping``; ``False`` if views of it are still exported (it then goes with them)."""
    try:
        mapping.close()
    except BufferError:
        return False
    return True


def _free_pages(memory_fd: int, offset: int, nbytes: int) -> None:
    """Give the pages of a released region back to the system (a hole in the memory file, which
    keeps its size, so the regions after it keep their offsets). Only for a region nothing reads
    any more: a mapping that still has it sees zeros."""
    try:
        mapping = mmap.mmap(memory_fd, nbytes, offset=offset)
    except OSError:
        return
    try:
        mapping.madvise(mmap.MADV_REMOVE)
    except (AttributeError, OSError):  # not Linux, or memory that cannot have holes
        pass
    finally:
        mapping.close()


def _anonymous_file() -> int:
    """A file descriptor of memory with no name anywhere in the file system."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("clusterenv-buffers", os.MFD_CLOEXEC)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryFile(dir=shm) as file:  # unlinked at once; the descriptor keeps it alive
        return os.dup(file.fileno())


class LocalTransport(Transport):
    """Learner side of the local backend.

    :param python: interpreter for the workers (default: this one)
    :param env: extra environment variables for the worker processes
    :param worker_spin: seconds a worker polls for its next request after each reply before it
        sleeps in the kernel (0: it sleeps at once); with ``inline_worker``, also how long the
        learner polls for a reply
    :param spinning_workers: how many workers (the first ones) poll like that (default: one fewer
        than the cores, so the learner keeps a core however the workers wait)
    :param inline_worker: run the last worker in the learner's own process instead of a process of
        its own (see :mod:`clusterenv_core.transports.inline`: faster where workers are as many as
        cores, but those envs lose the workers' isolation and timeouts)
    :param fork_server: fork the workers from a fork server that imported their modules once (see
        :mod:`clusterenv_core.transports.fork_server`), where the system has pidfds; ``False``:
        start each worker as a fresh interpreter, which imports them anew
    """

    shares_memory = True

    def __init__(
        self,
        python: str | None = None,
        env: dict[str, str] | None = None,
        worker_spin: float = 5e-4,
        spinning_workers: int | None = None,
        inline_worker: bool = False,
        fork_server: bool = True,
    ) -> None:
        self.python = python or sys.executable
        self.extra_env = dict(env or {})
        self.worker_spin = check_seconds("worker_spin", worker_spin, allow_zero=True, below=1.0)
        self.spinning_workers = (
            max((os.cpu_count() or 1) - 1, 0) if spinning_workers is None else check_int("spinning_workers", spinning_workers, 0)
        )
        self.processes: list[subprocess.Popen | ForkedWorker] = []
        self.sockets: list[_MessageSocket] = []
        self._stderr = _StderrTails()
        self.memory_fd: int | None = None
        self.memory: mmap.mmap | None = None
        self.memory_size = 0
        self.regions: dict[tuple[int, int], mmap.mmap] = {}  # by handle
        self.failed: set[int] = set()
        self.has_inline_worker = check_bool("inline_worker", inline_worker)
        self.inline: InlineWorker | None = None  # with inline_worker, once started: the last worker
        self.forks_workers = check_bool("fork_server", fork_server) and pidfd_supported()

    @property
    def num_workers(self) -> int:
        return len(self.sockets) + (self.inline is not None)

    def worker_pids(self) -> list[int]:
        """The worker processes' ids; an inline worker's is the learner's own."""
        return [process.pid for process in self.processes] + ([os.getpid()] if self.inline is not None else [])

    def _inline(self, worker: int) -> InlineWorker | None:
        """The inline worker if ``worker`` is it (the last one), else ``None``."""
        return self.inline if worker == len(self.sockets) else None

    def start(self, num_workers: int, timeout: float) -> None:
        self.memory_fd = _anonymous_file()
        # The learner's environment as it is: an env's helper processes see what they would see under
        # DummyVecEnv (the worker finds ClusterEnv through its import path, interpreter.child_command).
        self._worker_env = dict(os.environ, **self.extra_env)
        for worker in range(num_workers - self.has_inline_worker):
            process, channel = self._launch(worker, timeout)
            self.processes.append(process)
            self.sockets.append(channel)
        if self.has_inline_worker:
            from clusterenv_core.transports.inline import InlineWorker

            self.inline = InlineWorker(self.memory_fd)

    def _launch(self, worker: int, timeout: float) -> tuple[subprocess.Popen | ForkedWorker, _MessageSocket]:
        learner_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        spin = repr(self.worker_spin if worker < self.spinning_workers else 0.0)
        stderr = self._stderr.new_pipe(worker)
        try:
            process = self._fork(worker_end.fileno(), stderr, spin, timeout) if self.forks_workers else None
            if process is None:
                process = self._start_interpreter(worker_end.fileno(), stderr, spin)
        except BaseException:
            learner_end.close()
            raise
        finally:
            worker_end.close()
            os.close(stderr)
        # With an inline worker the learner is one of as many processes as cores: it polls as spinning
        # workers do, so the replies it waits for reach it without a wake-up.
        return process, _MessageSocket(learner_end, "the learner", self.worker_spin if self.has_inline_worker else 0.0)

    def _fork(self, socket_fd: int, stderr: int, spin: str, timeout: float) -> ForkedWorker | None:
        """A worker forked by the fork server, or ``None`` if it failed (a fresh interpreter then
        serves as well, only slower to start)."""
        modules = ["clusterenv_core.worker", *installed(self.worker_modules)]
        fds = [socket_fd, self.memory_fd, 1, stderr]  # fd 1: the learner's stdout now, as a new process inherits it
        try:
            return launch_worker(self.python, self._worker_env, fds, spin, modules, max(timeout, _IMPORT_TIMEOUT))
        except OSError:
            return None

    def _start_interpreter(self, socket_fd: int, stderr: int, spin: str) -> subprocess.Popen:
        fds = (socket_fd, self.memory_fd)
        command = child_command(self.python, "clusterenv_core.worker", ["local", *map(str, fds), spin])
        # A session of its own: processes its envs start share its process group, which close()
        # ends (and no signal of the learner's terminal reaches it; it ignores Ctrl-C anyway).
        return subprocess.Popen(
            command,
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
            stderr=stderr,
            env=self._worker_env,
            start_new_session=True,
        )

    def restart(self, worker: int, timeout: float) -> None:
        if self._inline(worker):
            raise NotImplementedError("the inline worker runs in the learner's process and cannot be replaced")
        old = self.processes[worker]
        old.kill()
        old.wait()
        _end_process_group(old)
        self.sockets[worker].sock.close()
        self.processes[worker], self.sockets[worker] = self._launch(worker, timeout)
        self.failed.discard(worker)

    def send(self, worker: int, message: Any) -> None:
        inline = self._inline(worker)
        if inline is not None:
            inline.request(message)
            return
        try:
            frame = _frame(message)
        except KeyboardInterrupt:
            raise RequestNotSent from None
        self._send_frame(worker, frame)

    def send_step(self, worker: int) -> None:
        # The pool starts its workers in order and the inline worker is the last: it steps its block
        # while the worker processes step theirs.
        inline = self._inline(worker)
        if inline is not None:
            inline.request(STEP)
        else:
            self._send_frame(worker, _STEP_FRAME)

    def _send_frame(self, worker: int, frame: bytes) -> None:
        try:
            self.sockets[worker].send_frame(frame)
        except OSError as error:
            raise self._lost(worker, f"cannot send to it ({error})") from error

    def recv(self, worker: int, timeout: float) -> Any:
        inline = self._inline(worker)
        if inline is not None:
            return inline.reply()
        try:
            return self.sockets[worker].recv(timeout, lambda: self._check_alive(worker))
        except EOFError:
            raise self._lost(worker, "its connection closed") from None
        except TimeoutError:
            self.failed.add(worker)
            raise WorkerTimeoutError(
                f"worker {worker} (pid {self.processes[worker].pid}{self.envs_of(worker)}) did not answer within {timeout:g} s"
            ) from None
        except ConnectionError as error:
            raise self._lost(worker, f"its connection broke ({error})") from error

    recv_step = recv

    def wait_steps(self, workers: list[int], timeout: float) -> list[int]:
        sockets = self.sockets
        if self.inline is None:
            ready = [worker for worker in workers if sockets[worker].has_data()]
            return ready or self._poll_replies(workers, timeout)
        processes = [worker for worker in workers if not self._inline(worker)]
        ready = {worker for worker in workers if self._inline(worker) and self.inline.has_reply()}
        ready.update(worker for worker in processes if sockets[worker].has_data())
        if not ready:
            return self._poll_replies(processes, timeout)
        # An inline worker's reply is in as soon as its request returned: the worker processes'
        # replies already in count too, or the envs behind them would wait for a turn that never comes.
        ready.update(self._poll_replies([worker for worker in processes if worker not in ready], 0.0))
        return [worker for worker in workers if worker in ready]

    def _poll_replies(self, workers: list[int], timeout: float) -> list[int]:
        """Worker processes among ``workers`` with bytes to read within ``timeout`` (or lost)."""
        by_fd = {self.sockets[worker].sock.fileno(): worker for worker in workers}
        poller = select.poll()
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            # Polled at least once, also with no time left: a reply may be in already.
            events = poller.poll(max(min(remaining, _LIVENESS_INTERVAL), 0.0) * 1000.0)
            if events:
                # Readable includes closed: the receive that follows names a lost worker.
                readable = {by_fd[fd] for fd, _ in events}
                return [worker for worker in workers if worker in readable]
            if remaining <= 0:
                return []
            for worker in workers:
                if self.processes[worker].poll() is not None:
                    return [worker]  # its receive reports it lost

    def _check_alive(self, worker: int) -> None:
        if self.processes[worker].poll() is not None:
            raise EOFError

    def _lost(self, worker: int, why: str) -> WorkerLostError:
        self.failed.add(worker)
        process = self.processes[worker]
        try:
            code = process.wait(timeout=1.0)
            if not getattr(process, "status_known", True):
                status = "ended (its exit status was lost: its fork server was killed)"
            elif code >= 0:
                status = f"exited with code {code}"
            else:
                status = f"was killed by {signal.Signals(-code).name}"
        except (subprocess.TimeoutExpired, ValueError):
            status = "is unresponsive"
            return WorkerLostError(f"worker {worker} (pid {process.pid}{self.envs_of(worker)}) {status}: {why}")
        last_lines = self._stderr.last_lines(worker)
        said = f"\n\nThe last lines it wrote to stderr:\n{last_lines}" if last_lines else " (it wrote nothing to stderr)"
        return WorkerLostError(f"worker {worker} (pid {process.pid}{self.envs_of(worker)}) {status}: {why}{said}")

    def share_buffers(self, spec: BatchSpec, blocks: list[range]) -> BatchBuffers:
        nbytes = spec.nbytes()
        os.ftruncate(self.memory_fd, nbytes)
        self.memory = mmap.mmap(self.memory_fd, nbytes)
        self.memory_size = nbytes
        return BatchBuffers(spec, self.memory)

    def share_region(self, nbytes: int) -> tuple[Any, memoryview]:
        # Regions are appended to the same memory file, page-aligned so each can be mapped alone.
        offset = -(-self.memory_size // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
        os.ftruncate(self.memory_fd, offset + nbytes)
        self.memory_size = offset + nbytes
        region = mmap.mmap(self.memory_fd, nbytes, offset=offset)
        self.regions[offset, nbytes] = region
        return (offset, nbytes), region

    def release_region(self, handle: Any) -> None:
        # Its pages are freed unless views of it are left here (a Rollout the caller kept reads
        # them). Workers read it no more: a region is released by the deploy that replaces its
        # policy, whose request is their next, or by close().
        region = self.regions.pop(handle, None)
        if region is not None and _unmap(region):
            _free_pages(self.memory_fd, *handle)

    def send_arrays(self, worker: int, arrays: list) -> None:
        pass  # shared memory: the worker sees the learner's arrays

    def recv_arrays(self, worker: int, arrays: list, timeout: float) -> None:
        pass

    def close(self, timeout: float, closed: set[int]) -> None:
        deadline = time.monotonic() + timeout
        try:
            for worker in self.failed:
                self.processes[worker].kill()
            for process in self.processes:
                try:
                    process.wait(timeout=max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    break  # the deadline passed: the rest are killed below
        finally:
            self._release()  # also after Ctrl-C in a wait, which is raised once everything is released

    def _release(self) -> None:
        """Kill the workers still running and free every descriptor, thread and mapping, then close
        the inline worker's envs. A further Ctrl-C (the user pressing again after the one that cut
        ``close`` short) is held until the workers are ended and everything is freed, which takes
        moments, or workers would be left running; the envs' close is theirs and stays interruptible."""
        try:
            with ctrl_c_held():
                for process in self.processes:
                    if process.poll() is None:
                        process.kill()
                        process.wait()
                    _end_process_group(process)
                for channel in self.sockets:
                    channel.sock.close()
                self.processes, self.sockets = [], []
                self._stderr.close()
                for mapping in [self.memory, *self.regions.values()]:
                    if mapping is not None:
                        _unmap(mapping)
                self.memory, self.regions = None, {}
                if self.memory_fd is not None:
                    os.close(self.memory_fd)
                    self.memory_fd = None
        finally:
            if self.inline is not None:
                inline, self.inline = self.inline, None
                inline.close()


class MemoryFileConnection(WorkerConnection):
    """What every worker of the local backend shares: the buffers and regions of the memory file.

    :param memory_fd: the memory file holding the batch buffers and the regions
    """

    def __init__(self, memory_fd: int) -> None:
        self.memory_fd = memory_fd
        self.memory: mmap.mmap | None = None

    def attach(self, spec: BatchSpec, block: range) -> tuple[BatchBuffers, int]:
        self.memory = mmap.mmap(self.memory_fd, spec.nbytes())
        return BatchBuffers(spec, self.memory), block.start

    def map_region(self, handle: Any, fields: list[Field], num_envs: int, block: range) -> tuple[dict, int]:
        offset, nbytes = handle
        region = mmap.mmap(self.memory_fd, nbytes, offset=offset)
        return field_views(fields, num_envs, region), block.start

    def send_arrays(self, arrays: list) -> None:
        pass  # shared memory: the learner sees the worker's arrays

    def recv_arrays(self, arrays: list) -> None:
        pass


class LocalWorkerConnection(MemoryFileConnection):
    """Worker side of the local backend, in a worker process.

    :param socket_fd: the worker's end of the socket pair
    :param memory_fd: the memory file holding the batch buffers
    :param spin: seconds to poll for the next request before sleeping in the kernel
    """

    def __init__(self, socket_fd: int, memory_fd: int, spin: float = 0.0) -> None:
        super().__init__(memory_fd)
        self.channel = _MessageSocket(socket.socket(fileno=socket_fd), "the worker", spin)

    def recv(self) -> Any:
        try:
            return self.channel.recv()
        except (EOFError, ConnectionError):
            return None

    def learner_alive(self) -> bool:
        return not self.channel.peer_closed()

    def request_waiting(self) -> bool:
        return self.channel.readable()

    def send(self, message: Any) -> None:
        self._send_frame(_frame(message))

    def send_step(self, reply: Any) -> None:
        self._send_frame(_OK_NONE_FRAME if reply is OK_NONE else _frame(reply))

    def _send_frame(self, frame: bytes) -> None:
        try:
            self.channel.send_frame(frame)
        except OSError:
            pass  # the learner is gone; the next recv ends the loop

    def close(self) -> None:
        self.channel.sock.close()
        _terminate_own_group()


def _terminate_own_group() -> None:
    """The learner starts each worker as a session leader, so what the envs started and left
    running shares this process group: end it here too, for a learner that was killed and cannot.
    SIGTERM lets those processes clean up; this process ignores it on its way out."""
    if os.getpgrp() == os.getpid():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)


def _end_when_orphaned(learner: int, forked: bool) -> None:
    """Once the ``learner`` process is gone, give the worker ``_ORPHAN_GRACE`` seconds to end by
    itself, then end it and what its envs left running. A fresh worker's parent is the learner: it
    is gone once the worker is reparented. A forked worker's parent is the fork server, which a
    learner may end while the worker serves on: it watches the learner through a pidfd."""
    if not forked:
        while os.getppid() == learner:
            time.sleep(1.0)
    else:
        try:
            learner_pidfd = os.pidfd_open(learner)
        except ProcessLookupError:
            pass  # gone already
        else:
            select.select([learner_pidfd], [], [])  # readable once the learner ended
    time.sleep(_ORPHAN_GRACE)
    try:
        print(f"clusterenv worker: the learner ended {_ORPHAN_GRACE:g} s ago and this worker has not; ending it", file=sys.stderr, flush=True)
    except OSError:
        pass  # stderr's reader was the learner
    if os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGTERM)  # this process too (signal handlers can only be set by the main thread)
    os._exit(1)


def worker_connection(argv: list[str]) -> LocalWorkerConnection:
    """Build the worker side from the command line ``<socket fd> <memory fd> <spin seconds>``, and
    ``<learner pid>`` for a worker forked by the fork server (a fresh worker's learner is its parent)."""
    # Ctrl-C in a terminal reaches the whole process group; the learner handles it and closes us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    socket_fd, memory_fd, spin, *forked_for = argv
    learner = int(forked_for[0]) if forked_for else os.getppid()
    threading.Thread(
        target=_end_when_orphaned, args=(learner, bool(forked_for)), name="clusterenv-orphan-watch", daemon=True
    ).start()
    return LocalWorkerConnection(int(socket_fd), int(memory_fd), float(spin))
