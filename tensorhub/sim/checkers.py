"""Invariant checkers. They observe; they never steer the system.

What they see: every request the server applied with its reply and effects (as a network tap
would), every physical memory write of a client, every finished operation, and the server's
``status`` (the same view a ``Query`` gives). Invariants:

(a) ``torn``       a replicate that returned done/no-change has every unit tagged with the
                   version the server gave (no shard holds bytes of two versions).
(b) ``mutate``     no holder's memory is written while a *live* read from it is in flight. A
                   read is live while the server still has the reader assigned to that source
                   in the same server epoch: an assignment is revoked by a newer one, by
                   ``Failed``/``Evicted`` to the reader, by the reader's own done/abort/
                   source-failed, by the source's eviction, leave or failure, and by a server
                   restart. (Revoked reads may see junk; the reader's checksum catches it.)
                   A write of the same version to a different unit is pipelining, not a violation.
                   A resharded read (``Assignment.reshard``) is live on every holder shard it
                   needs (the checker's own plan), each read on the holder's unit it copies,
                   until revoked as above (one of its holders leaving revokes it whole).
(c) ``txn``        all shards of a replica that finished one replicate round got one version.
(d) ``hang``       every operation ends (ok or a typed error) within ``bound_s`` after
                   max(its start, the end of the last fault); none is open at the end.
(e) ``retention``  while no holder was lost (no crash, preemption, eviction or server
                   restart so far), every retained (committed) version is available whenever
                   no holder of the model is draining or offloading (drains hide a holder by
                   design): checked at each UnpublishDone and at the end. After faults too, at
                   the end, against the ground truth: a retained version that some live replica
                   still holds whole (every shard's memory or host copy, non-spot) must be
                   available.
(f) ``bytes``      a replica that finished a round (all shards ok), and every replica at the
                   end, holds exactly the units the trainer wrote for that version. In the
                   ``mixed`` workload (:mod:`tensorhub.sim.mixed`) a unit's tag names its layout,
                   and a replica with a placement is checked per global range too: every box of
                   every global tensor its placement holds was written at that version by the
                   trainer (the union of the trainer shards' boxes, whatever their layout).
(g) ``cross_dc``   without faults, one cross-datacenter copy per (version, shard, dc): no
                   reader crosses while its datacenter already has a usable (complete, or
                   partial and at least as far) copy of that shard.
(h) ``dangling``   a host copy the server hands out exists.
(i) ``restart``    no holder's memory is written under a read that spans a server restart
                   while the new server protects it: within one lease of the restart (the
                   recovery window) unless the new server has the reader elsewhere, and later
                   while the new server has the reader attached to that source.
(o) ``control``    a handle's control block never advertises a unit its memory does not hold:
                   a user write (or a read of another version) below the advertised progress
                   of the advertised version is a violation (a failed read must hide its
                   partial region before the user may write the tensors).
(p) ``host_leak``  at the end (quiesced, after a grace of a few heartbeats), no live process
                   keeps a host copy of a version the server no longer retains, and the server
                   lists no host copy past retention.
(r) ``ghost``      an unpublish that skips the offload of a retained version leaves a copy on a
                   live process: not only copies on processes that crashed and had sent nothing
                   of their own for ``2.5 * heartbeat_interval_s`` (:class:`GhostCopyChecker`).
(s) ``lost``       an ``update()`` of a relative spec ends ``VersionLost`` only after it asked
                   again (the one retry a lost version gets) or when the server has no version
                   available: a read that failed (even one whose every byte landed, its source
                   dead) must not fail the update while an older retained version is held.
(t) ``fresh``      a no-op update answered locally names the newest version its handle was told
                   of, and one that was the model's newest readable within
                   ``noop_staleness_s`` (:mod:`tensorhub.sim.freshness`).
(u) ``reshard``    a resharded read's assignment lists every shard of one holder replica in
                   shard order with their placements, covers the reader (a plan with no gaps),
                   names as its source the first holder shard the reader needs, and every needed
                   shard holds the version whole when assigned (a holder whose process died,
                   which the server cannot know yet, excepted).
(j)-(n), (v), (w)  need the core's table before and after a step: :mod:`tensorhub.sim.observer`
                   ((v) ``replayed``: a new call of a named round is not answered an earlier
                   call's ``VersionNotFound`` while its version is available; (w) ``stalled``:
                   ``VersionStalled`` exactly when every replica publishing the version lacks a
                   shard's client).
"""

