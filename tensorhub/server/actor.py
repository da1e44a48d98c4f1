"""The reference server: a detached, named, async Ray actor over :class:`ReferenceCore`.

It decodes a msgspec request, hands it to the core with the current time, routes the core's
effects into per-client mailboxes and replies. It never touches tensor bytes. A timer task
calls ``core.tick`` every ``server_tick_s`` (lease expiry). :func:`tensorhub.server.find.server_handle`
finds the server of ``model`` by name in the configured namespace, creating it on first use;
clients reach it through :class:`tensorhub.ports.RayPort`.

Partitioning (``Config.server_per_model``, on by default): every model has its own server
actor, named ``<server_name>/<model percent-encoded>`` (:func:`tensorhub.server.naming.actor_name`). A
model's clients only ever talk to their model's server, so its request rate, table size, lease
ticks and liveness sweeps are that model's alone; no TensorHub state is shared between servers
(each is a separate process with its own event loop, and a restart of one loses only its
model's soft state; they share Ray's GCS and their nodes' CPUs). Off: one server named ``server_name`` serves every model, as before.
:func:`tensorhub.server.find.list_servers` finds every server of a namespace by its name.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from typing import Optional

import ray

from tensorhub.server.liveness import DeathWatch, RayLiveness
from tensorhub.auth import Gate
from tensorhub.config import Config
from tensorhub.core import bounds
from tensorhub.core import messages as m
from tensorhub.core.reference import ReferenceCore
from tensorhub.logs import configure_from_env
from tensorhub.server.requests import Backlog, Mailboxes, PulseHolds, apply_request, busy_hold, holdable, shed_register

log = logging.getLogger(__name__)


GONE_PROCESSES_MAX = 65536
"""How many gone processes a server remembers (about 10 MB at most)."""


def _process_key(p: Optional[m.ProcessId]) -> Optional[tuple]:
    """What names one Ray process for good: its worker id, else its actor and pid (None: not a
    Ray process, nothing to remember)."""
    if p is None or not p.job_id:
        return None
    if p.worker_id:
        return ("worker", p.worker_id)
    return ("actor", p.actor_id, p.pid) if p.actor_id else None


def _current_actor():
    """This actor's own handle, or None where the class runs outside a Ray actor (never starts
    a local Ray instance: ``get_runtime_context`` would, in a process without one)."""
    if not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None


@ray.remote(num_cpus=0, max_restarts=0)
class ReferenceServer:
    """Thin shell: ``call(request_bytes, wait_s) -> reply_bytes`` (see :mod:`tensorhub.ports`)."""

    def __init__(self, config: dict, model: str = "") -> None:
        configure_from_env()
        self.config = Config(**config)
        self.model = model
        """The model this server is partitioned to ("" : every model, ``server_per_model`` off)."""
        self.core = ReferenceCore(self.config)
        self.mail = Mailboxes()
        self._waiters: dict[str, _Waiter] = {}
        """Blocking calls waiting for an event, by client: an event wakes only its client's."""
        self._started = False
        self._ticker: Optional[asyncio.Task] = None
        self._metrics = _Metrics(model or "*")
        self._liveness = RayLiveness()
        self._swept_at = float("-inf")
        self._counts: dict[str, int] = {}
        """Calls served, by request type (and ``notes``): :meth:`counts`."""
        self._holds = PulseHolds()
        """Idle processes' pulses waiting here (``pulse_hold_s``)."""
        self._stamped_at = float("-inf")
        self._deaths: Optional[asyncio.Task] = None
        self._job_checks: set[asyncio.Task] = set()
        """Liveness checks in flight (their tasks, kept until done)."""
        self._gone_processes: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        """Processes Ray reported gone whose clients were removed (the newest
        ``GONE_PROCESSES_MAX``): they never register again (:meth:`_from_gone_process`)."""
        self._periodic: Optional[asyncio.Task] = None
        """The tick's periodic sweep, while in flight (one at a time)."""
        self._by_key: tuple = ()
        self._by: dict[str, dict[str, list[str]]] = {}
        self.pushed_deaths = 0
        """Clients removed because Ray pushed their worker's or node's death."""
        self._backlog = Backlog(self.config.lease_stretch_max_s, time.monotonic(), probed=True)
        """How far behind this server reads its queue (probes it sends itself): leases stretch
        by it (:class:`~tensorhub.server.requests.Backlog`)."""
        self._probes: set[asyncio.Task] = set()
        self._me = None
        """This actor's own handle (its probes go through it)."""
        self._gate = Gate(self.config.model_secret, model)
        """Capabilities, the model secret, bounds, one model (:mod:`tensorhub.auth`)."""
        self._refusals_unlogged = 0
        self._refusal_logged_at = float("-inf")

    async def call(self, data: bytes, wait_s: float = 0.0) -> bytes:
        """Serve one request (bare or :class:`~tensorhub.core.messages.Signed`). The gate
        comes first: a refused request releases no hold, starts no sweep, changes nothing."""
        self._start()
        if not isinstance(data, bytes) or len(data) > bounds.REQUEST_BYTES_MAX:
            return m.encode(m.ErrorReply(code="OutOfBounds", message=f"a request is bytes of at most "
                                                                     f"{bounds.REQUEST_BYTES_MAX}"))
        signed = m.decode_request(data)
        req, refused = self._gate.admit(self.core, signed)
        kind = type(req).__name__
        self._counts[kind] = self._counts.get(kind, 0) + 1
        if refused is not None:
            self._refused(kind, refused)
            return m.encode(refused)
        late = self._from_gone_process(req)
        if late is not None:
            self._refused(kind, late)
            return m.encode(late)
        shed = shed_register(req, self.core, self._backlog.behind_s(time.monotonic()), self.config, random.random())
        if shed is not None:
            self._counts["shed"] = self._counts.get("shed", 0) + 1
            self._metrics.request(kind, shed)
            return m.encode(shed)
        client_id = getattr(req, "client_id", None)
        for hold in self._holds.releases(req):
            hold.waker.set()
        if isinstance(req, m.SourceFailed):
            # Is the source a corpse? Then it goes now, and the reader's budget is not charged.
            await self._sweep_briefly(targeted=(req.source_id,))
        elif isinstance(req, m.Replicate) and time.monotonic() - self._swept_at > self.config.liveness_check_s / 2:
            await self._sweep_briefly()
        # The core runs between two awaits: one event loop, no lock needed.
        reply, woken = apply_request(self.core, self.mail, req, time.monotonic())
        reply = self._gate.answered(self.core, signed, reply)
        self._wake(woken)
        self._metrics.request(type(req).__name__, reply)
        if isinstance(req, (m.Publish, m.ReplicateDone)):
            # A version can come and go between two ticks (a short job): record it now too.
            self._metrics.table(self.core)
        if isinstance(reply, m.Waiting) and wait_s > 0 and client_id:
            ev = await self._wait_terminal(client_id, time.monotonic() + wait_s)
            if ev is not None:
                reply = ev
        elif hold_s := holdable(req, reply, wait_s, self.config.pulse_hold_max_s):
            behind = self._backlog.behind_s(time.monotonic())
            reply = await self._hold(req, busy_hold(hold_s, behind, self.config.heartbeat_interval_s,
                                                    self.config.request_timeout_s))
        return m.encode(reply)

    def _refused(self, kind: str, refusal: m.ErrorReply) -> None:
        """Count a refused request; log them at most once per 10 s (a foreign job that
        hammers the server must not flood its log). Never logs the request's contents."""
        self._metrics.request(kind, refusal)
        self._refusals_unlogged += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= 10.0:
            log.warning("model=%s refused %d request(s) since the last line, the last a %s: %s",
                        self.model or "*", self._refusals_unlogged, kind, refusal.code)
            self._refusals_unlogged, self._refusal_logged_at = 0, now

    async def _hold(self, pulse: m.Pulse, hold_s: float) -> m.PulseReply:
        """Keep an idle process's pulse until an event for it, a release or ``hold_s``
        (:class:`~tensorhub.server.requests.PulseHolds`). A hold that runs out stamps its handles as heard
        from now: the process was waiting on us until the answer leaves, and its next pulse
        gets a whole lease (plus the server's backlog) to arrive."""
        hold = self._holds.start(pulse, self.core, time.monotonic() + hold_s, time.monotonic())
        hold.waker = asyncio.Event()
        try:
            await asyncio.wait_for(hold.waker.wait(), timeout=hold_s)
        except asyncio.TimeoutError:
            if not hold.over:  # not released meanwhile (a released hold stops counting at once)
                self.core.touch(hold.client_ids, time.monotonic())
        return self._holds.answer(hold, self.core, self.mail, time.monotonic())

    async def probe(self, token: int) -> None:
        """The server's own call to itself, through the queue its clients' calls wait in: read
        now (:class:`~tensorhub.server.requests.Backlog`). Unknown tokens are ignored."""
        self._backlog.read(token)

    async def _probe(self) -> None:
        if self._me is None:  # driven outside an actor (tests): no queue to probe
            return
        token = self._backlog.arrived(time.monotonic())
        try:
            await self._me.probe.remote(token)
        except Exception:  # noqa: BLE001 - a lost probe teaches nothing; the next one will
            log.debug("backlog probe failed", exc_info=True)
            self._backlog.read(token, heard=False)

    async def _wait_terminal(self, client_id: str, deadline: float):
        """The next terminal event of ``client_id`` before ``deadline``, or None."""
        w = self._waiters.get(client_id)
        if w is None:
            w = self._waiters[client_id] = _Waiter()
        w.calls += 1
        try:
            while True:
                w.event.clear()  # before looking: a later event sets it again
                ev = self.mail.pop_terminal(client_id)
                left = deadline - time.monotonic()
                if ev is not None or left <= 0:
                    return ev
                try:
                    await asyncio.wait_for(w.event.wait(), timeout=left)
                except asyncio.TimeoutError:
                    pass
        finally:
            w.calls -= 1
            if not w.calls:
                del self._waiters[client_id]

    def _wake(self, client_ids) -> None:
        for cid in client_ids:
            w = self._waiters.get(cid)
            if w is not None:
                w.event.set()
        if self._holds.of:
            for hold in self._holds.held(client_ids, self.mail):
                hold.waker.set()

    async def notes(self, client_id: str, cap: bytes = b"") -> list[bytes]:
        """Pop ``client_id``'s background events; raises Unauthorized without its capability."""
        self._start()
        self._counts["notes"] = self._counts.get("notes", 0) + 1
        self._gate.check_notes(self.core, client_id, cap)
        return [m.encode(e) for e in self.mail.pop_background(client_id)]

    async def status(self, model: str = "", proof: bytes = b"") -> bytes:
        """The operator view (every holder): an encoded ``Status``, or an ``ErrorReply``
        (Unauthorized) on a server with a model secret unless ``proof`` is
        :func:`tensorhub.auth.operator_proof` of it for ``model``."""
        return m.encode(self._gate.operator_view(self.core, model, proof))

    async def counts(self) -> dict[str, int]:
        """Calls served so far, by request type (``Pulse``, ``Replicate``, ...) and ``notes``;
        also ``shed`` (registrations refused ``ServerBusy``: ``Config.register_shed_s``),
        ``held`` (pulses held now), ``pushed_deaths`` (clients removed on a death Ray
        pushed) and ``behind_max_ms`` (the most the server was found behind in reading its
        queue: leases stretch by it)."""
        return {**self._counts, "held": len(self._holds.of), "pushed_deaths": self.pushed_deaths,
                "behind_max_ms": int(self._backlog.max_seen_s * 1000)}

    async def ping(self) -> str:
        self._start()
        return "ok"

    def _start(self) -> None:
        if not self._started:
            self._started = True
            loop = asyncio.get_running_loop()
            self._me = _current_actor()
            # Behind counts from now: the probes start with this first call (an actor created
            # long before its first call was idle, not behind). Driven outside an actor
            # (tests) there is no queue to probe: never behind.
            stretch = self.config.lease_stretch_max_s if self._me is not None else 0.0
            self._backlog = Backlog(stretch, time.monotonic(), probed=True)
            self._ticker = loop.create_task(self._tick_loop())
            if self.config.liveness_check_s > 0:
                self._deaths = loop.create_task(DeathWatch(self._on_deaths, self._on_jobs_ended).run())

    def _clients_by(self, field: str) -> dict[str, list[str]]:
        """Client ids by one field of their :class:`ProcessId` (``worker_id``, ``node_id``,
        ``job_id``), rebuilt only after new registrations: Ray pushes every worker exit of the
        cluster, most of them not ours, and a lookup must not scan the table each time."""
        key = (id(self.core), self.core.registrations)
        if self._by_key != key:
            self._by_key, self._by = key, {}
        index = self._by.get(field)
        if index is None:
            index = self._by[field] = {}
            for cid, p in self.core.processes().items():
                value = getattr(p, field)
                if value:
                    index.setdefault(value, []).append(cid)
        return index

    def _on_jobs_ended(self, jobs: set[str]) -> None:
        """Ray reports these jobs finished: check their clients now (their actors died with the
        job unless detached), not at the next sweep."""
        by_job = self._clients_by("job_id")
        cids = tuple(cid for j in jobs for cid in by_job.get(j, ()) if cid in self.core.nodes)
        if cids:
            self._spawn_check(self._sweep(targeted=cids))

    def _on_deaths(self, workers: set[str], nodes: set[str]) -> None:
        """Ray pushed these workers' (processes') or nodes' deaths: their clients go now."""
        gone = {}
        for field, ids, what in (("node_id", nodes, "node"), ("worker_id", workers, "worker")):
            index = self._clients_by(field) if ids else {}
            for value in ids:
                for cid in index.get(value, ()):
                    gone[cid] = f"its {what} {value[:12]} died"
        gone = {cid: why for cid, why in sorted(gone.items()) if cid in self.core.nodes}
        for cid, why in gone.items():
            log.info("client %s is gone: %s", cid, why)
        self.pushed_deaths += len(gone)
        if gone:  # a death wave in one pass of the core
            self._declare_gone(gone)

    def _declare_gone(self, gone: dict[str, str]) -> None:
        """Remove these clients (``client id -> why``), whose processes Ray reports gone, and
        remember those processes: a message one of them sent before it died may still arrive,
        and its Register or Announce must not bring a corpse back as a holder (CI: a job's
        actor, declared gone with its ended job while Ray had not yet killed it, re-announced
        itself; its announcement opened a recovery window on a server that never restarted,
        and the next job's reader waited 39 s for an answer)."""
        for cid in gone:
            node = self.core.nodes.get(cid)
            key = _process_key(node.process if node is not None and not node.host else None)
            if key is not None:
                self._gone_processes[key] = None
                self._gone_processes.move_to_end(key)
        while len(self._gone_processes) > GONE_PROCESSES_MAX:
            self._gone_processes.popitem(last=False)
        self._route(self.core.declare_gone({c: f"process gone: {w}" for c, w in gone.items()}, time.monotonic()))

    def _from_gone_process(self, req: m.Request) -> Optional[m.ErrorReply]:
        """The refusal of a Register or Announce from a process declared gone (None: not one)."""
        reg = req.register if isinstance(req, m.Announce) else req if isinstance(req, m.Register) else None
        if reg is None or reg.client_id in self.core.nodes:
            return None
        key = _process_key(reg.process)
        if key is None or key not in self._gone_processes:
            return None
        return m.ErrorReply(code="UnknownClient", message=f"{reg.client_id}: its process was reported gone by Ray; "
                                                          "a gone process does not register again")

    def _route(self, effects: list[m.Deliver]) -> None:
        self._wake(self.mail.route(effects))

    async def _sweep_briefly(self, targeted: tuple[str, ...] = ()) -> None:
        """A sweep a request waits for, at most ``heartbeat_interval_s``: past that the request
        goes on without it (a reported source is then removed by the core's probe, 2.5 intervals
        after the report, sooner than a slow GCS would answer) and the sweep finishes on its own,
        applying what it finds when it does. A GCS call that hangs never holds a reader's
        report, nor its failover, until the lease runs out."""
        task = self._spawn_check(self._sweep(targeted))
        try:
            await asyncio.wait_for(asyncio.shield(task), self.config.heartbeat_interval_s)
        except asyncio.TimeoutError:
            self._counts["sweeps_slow"] = self._counts.get("sweeps_slow", 0) + 1
            log.warning("a liveness check took over %.1f s: the request goes on without it",
                        self.config.heartbeat_interval_s)

    def _spawn_check(self, check) -> asyncio.Task:
        """Run a liveness check (a coroutine) as a task of its own, kept until done; its failure
        is logged (:meth:`_swept`)."""
        task = asyncio.get_running_loop().create_task(check)
        self._job_checks.add(task)
        task.add_done_callback(self._swept)
        return task

    def _swept(self, task: asyncio.Task) -> None:
        self._job_checks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("liveness check failed", exc_info=task.exception())

    async def _sweep(self, targeted: tuple[str, ...] = ()) -> None:
        """Ask Ray which clients' processes are gone (off the event loop) and remove them."""
        if self.config.liveness_check_s <= 0:
            return
        self._swept_at = time.monotonic()
        processes = self.core.processes()
        # A process whose pulse is overdue is asked about by name (its actor may have died while
        # its job lives on): found within a few intervals, not at the end of its lease.
        # Overdue counts from what the server could have read (its backlog, as leases do).
        now = time.monotonic()
        late_s = 2 * self.config.heartbeat_interval_s + self._backlog.behind_s(now)
        targeted = tuple(targeted) + tuple(self.core.overdue(now, late_s))
        gone = await asyncio.to_thread(self._liveness.gone, processes, targeted)
        for cid, why in sorted(gone.items()):
            log.info("client %s is gone: %s", cid, why)
        if gone:
            self._declare_gone(gone)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.server_tick_s)
            if self.config.lease_stretch_max_s > 0:
                probe = asyncio.get_running_loop().create_task(self._probe())
                self._probes.add(probe)
                probe.add_done_callback(self._probes.discard)
            if self._holds.of and time.monotonic() - self._stamped_at >= self.config.heartbeat_interval_s:
                # Held pulses' handles count as heard from: stamped once per interval (the
                # freshness a source needs is 2.5 intervals), not on every tick.
                self._stamped_at = time.monotonic()
                self.core.touch(self._holds.attended(), self._stamped_at)
            now = time.monotonic()
            self._route(self.core.tick(now, self._backlog.behind_s(now)))
            self._metrics.table(self.core)
            if (self.config.liveness_check_s > 0 and time.monotonic() - self._swept_at >= self.config.liveness_check_s
                    and (self._periodic is None or self._periodic.done())):
                # Off the tick: a slow GCS must not stop leases and probes from being judged.
                # Its failure is logged (_swept); liveness is best effort, leases remain.
                self._periodic = self._spawn_check(self._sweep())


