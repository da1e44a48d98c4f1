"""Invariants that need the core's table just before a step as well as just after it, checked
against the simulated world's ground truth. Observers only: they never steer the system.

:meth:`CoreObserver.factory` wraps a core factory: every core it makes (the first one and each
one after a restart) has its ``handle``, ``tick`` and ``declare_dead`` observed. Pulses'
heartbeats and progress reports are not (they change no version, holder or round).

(j) ``fresh``          a ``"latest"`` replicate that resolves a new read (not a retry of the read
                       it already has, not a later shard of a round another shard resolved, not
                       a request answered for good already, which gets that answer again) gets
                       the newest available version, unless the server says it skipped
                       (smart skipping: ``in_flight >= 0``), checked by (k).
(k) ``skip``           a smart skip answers no version older than the newest one complete in the
                       reader's datacenter below the skipped one (or the reader's own, if newer),
                       and skips only to a newer version.
(l) ``atomic``         a version commits only when every shard of one replica holds it whole
                       (the world's memory or a host copy of that replica), never earlier: checked
                       at each commit as it happens (the core's ``versions.commit``; a premature commit
                       may be undone later in the same step, after it pushed older versions out).
(m) ``over_retention`` the server never retains more than ``versions_retained`` versions.
(n) ``last_copy``      a holder of a retained version that the server lets go without an
                       offload (its drain ends, or it leaves serving a host copy) leaves another
                       copy of that version and shard that is alive in truth: a non-spot process
                       that holds it whole in memory or in a host copy, or that crashed so
                       recently that the server cannot know yet (``2.5 * heartbeat_interval_s``
                       plus the largest message delay).
(v) ``replayed``       a new replicate call (one whose ``Replicate.call`` the server has not
                       answered ``VersionNotFound`` before: not a duplicate of an answered request,
                       nor a resend after its reply was lost) that asks for a version the server
                       has available is not answered ``VersionNotFound``: the final answer of an
                       earlier call of the same named round must not be replayed to it (a sharded
                       replica asks again in its round after ``VersionNotFound``, as verl's
                       rollouts do: a stale answer would keep it waiting for good).

(w) ``stalled``        a replicate of an exact version that is not available is answered
                       ``VersionStalled`` (a reader may stop waiting) if and only if some replica
                       publishes that version from some shards and every such replica lacks a
                       registered client of another shard (it cannot complete until one comes).

Rare paths are counted as they are taken (:data:`PATHS`): the simulator's JSON reports across
how many seeds each was taken.
"""

from __future__ import annotations

import collections

from tensorhub.core import messages as m
from tensorhub.core.placements import logical
from tensorhub.core.state import COMPLETE, NodeState
from tensorhub.sim.known import KNOWN_OPEN

PATHS = ("reply_retry", "swap", "swap_retry", "prefetch", "sharded_seeding", "prefetch_in_dc", "default_rounds",
         "checksums_off", "rounds_apart", "LastCopyHeld", "TransactionMismatch", "RequestTimeout", "ServerUnavailable",
         "msg_lost", "msg_duplicated", "local_noop", "local_skip", "answer_replayed", "round_asked_again",
         "round_waited", "publisher_copy_ahead", "msg_late_dup", "stalled")
"""Rare paths whose use is counted per seed (``ScenarioResult.paths``)."""

ERROR_PATHS = frozenset({"LastCopyHeld", "TransactionMismatch", "RequestTimeout", "ServerUnavailable"})

_UNOBSERVED = (m.Heartbeat, m.Progress, m.Query)
_RELEASING = (NodeState.DRAINING, NodeState.OFFLOADING)


