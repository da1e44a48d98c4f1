"""The reference protocol as a pure state machine.

``ReferenceCore.handle(request, now) -> (reply, effects)`` and ``tick(now) -> effects``. The
core owns the reference table (which node holds or receives which version of which shard),
version resolution, replicate transactions of sharded replicas, retention with host offload,
leases, and source scheduling. It never sleeps, never reads a clock and never does I/O: the
Ray actor and the simulator are two drivers of the same code.

Effects are ``Deliver(client_id, event)``: an outcome that reaches a client later (an
assignment once a source frees, a finished drain, an offload order, a failure, an eviction).
An event for the requesting client that arises while its own request is handled becomes the
reply itself, so a request that can finish at once costs one round trip.

Rules kept here (docs/design.md, section 1):
- a version is *committed* once every shard of one replica holds it complete; only committed
  versions with a live complete holder of every shard are *available* to version specs;
- the first shard of a replica to replicate in round ``seq`` resolves the spec; its siblings
  in that round get the same version (a transaction);
- unpublish hides the holder, waits until its readers finish, then completes (the drain);
- the last non-spot complete holder of a retained version offloads to host before unpublish;
- a client silent past ``lease_timeout_s`` is dead, and so is its whole replica (a client that a
  reader reported failed gets only ``2.5 * heartbeat_interval_s`` to heartbeat again); readers of a
  dead source are reassigned and resume from their own progress; readers of a version no one
  holds any more fail with ``VersionLost``;
- after a restart, a shard that announces a complete holding of round ``seq`` binds the round
  (siblings announced reading another version fail their read). One announced at another
  version than a sibling's completion of that round is refused (``VersionLost``; the shard stays
  registered, idle) unless the old server confirmed it (``Holding.confirmed``): a confirmed one
  wins over siblings' unconfirmed ones, which are demoted to idle (``Demoted``, their readers
  reassigned). Two confirmed ones are both kept (the old server never confirms both). Within
  the recovery window an unconfirmed completion waits (``ServerRecovering``) until every
  sibling shard of its replica has been heard from, so it meets a confirmed rival before its
  call returns; ``Demoted`` remains only for one accepted after the window. Likewise a round
  known only from announcements settles once every sibling has been heard from: inside the
  window a ``ReplicateDone`` or ``Replicate`` in it waits (``ServerRecovering``).

The state the core shares with its parts is one :class:`~tensorhub.core.table.Table`. The rules
across datacenters (offload seeding, smart skipping) are a part of their own,
:class:`~tensorhub.core.crossdc.CrossDatacenter`, that gets the table passed in; so is retention
with host copies, :class:`~tensorhub.core.retention.Retention`, that gets the table and the
functions of the core it acts through.

No request scans the table: ``tensorhub.core.index`` keeps the waiting queues, free sources and
counts per (model, version, shard), and the core keeps registries by replica, shard, host-copy
owner and model, the candidate seeders per datacenter, the rounds by replica
(:mod:`tensorhub.core.rounds`), and its clients in the order they were last heard from (lease
expiry). No removal scans it either: a death among 10,000 clients costs what it costs among
100, and a departed replica's state is forgotten (its rounds within a bound).
"""

from __future__ import annotations

import bisect
import collections
import logging
from typing import Iterable, Mapping, Optional

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core import scheduler, versions
from tensorhub.core.crossdc import CrossDatacenter
from tensorhub.core.retention import Retention
from tensorhub.core.rounds import DEPARTED_ROUNDS_LEASES, RoundTable
from tensorhub.core.table import Key, Table
from tensorhub.core.state import COMPLETE, LEGAL, SERVABLE, VISIBLE_SOURCE, ModelRecord, Node, NodeState
from tensorhub.errors import (
    InvalidState,
    LastCopyHeld,
    LayoutMismatch,
    ReplicaIncomplete,
    ServerRecovering,
    ShardTaken,
    TensorHubError,
    TransactionMismatch,
    UnknownClient,
    UnknownModel,
    VersionExpired,
    VersionLost,
    VersionNotFound,
    code_of,
)

log = logging.getLogger(__name__)

_READ_FOLLOW_UPS = frozenset({"SourceFailed", "ReplicateDone", "Progress"})
_OUTCOMES = (m.Assignment, m.UnpublishDone, m.OffloadOrder, m.Failed)


