"""Benchmark of learner <-> worker wake-up / completion signalling mechanisms.

What it measures
----------------
A learner process drives W worker processes (fresh interpreters started with
``subprocess.Popen([sys.executable, __file__, "--worker", ...], pass_fds=...)``)
in lock-step rounds::

    learner: busy-work L us  ->  signal "go" to all W workers
    worker : wait for "go"   ->  busy-work K us  ->  signal "done"
    learner: wait until all W workers are done

For each mechanism and each (W, K, L) configuration it reports the round trip
(time from the learner's first "go" until the last "done" was observed; the
learner's own L us of work is *not* included) as mean and p99 in microseconds,
the achieved rounds/s (which *does* include L), and the CPU used by the learner
and by the workers during the run (as a fraction of one core).

It also measures *idle burn*: with the workers started and waiting, the learner
sleeps for one second without signalling; the CPU seconds consumed by all
workers in that second are reported (a mechanism that spins forever would show
~1 core per worker here).

Mechanisms (all share one memfd-backed mmap block for control words such as K
and the stop flag):

* ``socket``        - 1-byte send/recv over one AF_UNIX socketpair per worker;
                      learner does a blocking recv per worker in turn.
* ``socket-poll``   - same, but learner and workers wait with select.poll and a
                      finite timeout (what production code with timeouts does).
* ``pipe``          - two os.pipe()s per worker, os.write/os.read.
* ``semaphore``     - POSIX semaphores (ctypes, sem_init(pshared=1)) living in
                      the shared mapping: one "go" semaphore per worker, one
                      shared counting "done" semaphore; sem_post/sem_timedwait.
* ``futex-spinS``   - per-worker sequence counters in the shared block; the
                      waiter polls the counter from Python for up to S us, then
                      announces it is sleeping (flag word) and blocks in
                      FUTEX_WAIT with a 10 ms timeout.  The signaller bumps the
                      counter and only calls FUTEX_WAKE if the flag is set.
* ``futex-L200-W0`` - same, learner spins 200 us, workers do not spin.
* ``spin-yieldS``   - like futex-spinS but the spin loop calls os.sched_yield().
* ``...-aw``        - "always wake": the signaller calls FUTEX_WAKE after every
                      counter bump regardless of the flag.  This is race-free
                      (the kernel re-checks the word under the futex bucket
                      lock), so the waiter's timeout can be 100 ms, which
                      matters because every timeout wake-up costs ~0.1 ms CPU
                      on a VM (10 ms timeout => ~1% of a core per worker).

Lost wake-ups: the "set sleeping flag; re-check counter" (waiter) vs. "store
counter; load flag" (signaller) handshake is a store->load pattern that x86
may reorder (no full fence is available from pure Python), so the signaller
can miss the flag and skip FUTEX_WAKE.  The finite futex timeout bounds the
damage; every wait that ended in ETIMEDOUT but then found the counter changed
is counted as ``recovered`` and reported.

Run (default: W=2 and W=4, 2 s per configuration, < 3 minutes)::

    .venv/bin/python benchmarks/signalling.py
    .venv/bin/python benchmarks/signalling.py --quick          # smoke test
    .venv/bin/python benchmarks/signalling.py --workers 2 --seconds 1 \
        --only futex-spin50,semaphore

Results are printed as a table and written to benchmarks/results/signalling.json.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import time

# --------------------------------------------------------------------------
# Shared block layout (int32 word indices).  Every group of words written by a
# different process lives on its own 64-byte cache line (16 int32 words).
# --------------------------------------------------------------------------
LINE = 16  # int32 words per cache line
SHM_SIZE = 16384
CTRL_STOP = 0  # learner -> workers: exit when set
CTRL_K_US = 1  # learner -> workers: busy-work per round (us)


def go_line(i: int) -> int:  # written by learner (seq), worker (sleep flag)
    return LINE * (1 + 2 * i)


def done_line(i: int) -> int:  # written by worker (seq, stats), learner (flag)
    return LINE * (2 + 2 * i)


# offsets within a line
SEQ, SLEEP, READY, RECOVERED, TIMEOUTS = 0, 1, 2, 3, 4

SEM_BASE = 8192  # byte offset of the semaphore area
SEM_STRIDE = 64  # sizeof(sem_t) == 32 on x86_64 glibc; keep line-aligned


def sem_offset(j: int) -> int:
    return SEM_BASE + SEM_STRIDE * j


SEQ_MASK = 0x7FFFFFFF
FUTEX_TIMEOUT_S = 0.010
POLL_TIMEOUT_MS = 100
LEARNER_TIMEOUT_S = 5.0  # a round taking longer than this is an error

# --------------------------------------------------------------------------
# ctypes bindings: futex(2) via syscall(2), POSIX semaphores
# --------------------------------------------------------------------------
SYS_futex = 202  # x86_64
FUTEX_WAIT = 0  # NOT FUTEX_WAIT_PRIVATE: the word is shared between processes
FUTEX_WAKE = 1
ETIMEDOUT = 110
EAGAIN = 11
EINTR = 4


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
# Without argtypes ctypes would pass Python ints as 32-bit C ints and truncate
# the 64-bit futex address.
_syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
_FUTEX_TS = Timespec(0, int(FUTEX_TIMEOUT_S * 1e9))  # relative timeout
_FUTEX_TS_P = ctypes.addressof(_FUTEX_TS)


def make_timespec(seconds: float) -> tuple[Timespec, int]:
    ts = Timespec(int(seconds), int((seconds - int(seconds)) * 1e9))
    return ts, ctypes.addressof(ts)  # keep ts alive as long as the address


def futex_wait(addr: int, expected: int, ts_p: int = _FUTEX_TS_P) -> int:
    """Block while *addr == expected (at most the relative timeout *ts_p).
    Returns 0 (woken), or errno: EAGAIN (value already != expected),
    ETIMEDOUT, EINTR."""
    if _syscall(SYS_futex, addr, FUTEX_WAIT, expected, ts_p, None, 0) == 0:
        return 0
    return ctypes.get_errno()


def futex_wake(addr: int, n: int = 1) -> None:
    _syscall(SYS_futex, addr, FUTEX_WAKE, n, None, None, 0)


_sem_init = _libc.sem_init
_sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_sem_init.restype = ctypes.c_int
_sem_post = _libc.sem_post
_sem_post.argtypes = [ctypes.c_void_p]
_sem_post.restype = ctypes.c_int
_sem_timedwait = _libc.sem_timedwait
_sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_sem_timedwait.restype = ctypes.c_int


class SemWaiter:
    """sem_timedwait needs an *absolute* CLOCK_REALTIME deadline."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.ts = Timespec()
        self.ts_p = ctypes.addressof(self.ts)

    def wait(self, addr: int) -> int:
        t = time.time() + self.timeout_s
        sec = int(t)
        self.ts.tv_sec = sec
        self.ts.tv_nsec = int((t - sec) * 1e9)
        if _sem_timedwait(addr, self.ts_p) == 0:
            return 0
        return ctypes.get_errno()


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def busy(us: float) -> None:
    if us <= 0:
        return
    pc = time.perf_counter
    end = pc() + us * 1e-6
    while pc() < end:
        pass


