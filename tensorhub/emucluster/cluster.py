"""An emulated multi-host Ray cluster on one machine, for tests and benchmarks (needs root).

    from tensorhub.emucluster import emulated_cluster

    with emulated_cluster(hosts=3, gbit=0.2, datacenters=[2, 1], inter_dc_gbit=0.15,
                          inter_dc_latency_ms=30) as c:
        out = c.run_driver([sys.executable, "bench.py"], timeout_s=300)   # ray.init() inside
        crossed = c.link_bytes()[(0, 1)]

Each host is a network namespace with a rate-limited NIC ``eth0`` and its own raylet (Ray
resource ``host-<k>``, plus ``dc-<d>`` with datacenters); the network is drawn in
:mod:`tensorhub.emucluster.plan`. The Ray head and the driver live in the root
namespace on datacenter 0's bridge; the head's own uplink is not shaped. Every raylet (so every
worker and actor it starts) has ``UCX_TLS=tcp``, ``UCX_NET_DEVICES=eth0`` and
``GLOO_SOCKET_IFNAME=eth0``: NIXL and gloo traffic then crosses the emulated links instead of
shared memory. The cluster has its own Ray temp dir, GCS port and auth token
(``RAY_AUTH_TOKEN_PATH``), so a plain ``ray.init()`` cluster on the same machine is untouched.

The harness never calls ``ray.init`` itself (the caller may be connected to another cluster):
drivers run as subprocesses (:meth:`EmulatedCluster.run_driver`, :meth:`driver_env`).

Lifecycle: :func:`start_cluster` writes a state file ``<state_dir>/<name>.json`` before it
creates anything and records every process it starts; :func:`teardown` (also run by the
context manager on exit, Ctrl-C or SIGTERM, and by the next start under the same name) kills
only those processes and the ones inside our namespaces, then deletes our namespaces, veths and
bridges. Ray starts as :mod:`tensorhub.emucluster.startup` says: the head, then the hosts a few
at a time, a node whose ``ray start`` failed the way a busy machine explains started again (up
to three starts in all, with a warning). The CLI is ``tensorhub cluster up|status|env|down``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple, Optional, Sequence

import msgspec

from tensorhub.emucluster import net as cluster_net, procs as cluster_procs
from tensorhub.emucluster.plan import ClusterError, ClusterSpec, NetPlan, plan_of
from tensorhub.emucluster.net import Traffic
from tensorhub.emucluster.procs import MARKER_ENV, ProcRecord, Role
from tensorhub.emucluster.startup import PROBE_TIMEOUT_S, RETRY_TIMEOUT_FACTOR, RayStarter, helper_argv, log_has

__all__ = ["ClusterError", "ClusterSpec", "EmulatedCluster", "LinkTraffic", "RETRY_TIMEOUT_FACTOR", "Traffic",
           "emulated_cluster", "start_cluster", "teardown"]

log = logging.getLogger(__name__)

STATE_VERSION = 1
DEFAULT_STATE_DIR = ClusterSpec.state_dir
WIRE_READY_LINE = b"ready\n"
POLL_S = 0.1
TEARDOWN_GRACE_S = 3.0
TEARDOWN_TIMEOUT_S = 15.0
ON_HOST_FRACTION = 0.01  # placement resource an actor takes: up to 100 actors per host


class Phase(str, enum.Enum):
    BUILDING = "building"  # resources may be half-made: teardown deletes whatever exists
    UP = "up"              # every node was alive when start_cluster returned


class ClusterState(msgspec.Struct, frozen=True):
    """The state file: everything teardown needs, written before anything is created."""

    version: int
    name: str
    run_id: str
    phase: Phase
    spec: dict
    namespaces: list[str]
    interfaces: list[str]
    workdir: str
    token_path: str
    head_port: int = 0
    processes: list[ProcRecord] = msgspec.field(default_factory=list)
    owner_pid: int = 0  # the process that started it; while it runs, no other start replaces it
    owner_start_ticks: int = 0

    @property
    def marker(self) -> str:
        return f"{self.name}:{self.run_id}"


class LinkTraffic(NamedTuple):
    """Bytes that crossed one inter-datacenter link, per direction (cumulative)."""

    a_to_b: int
    b_to_a: int

    @property
    def total(self) -> int:
        return self.a_to_b + self.b_to_a


def _state_path(name: str, state_dir: str) -> Path:
    return Path(state_dir) / f"{name}.json"


def _read_state(name: str, state_dir: str) -> Optional[ClusterState]:
    path = _state_path(name, state_dir)
    try:
        return msgspec.json.decode(path.read_bytes(), type=ClusterState)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as e:
        raise ClusterError(f"unreadable state file {path}: {e}; remove it after checking `ip netns list`") from e


def _write_state(state: ClusterState, state_dir: str) -> None:
    path = _state_path(state.name, state_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state)))
    os.replace(tmp, path)  # never a half-written state file


@contextlib.contextmanager
def _locked(name: str, state_dir: str) -> Iterator[None]:
    """Serialises start and teardown of one cluster name across processes."""
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(state_dir) / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class EmulatedCluster:
    """A handle on a running emulated cluster. Get one from :func:`start_cluster`,
    :func:`emulated_cluster` or :meth:`attach`. Hosts are numbered 0..hosts-1."""

    def __init__(self, spec: ClusterSpec, state: ClusterState,
                 popens: Sequence[subprocess.Popen] = ()) -> None:
        self.spec = spec
        self._state = state
        self._layout: NetPlan = plan_of(spec)
        self._popens = list(popens)

    @classmethod
    def attach(cls, name: str = ClusterSpec.name, state_dir: str = DEFAULT_STATE_DIR) -> "EmulatedCluster":
        """A handle on a cluster another process started (``tensorhub cluster up``).
        Raises ClusterError if there is no state file for ``name``."""
        state = _read_state(name, state_dir)
        if state is None:
            raise ClusterError(f"no emulated cluster {name!r} (no {_state_path(name, state_dir)})")
        spec_fields = dict(state.spec)
        if spec_fields.get("datacenters") is not None:
            spec_fields["datacenters"] = tuple(spec_fields["datacenters"])
        return cls(ClusterSpec(**spec_fields), state)

    # -- topology ---------------------------------------------------------------------------

    @property
    def hosts(self) -> int:
        return self.spec.hosts

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def state_path(self) -> Path:
        return _state_path(self.spec.name, self.spec.state_dir)

    @property
    def head_ip(self) -> str:
        return self._layout.head_ip

    @property
    def address(self) -> str:
        """``ip:port`` of the GCS, for ``ray.init(address=...)`` from the root namespace."""
        if not self._state.head_port:
            raise ClusterError(f"cluster {self.name!r} runs no Ray (ray=False or not started)")
        return f"{self._layout.head_ip}:{self._state.head_port}"

    def host_ip(self, k: int) -> str:
        return self._host(k).ip

    def dc_of(self, k: int) -> int:
        return self._host(k).dc

    def netns(self, k: int) -> str:
        return self._host(k).netns

    def hosts_in_dc(self, d: int) -> list[int]:
        return [h.index for h in self._layout.hosts if h.dc == d]

    def on(self, k: int) -> dict:
        """Actor/task options that place it on host k: ``Cls.options(**c.on(k)).remote()``."""
        self._host(k)
        return {"resources": {f"host-{k}": ON_HOST_FRACTION}}

    def on_head(self) -> dict:
        """Options that place an actor on the head node (root namespace, unshaped uplink)."""
        return {"resources": {"head": ON_HOST_FRACTION}}

    def on_dc(self, d: int) -> dict:
        """Options that place an actor on any host of datacenter d (needs ``datacenters``)."""
        if self.spec.datacenters is None or not 0 <= d < len(self.spec.datacenters):
            raise ClusterError(f"no datacenter {d} (datacenters={self.spec.datacenters})")
        return {"resources": {f"dc-{d}": ON_HOST_FRACTION}}

    def _host(self, k: int):
        if not 0 <= k < self.spec.hosts:
            raise ClusterError(f"no host {k}: the cluster has hosts 0..{self.spec.hosts - 1}")
        return self._layout.hosts[k]

    # -- processes ----------------------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_NODE_IP_ADDRESS", MARKER_ENV)}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self._state.token_path,
                   RAY_USAGE_STATS_ENABLED="0", UCX_TLS="tcp",
                   # UCX ignores bridge devices unless told (the head and driver sit on one).
                   UCX_TCP_BRIDGE_ENABLE="y")
        return env

    def _node_env(self, ifname: Optional[str], host: Optional[int]) -> dict[str, str]:
        """The environment of a process we start (and own: it carries the marker)."""
        env = self._base_env()
        env.update({MARKER_ENV: self._state.marker, "PYTHONUNBUFFERED": "1"})
        if ifname is not None:
            env.update(UCX_NET_DEVICES=ifname, GLOO_SOCKET_IFNAME=ifname)
        if host is not None:
            env["TENSORHUB_EMULATED_HOST"] = str(host)
        return env

    def driver_env(self) -> dict[str, str]:
        """``os.environ`` plus what a driver in the root namespace needs: ``RAY_ADDRESS`` (so a
        bare ``ray.init()`` joins this cluster), the token (``RAY_AUTH_MODE``,
        ``RAY_AUTH_TOKEN_PATH``), and ``UCX_TLS=tcp``, ``UCX_NET_DEVICES`` /
        ``GLOO_SOCKET_IFNAME`` = datacenter 0's bridge."""
        env = self._base_env()
        env.update(RAY_ADDRESS=self.address, UCX_NET_DEVICES=self._layout.bridges[0],
                   GLOO_SOCKET_IFNAME=self._layout.bridges[0])
        return env

    def run_driver(self, argv: Sequence[str], *, timeout_s: float, check: bool = False,
                   cwd: Optional[str] = None, input: Optional[str] = None) -> subprocess.CompletedProcess:
        """Runs ``argv`` in the root namespace with :meth:`driver_env`, blocking up to
        ``timeout_s`` (then the process is killed and ``subprocess.TimeoutExpired`` raised).
        Output is captured as text. ``check=True`` raises ``CalledProcessError`` on a non-zero
        exit."""
        return subprocess.run(list(argv), env=self.driver_env(), capture_output=True, text=True,
                              timeout=timeout_s, check=check, cwd=cwd, input=input)

    def worker_logs(self, pid: int, lines: int = 30) -> str:
        """The last ``lines`` of each Ray log of worker process ``pid`` on any node of this
        cluster (``worker-*-<pid>.err|out``, ``python-core-worker-*_<pid>.log``): what a test
        prints when an actor's worker died, so that the failure says why."""
        out = []
        for path in sorted(Path(self._state.workdir).rglob(f"*{pid}*")):
            if not path.is_file() or not path.name.endswith((f"-{pid}.err", f"-{pid}.out", f"_{pid}.log")):
                continue
            try:
                tail = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {path}\n" + "\n".join(tail))
        return "\n".join(out) or f"(no Ray log of worker {pid} under {self._state.workdir})"

    def host_argv(self, k: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside host k's namespace (not a Ray process: it gets no
        cluster environment unless you pass :meth:`host_env`)."""
        return ["ip", "netns", "exec", self.netns(k), *argv]

    def host_env(self, k: int) -> dict[str, str]:
        """The environment host k's raylet runs with (UCX/gloo on eth0, the token)."""
        self._host(k)
        return self._node_env("eth0", k)

    # -- counters ---------------------------------------------------------------------------

    def nic_bytes(self, k: int) -> Traffic:
        """Host k's NIC counters (sent = uploaded, received = downloaded), cumulative. Read
        from the root-side end of its veth, which sees exactly what ``eth0`` sees, mirrored."""
        t = cluster_net.dev_traffic(self._host(k).root_dev)
        return Traffic(sent=t.received, received=t.sent)

    def link_bytes(self) -> dict[tuple[int, int], LinkTraffic]:
        """Per inter-datacenter link ``(0, d)``: bytes sent dc 0 -> d and d -> 0 (cumulative).
        Empty without datacenters."""
        return {(link.dc_a, link.dc_b): LinkTraffic(a_to_b=cluster_net.dev_traffic(link.end_a).sent,
                                                    b_to_a=cluster_net.dev_traffic(link.end_b).sent)
                for link in self._layout.links}

    # -- link control -------------------------------------------------------------------------

    def set_link(self, d: int, up: bool) -> None:
        """Takes datacenter d's link to datacenter 0 down (``up=False``) or back up: its dc-0 end
        goes down, so nothing crosses in either direction (data, Ray's control plane, the
        driver's calls to actors there); TCP connections stay open and resume when it is up.
        Idempotent. Raises ClusterError if there is no such link."""
        link = next((l for l in self._layout.links if l.dc_b == d), None)
        if link is None:
            raise ClusterError(f"no link to datacenter {d} (datacenters={self.spec.datacenters})")
        cluster_net.set_up(link.end_a, up)

    @contextlib.contextmanager
    def link_cut(self, d: int) -> Iterator[None]:
        """Datacenter d's link is down inside the block and up again after it, whatever the block
        raised (see :meth:`set_link`)."""
        self.set_link(d, False)
        try:
            yield
        finally:
            self.set_link(d, True)

    # -- status and teardown ----------------------------------------------------------------

    def nodes(self, *, expect_nodes: int = 0, timeout_s: float = 0.0) -> list[dict]:
        """Ray nodes as the GCS lists them (``node_id``, ``ip``, ``alive``, ``is_head``,
        ``resources``), polled in a subprocess until ``expect_nodes`` are alive or ``timeout_s``
        passed (0: ask once). Raises ClusterError if the GCS does not answer."""
        argv = [*helper_argv("probe"), "--address", self.address, "--expect-nodes", str(expect_nodes),
                "--timeout-s", str(timeout_s)]
        p = subprocess.run(argv, env=self.driver_env(), capture_output=True, text=True,
                           timeout=timeout_s + PROBE_TIMEOUT_S)
        try:
            out = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            raise ClusterError(f"cluster probe failed (rc={p.returncode}): {p.stderr[-2000:]}") from None
        if p.returncode != 0 and out.get("error"):
            raise ClusterError(f"GCS at {self.address} does not answer: {out['error']}")
        return out["nodes"]

    def status(self, *, probe: bool = True) -> dict:
        """A JSON-able summary: spec, address, processes alive, per-host ip/dc/counters, links,
        and (``probe``) the Ray nodes alive."""
        procs = [{"role": r.role.value, "host": r.host, "pid": r.pid, "running": cluster_procs.is_same_running(r)}
                 for r in self._state.processes]
        present = cluster_net.existing_netns()
        hosts = []
        for h in self._layout.hosts:
            row = {"host": h.index, "dc": h.dc, "netns": h.netns, "ip": h.ip, "netns_present": h.netns in present}
            if row["netns_present"]:
                row.update(self.nic_bytes(h.index)._asdict())
            hosts.append(row)
        out = {"name": self.name, "phase": self._state.phase.value, "state_file": str(self.state_path),
               "spec": dataclasses.asdict(self.spec), "head_ip": self.head_ip,
               "address": self.address if self._state.head_port else None, "processes": procs, "hosts": hosts,
               "links": {f"{a}-{b}": t._asdict() for (a, b), t in self.link_bytes().items()}
               if all(cluster_net.SYS_NET.joinpath(l.end_a).exists() for l in self._layout.links) else {}}
        if probe and self._state.head_port:
            try:
                nodes = self.nodes()
                out["nodes_alive"] = sum(n["alive"] for n in nodes)
                out["nodes_expected"] = self.hosts + 1
            except (ClusterError, subprocess.TimeoutExpired) as e:
                out["nodes_error"] = str(e)
        return out

    def down(self) -> None:
        """Tears the cluster down (see :func:`teardown`). Idempotent."""
        with _locked(self.name, self.spec.state_dir):
            state = _read_state(self.name, self.spec.state_dir)
            if state is not None and state.run_id == self._state.run_id:
                _teardown_locked(state, self.spec.state_dir)
        cluster_procs.reap(self._popens)
        self._popens.clear()

    # -- startup ------------------------------------------------------------------------------

    def _record(self, rec: ProcRecord) -> None:
        self._state = msgspec.structs.replace(self._state, processes=[*self._state.processes, rec])
        _write_state(self._state, self.spec.state_dir)

    def _spawn(self, argv: Sequence[str], env: Mapping[str, str], log_name: str, role: Role, host: int):
        proc, rec = cluster_procs.spawn(argv, env, Path(self._state.workdir) / "logs" / log_name, role=role, host=host)
        self._popens.append(proc)
        self._record(rec)
        return proc, rec

    def _start_wires(self, deadline: float) -> None:
        argv = [*helper_argv("wire"), *(w.arg() for w in self._layout.wires)]
        proc, rec = self._spawn(argv, self._node_env(None, None), "wires.log", Role.WIRE, -1)
        self._wait_log(proc, rec, WIRE_READY_LINE, deadline, "delay wires")

    def _wait_log(self, proc: subprocess.Popen, rec: ProcRecord, line: bytes, deadline: float, what: str) -> None:
        while not log_has(rec.log_path, line):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"{what} did not start (rc={proc.poll()}); {rec.log_path}:\n"
                                   f"{cluster_procs.log_tail(rec.log_path)}")
            time.sleep(POLL_S)

    def _start_ray(self, deadline: float) -> None:
        wires = [r for r in self._state.processes if r.role is Role.WIRE]
        RayStarter(self.spec, self._layout, self._state.workdir, self._state.marker, spawn=self._spawn,
                   forget=self._forget, set_head_port=self._set_head_port, node_env=self._node_env,
                   driver_env=self.driver_env).start(deadline, wires)

    def _forget(self, rec: ProcRecord) -> None:
        self._state = msgspec.structs.replace(self._state, processes=[r for r in self._state.processes if r != rec])
        _write_state(self._state, self.spec.state_dir)

    def _set_head_port(self, port: int) -> None:
        self._state = msgspec.structs.replace(self._state, head_port=port)
        _write_state(self._state, self.spec.state_dir)


