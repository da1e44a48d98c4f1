"""A resharded read in the simulated world: a :class:`~tensorhub.core.handle.Pull` whose
assignment names ``reshard`` sources (a holder replica of another layout class).

What the real handle will do (docs/placements.md, :mod:`tensorhub.transport.reshard_read`),
at unit and range granularity (:mod:`tensorhub.sim.mixed`):

1. Plan once over every listed holder shard's placement (shard order; ``spread`` = the
   reader's shard): the holder shards it needs and, per reader unit of its own layout, the
   holder units whose ranges write into it. A plan with gaps (a listed replica that does not
   cover the reader) fails the pull at once, naming the assignment's source.
2. Read the needed holder units, those the earliest unfinished reader units need first, up to
   ``reads_in_flight`` at a time over every needed holder concurrently; only while the holder's
   control block shows the version (one that moved on fails the pull, naming that holder). A
   read copies the holder unit's tag at its END (a write to it meanwhile: torn). With checksums
   the tag is checked as it lands (a bad one fails the pull, naming the holder); without, a
   control read after the bytes landed must still show the version (the seqlock).
3. A reader unit is done when every holder range writing into it landed (checked): the pull's
   progress, reported to the server and shown in the control block so that readers of the
   reader's own class pipeline from it, is the prefix of done units. A done unit's tag is the
   reader's own ``(version, layout:shard, unit)`` when every tag it was built from was the
   holder's for that version, else what went wrong (TORN).
4. A needed holder that dies or stalls (nothing landed for ``source_stall_timeout_s``) fails
   the pull naming it (``Pulled.source``: the machine's ``SourceFailed`` names it); a failed or
   stopped pull cancels its posted reads and ends only when every one has ended (a cancelled
   read lands junk in the reader units it writes into, none of them done).
5. A failover keeps what is in place and checked (``ReshardRead.kept``): the done units of a
   failed pull, not only their prefix, are done for the next resharded pull of the same read
   and version (whatever replica, of whatever layout, it names), which reads only the holder
   units the other reader units need. A pull from a holder of the reader's own class, or a new
   read, drops them (the handle's ``drop_kept``/``begin_read``).
"""

from __future__ import annotations

from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.sim.mixed import UNIT_BYTES
from tensorhub.sim.tags import TORN


class HostCopySource:
    """A host copy as a resharded read's holder (its placement is its owner's): served by its
    owner's process while the owner keeps it, complete and never written (a freed one reads as
    FREED: ``World.read_tag``)."""

    def __init__(self, owner, version: int) -> None:
        self.cid = f"{owner.cid}#host{version}"
        self.alive = owner.alive and version in owner.host_copies
        self.endpoint = owner.machine.host_copies.get(version)
        self.region_version = version
        self.region_progress = owner.units
        self.units = owner.units
        self.host, self.tag_shard = owner.host, owner.tag_shard
        self.waiters: dict = {}
        """Never partial: nobody waits on it (a throwaway, as each look builds a new view)."""


class ReshardPulling:
    """One resharded pull in flight (see the module docstring); driven by :class:`ReshardPull`."""

    def __init__(self, a: m.Assignment, start: int, token: int, epoch: int) -> None:
        self.version = a.version
        self.assign_no = a.assign_no
        self.token = token
        self.epoch = epoch
        self.start = start
        self.source = a.source_id
        """The assignment's named source (the first needed holder shard)."""
        self.holders: dict[int, tuple[str, bytes]] = {}
        """Needed holder shard -> (client id, endpoint)."""
        self.deps = None
        self.done: set[int] = set(range(start))
        self.landed: dict[tuple[int, int], object] = {}
        """(holder shard, holder unit) -> the tag it brought (checked)."""
        self.inflight: dict[tuple[str, int], object] = {}
        self.failing = False
        self.dead_pending = False
        self.ends_at = 0.0
        self.last_landed = 0.0
        self.rebuilt = None

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(cid for cid, _ in self.holders.values())

    @property
    def progress(self) -> int:
        k = 0
        while k in self.done:
            k += 1
        return k

    def owns(self, rd) -> bool:
        return self.inflight.get((rd.source, rd.unit)) is rd


