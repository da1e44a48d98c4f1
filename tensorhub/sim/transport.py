"""The simulated transport: what a :class:`~tensorhub.core.handle.Pull` does in the simulated
world, for one client.

A unit read from host s to host r reserves the network path (:mod:`tensorhub.sim.network`) and
copies the source's content tag at the END of its transfer (a write to the source during it makes
a torn unit); each unit is verified (the checksum model) and a bad one fails the pull. Reads go
in unit order, at most ``reads_in_flight`` posted, and only below a partial source's progress
(the reader waits for its pushes; a source that does not move for ``source_stall_timeout_s``
fails the pull, and so does one whose process died, after the detection delay).

The rule of the shipped read loop that matters for correctness is kept: a failed or stopped
pull cancels its posted reads and reports only once every one of them has ended. A cancelled
read lands junk in its unit when it ends, so a driver that went on before that would be caught
writing over units it had verified.
"""

from __future__ import annotations

from typing import Any, Optional

from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.transport.pacing import Pacer

TORN = ("torn",)


class Pulling:
    """One pull in flight."""

    def __init__(self, a: m.Assignment, progress: int, token: int, pacer: Pacer) -> None:
        self.version = a.version
        self.source = a.source_id
        self.partial = a.source_partial
        self.assign_no = a.assign_no
        self.progress = progress  # contiguous verified units of ``version``
        self.token = token
        self.have: set[int] = set()
        self.inflight: dict[int, Any] = {}
        self.failing = False
        self.dead_pending = False
        self.stall_token = 0
        self.ends_at = 0.0
        """Stopped: when its last posted read ends."""
        self.pacer = pacer
        """The shipped read loop's window policy (reads kept posted), fed with virtual time."""


class SimTransport:
    def __init__(self, client) -> None:
        self.client = client
        self.world = client.world
        self.units = client.units
        self.unit_bytes = client.unit_bytes
        self.current: Optional[Pulling] = None

    # ------------------------------------------------------------------ the interface

    def pull(self, a: m.Assignment, start: int, token: int) -> None:
        """Read ``a.version`` from unit ``start`` on; answers ``client._answer(token, Pulled)``."""
        c = self.client
        if start == 0:
            c.region_version, c.region_progress = a.version, 0
        pacer = Pacer(self.world.config.reads_in_flight)
        pacer.on_rtt(2 * self.world.net.ctrl_latency_s)
        rs = Pulling(a, c.region_progress if c.region_version == a.version else 0, token, pacer)
        self.current = rs
        if rs.progress >= self.units:
            self._done(rs)
        else:
            self._issue(rs)

    def stop(self) -> Optional[Pulling]:
        """Stop the pull in progress: cancel its reads (their end is ``ends_at``); the caller
        then calls :meth:`finish`. None if there is nothing to stop."""
        rs = self.current
        if rs is None or rs.failing:
            return None
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
        if rs.source == source_cid or rs.source.startswith(source_cid + "#"):
            rs.stall_token += 1
            self._issue(rs)

    def source_died(self) -> None:
        """The source crashed: posted reads from it are lost; the failure shows after the
        transport's detection delay."""
        rs = self.current
        if rs is None or rs.failing:
            return
        for rd in rs.inflight.values():
            rd.dead = True
        rs.inflight = {}
        rs.pacer.forget_inflight()
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
        rs.pacer.forget_inflight()
        return end

    def _forget_source(self, rs: Pulling) -> None:
        src = self.world.source_client(rs.source)
        if src is not None:
            src.waiters.pop(self.client.cid, None)

    def _next_unit(self, rs: Pulling) -> int:
        k = rs.progress
        while k < self.units and (k in rs.have or k in rs.inflight):
            k += 1
        return k

    def _issue(self, rs: Pulling) -> None:
        w, c = self.world, self.client
        if rs.failing or rs is not self.current or rs.progress >= self.units:
            return
        src = w.source_client(rs.source)
        if src is None or not src.alive or (rs.source != src.cid and rs.source not in src.serves()):
            if not rs.dead_pending:  # the read will fail after the transport's detection delay
                rs.dead_pending = True
                w.sim.after(w.params.detect_delay_s, self._dead_detected, rs)
            return
        limit = src.served_units(rs.version) if (rs.partial and rs.source == src.cid) else self.units
        while rs.pacer.may_post():
            k = self._next_unit(rs)
            if k >= self.units:
                break
            if k >= limit:
                src.waiters[c.cid] = True
                rs.stall_token += 1
                w.sim.after(w.config.source_stall_timeout_s, self._stall_check, rs, rs.stall_token)
                break
            nbytes = self.unit_bytes
            end = w.net.reserve(src.host, c.host, nbytes)
            if rs.source != src.cid:  # a host-memory copy: slower than GPU memory
                end += nbytes / w.params.host_bw
            rd = w.net.post(c.cid, rs.source, rs.version, k, end, w.server.epoch, rs.assign_no)
            rs.inflight[k] = rd
            rs.pacer.on_post(k, nbytes, w.sim.now)
            w.sim.at(end, self._read_end, rd, rs)

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
        rs.pacer.on_done([rd.unit], w.sim.now)
        tag = w.read_tag(rd)
        c._write_unit(rd.unit, tag, rs.version)
        if tag != (rs.version, c.shard, rd.unit):
            w.stats_bad_units += 1
            self._failed(rs, "checksum mismatch")
            return
        rs.have.add(rd.unit)
        while rs.progress in rs.have:
            rs.progress += 1
        c.region_progress = rs.progress
        rs.stall_token += 1
        c._notify_waiters()
        if rs.progress >= self.units:
            self._done(rs)
            return
        self._issue(rs)

    def _stall_check(self, rs: Pulling, token: int) -> None:
        if self.client.alive and rs is self.current and token == rs.stall_token and not rs.failing:
            self.world.stats_stalls += 1
            self._failed(rs, "source stalled")

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