def start_cluster(spec: ClusterSpec) -> EmulatedCluster:
    """Builds the network and starts Ray; blocks until every node is alive or
    a node's start timeout passed (:mod:`tensorhub.emucluster.startup`: a node whose start failed
    transiently is started again, up to three times in all). First tears down what a previous run under the same name
    left behind, unless the process that started that run is still running (then raises
    ClusterError: ``tensorhub cluster down`` forces it). On any failure (or
    KeyboardInterrupt) removes what it built and re-raises.
    The cluster outlives the calling process until :func:`teardown` / :meth:`~EmulatedCluster.down`."""
    cluster_net.preflight()
    t0 = time.monotonic()
    deadline = t0 + spec.start_timeout_s
    layout = plan_of(spec)
    with _locked(spec.name, spec.state_dir):
        stale = _read_state(spec.name, spec.state_dir)
        if stale is not None:
            owner = stale.owner_pid
            if owner and owner != os.getpid() and cluster_procs.is_running(owner) \
                    and cluster_procs.start_ticks(owner) == stale.owner_start_ticks:
                raise ClusterError(f"cluster {spec.name!r} is in use by running pid {owner}; stop it, "
                                   f"or `tensorhub cluster down --name {spec.name}`, or pick another name")
            _teardown_locked(stale, spec.state_dir)
        found = cluster_net.conflicts(layout, spec.subnet)
        if found:
            raise ClusterError(f"cannot build cluster {spec.name!r}: already present and not ours: "
                               + "; ".join(found) + " (pick another name/subnet)")
        workdir = Path(spec.state_dir) / spec.name
        shutil.rmtree(workdir, ignore_errors=True)  # logs of the previous run under this name
        workdir.mkdir(parents=True)
        token_path = workdir / "auth_token"
        token_path.touch(mode=0o600)
        token_path.write_text(secrets.token_hex(32))
        state = ClusterState(version=STATE_VERSION, name=spec.name, run_id=uuid.uuid4().hex[:12], phase=Phase.BUILDING,
                             spec=dataclasses.asdict(spec), namespaces=list(layout.namespaces),
                             interfaces=list(layout.interfaces), workdir=str(workdir), token_path=str(token_path),
                             owner_pid=os.getpid(), owner_start_ticks=cluster_procs.start_ticks(os.getpid()) or 0)
        _write_state(state, spec.state_dir)
        cluster = EmulatedCluster(spec, state)
        try:
            cluster_net.build(spec, layout)
            if layout.wires:
                cluster._start_wires(deadline)
            if spec.ray:
                cluster._start_ray(deadline)
            cluster._state = msgspec.structs.replace(cluster._state, phase=Phase.UP)
            _write_state(cluster._state, spec.state_dir)
        except BaseException:
            with _signals_ignored():
                _teardown_locked(cluster._state, spec.state_dir, raise_on_failure=False)
                cluster_procs.reap(cluster._popens)
            raise
    return cluster


