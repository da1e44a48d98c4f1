"""A handle's read path as a named API, for code that moves a read's bytes itself.

A compiled graph's member (:mod:`tensorhub.graphs.member`) reads in two phases with the bytes
moved by the graph in between; tools and benchmarks look at a handle's region. They use this
API (``hub.reads``) instead of the handle's private members, so the handle may change inside
without them (``tests/project/test_layers.py`` checks that no code outside ``tensorhub/handle/`` uses a
private member of the handle).

A two-phase read::

    reads = hub.reads
    a = reads.begin("latest", update=True)       # Assignment, or NoChange: nothing to read
    src = reads.open_source(a)                   # kept open by the handle; never close it
    reads.pull_range(a, end_unit, source=src)    # no failover: the caller coordinates
    stats = reads.finish()                       # the rest with failover; now a holder
    # or reads.abort(why) if the caller gives up

:class:`ReadSession` is also the handle's own pull path: :meth:`ReadSession.pull_range` picks
the tier (the staging copy's memory, a same-host mapping through :mod:`tensorhub.transport.shm`,
else NIXL through :func:`tensorhub.transport.pull`) for the handle's driver
(:mod:`tensorhub.handle.driver`) as for a graph.

:class:`ReadStats` is what a read reports (``replicate``, ``update``, a prefetch's future).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional, Union

from tensorhub import errors, metrics
from tensorhub import transport as tx
from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.transport import shm

log = logging.getLogger("tensorhub.client")
"""The handle's log (one name for all its parts, kept for users' log filters)."""


@dataclasses.dataclass(frozen=True)
class ReadStats:
    """What one replicate/update did."""

    action: str
    """``"replicated"`` (bytes moved) or ``"noop"`` (update: already current)."""
    version: int
    seconds: float = 0.0
    """Wall time of the whole call (queueing, drain of the old version, offload, transfer)."""
    transfer_s: float = 0.0
    """Time from the first assignment to the last byte."""
    bytes: int = 0
    sources: tuple[str, ...] = ()
    """Source client ids in order (more than one after a failover)."""
    holders: tuple[str, ...] = ()
    """Every client the read was told to take bytes from, in order: ``sources``, and for a
    resharded read each holder shard of each assignment (docs/placements.md)."""
    partial_source: bool = False
    """The first source was itself still receiving (pipeline replication)."""
    cross_datacenter: bool = False
    failovers: int = 0
    finished_at: float = 0.0
    """Wall-clock time (``time.time()``) when the last byte was in place."""
    stall_s: float = 0.0
    """Part of ``seconds`` this call was blocked waiting for bytes: before its first source
    (queueing for one, and the drain of the version it left, but not its own offload copy) and,
    mid-read, starved by a source that had no further unit yet."""
    offload_s: float = 0.0
    """Part of ``seconds`` this handle spent copying its old version to host memory (it was the
    last holder of a retained version)."""
    prefetched: bool = False
    """The bytes came from this handle's own prefetch staging copy (:meth:`Hub.prefetch`): a
    local copy, complete or still arriving."""
    swapped: bool = False
    """A double buffer (:meth:`Hub.register`): the handle took over its complete staging copy's
    memory instead of copying it; :attr:`Hub.tensors` are the other set of tensors now."""
    skipped_in_flight: Optional[int] = None
    """Smart skipping: ``"latest"`` gave ``version``, the newest complete in this datacenter,
    because this newer version is still being seeded into it (None: no skip)."""

    @property
    def gbps(self) -> float:
        """Transfer rate (bytes over ``transfer_s``)."""
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


class ReadSession:
    """The read path of one handle (``hub.reads``): its reads from start to
    :class:`ReadStats`, in one call (:meth:`call`, what ``replicate`` and ``update`` run) or in
    two phases (:meth:`begin`, :meth:`finish`), and the pull each makes (:meth:`pull_range`).
    Owns what one read measures from its start (its clock, the region's starved time then, a
    read paused at its first pull). Not thread-safe beyond what the handle is: one read at a
    time, as one user call at a time; the caller holds the handle's call lock."""

    def __init__(self, hub) -> None:  # a tensorhub.Hub (not imported: hub.py imports this module)
        self._hub = hub
        self._t0 = 0.0
        """When the read in progress started (``perf_counter``)."""
        self._starved0 = 0.0
        """The region's starved time when the read started (its stall is the growth)."""
        self._paused: Optional[hm.Pull] = None
        """A read paused at its first pull (a compiled graph's member moves the bytes itself)."""

    def _start(self, update: bool, progress: Optional[Callable[[int, int], None]] = None) -> None:
        hub = self._hub
        hub.host_copies.stop_copy()
        self._t0 = time.perf_counter()
        self._starved0 = hub._memory.region.starved_s if hub._memory.region is not None else 0.0
        machine = hub._driver.machine
        hub._driver.begin_read(machine.published if update and hub.config.verify_mutability else None, progress)
        hub._reshard.begin_read()

    # ---- one call ------------------------------------------------------------------------
    def call(self, spec: m.VersionSpec, update: bool, round_no: Optional[int] = None,
             progress: Optional[Callable[[int, int], None]] = None) -> ReadStats:
        """A whole read (``replicate``, ``update``): resolve, drain the old version if updating,
        pull with failover, report done, become a holder; the handle's rules are the machine's."""
        hub = self._hub
        self._start(update, progress)
        try:
            out = hub._run(hm.ReplicateOp(spec, update, round_no))
        finally:
            hub._driver.end_read()
        st = self._stats(out)
        if st.action == "replicated" and not st.prefetched:
            # The server may ask this new holder for the version's retention copy at once (not
            # after a prefetch: its staging copy, first to finish the version, was asked instead).
            try:
                hub._background.take_notes(in_call=True)
            except errors.TensorHubError:
                pass
        metrics.record_read(hub.model, st.action, st.seconds, st.transfer_s, st.bytes, st.failovers,
                            stall_s=st.stall_s)
        return st

    def _stats(self, out: hm.Outcome) -> ReadStats:
        """What the read that ended with ``out`` did; a read that replicated refreshes the
        handle's checksums of what it holds."""
        hub = self._hub
        t_end = time.perf_counter()
        dt = t_end - self._t0
        d = hub._driver
        in_flight = out.in_flight if out.in_flight >= 0 else None
        if out.action == "noop":
            return ReadStats(action="noop", version=out.version, seconds=dt, offload_s=d.offload_s,
                             skipped_in_flight=in_flight)
        hub._memory.hold_checksums()
        count = hub._memory.layout.unit_count
        if hub._reshard.read_bytes:
            # Resharded pulls count what they moved (a failover moves only what was not in place
            # and checked); a later pull from a holder of its own layout, units from where it began.
            nbytes = hub._reshard.read_bytes + (self.units_bytes(d.plain_from, count) if d.plain_from is not None else 0)
        else:
            nbytes = self.units_bytes(d.pull_from, count)  # each unit fetched once
        log.info("model=%s version=%d shard=%d replicated %d bytes in %.3fs from %s",
                 hub.model, out.version, hub.shard, nbytes, dt, " -> ".join(out.sources))
        first, stage = out.first, hub._staging.copy
        waited = max(0.0, (d.t_assigned or t_end) - self._t0 - d.offload_s)
        stall = waited + max(0.0, hub._memory.region.starved_s - self._starved0)
        return ReadStats(action="replicated", version=out.version, seconds=dt, stall_s=stall,
                         transfer_s=t_end - (d.t_assigned or t_end), bytes=nbytes, sources=out.sources,
                         holders=out.holders,
                         partial_source=bool(first and first.source_partial),
                         cross_datacenter=bool(first and first.cross_datacenter), failovers=out.failovers,
                         finished_at=d.finished_at, offload_s=d.offload_s,
                         prefetched=bool(stage is not None and out.sources and out.sources[0] == stage.client_id),
                         skipped_in_flight=in_flight)

    # ---- the two phases ------------------------------------------------------------------
    def begin(self, spec: m.VersionSpec = "latest", update: bool = True) -> Union[m.Assignment, m.NoChange]:
        """Phase 1: resolve, drain the old version if updating, get a source; the read pauses at
        its first pull (the caller moves bytes, then :meth:`finish`, or :meth:`abort`).
        ``NoChange`` if there is nothing to read."""
        self._start(update)
        d = self._hub._driver
        try:
            res = d.drive(d.feed(hm.Start(hm.ReplicateOp(spec, update))), pause_at_pull=True)
        except BaseException:
            d.end_read()
            raise
        finally:
            d.verify_left = None
        if isinstance(res, hm.Outcome):
            d.end_read()
            return m.NoChange(version=res.version)
        self._paused = res
        return res.assignment

    def finish(self) -> ReadStats:
        """Phase 2: pull what is missing (failover included), report done, become a holder; returns
        the read's :class:`~tensorhub.ReadStats`."""
        pull, self._paused = self._paused, None
        assert pull is not None, "no read paused"
        try:
            st = self._stats(self._hub._driver.drive([pull]))
        finally:
            self._hub._driver.end_read()
        metrics.record_read(self._hub.model, st.action, st.seconds, st.transfer_s, st.bytes, st.failovers,
                            stall_s=st.stall_s)
        return st

    def abort(self, why: str) -> None:
        """End a paused read on the server too (its driver is gone): the server must not keep a
        reader that never finishes. Nothing to do if no read is paused."""
        if self._paused is None:
            return
        self._paused = None
        try:
            self._hub._driver.finish_interrupted(errors.TransferError(why))
        finally:
            self._hub._driver.end_read()

    # ---- moving bytes between the phases -------------------------------------------------
    def open_source(self, a: m.Assignment) -> tx.Source:
        """The NIXL source of ``a``, kept open by the handle across reads (never close it;
        :class:`~tensorhub.handle.sources.Sources`)."""
        return self._hub._sources.nixl(a)

    def source_checksums(self, source: tx.Source, version: int) -> Optional[list[int]]:
        """The checksums of a complete source holding ``version``, or None if it does not (yet)
        hold all of it (one control read)."""
        v, progress, sums = source.read_control(self._hub.config.source_stall_timeout_s)
        return sums if v == version and progress == self._hub._memory.layout.unit_count else None

    def pull_range(self, a: m.Assignment, end_unit: int, *, source: Optional[tx.Source] = None,
                   source_sums=None, should_stop=None, on_unit=None) -> int:
        """Read units [own progress, ``end_unit``) of ``a.version`` from ``a``'s source, without
        failover (a caller that coordinates the pipeline itself, e.g. a compiled graph, falls
        back to :meth:`finish` on error, which resumes from the same progress); returns the bytes
        read. ``source``: an open source to use (kept open); ``source_sums``: checksums of the
        source's units known final, a list or a growing :class:`~tensorhub.transport.KnownProgress`
        (then the source's control block is not read); ``should_stop``/``on_unit``: as for
        ``pull``. The handle's own pulls come here too (:class:`~tensorhub.handle.driver.Driver`)."""
        hub = self._hub
        if a.reshard:
            # From a holder replica of another layout: every needed shard's byte ranges, then
            # every cell checked (tensorhub.handle.reshard); nothing to resume from.
            return hub._reshard.pull(a, should_stop=should_stop, on_unit=on_unit)
        hub._reshard.drop_kept()  # this pull may write any unit past its start
        region, layout, config = hub._memory.region, hub._memory.layout, hub.config
        start = self.resume_point(a.version)
        ready = hub._delta_ready
        if ready is not None and ready.version == a.version and start == 0 and source is None and source_sums is None:
            # A seed rebuilt from a delta (tensorhub.handle.deltas): copied here, whatever the
            # source assigned; it failing (it should not: memory in this process) reads as usual.
            try:
                return shm.pull(region, ready.source, layout, expect_version=a.version, config=config,
                                start_unit=0, end_unit=end_unit, should_stop=should_stop, on_unit=on_unit)
            except (errors.TransferError, errors.ChecksumMismatch) as e:
                log.info("model=%s shard=%d: the version rebuilt from a delta did not copy (%s): reading it",
                         hub.model, hub.shard, e)
                hub._delta_ready = None
                start = self.resume_point(a.version)
        if source is None and source_sums is None:
            # The tier: this handle's own staging copy, else the holder's memory mapped here (same
            # host), else NIXL.
            stage = hub._staging.copy
            own = stage is not None and a.source_id == stage.client_id and stage._memory.region is not None
            near = shm.LocalSource(stage._memory.region, f"prefetch:{stage.client_id}") if own else hub._sources.same_host(a)
            if near is not None:
                try:
                    return shm.pull(region, near, layout, expect_version=a.version, config=config,
                                    start_unit=start, end_unit=end_unit, should_stop=should_stop, on_unit=on_unit)
                except (errors.TransferError, errors.ChecksumMismatch):
                    if not own:
                        hub._sources.drop(a)  # a mapping that failed is made afresh if assigned again
                    raise
        if source is None:
            source = self.open_source(a)
        try:
            return tx.pull(region, source, layout, expect_version=a.version, config=config,
                           start_unit=start, end_unit=end_unit, source_sums=source_sums,
                           should_stop=should_stop, on_unit=on_unit)
        except (errors.TransferError, errors.ChecksumMismatch) as e:
            hub._sources.drop(a)  # a source that failed is opened afresh if assigned again
            if (isinstance(e, errors.ChecksumMismatch) or source.reached or source_sums is not None
                    or isinstance(e, errors.SourceUnreachable)):
                raise
            raise errors.SourceUnreachable(str(e)) from e

    # ---- what the handle holds -----------------------------------------------------------
    @property
    def unit_count(self) -> int:
        """Transfer units of the registered layout."""
        return self._hub._memory.layout.unit_count

    def failed_source(self, a: m.Assignment) -> str:
        """The holder a failed pull of ``a`` blames: one shard of a resharded read's holders, else
        ``a``'s source."""
        return (self._hub._reshard.take_failed() if a.reshard else "") or a.source_id

    def resume_point(self, version: int) -> int:
        """Units of ``version`` already in place here: a read after a failover refetches nothing."""
        region = self._hub._memory.region
        return region.progress if region.version == version else 0

    def units_bytes(self, start: int, end: int) -> int:
        """Bytes of units ``[start, end)``."""
        layout = self._hub._memory.layout
        return sum(layout.unit_nbytes(u) for u in range(start, end))

    def checksums(self) -> list[int]:
        """The checksums of the units in place in the registered region."""
        return self._hub._memory.region.checksums()

    def progress(self) -> tuple[Optional[int], int, int]:
        """(the version being read or held, units in place, units in all); (None, 0, 0) before
        register."""
        region, layout = self._hub._memory.region, self._hub._memory.layout
        if region is None or layout is None:
            return None, 0, 0
        return region.version, region.progress, layout.unit_count

    @property
    def region(self):
        """The registered transport region (for raw-transport baselines; do not publish into it)."""
        return self._hub._memory.region

    @property
    def layout(self):
        """The registered :class:`~tensorhub.layout.Layout`."""
        return self._hub._memory.layout
