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

The state the core shares with its parts is one :class:`~tensorhub.core.table.Table`. This
module keeps the dispatch (a ``match`` on the request's type), the tick, the queries and
registration; the other concerns are parts that get the table and what they act through passed
in (docs/design.md, section 1): :attr:`~ReferenceCore.members` (:mod:`~tensorhub.core.members`),
:attr:`~ReferenceCore.holders` (:mod:`~tensorhub.core.holders`: publish, unpublish and the drain,
leave and removal), :attr:`~ReferenceCore.recovery` (:mod:`~tensorhub.core.recovery`:
``Announce`` after a restart, the recovery window), :attr:`~ReferenceCore.reading`
(:mod:`~tensorhub.core.reading`), :attr:`~ReferenceCore.read_requests`
(:mod:`~tensorhub.core.read_requests`), :attr:`~ReferenceCore.rounds`
(:mod:`~tensorhub.core.rounds`), :attr:`~ReferenceCore.versions`
(:mod:`~tensorhub.core.versions`), :attr:`~ReferenceCore.crossdc`
(:mod:`~tensorhub.core.crossdc`), :attr:`~ReferenceCore.retention`
(:mod:`~tensorhub.core.retention`), :attr:`~ReferenceCore.placements`
(:mod:`~tensorhub.core.placements`: registered placements, interned by digest).

No request scans the table: ``tensorhub.core.index`` keeps the waiting queues, free sources and
counts per (model, version, shard), and the parts keep registries by replica, shard, host-copy
owner and model, the candidate seeders per datacenter, the rounds by replica, and the clients in
the order they were last heard from (lease expiry). No removal scans it either: a death among
10,000 clients costs what it costs among 100, and a departed replica's state is forgotten (its
rounds within a bound).
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.cells import Cells
from tensorhub.core.crossdc import CrossDatacenter
from tensorhub.core.deltas import Deltas
from tensorhub.core.holders import Holders
from tensorhub.core.members import Members
from tensorhub.core.other_layouts import OtherLayouts
from tensorhub.core.placements import Placements, logical, shown
from tensorhub.core.read_requests import ReadRequests
from tensorhub.core.reading import Reading
from tensorhub.core.recovery import Recovery
from tensorhub.core.retention import Retention
from tensorhub.core.rounds import Rounds
from tensorhub.core.versions import Versions
from tensorhub.core.views import Views
from tensorhub.core.table import Key, Table
from tensorhub.core.state import LEGAL, Node, NodeState
from tensorhub.errors import (
    InvalidState,
    ServerRecovering,
    TensorHubError,
    UnknownClient,
    code_of,
)

log = logging.getLogger(__name__)

_READ_FOLLOW_UPS = frozenset({"SourceFailed", "ReplicateDone", "Progress"})
_RETRIED_IN_ROUND = frozenset({"ReplicaIncomplete", "ServerRecovering", "VersionLost", "UnknownClient"})
"""Error answers to ``Replicate`` that its handle follows with the same request (same call)."""
_OUTCOMES = (m.Assignment, m.UnpublishDone, m.OffloadOrder, m.Failed)


