"""The simulated transport: what a :class:`~tensorhub.core.handle.Pull` does in the simulated
world, for one client.

The pull's rules are the shipped read loop's, not a model of them: each pull drives a
:class:`~tensorhub.transport.readstate.ReadState` (what the NIXL reader in
:mod:`tensorhub.transport.reader` drives too): reads only below what the source's control block
shows for our version (a source that moved on fails the pull), posted in unit order as many as
the shipped window policy allows, the prefix advanced in order as units verify, and a pull in
which nothing moved for ``source_stall_timeout_s`` fails. What is simulated is only the reads
themselves and the clock: a unit read from host s to host r reserves the network path
(:mod:`tensorhub.sim.network`) and copies the source's content tag at the END of its transfer (a
write to the source during it makes a torn unit; the tag check is the checksum); a source whose
process died fails the pull after the detection delay.

With ``Config.checksums`` off nothing checks the tags: as the shipped reader, a landed unit
counts once a control read of the source (one control latency after the bytes arrived) still
shows our version (the seqlock), whatever bytes it brought; the checkers then see what that
lets through.

The rule of the shipped read loop that matters most for correctness is kept too: a failed or
stopped pull cancels its posted reads and reports only once every one of them has ended. A
cancelled read lands junk in its unit when it ends, so a driver that went on before that would
be caught writing over units it had verified.
"""

from __future__ import annotations

from typing import Any, Optional

from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.errors import SourceStalled, TransferError
from tensorhub.transport.readstate import ReadState

from tensorhub.sim.reshard_pull import ReshardPull, ReshardPulling
from tensorhub.sim.tags import TORN

__all__ = ["TORN", "Pulling", "SimTransport"]


class Pulling:
    """One pull in flight: the shipped read loop's bookkeeping (:class:`ReadState`) plus the
    simulated reads."""

    def __init__(self, a: m.Assignment, st: ReadState, token: int) -> None:
        self.version = a.version
        self.source = a.source_id
        """Whose memory the reads reach (``World.memory_of``): the source's, or a host copy."""
        self.partial = a.source_partial
        self.assign_no = a.assign_no
        self.st = st
        self.token = token
        self.inflight: dict[int, Any] = {}
        self.failing = False
        self.dead_pending = False
        self.ends_at = 0.0
        """Stopped: when its last posted read ends."""
        self.epoch = 0
        """The server epoch in which the pull started (its assignment's)."""
        self.rebuilt: Optional[list] = None
        """A version rebuilt from a delta in this process: its units are copied from these tags
        at local speed, unchecked (the real LocalSource carries the rebuilt copy's checksums)."""

    @property
    def progress(self) -> int:
        """Contiguous verified units of ``version``."""
        return self.st.prefix

    @property
    def sources(self) -> tuple[str, ...]:
        """Whose memory the pull reads (one source; a resharded pull's: every needed holder)."""
        return (self.source,)

    def owns(self, rd) -> bool:
        """``rd`` is one of this pull's posted reads still in flight."""
        return self.inflight.get(rd.unit) is rd


