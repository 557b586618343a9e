"""The local backend: worker processes on this machine, batch buffers in shared memory.

Each worker is a fork of the learner's fork server (:mod:`~.fork_server`), a fresh interpreter that
imported the installed modules the env factories name, once for all workers; or, with
``fork_server=False`` or where forking fails, a fresh interpreter of its own (``python -m
clusterenv_core.worker local ...``). Either way it imports only what its env factories
need and never re-runs the user's ``__main__``. It gets two file descriptors:

- one end of an ``AF_UNIX`` socket pair, carrying length-prefixed pickled control messages and the
  step wake-ups and replies. No network port is ever opened, and when either side dies the other
  reads end-of-file at once, so a dead worker is reported immediately and an orphaned worker exits.
- an anonymous memory file (``memfd``) holding the batch buffers. It has no name in ``/dev/shm``,
  so nothing is left behind however the processes end.

Signalling went through measurement (``benchmarks/signalling.py``, ``benchmarks/throughput.py``;
see docs/guides/what_bounds_the_step.md). Workers sleep in the kernel between requests, except
that the first ``cores - 1`` of them poll for up to ``worker_spin`` seconds after each reply before
they sleep: a learner that answers within that time reaches them without a wake-up, and with at
most ``cores - 1`` spinners the learner always has a core of its own. With ``inline_worker`` the
last worker runs in the learner's process instead (:mod:`~.inline`), and the learner polls for
replies as those workers poll for requests.

Modules, one concept each: :mod:`~.transport` (:class:`LocalTransport`, the learner's side),
:mod:`~.worker` (:class:`LocalWorkerConnection`, a worker process's side), :mod:`~.message_socket`
(the messages on a worker's socket), :mod:`~.memory_file` (the memory file, and the connection
every worker maps it through), :mod:`~.stderr_tails` (the workers' stderr), :mod:`~.inline` (the
inline worker), :mod:`~.fork_server` (the learner's side of the fork server) and
:mod:`~.fork_server_program` (the fork server itself).
"""

from clusterenv_core.transports.local.transport import LocalTransport
from clusterenv_core.transports.local.worker import LocalWorkerConnection, worker_connection

__all__ = ["LocalTransport", "LocalWorkerConnection", "worker_connection"]