from __future__ import annotations

from typing import Optional

from tensorhub.core import messages as m
from tensorhub.core.placements import logical, shown
from tensorhub.core.state import COMPLETE, NodeState
from tensorhub.placement import _subtract_all
from tensorhub.sim.freshness import NoopFreshnessChecker
from tensorhub.sim.known import KNOWN_OPEN
from tensorhub.sim.observer import CoreObserver, model_retains





class Checker:
    def __init__(self, world) -> None:
        self.world = world
        self.violations: list[tuple[str, float, str]] = []
        self.assign: dict[str, tuple[int, int, tuple[str, ...]]] = {}
        """reader -> (epoch, assign_no, the sources it may read): one, or a resharded read's
        needed holder shards (by the checker's own plan)."""
        self.open_ops: dict[int, object] = {}
        self.completed = 0
        self.failed: dict[str, int] = {}
        self.loss_at: Optional[float] = None
        self.seen_committed: set[int] = set()
        self.seen_committed_classes: dict[str, set[int]] = {}
        """The same, per layout class other than the model's first (the mixed workload)."""
        self.trainer_versions: set[tuple[int, int]] = set()
        self.global_written: dict[tuple[str, int], list] = {}
        """(global tensor, version) -> the boxes of it the trainer wrote at that version (mixed)."""
        self.cross_extra: list[str] = []
        self.source_failed_versions: set[int] = set()
        self.bound_s = 0.0
        self.fault_end_s = 0.0
        self.ghosts = GhostCopyChecker(world, self.violate)
        self.freshness = NoopFreshnessChecker(world, self.violate)
        self.restarted_at: Optional[float] = None
        """When the server last restarted (its recovery window starts then)."""
        self.live_at_death: dict[int, dict[str, tuple[int, int, tuple[str, ...]]]] = {}
        """Server epoch -> the reads (``assign``) still live when that server died (i)."""
        self.forgotten_sources: set[str] = set()
        """Clients the server restarted last has evicted since (a sibling's process died, a lease
        ran out): it protects no read of theirs that spans the restart (i), as the old server
        would not have (b). Not a holder that left: it may leave only once its drain ended,
        which is what the recovery window holds back."""
        self.observer = CoreObserver(self)
        self.known_open: list[tuple[str, float, str]] = []
        """Violations of open defects of the shipped code (see :data:`KNOWN_OPEN`)."""
        self.split: set[str] = set()
        self.unoffered: set[tuple[str, int]] = set()
        """(client, version): host copies whose HostCopy offer got no reply (see ``retention_msg_loss``)."""
        """Clients whose failed call left the server listing them as published holders (q)."""
        self.asks: dict[str, int] = {}
        """Replicate requests the server applied for each client's open operation (s)."""
        self.last_code: dict[str, tuple[str, str]] = {}
        """How each client's last operation ended."""

    def violate(self, kind: str, msg: str, known: str = "") -> None:
        """Record a violation; ``known``: it is an open defect of the shipped code, named there
        (reported apart, in ``known_open``, so that it does not fail runs until it is fixed)."""
        now = self.world.sim.now
        if known:
            self.known_open.append((kind, now, f"{msg} [open: {known}]"))
            self.world.sim.trace(f"KNOWN {kind}: {msg}")
            return
        self.violations.append((kind, now, msg))
        self.world.sim.trace(f"VIOLATION {kind}: {msg}")

    def note_loss(self, why: str) -> None:
        if self.loss_at is None:
            self.loss_at = self.world.sim.now

    # ------------------------------------------------------------------ server tap

    def on_server(self, cid, req, reply, effects, epoch: int) -> None:
        self.ghosts.on_server(cid, req, reply, effects)
        if self.world.server.core is not None:
            self.freshness.observe(self.world.server.core, self.world.sim.now)
        if isinstance(req, m.Replicate):
            self.asks[cid] = self.asks.get(cid, 0) + 1
        if isinstance(req, (m.Publish, m.ReplicateDone, m.Announce)) and isinstance(reply, m.Ok):
            # Every commit, as it happens (a status sample could miss one lost soon after).
            core = self.world.server.core
            for cls in core.table.classes.get(self.world.params.model) or (self.world.params.model,):
                mod = core.models.get(cls)
                if mod is not None:
                    self.committed_in(shown(cls)).update(mod.committed)
        if req is not None and not isinstance(reply, m.ErrorReply):
            if isinstance(req, (m.ReplicateDone, m.ReplicateAbort, m.Replicate, m.SourceFailed, m.Leave)):
                self.assign.pop(cid, None)
            if isinstance(req, (m.Leave, m.ReplicateAbort)):
                self._revoke_source(cid)  # an aborting partial holder's followers are orphaned
            if isinstance(req, m.SourceFailed):
                self.source_failed_versions.add(-1)
        batch = [(e.client_id, e.event) for e in effects if isinstance(e.event, m.Assignment)]
        if isinstance(reply, m.Assignment):
            batch.append((cid, reply))
        fresh = {c for c, _ in batch}
        for c, a in batch:
            self._assigned(c, a, epoch, fresh)
        retention_check = isinstance(reply, m.UnpublishDone)
        for eff in effects:
            ev = eff.event
            if isinstance(ev, (m.Failed, m.Demoted)):
                self.assign.pop(eff.client_id, None)
                self._revoke_source(eff.client_id)  # its own readers were orphaned
            elif isinstance(ev, m.Evicted):
                self.assign.pop(eff.client_id, None)
                self._revoke_source(eff.client_id)
                self.forgotten_sources.add(eff.client_id)
            elif isinstance(ev, m.UnpublishDone):
                retention_check = True
        if retention_check:
            self.check_retention("unpublish")

    def _assigned(self, cid: str, a: m.Assignment, epoch: int, fresh: set) -> None:
        sources = self._check_reshard(cid, a) if a.reshard else (a.source_id,)
        self.assign[cid] = (epoch, a.assign_no, sources)
        if "#host" in a.source_id:
            # (h): a host copy the server hands out must exist: its owner frees one only when the
            # server dropped it (or with its process).
            owner = self.world.source_client(a.source_id)
            if owner is not None and owner.alive and a.version not in owner.host_copies:
                self.violate("dangling", f"{cid} assigned host copy {a.source_id} of version {a.version}, "
                                         f"which its owner freed")
        if a.cross_datacenter and not self.world.faults_injected:
            # (g): crossing is wasted when the reader's datacenter already had a usable copy
            # (complete, or partial and at least as far as the reader) before this decision.
            reader = self.world.clients.get(cid)
            st = self.world.server.status(self.world.params.model)
            if reader is None or st is None or not st.models:
                return
            holders = st.models[0].holders
            mine = next((h.progress for h in holders if h.client_id == cid), 0)
            local = [h.client_id for h in holders
                     if h.client_id != cid and h.client_id not in fresh and h.datacenter == reader.dc
                     and h.version == a.version and h.shard == reader.shard
                     and (h.state == "published" or (h.state == "reading" and h.progress >= mine))]
            if local:
                self.cross_extra.append(f"{cid} read version {a.version} shard {reader.shard} across "
                                        f"datacenters while {local} held it in {reader.dc}")

    def _revoke_source(self, cid: str) -> None:
        """``cid`` no longer serves: every read of it is revoked (a resharded read's reads from
        its other holders too: the server detaches the reader from all of them)."""
        prefix = cid + "#host"
        for reader in [r for r, (_, _, ss) in self.assign.items()
                       if any(s == cid or s.startswith(prefix) for s in ss)]:
            del self.assign[reader]

    def live(self, rd) -> bool:
        got = self.assign.get(rd.reader)
        return (rd.epoch == self.world.server.epoch and got is not None and got[:2] == (rd.epoch, rd.assign_no)
                and rd.source in got[2])

    def _check_reshard(self, cid: str, a: m.Assignment) -> tuple[str, ...]:
        """(u) a resharded read's assignment lists one holder per shard of one layout (shard
        order, each its own placement: shards of several replicas of a layout class may serve
        one read, the per-shard choice of ``OtherLayouts``), names as its source the first
        shard the reader needs, the needed ones are exactly those the server counts it a
        reader of, and
        every needed shard holds the version whole when assigned (its memory; a holder whose
        process is dead, which the server cannot know yet, excepted). Returns the needed
        holders' client ids: the sources of (b) for this read."""
        w = self.world
        listed = [s.client_id for s in a.reshard]
        reader = w.clients.get(cid)
        holders = [w.clients.get(x) for x in listed]
        by_digest = {p.digest(): p for p in a.placements}
        shards = [s.shard for s in a.reshard]
        if shards != list(range(len(shards))) or any(
                h is not None and (h.num_shards != len(shards) or h.shard != s.shard or h.placement is None
                                   or h.placement.digest() != s.placement) for h, s in zip(holders, a.reshard)):
            self.violate("reshard", f"{cid} assigned version {a.version} by a resharded read from {listed} "
                                    f"(shards {shards}): not one holder per shard of a layout, in order, "
                                    "each with its placement")
            return tuple(listed)
        placements = tuple(by_digest.get(s.placement) for s in a.reshard)
        if reader is None or reader.placement is None or any(p is None for p in placements):
            self.violate("reshard", f"{cid} assigned a resharded read without its placements")
            return tuple(listed)
        deps = w.mixed.deps(reader.placement, placements, reader.shard)
        if not deps.complete:
            self.violate("reshard", f"{cid} assigned version {a.version} from {listed}, which do not hold all it needs")
            return tuple(listed)
        needed = tuple(listed[s] for s in deps.shards)
        core = w.server.core
        node = core.nodes.get(cid) if core is not None else None
        if node is not None and node.assign_no == a.assign_no and (
                set(node.reshard_from) != set(needed)
                or any(h in core.nodes and cid not in core.nodes[h].readers for h in needed)):
            # The holders the reader will read are those the server counts it a reader of (their
            # drains wait for it): else one could overwrite the bytes under the read.
            self.violate("reshard", f"{cid} assigned version {a.version} from {needed}, but the server counts it "
                                    f"a reader of {list(node.reshard_from)}")
        if len({holders[s].replica_id for s in deps.shards if holders[s] is not None}) > 1:
            self.observer.path("reshard_across_replicas")  # the per-shard choice (or swap) of OtherLayouts
        if a.source_id != needed[0]:
            self.violate("reshard", f"{cid}'s resharded read names source {a.source_id}, not its first needed "
                                    f"holder {needed[0]}")
        for s in deps.shards:
            h = holders[s]
            if h is None and "#host" in listed[s]:  # a host copy (its owner's placement)
                owner = w.clients.get(listed[s].split("#", 1)[0])
                v = int(listed[s].rsplit("#host", 1)[1])
                if owner is not None and owner.alive and (v != a.version or owner.host_copies.get(v) != owner.want(v)):
                    self.violate("reshard", f"{cid} assigned version {a.version} by a resharded read from {listed}, "
                                            f"but needed host copy {listed[s]} does not hold it whole")
                continue
            if h is None or not h.alive:
                continue
            if h.region_version != a.version or h.region_progress < h.units or h.mem != h.want(a.version):
                self.violate("reshard", f"{cid} assigned version {a.version} by a resharded read from {listed}, "
                                        f"but needed shard {h.cid} holds {h.region_progress}/{h.units} units of "
                                        f"version {h.region_version}")
        return needed

    # ------------------------------------------------------------------ physical memory

    def on_write(self, key: str, unit: Optional[int], version: int) -> None:
        """(b), (i), (o): ``key`` (a client or one of its host copies) writes ``unit`` (None: all units)."""
        self._check_control(key, unit, version)
        if self.restarted_at is not None:
            self._check_restart_reads(key, unit, version)
        for rd in self.world.net.reads_from(key):
            if rd.dead and not self.live(rd):
                continue
            if not self.live(rd):
                continue
            if unit is None or rd.unit == unit or rd.version != version:
                self.violate("mutate", f"{key} writes unit {unit} (version {version}) while "
                             f"{rd.reader} reads unit {rd.unit} of version {rd.version} from it",
                             known=KNOWN_OPEN["split_effect"] if key.split("#")[0] in self.split else "")
                return

    def _check_control(self, key: str, unit: Optional[int], version: int) -> None:
        c = self.world.clients.get(key)
        if c is None or c.region_version < 0 or version in (c.region_version, -3):  # -3: freed with its process
            return
        if (unit is None and c.region_progress > 0) or (unit is not None and unit < c.region_progress):
            code, kind = self.last_code.get(key, ("ok", "replicate"))
            known = KNOWN_OPEN["split_effect"] if key in self.split else ""
            self.violate("control", f"{key} writes unit {unit} (version {version}) while its control block "
                                    f"advertises {c.region_progress} units of version {c.region_version} "
                                    f"(its last call, {kind}, ended {code})", known=known)

    def _check_restart_reads(self, key: str, unit: Optional[int], version: int) -> None:
        w = self.world
        core = w.server.core
        for rd in w.net.reads_from(key):
            if rd.dead or rd.cancelled or rd.pull_epoch >= w.server.epoch:
                continue
            if not (unit is None or rd.unit == unit or rd.version != version):
                continue
            reader = w.clients.get(rd.reader)
            if reader is None or not reader.alive or reader.reading is None or not reader.reading.owns(rd):
                continue
            node = core.nodes.get(rd.reader) if core is not None else None
            attached = (node is not None and (node.source == rd.source or rd.source in node.reshard_from)
                        and node.state is NodeState.READING)
            if not attached and (not self._live_at_death(rd) or key.split("#")[0] in self.forgotten_sources):
                # Revoked before its server died (that server failed the reader, or evicted the
                # holder: (b)'s rules), or its holder evicted since by the new server, which has
                # not taken the read up: no server protects it; it may see junk, which its
                # checksums catch.
                continue
            in_window = w.sim.now < self.restarted_at + w.config.lease_timeout_s and (
                node is None or node.awaiting_source == rd.source or attached)
            if attached or in_window:
                self.violate("restart", f"{key} writes unit {unit} (version {version}) while {rd.reader} reads unit "
                                        f"{rd.unit} of version {rd.version} from it under a read that spans the "
                                        f"server restart at {self.restarted_at:.3f}s")
                return

    def note_restart(self) -> None:
        self.restarted_at = self.world.sim.now
        self.forgotten_sources = set()
        # A read that spans an earlier restart and that the server which just died revoked (it
        # failed or evicted the reader, assigned it anew, saw it end) spans this restart no more:
        # no later server protects it (mixed seed 9649: the second server failed a resharded
        # read the first had assigned once its window ended, let the holders unpublish, and
        # died before the reader heard; a holder's write under the third server is no violation).
        for live in self.live_at_death.values():
            for reader in [r for r, got in live.items() if self.assign.get(r) != got]:
                del live[reader]
        for e in range(self.world.server.epoch):
            self.live_at_death.setdefault(e, {})
        for reader, got in self.assign.items():
            if got[0] < self.world.server.epoch:
                self.live_at_death.setdefault(got[0], {})[reader] = got

    def _live_at_death(self, rd) -> bool:
        """Whether read ``rd`` (of a pull assigned by a server that has died since) was still live
        when that server died."""
        got = self.live_at_death.get(rd.pull_epoch, {}).get(rd.reader)
        return got is not None and got[1] == rd.assign_no and rd.source in got[2]

    def check_host_leaks(self) -> None:
        """(p), at the end."""
        w = self.world
        core = w.server.core
        if core is None:
            return
        mod = core.models.get(w.params.model)
        if mod is None:
            return
        past = mod.forgotten_below
        # A host copy past retention still draining under a reader the server lists (alive, or
        # dead and not expired yet: the drain waits for its lease) is on its way out, not a leak.
        waiting = {n.id for n in core.nodes.values()
                   if n.host and n.state is NodeState.DRAINING and any(r in core.nodes for r in n.readers)}
        for c in w.clients_alive():
            past = self._forgotten_below(core, c, mod.forgotten_below)
            for v in sorted(c.host_copies):
                if v < past and f"{c.cid}#host{v}" not in waiting:
                    self.violate("host_leak", f"{c.cid} still keeps a host copy of version {v}, past retention "
                                              f"(versions below {past} are forgotten)")
        for n in core.nodes.values():
            past = core.models[n.model].forgotten_below
            if n.host and 0 <= n.version < past and n.id not in waiting:
                self.violate("host_leak", f"the server lists host copy {n.id} of version {n.version} past retention "
                                          f"(versions below {past} are forgotten)")

    @staticmethod
    def _forgotten_below(core, c, default: int) -> int:
        """Retention's floor in ``c``'s layout class (the class its node, or a sibling's, is in)."""
        node = core.nodes.get(c.cid)
        if node is None and c.driver is not None:
            node = next((core.nodes[x.cid] for x in c.driver.members if x.cid in core.nodes), None)
        return default if node is None else core.models[node.model].forgotten_below

    def trainer_wrote(self, client, version: int) -> None:
        self.trainer_versions.add((client.tag_shard, version))
        if client.placement is not None:
            for lp in client.placement.tensors:
                for piece in lp.pieces:
                    self.global_written.setdefault((piece.tensor, version), []).append(piece.box)

    def check_memory(self, client, version: int, kind: str) -> bool:
        want = client.want(version)
        if client.mem != want:
            bad = [k for k in range(client.units) if client.mem[k] != want[k]]
            self.violate(kind, f"{client.cid} holds version {version} but units {bad[:4]} are "
                               f"{[client.mem[k] for k in bad[:4]]}",
                         known=KNOWN_OPEN["split_effect"] if self.split else "")
            return False
        if client.placement is not None:
            return self._check_global(client, version)
        if (client.shard, version) not in self.trainer_versions:
            self.violate("bytes", f"{client.cid} holds version {version} that no trainer wrote")
            return False
        return True

    def _check_global(self, client, version: int) -> bool:
        """(f) per global range: every box of every global tensor ``client``'s placement holds
        was written at ``version`` by the trainer (the union of its shards' boxes, whatever its
        layout): a replica of another layout holds no byte the trainer did not write."""
        for lp in client.placement.tensors:
            for piece in lp.pieces:
                rest = _subtract_all([piece.box], self.global_written.get((piece.tensor, version), ()))
                if rest:
                    self.violate("bytes", f"{client.cid} holds version {version} of {piece.tensor} {rest[0]} "
                                          f"(in its {lp.name}), which no trainer wrote at that version")
                    return False
        return True

    def on_replicated(self, client, version: int) -> None:
        self.check_memory(client, version, "torn")

    def on_round(self, driver, results: dict[int, tuple[str, int]]) -> None:
        """(c) and (f) after one replicate round of a replica."""
        if driver.broken:
            return  # the replica was evicted or lost a member: the server reset its rounds
        ok = {i: v for i, (code, v) in results.items() if code == "ok"}
        if len(set(ok.values())) > 1:
            self.violate("txn", f"replica {driver.replica_id} round {driver.seq}: shards got versions {ok}",
                         known=KNOWN_OPEN["txn_default_rounds"] if self.world.default_rounds and driver.gen else "")
            return
        if len(ok) == driver.num_shards:
            for i, v in ok.items():
                c = driver.members[i]
                if c.alive and c.published == v:
                    self.check_memory(c, v, "bytes")

    # ------------------------------------------------------------------ operations

    def op_start(self, op) -> None:
        self.open_ops[id(op)] = op
        self.asks[op.cid] = 0

    def op_end(self, op, code: str) -> None:
        self.open_ops.pop(id(op), None)
        self.last_code[op.cid] = (code, op.kind)
        if code in ("ServerUnavailable", "RequestTimeout", "TransactionMismatch", "LastCopyHeld"):
            self.observer.path(code)
        core = self.world.server.core
        node = core.nodes.get(op.cid) if core is not None and op.kind in ("replicate", "publish") and code != "ok" \
            else None
        c = self.world.clients.get(op.cid)
        if node is not None and node.state is NodeState.PUBLISHED and c is not None and (
                c.published is None if op.kind == "replicate" else c.published != node.version):
            # (q) the handle and the server must agree on what it publishes (a publish without a
            # reply the server applied: the handle holds it as published, the user unpublishes).
            self.split.add(op.cid)
            self.violate("split", f"{op.cid}'s {op.kind} failed ({code}) while the server lists it as a published "
                                  f"holder of version {node.version} (the handle: {c.published})")
        if code == "VersionLost" and op.relative_update and self.asks.get(op.cid, 0) < 2:
            st = self.world.server.status(self.world.params.model) if self.world.server.up else None
            avail = list(st.models[0].available) if st is not None and st.models else []
            if avail:
                self.violate("lost", f"{op.cid}'s update ended VersionLost without asking again, "
                                     f"while versions {avail} are available")
        if code == "ok":
            self.completed += 1
        else:
            self.failed[code] = self.failed.get(code, 0) + 1
        now = self.world.sim.now
        if now - max(op.start, self.fault_end_s) > self.bound_s:
            self.violate("hang", f"{op.cid} {op.kind} took {now - op.start:.1f}s (bound {self.bound_s:.1f}s)")

    def op_abandon(self, op) -> None:
        self.open_ops.pop(id(op), None)

    # ------------------------------------------------------------------ state checks

    def committed_in(self, cls: str) -> set[int]:
        """The versions the checker saw committed in layout class ``cls`` (as the server's status
        names it, :func:`~tensorhub.core.placements.shown`; the model itself outside the mixed
        workload)."""
        if cls == self.world.params.model:
            return self.seen_committed
        return self.seen_committed_classes.setdefault(cls, set())

    def class_views(self) -> list:
        """The model's view per layout class (:mod:`tensorhub.core.placements`): retention is a
        class's (its own rounds, commits and retained versions). One view outside ``mixed``."""
        w = self.world
        if w.mixed is None:
            st = w.server.status(w.params.model)
            return list(st.models[:1]) if st is not None else []
        st = w.server.status(w.params.model)  # the first class under the model's name, the others
        return [] if st is None else list(st.models)  # as "<model> (layout class n)"

    def check_retention(self, where: str) -> None:
        if self.loss_at is not None:
            return
        if self.world.mixed is not None:
            self._check_retention_across(where)
            return
        for mv in self.class_views():
            # The checker keeps its own record of committed versions: the server drops a version
            # it believes lost, and that must not hide a retention bug.
            seen = self.committed_in(mv.model)
            seen.update(mv.committed)
            if any(h.state in ("draining", "offloading") for h in mv.holders):
                continue
            expected = sorted(seen)[-self.world.config.versions_retained:]
            missing = sorted(set(expected) - set(mv.available))
            if missing:
                self.violate("retention", f"at {where}: retained versions {missing} are not available "
                                          f"(newest committed {expected}, available {list(mv.available)})")

    def _check_retention_across(self, where: str) -> None:
        """(e) with layout classes: the model's newest retained versions (committed in any class)
        are each available in some class, whenever no holder of any class drains or offloads. A
        class does not keep a version another layout holds whole (the core's retention counts
        copies across classes), so one class alone may well lack it."""
        views = self.class_views()
        if any(h.state in ("draining", "offloading") for mv in views for h in mv.holders):
            return
        for mv in views:
            self.committed_in(mv.model).update(mv.committed)
        seen = self.seen_committed.union(*self.seen_committed_classes.values())
        expected = sorted(seen)[-self.world.config.versions_retained:]
        available = set().union(*(mv.available for mv in views)) if views else set()
        missing = sorted(set(expected) - available)
        if missing:
            self.violate("retention", f"at {where}: retained versions {missing} are available in no layout class "
                                      f"(newest committed {expected}, available {sorted(available)})")

    def check_retention_truth(self) -> None:
        """(e) after faults: the server must list every retained version that live non-spot
        memory still holds whole (one replica's shards, GPU copy or host copy)."""
        for mv in self.class_views():
            self._retention_truth(mv)

    def _retention_truth(self, mv) -> None:
        w = self.world
        seen = self.committed_in(mv.model)
        if not seen:
            return
        if any(h.state in ("draining", "offloading") for h in mv.holders):
            return
        seen.update(mv.committed)
        expected = sorted(seen)[-w.config.versions_retained:]
        ids = {h.client_id for h in mv.holders}
        for v in sorted(set(expected) - set(mv.available)):
            holders, unoffered = [], True
            for d in w.drivers():
                members = [c for c in d.members if c.alive and c.keeps_copies]
                if w.mixed is not None and not any(c.cid in ids for c in members):
                    continue  # a replica of another layout class (or unknown to the server)
                if len(members) == d.num_shards and all(self._holds(c, v) for c in members):
                    holders.append(d.replica_id)
                    unoffered = unoffered and any((c.cid, v) in self.unoffered for c in members)
            if holders:
                self.violate("retention", f"at end: retained version {v} is not available while replica(s) "
                                          f"{holders} hold it whole (available {list(mv.available)})",
                             known=KNOWN_OPEN["retention_msg_loss"] if unoffered else "")

    @staticmethod
    def _holds(c, v: int) -> bool:
        want = c.want(v)
        return (c.published == v and c.mem == want) or c.host_copies.get(v) == want

    def final(self, quiesced: bool) -> None:
        w = self.world
        for op in self.open_ops.values():
            self.violate("hang", f"{op.cid} {op.kind} (started {op.start:.1f}s) never finished")
        if not quiesced:
            self.violate("hang", "the workload did not quiesce before the deadline")
        self.check_retention("end")
        if quiesced:
            self.check_retention_truth()
            self.check_host_leaks()
        for d in w.rollouts:
            alive = [c for c in d.members if c.alive]
            if len(alive) == d.num_shards and alive[0].published is not None:
                vs = {c.published for c in alive}
                if len(vs) == 1:
                    for c in alive:
                        self.check_memory(c, c.published, "bytes")
        if not w.faults_injected:
            for msg in self.cross_extra:
                self.violate("cross_dc", msg)