class SimTransport:
    def __init__(self, client) -> None:
        self.client = client
        self.world = client.world
        self.units = client.units
        self.unit_bytes = client.unit_bytes
        self.current: Optional[Pulling] = None
        self._reshard = None
        """The resharded pulls' part (:mod:`tensorhub.sim.reshard_pull`), made at the first."""

    def _resharding(self):
        """The resharded pulls' part when the pull in progress is one, else None."""
        if not isinstance(self.current, ReshardPulling):
            return None
        if self._reshard is None:
            self._reshard = ReshardPull(self)
        return self._reshard

    # ------------------------------------------------------------------ the interface

    def begin_read(self) -> None:
        """A read starts (the user's replicate/update): a failed resharded pull's kept units go."""
        if self._reshard is not None:
            self._reshard.kept = None

    def pull(self, a: m.Assignment, start: int, token: int) -> None:
        """Read ``a.version`` from unit ``start`` on; answers ``client._answer(token, Pulled)``."""
        c, w = self.client, self.world
        if a.reshard:
            if self._reshard is None:
                self._reshard = ReshardPull(self)
            self._reshard.pull(a, start, token)
            return
        if self._reshard is not None:
            self._reshard.kept = None  # this pull may write any unit past its start
        if start == 0:
            c.region_version, c.region_progress = a.version, 0
        first = c.region_progress if c.region_version == a.version else 0
        st = ReadState(a.version, first, self.units, window_max=w.config.reads_in_flight,
                       stall_timeout_s=w.config.source_stall_timeout_s, now=w.sim.now, source=a.source_id)
        st.pacer.on_rtt(2 * w.net.ctrl_latency_s)
        rs = Pulling(a, st, token)
        rs.source = w.memory_of(a)  # the memory the assigned endpoint names
        rs.epoch = w.server.epoch
        if c.delta_ready is not None and c.delta_ready[0] == a.version and first == 0:
            rs.rebuilt = c.delta_ready[1]
        self.current = rs
        if st.finished:
            self._done(rs)
        else:
            w.sim.at(st.stall_due(), self._watch, rs)
            self._issue(rs)

    def stop(self) -> Optional[Pulling]:
        """Stop the pull in progress: cancel its reads (their end is ``ends_at``); the caller
        then calls :meth:`finish`. None if there is nothing to stop."""
        rs = self.current
        if rs is None or rs.failing:
            return None
        rp = self._resharding()
        if rp is not None:
            rs.ends_at = rp.stop(rs)
            return rs
        rs.failing = True
        rs.ends_at = self._cancel_reads(rs)
        self._forget_source(rs)
        return rs

    def finish(self, rs: Pulling) -> bool:
        """A stopped pull's reads have all ended; False if it was superseded meanwhile."""
        if rs is not self.current:
            return False
        self.current = None
        return True

    def died(self) -> None:
        """The process crashed: its posted reads deliver nothing."""
        rp = self._resharding()
        if rp is not None:
            rp.died(self.current)
            self.current = None
        if self.current is not None:
            for rd in self.current.inflight.values():
                rd.dead = True
                self.world.net.unregister(rd)
            self.current = None

    def poke(self, source_cid: str) -> None:
        """The source's progress counter moved (or the source died)."""
        rs = self.current
        if not self.client.alive or rs is None or rs.failing:
            return
        rp = self._resharding()
        if rp is not None:
            rp.poke(rs, source_cid)
            return
        if rs.source == source_cid or rs.source.startswith(source_cid + "#"):
            self._issue(rs)

    def source_died(self) -> None:
        """The source crashed: posted reads from it are lost; the failure shows after the
        transport's detection delay."""
        rs = self.current
        if rs is None or rs.failing:
            return
        rp = self._resharding()
        if rp is not None:
            rp.source_died(rs)
            return
        for rd in rs.inflight.values():
            rd.dead = True
        rs.inflight = {}
        rs.st.forget_posted()
        if not rs.dead_pending:
            rs.dead_pending = True
            self.world.sim.after(self.world.params.detect_delay_s, self._dead_detected, rs)

    # ------------------------------------------------------------------ reads

    def _cancel_reads(self, rs: Pulling) -> float:
        end = self.world.sim.now
        for rd in rs.inflight.values():
            rd.dead = True
            rd.cancelled = True
            end = max(end, rd.end)
        rs.inflight = {}
        rs.st.forget_posted()
        return end

    def _forget_source(self, rs: Pulling) -> None:
        src = self.world.source_client(rs.source)
        if src is not None:
            src.waiters.pop(self.client.cid, None)

    def _source_state(self, rs: Pulling, src) -> tuple[int, int]:
        """The source's control block as a read of it would see it: (version, units final)."""
        if rs.source != src.cid:  # a host copy: complete and immutable while served
            return (rs.version, self.units) if src.host_copies.get(rs.version) is not None else (-1, 0)
        return src.region_version, src.region_progress

    def _source_gone(self, rs: Pulling, src) -> bool:
        """The source (or the host copy read) is gone: any read of it, data or control, fails
        after the transport's detection delay."""
        if src is not None and src.alive and (rs.source == src.cid or rs.source in src.serves()):
            return False
        if not rs.dead_pending:
            rs.dead_pending = True
            self.world.sim.after(self.world.params.detect_delay_s, self._dead_detected, rs)
        return True

    def _issue(self, rs: Pulling) -> None:
        w, c = self.world, self.client
        if rs.failing or rs is not self.current or rs.st.finished:
            return
        src = w.source_client(rs.source)
        if rs.rebuilt is None and self._source_gone(rs, src):
            return
        st = rs.st
        # A rebuilt version is complete here whatever the assigned source does.
        version, progress = (rs.version, self.units) if rs.rebuilt is not None else self._source_state(rs, src)
        try:
            st.source_state(version, progress, None, w.sim.now)
        except TransferError as e:  # the source moved on
            self._failed(rs, str(e))
            return
        while (k := st.next_to_post()) is not None:
            nbytes = self.unit_bytes
            if rs.rebuilt is not None:  # a copy inside this process
                end = w.net.reserve(c.host, c.host, nbytes)
                rd = w.net.post(c.cid, f"{c.cid}#rebuilt", rs.version, k, end, w.server.epoch, rs.assign_no)
            else:
                end = w.net.reserve(src.host, c.host, nbytes)
                if rs.source != src.cid:  # a host-memory copy: slower than GPU memory
                    end += nbytes / w.params.host_bw
                rd = w.net.post(c.cid, rs.source, rs.version, k, end, w.server.epoch, rs.assign_no)
            rd.pull_epoch = rs.epoch
            rs.inflight[k] = rd
            st.posted(k, nbytes, w.sim.now)
            w.sim.at(end, self._read_end, rd, rs)
        if st.starved and rs.rebuilt is None:
            src.waiters[c.cid] = True  # it pushes its progress to us (Follow)

    def _read_end(self, rd, rs: Pulling) -> None:
        w, c = self.world, self.client
        w.net.unregister(rd)
        if not c.alive:
            return
        if rd.dead:
            if rd.cancelled:
                c._write_unit(rd.unit, TORN, c.region_version)  # what a cancelled read leaves
            return
        if rs is not self.current or rs.inflight.get(rd.unit) is not rd:
            return
        del rs.inflight[rd.unit]
        st = rs.st
        st.completed([rd.unit], w.sim.now)
        if rs.rebuilt is not None:
            c._write_unit(rd.unit, rs.rebuilt[rd.unit], rs.version)
            self._advance(rs)
            return
        tag = w.read_tag(rd)
        c._write_unit(rd.unit, tag, rs.version)
        if not w.config.checksums:
            # The seqlock: a control read of the source, its bytes already in place.
            w.sim.after(w.net.ctrl_latency_s, self._seqlock, rs)
            return
        if tag != (rs.version, c.tag_shard, rd.unit):
            w.stats_bad_units += 1
            self._failed(rs, "checksum mismatch")
            return
        self._advance(rs)

    def _seqlock(self, rs: Pulling) -> None:
        """Without checksums the landed units count only if the source's control block, read
        after their bytes arrived, still shows our version (the shipped reader's rule; what the
        bytes are is not looked at)."""
        w = self.world
        if not self.client.alive or rs is not self.current or rs.failing:
            return
        src = w.source_client(rs.source)
        if self._source_gone(rs, src):
            return
        version, progress = self._source_state(rs, src)
        try:
            rs.st.source_state(version, progress, None, w.sim.now)
        except TransferError as e:  # the source moved on while the bytes were in flight
            self._failed(rs, str(e))
            return
        w.checker.observer.path("checksums_off")
        self._advance(rs)

    def _advance(self, rs: Pulling) -> None:
        """Extend the prefix over the landed units (each checked already), then go on."""
        c, st = self.client, rs.st
        advanced = False
        while (u := st.next_to_verify()) is not None:
            st.verified(u, self.world.sim.now)
            advanced = True
        if advanced:
            c.region_progress = st.prefix
            c._notify_waiters()
        if st.finished:
            self._done(rs)
            return
        self._issue(rs)

    def _watch(self, rs: Pulling) -> None:
        """The read loop's stall rule, checked when it could fire."""
        w = self.world
        if not self.client.alive or rs is not self.current or rs.failing:
            return
        try:
            rs.st.check_stalled(w.sim.now, inflight=list(rs.inflight))
        except SourceStalled as e:
            w.stats_stalls += 1
            self._failed(rs, str(e))
            return
        w.sim.at(rs.st.stall_due(), self._watch, rs)

    def _dead_detected(self, rs: Pulling) -> None:
        if self.client.alive and rs is self.current and not rs.failing:
            src = self.world.source_client(rs.source)
            self._failed(rs, "source unreachable", unreachable=src is None or not src.alive)

    # ------------------------------------------------------------------ endings

    def _failed(self, rs: Pulling, error: str, unreachable: bool = False) -> None:
        if rs.failing:
            return
        rs.failing = True
        end = self._cancel_reads(rs)
        self._forget_source(rs)
        self.world.sim.at(end, self._ended, rs, hm.Pulled(rs.progress, error, unreachable=unreachable))

    def _done(self, rs: Pulling) -> None:
        self.world.sim.after(0.0, self._ended, rs, hm.Pulled(rs.progress))

    def _ended(self, rs: Pulling, ev: hm.Pulled) -> None:
        if rs is not self.current:
            return
        self.current = None
        self.client.region_progress = ev.progress
        self.client._answer(rs.token, ev)