class Shm:
    """memfd-backed shared block; ``w`` is an int32 memoryview (fast to poll)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.mm = mmap.mmap(fd, SHM_SIZE)
        self.w = memoryview(self.mm).cast("i")
        # Base address of the mapping (page aligned, so every int32 word is
        # 4-byte aligned as FUTEX_WAIT requires).  from_buffer keeps an export
        # on the mmap; we never close it explicitly (process exit unmaps).
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)
        assert self.base % 64 == 0

    def addr(self, word: int) -> int:
        return self.base + 4 * word

    @classmethod
    def create(cls) -> "Shm":
        fd = os.memfd_create("clusterenv-signalling", 0)
        os.ftruncate(fd, SHM_SIZE)
        return cls(fd)


class SpinFutex:
    """Wait for a sequence word to change: spin S us, then futex with timeout."""

    def __init__(self, shm: Shm, spin_us: float, yield_: bool,
                 timeout_s: float = FUTEX_TIMEOUT_S):
        self.ts, self.ts_p = make_timespec(timeout_s)
        self.w = shm.w
        self.shm = shm
        self.spin_s = spin_us * 1e-6
        self.yield_ = yield_
        self.recovered = 0  # ETIMEDOUT but the value *had* changed -> lost wake
        self.timeouts = 0  # all ETIMEDOUT returns (idle ones included)

    def wait_change(self, seq_word: int, sleep_word: int, old: int,
                    deadline: float | None = None) -> int:
        w = self.w
        v = w[seq_word]
        if v != old:
            return v
        if self.spin_s > 0:
            pc = time.perf_counter
            end = pc() + self.spin_s
            if self.yield_:
                yld = os.sched_yield
                while pc() < end:
                    yld()
                    v = w[seq_word]
                    if v != old:
                        return v
            else:
                while pc() < end:
                    v = w[seq_word]
                    if v != old:
                        return v
        addr = self.shm.addr(seq_word)
        while True:
            w[sleep_word] = 1
            v = w[seq_word]  # re-check after announcing (store->load!)
            if v != old:
                w[sleep_word] = 0
                return v
            err = futex_wait(addr, old, self.ts_p)
            w[sleep_word] = 0
            v = w[seq_word]
            if err == ETIMEDOUT:
                self.timeouts += 1
                if v != old:
                    self.recovered += 1
            if v != old:
                return v
            if deadline is not None and time.perf_counter() > deadline:
                raise TimeoutError("futex wait timed out")
            if deadline is None and os.getppid() != PARENT_PID[0]:
                sys.exit(0)  # orphaned worker


PARENT_PID = [0]


def parse_mech(name: str) -> dict:
    """Mechanism name -> parameters.  Suffix "-aw" (futex kinds): signaller
    always calls FUTEX_WAKE (race-free), waiters use a 100 ms timeout."""
    if name.endswith("-aw"):
        d = parse_mech(name[:-3])
        assert d["kind"] == "futex", name
        d.update(always_wake=True, timeout_s=0.100)
        return d
    if name.startswith("futex-L"):
        ls, ws = name[len("futex-L"):].split("-W")
        return {"kind": "futex", "spin_learner": float(ls), "spin_worker": float(ws),
                "yield": False, "always_wake": False, "timeout_s": FUTEX_TIMEOUT_S}
    if name.startswith("futex-spin"):
        s = float(name[len("futex-spin"):])
        return {"kind": "futex", "spin_learner": s, "spin_worker": s, "yield": False,
                "always_wake": False, "timeout_s": FUTEX_TIMEOUT_S}
    if name.startswith("spin-yield"):
        s = float(name[len("spin-yield"):])
        return {"kind": "futex", "spin_learner": s, "spin_worker": s, "yield": True,
                "always_wake": False, "timeout_s": FUTEX_TIMEOUT_S}
    if name in ("socket", "socket-poll", "pipe", "semaphore"):
        return {"kind": name}
    raise ValueError(name)


MECHANISMS = ["socket", "socket-poll", "pipe", "semaphore",
              "futex-spin0", "futex-spin20", "futex-spin50", "futex-spin200",
              "futex-L200-W0", "spin-yield50", "spin-yield50-aw"]


# --------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------
def worker_main(args) -> None:
    PARENT_PID[0] = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the learner cleans up
    mech = parse_mech(args.mech)
    kind = mech["kind"]
    i = args.index
    shm = Shm(args.shm_fd)
    w = shm.w
    g, d = go_line(i), done_line(i)
    w[d + READY] = 1

    if kind in ("socket", "socket-poll"):
        sock = socket.socket(fileno=args.fd_a)
        recv, send = sock.recv, sock.send
        poller = None
        if kind == "socket-poll":
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
        while True:
            if poller is not None:
                while not poller.poll(POLL_TIMEOUT_MS):
                    if os.getppid() != PARENT_PID[0]:
                        return
            if not recv(1) or w[CTRL_STOP]:
                return
            busy(w[CTRL_K_US])
            send(b"d")
    elif kind == "pipe":
        rfd, wfd = args.fd_a, args.fd_b
        rd, wr = os.read, os.write
        while True:
            if not rd(rfd, 1) or w[CTRL_STOP]:
                return
            busy(w[CTRL_K_US])
            wr(wfd, b"d")
    elif kind == "semaphore":
        go_sem = shm.base + sem_offset(i)
        done_sem = shm.base + sem_offset(args.nworkers)
        sw = SemWaiter(FUTEX_TIMEOUT_S * 10)
        while True:
            err = sw.wait(go_sem)
            if err:
                if os.getppid() != PARENT_PID[0]:
                    return
                continue
            if w[CTRL_STOP]:
                return
            busy(w[CTRL_K_US])
            _sem_post(done_sem)
    else:  # futex / spin-yield
        waiter = SpinFutex(shm, mech["spin_worker"], mech["yield"], mech["timeout_s"])
        always = mech["always_wake"]
        seq = 0
        done_addr = shm.addr(d + SEQ)
        while True:
            seq = waiter.wait_change(g + SEQ, g + SLEEP, seq)
            if w[CTRL_STOP]:
                break
            busy(w[CTRL_K_US])
            w[d + SEQ] = seq  # publish completion of round `seq`
            if always or w[d + SLEEP]:  # learner announced it is (about to be) asleep
                futex_wake(done_addr)
            w[d + RECOVERED] = waiter.recovered
            w[d + TIMEOUTS] = waiter.timeouts
        w[d + RECOVERED] = waiter.recovered
        w[d + TIMEOUTS] = waiter.timeouts


# --------------------------------------------------------------------------
# learner side
# --------------------------------------------------------------------------
class Pool:
    """Starts W workers for one mechanism and runs rounds against them."""

    def __init__(self, mech_name: str, nworkers: int):
        self.name = mech_name
        self.mech = parse_mech(mech_name)
        self.kind = self.mech["kind"]
        self.n = nworkers
        self.procs: list[subprocess.Popen] = []
        self.fds_to_close: list[int] = []
        self.shm = Shm.create()
        self.w = self.shm.w
        self.learner_recovered = 0
        self.learner_timeouts = 0
        self.poll_timeouts = 0
        self._start()

    # -- setup -------------------------------------------------------------
    def _start(self) -> None:
        kind, n, shm = self.kind, self.n, self.shm
        if kind == "semaphore":
            for j in range(n + 1):  # n "go" semaphores + 1 shared "done"
                if _sem_init(shm.base + sem_offset(j), 1, 0) != 0:
                    raise OSError(ctypes.get_errno(), "sem_init")
        self.socks, self.go_w, self.done_r = [], [], []
        for i in range(n):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker",
                   "--mech", self.name, "--index", str(i), "--nworkers", str(n),
                   "--shm-fd", str(shm.fd)]
            pass_fds = [shm.fd]
            child_fds: list[int] = []
            if kind in ("socket", "socket-poll"):
                a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                cmd += ["--fd-a", str(b.fileno())]
                pass_fds.append(b.fileno())
                self.socks.append(a)
                child_fds.append(b)
            elif kind == "pipe":
                go_r, go_w = os.pipe()
                done_r, done_w = os.pipe()
                cmd += ["--fd-a", str(go_r), "--fd-b", str(done_w)]
                pass_fds += [go_r, done_w]
                self.go_w.append(go_w)
                self.done_r.append(done_r)
                self.fds_to_close += [go_w, done_r]
                child_fds += [go_r, done_w]
            proc = subprocess.Popen(cmd, pass_fds=pass_fds)
            self.procs.append(proc)
            ALL_CHILDREN.append(proc)  # killed in main()'s finally no matter what
            for f in child_fds:  # the child has its copy now
                f.close() if hasattr(f, "close") else os.close(f)
        deadline = time.monotonic() + 30
        for i in range(n):
            while not self.w[done_line(i) + READY]:
                if time.monotonic() > deadline or self.procs[i].poll() is not None:
                    raise RuntimeError(f"worker {i} of {self.name} failed to start")
                time.sleep(0.002)
        if kind == "futex":
            self.waiter = SpinFutex(shm, self.mech["spin_learner"], self.mech["yield"],
                                    self.mech["timeout_s"])
            self.seq = 0
        if kind == "semaphore":
            self.semw = SemWaiter(LEARNER_TIMEOUT_S)

    def worker_cpu(self) -> float:
        """Total CPU seconds of all workers, ns resolution and up to date even
        for a process that is running right now (psutil / /proc/<pid>/stat
        only have 10 ms tick resolution).  Uses the per-process CPU clock id
        MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED) = (~pid << 3) | 2."""
        return sum(time.clock_gettime((~p.pid << 3) | 2) for p in self.procs)

    # -- one round -----------------------------------------------------------
    def make_round(self):
        """Return a zero-arg function performing go + wait-for-all-done."""
        kind, n = self.kind, self.n
        if kind == "socket":
            socks = self.socks

            def rnd():
                for s in socks:
                    s.send(b"g")
                for s in socks:
                    if not s.recv(1):
                        raise RuntimeError("worker died")
            return rnd
        if kind == "socket-poll":
            socks, poller = self.socks, select.poll()
            fds = [s.fileno() for s in socks]
            timeout_ms = int(LEARNER_TIMEOUT_S * 1000)

            def rnd():
                for s in socks:
                    s.send(b"g")
                for f in fds:
                    poller.register(f, select.POLLIN)
                pending = n
                while pending:
                    events = poller.poll(timeout_ms)
                    if not events:
                        self.poll_timeouts += 1
                        raise TimeoutError("poll timed out")
                    for f, _ in events:
                        if not os.read(f, 1):
                            raise RuntimeError("worker died")
                        poller.unregister(f)
                        pending -= 1
            return rnd
        if kind == "pipe":
            go_w, done_r = self.go_w, self.done_r
            wr, rd = os.write, os.read

            def rnd():
                for f in go_w:
                    wr(f, b"g")
                for f in done_r:
                    if not rd(f, 1):
                        raise RuntimeError("worker died")
            return rnd
        if kind == "semaphore":
            base = self.shm.base
            go = [base + sem_offset(i) for i in range(n)]
            done = base + sem_offset(n)
            semw = self.semw

            def rnd():
                for a in go:
                    _sem_post(a)
                for _ in range(n):
                    err = semw.wait(done)
                    if err:
                        raise OSError(err, "sem_timedwait")
            return rnd
        # futex / spin-yield
        w, shm, waiter = self.w, self.shm, self.waiter
        gl = [go_line(i) for i in range(n)]
        dl = [done_line(i) for i in range(n)]
        gaddr = [shm.addr(x + SEQ) for x in gl]
        always = self.mech["always_wake"]

        def rnd():
            seq = (self.seq + 1) & SEQ_MASK
            self.seq = seq
            for i in range(n):
                g = gl[i]
                w[g + SEQ] = seq
                if always or w[g + SLEEP]:
                    futex_wake(gaddr[i])
            deadline = time.perf_counter() + LEARNER_TIMEOUT_S
            old = (seq - 1) & SEQ_MASK
            for d in dl:
                if w[d + SEQ] != seq:
                    v = waiter.wait_change(d + SEQ, d + SLEEP, old, deadline)
                    if v != seq:
                        raise RuntimeError(f"unexpected done seq {v} != {seq}")
        return rnd

    def run(self, k_us: float, l_us: float, seconds: float) -> dict:
        self.w[CTRL_K_US] = int(k_us)
        rnd = self.make_round()
        for _ in range(50):  # warm-up
            busy(l_us)
            rnd()
        lat: list[float] = []
        app = lat.append
        pc = time.perf_counter
        c0w = self.worker_cpu()
        c0l = time.process_time()
        t_start = pc()
        t_end = t_start + seconds
        while True:
            busy(l_us)
            t0 = pc()
            rnd()
            t1 = pc()
            app(t1 - t0)
            if t1 >= t_end:
                break
        elapsed = pc() - t_start
        cw = self.worker_cpu() - c0w
        cl = time.process_time() - c0l
        import numpy as np
        a = np.asarray(lat) * 1e6
        return {
            "rounds": len(lat),
            "mean_us": float(a.mean()),
            "p50_us": float(np.percentile(a, 50)),
            "p99_us": float(np.percentile(a, 99)),
            "max_us": float(a.max()),
            "rounds_per_s": len(lat) / elapsed,
            "learner_cpu_frac": cl / elapsed,
            "workers_cpu_frac": cw / elapsed,
        }

    def idle_burn(self, seconds: float) -> float:
        time.sleep(0.05)  # let spin windows expire
        c0 = self.worker_cpu()
        time.sleep(seconds)
        return (self.worker_cpu() - c0) / seconds

    def worker_stats(self) -> dict:
        rec = sum(self.w[done_line(i) + RECOVERED] for i in range(self.n))
        tmo = sum(self.w[done_line(i) + TIMEOUTS] for i in range(self.n))
        out = {"worker_recovered": rec, "worker_futex_timeouts": tmo}
        if self.kind == "futex":
            out["learner_recovered"] = self.waiter.recovered
            out["learner_futex_timeouts"] = self.waiter.timeouts
        if self.kind == "socket-poll":
            out["learner_poll_timeouts"] = self.poll_timeouts
        return out

    # -- teardown ----------------------------------------------------------
    def close(self) -> None:
        try:
            self.w[CTRL_STOP] = 1
            for i in range(self.n):  # wake everyone once so they see STOP
                try:
                    if self.kind in ("socket", "socket-poll"):
                        self.socks[i].send(b"s")
                    elif self.kind == "pipe":
                        os.write(self.go_w[i], b"s")
                    elif self.kind == "semaphore":
                        _sem_post(self.shm.base + sem_offset(i))
                    else:
                        g = go_line(i)
                        self.w[g + SEQ] = (self.w[g + SEQ] + 1) & SEQ_MASK
                        futex_wake(self.shm.addr(g + SEQ))
                except OSError:
                    pass
            deadline = time.monotonic() + 2
            for p in self.procs:
                try:
                    p.wait(max(0.01, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            kill_all(self.procs)
            for s in self.socks:
                s.close()
            for f in self.fds_to_close:
                try:
                    os.close(f)
                except OSError:
                    pass
            os.close(self.shm.fd)


ALL_CHILDREN: list[subprocess.Popen] = []


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass


CONFIGS = [(0, 0), (100, 0), (100, 200)]  # (K us, L us)


def fmt_table(rows: list[dict]) -> str:
    hdr = (f"{'mechanism':<15}{'W':>2} {'K':>4} {'L':>4} | {'mean':>7} {'p99':>7} "
           f"{'rounds/s':>9} | {'lrn%':>5} {'wrk%':>5}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        lines.append(
            f"{r['mechanism']:<15}{r['workers']:>2} {r['k_us']:>4} {r['l_us']:>4} | "
            f"{r['mean_us']:>7.1f} {r['p99_us']:>7.1f} {r['rounds_per_s']:>9.0f} | "
            f"{100 * r['learner_cpu_frac']:>5.0f} {100 * r['workers_cpu_frac']:>5.0f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="2,4", help="comma list of W (default 2,4)")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per configuration")
    ap.add_argument("--idle-seconds", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="0.3 s per config, 0.3 s idle")
    ap.add_argument("--only", default="", help="comma list of mechanisms")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "signalling.json"))
    # worker-only arguments
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mech", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--nworkers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--shm-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--fd-a", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--fd-b", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return
    import measuring  # here, not above: the workers run this script too, and import no numpy

    if args.quick:
        args.seconds, args.idle_seconds = 0.3, 0.3
    workers = [int(x) for x in args.workers.split(",") if x]
    mechs = [m for m in args.only.split(",") if m] or MECHANISMS
    for m in mechs:
        parse_mech(m)

    rows, idle, stats = [], [], []
    t_all = time.perf_counter()
    try:
        for mech in mechs:
            for n in workers:
                pool = Pool(mech, n)
                try:
                    for k_us, l_us in CONFIGS:
                        r = pool.run(k_us, l_us, args.seconds)
                        r.update(mechanism=mech, workers=n, k_us=k_us, l_us=l_us)
                        rows.append(r)
                        print(fmt_table([r]).splitlines()[-1], flush=True)
                    burn = pool.idle_burn(args.idle_seconds)
                    idle.append({"mechanism": mech, "workers": n,
                                 "workers_cpu_s_per_s": burn})
                finally:
                    pool.close()
                st = pool.worker_stats()  # workers publish final counts on exit
                st.update(mechanism=mech, workers=n)
                stats.append(st)
                ALL_CHILDREN.clear()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        kill_all(ALL_CHILDREN)

    print()
    print("Round trip (us, learner 'go' -> all 'done'; excludes L), rounds/s includes L;")
    print("lrn%/wrk% = CPU of learner / all workers in % of one core during the run")
    print(fmt_table(rows))
    print()
    print("Idle burn (workers waiting, learner asleep) and lost-wakeup recovery:")
    print(f"{'mechanism':<15}{'W':>2} | {'idle CPU ms/s':>13} | {'recovered':>9} {'futex timeouts':>15}")
    for ib, st in zip(idle, stats):
        rec = st.get("worker_recovered", 0) + st.get("learner_recovered", 0)
        tmo = st.get("worker_futex_timeouts", 0) + st.get("learner_futex_timeouts", 0)
        print(f"{ib['mechanism']:<15}{ib['workers']:>2} | {1000 * ib['workers_cpu_s_per_s']:>13.2f} | "
              f"{rec:>9} {tmo:>15}")
    total = time.perf_counter() - t_all
    print(f"\ntotal time {total:.1f}s")

    measuring.write_json(args.out, {
        "meta": {**measuring.machine(), "seconds_per_config": args.seconds,
                 "idle_seconds": args.idle_seconds,
                 "futex_timeout_s": FUTEX_TIMEOUT_S,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "total_runtime_s": total},
        "rounds": rows, "idle": idle, "wakeup_stats": stats})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
