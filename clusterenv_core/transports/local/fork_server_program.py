"""The fork server's program: ``python -m clusterenv_core.transports.local.fork_server_program <fd>``.

It serves the learner's :class:`~clusterenv_core.transports.local.fork_server.ForkServer` on the
control socket ``<fd>``: for each request it imports the modules named (those it can), forks a
worker with the request's descriptors, and sends back the worker's pid, a pidfd of it and a socket
on which it sends the worker's exit status once it reaped it. It ends when the learner's end of
the control socket closes, or once it has had no worker for :data:`IDLE_SECONDS`. A fork turns
into the worker program (:mod:`clusterenv_core.worker.launch`) as ``python -m clusterenv_core.worker
local ...`` would run it.
"""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import socket
import sys
import time

from clusterenv_core.transports.local.fork_server import EXIT_STATUS, MAX_MESSAGE

#: seconds the fork server lingers without a worker before it ends (pools opened one after another,
#: as in a test suite or an eval env after a training env, reuse it)
IDLE_SECONDS = 10.0
# The request's descriptors, in order: the worker's socket end and memory file (its arguments), and
# the learner's stdout and the worker's stderr pipe (its standard streams).
_REQUEST_FDS = 4


def _serve(control: socket.socket) -> None:
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the loop through the pipe
    statuses: dict[int, socket.socket] = {}  # per live worker, the server's end of its status socket
    imported: set[str] = set()
    idle_since = time.monotonic()
    while True:
        timeout = None if statuses else max(idle_since + IDLE_SECONDS - time.monotonic(), 0.0)
        readable, _, _ = select.select([control, wake_read], [], [], timeout)
        if wake_read in readable:
            try:
                while os.read(wake_read, 512):
                    pass
            except BlockingIOError:
                pass
            _reap(statuses)
            if not statuses:
                idle_since = time.monotonic()
        if control in readable:
            message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, _REQUEST_FDS)
            if not message:  # the learner is gone; its workers watch it themselves
                for status in statuses.values():
                    status.close()
                return
            arguments, learner, cwd, env, modules = pickle.loads(message)
            for module in modules:
                if module not in imported:
                    imported.add(module)
                    try:
                        importlib.import_module(module)
                    except Exception:
                        pass  # the worker imports it itself, and reports what fails
            _fork(
                control, fds, [*arguments, str(learner)], cwd, env, [control.fileno(), wake_read, wake_write], statuses
            )
        elif not readable and not statuses:
            return  # idle for IDLE_SECONDS


def _fork(
    control: socket.socket,
    fds: list[int],
    arguments: list[str],
    cwd: str,
    env: dict[str, str],
    server_fds: list[int],
    statuses: dict[int, socket.socket],
) -> None:
    status_server, status_learner = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        try:
            for fd in [*server_fds, status_server.fileno(), status_learner.fileno()]:
                os.close(fd)
            for status in statuses.values():
                status.close()
            _become_worker(fds, arguments, cwd, env)
        finally:
            os._exit(1)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)  # before the server reaps it, which only its own loop does
    statuses[pid] = status_server
    try:
        socket.send_fds(control, [pickle.dumps(pid)], [pidfd, status_learner.fileno()])
    finally:
        os.close(pidfd)
        status_learner.close()


def _become_worker(fds: list[int], arguments: list[str], cwd: str, env: dict[str, str]) -> None:
    """Turn this fork into a local worker: ``fds`` as in a request, ``arguments`` the worker's own
    after its descriptors (its spin and orphan grace seconds, and its learner's pid)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()  # as the local backend's workers are: what its envs start shares its process group
    socket_fd, memory_fd, stdout, stderr = fds
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, standard in ((devnull, 0), (stdout, 1), (stderr, 2)):
        if fd != standard:
            os.dup2(fd, standard)
            os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # the legacy global generator: fresh entropy, as a fresh interpreter has
    from clusterenv_core.worker import launch

    program = os.path.join(os.path.dirname(launch.__file__), "__main__.py")
    sys.argv = [program, "local", str(socket_fd), str(memory_fd), *arguments]  # as `python -m` sets it
    launch.end_worker_program(launch.run_worker_program(sys.argv[1:]))


def _reap(statuses: dict[int, socket.socket]) -> None:
    while statuses:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        channel = statuses.pop(pid, None)
        if channel is not None:
            try:
                channel.send(EXIT_STATUS.pack(status))
            except OSError:
                pass  # the learner closed it: it no longer watches this worker
            channel.close()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Closed on the way out: the server runs with the learner's flags, and under -X dev an unclosed
    # socket is a ResourceWarning on the learner's stderr.
    with socket.socket(fileno=int(sys.argv[1])) as control:
        _serve(control)
