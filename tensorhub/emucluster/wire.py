"""``python -m tensorhub.emucluster.wire WIRE...``: delay lines between TAP devices.

Each ``WIRE`` is ``netns_a:dev_a:netns_b:dev_b:delay_ms`` (an empty netns is the root
namespace). The process attaches to both TAP devices (which must exist, persistent, created
with ``ip tuntap add``), prints ``ready`` on stdout, then forever copies every frame read from
one end to the other end ``delay_ms`` later: a constant one-way delay in both directions,
FIFO, nothing reordered. Rate limits are not its business (tbf on the TAP devices does that).

Frames carry a virtio-net header and the TAPs announce TSO, so TCP's 64 KiB GSO frames pass
whole: one read and one write per 64 KiB. A direction's delay line holds at most
``QUEUE_BYTES_MAX``; beyond it frames are dropped (counted, reported on exit). Stops on
SIGTERM/SIGINT; while it is not running the wires are down (carrier off), not bypassed.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import os
import select
import signal
import struct
import sys
import time
from typing import NamedTuple

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
CLONE_NEWNET = 0x40000000
FRAME_BYTES_MAX = 256 << 10      # a 64 KiB GSO frame plus headers, with room to spare
QUEUE_BYTES_MAX = 256 << 20      # per direction: far above rate x delay of any emulated link
READS_PER_WAKEUP_MAX = 64        # then serve other ends and due frames


class Wire(NamedTuple):
    netns_a: str
    dev_a: str
    netns_b: str
    dev_b: str
    delay_s: float


def parse_wire(text: str) -> Wire:
    ns_a, dev_a, ns_b, dev_b, delay_ms = text.split(":")
    return Wire(ns_a, dev_a, ns_b, dev_b, float(delay_ms) / 1000.0)


def open_tap(netns: str, dev: str) -> int:
    """A non-blocking fd on TAP ``dev`` in namespace ``netns`` (the fd stays bound to it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        if netns:
            ns_fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(ns_fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {netns}")
            finally:
                os.close(ns_fd)
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", dev.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
        return fd
    finally:
        if netns and libc.setns(home, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back to the root namespace")
        os.close(home)


class Direction:
    """Frames read from ``src`` wait ``delay_s``, then are written to ``dst``."""

    def __init__(self, src: int, dst: int, delay_s: float) -> None:
        self.src, self.dst, self.delay_s = src, dst, delay_s
        self.line: collections.deque = collections.deque()
        self.queued_bytes = 0
        self.dropped = 0

    def read(self, now: float) -> None:
        for _ in range(READS_PER_WAKEUP_MAX):
            try:
                frame = os.read(self.src, FRAME_BYTES_MAX)
            except BlockingIOError:
                return
            if self.queued_bytes + len(frame) > QUEUE_BYTES_MAX:
                self.dropped += 1
                continue
            self.line.append((now + self.delay_s, frame))
            self.queued_bytes += len(frame)

    def flush(self, now: float) -> None:
        while self.line and self.line[0][0] <= now:
            _, frame = self.line.popleft()
            self.queued_bytes -= len(frame)
            try:
                os.write(self.dst, frame)
            except OSError:  # the far end is down or full: the frame is lost, as on a wire
                self.dropped += 1


def run(wires: list[Wire]) -> int:
    by_fd: dict[int, Direction] = {}
    for w in wires:
        a, b = open_tap(w.netns_a, w.dev_a), open_tap(w.netns_b, w.dev_b)
        by_fd[a] = Direction(a, b, w.delay_s)
        by_fd[b] = Direction(b, a, w.delay_s)
    poller = select.epoll()
    for fd in by_fd:
        poller.register(fd, select.EPOLLIN)
    stop = []
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.append(1))
    print("ready", flush=True)
    dirs = list(by_fd.values())
    while not stop:
        due = [d.line[0][0] for d in dirs if d.line]
        timeout = max(0.0, min(due) - time.monotonic()) if due else 1.0
        try:
            events = poller.poll(timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd, _ in events:
            by_fd[fd].read(now)
        now = time.monotonic()
        for d in dirs:
            d.flush(now)
    dropped = sum(d.dropped for d in dirs)
    print(f"stopped; frames dropped: {dropped}", flush=True)
    return 0


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or any(a.startswith("-") for a in args):
        print(__doc__, file=sys.stderr)
        return 2
    return run([parse_wire(a) for a in args])


if __name__ == "__main__":
    sys.exit(main())
