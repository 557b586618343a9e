"""The worker side of the local backend, in a worker process: :class:`LocalWorkerConnection`.

A worker reads its requests from its end of the socket pair and maps the memory file the learner
shares. When the learner is gone it reads end-of-file and ends; a thread watches the learner too,
and ends a worker that has not ended by itself within the orphan grace (the transport's
``orphan_grace``: an env that hangs in its ``close()``, or a thread it left running, would keep it
forever).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any

from clusterenv_core.protocol import OK_NONE
from clusterenv_core.transports.local.memory_file import MemoryFileConnection
from clusterenv_core.transports.local.message_socket import OK_NONE_FRAME, MessageSocket, frame_message


class LocalWorkerConnection(MemoryFileConnection):
    """Worker side of the local backend, in a worker process.

    :param socket_fd: the worker's end of the socket pair
    :param memory_fd: the memory file holding the batch buffers
    :param spin: seconds to poll for the next request before sleeping in the kernel
    """

    def __init__(self, socket_fd: int, memory_fd: int, spin: float = 0.0) -> None:
        super().__init__(memory_fd)
        self.channel = MessageSocket(socket.socket(fileno=socket_fd), "the worker", spin)

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
        self._send_frame(frame_message(message))

    def send_step(self, reply: Any) -> None:
        self._send_frame(OK_NONE_FRAME if reply is OK_NONE else frame_message(reply))

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


def _end_when_orphaned(learner: int, forked: bool, grace: float) -> None:
    """Once the ``learner`` process is gone, give the worker ``grace`` seconds to end by itself (its
    loop reads end-of-file and closes its envs), then end it and what its envs left running: an env
    that hangs, or a thread it left running, would keep it forever. A fresh worker's parent is the
    learner: it is gone once the worker is reparented. A forked worker's parent is the fork server,
    which a learner may end while the worker serves on: it watches the learner through a pidfd."""
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
    time.sleep(grace)
    try:
        print(
            f"clusterenv worker: the learner ended {grace:g} s ago and this worker has not; ending it",
            file=sys.stderr,
            flush=True,
        )
    except OSError:
        pass  # stderr's reader was the learner
    if os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGTERM)  # this process too (signal handlers can only be set by the main thread)
    os._exit(1)


def worker_connection(argv: list[str]) -> LocalWorkerConnection:
    """Build the worker side from the command line ``<socket fd> <memory fd> <spin seconds> <orphan
    grace seconds>``, and ``<learner pid>`` for a worker forked by the fork server (a fresh worker's
    learner is its parent)."""
    # Ctrl-C in a terminal reaches the whole process group; the learner handles it and closes us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    socket_fd, memory_fd, spin, orphan_grace, *forked_for = argv
    learner = int(forked_for[0]) if forked_for else os.getppid()
    threading.Thread(
        target=_end_when_orphaned,
        args=(learner, bool(forked_for), float(orphan_grace)),
        name="clusterenv-orphan-watch",
        daemon=True,
    ).start()
    return LocalWorkerConnection(int(socket_fd), int(memory_fd), float(spin))
