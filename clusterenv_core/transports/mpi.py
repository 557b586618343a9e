"""The MPI backend: workers are MPI ranks, reached with mpi4py buffer messages.

``backend="mpi"`` needs ``mpi4py`` (tested with MPICH 5 from the ``mpich`` wheel). Only this module
imports it, and only when a pool or a worker uses it; importing mpi4py initializes MPI.

Launch modes
------------
The mode is chosen when the pool starts (``launch="auto"``, the default):

- **spawn** -- ``COMM_WORLD`` has one rank (plain ``python train.py``): the learner spawns
  ``num_workers`` ranks with ``MPI.COMM_SELF.Spawn(sys.executable, ["-m", "clusterenv_core.worker",
  "mpi", "spawn"])`` and talks to them over the intercommunicator. Every pool spawns its own ranks.
  With MPICH the first spawn starts MPICH's process manager (``mpiexec``, "singleton init"); the
  backend finds it next to the interpreter or on ``PATH`` and starts it in a session of its own
  (``isolate=True``) so that a worker rank that dies cannot take the learner down with it.
- **world** -- ``COMM_WORLD`` has more than one rank: rank 0 is the learner and every other rank is
  a worker (worker ``w`` is rank ``w + 1``; ``num_workers`` must equal ``size - 1``). A worker rank
  gets there in one of two ways, and both may be mixed in one job:

  - MPMD: ``mpiexec -n 1 python train.py : -n W python -m clusterenv_core.worker`` -- the ranks
    run the worker program, which waits for rank 0 to send them their env factories.
  - SPMD: ``mpiexec -n W+1 python train.py`` -- every rank runs the script; on a rank above 0,
    constructing the env (``EnvPool``/``ClusterVecEnv``) turns the process into a worker that serves
    rank 0 until it closes the pool, then finalizes MPI and exits with code 0 without running the
    rest of the script (it leaves through C ``exit()``: none of the script's ``finally`` blocks or
    ``atexit`` handlers run there). Code before the env's construction runs on every rank.

  So the learner never needs to know which: rank 0 is the learner, other ranks are workers whether
  they run the worker program or the script. ``launch="spawn"`` forces spawning from every rank
  that creates a pool (e.g. several learners in one job); ``launch="world"`` insists on a world.
  One pool per world job: its worker ranks exit when it closes.

Hot path
--------
Each side keeps its batch buffers in one private block. A step is two messages per worker, built
from derived datatypes (``hindexed`` over bytes) created once at ``attach``: the learner sends the
worker's action rows of every action field in one message (the step request itself), and the worker
answers with one message holding a 16-byte header and its result rows of every result field; the
learner posts that receive before sending, so the rows land directly in its buffers. Final
observations ride along only when an env of the block finished. Nothing on the hot path is pickled;
a step whose reply is not ``("ok", None)`` (non-empty infos, errors) sends the pickled reply in a
third message, whose size the header announces. Control messages are pickled.

Waiting
-------
No MPI call blocks: every wait tests its request or probe (``Test``/``Improbe``) under a deadline.
MPICH's own blocking calls spin, and on a busy host a spinning or timer-napping waiter loses to a
kernel wake-up, so peers on the learner's host also share a *doorbell*: an abstract Unix socket
(no file anywhere) on which the sender writes one byte after its MPI sends and the receiver sleeps
in ``poll()``. MPI still carries all data; the doorbell only says "look now", and its end-of-file
says the peer process is gone, at once. An idle pool costs no CPU. Peers on other hosts poll: a
spin of ``spin`` seconds (learner) or ``worker_spin`` (workers), then naps doubling from 20 us up
to ``max_sleep``/``worker_max_sleep``, so a worker idle while the learner trains wakes about once a
millisecond instead of burning a core (set ``worker_spin=0`` on oversubscribed nodes). Every
``liveness_interval`` a wait also checks that the peer still exists (pids on the same host, and in
spawn mode MPICH's process manager).

Faults (MPICH 5.0.2, observed)
------------------------------
- An env raising on a worker rank: :class:`~clusterenv_core.errors.EnvError` with the remote
  traceback; the pool stays usable and closeable, as with the local backend.
- A spawned worker rank dying (SIGKILL, segfault): MPICH's process manager kills every other
  spawned rank of the process (all its MPI pools) and exits. By default it would also SIGKILL the learner's whole process group
  (the learner, the shell that started it); ``isolate=True`` (the default) starts the manager in a
  session of its own, so only its ranks go. The learner gets
  :class:`~clusterenv_core.errors.WorkerLostError` at once when the rank was on its host (the
  doorbell closes), else within ``liveness_interval`` (the manager's exit). Afterwards this process
  cannot spawn MPI workers again and leaves without ``MPI_Finalize`` (which would crash with the
  manager gone).
- A world worker rank dying (``mpiexec`` or ``srun``): the launcher ends the whole job, learner
  included -- hydra SIGKILLs every rank, with or without ``-disable-auto-cleanup`` (which only sends
  a SIGUSR1 first). The learner may still see a ``WorkerLostError`` (a same-host doorbell closes
  first) but is killed moments later: checkpoint. This is MPI's fail-stop model.
- A hanging env: :class:`~clusterenv_core.errors.WorkerTimeoutError` after the pool's ``timeout``.
  At ``close`` a stuck spawned rank on the learner's host is killed (MPICH then ends the rest of
  that spawn); a stuck world rank cannot be killed alone, so ``close`` returns and the learner calls
  ``MPI_Abort`` at exit rather than wait in ``MPI_Finalize`` forever.
- The learner dying: spawned ranks are killed by the process manager when the learner's
  connection drops; world ranks by the launcher. Worker ranks on the learner's host also leave by
  themselves when its doorbell closes or its pid disappears. A learner that raises closes its pools
  at exit (``atexit``), so its ranks exit with code 0.
- A learner that never creates its pool in an MPMD launch would leave the worker ranks in
  ``MPI_Init``/the handshake: they give up after ``CLUSTERENV_MPI_CONNECT_TIMEOUT`` seconds (600),
  which ends the job.

Exit
----
``close()`` ends every worker: spawned ranks finalize and exit at once; world ranks finalize and
then wait, idle, inside ``MPI_Finalize`` until the learner finalizes (MPICH's ``MPI_Finalize``
synchronizes the whole job), then exit with code 0. In spawn mode, when this module is the first
to import mpi4py, it finalizes MPI itself at exit (``mpi4py.rc.finalize = False``) so that it can
skip finalization after a worker loss.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import faulthandler
import os
import pickle
import secrets
import select
import shlex
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
import weakref
from typing import Any

import numpy as np

from clusterenv_core.buffers import BatchBuffers, BatchSpec, Field, field_views, fields_nbytes
from clusterenv_core.errors import ClusterEnvError, WorkerLostError, WorkerTimeoutError
from clusterenv_core.launch import launched_by_mpi
from clusterenv_core.protocol import PROGRESS, STEP, dumps
from clusterenv_core.transports.base import Transport, WorkerConnection

# Message tags; the range keeps clear of small tags a user's own messages would use.
_TAG_CONTROL = 7101  # learner -> worker: a pickled control message
_TAG_STEP = 7102  # learner -> worker: the block's action rows; this is the step request
_TAG_REPLY = 7103  # worker -> learner: the pickled reply to a control message
_TAG_RESULT = 7104  # worker -> learner: header and result rows of a step
_TAG_PAYLOAD = 7105  # worker -> learner: the pickled step reply, when it is not ("ok", None)
_TAG_ARRAYS = 7106  # either way: the arrays of a region (policy weights, rollout segments)
_TAG_HELLO = 7107  # worker -> learner, once: pid and host
_TAG_CONFIG = 7108  # learner -> worker, once: its index, the learner's pid and host, polling
_TAG_BELL = 7109  # worker -> learner, once: whether it connected to the learner's doorbell

_HEADER = 16  # bytes: int64 length of the pickled reply that follows (0: "ok", None), int64 spare
_ALIGN = 64
_OK_NONE = ("ok", None)
# Control operations that write the worker's result rows (observations): their reply is followed by
# the rows, as a step's is. The local backend needs no such thing: its buffers are shared.
_ROW_OPS = frozenset({"reset", "rollout"})
_MIN_NAP = 20e-6
_RUNG_SPIN = 50e-6  # after a ring, poll this long without sleeping: the message is on its way
_SLOW_MESSAGE_SLEEP = 1e-3  # first sleep when a rung message does not show within _RUNG_SPIN
_RING_FLAGS = int(socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
_CLOSED_GRACE = 1.0  # how long messages may trail the close of the sender's doorbell
_ABORT_REPORT_SECONDS = 0.3  # before MPI_Abort at exit: time for the launcher to forward the reason
_ARRAYS_TIMEOUT = 60.0
_START_TIMEOUT = 60.0  # at least this long for ranks to start (interpreters, imports): slow is not stuck
# Environment variables set by process managers for the processes they launch.
CONNECT_TIMEOUT_VARIABLE = "CLUSTERENV_MPI_CONNECT_TIMEOUT"
_DEFAULT_CONNECT_TIMEOUT = 600.0

_HOST = socket.gethostname()


class _State:
    """Process-wide MPI state of this module."""

    MPI: Any = None
    owns_finalize = False  # we set mpi4py.rc.finalize = False and finalize at exit ourselves
    world_used = False  # the world's worker ranks served a pool (they exit when it closes)
    pm_started = False  # MPICH's singleton process manager was started by our first spawn
    pm_pid: int | None = None
    pm_exited = False
    finalize_unsafe = False  # MPI_Finalize would crash (process manager gone)
    abort_at_exit = ""  # why: a world rank could not be closed, so MPI_Finalize would wait for it forever
    live: weakref.WeakSet = weakref.WeakSet()


def _mpi(worker: bool = False) -> Any:
    """mpi4py's MPI module, imported (MPI initialized) on first use with this module's settings."""
    if _State.MPI is not None:
        return _State.MPI
    import mpi4py

    watchdog = False
    if "mpi4py.MPI" not in sys.modules:
        if worker:
            # Worker ranks are ours and single-threaded.
            mpi4py.rc.thread_level = "serialized"
        elif not launched_by_mpi():
            # A singleton that may spawn: finalize ourselves, so a lost worker can skip it.
            mpi4py.rc.finalize = False
            _State.owns_finalize = True
        elif _connect_timeout() > 0:
            # The learner of an MPI job waits in MPI_Init (in C) for every rank; a rank whose program
            # died before reaching MPI must not leave it there forever.
            faulthandler.dump_traceback_later(_connect_timeout(), exit=True)
            watchdog = True
    try:
        from mpi4py import MPI
    finally:
        if watchdog:
            faulthandler.cancel_dump_traceback_later()

    _State.MPI = MPI
    if not worker:
        atexit.register(_at_exit)
    return MPI


def _at_exit() -> None:
    """Close the pools still open, then finalize MPI when that is safe (learner side)."""
    for transport in list(_State.live):
        try:
            transport._close_at_exit()
        except Exception:
            pass
    MPI = _State.MPI
    if MPI is None or MPI.Is_finalized():
        return
    if _State.abort_at_exit:
        _flush()
        print(
            f"clusterenv: {_State.abort_at_exit}; aborting the MPI job instead of waiting for it forever in MPI_Finalize",
            file=sys.stderr,
            flush=True,
        )
        # The launcher forwards our output through its proxies and stops forwarding once it hears
        # of the abort: give it a moment to pass on why the job ends.
        time.sleep(_ABORT_REPORT_SECONDS)
        MPI.COMM_WORLD.Abort(1)
    if _State.finalize_unsafe or _pm_exited():
        if not _State.owns_finalize:
            # mpi4py would call MPI_Finalize after us and crash: end the process here instead.
            _flush()
            print(
                "clusterenv: MPI's process manager ended after a lost worker; exiting without MPI_Finalize",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
        return
    if _State.owns_finalize:
        MPI.Finalize()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


# -- helpers ----------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return True


def _pm_exited() -> bool:
    """Whether the singleton process manager our first spawn started has ended (reaping it)."""
    if _State.pm_exited or _State.pm_pid is None:
        return _State.pm_exited
    try:
        pid, _ = os.waitpid(_State.pm_pid, os.WNOHANG)
        exited = pid != 0
    except ChildProcessError:
        exited = not _pid_alive(_State.pm_pid)
    if exited:
        _State.pm_exited = True
        _State.finalize_unsafe = True
    return exited


def _address(buffer: Any) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def _row_bytes(array: np.ndarray) -> int:
    return array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))


def _block_type(MPI: Any, blocks: list[tuple[int, int]]) -> Any:
    """A committed datatype of the ``(displacement, length)`` byte ranges, in order."""
    blocks = [(offset, length) for offset, length in blocks if length > 0]
    datatype = MPI.BYTE.Create_hindexed([length for _, length in blocks], [offset for offset, _ in blocks])
    return datatype.Commit()


def _result_arrays(buffers: BatchBuffers) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The arrays a step returns, in message order: always sent, and sent when an episode ended."""
    return [*buffers.obs, buffers.rewards, buffers.terminated, buffers.truncated], list(buffers.final_obs)


