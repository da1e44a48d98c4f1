"""Builds and removes an emulated cluster's network (namespaces, veths, bridges, tc) with ``ip``.

Needs root. Touches only the names a :class:`~tensorhub.emucluster.plan.NetPlan` lists;
:func:`conflicts` refuses to build over any of them, or over a subnet some route already
covers, so a developer's own namespaces and bridges are never modified.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterable, NamedTuple, Optional, Sequence

from tensorhub.emucluster.plan import ClusterError, ClusterSpec, NetPlan, rtt_budget_s, shaping_commands

IP_TIMEOUT_S = 20.0
SYS_NET = Path("/sys/class/net")
# Per-namespace TCP buffers large enough for one stream to fill a long fat emulated link
# (1 Gbit/s x 60 ms RTT is 7.5 MB; the kernel default maximum is 4-6 MB).
NETNS_SYSCTLS = {
    "net.ipv4.tcp_rmem": "4096 131072 33554432",
    "net.ipv4.tcp_wmem": "4096 16384 33554432",
    "net.ipv6.conf.all.disable_ipv6": "1",
    "net.ipv6.conf.default.disable_ipv6": "1",
}


class Traffic(NamedTuple):
    """Byte counters of one NIC, from its own point of view (cumulative since creation)."""

    sent: int
    received: int


def preflight() -> None:
    """Raises ClusterError unless we are root and ``ip``/``tc`` exist and ``ip netns`` works."""
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (network namespaces, veth, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"`{tool}` not found on PATH (install iproute2)")
    run(["ip", "netns", "list"])


def unavailable_reason() -> Optional[str]:
    """Why an emulated cluster cannot be built here (for a test's skip reason), or None."""
    try:
        preflight()
    except ClusterError as e:
        return str(e)
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun (delay wires)"
    return None


def run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Runs one iproute2 command; a failure (if ``check``) is a ClusterError with its stderr."""
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterError(f"`{' '.join(argv)}` failed: {e}") from e
    if check and p.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed (rc={p.returncode}): {p.stderr.strip()}")
    return p


def existing_netns() -> set[str]:
    out = run(["ip", "netns", "list"]).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def conflicts(layout: NetPlan, subnet: str) -> list[str]:
    """What already exists under our names, and routes that overlap ``subnet``."""
    found = [f"network namespace {ns}" for ns in sorted(set(layout.namespaces) & existing_netns())]
    found += [f"interface {i}" for i in layout.interfaces if (SYS_NET / i).exists()]
    ours = ipaddress.IPv4Network(subnet)
    routes = json.loads(run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]")
    for r in routes:
        dst = r.get("dst", "")
        if dst in ("", "default"):
            continue
        try:
            net = ipaddress.IPv4Network(dst, strict=False)
        except ValueError:
            continue
        if net.overlaps(ours):
            found.append(f"route {dst} dev {r.get('dev', '?')} overlaps subnet {subnet}")
    return found


def build(spec: ClusterSpec, layout: NetPlan) -> None:
    """Creates bridges, inter-datacenter links and hosts. Not idempotent: call on a clean slate
    (:func:`conflicts` empty); on error the caller tears down what :class:`NetPlan` lists.
    Links with delay are TAP pairs that carry nothing until the wire process attaches."""
    rtt_s = rtt_budget_s(spec)
    for br in layout.bridges:
        run(["ip", "link", "add", br, "type", "bridge", "forward_delay", "0", "stp_state", "0"])
        # br_netfilter would send bridged frames through the host firewall: not a real switch.
        run(["ip", "link", "set", br, "type", "bridge", "nf_call_iptables", "0", "nf_call_ip6tables", "0",
             "nf_call_arptables", "0"], check=False)
        _disable_ipv6(br)
        run(["ip", "link", "set", br, "up"])
    run(["ip", "addr", "add", f"{layout.head_ip}/{layout.prefix_len}", "dev", layout.bridges[0]])
    for link in layout.links:
        if link.delay_ms > 0:
            run(["ip", "tuntap", "add", "dev", link.end_a, "mode", "tap", "vnet_hdr"])
            run(["ip", "tuntap", "add", "dev", link.end_b, "mode", "tap", "vnet_hdr"])
        else:
            run(["ip", "link", "add", link.end_a, "type", "veth", "peer", "name", link.end_b])
        for end, dc in ((link.end_a, link.dc_a), (link.end_b, link.dc_b)):
            _disable_ipv6(end)
            run(["ip", "link", "set", end, "master", layout.bridges[dc]])
            for argv in shaping_commands(end, spec.inter_dc_gbit, rtt_s):
                run(argv)
            run(["ip", "link", "set", end, "up"])
    for h in layout.hosts:
        ns = h.netns
        run(["ip", "netns", "add", ns])
        if h.delay_ms > 0:
            run(["ip", "-n", ns, "tuntap", "add", "dev", "eth0", "mode", "tap", "vnet_hdr"])
            run(["ip", "tuntap", "add", "dev", h.root_dev, "mode", "tap", "vnet_hdr"])
        else:
            run(["ip", "link", "add", h.root_dev, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _disable_ipv6(h.root_dev)
        run(["ip", "link", "set", h.root_dev, "master", layout.bridges[h.dc]])
        run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w"] + [f"{k}={v}" for k, v in NETNS_SYSCTLS.items()])
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        run(["ip", "-n", ns, "addr", "add", f"{h.ip}/{layout.prefix_len}", "dev", "eth0"])
        for argv in shaping_commands("eth0", spec.gbit, rtt_s, netns=ns):  # upload
            run(argv)
        for argv in shaping_commands(h.root_dev, spec.gbit, rtt_s):  # download
            run(argv)
        run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        run(["ip", "link", "set", h.root_dev, "up"])
        run(["ip", "-n", ns, "route", "add", "default", "via", layout.head_ip])


def destroy(namespaces: Iterable[str], interfaces: Iterable[str]) -> list[str]:
    """Deletes the namespaces (their ``eth0`` and its veth peer go with them) and interfaces
    that still exist. Idempotent. Returns what could not be deleted (empty on success)."""
    failed = []
    present = existing_netns()
    for ns in namespaces:
        if ns in present and run(["ip", "netns", "del", ns], check=False).returncode != 0:
            failed.append(f"network namespace {ns}")
    for dev in interfaces:
        if (SYS_NET / dev).exists() and run(["ip", "link", "del", dev], check=False).returncode != 0:
            if (SYS_NET / dev).exists():  # a veth may vanish with its peer meanwhile
                failed.append(f"interface {dev}")
    return failed


def set_up(dev: str, up: bool) -> None:
    """Sets root-namespace interface ``dev`` up or down (a cut link). Idempotent."""
    run(["ip", "link", "set", "dev", dev, "up" if up else "down"])


def netns_pids(ns: str) -> set[int]:
    """Processes inside namespace ``ns`` (empty if it does not exist)."""
    p = run(["ip", "netns", "pids", ns], check=False)
    return {int(x) for x in p.stdout.split()} if p.returncode == 0 else set()


def dev_traffic(dev: str) -> Traffic:
    """Counters of a root-namespace interface, as that interface sees them."""
    stats = SYS_NET / dev / "statistics"
    try:
        return Traffic(sent=int((stats / "tx_bytes").read_text()), received=int((stats / "rx_bytes").read_text()))
    except OSError as e:
        raise ClusterError(f"cannot read counters of {dev}: {e}") from e


def _disable_ipv6(dev: str) -> None:
    # No router solicitations or DAD probes: the byte counters then show only our traffic.
    try:
        Path(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6").write_text("1")
    except OSError:
        pass
