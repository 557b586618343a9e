"""LocalTransport: the learner side of the local backend.

It starts the worker processes (forks of the fork server, or fresh interpreters), talks to each
over its socket, lays the buffers and regions out in the memory file, and ends the workers and
what their envs started. With ``inline_worker`` the last worker is an
:class:`~clusterenv_core.transports.local.inline.InlineWorker` in the learner's own process.
"""

from __future__ import annotations

import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from clusterenv_core.buffers import BatchBuffers, BatchSpec
from clusterenv_core.checks import check_bool, check_int, check_seconds
from clusterenv_core.errors import WorkerLostError, WorkerTimeoutError
from clusterenv_core.interpreter import child_command
from clusterenv_core.protocol import STEP
from clusterenv_core.transports.base import RequestNotSent, Transport, ctrl_c_held
from clusterenv_core.transports.local.fork_server import ForkedWorker, installed, launch_worker, pidfd_supported
from clusterenv_core.transports.local.memory_file import anonymous_file, free_pages, unmap
from clusterenv_core.transports.local.message_socket import LIVENESS_INTERVAL, STEP_FRAME, MessageSocket, frame_message
from clusterenv_core.transports.local.stderr_tails import StderrTails

if TYPE_CHECKING:
    from clusterenv_core.transports.local.inline import InlineWorker

_IMPORT_TIMEOUT = 60.0  # at least this long for the fork server to import the workers' modules: slow is not stuck


def _end_process_group(process: subprocess.Popen) -> None:
    """Kill what the envs of an ended worker process started and left running (helper processes,
    simulators): they share the worker's process group, whose id is the worker's pid. PIDs are
    handed out in sequence, so the id names no other group this soon after the worker ended."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in the group


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
        its own (see :mod:`clusterenv_core.transports.local.inline`: faster where workers are as many as
        cores, but those envs lose the workers' isolation and timeouts)
    :param fork_server: fork the workers from a fork server that imported their modules once (see
        :mod:`clusterenv_core.transports.local.fork_server`), where the system has pidfds; ``False``:
        start each worker as a fresh interpreter, which imports them anew
    :param orphan_grace: seconds a worker whose learner is gone (killed, say) has to end by itself
        before it is ended, with what its envs left running: it ends at once as its socket reads
        end-of-file, unless an env hangs in ``close()`` or left a thread running
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
        orphan_grace: float = 10.0,
    ) -> None:
        self.python = python or sys.executable
        self.extra_env = dict(env or {})
        self.worker_spin = check_seconds("worker_spin", worker_spin, allow_zero=True, below=1.0)
        self.spinning_workers = (
            max((os.cpu_count() or 1) - 1, 0)
            if spinning_workers is None
            else check_int("spinning_workers", spinning_workers, 0)
        )
        self.processes: list[subprocess.Popen | ForkedWorker] = []
        self.sockets: list[MessageSocket] = []
        self._stderr = StderrTails()
        self.memory_fd: int | None = None
        self.memory: mmap.mmap | None = None
        self.memory_size = 0
        self.regions: dict[tuple[int, int], mmap.mmap] = {}  # by handle
        self.failed: set[int] = set()
        self.has_inline_worker = check_bool("inline_worker", inline_worker)
        self.inline: InlineWorker | None = None  # with inline_worker, once started: the last worker
        self.forks_workers = check_bool("fork_server", fork_server) and pidfd_supported()
        self.orphan_grace = check_seconds("orphan_grace", orphan_grace)

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
        self.memory_fd = anonymous_file()
        # The learner's environment as it is: an env's helper processes see what they would see under
        # DummyVecEnv (the worker finds ClusterEnv through its import path, interpreter.child_command).
        self._worker_env = dict(os.environ, **self.extra_env)
        for worker in range(num_workers - self.has_inline_worker):
            process, channel = self._launch(worker, timeout)
            self.processes.append(process)
            self.sockets.append(channel)
        if self.has_inline_worker:
            from clusterenv_core.transports.local.inline import InlineWorker

            self.inline = InlineWorker(self.memory_fd)

    def _launch(self, worker: int, timeout: float) -> tuple[subprocess.Popen | ForkedWorker, MessageSocket]:
        learner_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The worker's arguments after its descriptors (local/worker.py: worker_connection).
        arguments = [repr(self.worker_spin if worker < self.spinning_workers else 0.0), repr(self.orphan_grace)]
        stderr = self._stderr.new_pipe(worker)
        try:
            process = self._fork(worker_end.fileno(), stderr, arguments, timeout) if self.forks_workers else None
            if process is None:
                process = self._start_interpreter(worker_end.fileno(), stderr, arguments)
        except BaseException:
            learner_end.close()
            raise
        finally:
            worker_end.close()
            os.close(stderr)
        # With an inline worker the learner is one of as many processes as cores: it polls as spinning
        # workers do, so the replies it waits for reach it without a wake-up.
        return process, MessageSocket(learner_end, "the learner", self.worker_spin if self.has_inline_worker else 0.0)

    def _fork(self, socket_fd: int, stderr: int, arguments: list[str], timeout: float) -> ForkedWorker | None:
        """A worker forked by the fork server, or ``None`` if it failed (a fresh interpreter then
        serves as well, only slower to start)."""
        modules = ["clusterenv_core.worker.serving", *installed(self.worker_modules)]
        fds = [socket_fd, self.memory_fd, 1, stderr]  # fd 1: the learner's stdout now, as a new process inherits it
        try:
            return launch_worker(self.python, self._worker_env, fds, arguments, modules, max(timeout, _IMPORT_TIMEOUT))
        except OSError:
            return None

    def _start_interpreter(self, socket_fd: int, stderr: int, arguments: list[str]) -> subprocess.Popen:
        fds = (socket_fd, self.memory_fd)
        command = child_command(self.python, "clusterenv_core.worker", ["local", *map(str, fds), *arguments])
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
            frame = frame_message(message)
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
            self._send_frame(worker, STEP_FRAME)

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
                f"{self.process_named(worker, self.processes[worker].pid)} did not answer within {timeout:g} s"
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
            events = poller.poll(max(min(remaining, LIVENESS_INTERVAL), 0.0) * 1000.0)
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
            return WorkerLostError(f"{self.process_named(worker, process.pid)} {status}: {why}")
        last_lines = self._stderr.last_lines(worker)
        said = (
            f"\n\nThe last lines it wrote to stderr:\n{last_lines}" if last_lines else " (it wrote nothing to stderr)"
        )
        return WorkerLostError(f"{self.process_named(worker, process.pid)} {status}: {why}{said}")

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
        if region is not None and unmap(region):
            free_pages(self.memory_fd, *handle)

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
                        unmap(mapping)
                self.memory, self.regions = None, {}
                if self.memory_fd is not None:
                    os.close(self.memory_fd)
                    self.memory_fd = None
        finally:
            if self.inline is not None:
                inline, self.inline = self.inline, None
                inline.close()
