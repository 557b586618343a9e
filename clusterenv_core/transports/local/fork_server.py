"""The local backend's fork server: a process that imports the workers' modules once and forks workers.

A fresh interpreter for every worker pays for its imports every time: an SB3 env factory
(``make_vec_env`` wraps each env in SB3's ``Monitor``) makes each worker import SB3 and torch,
seconds of CPU per worker, and a pool with more workers than cores pays them one after another.
The fork server is started once per learner process (and interpreter), as a fresh interpreter
itself, and imports the modules the env factories name (:func:`clusterenv_core.protocol.modules_named`)
before it forks a worker; a worker forked from it starts with them imported, in milliseconds. The
server never runs env code, starts no thread and holds nothing of a pool, so a fork of it is a fresh
worker in all but its imports.

- Its worker processes are its children: it reaps each and sends the exit status to the learner
  over a socket of that worker's own; the learner also gets a pidfd of each worker, which tells it
  the worker ended and lets it signal the worker safely.
- It ends when the learner does (its control socket reads end-of-file), and by itself once it has
  had no worker for :data:`~.fork_server_program.IDLE_SECONDS`, so that a learner whose pools are
  closed keeps no process. Its workers watch the learner, not it (they are given the learner's pid): a server that ends
  early, or that the learner ends (Ctrl-C while it forked), leaves them serving.
- It lives in a session of its own, as the workers do (each is made a session leader at once), so
  Ctrl-C at the learner's terminal reaches neither.

Requests and replies are single messages on a ``SOCK_SEQPACKET`` socket pair, file descriptors
passed with them (``SCM_RIGHTS``). This module is the learner's side (:class:`ForkServer`,
:class:`ForkedWorker`, :func:`launch_worker`); the server runs :mod:`~.fork_server_program`.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence

from clusterenv_core.interpreter import child_command, interpreter_flags, site_roots

#: the name of the thread that reaps a fork server once it ended
REAPER_THREAD = "clusterenv-fork-server-reaper"
#: a worker's exit status as the server sends it to the learner (as ``os.waitpid`` gave it)
EXIT_STATUS = struct.Struct("<i")
#: the longest request or reply, in bytes
MAX_MESSAGE = 1 << 20


def pidfd_supported() -> bool:
    """Whether this system has pidfds (Linux 5.3+), which the learner needs to watch forked workers."""
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


class ForkedWorker:
    """The learner's handle on a worker process the fork server forked: what the local backend
    uses of :class:`subprocess.Popen` (``pid``, ``poll``, ``wait``, ``kill``, ``returncode``).

    :param pid: the worker's process id
    :param pidfd: a pidfd of the worker: readable once it ended, and safe to signal however late
    :param status: the learner's end of the socket the server sends the worker's exit status on
    """

    def __init__(self, pid: int, pidfd: int, status: socket.socket) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.status = status
        #: the exit code as :class:`subprocess.Popen` gives it (``-N``: killed by signal ``N``), once ended
        self.returncode: int | None = None
        #: ``False`` if the worker ended but its status was lost (the fork server was killed)
        self.status_known = True

    def poll(self) -> int | None:
        if self.returncode is None and _readable(self.pidfd, 0.0):
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not _readable(self.pidfd, timeout):
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            self._collect()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass  # ended already; its pidfd names no other process

    def _collect(self) -> None:
        """Read the exit status of the ended worker: the server reaps it and sends it at once."""
        data = self.status.recv(EXIT_STATUS.size) if _readable(self.status.fileno(), 5.0) else b""
        if len(data) == EXIT_STATUS.size:
            self.returncode = os.waitstatus_to_exitcode(EXIT_STATUS.unpack(data)[0])
        else:
            self.returncode, self.status_known = 1, False
        self.status.close()
        os.close(self.pidfd)
        self.pidfd = -1


def _readable(fd: int, timeout: float | None) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else timeout * 1000.0))


class ForkServer:
    """The learner's side of one fork server process.

    :param python: the server's interpreter, started with the learner's flags and import path
        (:func:`~clusterenv_core.interpreter.child_command`), which its workers inherit
    :param env: the server's environment (the workers get their own with each launch)
    """

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.owner = os.getpid()
        self.control, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                child_command(
                    python, "clusterenv_core.transports.local.fork_server_program", [str(server_end.fileno())]
                ),
                pass_fds=[server_end.fileno()],
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            self.control.close()
            raise
        finally:
            server_end.close()
        # Reaped when it ends (idle), so that it is never left a zombie of the learner's.
        threading.Thread(target=self.process.wait, name=REAPER_THREAD, daemon=True).start()

    def usable(self) -> bool:
        """Whether this server can still fork workers for this process."""
        return self.owner == os.getpid() and self.process.poll() is None

    def launch(
        self, fds: Sequence[int], arguments: Sequence[str], env: dict[str, str], modules: Sequence[str], timeout: float
    ) -> ForkedWorker:
        """Fork a local worker for the socket end and memory file ``fds[:2]``, its stdout and stderr
        ``fds[2:]``, after importing ``modules`` in the server (those it can). The worker gets
        ``arguments`` after its descriptors, then this learner's pid (the process it watches).

        :raises OSError: the server is gone or did not answer within ``timeout`` seconds
        """
        request = pickle.dumps((list(arguments), os.getpid(), os.getcwd(), env, list(modules)))
        socket.send_fds(self.control, [request], list(fds))
        if not _readable(self.control.fileno(), timeout):
            raise TimeoutError(f"the fork server did not fork a worker within {timeout:g} s")
        reply, reply_fds, _, _ = socket.recv_fds(self.control, MAX_MESSAGE, 2)
        if not reply:
            raise ConnectionError("the fork server ended")
        pid = pickle.loads(reply)
        pidfd, status = reply_fds
        return ForkedWorker(pid, pidfd, socket.socket(fileno=status))

    def close(self) -> None:
        """End the server (its workers go on until their own ends)."""
        self.control.close()
        self.process.kill()
        try:
            self.process.wait(1.0)  # at once: killed
        except subprocess.TimeoutExpired:
            pass


def installed(modules: Sequence[str]) -> list[str]:
    """Those of ``modules`` (imported in this process) that come from installed packages.

    Only those are worth importing in the server, and only they are safe to: the user's own modules
    run code of theirs when imported, which may build a pool or start threads (a fork then copies
    their locks held), and are cheap to import in each worker anyway.
    """
    roots = site_roots()
    chosen = []
    for module in modules:
        path = getattr(sys.modules.get(module.split(".")[0]), "__file__", None)
        if path and any(os.path.realpath(path).startswith(root) for root in roots):
            chosen.append(module)
    return chosen


_servers: dict[tuple[str, ...], ForkServer] = {}
_servers_lock = threading.Lock()


@atexit.register
def _close_servers() -> None:
    """End this learner's fork servers as it exits, rather than leave their sockets to the garbage
    collector (a ResourceWarning under ``-X dev``)."""
    with _servers_lock:
        servers = [server for server in _servers.values() if server.owner == os.getpid()]
        _servers.clear()
    for server in servers:
        server.close()


def launch_worker(
    python: str,
    env: dict[str, str],
    fds: Sequence[int],
    arguments: Sequence[str],
    modules: Sequence[str],
    timeout: float,
) -> ForkedWorker:
    """Fork a local worker from this process's fork server for the interpreter ``python`` and the
    packages of ``modules`` (started if need be).

    A server that ended since (idle) or fails is replaced once.

    :raises OSError: no server could fork it
    """
    # A server per set of packages: workers import only what their factories need, torch only if
    # they name it, also when an earlier pool's server imported it. And per flags and import path,
    # which its workers inherit and its imports followed.
    packages = sorted({module.split(".")[0] for module in modules})
    key = (python, *interpreter_flags(python), "", *sys.path, "", *packages)
    with _servers_lock:
        for attempt in range(2):
            server = _servers.get(key)
            if server is None or not server.usable():
                server = _servers[key] = ForkServer(python, env)
            try:
                return server.launch(fds, arguments, env, modules, timeout)
            except BaseException as error:
                # Its replies may be out of step with the requests now (Ctrl-C while it forked):
                # it serves no more. Its workers watch their learner, not it, and serve on.
                del _servers[key]
                server.close()
                if attempt == 1 or not isinstance(error, OSError):
                    raise
    raise AssertionError("unreachable")