class GhostCopyChecker:
    """(i) ``ghost``: the last-copy rule must rest on proof of life. When a non-spot holder of a
    retained version stops holding it (an unpublish, or the drain of an update) and keeps no
    host copy of it (the offload skipped), the server counted another copy as live. If every
    other copy it still lists is served by a process that has crashed and had sent no request
    of its own for ``2.5 * heartbeat_interval_s`` before that moment, the server had no proof
    that any lived (a held pulse is none: a process dead without Ray knowing is held the same),
    and the version rests on ghosts: lost once their leases run out. A copy that crashed within
    that window is the protocol's accepted blind spot (silence that short proves nothing
    either), not flagged; nor is a holder the server removed (declared dead, or left)."""

    def __init__(self, world, violate) -> None:
        self.world = world
        self.violate = violate
        self.last_request: dict[str, float] = {}
        """Client -> when the server last got a request of its own process (a pulse's arrival
        included; the time it was held, not)."""
        self.held: dict[str, int] = {}
        """Client -> the version the server last listed it as a complete holder of."""
        self.core = None

    def on_server(self, cid, req, reply, effects) -> None:
        now = self.world.sim.now
        if isinstance(req, m.Pulse):
            for b in req.beats:
                self.last_request[b.client_id] = now
        elif req is not None and cid is not None:
            self.last_request[cid] = now
        core = self.world.server.core
        if core is not self.core:  # a restarted server: a new table
            self.core, self.held = core, {}
        held = {}
        for n in core.nodes.values():
            if not n.host and n.keeps_copies and n.state.value in ("published", "draining", "offloading"):
                held[n.id] = n.version
        for holder, version in self.held.items():
            if held.get(holder) != version and holder in core.nodes:
                self._check(core, holder, version, now)
        self.held = held

    def _check(self, core, holder: str, version: int, now: float) -> None:
        node = core.nodes[holder]
        if (version not in core.retained(node.model) or f"{holder}#host{version}" in core.nodes
                or not model_retains(core, node.model, version, self.world.config.versions_retained)):
            return  # not retained (by its class, or by the model: its classes together)
        own = [core.nodes[i] for i in sorted(core.groups.get((node.model, version, node.shard), ()))]
        # Another layout class's copies count too (the core's retention counts a replica of
        # another layout that holds the version whole): every shard of theirs, any one alive
        # proves enough for this checker (it does not plan whether that layout fills the shard).
        # There a draining or offloading holder is a copy as much as a published one: it holds
        # every unit, its process writes none before its drain ends, and the end of its own drain
        # decides its offload anew, after this holder let go (the core's COMPLETE).
        others = []
        for cls in core.table.classes.get(logical(node.model), ()):
            if cls != node.model:
                for s in range(core.models[cls].num_shards):
                    others += [core.nodes[i] for i in sorted(core.groups.get((cls, version, s), ()))]
        copies = [o for o in own if o.state.value == "published"] + [o for o in others if o.state in COMPLETE]
        owners = sorted({o.owner if o.host else o.id for o in copies
                         if o.id != holder and o.owner != holder and o.keeps_copies})
        if not owners:
            return  # no other copy counted: not a skip this checker judges
        window = 2.5 * self.world.config.heartbeat_interval_s
        for cid in owners:
            c = self.world.clients.get(cid)
            if c is None or c.alive or now - self.last_request.get(cid, float("-inf")) <= window:
                return
        self.violate("ghost", f"{holder} let go of version {version} shard {node.shard} without an offload while "
                              f"its only other copies were on crashed processes {owners}, silent for over {window:.1f}s")
