"""Starting an emulated cluster's Ray: the head, then every host's raylet, until the GCS lists
every node alive.

:class:`RayStarter` owns the start of one cluster: which node is at which attempt, which hosts
wait their turn, each start's deadline. It gets every process through the cluster's ``spawn``
and gives a failed one back through ``forget`` (the cluster owns the state file and its list of
processes); it never touches the network (:mod:`tensorhub.emucluster.net` built it before).

The rules, all for a busy machine (2 cores, Ray's GCS and every raylet starting at once):

- The head starts first, alone. Then the hosts, at most :data:`STARTING_AT_ONCE` at a time: a
  raylet's start is seconds of mostly CPU-bound work, and four at once on 2 cores is what made
  Ray's fixed waits run out (the CI run of 2026-12-03: a host timed out, and on its retry its
  raylet died before it registered).
- A node whose ``ray start`` failed in a way a busy machine explains (:data:`TRANSIENT_LINES`:
  Ray's own 30 s wait for its raylet to register ran out, or the raylet exited before it
  registered) is started again, up to :data:`MAX_ATTEMPTS` in all, each retry with
  :mod:`tensorhub.emucluster.raystart`'s longer wait and in a fresh temp dir. A warning of
  logger ``tensorhub.emucluster.cluster`` names the node, the reason and the wait.
- Any other exit, a node still not up at its deadline, or the last attempt failing raises
  :class:`ClusterError` with the tail of the node's ``ray start`` log and of its raylet's logs.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

from tensorhub.emucluster import procs as cluster_procs
from tensorhub.emucluster.plan import ClusterError, ClusterSpec, NetPlan
from tensorhub.emucluster.procs import ProcRecord, Role

log = logging.getLogger("tensorhub.emucluster.cluster")

HEAD_READY_LINE = b"Ray runtime started"  # what `ray start` prints once its node is registered
STARTUP_TIMEOUT_LINE = b"timed out during startup"  # Ray's own wait for its raylet (30 s, fixed) ran out
RAYLET_EXITED_LINE = b"the raylet exited before it registered"  # raystart.RayletExited
TRANSIENT_LINES = {STARTUP_TIMEOUT_LINE: "timed out during startup",
                   RAYLET_EXITED_LINE: "ended: its raylet exited before it registered"}
MAX_ATTEMPTS = 3  # starts of one node in all
STARTING_AT_ONCE = max(2, os.cpu_count() or 2)  # hosts whose `ray start` has not finished yet
RAY_NODE_WAIT_S = 30.0  # how long a plain `ray start` waits for its raylet to register (fixed in Ray)
RETRY_TIMEOUT_FACTOR = 2.0  # a node started again waits this many max(start_timeout_s, RAY_NODE_WAIT_S)
POLL_S = 0.1
TEARDOWN_TIMEOUT_S = 15.0
PROBE_TIMEOUT_S = 20.0
RAYLET_LOG_TAIL_BYTES = 1500

Spawn = Callable[[Sequence[str], Mapping[str, str], str, Role, int], "tuple[subprocess.Popen, ProcRecord]"]


class _Start(NamedTuple):
    """One attempt at starting one node."""

    proc: subprocess.Popen
    rec: ProcRecord
    attempt: int
    deadline: float


class RayStarter:
    """Starts the head and the hosts of one cluster (:meth:`start`); see the module's rules.

    ``spawn(argv, env, log_name, role, host)`` starts and records a process; ``forget(rec)``
    drops the record of a failed one; ``set_head_port(port)`` records the GCS port the hosts
    join; ``node_env(ifname, host)`` and ``driver_env()`` are the environments of a node and of
    a driver in the root namespace."""

    def __init__(self, spec: ClusterSpec, layout: NetPlan, workdir: str, marker: str, *, spawn: Spawn,
                 forget: Callable[[ProcRecord], None], set_head_port: Callable[[int], None],
                 node_env: Callable[[Optional[str], Optional[int]], dict], driver_env: Callable[[], dict]) -> None:
        self.spec, self.layout, self.workdir, self.marker = spec, layout, Path(workdir), marker
        self._spawn, self._forget, self._set_head_port = spawn, forget, set_head_port
        self._node_env, self._driver_env = node_env, driver_env
        self._address = ""
        self._wires: list[ProcRecord] = []

    def start(self, deadline: float, wires: Sequence[ProcRecord] = ()) -> None:
        """Blocks until the head and every host are up and the GCS lists ``hosts + 1`` nodes
        alive. ``deadline`` bounds the head's first attempt; each host's attempt has its own
        (``start_timeout_s`` from its spawn; longer for a retry). ``wires``: processes a failed
        head's cleanup must spare."""
        self._wires = list(wires)
        head = self._start_head(deadline)
        self._start_hosts(head)

    # -- the head -------------------------------------------------------------------------------

    def _start_head(self, deadline: float) -> _Start:
        for attempt in range(MAX_ATTEMPTS):
            proc, rec = self._spawn(self._head_argv(attempt), self._node_env(self.layout.bridges[0], None),
                                    "head.log" if attempt == 0 else f"head-{attempt}.log", Role.HEAD, -1)
            start = _Start(proc, rec, attempt, deadline)
            while not log_has(rec.log_path, HEAD_READY_LINE):
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(POLL_S)
            else:
                return start
            if proc.poll() is None or not self._may_retry(start):
                raise ClusterError(f"Ray head did not start (rc={proc.poll()}){self._again(attempt)}; "
                                   f"{rec.log_path}:\n{cluster_procs.log_tail(rec.log_path)}{self._raylet_tail(start)}")
            self._drop_failed_start(start)
            deadline = max(deadline, time.monotonic() + self.retry_wait_s() + PROBE_TIMEOUT_S)
        raise AssertionError("unreachable")

    def _head_argv(self, attempt: int) -> list[str]:
        """The command that starts the head at ``attempt``: fresh ports each attempt (the failed
        one's may linger), recorded as the cluster's GCS port."""
        spec, lay = self.spec, self.layout
        gcs_port, agent_port, client_port, dash_port = _free_ports(4)
        self._set_head_port(gcs_port)
        self._address = f"{lay.head_ip}:{gcs_port}"
        argv = [*self._ray_start(attempt), "--head", "--block", "--port", str(gcs_port),
                "--node-ip-address", lay.head_ip, "--num-cpus", str(spec.head_cpus),
                "--resources", json.dumps({"head": 1}), "--temp-dir", str(self._temp_dir(Role.HEAD, -1, attempt)),
                "--object-store-memory", str(spec.object_store_bytes_per_host),
                "--dashboard-agent-listen-port", str(agent_port), "--ray-client-server-port", str(client_port),
                "--include-dashboard", "true" if spec.include_dashboard else "false", "--disable-usage-stats"]
        if spec.include_dashboard:
            argv += ["--dashboard-host", lay.head_ip, "--dashboard-port", str(dash_port)]
        return argv

    # -- the hosts ------------------------------------------------------------------------------

    def _start_hosts(self, head: _Start) -> None:
        """Starts every host, :data:`STARTING_AT_ONCE` at a time, retrying transient failures,
        then waits for the GCS to list every node alive."""
        waiting = collections.deque((k, 0) for k in range(self.spec.hosts))
        starting: dict[int, _Start] = {}
        up: dict[int, _Start] = {}
        while waiting or starting:
            while waiting and len(starting) < STARTING_AT_ONCE:
                k, attempt = waiting.popleft()
                starting[k] = self._start_host(k, attempt)
            for k, s in list(starting.items()):
                if log_has(s.rec.log_path, HEAD_READY_LINE):
                    up[k] = starting.pop(k)
                elif s.proc.poll() is not None:
                    if not self._may_retry(s):
                        raise self._exited(s)
                    del starting[k]
                    self._drop_failed_start(s)
                    waiting.appendleft((k, s.attempt + 1))
                elif time.monotonic() > s.deadline:
                    raise self._not_up([s])
            for s in (head, *up.values()):
                if s.proc.poll() is not None:
                    raise self._exited(s)
            time.sleep(POLL_S)
        self._wait_listed(list(up.values()))

    def _start_host(self, k: int, attempt: int) -> _Start:
        log_name = f"host-{k}.log" if attempt == 0 else f"host-{k}-{attempt}.log"
        proc, rec = self._spawn(self._host_argv(k, attempt), self._node_env("eth0", k), log_name, Role.HOST, k)
        wait_s = self.spec.start_timeout_s if attempt == 0 else self.retry_wait_s() + PROBE_TIMEOUT_S
        return _Start(proc, rec, attempt, time.monotonic() + wait_s)

    def _host_argv(self, k: int, attempt: int) -> list[str]:
        """The command that starts host k's raylet at ``attempt``."""
        spec, h = self.spec, self.layout.hosts[k]
        resources = {f"host-{k}": 1}
        if spec.datacenters is not None:
            resources[f"dc-{h.dc}"] = 1
        # Own temp dir per node and attempt: raylets started at once in one session dir race
        # for the same socket names (plasma_store.N) and one aborts; a retry must not meet the
        # sockets of the attempt before it.
        return ["ip", "netns", "exec", h.netns, *self._ray_start(attempt), "--address", self._address,
                "--node-ip-address", h.ip, "--num-cpus", str(spec.cpus_per_host),
                "--resources", json.dumps(resources), "--object-store-memory",
                str(spec.object_store_bytes_per_host), "--block", "--disable-usage-stats",
                "--temp-dir", str(self._temp_dir(Role.HOST, k, attempt))]

    def _wait_listed(self, up: list[_Start]) -> None:
        """Every `ray start` said its node started: waits (bounded) for the GCS to list them."""
        argv = [*helper_argv("probe"), "--address", self._address, "--expect-nodes", str(self.spec.hosts + 1),
                "--timeout-s", str(PROBE_TIMEOUT_S)]
        p = subprocess.run(argv, env=self._driver_env(), capture_output=True, text=True,
                           timeout=2 * PROBE_TIMEOUT_S)
        if p.returncode == 0:
            return
        try:
            seen = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            seen = {"nodes": [], "error": p.stderr[-2000:]}
        alive = {n["ip"] for n in seen["nodes"] if n["alive"]}
        missing = [s for s in up if self.layout.hosts[s.rec.host].ip not in alive]
        raise self._not_up(missing, gcs=seen.get("error") or "answering")

    # -- failures and retries ---------------------------------------------------------------------

    def _may_retry(self, s: _Start) -> bool:
        return s.attempt + 1 < MAX_ATTEMPTS and self._transient(s) is not None

    def _transient(self, s: _Start) -> Optional[str]:
        try:
            text = Path(s.rec.log_path).read_bytes()
        except OSError:
            return None
        return next((why for line, why in TRANSIENT_LINES.items() if line in text), None)

    def _drop_failed_start(self, s: _Start) -> None:
        """After ``s``'s `ray start` failed transiently: kills what it left behind (in the host's
        namespace; for the head, before any host started, every process of ours but the wires),
        forgets its record and warns that it is started again."""
        rec = s.rec
        if rec.role is Role.HOST:
            left = cluster_procs.kill_namespaces([self.layout.hosts[rec.host].netns], timeout_s=TEARDOWN_TIMEOUT_S)
        else:
            left = cluster_procs.kill_all([], self.marker, [], grace_s=0.0, timeout_s=TEARDOWN_TIMEOUT_S,
                                          keep={r.pid for r in self._wires})
        who = _who(rec)
        if left:
            raise ClusterError(f"cannot start {who} again: processes {sorted(left)} of its failed `ray start` "
                               f"survive; {rec.log_path}")
        self._forget(rec)  # status lists the running attempt only
        log.warning("emulated cluster %s: %s's `ray start` %s (a busy machine); starting it again (attempt %d "
                    "of %d), waiting up to %.0f s; %s", self.spec.name, who, self._transient(s), s.attempt + 2,
                    MAX_ATTEMPTS, self.retry_wait_s(), rec.log_path)

    def _exited(self, s: _Start) -> ClusterError:
        return ClusterError(f"Ray {_who(s.rec)} exited (rc={s.proc.poll()}) during startup{self._again(s.attempt)}; "
                            f"{s.rec.log_path}:\n{cluster_procs.log_tail(s.rec.log_path)}{self._raylet_tail(s)}")

    def _not_up(self, missing: list[_Start], gcs: str = "not asked") -> ClusterError:
        tails = "\n".join(f"--- {_who(s.rec)} ({s.rec.log_path}):\n"
                          f"{cluster_procs.log_tail(s.rec.log_path, RAYLET_LOG_TAIL_BYTES)}{self._raylet_tail(s)}"
                          for s in missing[:3])
        return ClusterError(f"{len(missing)} of {self.spec.hosts} raylets not alive within the start timeout "
                            f"(start_timeout_s={self.spec.start_timeout_s}; hosts {[s.rec.host for s in missing]}; "
                            f"GCS: {gcs}):\n{tails}")

    @staticmethod
    def _again(attempt: int) -> str:
        return f" (started {attempt + 1} times; the earlier starts failed transiently)" if attempt else ""

    def _raylet_tail(self, s: _Start) -> str:
        """The tails of the raylet's own logs of attempt ``s`` (why a raylet died is there, not
        in `ray start`'s output)."""
        logs = self._temp_dir(s.rec.role, s.rec.host, s.attempt) / "session_latest" / "logs"
        out = [f"\n--- {path}:\n{cluster_procs.log_tail(str(path), RAYLET_LOG_TAIL_BYTES)}"
               for path in (logs / "raylet.out", logs / "raylet.err")
               if path.is_file() and path.stat().st_size]
        return "".join(out)

    # -- helpers --------------------------------------------------------------------------------

    def _temp_dir(self, role: Role, k: int, attempt: int) -> Path:
        base = "head" if role is Role.HEAD else f"h{k}"
        return self.workdir / (base if attempt == 0 else f"{base}-{attempt}")

    def _ray_start(self, attempt: int) -> list[str]:
        """``ray start`` for a node's first attempt; for a retry, the same waiting up to
        :meth:`retry_wait_s` for the node to register (:mod:`tensorhub.emucluster.raystart`)."""
        if attempt == 0:
            return [_ray_executable(), "start"]
        return [*helper_argv("raystart"), f"{self.retry_wait_s():.0f}", "start"]

    def retry_wait_s(self) -> float:
        """How long a node started again waits for its raylet to register."""
        return RETRY_TIMEOUT_FACTOR * max(self.spec.start_timeout_s, RAY_NODE_WAIT_S)


def _who(rec: ProcRecord) -> str:
    return f"host {rec.host}" if rec.role is Role.HOST else "the head"


def helper_argv(module: str) -> list[str]:
    """argv that runs a stdlib-only helper module of this package as a script: ``python -m
    tensorhub.emucluster.X`` would import ``tensorhub`` (and with it Ray and torch, 2 s) first."""
    return [sys.executable, str(Path(__file__).with_name(f"{module}.py"))]


def _ray_executable() -> str:
    # The `ray` next to this interpreter: a pyenv shim on PATH costs a bash and a pyenv per call.
    candidate = Path(sys.executable).parent / "ray"
    found = str(candidate) if candidate.exists() else shutil.which("ray")
    if not found:
        raise ClusterError("the `ray` command is not installed next to this Python nor on PATH")
    return found


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def log_has(path: str, needle: bytes) -> bool:
    try:
        return needle in Path(path).read_bytes()
    except OSError:
        return False