class CoreObserver:
    def __init__(self, checker) -> None:
        self.checker = checker
        self.world = checker.world
        self.paths: collections.Counter = collections.Counter()
        self.max_delay_s = 0.0
        """The largest extra message delay in force so far (``msg_delay``)."""
        self.crossings = 0
        """Reads assigned a source in another datacenter (each moves a shard over a slow link)."""
        self.lost: set[int] = set()
        """Versions the server dropped from retention as lost (no holder of some shard left)."""
        self.crashes: dict[str, tuple[float, int, set[int], bool, str, int]] = {}
        """Crashed clients: cid -> (when, shard, versions it held whole then (memory or host
        copy), spot or retains=False, replica, shards): the server may list what they held until it learns."""
        self.not_found: set[tuple[str, int]] = set()
        """(client, call) of the replicate calls some server answered ``VersionNotFound`` (v): the
        same call again may get that answer again."""
        self.round_misses: set[tuple[str, int]] = set()
        """(client, named round) answered ``VersionNotFound`` (the ``round_waited`` path)."""

    def path(self, name: str) -> None:
        self.paths[name] += 1

    # ------------------------------------------------------------------ wrapping the core

    def factory(self, inner):
        def make(config):
            core = inner(config)
            handle, tick, declare_dead = core.handle, core.tick, core.declare_dead

            def observed_handle(req, now):
                if isinstance(req, _UNOBSERVED):
                    return handle(req, now)
                pre = self._before(core, req)
                reply, effects = handle(req, now)
                self._after(core, req, reply, effects, pre)
                return reply, effects

            def observed_tick(now):
                pre = self._before(core, None)
                effects = tick(now)
                self._after(core, None, None, effects, pre)
                return effects

            def observed_declare_dead(client_ids, now, reason):
                pre = self._before(core, None)
                effects = declare_dead(client_ids, now, reason)
                self._after(core, None, None, effects, pre)
                return effects

            commit = core.versions.commit

            def observed_commit(model, v, by):
                # (l) as it happens: a premature commit may be undone within the same step (the
                # version counts as lost), after it forgot the older versions.
                if model == self.world.params.model:
                    self._check_atomic(v)
                return commit(model, v, by)

            core.handle, core.tick, core.declare_dead = observed_handle, observed_tick, observed_declare_dead
            core.versions.commit = observed_commit
            return core
        return make

    def _before(self, core, req) -> dict:
        model = self.world.params.model
        mod = core.models.get(model)
        pre = {
            "committed": tuple(mod.committed) if mod is not None else (),
            "releasing": {n.id: (n.version, n.shard) for n in core.nodes.values()
                          if n.state in _RELEASING and not n.host and n.keeps_copies},
        }
        if isinstance(req, m.Leave):
            pre["hosts"] = [(n.version, n.shard) for n in core.nodes.values()
                            if n.host and n.owner == req.client_id and n.state in COMPLETE]
        if isinstance(req, m.Replicate):
            node = core.nodes.get(req.client_id)
            if node is not None and not node.host:
                pre["node"] = (node.state, node.version, node.round_seq, node.pending_read)
                pre["answered"] = node.answered[0] if node.answered is not None else None  # its call
                pre["in_txn"] = node.num_shards > 1 and (node.model, node.replica_id, req.seq) in core.txns
                avail = core.available(node.model) if node.model in core.models else []
                pre["avail"] = avail
                # What a version spec resolves against: every layout class of the model (v).
                pre["avail_all"] = core.versions.available_all(node.model) if node.model in core.models else []
                pre["complete_here"] = {v for v in avail if _complete_in(core, node.model, v, node.datacenter)}
                if isinstance(req.spec, int):
                    pre["stalled"] = _stalled_truth(core, node.model, req.spec)
                if node.num_shards > 1:
                    sib = [n.round_seq for n in core.nodes.values() if not n.host and n.model == node.model
                           and n.replica_id == node.replica_id and n.id != node.id and n.round_seq > 0]
                    if sib and req.seq > 0 and max(abs(req.seq - s) for s in sib) > 1:
                        self.path("rounds_apart")
        return pre

    def _after(self, core, req, reply, effects, pre: dict) -> None:
        if isinstance(reply, m.ErrorReply) and reply.code in ERROR_PATHS:
            self.path(reply.code)
        if isinstance(req, m.Swap) and isinstance(reply, m.Ok):
            self.path("swap")
        self._note_prefetched(core, req, reply, effects)
        for eff in effects:
            if isinstance(eff.event, m.SeedAhead):
                target = core.nodes.get(eff.client_id)
                if target is not None and target.num_shards > 1:
                    self.path("sharded_seeding")
            elif isinstance(eff.event, m.PrefetchAhead):
                self.path("prefetch_in_dc")
        model = self.world.params.model
        mod = core.models.get(model)
        if mod is None:
            return
        retained = core.retained(model)
        if len(retained) > self.world.config.versions_retained:
            self.checker.violate("over_retention", f"the server retains versions {retained}, more than "
                                                   f"versions_retained={self.world.config.versions_retained}")
        self.lost.update(v for v in pre["committed"] if v not in mod.committed and v >= mod.forgotten_below)
        self._check_released(core, req, reply, pre, retained)
        if isinstance(req, m.Replicate) and "node" in pre and not isinstance(reply, m.ErrorReply):
            self._check_fresh(core, req, reply, pre)
        if isinstance(req, m.Replicate) and "node" in pre:
            self._check_not_found(req, reply, pre)

    def _note_prefetched(self, core, req, reply, effects) -> None:
        """The ``prefetch`` path: a read assigned the reader's own staging copy (the Hub's
        ``ReadStats.prefetched``), after a user prefetch or an offload seed."""
        given = [(req.client_id, reply)] if isinstance(reply, m.Assignment) else []
        given += [(e.client_id, e.event) for e in effects if isinstance(e.event, m.Assignment)]
        for cid, a in given:
            self.crossings += a.cross_datacenter
            src = core.nodes.get(a.source_id)
            if src is not None and src.stage_for == cid:
                self.path("prefetch")

    # ------------------------------------------------------------------ (j) and (k)

    def _check_fresh(self, core, req: m.Replicate, reply, pre: dict) -> None:
        state, version, seq, pending = pre["node"]
        if req.call > 0 and pre["answered"] is not None and req.call <= pre["answered"]:
            self.path("answer_replayed")  # answered for good already: the same answer again
            return
        if req.seq > 0 and req.seq == seq and (state in (NodeState.READING, NodeState.WAITING) or pending is not None):
            self.path("reply_retry")  # the same request again: it keeps the read it has
            return
        if req.spec != "latest" or pre["in_txn"] or not pre["avail"]:
            return
        node = core.nodes.get(req.client_id)
        if node is None:
            return
        if isinstance(reply, (m.Waiting, m.Assignment, m.NoChange)):
            got = reply.version
        elif node.pending_read is not None:
            got = node.pending_read[0]
        else:
            return
        newest = max(pre["avail"])
        if got >= newest:
            return
        skipped = reply.in_flight if isinstance(reply, m.NoChange) else node.in_flight
        if skipped < 0:
            self.checker.violate("fresh", f"{req.client_id} asked 'latest' and got version {got} while {newest} "
                                          f"was available (available {pre['avail']})")
            return
        own = version if state is NodeState.PUBLISHED and version < skipped else -1
        local = max([v for v in pre["complete_here"] if v < skipped] + [own])
        if got < local or skipped <= got:
            self.checker.violate("skip", f"{req.client_id} asked 'latest' and skipped version {skipped} to {got}; "
                                         f"the rule allows {local} (complete in its datacenter: "
                                         f"{sorted(pre['complete_here'])}, its own {own})")

    # ------------------------------------------------------------------ (v)

    def _check_not_found(self, req: m.Replicate, reply, pre: dict) -> None:
        key = (req.client_id, req.call)
        code = reply.code if isinstance(reply, m.ErrorReply) else ""
        self._check_stalled(req, code, pre)
        missed = code in ("VersionNotFound", "VersionStalled")
        if (req.client_id, req.seq) in self.round_misses and not missed and req.call > 0 and key not in self.not_found:
            self.path("round_waited")  # a named round asked again after VersionNotFound, resolved now
        if not missed:
            return
        if req.call <= 0 or key in self.not_found:
            return  # unnumbered, or this very call answered so before: the same answer again
        self.not_found.add(key)
        self.round_misses.add((req.client_id, req.seq))
        if isinstance(req.spec, int) and req.spec in pre["avail_all"]:
            self.checker.violate("replayed", f"{req.client_id}'s replicate call {req.call} (round {req.seq}) for "
                                             f"version {req.spec} answered VersionNotFound while the server has it "
                                             f"available (available {pre['avail_all']})")

    def _check_stalled(self, req: m.Replicate, code: str, pre: dict) -> None:
        """(w): an exact version that is not available is answered ``VersionStalled`` exactly
        when, in the table before the request, every replica publishing it from some shards
        lacks a registered client of another shard (and some replica does publish it). A call
        answered before gets that answer again, whatever the table says now."""
        if code not in ("VersionNotFound", "VersionStalled") or "stalled" not in pre:
            return
        if req.call > 0 and (req.client_id, req.call) in self.not_found:
            return  # this very call was answered so before: the same answer again (v)
        stalled = pre["stalled"]
        if code == "VersionStalled":
            self.path("stalled")
        if (code == "VersionStalled") != stalled:
            self.checker.violate("stalled", f"{req.client_id}'s replicate of version {req.spec} answered {code}; "
                                            f"the table says it {'cannot' if stalled else 'may still'} become "
                                            f"available (every replica publishing it lacks a shard: {stalled})")

    # ------------------------------------------------------------------ (l)

    def _check_atomic(self, v: int) -> None:
        w = self.world
        by_replica: dict[str, set[int]] = {}
        num: dict[str, int] = {}
        for c in w.clients.values():
            want = c.want(v)
            if c.mem == want or (c.alive and c.host_copies.get(v) == want):
                by_replica.setdefault(c.replica_id, set()).add(c.tag_shard)
                num[c.replica_id] = c.num_shards
        for _, shard, held, _, replica, shards in self.crashes.values():
            if v in held:  # a crashed holder the server may not know about yet
                by_replica.setdefault(replica, set()).add(shard)
                num[replica] = shards
        whole = [r for r, shards in by_replica.items() if len(shards) == num[r]]
        if not whole:
            self.checker.violate("atomic", f"version {v} committed while no replica holds every shard of it "
                                           f"(shards held per replica: "
                                           f"{ {r: sorted(s, key=str) for r, s in sorted(by_replica.items())} })",
                                 known=KNOWN_OPEN["split_effect"] if self.checker.split else "")

    # ------------------------------------------------------------------ (n)

    def note_crash(self, c) -> None:
        held = {v for v, copy in c.host_copies.items() if copy == c.want(v)}
        if c.mem and c.mem[0] is not None and c.mem[0][0] not in ("dirty", "freed", "torn"):
            v = c.mem[0][0]
            if c.mem == c.want(v):
                held.add(v)
        self.crashes[c.cid] = (self.world.sim.now, c.tag_shard, held, not c.keeps_copies, c.replica_id, c.num_shards)

    def _check_released(self, core, req, reply, pre: dict, retained: list[int]) -> None:
        released = []
        for nid, (v, shard) in pre["releasing"].items():
            n = core.nodes.get(nid)
            if n is not None and not (n.state in COMPLETE and n.version == v):
                released.append((nid, v, shard))
        if isinstance(req, m.Leave) and isinstance(reply, m.Ok) and not req.drop_last_copy:
            released += [(req.client_id, v, shard) for v, shard in pre.get("hosts", ())]
        for nid, v, shard in released:
            if self._matters(core, nid, v, retained) and not self._live_copy(nid, v, shard, leaving=isinstance(req, m.Leave)):
                self.checker.violate("last_copy", f"{nid} let go of retained version {v} shard {shard} without "
                                                  f"an offload while no other live non-spot copy of it exists",
                                     known=_known_last_copy(self.checker))

    def _matters(self, core, releaser: str, v: int, retained: list[int]) -> bool:
        """Whether letting go of ``v`` can lose it. Outside ``mixed``: ``v`` is retained. In
        ``mixed`` the model retains the newest ``versions_retained`` versions its layout classes
        retain together (a class that has not caught up with a newer version still retains an
        older one, which the model has moved past: its readers reach the newer one by resharded
        reads, as a one-layout model's readers find only the newer one), and a class is filled
        from another only by a replica of that class holding the version whole (every shard: a
        resharded read's source). So the release matters when the model retains ``v`` and ``v``
        is retained in the releaser's own class, or in another class while the releaser's
        replica holds ``v`` whole in truth (it may be that class's copy). A shard of a replica
        that does not hold ``v`` whole, of a version its own class does not retain, is no copy
        any reader could ever be given."""
        w = self.world
        if w.mixed is None:
            return v in retained
        if not model_retains(core, w.params.model, v, w.config.versions_retained):
            return False
        node = core.nodes.get(releaser)
        own = node.model if node is not None else w.params.model
        if v in core.retained(own):
            return True
        c = w.clients.get(releaser.split("#", 1)[0])
        allow_s = 2.5 * w.config.heartbeat_interval_s + 0.01 + self.max_delay_s
        return c is not None and c.driver is not None and self._replica_holds(c.driver, v, allow_s, core)

    def _replica_holds(self, d, v: int, allow_s: float, core=None) -> bool:
        """Every shard of replica ``d`` holds ``v`` whole in truth: its member alive, in memory or
        a host copy, or a process of that shard (the member now, or one it replaced) that crashed
        so recently (within ``allow_s``, holding ``v``) that the server cannot know yet. With
        ``core``: a crashed process counts only while that server still lists it (one declared
        dead is known gone: its replica no longer holds ``v`` whole for the server either;
        ``mixed_engines`` seed 989, where no other class kept a copy to mask it)."""
        now = self.world.sim.now
        for c in d.members:
            if c.alive and (c.mem == c.want(v) or c.host_copies.get(v) == c.want(v)):
                continue
            if not any(rep == d.replica_id and sh == c.tag_shard and v in held and now - t <= allow_s
                       and (core is None or cid in core.nodes)
                       for cid, (t, sh, held, _, rep, _) in self.crashes.items()):
                return False
        return True

    def _live_copy(self, releaser: str, v: int, shard: int, leaving: bool) -> bool:
        w = self.world
        # A copy of the releaser's own layout (a layout class's shard; in the mixed workload
        # the tags name it): its shard number alone in the others.
        rel = w.clients.get(releaser.split("#", 1)[0])
        if rel is not None:
            shard = rel.tag_shard
        want = None
        for c in w.clients.values():
            if c.tag_shard != shard or not c.keeps_copies or not c.alive:
                continue
            if want is None:
                want = c.want(v)
            if c.cid != releaser and c.mem == want:
                return True
            if (c.cid != releaser or not leaving) and c.host_copies.get(v) == want:
                return True
        # The server's liveness rule (heard from within 2.5 heartbeats), plus the longest a message
        # sent before the crash may have taken to arrive.
        allow_s = 2.5 * w.config.heartbeat_interval_s + 0.01 + self.max_delay_s
        if w.mixed is not None and self._whole_elsewhere(v, shard, allow_s):
            return True
        return any(sh == shard and v in held and not spot and w.sim.now - t <= allow_s
                   for t, sh, held, spot, _, _ in self.crashes.values())


    def _whole_elsewhere(self, v: int, tag_shard, allow_s: float) -> bool:
        """The mixed workload: a non-spot replica of another layout holds ``v`` whole, in memory
        or host copies (it holds every byte of the model: a resharded read, or its own class's
        reads, bring the version back), each of its shards alive or crashed so recently (within
        ``allow_s``, holding ``v``) that the server cannot know yet: the blind spot the same
        layout's copies are allowed."""
        for d in self.world.drivers():
            members = [c for c in d.members if c.keeps_copies]
            if (len(members) == d.num_shards and all(c.tag_shard != tag_shard for c in members)
                    and self._replica_holds(d, v, allow_s)):
                return True
        return False