class ReferenceCore:
    """The reference table and every rule around it. Not thread-safe: one driver calls it.

    Its state shared with its parts is :attr:`table` (:class:`~tensorhub.core.table.Table`);
    :attr:`nodes`, :attr:`models`, :attr:`groups` and :attr:`index` are the table's own
    (never rebound). The rules across datacenters are the part :attr:`crossdc`, retention the
    part :attr:`retention`."""

    def __init__(self, config: Optional[Config] = None) -> None:
        self.config = config or Config()
        self.table = Table(self.config)
        self.nodes = self.table.nodes
        self.models = self.table.models
        self.groups = self.table.groups
        self.index = self.table.index
        self.crossdc = CrossDatacenter(self.table)
        """Offload seeding and smart skipping (:mod:`tensorhub.core.crossdc`)."""
        self.retention = Retention(
            self.table, add_host_copy=self._add_host_copy, drain=self._drain, finish_drain=self._finish_drain,
            complete_unpublish=self._complete_unpublish, describe=self._describe,
            keeps_dc_copy=self.crossdc.keeps_dc_copy, recovering_until=lambda: self._recovering_until,
            clients_in=lambda model: self._model_nodes[model] - self._model_hosts[model])
        """Host copies and retention (:mod:`tensorhub.core.retention`)."""
        self.txns = RoundTable(DEPARTED_ROUNDS_LEASES * self.config.lease_timeout_s)
        """The replicate rounds of sharded replicas (:mod:`tensorhub.core.rounds`: by replica;
        a departed replica's are forgotten within a bound)."""
        self._order = 0
        self._stamp = 0
        self._removed: set[str] = set()
        """Clients removed during this request: only their ``Evicted`` reaches them."""
        self._reseed: set[tuple[str, str]] = set()
        """(model, datacenter) whose offload seeding is re-checked when the request settles."""
        self._born: Optional[float] = None
        self._recovering_until = float("-inf")
        self._held_back: dict[str, tuple[str, str, int]] = {}
        """Client -> (model, replica, shard) of an unconfirmed sharded completion held back in the
        recovery window (:meth:`_holds_back`); it counts as heard from for its siblings."""
        self._window_closed = True
        self._pending_edges: dict[str, set[str]] = {}
        """After a restart: announced readers whose source has not announced itself yet."""
        # Registries beyond the table's, so that no request scans it (tensorhub/core/index.py):
        self._shards: dict[tuple[str, str, int], str] = {}
        """(model, replica, shard) -> the client holding that shard (host copies excluded)."""
        self._model_nodes: collections.Counter = collections.Counter()
        """model -> nodes (host copies included)."""
        self._model_hosts: collections.Counter = collections.Counter()
        """model -> host copies."""
        self._lease: dict[str, None] = {}
        """Clients (host copies excluded) in the order they were last heard from, oldest first:
        ``now`` never decreases, so moving a client to the end on each request keeps it sorted."""

    # ------------------------------------------------------------------ driver interface

    def handle(self, req: m.Request, now: float) -> tuple[m.Reply, list[m.Deliver]]:
        """Apply one request at time ``now``. Errors come back as ``ErrorReply`` and change
        nothing (every handler validates before it mutates)."""
        self.table.begin(now)
        self._removed = set()
        if self._born is None:
            self._born = now
        name = type(req).__name__
        if name == "Replicate" and self._read_superseded(req):
            # The handle gave that read up (its ReplicateAbort, sent without waiting, was lost):
            # apply the abort first, then this request.
            _, aborted = self.handle(m.ReplicateAbort(req.client_id), now)
            reply, effects = self.handle(req, now)
            return reply, aborted + effects
        try:
            client_id = None if isinstance(req, m.Register) else getattr(req, "client_id", None)
            if client_id is not None:
                node = self.nodes.get(client_id)
                if node is None or node.host:
                    raise UnknownClient(f"client {client_id} is not registered (expired, or the server restarted)")
                self._seen(node, now)
                node.heard_at = now
                node.unreachable = False  # it talks to us: alive, reachable from somewhere
                if node.state is NodeState.IDLE and node.failure is not None and name in _READ_FOLLOW_UPS:
                    # The read already failed (the event may not have reached the reader).
                    return m.ErrorReply(code=node.failure.code, message=node.failure.message), []
                if name == "Replicate" and req.seq > 0 and req.seq == node.round_seq:
                    retried = self._replicate_retried(node)
                    if retried is not None:
                        return retried, []
                if name in ("Publish", "Replicate"):
                    node.failure = None
                if node.state not in LEGAL[name]:
                    raise InvalidState(f"{name} is not allowed while {self._describe(node)}")
            reply = getattr(self, f"_on_{name}")(req, now)
            if client_id is not None and client_id in self.retention.probing:
                self.retention.proved(client_id)
        except TensorHubError as err:
            assert not self.table.effects, "a rejected request must not have effects"
            return m.ErrorReply(code=code_of(err), message=str(err)), []
        self._settle()
        effects = self.table.take_effects()
        client_id = getattr(req, "client_id", None)
        if isinstance(reply, m.Waiting) and client_id is not None:
            for i, eff in enumerate(effects):
                # Only an outcome of this request becomes the reply; background events
                # (DropHostCopy, Evicted) stay effects.
                if eff.client_id == client_id and isinstance(eff.event, _OUTCOMES):
                    reply = eff.event
                    del effects[i]
                    break
        return reply, effects

    def tick(self, now: float, grace_s: float = 0.0) -> list[m.Deliver]:
        """Expire clients whose lease ran out; returns the effects of their removal.
        ``grace_s`` (>= 0): how long the driver may not yet have read what clients sent it (its
        own backlog): a client counts as silent only after ``lease_timeout_s + grace_s`` (a
        reported client after ``2.5 * heartbeat_interval_s + grace_s``), so a slow server does
        not mistake its unread queue for dead clients."""
        assert grace_s >= 0, grace_s
        self.table.begin(now)
        self._removed = set()
        if self._born is None:
            self._born = now
        lease = self.config.lease_timeout_s + grace_s
        probe = 2.5 * self.config.heartbeat_interval_s + grace_s
        dead_replicas = set()
        for cid in self._lease:  # oldest first: stop at the first one still within its lease
            n = self.nodes[cid]
            if now - n.last_seen <= lease:
                break
            dead_replicas.add((n.model, n.replica_id))
        for cid in list(self.index.suspected()):
            n = self.nodes[cid]
            if n.last_seen > n.suspected_at:
                n.suspected_at = None  # it heartbeated since it was reported: alive after all
                self.index.mark(n)
            elif now - n.suspected_at > probe:
                dead_replicas.add((n.model, n.replica_id))
        for model, replica in sorted(dead_replicas):
            log.info("model=%s replica=%s lease expired or reported dead: removing the replica", model, replica)
            self._remove_replica(model, replica, reason="lease expired")
        self.txns.prune(now)
        if now >= self._recovering_until:
            self._held_back.clear()  # accepted as they are from now on
            if not self._window_closed:
                # VersionLost was held back during the window: re-check every read group once.
                self._window_closed = True
                self.table.touched.update(n.key for n in self.nodes.values() if n.state in (NodeState.WAITING, NodeState.READING))
            pending = self.index.awaiting() | self.index.draining()
            for node in sorted((self.nodes[i] for i in pending), key=lambda n: n.order):
                if node.awaiting_source is not None:
                    node.awaiting_source = None  # its source never came back: schedule it anew
                    self.index.mark(node)
                    self._pending_edges.clear()
                    self.table.touched.add(node.key)
                if node.state is NodeState.DRAINING and not node.readers:
                    self._finish_drain(node)
        for mod in self.models.values():
            for dc, (v, rid, t) in list(mod.seed_asked.items()):
                if rid and now - t >= self.config.seed_wait_s and not self.crossdc.seeder_busy(mod.name, rid):
                    # The asked seeder never started: its datacenter's waiting readers may cross
                    # (replacing the entry looks at them again).
                    self.crossdc.set_seed_asked(mod, dc, (v, "", t))
        self._settle()
        return self.table.take_effects()

    # ------------------------------------------------------------------ queries

    def declare_dead(self, client_ids, now: float, reason: str) -> list[m.Deliver]:
        """The cluster manager says the processes of ``client_ids`` are gone: remove their
        replicas now (as a lease expiry would later). Unknown ids are ignored. Returns effects."""
        return self.declare_gone({c: reason for c in client_ids}, now)

    def declare_gone(self, gone: Mapping[str, str], now: float) -> list[m.Deliver]:
        """:meth:`declare_dead` of many clients at once, each with its own reason (``client id ->
        reason``): a death wave (a node with hundreds of clients, a job's fleet) is removed in
        one pass, with one settle of the groups it touched. Cost: the removals themselves, not
        the table (no removal scans it). Unknown ids are ignored. Returns effects."""
        self.table.begin(now)
        self._removed = set()
        replicas: dict[tuple[str, str], str] = {}
        for cid in sorted(gone):
            n = self.nodes.get(cid)
            if n is not None and not n.host:
                replicas.setdefault((n.model, n.replica_id), gone[cid])
        for (model, replica), reason in sorted(replicas.items()):
            log.info("model=%s replica=%s: %s", model, replica, reason)
            self._remove_replica(model, replica, reason=reason)
        self._settle()
        return self.table.take_effects()

    def holder_counts(self) -> dict[tuple[str, str], int]:
        """Nodes by (model, state value), kept by the index (no scan of the table)."""
        self.index.flush()
        return dict(self.index.state_counts)

    def overdue(self, now: float, after_s: float, limit: int = 256) -> list[str]:
        """Clients not heard from for ``after_s`` (oldest first, at most ``limit``; host copies
        excluded): the server asks Ray whether their process is gone before their lease runs
        out. Walks the lease order from its oldest end: nothing to walk when all are current."""
        out = []
        for cid in self._lease:
            n = self.nodes.get(cid)
            if n is None:
                continue
            if now - n.last_seen < after_s or len(out) >= limit:
                break
            if not n.host:
                out.append(cid)
        return out

    def touch(self, client_ids, now: float) -> None:
        """Count ``client_ids`` as heard from at ``now`` for their lease (the server holds their
        process's pulse: the process is waiting on us). Not a proof that the process is alive
        (retention asks for one, ``Probe``). Unknown ids are skipped."""
        for cid in client_ids:
            n = self.nodes.get(cid)
            if n is not None and not n.host:
                self._seen(n, now)

    @property
    def registrations(self) -> int:
        """Grows with every client (and host copy) added: a cache of :meth:`processes` built
        at one value still holds every client registered since (removed ones it may still
        name: look them up)."""
        return self._order

    def processes(self) -> dict[str, m.ProcessId]:
        """The process of every registered client (host copies excluded)."""
        return {n.id: n.process for n in self.nodes.values() if not n.host}

    def available(self, model: str) -> list[int]:
        """Committed, retained versions with a visible complete holder of every shard."""
        mod = self.models.get(model)
        if mod is None:
            return []
        out = []
        for v in mod.committed:
            if v < mod.forgotten_below:
                continue
            if all(self._has_visible(model, v, i) for i in range(mod.num_shards)):
                out.append(v)
        return out

    def retained(self, model: str) -> list[int]:
        """Committed versions of ``model`` not yet forgotten (retention), oldest first."""
        return self.table.retained(model)

    def status(self, model: str = "", layouts: bool = False) -> m.Status:
        """The table as :class:`~tensorhub.core.messages.Status`: every model, or ``model`` only;
        ``layouts``: with each model's known shard layouts."""
        views = []
        for name in sorted(self.models):
            if model and name != model:
                continue
            mod = self.models[name]
            holders = tuple(
                m.HolderView(
                    client_id=n.id, replica_id=n.replica_id, shard=n.shard, datacenter=n.datacenter,
                    spot=n.spot, host=n.host, state=n.state.value, version=n.version,
                    progress=n.progress, readers=len(n.readers), source=n.source or "",
                    units=n.layout.unit_count, total_bytes=n.layout.total_bytes,
                )
                for n in sorted(self.nodes.values(), key=lambda n: n.order)
                if n.model == name
            )
            views.append(m.ModelView(
                model=name, num_shards=mod.num_shards, available=tuple(self.available(name)),
                committed=tuple(self.retained(name)), holders=holders,
                layouts=tuple(m.ShardLayout(i, mod.layouts[i]) for i in sorted(mod.layouts)) if layouts else (),
            ))
        return m.Status(models=tuple(views))

    # ------------------------------------------------------------------ requests

    def _on_Query(self, req: m.Query, now: float) -> m.Reply:
        return self.status(req.model, layouts=req.layouts)

    def _on_Register(self, req: m.Register, now: float) -> m.Reply:
        existing = self.nodes.get(req.client_id)
        if existing is not None:
            if self._registration_of(existing) == req:
                return m.Registered(round_seq=self._rounds_done(req))
            raise InvalidState(f"client {req.client_id} is already registered with other parameters")
        self._check_registration(req)
        if req.num_shards > 1 and now < self._recovering_until:
            if self._unheard_shards(req.model, req.replica_id, req.num_shards) - {req.shard}:
                # After a restart the replica's rounds are known only from its shards'
                # announcements: a fresh process waits for them to count on with its siblings.
                raise ServerRecovering(f"{req.model} replica {req.replica_id}: siblings of shard {req.shard} "
                                       f"are still re-announcing; retry")
        self._add_node(req, now)
        mod = self.models[req.model]
        if not req.stage_for and mod.committed:
            asked = mod.seed_asked.get(req.datacenter)
            if asked is None or asked[0] < mod.committed[-1]:
                self._reseed.add((req.model, req.datacenter))  # perhaps a datacenter to seed
        return m.Registered(round_seq=self._rounds_done(req))

    def _rounds_done(self, req: m.Register) -> int:
        """The rounds of this shard's replica that a (restarted) process of this shard counts as
        behind it: its first replicate joins the newest round while a sibling is still reading in
        it, else starts the next one. A best effort: only the caller knows for sure which round a
        restarted process is in (``replicate(..., round=)``)."""
        rounds = self.txns.of(req.model, req.replica_id)
        if not rounds:
            return 0
        newest = max(rounds)
        version = rounds[newest][1]
        inside = any(n.shard != req.shard and n.state in (NodeState.WAITING, NodeState.READING) and n.version == version
                     for n in self.table.replica_nodes(req.model, req.replica_id))
        return newest - 1 if inside else newest

    def _on_Announce(self, req: m.Announce, now: float) -> m.Reply:
        """A client re-registers after a server restart (or an eviction) with what it holds.
        The first announcement opens a recovery window of one lease: drains do not complete
        before it ends, so a reader that is still copying from a holder under the old server
        has time to announce that edge before the holder may write its tensors."""
        reg, hold = req.register, req.holding
        fresh = reg.client_id not in self.nodes
        if fresh:
            self._check_registration(reg)
            self._recovering_until = max(self._recovering_until, self._born + self.config.lease_timeout_s)
            self._window_closed = False
        if self._holds_back(reg, hold, now):
            if fresh:
                self._held_back[reg.client_id] = (reg.model, reg.replica_id, reg.shard)
            else:
                self._seen(self.nodes[reg.client_id], now)
            raise ServerRecovering(
                f"{reg.model} replica {reg.replica_id}: shard {reg.shard}'s unconfirmed completion of version "
                f"{hold.published} waits for its siblings to re-announce; retry")
        self._held_back.pop(reg.client_id, None)
        if fresh:
            self._add_node(reg, now)
        node = self.nodes[reg.client_id]
        self._seen(node, now)
        node.heard_at = now
        refused = self._conflicting_completion(node, hold)
        completes = refused is None and hold.published is not None
        if completes and node.state is NodeState.IDLE:
            self._set_version(node, hold.published, NodeState.PUBLISHED, node.units)
            self._maybe_commit(node)
        elif completes and node.state in (NodeState.WAITING, NodeState.READING) and node.version == hold.published:
            self._complete_read(node)  # an earlier announcement saw the read still in progress
        elif refused is not None:
            # Kept registered, holding nothing of this round (an earlier announcement's read of
            # that version ends here too).
            if node.state in (NodeState.WAITING, NodeState.READING) and node.version == hold.published:
                self._stop_reading(node)
                node.failure = m.Failed(code=code_of(refused), message=str(refused))
        elif hold.reading_version >= 0 and node.state is NodeState.IDLE:
            node.round_seq = hold.txn_seq
            self._set_version(node, hold.reading_version, NodeState.WAITING, max(0, min(hold.reading_units, node.units)))
            self._stamp += 1
            node.stamp = self._stamp
            self.index.mark(node)
            src = self.nodes.get(hold.reading_source)
            if src is not None and src.version == hold.reading_version and src.state is not NodeState.IDLE:
                self._attach(node, src)
            elif hold.reading_source and hold.reading_source not in self.nodes:
                # Its source has not announced yet: wait for it (it may bring the edge back). One
                # that announced already without this version is no source: queue normally.
                node.awaiting_source = hold.reading_source
                self.index.mark(node)
                self._pending_edges.setdefault(hold.reading_source, set()).add(node.id)
        for rid in sorted(self._pending_edges.pop(node.id, ())):
            reader = self.nodes.get(rid)
            if reader is not None and reader.state is NodeState.WAITING and reader.awaiting_source == node.id:
                reader.awaiting_source = None
                self.index.mark(reader)
                if reader.version == node.version:
                    self._attach(reader, node)
        for version, endpoint in hold.host_copies:
            self.retention.announced_host_copy(node, version, endpoint)
        if completes and node.version == hold.published and node.state in COMPLETE:
            node.unconfirmed = None if hold.confirmed or hold.txn_seq < 0 else (hold.txn_seq, hold.published)
        if refused is not None:
            return m.ErrorReply(code=code_of(refused), message=str(refused))
        if hold.txn_seq >= 0 and node.num_shards > 1:
            key = (node.model, node.replica_id, hold.txn_seq)
            txn = self.txns.get(key)
            completed = hold.published is not None and hold.published == hold.txn_version
            if txn is None or (completed and txn[1] != hold.txn_version and not self._round_completed(node, txn)):
                # A shard that completed its round binds it; siblings that announced another
                # version were still reading one the round had moved away from (it was lost and
                # the round re-resolved before the restart): their read fails, their retry joins.
                txn = self.txns[key] = ("announced", hold.txn_version, set())
            if txn[1] == hold.txn_version:
                txn[2].add(node.shard)
        return m.Ok()

    def _holds_back(self, reg: m.Register, hold: m.Holding, now: float) -> bool:
        """Whether an unconfirmed completion of a sharded round waits (``ServerRecovering``):
        inside the recovery window, until every sibling shard of its replica has been heard
        from. A confirmed sibling completion of another version announced after it would demote
        it, but by then the caller's ``replicate()`` had already returned; held back, it meets
        that sibling first and is refused instead (:meth:`_conflicting_completion`)."""
        if (hold.confirmed or hold.published is None or hold.txn_seq < 0 or reg.num_shards <= 1
                or hold.published != hold.txn_version or now >= self._recovering_until):
            return False
        return bool(self._unheard_shards(reg.model, reg.replica_id, reg.num_shards) - {reg.shard})

    def _round_unsettled(self, node: Node, spec: object) -> bool:
        """Inside the recovery window, ``node``'s round is known only from announcements
        (``spec == "announced"``) and a sibling has not re-announced yet: it may bring the old
        server's confirmed completion of the round at another version, which binds the round."""
        return (spec == "announced" and self.table.now < self._recovering_until
                and bool(self._unheard_shards(node.model, node.replica_id, node.num_shards) - {node.shard}))

    def _unheard_shards(self, model: str, replica_id: str, num_shards: int) -> set[int]:
        """Shards of a replica that neither registered/announced nor wait held back."""
        heard = {n.shard for n in self.table.replica_nodes(model, replica_id)}
        heard.update(shard for mod, rid, shard in self._held_back.values() if (mod, rid) == (model, replica_id))
        return set(range(num_shards)) - heard

    def _conflicting_completion(self, node: Node, hold: m.Holding) -> Optional[VersionLost]:
        """An announced completion of round ``hold.txn_seq`` at a version other than the one a
        sibling shard already completed in that round (each shard's ``ReplicateDone`` met the
        restart, one of them after the old server had failed its read and moved the round):
        an unconfirmed one is refused (returned); a confirmed one demotes siblings whose
        completions were all unconfirmed (they lose to it) and is accepted."""
        if (hold.published is None or hold.txn_seq < 0 or node.num_shards <= 1
                or hold.published != hold.txn_version):
            return None
        txn = self.txns.get((node.model, node.replica_id, hold.txn_seq))
        if txn is None or txn[1] == hold.published:
            return None
        _, version, consumed = txn
        rivals = [n for n in self.table.replica_nodes(node.model, node.replica_id)
                  if n.id != node.id and n.shard in consumed and n.version == version and n.state in COMPLETE]
        if not rivals:
            return None
        where = (f"{self._describe(node)}: round {hold.txn_seq} of replica {node.replica_id} completed version "
                 f"{version} on shard {min(n.shard for n in rivals)}")
        if not hold.confirmed:
            return VersionLost(f"{where}; this unconfirmed completion of version {hold.published} is refused")
        if all(n.unconfirmed == (hold.txn_seq, version) for n in rivals):
            for n in sorted(rivals, key=lambda n: n.order):
                log.info("model=%s version=%d %s: unconfirmed completion demoted", n.model, n.version, n.id)
                self._stop_reading(n)  # its readers (if any) are reassigned
                n.unconfirmed = None
                self.table.deliver(n.id, m.Demoted(version=version, reason=(
                    f"round {hold.txn_seq} of replica {node.replica_id}: shard {node.shard}'s confirmed "
                    f"completion of version {hold.published} wins over this unconfirmed one")))
        return None

    def _round_completed(self, node: Node, txn: tuple[object, int, set[int]]) -> bool:
        """Whether a sibling shard of ``node`` that took ``txn``'s version holds all of it."""
        _, version, consumed = txn
        return any(n.id != node.id and n.shard in consumed and n.version == version and n.state in COMPLETE
                   for n in self.table.replica_nodes(node.model, node.replica_id))

    def _on_Heartbeat(self, req: m.Heartbeat, now: float) -> m.Reply:
        return m.Ok()

    def _on_Publish(self, req: m.Publish, now: float) -> m.Reply:
        node = self.nodes[req.client_id]
        if req.version < 0:
            raise InvalidState(f"version {req.version} is negative")
        if node.state is NodeState.PUBLISHED:
            if node.version == req.version:
                return m.Ok()
            raise InvalidState(f"{self._describe(node)}: unpublish() before publishing version {req.version}")
        mod = self.models[node.model]
        if req.version < mod.forgotten_below:
            raise VersionExpired(f"{node.model}: version {req.version} is older than the retained versions")
        self._set_version(node, req.version, NodeState.PUBLISHED, node.units)
        self._maybe_commit(node)
        return m.Ok()

    def _on_Unpublish(self, req: m.Unpublish, now: float) -> m.Reply:
        node = self.nodes[req.client_id]
        if node.state is NodeState.IDLE:
            return m.UnpublishDone(version=-1)
        if node.state is NodeState.OFFLOADING:
            return m.OffloadOrder(version=node.version)  # a retry: the order may have been lost
        if node.state is NodeState.DRAINING:
            return m.Waiting(version=node.version)
        self._begin_unpublish(node)
        return m.Waiting(version=node.version)

    def _read_superseded(self, req: m.Replicate) -> bool:
        """Whether ``req`` asks for a later round than the read its node is still doing (or
        waits to start after an update's drain). A handle runs one operation at a time and
        ends every read it asked for on the server (rules 1 and 3 of
        :mod:`tensorhub.core.handle`), so that read was given up: only its ``ReplicateAbort``
        (sent without waiting for a reply) never arrived. Kept, the read would go on for
        nobody, and its source could never drain."""
        node = self.nodes.get(req.client_id)
        if node is None or node.host or req.seq <= 0 or req.seq <= node.round_seq:
            return False
        return node.state in (NodeState.WAITING, NodeState.READING) or (node.state is NodeState.DRAINING and node.pending_read is not None)

    def _replicate_retried(self, node: Node) -> Optional[m.Reply]:
        """A ``Replicate`` with the seq of the read this node is already doing is the same
        request again: its reply was lost (a cut link, a slow server) and the client sent it
        anew after a reconnect, while the first one had arrived. It gets that read's outcome
        again instead of ``InvalidState``, which would leave the node reading for nobody (and
        its datacenter skipping to a seed that never lands). None: not such a retry."""
        if node.state is NodeState.READING:
            return self._assignment(node)
        if node.state is NodeState.WAITING:
            return m.Waiting(version=node.version)
        if node.pending_read is not None:
            if node.state is NodeState.OFFLOADING:
                return m.OffloadOrder(version=node.version)
            if node.state is NodeState.DRAINING:
                return m.Waiting(version=node.pending_read[0])
        return None

    def _on_Replicate(self, req: m.Replicate, now: float) -> m.Reply:
        node = self.nodes[req.client_id]
        if node.state is NodeState.PUBLISHED and not req.update:
            raise InvalidState(f"{self._describe(node)}: unpublish() first, or use update()")
        node.in_flight = -1
        version = self._resolve_in_txn(node, req)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("model=%s reader=%s (%s, %s %s) asks %r: version %d%s", node.model, node.id, node.datacenter,
                      node.state.name, node.version, req.spec, version,
                      f" (skipping {node.in_flight} in flight)" if node.in_flight >= 0 else "")
        node.round_seq = req.seq
        if node.state is NodeState.PUBLISHED and node.version == version:
            return m.NoChange(version=version, in_flight=node.in_flight)
        resume = req.resume_units if req.resume_version == version else 0
        if node.state is NodeState.PUBLISHED:
            node.pending_read = (version, resume)
            self._begin_unpublish(node)
        else:
            self._enqueue_read(node, version, resume)
        return m.Waiting(version=version)

    def _on_SourceFailed(self, req: m.SourceFailed, now: float) -> m.Reply:
        node = self.nodes[req.client_id]
        node.progress = max(0, min(req.units_done, node.units))
        self.index.mark(node)
        node.failed_gone = req.source_id not in self.nodes
        if node.state is NodeState.WAITING:
            if node.awaiting_source == req.source_id:
                # Announced after a restart as reading from this source, which it has since found
                # failed: do not restore that edge when the source announces; schedule anew.
                node.awaiting_source = None
                self.index.mark(node)
                node.suspects.add(req.source_id)
                self.table.touched.add(node.key)
            return m.Waiting(version=node.version)
        if node.source != req.source_id:
            return self._assignment(node)  # already moved on; repeat the current one
        log.info("model=%s version=%d reader=%s reports source %s failed at unit %d",
                 node.model, node.version, node.id, req.source_id, node.progress)
        node.suspects.add(req.source_id)
        src = self.nodes.get(req.source_id)
        if src is not None and not src.host and src.suspected_at is None:
            src.suspected_at = now
            self.index.mark(src)
        if src is not None and req.unreachable:
            src.unreachable = True
        self._detach_from_source(node)
        self._wait(node)
        return m.Waiting(version=node.version)

    def read_failed(self, client_id: str) -> bool:
        """The server failed ``client_id``'s last read (a later Progress, SourceFailed or
        ReplicateDone of it is answered with that failure)."""
        node = self.nodes.get(client_id)
        return node is not None and node.state is NodeState.IDLE and node.failure is not None

    def _on_Progress(self, req: m.Progress, now: float) -> m.Reply:
        node = self.nodes[req.client_id]
        node.progress = max(node.progress, min(req.units_done, node.units))
        self.index.mark(node)
        return m.Ok()

    def _on_ReplicateDone(self, req: m.ReplicateDone, now: float) -> m.Reply:
        node = self.nodes[req.client_id]
        if node.version != req.version:
            raise InvalidState(f"{self._describe(node)}: done reported for version {req.version}")
        txn = self.txns.get((node.model, node.replica_id, node.round_seq)) if node.num_shards > 1 else None
        if txn is not None and txn[1] == node.version and self._round_unsettled(node, txn[0]):
            # This read completes once every sibling has re-announced (if one brings a confirmed
            # completion at another version, this read then ends VersionLost).
            raise ServerRecovering(f"{self._describe(node)}: round {node.round_seq} of replica {node.replica_id} "
                                   f"waits for its siblings to re-announce; retry")
        if txn is not None and txn[1] != node.version:
            # The round moved to another version while this shard was still reading (its version
            # was lost and a sibling's retry re-resolved the round; a server restart can hide
            # that the read had been failed): finishing it would split the replica.
            err = VersionLost(f"{self._describe(node)}: round {node.round_seq} of replica {node.replica_id} "
                              f"moved to version {txn[1]} during this read of {req.version}")
            self._fail_read(node, err)
            return m.ErrorReply(code=code_of(err), message=str(err))
        self._complete_read(node)
        return m.Ok()

    def _complete_read(self, node: Node) -> None:
        """The reader has every unit (verified by itself); it is a holder now. Also legal while
        WAITING: its source may have died just as the last unit arrived."""
        # A holder first, then detach: the drain of the source may end here, and its
        # retention check must count this reader as a holder already.
        self._set_version(node, node.version, NodeState.PUBLISHED, node.units)
        self._detach_from_source(node)
        node.suspects.clear()
        node.awaiting_source = None
        self.index.mark(node)
        self._maybe_commit(node)
        self.retention.ask_host_copy(node)

    def _on_Swap(self, req: m.Swap, now: float) -> m.Reply:
        """The handle takes over its complete staging copy's memory (see :class:`m.Swap`)."""
        x, y = self.nodes[req.client_id], self.nodes.get(req.stage_id)
        why = ""
        if (req.endpoint and x.endpoint == req.endpoint and x.state is NodeState.PUBLISHED and x.version == req.version
                and y is not None and y.stage_for == x.id):
            return m.Ok()  # this swap again (its answer was lost): made already
        if x.state is not NodeState.IDLE:
            raise InvalidState(f"Swap is not allowed while {self._describe(x)}")
        if y is None or y.host or y.stage_for != x.id:
            why = f"{req.stage_id} is not this handle's staging copy"
        elif x.num_shards > 1:
            why = "sharded replicas read in rounds: they copy"
        elif y.state is not NodeState.PUBLISHED or y.version != req.version:
            why = f"the staging copy is {y.state.value} at version {y.version}, not complete at {req.version}"
        elif y.readers:
            why = f"the staging copy has {len(y.readers)} reader(s)"
        else:
            v = self._resolve(x, req.spec)
            if v != req.version:
                why = f"{req.spec!r} is version {v} now"
        if why:
            raise InvalidState(f"{self._describe(x)}: swap refused: {why}")
        x.endpoint, y.endpoint = y.endpoint, x.endpoint
        if y.copy_asked >= 0:  # its retention copy would now come from nowhere: ask the handle
            y.copy_asked = -1
        self._set_version(y, -1, NodeState.IDLE, 0)
        self._set_version(x, req.version, NodeState.PUBLISHED, x.units)
        self._maybe_commit(x)
        self.retention.ask_host_copy(x)
        return m.Ok()

    def _on_ReplicateAbort(self, req: m.ReplicateAbort, now: float) -> m.Reply:
        """The handle gave up its read. An ``update()`` that gives up while its old version is
        still draining (no byte of the new one written: the read is only ``pending_read``) takes
        the update back: the node publishes its old version again, as the handle's tensors still
        hold it (the handle then re-publishes it, rule 3 of :mod:`tensorhub.core.handle`).
        Refusing the abort instead would leave the server reading for nobody once the drain
        ends, and the source it reads from could never drain."""
        node = self.nodes[req.client_id]
        if node.state is NodeState.DRAINING:
            if node.pending_read is None:
                raise InvalidState(f"{self._describe(node)}: unpublishing, no read to abort")
            node.pending_read = None
            self.retention.end_proof_wait(node)
            node.state = NodeState.PUBLISHED
            self.index.mark(node)
            self.table.touched.add(node.key)
            return m.Ok()
        self._stop_reading(node)
        return m.Ok()

    def _on_Leave(self, req: m.Leave, now: float) -> m.Reply:
        if not req.drop_last_copy:
            held = self.retention.last_copies(self.nodes[req.client_id])
            if held:
                raise LastCopyHeld(
                    f"{self._describe(self.nodes[req.client_id])} serves the last live non-spot copy of "
                    f"retained version(s) {held} while other clients of the model remain: the handle stays open "
                    f"(close(drop_last_copy=True) drops it)")
        self._remove(req.client_id)
        self._forget_empty_models()
        return m.Ok()

    def _on_OffloadDone(self, req: m.OffloadDone, now: float) -> m.Reply:
        return self.retention.on_offload_done(req)

    def _on_HostCopy(self, req: m.HostCopy, now: float) -> m.Reply:
        return self.retention.on_host_copy(req)

    # ------------------------------------------------------------------ registration

    def _check_registration(self, req: m.Register) -> None:
        if req.num_shards < 1 or not 0 <= req.shard < req.num_shards:
            raise LayoutMismatch(f"shard {req.shard} of {req.num_shards} is out of range")
        if req.layout.unit_count < 1:
            raise LayoutMismatch(f"{req.model}: a layout needs at least one transfer unit")
        mod = self.models.get(req.model)
        if mod is not None:
            if mod.num_shards != req.num_shards:
                raise LayoutMismatch(f"{req.model} has {mod.num_shards} shards per replica, not {req.num_shards}")
            known = mod.layouts.get(req.shard)
            if known is not None and (known.fingerprint, known.unit_count) != (req.layout.fingerprint, req.layout.unit_count):
                raise LayoutMismatch(f"{req.model} shard {req.shard}: {_first_difference(known, req.layout)}")
        holder = self._shards.get((req.model, req.replica_id, req.shard))
        if holder is not None:
            raise ShardTaken(f"{req.model} replica {req.replica_id} shard {req.shard} is held by client {holder}")

    def _add_node(self, req: m.Register, now: float) -> Node:
        mod = self.models.get(req.model)
        if mod is None:
            mod = self.models[req.model] = ModelRecord(req.model, req.num_shards)
        mod.layouts.setdefault(req.shard, req.layout)
        self._order += 1
        node = Node(
            id=req.client_id, model=req.model, replica_id=req.replica_id, shard=req.shard,
            num_shards=req.num_shards, datacenter=req.datacenter, spot=req.spot,
            layout=req.layout, endpoint=req.endpoint, order=self._order, last_seen=now, heard_at=now,
            process=req.process, machine=req.machine, stage_for=req.stage_for,
        )
        self.nodes[node.id] = node
        self._shards[(node.model, node.replica_id, node.shard)] = node.id
        self.table.replicas.setdefault((node.model, node.replica_id), set()).add(node.id)
        self.crossdc.candidates.update(node.model, node.replica_id, self.table.replica_nodes(node.model, node.replica_id),
                              node.num_shards)
        self.txns.returned(node.model, node.replica_id)
        self._model_nodes[node.model] += 1
        self._lease[node.id] = None
        self.index.mark(node)
        return node

    def _add_host_copy(self, owner: Node, version: int, endpoint: bytes) -> None:
        """``owner``'s host copy of ``version`` becomes a node of its own (``<owner>#host<version>``),
        published and served by ``owner``'s process (retention decides when)."""
        hid = f"{owner.id}#host{version}"
        if hid in self.nodes:
            return
        self._order += 1
        host = Node(
            id=hid, model=owner.model, replica_id=f"{owner.replica_id}#host", shard=owner.shard,
            num_shards=owner.num_shards, datacenter=owner.datacenter, spot=False,
            layout=owner.layout, endpoint=endpoint, order=self._order, host=True, owner=owner.id,
            machine=owner.machine,
        )
        self.nodes[hid] = host
        self._model_nodes[host.model] += 1
        self._model_hosts[host.model] += 1
        self.table.hosts_of.setdefault(owner.id, set()).add(hid)
        self._set_version(host, version, NodeState.PUBLISHED, host.units)
        self._maybe_commit(host)
        log.info("model=%s version=%d shard=%d host copy published by %s", host.model, version, host.shard, owner.id)

    def _registration_of(self, n: Node) -> m.Register:
        return m.Register(
            client_id=n.id, model=n.model, replica_id=n.replica_id, shard=n.shard,
            num_shards=n.num_shards, layout=n.layout, endpoint=n.endpoint,
            datacenter=n.datacenter, spot=n.spot, process=n.process, machine=n.machine,
            stage_for=n.stage_for,
        )

    # ------------------------------------------------------------------ versions

    def _set_version(self, node: Node, version: int, state: NodeState, progress: int) -> None:
        if node.version >= 0:
            group = self.groups.get(node.key)
            if group is not None:
                group.discard(node.id)
                if not group:
                    del self.groups[node.key]
            self.table.touched.add(node.key)
        node.version, node.state, node.progress = version, state, progress
        self.index.mark(node)
        if version >= 0:
            self.groups.setdefault(node.key, set()).add(node.id)
            self.table.touched.add(node.key)

    def _has_visible(self, model: str, version: int, shard: int) -> bool:
        """A source now, or one about to publish a host copy (OFFLOADING): a reader resolving
        to such a version waits a moment for the copy instead of failing."""
        g = self.table.group((model, version, shard))
        return any(g.counts[s] for s in SERVABLE)

    def _maybe_commit(self, node: Node) -> None:
        """Commit ``node``'s version once every shard of its replica holds it complete and visible.
        Host copies count for their owner's replica: only a committed version is ever offloaded,
        so after a restart they bring its commit back (the replica's GPU copies may have moved on).
        A draining or offloading shard still holds its version whole and counts too: after a
        restart a holder re-announces and at once re-sends the unpublish it had in flight, before
        its siblings announce; left out, the version would never commit again, so its drains
        would end without the offload that keeps it."""
        mod = self.models[node.model]
        v = node.version
        if v in mod.committed:
            return
        owner = self.nodes.get(node.owner) if node.host else node
        if owner is None:
            return
        replica = owner.replica_id
        covered = set()
        for shard in range(mod.num_shards):  # the holders of v before it commits: a few
            for i in self.groups.get((node.model, v, shard), ()):
                n = self.nodes[i]
                if n.state not in COMPLETE:
                    continue
                n_owner = self.nodes.get(n.owner) if n.host else n
                if n_owner is not None and n_owner.replica_id == replica:
                    covered.add(n.shard)
        if len(covered) == mod.num_shards:
            self._commit(node.model, v, replica)

    def _commit(self, model: str, v: int, by: str) -> None:
        mod = self.models[model]
        if v < mod.forgotten_below:
            return
        mod.committed.append(v)
        mod.committed.sort()
        replica = self.table.replica_nodes(model, by)
        if replica:
            mod.origin_dc[v] = replica[0].datacenter
        log.info("model=%s version=%d committed by replica %s", model, v, by)
        self.crossdc.seed_remote(model)
        keep = self.config.versions_retained
        if len(mod.committed) > keep:
            mod.forgotten_below = max(mod.forgotten_below, mod.committed[-keep])
            for old in [c for c in mod.committed if c < mod.forgotten_below]:
                mod.committed.remove(old)
                self.retention.forget(model, old)
            self.retention.forget_below(model, mod.forgotten_below)

    def _resolve(self, node: Node, spec: m.VersionSpec) -> int:
        try:
            version = self._resolve_now(node, spec)
        except (VersionNotFound, UnknownModel, VersionExpired) as err:
            if self.table.now < self._recovering_until:
                raise ServerRecovering(f"{err} (holders are still re-announcing after a server restart)") from None
            raise
        if (self.table.now < self._recovering_until and not isinstance(spec, int)
                and version == max(self.available(node.model))
                and not any(self.nodes[i].state in VISIBLE_SOURCE and not self.nodes[i].host
                            for i in self.groups.get((node.model, version, node.shard), ()))):
            # The newest version known is held by host copies alone: those are retained older
            # versions, so the holders of the newer ones have not re-announced yet.
            raise ServerRecovering(f"{node.model}: newest known version {version} is held by host copies only "
                                   f"(holders are still re-announcing after a server restart)")
        return version

    def _resolve_now(self, node: Node, spec: m.VersionSpec) -> int:
        mod = self.models[node.model]
        avail = self.available(node.model)
        kind, k = versions.parse_spec(spec)
        if kind == "latest" and k == 0 and self.config.smart_skipping and avail:
            skipped = self.crossdc.smart_skip(node, avail)
            if skipped is not None:
                node.in_flight = skipped[1]
                return skipped[0]
        others = self._model_nodes[node.model] - len(self.table.replicas.get((node.model, node.replica_id), ()))
        if not mod.committed and not others:
            raise UnknownModel(f"{node.model}: no other replica of this model is registered")
        return versions.resolve(spec, node.model, avail, mod.forgotten_below)

    def _resolve_in_txn(self, node: Node, req: m.Replicate) -> int:
        if node.num_shards == 1:
            return self._resolve(node, req.spec)
        key = (node.model, node.replica_id, req.seq)
        txn = self.txns.get(key)
        if txn is None:
            present = len(self.table.replicas.get((node.model, node.replica_id), ()))
            if present < node.num_shards:
                # After a restart a sibling may not have re-announced the version it got in this
                # round yet; resolving now could split the transaction.
                raise ReplicaIncomplete(f"{node.model} replica {node.replica_id}: only {present} of "
                                   f"{node.num_shards} shards are registered; retry")
            version = self._resolve(node, req.spec)
            self.txns[key] = (req.spec, version, {node.shard})
            # Older rounds of this replica are finished once a newer one starts.
            self.txns.drop_before(node.model, node.replica_id, req.seq)
            return version
        spec, version, consumed = txn
        if self._round_unsettled(node, spec):
            # Reading on now could split the transaction.
            raise ServerRecovering(f"{node.model} replica {node.replica_id} round {req.seq}: siblings of shard "
                                   f"{node.shard} are still re-announcing; retry")
        if spec != "announced" and spec != req.spec:
            raise TransactionMismatch(
                f"{node.model} replica {node.replica_id} round {req.seq}: shard {node.shard} asked {req.spec!r}, "
                f"another shard asked {spec!r}"
            )
        if (not isinstance(req.spec, int) and node.shard in consumed
                and not self._round_version_held(node, version)
                and not self._consumer_unaccounted(node, consumed)):
            # A retry in this round after its version was lost: re-resolve the round, unless a
            # sibling already holds (or receives) that version -- then the retry fails with
            # VersionLost and the next round realigns the replica.
            version = self._resolve(node, req.spec)
            consumed = {node.shard}
            self.txns[key] = (spec, version, consumed)
            return version
        consumed.add(node.shard)
        return version

    def _consumer_unaccounted(self, node: Node, consumed: set[int]) -> bool:
        """A sibling shard that took this round's version is not registered right now (evicted,
        or not re-announced yet): it may still hold the version, so the round must not move."""
        present = {n.shard for n in self.table.replica_nodes(node.model, node.replica_id)}
        return any(sh != node.shard and sh not in present for sh in consumed)

    def _round_version_held(self, node: Node, version: int) -> bool:
        """Whether ``version`` is still a committed, available version, or a sibling shard of
        ``node``'s replica holds or receives it (or will, once its drain or offload ends)."""
        if version in self.available(node.model):
            return True
        return any(n.shard != node.shard and ((n.version == version and n.state is not NodeState.IDLE)
                                              or (n.pending_read is not None and n.pending_read[0] == version))
                   for n in self.table.replica_nodes(node.model, node.replica_id))

    # ------------------------------------------------------------------ unpublish, drain, offload

    def _begin_unpublish(self, node: Node) -> None:
        self._drain(node)

    def _drain(self, node: Node) -> None:
        node.state = NodeState.DRAINING
        self.index.mark(node)
        self.table.touched.add(node.key)
        if not node.readers:
            self._finish_drain(node)

    def _finish_drain(self, node: Node) -> None:
        if self.table.now < self._recovering_until:
            # Completed by tick() once the recovery window is over: a reader still copying from
            # this holder (a host copy too) under the old server may not have announced yet.
            return
        self._finish_drain_now(node)

    def _finish_drain_now(self, node: Node) -> None:
        """No reader is left. Offload first when this is the last non-spot copy of a retained
        version (checked now, not at unpublish time: the readers just drained are holders now)."""
        if not node.host and self.retention.needs_offload(node):
            if self.retention.awaits_proof(node):
                return  # stays DRAINING until the proof or proof_until (tick)
            node.state = NodeState.OFFLOADING
            self.index.mark(node)
            log.info("model=%s version=%d shard=%d %s holds %s: offload first", node.model, node.version,
                     node.shard, node.id, f"the newest copy in {node.datacenter}" if node.stage_for
                     else "the last non-spot copy")
            self.table.deliver(node.id, m.OffloadOrder(version=node.version))
            return
        self.retention.end_proof_wait(node)
        self._complete_unpublish(node)

    def _complete_unpublish(self, node: Node) -> None:
        version = node.version
        self._set_version(node, -1, NodeState.IDLE, 0)
        if node.host:
            self._forget_node(node)
            if node.owner in self.nodes:
                self.table.deliver(node.owner, m.DropHostCopy(version=version))
            return
        if node.pending_read is not None:
            target, resume = node.pending_read
            node.pending_read = None
            self._enqueue_read(node, target, resume)
        else:
            self.table.deliver(node.id, m.UnpublishDone(version=version))

    # ------------------------------------------------------------------ reading

    def _enqueue_read(self, node: Node, version: int, resume: int) -> None:
        self._set_version(node, version, NodeState.WAITING, max(0, min(resume, node.units)))
        node.suspects.clear()
        self._stamp += 1
        node.stamp = self._stamp
        self.index.mark(node)

    def _wait(self, node: Node) -> None:
        node.state = NodeState.WAITING
        node.source = None
        self.index.mark(node)
        self.table.touched.add(node.key)

    def _detach_from_source(self, node: Node) -> None:
        src = self.nodes.get(node.source) if node.source else None
        node.source = None
        if src is not None:
            src.readers.discard(node.id)
            self.index.mark(src)
            self.table.touched.add(src.key)
            if src.state is NodeState.DRAINING and not src.readers:
                self._finish_drain(src)

    def _stop_reading(self, node: Node) -> None:
        """The node stops receiving (abort, lost version): its own readers lose their source."""
        self._detach_from_source(node)
        for r in sorted(node.readers):
            self._orphan(r)
        node.readers.clear()
        self._set_version(node, -1, NodeState.IDLE, 0)

    def _orphan(self, reader_id: str) -> None:
        reader = self.nodes.get(reader_id)
        if reader is not None and reader.state is NodeState.READING:
            reader.source = None
            self._wait(reader)

    def _assignment(self, node: Node) -> m.Assignment:
        src = self.nodes[node.source]
        gone, node.failed_gone = node.failed_gone, False
        return m.Assignment(
            version=node.version, source_id=src.id, source_endpoint=src.endpoint,
            source_partial=not src.complete, start_unit=node.progress, assign_no=node.assign_no,
            cross_datacenter=src.datacenter != node.datacenter, failed_source_gone=gone,
            in_flight=node.in_flight,
        )

    def _downstream(self, node: Node) -> set[str]:
        out: set[str] = set()
        todo = list(node.readers)
        while todo:
            r = todo.pop()
            if r in out or r not in self.nodes:
                continue
            out.add(r)
            todo.extend(self.nodes[r].readers)
        return out

    def _settle(self) -> None:
        """Assign waiting readers of every touched group, FIFO; fail readers of lost versions."""
        if self._reseed:  # first: a new seed entry may release readers waiting for an old one
            todo, self._reseed = sorted(self._reseed), set()
            for model in sorted({mo for mo, _ in todo}):
                self.crossdc.seed_remote(model, {dc for mo, dc in todo if mo == model})
        seen: set[Key] = set()
        while self.table.touched:
            keys = sorted(self.table.touched)
            seen.update(keys)
            self.table.touched = set()
            for key in keys:
                self._pump(key)
        self._drop_lost_versions(seen)
        if self._removed:
            # A removed client gets nothing from this request but its eviction (one pass
            # here, not one per removal: a death wave of k clients filters once, not k times).
            self.table.effects = [e for e in self.table.effects
                             if e.client_id not in self._removed or isinstance(e.event, m.Evicted)]
            self._removed = set()

    def _drop_lost_versions(self, keys: set[Key]) -> None:
        """A committed version of which some shard has no node left at all can never be read
        again: it stops counting toward retention, so the newest versions still held stay
        available (a trainer that dies right after publishing does not push out the version
        every rollout holds)."""
        for model, version in sorted({(k[0], k[1]) for k in keys if k[1] >= 0}):
            mod = self.models.get(model)
            if mod is None or version not in mod.committed:
                continue
            if any(not self.groups.get((model, version, i)) for i in range(mod.num_shards)):
                mod.committed.remove(version)
                log.info("model=%s version=%d lost: no holder of some shard is left", model, version)

    def _pump(self, key: Key) -> None:
        """Assign the waiting readers of one group, FIFO. Cost: the readers assigned plus those
        looked at while some source is still free (none once every source is busy)."""
        g = self.index.group(key)
        if g is None or (not g.waiting and not g.counts[NodeState.READING]):
            return
        recovering = self.table.now < self._recovering_until
        if not recovering and not g.complete():
            # Every chain of partial holders roots at a complete one; with none left, no
            # reader of this group can finish.
            lost = VersionLost(f"{key[0]} version {key[1]} shard {key[2]}: no holder is left")
            for n in sorted((self.nodes[i] for i in self.groups.get(key, ())), key=lambda n: n.stamp):
                if n.state in (NodeState.WAITING, NodeState.READING):
                    self._fail_read(n, lost)
            return
        blocked_dcs = self.crossdc.seed_pending(key[0], key[1])
        passed_over = False
        pool = _GroupPool(self, key)
        origin = self.models[key[0]].origin_dc.get(key[1]) if key[0] in self.models else None
        after: tuple = ()
        tried: set[str] = set()
        looked = 0
        while True:
            g = self.index.group(key)
            if g is None:
                return
            cross_only = not (g.free_all or g.staged)
            if cross_only and not (origin is not None and g.visible_dc[origin]
                                   and any(dc != origin and n for dc, n in g.active_dc.items())):
                return  # every source is busy: no reader can be assigned (rules 2 and 4)
            i = bisect.bisect_right(g.waiting, after)
            if i == len(g.waiting):
                return
            after = g.waiting[i]
            reader = self.nodes[after[1]]
            if reader.awaiting_source is not None:
                continue
            if cross_only:
                # Only the origin's per-datacenter slots may be left: one look per remote
                # datacenter, and a bounded one (a queue of thousands is not scanned per event).
                looked += 1
                if looked > _CROSS_LOOK_MAX:
                    return
                if reader.datacenter == origin or reader.datacenter in tried:
                    continue
                tried.add(reader.datacenter)
            src = scheduler.choose_source(
                reader, pool, downstream=self._downstream(reader),
                readers_per_source_max=self.config.readers_per_source_max,
                seeding_blocked=reader.datacenter in blocked_dcs and not reader.stage_for
                and blocked_dcs.get(reader.datacenter) != reader.replica_id,
                origin_dc=origin,
            )
            if src is None:
                blocked_dcs.setdefault(reader.datacenter, "")
                passed_over = True
                continue
            if reader.in_flight >= 0 and src.datacenter != reader.datacenter:
                # Smart skipping chose this version because it was complete here; its holders
                # here moved on meanwhile. Fetching it across would cost the link for a version
                # already stale: end the read (a "latest" caller retries and resolves anew).
                self._fail_read(reader, VersionLost(
                    f"{key[0]} version {key[1]} shard {key[2]}: chosen by smart skipping, no longer held in "
                    f"datacenter {reader.datacenter}"))
                continue
            self._attach(reader, src)
            self.table.deliver(reader.id, self._assignment(reader))
            if passed_over:
                # An earlier reader found no source; this one may now be its source (a seeder
                # staging copy that started after it asked): look again.
                self.table.touched.add(key)

    def _attach(self, reader: Node, src: Node) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("model=%s version=%d reader=%s (%s) reads from %s (%s, %s, %d units)", reader.model,
                      reader.version, reader.id, reader.datacenter, src.id, src.datacenter, src.state.name,
                      src.progress)
        reader.state = NodeState.READING
        reader.source = src.id
        reader.assign_no += 1
        src.readers.add(reader.id)
        self.index.mark(reader)
        self.index.mark(src)

    def _fail_read(self, node: Node, err: TensorHubError) -> None:
        log.info("model=%s version=%d reader=%s fails: %s", node.model, node.version, node.id, err)
        self._stop_reading(node)
        node.failure = m.Failed(code=code_of(err), message=str(err))
        self.table.deliver(node.id, node.failure)

    # ------------------------------------------------------------------ removal

    def _remove_replica(self, model: str, replica_id: str, reason: str) -> None:
        members = sorted(self.table.replicas.get((model, replica_id), ()))
        for nid in members:
            node = self.nodes.get(nid)
            if node is None:
                continue
            self.table.deliver(nid, m.Evicted(reason=reason))
            self._remove(nid)
        # The replica's rounds stay (for a bounded time, tensorhub/core/rounds.py): its members
        # re-announce (or restart) and go on counting from them; a round whose version is gone
        # is re-resolved by the next shard that asks.
        self._forget_empty_models()


    def _remove(self, node_id: str) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            return
        for hid in sorted(self.table.hosts_of.get(node_id, ()), key=lambda h: self.nodes[h].order):
            self._remove(hid)
        self._detach_from_source(node)
        for r in sorted(node.readers):
            self._orphan(r)
        node.readers.clear()
        self._set_version(node, -1, NodeState.IDLE, 0)
        self._forget_node(node)
        mod = self.models.get(node.model)
        if mod is not None and not node.host:
            asked = mod.seed_asked.get(node.datacenter)
            if asked is not None and asked[1] in ("", node.replica_id, node.replica_id.removesuffix("~prefetch")):
                # The seeder (or the reader that had the version there) is gone: another
                # replica of that datacenter takes over the seed.
                self.crossdc.set_seed_asked(mod, node.datacenter, None)
                self._reseed.add((node.model, node.datacenter))
        self._removed.add(node_id)

    def _forget_empty_models(self) -> None:
        for name in [k for k in self.models if not self._model_nodes[k]]:
            del self.models[name]
            self._model_nodes.pop(name, None)
            self._model_hosts.pop(name, None)

    def _forget_node(self, node: Node) -> None:
        """Take ``node`` (IDLE by now) out of the table and every index."""
        del self.nodes[node.id]
        self.index.drop(node)
        self._model_nodes[node.model] -= 1
        if node.host:
            self._model_hosts[node.model] -= 1
            hosts = self.table.hosts_of.get(node.owner)
            if hosts is not None:
                hosts.discard(node.id)
                if not hosts:
                    del self.table.hosts_of[node.owner]
            return
        del self._shards[(node.model, node.replica_id, node.shard)]
        replica = self.table.replicas[(node.model, node.replica_id)]
        replica.discard(node.id)
        if not replica:
            del self.table.replicas[(node.model, node.replica_id)]
            self.txns.departed(node.model, node.replica_id, self.table.now)
        self.crossdc.candidates.update(node.model, node.replica_id, self.table.replica_nodes(node.model, node.replica_id),
                              node.num_shards)
        del self._lease[node.id]

    def _seen(self, node: Node, now: float) -> None:
        node.last_seen = now
        self._lease.pop(node.id, None)
        self._lease[node.id] = None

    # ------------------------------------------------------------------ helpers

    def _describe(self, node: Node) -> str:
        v = f" version {node.version}" if node.version >= 0 else ""
        return f"{node.model} replica {node.replica_id} shard {node.shard} is {node.state.value}{v}"


