"""What an emulated cluster is made of, computed from its spec: pure, no root, no side effects.

    hosts 0..K-1, each a network namespace ``<name>-h<k>`` with one NIC ``eth0``:

        [ns <name>-h0] eth0 ==veth== <name>-v0 --+
        [ns <name>-h1] eth0 ==veth== <name>-v1 --+-- bridge <name>-br0 (10.77.0.1 = head, driver)
                                                 |
                                        <name>-l1a ==inter-dc link== <name>-l1b -- bridge <name>-br1
                                                                                    +-- <name>-v2 ...

Every host is in one datacenter (all in dc 0 without ``datacenters``). Each datacenter has a
bridge; datacenter d >= 1 is joined to datacenter 0 by one veth pair (a star around dc 0, so
traffic between two non-zero datacenters crosses two links). The whole cluster is one L2
segment and one IP subnet: the head is ``subnet + 1`` on dc 0's bridge, host k of datacenter d
is ``subnet + 256 * (d + 1) + k + 1`` (10.77.2.5 is host 4, in dc 1).

Shaping (:func:`shaping_commands`): every shaped device gets an ``htb`` root (rate, burst,
bulk queue limit) that sends small packets (ACKs) ahead of bulk data. A host NIC is shaped in
both directions: upload on ``eth0`` inside the namespace, download on the root-side end. The inter-datacenter link is shaped on both ends.

Latency: this machine's kernel has no ``sch_netem`` (nor ``fq``, so no EDT delay either), so
delay is added in user space by a *wire* (:mod:`tensorhub.emucluster.wire`): a link
with delay is a pair of TAP devices instead of a veth pair, and one process copies frames
between them after the delay, keeping GSO frames whole (64 KiB per read, so a few thousand
frames per second per Gbit/s). ``latency_ms`` is the one-way delay added between two hosts of
one datacenter (half in each host's wire); ``inter_dc_latency_ms`` is added once more, in each
direction, on the inter-datacenter link. Links without delay stay kernel-only veth pairs.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from typing import Optional

from tensorhub.errors import ClusterError

NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,5}$")
RESERVED_NAME_PREFIXES = ("tx",)  # a developer's own experiments use tx* names; never ours
IFNAME_BYTES_MAX = 15
HOSTS_MAX = 250  # host k is subnet + 256 * (dc + 1) + k + 1
TBF_BURST_BYTES_MIN = 64 << 10   # >= one 64 KiB GSO segment, so tbf never has to split them
TBF_BURST_S = 0.001              # at high rates, one ms of line rate
TBF_QUEUE_S_MIN = 0.05           # queue at least 50 ms of line rate ...
TBF_QUEUE_BYTES_MIN = 1 << 20    # ... and at least 1 MiB
SMALL_PACKET_BYTES = 128         # IP packets shorter than this (ACKs) skip the bulk queue
SMALL_CLASS_SHARE = 0.05         # the small-packet class's guaranteed share (it may use all)
HTB_QUANTUM = 60000              # bytes per round between classes of one priority


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """An emulated cluster's shape. Validated on construction (raises :class:`ClusterError`).

    ``gbit``/``inter_dc_gbit`` are link rates in Gbit/s (floats: 0.2 is 200 Mbit/s);
    ``latency_ms`` and ``inter_dc_latency_ms`` are one-way delays (see the module docstring).
    ``datacenters`` lists hosts per datacenter in host order (``(3, 3)``: hosts 0-2 in dc 0,
    3-5 in dc 1); ``None`` is one datacenter. ``name`` prefixes every namespace, interface,
    state file and Ray temp dir, and ``subnet`` must not overlap any route of the machine, so
    two clusters with different names and subnets coexist. ``ray=False`` builds only the
    network (for experiments with plain processes in the namespaces).
    """

    hosts: int
    gbit: float = 1.0
    latency_ms: float = 0.0
    datacenters: Optional[tuple[int, ...]] = None
    inter_dc_gbit: float = 1.0
    inter_dc_latency_ms: float = 0.0
    cpus_per_host: int = 2
    head_cpus: int = 1
    object_store_bytes_per_host: int = 512 << 20
    name: str = "th"
    subnet: str = "10.77.0.0/16"
    ray: bool = True
    include_dashboard: bool = False
    start_timeout_s: float = 120.0
    state_dir: str = "/tmp/tensorhub-cluster"

    def __post_init__(self) -> None:
        if self.datacenters is not None:
            object.__setattr__(self, "datacenters", tuple(int(n) for n in self.datacenters))
        errors = list(_spec_errors(self))
        if errors:
            raise ClusterError("invalid cluster spec: " + "; ".join(errors))

    @property
    def dc_sizes(self) -> tuple[int, ...]:
        return self.datacenters if self.datacenters is not None else (self.hosts,)


def _spec_errors(s: ClusterSpec):
    if not NAME_RE.match(s.name):
        yield f"name {s.name!r} must match {NAME_RE.pattern} (it prefixes 15-byte interface names)"
    if s.name.startswith(RESERVED_NAME_PREFIXES):
        yield f"name {s.name!r} starts with a reserved prefix {RESERVED_NAME_PREFIXES}"
    if s.hosts < 0 or (s.hosts == 0 and s.datacenters is not None):
        yield f"hosts={s.hosts} must be >= 1 (or 0 without datacenters: a head node alone)"
    if s.datacenters is not None:
        if sum(s.datacenters) != s.hosts or min(s.datacenters, default=0) < 1:
            yield f"datacenters={s.datacenters} must be positive and sum to hosts={s.hosts}"
    if s.hosts > HOSTS_MAX:
        yield f"hosts={s.hosts} exceeds {HOSTS_MAX}"
    for field in ("gbit", "inter_dc_gbit"):
        if not getattr(s, field) > 0:
            yield f"{field}={getattr(s, field)} must be > 0"
    for field in ("latency_ms", "inter_dc_latency_ms"):
        if not getattr(s, field) >= 0:
            yield f"{field}={getattr(s, field)} must be >= 0"
    if s.cpus_per_host < 0 or s.head_cpus < 0:
        yield "cpus_per_host and head_cpus must be >= 0"
    if s.object_store_bytes_per_host < 75 << 20:
        yield "object_store_bytes_per_host must be >= 75 MiB (Ray's minimum)"
    if not s.start_timeout_s > 0:
        yield "start_timeout_s must be > 0"
    try:
        net = ipaddress.IPv4Network(s.subnet)
    except ValueError as e:
        yield f"subnet {s.subnet!r}: {e}"
        return
    last = 256 * len(s.dc_sizes) + s.hosts + 1
    if last >= net.num_addresses - 1:
        yield f"subnet {s.subnet} is too small for {len(s.dc_sizes)} datacenters (use /20 or larger)"


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """One host of a :class:`NetPlan`: its namespace, address and NIC."""

    index: int
    dc: int
    netns: str
    ip: str
    root_dev: str  # the root-namespace end of the host's NIC (on the bridge); its peer is eth0 in netns
    delay_ms: float  # added by the host's wire in each direction; 0: the NIC is a plain veth pair


@dataclasses.dataclass(frozen=True)
class Wire:
    """A delayed link between two TAP devices: ``netns_a`` ("" = root namespace)."""

    netns_a: str
    dev_a: str
    netns_b: str
    dev_b: str
    delay_ms: float

    def arg(self) -> str:
        return f"{self.netns_a}:{self.dev_a}:{self.netns_b}:{self.dev_b}:{self.delay_ms}"


@dataclasses.dataclass(frozen=True)
class InterDcLink:
    """The veth pair joining ``dc_a`` (always 0) and ``dc_b``; ``end_a`` sits on dc_a's bridge,
    so its transmit counter is the bytes sent from dc_a to dc_b."""

    dc_a: int
    dc_b: int
    end_a: str
    end_b: str
    delay_ms: float  # one-way, each direction; > 0 makes the ends TAPs joined by a wire


@dataclasses.dataclass(frozen=True)
class NetPlan:
    """Every name and address an emulated cluster creates (its namespaces, devices, bridges,
    links), computed from its :class:`ClusterSpec` by :func:`plan_of`. Not a tensor layout
    (that is :class:`tensorhub.layout.Layout`)."""

    name: str
    prefix_len: int
    head_ip: str
    bridges: tuple[str, ...]  # index = datacenter
    hosts: tuple[HostPlan, ...]
    links: tuple[InterDcLink, ...]

    @property
    def wires(self) -> tuple[Wire, ...]:
        hosts = [Wire(h.netns, "eth0", "", h.root_dev, h.delay_ms) for h in self.hosts if h.delay_ms > 0]
        links = [Wire("", l.end_a, "", l.end_b, l.delay_ms) for l in self.links if l.delay_ms > 0]
        return tuple(hosts + links)

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(h.netns for h in self.hosts)

    @property
    def interfaces(self) -> tuple[str, ...]:
        """Every root-namespace interface we create, in deletion order."""
        veths = [h.root_dev for h in self.hosts]
        links = [end for link in self.links for end in (link.end_a, link.end_b)]
        return tuple(veths + links + list(self.bridges))


def plan_of(spec: ClusterSpec) -> NetPlan:
    net = ipaddress.IPv4Network(spec.subnet)
    base = net.network_address
    hosts = []
    k = 0
    for dc, size in enumerate(spec.dc_sizes):
        for _ in range(size):
            ip = base + 256 * (dc + 1) + k + 1
            hosts.append(HostPlan(index=k, dc=dc, netns=f"{spec.name}-h{k}", ip=str(ip),
                                    root_dev=f"{spec.name}-v{k}", delay_ms=spec.latency_ms / 2))
            k += 1
    links = tuple(InterDcLink(0, d, f"{spec.name}-l{d}a", f"{spec.name}-l{d}b", spec.inter_dc_latency_ms)
                  for d in range(1, len(spec.dc_sizes)))
    out = NetPlan(name=spec.name, prefix_len=net.prefixlen, head_ip=str(base + 1),
                 bridges=tuple(f"{spec.name}-br{d}" for d in range(len(spec.dc_sizes))),
                 hosts=tuple(hosts), links=links)
    assert all(len(i) <= IFNAME_BYTES_MAX for i in out.interfaces), out.interfaces
    return out


def rtt_budget_s(spec: ClusterSpec) -> float:
    """The longest round trip between two hosts, from the added delays alone."""
    hops = 1 if len(spec.dc_sizes) <= 2 else 2
    return 2 * (spec.latency_ms + hops * spec.inter_dc_latency_ms) / 1000.0


def shaping_commands(dev: str, gbit: float, rtt_s: float, netns: Optional[str] = None) -> list[list[str]]:
    """``tc`` argv lists that shape egress of ``dev`` to ``gbit``.

    An ``htb`` root with two classes sharing the rate: small packets (IP length under
    :data:`SMALL_PACKET_BYTES`: TCP ACKs, control messages) go first, everything else queues
    behind them. A plain FIFO (``tbf``) would put a host's ACKs behind its own upload: a host
    that forwards at line rate (a partial holder serving a follower) then slows what it
    receives, an artifact a real NIC's flow-fair queueing (Linux's default ``fq_codel``) does
    not have, and this kernel has neither ``fq_codel`` nor ``prio``.

    The burst is at least one 64 KiB GSO frame (so the shaper never splits them) and 1 ms of
    line rate; the bulk queue holds at least 50 ms (and 1 MiB) of line rate plus one ``rtt_s``
    of it, so a single TCP stream keeps the link busy after a loss.
    """
    rate_bytes_s = gbit * 1e9 / 8
    burst_bytes = max(TBF_BURST_BYTES_MIN, int(rate_bytes_s * TBF_BURST_S))
    limit_bytes = max(TBF_QUEUE_BYTES_MIN, int(rate_bytes_s * (TBF_QUEUE_S_MIN + rtt_s)))
    rate = int(gbit * 1e9)
    small = max(1, int(rate * SMALL_CLASS_SHARE))
    tc = ["tc"] + (["-n", netns] if netns else [])
    shape = ["burst", str(burst_bytes), "cburst", str(burst_bytes)]
    return [
        tc + ["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "20"],
        tc + ["class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
              "rate", f"{rate}bit", "ceil", f"{rate}bit", *shape],
        tc + ["class", "replace", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "prio", "0",
              "rate", f"{small}bit", "ceil", f"{rate}bit", "quantum", str(HTB_QUANTUM), *shape],
        tc + ["class", "replace", "dev", dev, "parent", "1:1", "classid", "1:20", "htb", "prio", "1",
              "rate", f"{rate - small}bit", "ceil", f"{rate}bit", "quantum", str(HTB_QUANTUM), *shape],
        tc + ["qdisc", "replace", "dev", dev, "parent", "1:10", "handle", "10:", "pfifo", "limit", "10000"],
        tc + ["qdisc", "replace", "dev", dev, "parent", "1:20", "handle", "20:", "bfifo", "limit", str(limit_bytes)],
        # IPv4 total length (bytes 2-3 of the header) below 128
        tc + ["filter", "replace", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
              "match", "u16", "0x0000", f"0x{0x10000 - SMALL_PACKET_BYTES:04x}", "at", "2", "flowid", "1:10"],
    ]


def parse_datacenters(text: Optional[str]) -> Optional[tuple[int, ...]]:
    """``"3,3"`` -> ``(3, 3)``; empty or None -> None. Raises ClusterError on bad input."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ClusterError(f"--datacenters {text!r}: expected comma-separated host counts, e.g. 3,3") from None

