"""A delayed Ethernet cable between network namespaces, for kernels without ``tc netem``.

    python tests/cluster/delayline.py --delay-ms 5 NS_A:TAP_A,NS_B:TAP_B [NS_C:TAP_C,NS_D:TAP_D ...]

Each pair of persistent TAP devices (``ip -n NS tuntap add dev TAP mode tap``) becomes the two ends
of one cable: every frame written by one namespace's kernel to its TAP is delivered to the other TAP
``--delay-ms`` later, in order, in both directions. tests/cluster/netns.sh uses it for the worker
hosts' links (worker's ce0 <-> switch port) when ``tc qdisc ... netem`` is not available; killing the
process unplugs the cables (the TAPs lose their carrier).

Frames only ever move between the given TAPs: nothing is read from or sent to any other interface.
Runs at most ``--max-seconds`` (default 900), then exits.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
MAX_FRAME = 65536
MAX_QUEUED = 4096  # frames per direction; beyond that a frame is dropped, as a full NIC queue would


def open_tap(namespace: str, name: str) -> int:
    """Attach to the persistent TAP ``name`` of network namespace ``namespace`` (by its /run/netns name)."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
        return fd
    finally:
        if libc.setns(home, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back")
        os.close(target)
        os.close(home)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cables", nargs="+", help="NS_A:TAP_A,NS_B:TAP_B")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of every frame")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    args = parser.parse_args()
    delay = args.delay_ms / 1e3

    peer: dict[int, int] = {}
    for cable in args.cables:
        ends = [end.split(":", 1) for end in cable.split(",")]
        if len(ends) != 2 or any(len(end) != 2 for end in ends):
            parser.error(f"a cable is NS_A:TAP_A,NS_B:TAP_B, got {cable!r}")
        a, b = (open_tap(namespace, name) for namespace, name in ends)
        peer[a], peer[b] = b, a
    queues: dict[int, collections.deque] = {fd: collections.deque() for fd in peer}  # frames to write to fd
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"delayline: {len(args.cables)} cable(s), {args.delay_ms:g} ms each way", flush=True)

    end = time.monotonic() + args.max_seconds
    readable = list(peer)
    while True:
        now = time.monotonic()
        if now >= end:
            return
        due = min((queue[0][0] for queue in queues.values() if queue), default=None)
        timeout = min(end - now, 1.0) if due is None else max(0.0, due - now)
        ready, _, _ = select.select(readable, [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            queue = queues[peer[fd]]
            for _ in range(64):  # bounded batch per wake-up
                try:
                    frame = os.read(fd, MAX_FRAME)
                except BlockingIOError:
                    break
                except OSError:
                    break  # e.g. the device went down
                if len(queue) < MAX_QUEUED:
                    queue.append((now + delay, frame))
        for fd, queue in queues.items():
            while queue and queue[0][0] <= now:
                try:
                    os.write(fd, queue.popleft()[1])
                except OSError:
                    pass  # carrier down or queue full: the frame is lost, as on a real link


if __name__ == "__main__":
    main()