class _Waiter:
    """The blocking calls of one client waiting in the server."""

    __slots__ = ("event", "calls")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.calls = 0


class _Metrics:
    """Ray dashboard metrics (Prometheus through the Ray metrics agent)."""

    def __init__(self, served: str) -> None:
        self.served = served
        """The ``model`` tag of request counts: the server's model, "*" for a shared server."""
        try:
            from ray.util import metrics
        except ImportError:  # pragma: no cover
            self.requests = None
            return
        self.requests = metrics.Counter("tensorhub_requests", "requests handled by the reference server",
                                        ("type", "outcome", "model"))
        self.holders = metrics.Gauge("tensorhub_holders", "nodes in the reference table by state", ("model", "state"))
        self.versions = metrics.Gauge("tensorhub_latest_version", "newest available version", ("model",))
        self._shown: set[tuple[str, str]] = set()
        """(model, state) pairs whose holder gauge was last set above 0."""

    def request(self, kind: str, reply: object) -> None:
        if self.requests is not None:
            outcome = reply.code if isinstance(reply, m.ErrorReply) else "ok"
            self.requests.inc(1, tags={"type": kind, "outcome": outcome, "model": self.served})

    def table(self, core: ReferenceCore) -> None:
        if self.requests is None:
            return
        counts = core.holder_counts()
        for model, state in self._shown - counts.keys():
            self.holders.set(0, tags={"model": model, "state": state})  # the table drops empty states
        for (model, state), c in counts.items():
            self.holders.set(c, tags={"model": model, "state": state})
        self._shown = set(counts)
        for model in core.models:
            avail = core.available(model)
            if avail:
                self.versions.set(avail[-1], tags={"model": model})