def _poll(ready, timeout: float, spin: float, max_sleep: float, check=None, interval: float = 0.25) -> bool:
    """Call ``ready()`` until it is true (then True) or ``timeout`` passes (then False): spin for
    ``spin`` seconds, then sleep with doubling naps up to ``max_sleep``; ``check()`` runs every
    ``interval`` seconds and may raise."""
    now = time.perf_counter()
    deadline, spin_end, next_check = now + timeout, now + spin, now + interval
    nap = _MIN_NAP
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


class _PeerGone(Exception):
    """The process at the other end of a doorbell exited."""


class _Doorbell:
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
        """Like :func:`_poll`, sleeping in the kernel until the peer rings; :class:`_PeerGone` when
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
                if ready() or _poll(ready, spin, spin, max_sleep):
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
        if _poll(ready, min(remaining, _CLOSED_GRACE), 0.0, max_sleep, check, 0.01):
            return True
        raise _PeerGone

    def close(self) -> None:
        self.sock.close()


class _Probe:
    """A matched probe for one source and tag, usable as ``ready()`` of :func:`_poll`."""

    __slots__ = ("comm", "source", "tag", "status", "message")

    def __init__(self, MPI: Any, comm: Any, source: int, tag: int) -> None:
        self.comm, self.source, self.tag = comm, source, tag
        self.status = MPI.Status()
        self.message = None

    def __call__(self) -> bool:
        self.message = self.comm.Improbe(self.source, self.tag, self.status)
        return self.message is not None


# -- learner side -----------------------------------------------------------------------------------


def _find_mpiexec() -> str | None:
    """MPICH's mpiexec for singleton init: the one next to this interpreter (the mpich wheel), else PATH's."""
    beside = os.path.join(sys.prefix, "bin", "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


@contextlib.contextmanager
def _process_manager(mpiexec: str | None, isolate: bool):
    """Around the first spawn of a singleton MPICH process: make MPICH find its ``mpiexec`` through a
    shim that records the process manager's pid and (``isolate``) starts it in a new session.

    MPICH starts ``mpiexec`` from ``PATH`` when a singleton first spawns. When a spawned rank dies,
    that process manager kills its process group; in the learner's group that is the learner itself
    and the shell that started it. In a session of its own it only takes its own ranks down.
    """
    MPI = _State.MPI
    if _State.pm_started or MPI.get_vendor()[0] != "MPICH" or launched_by_mpi():
        yield
        return
    real = mpiexec or _find_mpiexec()
    if real is None:
        raise ClusterEnvError(
            "backend='mpi' spawns its workers through MPICH's mpiexec, which was found neither next to "
            f"{sys.executable} nor on PATH: install the mpich wheel (pip install mpich), put mpiexec on PATH, "
            "pass mpiexec=<path>, or launch the job with mpiexec"
        )
    directory = tempfile.mkdtemp(prefix="clusterenv-mpiexec-")
    pid_file = os.path.join(directory, "pid")
    starter = "import os, sys\n" + ("try:\n    os.setsid()\nexcept OSError:\n    pass\n" if isolate else "")
    starter += "os.execv(sys.argv[1], sys.argv[1:])\n"
    shim = os.path.join(directory, "mpiexec")
    with open(shim, "w") as file:
        file.write(
            "#!/bin/sh\n"
            f"echo $$ > {shlex.quote(pid_file)}\n"
            f"exec {shlex.quote(sys.executable)} -S -c {shlex.quote(starter)} {shlex.quote(real)} \"$@\"\n"
        )
    os.chmod(shim, 0o755)
    saved = {name: os.environ.get(name) for name in ("PATH", "PYTHONPATH")}
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PATH"] = os.pathsep.join(filter(None, [directory, saved["PATH"]]))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, saved["PYTHONPATH"]]))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        try:
            with open(pid_file) as file:
                _State.pm_pid = int(file.read().strip())
            _State.pm_started = True
        except (OSError, ValueError):
            pass
        shutil.rmtree(directory, ignore_errors=True)


class MPITransport(Transport):
    """Learner side of the MPI backend (see the module documentation for launch modes).

    :param launch: ``"auto"`` (spawn when ``COMM_WORLD`` has one rank, else world), ``"spawn"`` or ``"world"``
    :param python: interpreter of spawned workers (default: this one)
    :param spawn_info: MPI info keys for ``Spawn`` (e.g. ``{"hosts": "node1,node2"}``)
    :param mpiexec: MPICH's ``mpiexec`` for the first spawn of a singleton (default: found)
    :param isolate: start that process manager in its own session, so a dying worker cannot kill the learner
    :param spin: seconds the learner polls a reply without sleeping
    :param max_sleep: longest nap of the learner while it polls
    :param worker_spin: seconds a worker polls for the next message without sleeping
    :param worker_max_sleep: longest nap of an idle worker
    :param liveness_interval: seconds between checks that a silent peer still exists
    :param doorbell: wake peers on the learner's host through a Unix socket instead of polling
    """

    shares_memory = False

    def __init__(
        self,
        launch: str = "auto",
        python: str | None = None,
        spawn_info: dict[str, str] | None = None,
        mpiexec: str | None = None,
        isolate: bool = True,
        spin: float = 50e-6,
        max_sleep: float = 200e-6,
        worker_spin: float = 1e-3,
        worker_max_sleep: float = 1e-3,
        liveness_interval: float = 0.25,
        doorbell: bool = True,
    ) -> None:
        if launch not in ("auto", "spawn", "world"):
            raise ValueError(f"launch must be 'auto', 'spawn' or 'world', got {launch!r}")
        for name, value in (
            ("spin", spin),
            ("max_sleep", max_sleep),
            ("worker_spin", worker_spin),
            ("worker_max_sleep", worker_max_sleep),
            ("liveness_interval", liveness_interval),
        ):
            if not isinstance(value, (int, float)) or value < 0 or value == float("inf"):
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        self.launch = launch
        self.python = python or sys.executable
        self.spawn_info = dict(spawn_info or {})
        self.mpiexec = mpiexec
        self.isolate = bool(isolate)
        self.spin, self.max_sleep = float(spin), max(float(max_sleep), _MIN_NAP)
        self.worker_spin, self.worker_max_sleep = float(worker_spin), max(float(worker_max_sleep), _MIN_NAP)
        self.liveness_interval = max(float(liveness_interval), 0.01)
        self.doorbell = bool(doorbell)
        self._bells: list[_Doorbell | None] = []
        self.failed: set[int] = set()
        self.mode: str | None = None
        self.comm: Any = None
        self.ranks: list[int] = []
        self.pids: list[int] = []
        self.hosts: list[str] = []
        self._closed = False
        self._awaiting: set[int] = set()  # workers whose reply to a control message is unread
        self._closing: set[int] = set()  # workers sent "close"
        self._closed_ok: set[int] = set()  # workers that answered "close"
        self._last_op: list[str] = []  # per worker: the last control operation sent
        self._sends: list[list] = []  # per worker: (request, buffer) of sends not known complete
        self._result_requests: list = []
        self._action_requests: list = []
        self._result_messages: list = []
        self._action_messages: list = []
        self._datatypes: list = []
        self._memory: bytearray | None = None
        self._headers: np.ndarray | None = None
        self._regions: list[bytearray] = []

    @property
    def num_workers(self) -> int:
        return len(self.ranks)

    def default_num_workers(self) -> int | None:
        """The number of worker ranks a world launch provides (``None`` in spawn mode)."""
        MPI = _mpi()
        size = MPI.COMM_WORLD.Get_size()
        if self.launch == "spawn" or (self.launch == "auto" and size == 1):
            return None
        return size - 1

    # -- start ------------------------------------------------------------------------------------

    def start(self, num_workers: int, timeout: float) -> None:
        timeout = max(timeout, _START_TIMEOUT)
        MPI = _mpi()
        world = MPI.COMM_WORLD
        mode = self.launch
        if mode == "auto":
            mode = "spawn" if world.Get_size() == 1 else "world"
        if mode == "world":
            if world.Get_size() == 1:
                raise ValueError(
                    "launch='world' needs worker ranks: run under mpiexec with more than one rank "
                    "(e.g. mpiexec -n 1 python train.py : -n 4 python -m clusterenv_core.worker)"
                )
            if world.Get_rank() != 0:
                _serve_as_worker()  # SPMD: this rank becomes a worker and never returns
            self._start_world(num_workers, timeout)
        else:
            self._start_spawn(num_workers, timeout)
        _State.live.add(self)

    def _start_spawn(self, num_workers: int, timeout: float) -> None:
        MPI = _State.MPI
        if _pm_exited():
            raise ClusterEnvError(
                "MPI's process manager of this process ended after an earlier worker loss; "
                "this process cannot spawn MPI workers anymore (start a new process)"
            )
        info = MPI.Info.Create()
        try:
            info.Set("wdir", os.getcwd())
            for key, value in self.spawn_info.items():
                info.Set(str(key), str(value))
            args = ["-m", "clusterenv_core.worker", "mpi", "spawn"]
            with _process_manager(self.mpiexec, self.isolate):
                self.comm = MPI.COMM_SELF.Spawn(self.python, args, maxprocs=num_workers, info=info)
        finally:
            info.Free()
        self.mode = "spawn"
        self._handshake(list(range(num_workers)), timeout)

    def _start_world(self, num_workers: int, timeout: float) -> None:
        MPI = _State.MPI
        if _State.world_used:
            raise ClusterEnvError(
                "the worker ranks of this MPI job already served a pool and have exited: a world launch "
                "(mpiexec with several ranks) serves one pool; use launch='spawn' for more"
            )
        _State.world_used = True
        self.comm = MPI.COMM_WORLD
        self.mode = "world"
        available = self.comm.Get_size() - 1
        self._handshake(list(range(1, available + 1)), timeout)
        if num_workers != available:
            for worker in range(available):
                self.send(worker, ("close", None))
            for worker in range(available):
                try:
                    self.recv(worker, 5.0)
                except ClusterEnvError:
                    pass
            self.close(5.0)
            raise ValueError(
                f"this MPI job has {available} worker ranks (COMM_WORLD size {available + 1}) but the pool asked "
                f"for num_workers={num_workers}: pass num_workers={available}"
            )

    def _handshake(self, ranks: list[int], timeout: float) -> None:
        """Learn each worker's pid and host, then tell it its index and how to poll."""
        MPI = _State.MPI
        self.ranks = ranks
        count = len(ranks)
        self.pids, self.hosts = [0] * count, [""] * count
        self._sends = [[] for _ in range(count)]
        self._last_op = [""] * count
        self._result_requests = [None] * count
        self._action_requests = [None] * count
        for worker, rank in enumerate(ranks):
            probe = _Probe(MPI, self.comm, rank, _TAG_HELLO)
            if not _poll(probe, timeout, self.spin, self.max_sleep, self._check_manager, self.liveness_interval):
                self.failed.add(worker)
                raise WorkerTimeoutError(
                    f"worker {worker} (MPI rank {rank}) did not start within {timeout:g} s"
                    + (" (is its rank running python -m clusterenv_core.worker?)" if self.mode == "world" else "")
                )
            hello = self._receive_pickled(probe)
            self.pids[worker], self.hosts[worker] = hello["pid"], hello["host"]
        self._bells = [None] * count
        listener = name = None
        if self.doorbell and _HOST in self.hosts and sys.platform.startswith("linux"):
            # An abstract socket: no file anywhere, gone when closed.
            name = f"\0clusterenv-mpi-{os.getpid()}-{secrets.token_hex(8)}"
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(name)
            listener.listen(count)
        config = {
            "learner_pid": os.getpid(),
            "learner_host": _HOST,
            "spin": self.worker_spin,
            "max_sleep": self.worker_max_sleep,
            "liveness_interval": self.liveness_interval,
        }
        try:
            for worker, rank in enumerate(ranks):
                bell = name if self.hosts[worker] == _HOST else None
                data = dumps(dict(config, worker=worker, doorbell=bell))
                self._sends[worker].append((self.comm.Isend(data, dest=rank, tag=_TAG_CONFIG), data))
            if listener is not None:
                self._accept_doorbells(listener, timeout)
        finally:
            if listener is not None:
                listener.close()

    def _accept_doorbells(self, listener: socket.socket, timeout: float) -> None:
        """Each worker on this host says whether it connected; accept those that did, known by pid."""
        MPI = _State.MPI
        expected = 0
        for worker, rank in enumerate(self.ranks):
            if self.hosts[worker] != _HOST:
                continue
            probe = _Probe(MPI, self.comm, rank, _TAG_BELL)
            if not _poll(probe, timeout, self.spin, self.max_sleep, self._check_manager, self.liveness_interval):
                self.failed.add(worker)
                raise WorkerTimeoutError(f"worker {worker} (MPI rank {rank}) did not finish starting within {timeout:g} s")
            expected += bool(self._receive_pickled(probe))
        by_pid = {pid: worker for worker, pid in enumerate(self.pids) if self.hosts[worker] == _HOST}
        listener.settimeout(timeout)
        while expected > 0:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # those workers poll instead
            credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid = struct.unpack("3i", credentials)[0]
            worker = by_pid.pop(pid, None)
            if worker is None:  # not one of ours
                sock.close()
                continue
            self._bells[worker] = _Doorbell(sock, sleep_in_recv=False)
            expected -= 1

    # -- control messages -------------------------------------------------------------------------

    def send(self, worker: int, message: Any) -> None:
        if self._closed:
            raise WorkerLostError(f"worker {worker}: the MPI transport is closed")
        data = dumps(message)
        pending = self._sends[worker]
        if pending:
            pending[:] = [(request, buffer) for request, buffer in pending if not request.Test()]
        pending.append((self.comm.Isend(data, dest=self.ranks[worker], tag=_TAG_CONTROL), data))
        bell = self._bells[worker]
        if bell is not None:
            bell.ring()
        self._awaiting.add(worker)
        self._last_op[worker] = op = message[0]
        if op == "close":
            self._closing.add(worker)

    def recv(self, worker: int, timeout: float) -> Any:
        if self._closed:
            raise WorkerLostError(f"worker {worker}: the MPI transport is closed")
        if self._result_requests[worker] is not None:
            return self.recv_step(worker, timeout)
        probe = _Probe(_State.MPI, self.comm, self.ranks[worker], _TAG_REPLY)
        self._wait(worker, probe, timeout)
        reply = self._receive_pickled(probe)
        if reply[0] == PROGRESS:  # an interim reply: no rows, the real one follows
            self._received(worker)
            return reply
        if self._last_op[worker] in _ROW_OPS and self._result_messages:
            rank = self.ranks[worker]
            self._wait(worker, self.comm.Irecv(self._result_messages[worker], source=rank, tag=_TAG_RESULT).Test, timeout)
        self._received(worker)
        self._awaiting.discard(worker)
        if worker in self._closing:
            self._closed_ok.add(worker)
        return reply

    def _receive_pickled(self, probe: _Probe) -> Any:
        buffer = bytearray(probe.status.Get_count(_State.MPI.BYTE))
        probe.message.Recv(buffer)
        return pickle.loads(buffer)

    def _wait(self, worker: int, ready, timeout: float, bell: bool = True) -> None:
        """Wait for ``ready()`` (a receive the worker rings for, unless ``bell`` is false)."""
        if ready():
            return
        check = functools.partial(self._check_alive, worker)
        doorbell = self._bells[worker] if bell else None
        try:
            if doorbell is not None:
                ok = doorbell.wait(ready, timeout, self.max_sleep, check, self.liveness_interval)
            else:
                ok = _poll(ready, timeout, self.spin, self.max_sleep, check, self.liveness_interval)
        except _PeerGone:
            self._check_alive(worker)  # names the cause when it can
            raise self._dead(worker) from None
        if not ok:
            self.failed.add(worker)
            raise WorkerTimeoutError(f"worker {worker} ({self._describe(worker)}) did not answer within {timeout:g} s")

    def _received(self, worker: int) -> None:
        bell = self._bells[worker]
        if bell is not None:
            bell.received()

    def _describe(self, worker: int) -> str:
        return f"MPI rank {self.ranks[worker]}, pid {self.pids[worker]} on {self.hosts[worker]}"

    def _check_manager(self) -> None:
        if self.mode == "spawn" and _pm_exited():
            raise self._lost_all("MPI's process manager ended (a spawned worker rank died and MPICH ended its job)")

    def _check_alive(self, worker: int) -> None:
        if self.hosts[worker] == _HOST and not _pid_alive(self.pids[worker]):
            raise self._dead(worker)
        self._check_manager()

    def _dead(self, worker: int) -> WorkerLostError:
        why = "died"
        if self.mode == "spawn":
            # MPICH ends the spawned ranks, its process manager exits: no more spawns, no MPI_Finalize.
            if _pm_exited():
                why += " (MPICH's process manager ended every spawned rank of this process after a rank died)"
            _State.finalize_unsafe = True
        self.failed.add(worker)
        return WorkerLostError(f"worker {worker} ({self._describe(worker)}) {why}")

    def _lost_all(self, why: str) -> WorkerLostError:
        self.failed.update(range(self.num_workers))
        return WorkerLostError(f"all {self.num_workers} MPI workers of this pool are lost: {why}")

    # -- buffers and steps ------------------------------------------------------------------------

    def share_buffers(self, spec: BatchSpec, blocks: list[range]) -> BatchBuffers:
        MPI = _State.MPI
        count = len(blocks)
        header_bytes = -(-_HEADER * count // _ALIGN) * _ALIGN
        self._memory = memory = bytearray(header_bytes + spec.nbytes())
        buffers = BatchBuffers(spec, memoryview(memory)[header_bytes:])
        self._headers = np.frombuffer(memory, dtype=np.int64, count=2 * count).reshape(count, 2)
        base = _address(memory)
        always, when_done = _result_arrays(buffers)
        self._result_messages, self._action_messages = [], []
        for worker, block in enumerate(blocks):

            def rows(arrays: list[np.ndarray], block: range = block) -> list[tuple[int, int]]:
                return [
                    (array.ctypes.data - base + block.start * _row_bytes(array), len(block) * _row_bytes(array))
                    for array in arrays
                ]

            results = _block_type(MPI, [(_HEADER * worker, _HEADER), *rows(always), *rows(when_done)])
            actions = _block_type(MPI, rows(buffers.actions))
            self._datatypes += [results, actions]
            self._result_messages.append([memory, 1, results])
            self._action_messages.append([memory, 1, actions])
        return buffers

    def send_step(self, worker: int) -> None:
        if self._closed:
            raise WorkerLostError(f"worker {worker}: the MPI transport is closed")
        rank = self.ranks[worker]
        comm = self.comm
        # The receive goes first, so the result rows land directly in the buffers.
        self._result_requests[worker] = comm.Irecv(self._result_messages[worker], source=rank, tag=_TAG_RESULT)
        self._action_requests[worker] = comm.Isend(self._action_messages[worker], dest=rank, tag=_TAG_STEP)
        bell = self._bells[worker]
        if bell is not None:
            bell.ring()

    def recv_step(self, worker: int, timeout: float) -> Any:
        request = self._result_requests[worker]
        if request is None:
            raise ClusterEnvError(f"recv_step without send_step for worker {worker}")
        self._wait(worker, request.Test, timeout)
        self._result_requests[worker] = None
        self._wait(worker, self._action_requests[worker].Test, timeout, bell=False)  # done: the worker answered
        self._action_requests[worker] = None
        if self._headers[worker, 0] == 0:
            self._received(worker)
            return _OK_NONE
        probe = _Probe(_State.MPI, self.comm, self.ranks[worker], _TAG_PAYLOAD)
        self._wait(worker, probe, timeout)
        self._received(worker)
        return self._receive_pickled(probe)

    # -- regions (worker-side inference) ----------------------------------------------------------

    def share_region(self, nbytes: int) -> tuple[Any, memoryview]:
        region = bytearray(nbytes)
        self._regions.append(region)
        return len(self._regions) - 1, memoryview(region)

    def send_arrays(self, worker: int, arrays: list) -> None:
        rank = self.ranks[worker]
        for array in arrays:
            data = np.ascontiguousarray(array)
            request = self.comm.Isend(data, dest=rank, tag=_TAG_ARRAYS)
            bell = self._bells[worker]
            if bell is not None:
                bell.ring()
            self._wait(worker, request.Test, _ARRAYS_TIMEOUT, bell=False)

    def recv_arrays(self, worker: int, arrays: list, timeout: float) -> None:
        for array in arrays:
            target = array if array.flags.c_contiguous else np.empty_like(array)
            self._wait(worker, self.comm.Irecv(target, source=self.ranks[worker], tag=_TAG_ARRAYS).Test, timeout)
            self._received(worker)
            if target is not array:
                array[...] = target

    # -- end --------------------------------------------------------------------------------------

    def _close_at_exit(self) -> None:
        """Interpreter exit with the pool still open: ask the workers to close, as the pool would."""
        if self._closed or self.comm is None:
            return
        for worker in range(self.num_workers):
            if worker in self.failed or worker in self._closing:
                continue
            try:
                if worker in self._awaiting or self._result_requests[worker] is not None:
                    self.recv(worker, 5.0)
                self.send(worker, ("close", None))
            except ClusterEnvError:
                pass
        for worker in sorted(self._closing - self._closed_ok - self.failed):
            try:
                self.recv(worker, 5.0)
            except ClusterEnvError:
                pass
        self.close(5.0)

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        _State.live.discard(self)
        if self.comm is None:
            return
        deadline = time.monotonic() + timeout
        for request in self._result_requests:
            if request is not None:
                try:
                    request.Cancel()
                    _poll(request.Test, 1.0, 0.0, 1e-3)
                except Exception:
                    pass
        unclosed = [worker for worker in range(self.num_workers) if worker not in self._closed_ok]
        if self.mode == "spawn":
            if unclosed:
                # Stuck or lost ranks: kill those on this host; MPICH then ends the rest of the spawn.
                for worker in unclosed:
                    if self.hosts[worker] == _HOST and _pid_alive(self.pids[worker]):
                        try:
                            os.kill(self.pids[worker], signal.SIGKILL)
                        except OSError:
                            pass
                _State.finalize_unsafe = True
                try:
                    self.comm.Free()
                except Exception:
                    pass
            else:
                # Every worker answered "close" and disconnects too (a collective call).
                self.comm.Disconnect()
            # Closed workers finalize and exit at once; wait for those on this host.
            for worker in range(self.num_workers):
                if self.hosts[worker] != _HOST:
                    continue
                while _pid_alive(self.pids[worker]) and time.monotonic() < deadline:
                    time.sleep(0.01)
        elif unclosed:
            # A world rank that did not close would keep MPI_Finalize waiting forever.
            ranks = ", ".join(str(self.ranks[worker]) for worker in unclosed)
            _State.abort_at_exit = f"worker rank(s) {ranks} did not close"
        for datatype in self._datatypes:
            try:
                datatype.Free()
            except Exception:
                pass
        self._datatypes = []
        self._result_requests = [None] * self.num_workers
        self._action_requests = [None] * self.num_workers
        self._sends = [[] for _ in range(self.num_workers)]
        for bell in self._bells:
            if bell is not None:
                bell.close()
        self._bells = [None] * self.num_workers


# -- worker side ------------------------------------------------------------------------------------


class MPIWorkerConnection(WorkerConnection):
    """Worker side of the MPI backend.

    :param comm: the communicator to the learner (the spawn intercommunicator or ``COMM_WORLD``)
    :param kind: ``"spawn"``, ``"mpmd"`` or ``"spmd"`` (how this rank became a worker)
    """

    def __init__(self, comm: Any, kind: str) -> None:
        MPI = _State.MPI
        self.comm, self.kind = comm, kind
        self.learner = 0
        data = dumps({"pid": os.getpid(), "host": _HOST})
        request = comm.Isend(data, dest=self.learner, tag=_TAG_HELLO)
        probe = _Probe(MPI, comm, self.learner, _TAG_CONFIG)
        _poll(probe, float("inf"), 0.0, 5e-3)
        buffer = bytearray(probe.status.Get_count(MPI.BYTE))
        probe.message.Recv(buffer)
        _poll(request.Test, float("inf"), 0.0, 5e-3)
        config = pickle.loads(buffer)
        self.bell: _Doorbell | None = None
        if config["doorbell"] is not None:
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(config["doorbell"])
                self.bell = _Doorbell(sock, sleep_in_recv=True)
            except OSError:
                pass  # poll instead (e.g. another network namespace)
            connected = dumps(self.bell is not None)
            _poll(comm.Isend(connected, dest=self.learner, tag=_TAG_BELL).Test, float("inf"), 0.0, 5e-3)
        self.index = config["worker"]
        self.learner_pid, self.learner_host = config["learner_pid"], config["learner_host"]
        self.spin, self.max_sleep = config["spin"], config["max_sleep"]
        self.liveness_interval = config["liveness_interval"]
        self.learner_gone = False
        self.ring_owed = False
        self.probe = _Probe(MPI, comm, self.learner, MPI.ANY_TAG)
        self.last_op = ""
        self.full_message = None
        self.datatypes: list = []
        self.regions: list[bytearray] = []

    def _check_learner(self) -> None:
        if self.learner_host == _HOST and not _pid_alive(self.learner_pid):
            self.learner_gone = True
            raise EOFError

    def _complete(self, request: Any) -> None:
        """Wait for one of our sends; a learner that disappears meanwhile ends the worker."""
        if not request.Test():
            # EOFError (learner gone) ends the worker loop; close() then exits.
            _poll(request.Test, float("inf"), self.spin, self.max_sleep, self._check_learner, self.liveness_interval)

    def _await(self, ready) -> None:
        """Wait for something the learner sends (and rings for); EOFError when the learner is gone."""
        bell = self.bell
        if bell is None:
            _poll(ready, float("inf"), self.spin, self.max_sleep, self._check_learner, self.liveness_interval)
            return
        ring_first, self.ring_owed = self.ring_owed, False
        try:
            bell.wait(ready, float("inf"), self.max_sleep, self._check_learner, self.liveness_interval, ring_first)
        except _PeerGone:
            self.learner_gone = True
            raise EOFError from None

    def _ring(self) -> None:
        if self.bell is not None:
            self.bell.ring()

    def _received(self) -> None:
        if self.bell is not None:
            self.bell.received()

    def recv(self) -> Any:
        probe = self.probe
        while True:
            if probe():
                if self.ring_owed:
                    self.ring_owed = False
                    self.bell.ring()
            else:
                try:
                    self._await(probe)
                except EOFError:
                    return None
            self._received()
            tag = probe.status.Get_tag()
            if tag == _TAG_STEP:
                probe.message.Recv(self.action_message)
                return STEP
            buffer = bytearray(probe.status.Get_count(_State.MPI.BYTE))
            probe.message.Recv(buffer)
            if tag == _TAG_CONTROL:
                message = pickle.loads(buffer)
                self.last_op = message[0]
                return message
            # Anything else (arrays of an interrupted exchange) is dropped.

    def send(self, message: Any) -> None:
        data = dumps(message)
        request = self.comm.Isend(data, dest=self.learner, tag=_TAG_REPLY)
        rows = None
        if self.last_op in _ROW_OPS and self.full_message is not None and message[0] != PROGRESS:
            self.header[0] = 0
            rows = self.comm.Isend(self.full_message, dest=self.learner, tag=_TAG_RESULT)
        self._ring()
        if rows is not None:
            self._complete(rows)
        self._complete(request)

    def attach(self, spec: BatchSpec, block: range) -> tuple[BatchBuffers, int]:
        MPI = _State.MPI
        local = BatchSpec(len(block), spec.observation_space, spec.action_space)
        self.memory = memory = bytearray(_ALIGN + local.nbytes())
        buffers = BatchBuffers(local, memoryview(memory)[_ALIGN:])
        self.header = np.frombuffer(memory, dtype=np.int64, count=2)
        base = _address(memory)

        def rows(arrays: list[np.ndarray]) -> list[tuple[int, int]]:
            return [(array.ctypes.data - base, array.nbytes) for array in arrays]

        always, when_done = _result_arrays(buffers)
        short = _block_type(MPI, [(0, _HEADER), *rows(always)])
        full = _block_type(MPI, [(0, _HEADER), *rows(always), *rows(when_done)])
        actions = _block_type(MPI, rows(buffers.actions))
        for datatype in self.datatypes:
            datatype.Free()
        self.datatypes = [short, full, actions]
        self.short_message, self.full_message = [memory, 1, short], [memory, 1, full]
        self.action_message = [memory, 1, actions]
        self.has_final = bool(when_done)
        # Byte views compared with zeros: a fifth of the cost of ndarray.any() on every step.
        self.terminated_bytes = memoryview(buffers.terminated).cast("B")
        self.truncated_bytes = memoryview(buffers.truncated).cast("B")
        self.no_flags = bytes(len(block))
        return buffers, 0

    def send_step(self, reply: Any) -> None:
        comm, learner = self.comm, self.learner
        data = None
        if reply[1] is None and reply[0] == "ok":
            self.header[0] = 0
        else:
            data = dumps(reply)
            self.header[0] = len(data)
        ended = self.has_final and (self.terminated_bytes != self.no_flags or self.truncated_bytes != self.no_flags)
        request = comm.Isend(self.full_message if ended else self.short_message, dest=learner, tag=_TAG_RESULT)
        payload = None if data is None else comm.Isend(data, dest=learner, tag=_TAG_PAYLOAD)
        if self.bell is not None:
            if request.Test() and (payload is None or payload.Test()):
                # Sent: ring when about to sleep, so the learner does not wake while this worker
                # still holds a core (with more processes than cores, that wake-up would wait).
                self.ring_owed = True
                return
            self.bell.ring()  # the sends need the learner's progress (a large message): now
        if payload is not None:
            self._complete(payload)
        self._complete(request)

    def map_region(self, handle: Any, fields: list[Field], num_envs: int, block: range) -> tuple[dict, int]:
        region = bytearray(fields_nbytes(fields, len(block)))
        self.regions.append(region)
        return field_views(fields, len(block), region), 0

    def send_arrays(self, arrays: list) -> None:
        for array in arrays:
            request = self.comm.Isend(np.ascontiguousarray(array), dest=self.learner, tag=_TAG_ARRAYS)
            self._ring()
            self._complete(request)

    def recv_arrays(self, arrays: list) -> None:
        for array in arrays:
            target = array if array.flags.c_contiguous else np.empty_like(array)
            self._await(self.comm.Irecv(target, source=self.learner, tag=_TAG_ARRAYS).Test)
            self._received()
            if target is not array:
                array[...] = target

    def close(self) -> None:
        """Leave MPI and end the process with code 0 (never returns)."""
        MPI = _State.MPI
        for datatype in self.datatypes:
            try:
                datatype.Free()
            except Exception:
                pass
        self.datatypes = []
        if self.bell is not None:
            self.bell.close()
        _flush()
        if not self.learner_gone:
            if self.kind == "spawn":
                # With the learner's Disconnect: MPICH's process manager treats an exit without it as a failure.
                self.comm.Disconnect()
            # World ranks wait here, idle, until the learner finalizes too.
            MPI.Finalize()
            _flush()
            # C exit(), not os._exit(): MPICH finishes leaving its process manager in an exit handler
            # (without it the manager counts the rank as failed); Python's own exit would run the
            # script's finally blocks and atexit handlers, which an SPMD worker must not.
            import ctypes

            ctypes.CDLL(None).exit(0)
        _flush()
        os._exit(0)


def _connect(kind: str) -> MPIWorkerConnection:
    """Become a worker: initialize MPI (waiting at most the connect timeout for the learner)."""
    if _in_main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the learner's to handle
    watchdog = kind != "spawn" and _connect_timeout() > 0
    if watchdog:
        # MPI_Init and the handshake block in C until the learner takes part; a learner that never
        # creates its pool must not leave this rank waiting forever.
        faulthandler.dump_traceback_later(_connect_timeout(), exit=True)
    try:
        MPI = _mpi(worker=True)
        if kind == "spawn":
            comm = MPI.Comm.Get_parent()
            if comm == MPI.COMM_NULL:
                raise SystemExit("clusterenv worker (mpi spawn): not started by MPI_Comm_spawn")
        else:
            comm = MPI.COMM_WORLD
            if comm.Get_size() == 1 or comm.Get_rank() == 0:
                raise SystemExit(
                    "clusterenv worker (mpi): run the worker program as ranks 1.. of an MPI job whose rank 0 is "
                    "the learner, e.g. mpiexec -n 1 python train.py : -n 4 python -m clusterenv_core.worker"
                )
        return MPIWorkerConnection(comm, kind)
    finally:
        if watchdog:
            faulthandler.cancel_dump_traceback_later()


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _connect_timeout() -> float:
    value = os.environ.get(CONNECT_TIMEOUT_VARIABLE, "")
    try:
        return float(value) if value else _DEFAULT_CONNECT_TIMEOUT
    except ValueError:
        return _DEFAULT_CONNECT_TIMEOUT


def _serve_as_worker() -> None:
    """SPMD: a rank above 0 that constructs a pool serves rank 0 instead, then exits."""
    from clusterenv_core.worker import serve

    connection = _connect("spmd")
    try:
        serve(connection)  # its close() finalizes MPI and exits
    finally:
        _flush()
        os._exit(0)


def worker_connection(argv: list[str]) -> MPIWorkerConnection:
    """Build the worker side from ``python -m clusterenv_core.worker [mpi [spawn]]``.

    Without arguments (MPMD launches) the rank serves rank 0 of ``COMM_WORLD``; ``spawn`` is what
    spawned ranks get and serves the parent.
    """
    kind = argv[0] if argv else "mpmd"
    if kind == "world":
        kind = "mpmd"
    if kind not in ("spawn", "mpmd"):
        raise SystemExit(f"clusterenv worker (mpi): unknown argument {kind!r}; expected nothing or 'spawn'")
    return _connect(kind)