def teardown(name: str = ClusterSpec.name, state_dir: str = DEFAULT_STATE_DIR) -> bool:
    """Tears down cluster ``name`` from its state file: kills its processes (only those), deletes
    its namespaces, veths and bridges, removes the state file (logs stay in
    ``<state_dir>/<name>/logs`` until the next start). Idempotent; returns False if there was
    nothing to tear down. Raises ClusterError if something survives (the state file then stays,
    so a later call retries)."""
    cluster_net.preflight()
    with _locked(name, state_dir):
        state = _read_state(name, state_dir)
        if state is None:
            return False
        _teardown_locked(state, state_dir)
        return True


def _teardown_locked(state: ClusterState, state_dir: str, *, raise_on_failure: bool = True) -> None:
    survivors = cluster_procs.kill_all(state.processes, state.marker, state.namespaces,
                                       grace_s=TEARDOWN_GRACE_S, timeout_s=TEARDOWN_TIMEOUT_S)
    failed = cluster_net.destroy(state.namespaces, state.interfaces)
    if survivors or failed:
        if raise_on_failure:
            raise ClusterError(f"teardown of {state.name!r} incomplete: processes {sorted(survivors)} survive, "
                               f"could not delete {failed}; state kept in {_state_path(state.name, state_dir)}")
        return
    _state_path(state.name, state_dir).unlink(missing_ok=True)
    for spilled in Path(state.workdir).rglob("ray_spilled_objects*"):
        shutil.rmtree(spilled, ignore_errors=True)  # can be large; the logs stay for post-mortems


@contextlib.contextmanager
def emulated_cluster(hosts: int, gbit: float = 1.0, latency_ms: float = 0.0,
                     datacenters: Optional[Sequence[int]] = None, cpus_per_host: int = 2,
                     **spec_fields) -> Iterator[EmulatedCluster]:
    """Starts an emulated cluster (:func:`start_cluster`; other :class:`ClusterSpec` fields
    as keywords) and tears it down on exit, on an exception, on Ctrl-C and, while inside and
    in the main thread, on SIGTERM (turned into KeyboardInterrupt)."""
    spec = ClusterSpec(hosts=hosts, gbit=gbit, latency_ms=latency_ms,
                       datacenters=tuple(datacenters) if datacenters is not None else None,
                       cpus_per_host=cpus_per_host, **spec_fields)
    with _sigterm_as_interrupt():
        cluster = start_cluster(spec)
        try:
            yield cluster
        finally:
            with _signals_ignored():
                cluster.down()


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """Teardown is bounded (about TEARDOWN_GRACE_S + TEARDOWN_TIMEOUT_S): let it finish."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
