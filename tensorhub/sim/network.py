"""The network: full-duplex NICs, slower inter-datacenter links, control-message channels.

A unit transfer from host s to host r reserves s.tx and r.rx (and the s->r datacenter link
when it crosses datacenters) for ``bytes / min(bandwidth)`` seconds, FIFO per resource. Two
transfers that share no resource run in parallel, so a pipeline (r2 reading from a partial r1
while r1 reads from the trainer) costs about one transfer, not two. Transfers between two
clients on the same host use the host's local copy engine instead of the NIC.

Control messages (client <-> server) travel on FIFO channels (one per direction and peer, like
a TCP connection) with a small latency. The ``msg_delay`` fault adds a random extra delay per
message, which reorders messages across channels (never within one). While the server is up,
``msg_loss`` loses a call's request or its reply (the caller's transport then fails, as a broken
connection does: the call sees the server unavailable) and ``msg_dup`` delivers a request twice,
back to back on its channel (the second reply is dropped: one answer per call).
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional


class Resource:
    __slots__ = ("name", "bw", "factor", "free_at")

    def __init__(self, name: str, bw: float) -> None:
        self.name = name
        self.bw = bw
        self.factor = 1.0  # slow_link fault: bandwidth is divided by this
        self.free_at = 0.0


class Read:
    """One posted unit read: the reader copies ``unit`` of ``source`` into its own memory.
    Physically in flight from ``t0`` (posted) to ``end``; ``dead`` reads deliver nothing to the
    reader's bookkeeping."""

    __slots__ = ("rid", "reader", "source", "version", "unit", "t0", "end", "epoch", "assign_no", "dead", "cancelled",
                 "pull_epoch")

    def __init__(self, rid, reader, source, version, unit, t0, end, epoch, assign_no) -> None:
        self.rid, self.reader, self.source, self.version, self.unit = rid, reader, source, version, unit
        self.t0, self.end, self.epoch, self.assign_no = t0, end, epoch, assign_no
        self.dead = False
        self.cancelled = False
        """Cancelled by the reader: it may still land (junk) until ``end``."""
        self.pull_epoch = epoch
        """The server epoch in which the reader got the assignment this read serves."""


class Host:
    __slots__ = ("name", "dc", "tx", "rx", "local")

    def __init__(self, name: str, dc: str, nic_bw: float, local_bw: float) -> None:
        self.name, self.dc = name, dc
        self.tx = Resource(f"{name}.tx", nic_bw)
        self.rx = Resource(f"{name}.rx", nic_bw)
        self.local = Resource(f"{name}.local", local_bw)


class Network:
    def __init__(self, sim, rng: random.Random, *, ctrl_latency_s: float = 0.0005,
                 ctrl_jitter_s: float = 0.0005, nic_latency_s: float = 5e-6) -> None:
        self.sim = sim
        self.rng = rng
        self.ctrl_latency_s = ctrl_latency_s
        self.ctrl_jitter_s = ctrl_jitter_s
        self.nic_latency_s = nic_latency_s
        self.extra_delay_max_s = 0.0
        self.loss_p = 0.0
        """``msg_loss`` fault: the chance that a call's request or reply is lost (server up)."""
        self.dup_p = 0.0
        """``msg_dup`` fault: the chance that a request is delivered twice (server up)."""
        self.fault_rng = random.Random(f"{sim.seed}/net-faults")
        """Its own stream: the jitter draws of a seed stay as they were."""
        self.late_p = 0.0
        """``late_dup`` fault: the chance that a ``Replicate`` is delivered again, later."""
        self.late_delay_max_s = 0.0
        self.late_rng = random.Random(f"{sim.seed}/net-late")
        """Its own stream: the other faults' draws of a seed stay as they were."""
        self.lost = self.duplicated = 0
        self.hosts: dict[str, Host] = {}
        self.links: dict[tuple[str, str], tuple[Resource, float]] = {}
        self.reads_by_source: dict[str, dict[int, Read]] = {}
        self._chan_last: dict[tuple[str, str], float] = {}
        self._rid = 0
        self.bytes_moved = 0

    # ------------------------------------------------------------------ topology

    def add_host(self, name: str, dc: str, nic_bw: float, local_bw: float = 200e9) -> Host:
        h = self.hosts[name] = Host(name, dc, nic_bw, local_bw)
        return h

    def add_dc_link(self, a: str, b: str, bw: float, latency_s: float) -> None:
        self.links[(a, b)] = (Resource(f"{a}->{b}", bw), latency_s)
        self.links[(b, a)] = (Resource(f"{b}->{a}", bw), latency_s)

    # ------------------------------------------------------------------ data path

    def reserve(self, src_host: str, dst_host: str, nbytes: int) -> float:
        """Reserve the path for one transfer posted now; returns its completion time."""
        s, r = self.hosts[src_host], self.hosts[dst_host]
        if s is r:
            path, lat = [s.local], 1e-6
        else:
            path, lat = [s.tx, r.rx], self.nic_latency_s
            if s.dc != r.dc:
                link, lat = self.links[(s.dc, r.dc)]
                path.append(link)
        bw = min(res.bw / res.factor for res in path)
        start = max(self.sim.now, max(res.free_at for res in path))
        done = start + nbytes / bw
        for res in path:
            res.free_at = done
        self.bytes_moved += nbytes
        return done + lat

    def post(self, reader: str, source: str, version: int, unit: int, end: float,
             epoch: int, assign_no: int) -> Read:
        self._rid += 1
        rd = Read(self._rid, reader, source, version, unit, self.sim.now, end, epoch, assign_no)
        self.reads_by_source.setdefault(source, {})[rd.rid] = rd
        return rd

    def unregister(self, rd: Read) -> None:
        reads = self.reads_by_source.get(rd.source)
        if reads is not None:
            reads.pop(rd.rid, None)
            if not reads:
                del self.reads_by_source[rd.source]

    def reads_from(self, source: str) -> list[Read]:
        return list(self.reads_by_source.get(source, {}).values())

    # ------------------------------------------------------------------ control messages

    def send(self, src: str, dst: str, fn: Callable[..., Any], *args: Any) -> None:
        delay = self.ctrl_latency_s + self.rng.random() * self.ctrl_jitter_s
        if self.extra_delay_max_s > 0:
            delay += self.rng.random() * self.extra_delay_max_s
        key = (src, dst)
        t = max(self.sim.now + delay, self._chan_last.get(key, 0.0))
        self._chan_last[key] = t
        self.sim.at(t, fn, *args)

    def lose(self) -> bool:
        """Whether the message about to be sent is lost (``msg_loss``)."""
        if self.loss_p > 0 and self.fault_rng.random() < self.loss_p:
            self.lost += 1
            return True
        return False

    def duplicate(self) -> bool:
        """Whether the request about to be sent is delivered twice (``msg_dup``)."""
        if self.dup_p > 0 and self.fault_rng.random() < self.dup_p:
            self.duplicated += 1
            return True
        return False

    def late_duplicate(self) -> Optional[float]:
        """``late_dup``: after how long the request about to be sent is delivered again, or None."""
        if self.late_p > 0 and self.late_rng.random() < self.late_p:
            return self.late_rng.uniform(0.0, self.late_delay_max_s)
        return None

    def host(self, name: str) -> Optional[Host]:
        return self.hosts.get(name)