def model_retains(core, model: str, v: int, keep: int) -> bool:
    """Whether ``v`` is one of the newest ``keep`` versions the layout classes of ``model``
    retain together (the contract; the core's ``Retention.kept`` is the rule)."""
    classes = [c for c in core.models if logical(c) == logical(model)]
    return v in sorted(set().union(*(core.retained(c) for c in classes)))[-keep:]


def _known_last_copy(checker) -> str:
    if checker.split:
        return KNOWN_OPEN["split_effect"]
    return ""


def _complete_in(core, model: str, v: int, dc: str) -> bool:
    """Every shard of ``v`` has a visible (published) holder in datacenter ``dc``."""
    shards = core.models[model].num_shards
    here = {n.shard for n in core.nodes.values()
            if n.model == model and n.version == v and n.datacenter == dc and n.state is NodeState.PUBLISHED}
    return len(here) == shards


def path_seeds(results) -> dict[str, int]:
    """Across how many of ``results`` each rare path was taken."""
    out = {p: 0 for p in PATHS}
    for r in results:
        for p, n in (r.paths or {}).items():
            if n:
                out[p] = out.get(p, 0) + 1
    return out


def _stalled_truth(core, model: str, version: int) -> bool:
    """Whether ``version`` of ``model``'s model is published in part by some replica (of any
    layout class) and every such replica lacks a registered client of some shard: the table's
    nodes, counted here apart from the core's own answer (:meth:`Versions.stalled`)."""
    base = logical(model)
    publishing: set[tuple[str, str]] = set()
    registered: dict[tuple[str, str], set[int]] = {}
    for n in core.nodes.values():
        if n.host or logical(n.model) != base:
            continue
        registered.setdefault((n.model, n.replica_id), set()).add(n.shard)
        if n.version == version and n.state is NodeState.PUBLISHED:
            publishing.add((n.model, n.replica_id))
    return bool(publishing) and all(len(registered[k]) < core.models[k[0]].num_shards for k in publishing)
