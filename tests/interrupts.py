"""Ctrl-C on a timer, for tests of what an interrupted wait leaves behind."""

from __future__ import annotations

import signal
import threading


def interrupt_soon(delay: float) -> None:
    """Ctrl-C in ``delay`` seconds, delivered to the main thread (a process-wide signal may land on
    another thread, and the main thread then only notices it when its wait returns)."""
    # A run started in the background of a shell without job control inherits SIGINT ignored, and
    # Python then installs no handler for it: give Ctrl-C the meaning it has at a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(delay, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