def _first_difference(a: m.LayoutInfo, b: m.LayoutInfo) -> str:
    for i, (x, y) in enumerate(zip(a.tensors, b.tensors)):
        if x != y:
            return f"tensor #{i} is {y.name} {y.dtype}{list(y.shape)}, the model has {x.name} {x.dtype}{list(x.shape)}"
    if len(a.tensors) != len(b.tensors):
        return f"{len(b.tensors)} tensors, the model has {len(a.tensors)}"
    if a.unit_count != b.unit_count:
        return f"{b.unit_count} transfer units, the model has {a.unit_count} (unit_bytes differs?)"
    return f"layout fingerprint {b.fingerprint[:12]} differs from the model's {a.fingerprint[:12]}"


_CROSS_LOOK_MAX = 64
"""Waiting readers a pump looks at once every source is busy, for an origin slot of their
datacenter (``scheduler.choose_source``); the rest wait for the next event of the group."""


class _GroupPool:
    """The scheduler's view (:class:`scheduler.Pool`) of one group through the core's index. A
    host copy stands in for its owner's GPU copy only once the owner stops serving the version:
    both live behind the owner's NIC, so serving from both would double its load (and break the
    pipeline) instead of spreading it."""

    def __init__(self, core: ReferenceCore, key: Key) -> None:
        self.core = core
        self.key = key

    def _nodes(self, ids: Iterable[str]) -> Iterable[Node]:
        nodes = self.core.nodes
        for i in ids:
            n = nodes[i]
            if n.host:
                owner = nodes.get(n.owner)
                if owner is not None and owner.key == self.key and owner.state in VISIBLE_SOURCE:
                    continue
            yield n

    def everyone(self) -> Iterable[Node]:
        return self._nodes(self.core.table.group(self.key).all_candidates())

    def in_datacenter(self, dc: str) -> Iterable[Node]:
        return self._nodes(self.core.table.group(self.key).candidates_in(dc))

    def staged_for(self, reader_id: str) -> Iterable[Node]:
        return self._nodes(self.core.table.group(self.key).staged.get(reader_id, ()))

    def free(self, dc: Optional[str], machine: str) -> Iterable[Node]:
        return self._nodes(self.core.table.group(self.key).free(dc, machine))

    def readers_in(self, cand: Node, dc: str) -> int:
        nodes = self.core.nodes
        return sum(1 for r in cand.readers if r in nodes and nodes[r].datacenter == dc)