class ReshardPull:
    """The resharded pulls of one client (a part of :class:`~tensorhub.sim.transport.SimTransport`)."""

    def __init__(self, transport) -> None:
        self.t = transport
        self.client = transport.client
        self.world = transport.world
        self.kept: tuple[int, frozenset[int]] | None = None
        """(version, reader units done) a failed pull of the current read left (rule 5)."""

    def pull(self, a: m.Assignment, start: int, token: int) -> None:
        c, w = self.client, self.world
        if start == 0:
            c.region_version, c.region_progress = a.version, 0
        first = c.region_progress if c.region_version == a.version else 0
        rs = ReshardPulling(a, first, token, w.server.epoch)
        if self.kept is not None and self.kept[0] == a.version == c.region_version:
            if self.kept[1] - rs.done:
                w.checker.observer.path("reshard_kept")
            rs.done |= self.kept[1]
        self.kept = None
        rs.last_landed = w.sim.now
        self.t.current = rs
        by_digest = {p.digest(): p for p in a.placements}
        listed = sorted(a.reshard, key=lambda s: s.shard)
        holders = tuple(by_digest.get(s.placement) for s in listed)
        if any(h is None for h in holders) or [s.shard for s in listed] != list(range(len(listed))):
            self._failed(rs, "layout mismatch: the assignment's holder placements are not a replica's", a.source_id)
            return
        deps = w.mixed.deps(c.placement, holders, c.shard)
        if not deps.complete:
            self._failed(rs, "layout mismatch: the holder replica does not hold what the reader needs", a.source_id)
            return
        rs.deps = deps
        rs.holders = {s.shard: (s.client_id, s.endpoint) for s in listed if s.shard in deps.shards}
        self._advance(rs)
        if rs.failing or rs is not self.t.current:
            return
        w.sim.at(w.sim.now + w.config.source_stall_timeout_s, self._watch, rs)

    # ------------------------------------------------------------------ the interface

    def stop(self, rs: ReshardPulling) -> float:
        rs.failing = True
        end = self._cancel_reads(rs)
        self._forget_sources(rs)
        return end

    def died(self, rs: ReshardPulling) -> None:
        for rd in rs.inflight.values():
            rd.dead = True
            self.world.net.unregister(rd)

    def poke(self, rs: ReshardPulling, source_cid: str) -> None:
        if source_cid in rs.sources:
            self._issue(rs)

    def source_died(self, rs: ReshardPulling) -> None:
        for key, rd in list(rs.inflight.items()):
            src = self._source(rd.source)
            if src is None or not src.alive:
                rd.dead = True
                del rs.inflight[key]
        self._issue(rs)

    # ------------------------------------------------------------------ reads

    def _pending(self, rs: ReshardPulling):
        """Holder units still to read, those the earliest unfinished reader units need first."""
        seen = set()
        for k, needs in enumerate(rs.deps.units):
            if k in rs.done:
                continue
            for pair in sorted(needs):
                if pair not in rs.landed and pair not in seen:
                    seen.add(pair)
                    yield pair

    def _source(self, cid: str):
        """The client ``cid`` names, or a view of a host copy (``<owner>#host<v>``), or None."""
        if "#host" not in cid:
            return self.world.clients.get(cid)
        owner = self.world.clients.get(cid.split("#", 1)[0])
        return None if owner is None else HostCopySource(owner, int(cid.rsplit("#host", 1)[1]))

    def _holder(self, rs: ReshardPulling, shard: int):
        """The live holder client of ``shard`` whose memory the assigned endpoint names, or None."""
        cid, endpoint = rs.holders[shard]
        src = self._source(cid)
        if src is None or not src.alive or src.endpoint != endpoint:
            return None
        return src

    def _issue(self, rs: ReshardPulling) -> None:
        w, c = self.world, self.client
        if rs.failing or rs is not self.t.current:
            return
        posted = {(rd.source, rd.unit) for rd in rs.inflight.values()}
        for hs, hu in self._pending(rs):
            if len(rs.inflight) >= w.config.reads_in_flight:
                break
            cid = rs.holders[hs][0]
            if (cid, hu) in posted:
                continue
            src = self._holder(rs, hs)
            if src is None:
                self._gone(rs, cid)
                return
            if src.region_version != rs.version:
                self._failed(rs, f"source {cid} moved on from version {rs.version}", cid)
                return
            if src.region_progress <= hu:
                src.waiters[c.cid] = True  # a partial holder: it pushes its progress to us
                continue
            nbytes = rs.deps.nbytes[(hs, hu)] * w.params.unit_bytes // UNIT_BYTES
            end = w.net.reserve(src.host, c.host, max(1, nbytes))
            rd = w.net.post(c.cid, cid, rs.version, hu, end, w.server.epoch, rs.assign_no)
            rd.pull_epoch = rs.epoch
            rs.inflight[(cid, hu)] = rd
            posted.add((cid, hu))
            w.sim.at(end, self._read_end, rd, rs, hs)

    def _read_end(self, rd, rs: ReshardPulling, hs: int) -> None:
        w, c = self.world, self.client
        w.net.unregister(rd)
        if not c.alive:
            return
        if rd.dead:
            if rd.cancelled:
                for k in self._writes_into(rs, hs, rd.unit):
                    c._write_unit(k, TORN, c.region_version)  # what a cancelled read leaves
            return
        if rs is not self.t.current or not rs.owns(rd):
            return
        del rs.inflight[(rd.source, rd.unit)]
        src = self._source(rd.source)
        tag = w.read_tag(rd)  # a live holder's memory (TORN if written meanwhile) or a host copy's
        if w.config.checksums:
            if tag != (rs.version, src.tag_shard, rd.unit):
                w.stats_bad_units += 1
                self._failed(rs, "checksum mismatch", rd.source)
                return
            self._landed(rs, hs, rd.unit, tag)
            return
        w.sim.after(w.net.ctrl_latency_s, self._seqlock, rs, hs, rd.unit, rd.source, tag)

    def _seqlock(self, rs: ReshardPulling, hs: int, hu: int, cid: str, tag) -> None:
        """Without checksums: the holder's control block, read after the bytes landed, must
        still show the version (whatever the bytes are)."""
        if rs.failing or rs is not self.t.current or not self.client.alive:
            return
        src = self._holder(rs, hs)
        if src is None:
            self._gone(rs, cid)
            return
        if src.region_version != rs.version:
            self._failed(rs, f"source {cid} moved on from version {rs.version}", cid)
            return
        self.world.checker.observer.path("checksums_off")
        self._landed(rs, hs, hu, tag)

    def _landed(self, rs: ReshardPulling, hs: int, hu: int, tag) -> None:
        rs.landed[(hs, hu)] = tag
        rs.last_landed = self.world.sim.now
        self._advance(rs)

    def _writes_into(self, rs: ReshardPulling, hs: int, hu: int) -> list[int]:
        """The reader units not done that holder unit ``hu`` of shard ``hs`` writes into."""
        if rs.deps is None:
            return []
        return [k for k, needs in enumerate(rs.deps.units) if (hs, hu) in needs and k not in rs.done]

    def _advance(self, rs: ReshardPulling) -> None:
        """Reader units whose every holder range landed are done; the prefix is the progress."""
        c, w = self.client, self.world
        before = rs.progress
        for k, needs in enumerate(rs.deps.units):
            if k in rs.done or not all(p in rs.landed for p in needs):
                continue
            rs.done.add(k)
            good = all(rs.landed[p] == (rs.version, self._tag_shard(rs, p[0]), p[1]) for p in needs)
            c._write_unit(k, (rs.version, c.tag_shard, k) if good else TORN, rs.version)
        if rs.progress != before:
            c.region_progress = rs.progress
            c._notify_waiters()
        if len(rs.done) >= c.units:
            w.sim.after(0.0, self._ended, rs, hm.Pulled(rs.progress))
            rs.failing = True  # nothing more to post
            return
        self._issue(rs)

    def _tag_shard(self, rs: ReshardPulling, hs: int):
        src = self._source(rs.holders[hs][0])
        return src.tag_shard if src is not None else None

    def _watch(self, rs: ReshardPulling) -> None:
        """The stall rule: nothing landed for ``source_stall_timeout_s``."""
        w = self.world
        if rs.failing or rs is not self.t.current or not self.client.alive:
            return
        due = rs.last_landed + w.config.source_stall_timeout_s
        if w.sim.now >= due:
            w.stats_stalls += 1
            waiting = next(iter(self._pending(rs)), None)
            cid = rs.holders[waiting[0]][0] if waiting is not None else rs.source
            self._failed(rs, f"source {cid} stalled", cid)
            return
        w.sim.at(due, self._watch, rs)

    def _gone(self, rs: ReshardPulling, cid: str) -> None:
        """A needed holder is gone: the failure shows after the transport's detection delay."""
        if not rs.dead_pending:
            rs.dead_pending = True
            self.world.sim.after(self.world.params.detect_delay_s, self._dead_detected, rs, cid)

    def _dead_detected(self, rs: ReshardPulling, cid: str) -> None:
        if self.client.alive and rs is self.t.current and not rs.failing:
            src = self._source(cid)
            self._failed(rs, f"source {cid} unreachable", cid, unreachable=src is None or not src.alive)

    # ------------------------------------------------------------------ endings

    def _cancel_reads(self, rs: ReshardPulling) -> float:
        end = self.world.sim.now
        for rd in rs.inflight.values():
            rd.dead = True
            rd.cancelled = True
            end = max(end, rd.end)
        rs.inflight = {}
        return end

    def _forget_sources(self, rs: ReshardPulling) -> None:
        for cid in rs.sources:
            src = self._source(cid)
            if src is not None:
                src.waiters.pop(self.client.cid, None)

    def _failed(self, rs: ReshardPulling, error: str, source: str, unreachable: bool = False) -> None:
        if rs.failing:
            return
        rs.failing = True
        end = self._cancel_reads(rs)
        self._forget_sources(rs)
        self.world.sim.trace(f"reshard pull {self.client.cid} v{rs.version} failed on {source}: {error}")
        self.world.sim.at(end, self._ended, rs,
                          hm.Pulled(rs.progress, error, unreachable=unreachable, failed_source=source or ""))

    def _ended(self, rs: ReshardPulling, ev: hm.Pulled) -> None:
        if rs is not self.t.current:
            return
        self.t.current = None
        if ev.error:
            self.kept = (rs.version, frozenset(rs.done))
        self.client.region_progress = ev.progress
        self.client._answer(rs.token, ev)