class ReferenceCore:
    """The reference table and every rule around it. Not thread-safe: one driver calls it.

    Its state shared with its parts is :attr:`table` (:class:`~tensorhub.core.table.Table`);
    :attr:`nodes`, :attr:`models`, :attr:`groups` and :attr:`index` are the table's own
    (never rebound). Its parts (see the module docstring) are attributes, each built once here
    with what it acts through; :meth:`handle` dispatches a request with a ``match`` on its type
    to the part that applies it (the ``on_<Request>`` of :attr:`holders`, :attr:`recovery` and
    :attr:`read_requests`, :attr:`retention`'s), else to the core's own ``_on_<Request>``."""

    def __init__(self, config: Optional[Config] = None) -> None:
        self.config = config or Config()
        self.table = Table(self.config)
        self.nodes = self.table.nodes
        self.models = self.table.models
        self.groups = self.table.groups
        self.index = self.table.index
        self.crossdc = CrossDatacenter(self.table)
        """Offload seeding and smart skipping (:mod:`tensorhub.core.crossdc`)."""
        self.deltas = Deltas(self.table)
        """Offers of seeds as deltas (:mod:`tensorhub.core.deltas`)."""
        # members, holders and recovery are built below: what the parts above act through of them
        # is looked up when called (so a core given another class of part reaches every call).
        self.placements = Placements(self.table)
        """Registered placements and layout classes (:mod:`tensorhub.core.placements`)."""
        self.other_layouts = OtherLayouts(self.table, self.placements.reshard_shards)
        """Which replicas of other layout classes can fill a node (:mod:`tensorhub.core.other_layouts`)."""
        self.retention = Retention(
            self.table, add_host_copy=lambda owner, v, endpoint: self.holders.add_host_copy(owner, v, endpoint),
            drain=lambda n: self.holders.drain(n), finish_drain=lambda n: self.holders.finish_drain(n),
            complete_unpublish=lambda n: self.holders.complete_unpublish(n), describe=self._describe,
            keeps_dc_copy=self.crossdc.keeps_dc_copy, recovering_until=lambda: self.recovery.until,
            clients_in=lambda model: sum(self.members.clients_in(c) for c in self.table.classes.get(logical(model))
                                         or [model]),
            others=self.other_layouts)
        """Host copies and retention (:mod:`tensorhub.core.retention`)."""
        self.versions = Versions(
            self.table, seed_remote=self.crossdc.seed_remote, smart_skip=self.crossdc.smart_skip,
            forget=self.retention.forget, forget_below=self.retention.forget_below,
            nodes_in=lambda model: self.members.nodes_in(model), recovering_until=lambda: self.recovery.until)
        """Commits, available versions and resolution (:mod:`tensorhub.core.versions`)."""
        self.cells = Cells(self.table, placement_of=self.placements.get, class_digests=self.placements.class_digests)
        """The cell checksums of resharded reads (:mod:`tensorhub.core.cells`)."""
        self.reading = Reading(self.table, finish_drain=lambda n: self.holders.finish_drain(n),
                               seed_pending=self.crossdc.seed_pending,
                               recovering=lambda: self.table.now < self.recovery.until,
                               placements=self.placements, others=self.other_layouts, ask_cells=self.cells.ask,
                               grid_digests=self.cells.grid_digests)
        """Readers' queues and assignments (:mod:`tensorhub.core.reading`)."""
        self.views = Views(self.table, available=self.versions.available_all,
                           clients_of=lambda model: self.members.clients_of(model),
                           recovering=lambda: self.table.now < self.recovery.until,
                           skip_news=self.crossdc.skip_news, skip_datacenters=self.crossdc.skip_datacenters)
        """Pushes of each model's newest version for local no-op answers (:mod:`tensorhub.core.views`)."""
        self.rounds = Rounds(self.table, resolve=self.versions.resolve, available=self.versions.available_all,
                             stop_reading=self.reading.stop, describe=self._describe,
                             recovering_until=lambda: self.recovery.until)
        """Replicate rounds of sharded replicas as transactions (:mod:`tensorhub.core.rounds`)."""
        self.txns = self.rounds.txns
        """The round table (:class:`~tensorhub.core.rounds.RoundTable`), owned by :attr:`rounds`."""
        self.members = Members(
            self.table, placements=self.placements, replica_back=self.txns.returned, replica_gone=self.txns.departed,
            replica_changed=lambda model, rid, shards: self.crossdc.candidates.update(
                model, rid, self.table.replica_nodes(model, rid), shards))
        """Registered clients and host copies, and the lease order (:mod:`tensorhub.core.members`)."""
        self.holders = Holders(
            self.table, reading=self.reading, retention=self.retention, add_host=self._add_host,
            forget=self._forget, forget_empty_models=self.members.forget_empty_models,
            maybe_commit=self.versions.maybe_commit, set_seed_asked=self.crossdc.set_seed_asked,
            recovering_until=lambda: self.recovery.until, describe=self._describe,
            check_covered=self.placements.check_covered)
        """Publish, the drain and removal (:mod:`tensorhub.core.holders`)."""
        self.read_requests = ReadRequests(
            self.table, reading=self.reading, rounds=self.rounds, versions=self.versions,
            retention=self.retention, drain=lambda n: self.holders.drain(n), describe=self._describe)
        """The requests of a read (:mod:`tensorhub.core.read_requests`)."""
        self.recovery = Recovery(
            self.table, rounds=self.rounds, reading=self.reading, check=self.members.check, add=self.members.add,
            seen=self.members.seen, maybe_commit=self.versions.maybe_commit, complete=self.read_requests.complete,
            announced_host_copy=self.retention.announced_host_copy,
            finish_drain=lambda n: self.holders.finish_drain(n))
        """Re-announcements after a restart and the recovery window (:mod:`tensorhub.core.recovery`)."""

    # ------------------------------------------------------------------ driver interface

    def handle(self, req: m.Request, now: float) -> tuple[m.Reply, list[m.Deliver]]:
        """Apply one request at time ``now``. Errors come back as ``ErrorReply`` and change
        nothing (every handler validates before it mutates)."""
        self.table.begin(now)
        self.recovery.started(now)
        name = type(req).__name__
        if name == "Replicate" and self.read_requests.superseded(req):
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
                self.members.seen(node, now)
                node.heard_at = now
                node.unreachable = False  # it talks to us: alive, reachable from somewhere
                if node.state is NodeState.IDLE and node.failure is not None and name in _READ_FOLLOW_UPS:
                    # The read already failed (the event may not have reached the reader).
                    return m.ErrorReply(code=node.failure.code, message=node.failure.message), []
                if name == "Replicate" and req.call > 0 and node.answered is not None and req.call <= node.answered[0]:
                    # A call answered for good already, again: a duplicate in transit, or a
                    # resend whose first reply was lost. The same answer, and nothing else:
                    # taken afresh it could start a read its handle never follows (the handle
                    # ended that call), and the read's sources could never drain.
                    call, answer = node.answered
                    if req.call == call:
                        return answer, []
                    return m.ErrorReply(code="InvalidState", message=f"{self._describe(node)}: replicate call "
                                                                       f"{req.call} arrived after call {call} was answered"), []
                if self._starts_current_read(req, node):
                    # Sent again (its reply lost, or a duplicate): that read's answer now,
                    # changing nothing, not InvalidState: the handle would end the call without
                    # aborting a read it never saw start, and the read's sources could never
                    # drain (mixed_spot seed 569).
                    retried = self.read_requests.retried(node)
                    if retried is not None:
                        return retried, []
                if name in ("Publish", "Replicate"):
                    node.failure = None
                if node.state not in LEGAL[name]:
                    raise InvalidState(f"{name} is not allowed while {self._describe(node)}")
            reply = self._dispatch(req, now)
            if client_id is not None and client_id in self.retention.probing:
                self.retention.proved(client_id)
        except TensorHubError as err:
            assert not self.table.effects, "a rejected request must not have effects"
            reply = m.ErrorReply(code=code_of(err), message=str(err))
            self._note_answered(req, reply)
            return reply, []
        node = self.nodes.get(getattr(req, "client_id", None) or getattr(getattr(req, "register", None), "client_id", ""))
        self._settle(node.model if node is not None else None)
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
        self._note_answered(req, reply)
        return reply, effects

    @staticmethod
    def _starts_current_read(req: m.Request, node: Node) -> bool:
        """Whether ``req`` is the request that started ``node``'s current read, applied already:
        a numbered round's ``Replicate`` (the round's sequence number), or an update's
        ``OffloadDone`` of the version before (the node reads the new version now, whether the
        host copy was kept or not)."""
        if isinstance(req, m.Replicate):
            return req.seq > 0 and req.seq == node.round_seq
        if isinstance(req, m.OffloadDone):
            return node.state in (NodeState.WAITING, NodeState.READING) and req.version != node.version
        return False

    def _note_answered(self, req: m.Request, reply: object) -> None:
        """Keep a numbered ``Replicate``'s final answer (``NoChange``, or an error its handle does
        not follow within the call: not ``ReplicaIncomplete``/``ServerRecovering``, asked again,
        nor ``VersionLost``, which an update retries once in its round)."""
        if not isinstance(req, m.Replicate) or req.call <= 0:
            return
        node = self.nodes.get(req.client_id)
        if node is None or node.host:
            return
        if isinstance(reply, m.NoChange) or (isinstance(reply, m.ErrorReply) and reply.code not in _RETRIED_IN_ROUND):
            node.answered = (req.call, reply)

    def _dispatch(self, req: m.Request, now: float) -> m.Reply:
        """Apply ``req`` (its client checked by :meth:`handle`) by its type: the part that applies
        it, or the core's own ``_on_<Request>``. A handler validates before it mutates."""
        rr = self.read_requests
        match req:
            case m.Register():
                return self._on_Register(req, now)
            case m.Announce():
                reply = self.recovery.on_Announce(req, now)
                self.views.announced(req.register.client_id)
                return reply
            case m.Heartbeat():
                return m.Ok()
            case m.Query():
                return self.status(req.model, layouts=req.layouts)
            case m.Publish():
                reply = self.holders.on_Publish(req, now)
                node = self.nodes.get(req.client_id)
                if node is not None and node.state is NodeState.PUBLISHED and node.version == req.version:
                    self.cells.ahead(node)  # hash for the other layout classes while readers are told
                return reply
            case m.Unpublish():
                return self.holders.on_Unpublish(req, now)
            case m.Leave():
                return self.holders.on_Leave(req, now)
            case m.Replicate():
                return rr.on_Replicate(req, now)
            case m.SourceFailed():
                return rr.on_SourceFailed(req, now)
            case m.Progress():
                return rr.on_Progress(req, now)
            case m.ReplicateDone():
                return rr.on_ReplicateDone(req, now)
            case m.ReplicateAbort():
                return rr.on_ReplicateAbort(req, now)
            case m.Swap():
                return rr.on_Swap(req, now)
            case m.OffloadDone():
                return self.retention.on_offload_done(req)
            case m.HostCopy():
                return self.retention.on_host_copy(req)
            case m.OfferDelta():
                return self.deltas.on_offer(self.nodes[req.client_id], req)
            case m.FindDelta():
                return self.deltas.on_find(self.nodes[req.client_id], req)
            case m.CellSums():
                return self.cells.on_sums(self.nodes[req.client_id], req)
            case m.FindCells():
                return self.cells.on_find(self.nodes[req.client_id], req)
        raise TypeError(f"the reference core has no handler for {type(req).__name__}")

    def tick(self, now: float, grace_s: float = 0.0) -> list[m.Deliver]:
        """Expire clients whose lease ran out; returns the effects of their removal.
        ``grace_s`` (>= 0): how long the driver may not yet have read what clients sent it (its
        own backlog): a client counts as silent only after ``lease_timeout_s + grace_s`` (a
        reported client after ``2.5 * heartbeat_interval_s + grace_s``), so a slow server does
        not mistake its unread queue for dead clients."""
        assert grace_s >= 0, grace_s
        self.table.begin(now)
        self.recovery.started(now)
        lease = self.config.lease_timeout_s + grace_s
        probe = 2.5 * self.config.heartbeat_interval_s + grace_s
        dead_replicas = set()
        for n in self.members.lease_expired(now, lease):
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
            self.holders.remove_replica(model, replica, reason="lease expired")
        self.txns.prune(now)
        self.recovery.tick(now)  # the window's end; drains that wait complete
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
        replicas: dict[tuple[str, str], str] = {}
        for cid in sorted(gone):
            n = self.nodes.get(cid)
            if n is not None and not n.host:
                replicas.setdefault((n.model, n.replica_id), gone[cid])
        for (model, replica), reason in sorted(replicas.items()):
            log.info("model=%s replica=%s: %s", model, replica, reason)
            self.holders.remove_replica(model, replica, reason=reason)
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
        return self.members.overdue(now, after_s, limit)

    def pulse_answered(self, client_ids, now: float) -> float:
        """A pulse of ``client_ids`` is answered at ``now`` (on arrival or after a hold): what it
        brings may serve local no-op answers for the returned seconds (``PulseReply.view_s``; 0:
        not at all; :meth:`tensorhub.core.views.Views.answered`)."""
        return self.views.answered(client_ids, now)

    def touch(self, client_ids, now: float) -> None:
        """Count ``client_ids`` as heard from at ``now`` for their lease (the server holds their
        process's pulse: the process is waiting on us). Not a proof that the process is alive
        (retention asks for one, ``Probe``). Unknown ids are skipped."""
        for cid in client_ids:
            n = self.nodes.get(cid)
            if n is not None and not n.host:
                self.members.seen(n, now)

    @property
    def registrations(self) -> int:
        """Grows with every client (and host copy) added: a cache of :meth:`processes` built
        at one value still holds every client registered since (removed ones it may still
        name: look them up)."""
        return self.members.registrations

    def processes(self) -> dict[str, m.ProcessId]:
        """The process of every registered client (host copies excluded)."""
        return {n.id: n.process for n in self.nodes.values() if not n.host}

    def available(self, model: str) -> list[int]:
        """Committed, retained versions with a visible complete holder of every shard."""
        return self.versions.available(model)

    def retained(self, model: str) -> list[int]:
        """Committed versions of ``model`` not yet forgotten (retention), oldest first."""
        return self.table.retained(model)

    def read_failed(self, client_id: str) -> Optional[m.Failed]:
        """How the server failed ``client_id``'s last read (a later Progress, SourceFailed or
        ReplicateDone of it is answered with that failure); None: it did not."""
        return self.read_requests.read_failed(client_id)

    def status(self, model: str = "", layouts: bool = False) -> m.Status:
        """The table as :class:`~tensorhub.core.messages.Status`: every model, or ``model`` only;
        ``layouts``: with each model's known shard layouts. A model's first layout class is shown
        under the model's name, each other one as ``<model> (layout class <n>)``."""
        views = []
        for name in sorted(self.models):
            base = logical(name)
            if model and base != model:
                continue
            first = (self.table.classes.get(base) or [name])[0] == name
            mod = self.models[name]
            mine = sorted((n for n in self.nodes.values() if n.model == name), key=lambda n: n.order)
            holders = tuple(
                m.HolderView(
                    client_id=n.id, replica_id=n.replica_id, shard=n.shard, datacenter=n.datacenter,
                    spot=n.spot, host=n.host, state=n.state.value, version=n.version,
                    progress=n.progress, readers=len(n.readers), source=n.source or "",
                    units=n.layout.unit_count, total_bytes=n.layout.total_bytes,
                )
                for n in mine
            )
            available = self.available(name)
            publishing = sorted({n.version for n in mine if not n.host and n.state is NodeState.PUBLISHED}
                                - set(available))
            views.append(m.ModelView(
                model=base if first else shown(name), num_shards=mod.num_shards, available=tuple(available),
                committed=tuple(self.retained(name)), holders=holders, publishing=tuple(publishing),
                layouts=tuple(m.ShardLayout(i, mod.layouts[i]) for i in sorted(mod.layouts)) if layouts else (),
                placements=self.placements.view(base) if first else (),
                schema=self.placements.schema(base) if first and layouts else (),
            ))
        return m.Status(models=tuple(views))

    # ------------------------------------------------------------------ requests

    def _on_Register(self, req: m.Register, now: float) -> m.Reply:
        existing = self.nodes.get(req.client_id)
        if existing is not None:
            if self.members.registration_of(existing) == req:
                return m.Registered(round_seq=self.rounds.rounds_done(existing.model, req.replica_id, req.shard))
            raise InvalidState(f"client {req.client_id} is already registered with other parameters")
        cls = self.members.check(req)  # its layout class: the model's own record unless it opened another
        if req.num_shards > 1 and now < self.recovery.until:
            if self.rounds.unheard_shards(cls, req.replica_id, req.num_shards) - {req.shard}:
                # After a restart the replica's rounds are known only from its shards'
                # announcements: a fresh process waits for them to count on with its siblings.
                raise ServerRecovering(f"{req.model} replica {req.replica_id}: siblings of shard {req.shard} "
                                       f"are still re-announcing; retry")
        node = self.members.add(req, now, cls)
        if req.placement is not None and now >= self.recovery.until:
            self._merge_classes(req.model)
            cls = node.model
        self.views.joined(req.client_id)
        mod = self.models[cls]
        if not req.stage_for and mod.committed:
            asked = mod.seed_asked.get(req.datacenter)
            if asked is None or asked[0] < mod.committed[-1]:
                self.table.reseed.add((cls, req.datacenter))  # perhaps a datacenter to seed
        return m.Registered(round_seq=self.rounds.rounds_done(cls, req.replica_id, req.shard))

    def _merge_classes(self, model: str) -> None:
        """Layout classes of ``model`` opened for replicas of one layout whose ranks registered
        interleaved (:meth:`Placements.class_of` cannot judge a shard a class has not seen yet)
        become one once the earlier class has seen their shards (:meth:`Placements.earlier_fit`):
        a later class whose clients are all idle at no version, with no host copy, no committed
        version and no round (nothing read, published or begun, so no state of its own to carry)
        moves into the earlier one, as if its clients had registered there. A class that has
        begun reading stays apart (it reshards from the others, as before)."""
        for cls in list(self.table.classes.get(model, ()))[1:]:
            mod = self.models.get(cls)
            if mod is None or mod.committed or self.members.nodes_in(cls) != self.members.clients_in(cls):
                continue
            clients = [self.nodes[c] for c in self.members.clients_of(cls)]
            if any(n.version >= 0 or n.state is not NodeState.IDLE or self.txns.of(cls, n.replica_id)
                   for n in clients):
                continue
            into = self.placements.earlier_fit(cls)
            if into is None or any(self.txns.of(into, n.replica_id) for n in clients):
                continue
            self.members.move_class(cls, into)
            self.members.forget_empty_models()
            self.views.forget(cls)
            log.info("%s: layout class %s joins %s (the same placements, registered interleaved)",
                     model, shown(cls), shown(into))

    # ------------------------------------------------------------------ the end of a request or tick

    def _settle(self, model: Optional[str] = None) -> None:
        """Assign waiting readers of every touched group, FIFO; fail readers of lost versions;
        tell a datacenter's replicas to prefetch a seed that reached it; push a changed newest
        version of every touched model (and ``model``, the request's)."""
        table = self.table
        if table.reseed:  # first: a new seed entry may release readers waiting for an old one
            todo, table.reseed = sorted(table.reseed), set()
            for model in sorted({mo for mo, _ in todo}):
                self.crossdc.seed_remote(model, {dc for mo, dc in todo if mo == model})
        seen: set[Key] = set()
        while table.touched:
            keys = sorted(table.touched)
            seen.update(keys)
            table.touched = set()
            for key in keys:
                self.reading.pump(key)
        self.versions.drop_lost(seen)
        models = {k[0] for k in seen} | ({model} if model is not None else set())
        self.crossdc.prefetch_in_datacenters(models)  # a seed that reached a datacenter: the others follow
        self.views.settle(models)
        if table.removed:
            # A removed client gets nothing from this request but its eviction (one pass
            # here, not one per removal: a death wave of k clients filters once, not k times).
            table.effects = [e for e in table.effects
                             if e.client_id not in table.removed or isinstance(e.event, m.Evicted)]
            table.removed = set()

    # ------------------------------------------------------------------ helpers

    def _forget(self, node: Node) -> None:
        """``node`` (IDLE by now) leaves the table, its registries and what it was asked to hash."""
        self.members.forget(node)
        self.cells.forget(node.id)

    def _add_host(self, owner: Node, version: int, endpoint: bytes) -> Node:
        """``owner``'s host copy of ``version`` as a node (:meth:`Members.add_host`), with the
        cell checksums ``owner`` sent of that version (a reshard source like its owner)."""
        host = self.members.add_host(owner, version, endpoint)
        self.cells.inherit(owner, host, version)
        return host

    def _describe(self, node: Node) -> str:
        v = f" version {node.version}" if node.version >= 0 else ""
        return f"{node.model} replica {node.replica_id} shard {node.shard} is {node.state.value}{v}"
