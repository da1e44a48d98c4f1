"""Range reads: a resharding plan's runs, from one holder shard straight into the reader's tensors.

Stage 2a of issue 24 (the byte mover; no handle or server wiring yet). A
:class:`~tensorhub.core.reshard.ReshardPlan` lists *runs*: ``count`` copies of ``run_bytes``
bytes, from a holder shard's local tensor to one of the reader's, each next copy a stride further
on each side. Two tiers carry them out, with no staging copy on either side:

- :func:`read_runs`: one-sided NIXL READs from a holder's registered :class:`Region` (opened as a
  :class:`Source`, as the unit reader opens it) into the reader's registered :class:`Region`.
  The runs become *requests* (one NIXL transfer each, a list of descriptors), packed up to
  ``request_bytes`` (``config.unit_bytes`` by default); a contiguous run longer than that is cut.
- :func:`copy_runs`: the same-host tier, from a holder's memory mapped here (a
  :class:`~tensorhub.transport.shm.ShmSource` or :class:`~tensorhub.transport.shm.LocalSource`):
  one ``copy_`` per run between ``as_strided`` views of the two sides' bytes.

Strided runs (a column slice) over NIXL: ``strided="rows"`` batches rows into requests of about
``request_bytes`` each (one descriptor per row), kept in flight by the read loop's window;
``strided="multi"`` posts each strided run as one request of ``count`` descriptors, whatever its
size. Measured (``benchmarks/ranges.py --json --reps 5``, two runs, 2-core CPU VM shared with
other work, UCX cross-memory attach between two processes; GB/s, best of 5):

    column slice of the holder's    contiguous   rows, 16 MiB   rows, 1 MiB   multi: one
    tensor (its row bytes)          same bytes   requests       requests      request
    fp32 8192x8192, 1/2 (16 KiB)    5.10, 4.97   2.35, 2.71     2.14, 2.88    3.71, 2.50
    fp32 8192x8192, 1/4 (8 KiB)     4.62, 6.24   2.70, 1.77     1.60, 1.93    1.98, 1.65
    bf16 8192x4096, 1/2 (4 KiB)     5.01, 1.61   1.68, 1.07     1.06, 0.57    1.55, 0.93
    bf16 8192x4096, 1/4 (2 KiB)     5.18, 3.01   0.86, 0.51     0.60, 0.42    0.86, 0.47

Over cross-memory attach a strided read pays per row (about 2-4 us more a descriptor; we did not
look inside UCX, which gets each descriptor separately), so it runs at 0.16-0.73 of a contiguous read
of the same bytes whichever way it is posted; posting cost is not it (preparing 8192 descriptors:
about 1 ms of a 60 ms read). ``"rows"`` and ``"multi"`` are equal within this machine's noise
(rows ahead in 6 of 8, one tie); 1 MiB requests were slower in 6 of 8. The default is ``"rows"`` with
``unit_bytes`` requests (:data:`STRIDED_DEFAULT`): as fast, and it keeps every request bounded,
so the window, the stall timeout and the drain work per 16 MiB, not per whole column slice. Two
requests in flight gained 14-20% over one in a side measurement (the read loop's window allows
it). NIXL 1.5.1's compressed strided lists (an Nx5 ``prep_xfer_dlist``) were tried: the READ
reported DONE having moved only the first row, so they are not used. With an RDMA NIC the
per-descriptor cost is the NIC's; re-measure there. The same-host tier's strided ``copy_`` ran at
0.61-0.91 of a contiguous copy of the same bytes (5.2-12 GB/s).

Rules, as :func:`tensorhub.transport.reader.pull` has them:

1. Every run is checked against both sides' tensor sizes before anything is posted; a run that
   does not fit, or names a tensor neither side has, is :class:`LayoutMismatch` (nothing moved).
2. The holder must hold ``expect_version``: its control block is read first (twice: the
   second read times the round trip for the window) and again after the last read (a seqlock:
   a holder that moved on meanwhile makes the bytes void, :class:`TransferError`). A holder
   still at an older version is waited for, at most ``source_stall_timeout_s``
   (:class:`SourceStalled`). Given the holder's unit table (``HolderTensors.units``,
   :func:`unit_map` of its layout), a *partial* holder serves the runs whose bytes lie in its
   final units: each request is posted once the holder's progress covers the units under it
   (requests go in that order), the control block is polled for more while the next request
   waits, and the last check asks for every unit read from to be still final. Without the
   table the holder must be complete.
3. At most ``config.reads_in_flight`` requests are posted, fewer as the link needs
   (:class:`~tensorhub.transport.pacing.Pacer`); nothing moving for ``source_stall_timeout_s``
   is :class:`SourceStalled`; a failed request is :class:`TransferError`.
4. Every posted request is terminal when the call returns or raises. A request still in flight
   ``source_stall_timeout_s`` after a failure is never released (that does not stop a UCX READ):
   the region keeps it (:meth:`Region.keep_range_reads`), the call raises
   :class:`ReadsNotTerminal`, and the caller waits for :meth:`Region.settle` before it reuses
   the bytes or reports the holder failed.
5. Neither tier touches the reader region's control block (version, progress, checksums): which
   units a set of runs completes is the caller's (the wiring stage's) to publish.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from tensorhub.config import Config
from tensorhub.core.reshard import ReshardPlan, Run
from tensorhub.errors import LayoutMismatch, ReadsNotTerminal, SourceStalled, SourceUnreachable, TransferError
from tensorhub.layout import Layout
from tensorhub.transport.agent import XferState, await_terminal, sleep_unlocked, unlocked
from tensorhub.transport.nixl import MemRegion, Region, Source
from tensorhub.transport.pacing import POLL_MAX_S, POLL_MIN_S, Pacer

logger = logging.getLogger(__name__)

__all__ = ["STRIDED_DEFAULT", "HolderTensors", "copy_runs", "range_descs", "read_runs", "runs_of"]

STRIDED_DEFAULT = "rows"
"""How :func:`read_runs` posts a strided run unless told: rows batched into requests of about
``request_bytes``. Chosen by measurement (the module doc's table): as fast as one
multi-descriptor request here, and every request stays bounded."""


class HolderTensors(NamedTuple):
    """A holder shard's local tensors as runs name them: ``names`` in the order of its endpoint's
    tensors (its placement's order), and their sizes in bytes. ``units``: the holder's transfer
    units (its :class:`~tensorhub.layout.Layout`'s, see :func:`unit_map`), so that a partial
    holder serves the runs whose bytes lie in its final units (rule 2); None: the holder must be
    complete."""

    names: tuple[str, ...]
    nbytes: tuple[int, ...]
    units: Optional["UnitMap"] = None

    @classmethod
    def of(cls, names: Sequence[str], mems: Sequence[MemRegion]) -> "HolderTensors":
        """From the holder's tensor names and its endpoint's ``tensors``."""
        if len(names) != len(mems):
            raise LayoutMismatch(f"{len(names)} holder tensor names for an endpoint of {len(mems)} tensors")
        return cls(tuple(names), tuple(m.nbytes for m in mems))

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise LayoutMismatch(f"the holder has no local tensor {name!r}") from None

    def need(self, tensor: int, end: int) -> Optional[int]:
        """Units of the holder's prefix that must be final before bytes ``[.., end)`` of its
        tensor ``tensor`` may be read (None: all of them, no unit map)."""
        return None if self.units is None else self.units.need(tensor, end)


class UnitMap(NamedTuple):
    """Where a holder's transfer units start, per tensor: ``starts[t]`` are the byte offsets in
    tensor ``t`` at which its units begin, ``first[t]`` the index of the first of them."""

    starts: tuple[tuple[int, ...], ...]
    first: tuple[int, ...]
    unit_count: int

    def need(self, tensor: int, end: int) -> int:
        """1 + the index of the unit holding byte ``end - 1`` of ``tensor``."""
        starts = self.starts[tensor]
        if not starts:
            return 0
        return self.first[tensor] + bisect.bisect_right(starts, max(end - 1, 0))


def unit_map(layout: Layout) -> UnitMap:
    """The :class:`UnitMap` of a holder's layout (:mod:`tensorhub.layout` rules: a large tensor
    cut into units, small ones packed together)."""
    starts: list[list[int]] = [[] for _ in layout.metas]
    first = [0] * len(layout.metas)
    for u, unit in enumerate(layout.units):
        for piece in unit:
            if not starts[piece.tensor_index]:
                first[piece.tensor_index] = u
            starts[piece.tensor_index].append(piece.offset)
    return UnitMap(tuple(tuple(x) for x in starts), tuple(first), layout.unit_count)


def runs_of(plan: ReshardPlan, shard: int) -> tuple[Run, ...]:
    """The plan's runs that read holder shard ``shard``."""
    return tuple(r for r in plan.runs if r.holder_shard == shard)


def _span(r: Run, offset: int, stride: int) -> int:
    """One past the last byte ``r`` touches on the side at ``offset`` with ``stride``."""
    return offset + (r.count - 1) * stride + r.run_bytes


def _check_run(r: Run, reader_nbytes: int, holder_nbytes: int) -> None:
    """Rule 1: a run lies inside both tensors."""
    if r.run_bytes < 0 or r.count < 1 or min(r.reader_offset, r.holder_offset, r.reader_stride, r.holder_stride) < 0:
        raise LayoutMismatch(f"run {r} has a negative size, count or offset")
    if _span(r, r.reader_offset, r.reader_stride) > reader_nbytes:
        raise LayoutMismatch(f"run {r} writes past reader tensor {r.reader_tensor!r} ({reader_nbytes} bytes)")
    if _span(r, r.holder_offset, r.holder_stride) > holder_nbytes:
        raise LayoutMismatch(f"run {r} reads past holder tensor {r.holder_tensor!r} ({holder_nbytes} bytes)")


def range_descs(mem: MemRegion, offset: int, nbytes: int, count: int = 1, stride: int = 0,
                first: int = 0) -> np.ndarray:
    """NIXL descriptors (an Nx3 ``uint64`` array: address, length, device) of rows
    ``[first, count)`` of a strided range of the registered tensor ``mem``: row ``i`` is
    ``nbytes`` bytes at ``offset + i * stride``. Bounds are the caller's to check."""
    rows = np.arange(first, count, dtype=np.uint64)
    out = np.empty((len(rows), 3), dtype=np.uint64)
    out[:, 0] = np.uint64(mem.addr + offset) + rows * np.uint64(stride)
    out[:, 1] = nbytes
    out[:, 2] = mem.dev_id
    return out


class _Request(NamedTuple):
    local: np.ndarray
    remote: np.ndarray
    nbytes: int
    need: int = 0
    """Holder units that must be final before it is posted."""


def _segments(r: Run, lmem: MemRegion, rmem: MemRegion, strided: str, request_bytes: int,
              need: Callable[[int], int]) -> Iterator[_Request]:
    """One run as blocks of descriptors that may share a request, each at most
    ``request_bytes`` unless it is one strided run posted whole (``"multi"``). ``need(end)``:
    the holder units that must be final to read its tensor's bytes up to ``end``."""
    if r.run_bytes == 0:
        return
    if r.count > 1 and (strided == "multi" or r.run_bytes <= request_bytes):
        per = r.count if strided == "multi" else max(1, request_bytes // r.run_bytes)
        for a in range(0, r.count, per):
            b = min(r.count, a + per)
            yield _Request(range_descs(lmem, r.reader_offset, r.run_bytes, b, r.reader_stride, a),
                           range_descs(rmem, r.holder_offset, r.run_bytes, b, r.holder_stride, a),
                           (b - a) * r.run_bytes, need(r.holder_offset + (b - 1) * r.holder_stride + r.run_bytes))
        return
    for i in range(r.count):  # contiguous, or rows longer than a request: cut each row
        lo, ho = r.reader_offset + i * r.reader_stride, r.holder_offset + i * r.holder_stride
        for a in range(0, r.run_bytes, request_bytes):
            n = min(request_bytes, r.run_bytes - a)
            yield _Request(range_descs(lmem, lo + a, n), range_descs(rmem, ho + a, n), n, need(ho + a + n))


def _requests(runs: Sequence[Run], lmems: dict[str, MemRegion], rmems: dict[str, MemRegion],
              strided: str, request_bytes: int, holder: "HolderTensors") -> list[_Request]:
    """Segments ordered by the holder units they need (stable: plan order within one need; a
    partial holder's final units first), packed greedily into requests of at most
    ``request_bytes`` that never mix needs (a request waits for nothing it does not read)."""
    out: list[_Request] = []
    pending: list[_Request] = []
    size = 0
    segs: list[_Request] = []
    for r in runs:
        j = holder.index(r.holder_tensor)
        need = (lambda end, j=j: holder.need(j, end)) if holder.units is not None else (lambda end: -1)
        segs.extend(_segments(r, lmems[r.reader_tensor], rmems[r.holder_tensor], strided, request_bytes, need))
    segs.sort(key=lambda q: q.need)

    def flush() -> None:
        nonlocal size
        if pending:
            out.append(_Request(np.concatenate([p.local for p in pending]),
                                np.concatenate([p.remote for p in pending]), size, pending[0].need))
            pending.clear()
            size = 0

    for seg in segs:
        if size and (size + seg.nbytes > request_bytes or seg.need != pending[0].need):
            flush()
        pending.append(seg)
        size += seg.nbytes
    flush()
    return out


def read_runs(region: Region, source: Source, runs: Sequence[Run], holder: HolderTensors, *,
              expect_version: int, config: Config, strided: Optional[str] = None,
              request_bytes: Optional[int] = None) -> int:
    """Carry out ``runs`` (all from the holder shard behind ``source``: see :func:`runs_of`) by
    one-sided NIXL READs straight into ``region``'s registered tensors, named by the region's
    layout. ``holder`` names the source's tensors. ``strided``: ``"rows"`` or ``"multi"`` (see
    the module doc; None: :data:`STRIDED_DEFAULT`); ``request_bytes``: bytes per request (None:
    ``config.unit_bytes``). Blocks until every byte landed or the read failed; returns the bytes
    read. Not idempotent only in that it reads again. Raises as the module doc's rules say:
    :class:`LayoutMismatch` (nothing posted), :class:`SourceStalled`, :class:`TransferError`,
    :class:`ReadsNotTerminal` (reads left with the region), and :class:`ReadsNotTerminal` at
    once while an earlier call's reads are still in flight (:meth:`Region.settle`)."""
    strided = strided or STRIDED_DEFAULT
    if strided not in ("rows", "multi"):
        raise ValueError(f"strided must be 'rows' or 'multi', not {strided!r}")
    request_bytes = int(request_bytes or config.unit_bytes)
    if request_bytes < 1:
        raise ValueError("request_bytes must be >= 1")
    if region.agent is not source.agent:
        raise TransferError("region and source must use the same agent")
    ep = source.endpoint
    if len(holder.names) != len(ep.tensors) or holder.nbytes != tuple(m.nbytes for m in ep.tensors):
        raise LayoutMismatch(f"the holder tensors given do not match the endpoint of {source.name}")
    lmems, rmems = {}, {}
    for r in runs:
        i = _reader_index(region, r.reader_tensor)
        j = holder.index(r.holder_tensor)
        _check_run(r, region.layout.metas[i].nbytes, holder.nbytes[j])
        lmems[r.reader_tensor], rmems[r.holder_tensor] = region.mems[i], ep.tensors[j]
    if not region.settle(0.0):
        raise ReadsNotTerminal(f"{region.unsettled_ranges} range reads and reads into units "
                               f"{region.unsettled_units} of an earlier call are still in flight (Region.settle)")
    mem_types = {m.mem_type for m in rmems.values() if m.nbytes}
    if len(mem_types) > 1:
        raise LayoutMismatch(f"source {source.name} spans memory types {sorted(mem_types)}")
    requests = _requests(runs, lmems, rmems, strided, request_bytes, holder)
    if not requests:
        return 0
    with region.agent.xfer_lock:
        return _RangeReader(region, source, requests, expect_version, config,
                            mem_types.pop() if mem_types else "DRAM").run()


def _reader_index(region: Region, name: str) -> int:
    try:
        return region.layout.index_of(name)
    except (KeyError, ValueError):
        raise LayoutMismatch(f"the reader has no local tensor {name!r}") from None


class _RangeReader:
    """State of one :func:`read_runs` call; exists so the loop fits on a screen. Runs with the
    agent's ``xfer_lock`` held, let go while it sleeps."""

    def __init__(self, region: Region, source: Source, requests: list[_Request], version: int,
                 config: Config, remote_mem: str):
        self.region, self.source, self.requests = region, source, requests
        self.version, self.config, self.remote_mem = version, config, remote_mem
        self.nx = region.agent.nixl
        self.lock = region.agent.xfer_lock
        self.pacer = Pacer(config.reads_in_flight)
        self.inflight: dict[int, Any] = {}
        self.next = 0
        self.bytes_read = 0
        self.moved_at = time.monotonic()
        self.total = source.endpoint.unit_count
        self.progress = 0
        """The holder's final units as last read from its control block (our version)."""
        self.needs = [self.total if q.need < 0 else min(q.need, self.total) for q in requests]
        """Per request, the holder units that must be final (sorted: _requests orders them)."""

    def run(self) -> int:
        try:
            first = self.needs[0] if self.needs else self.total
            self._await_version(first)
            self._await_version(first)  # the first paid for connecting: this one times the round trip
            self._loop()
            self._check_version("after the last read")  # rule 2: the seqlock
        except BaseException as e:
            self._drain(e)
            raise
        self._drain(None)
        return self.bytes_read

    def _loop(self) -> None:
        n = len(self.requests)
        while self.next < n or self.inflight:
            while self.next < n and self.pacer.may_post() and self.needs[self.next] <= self.progress:
                self._post(self.next)
                self.next += 1
            if self._reap():
                continue
            now = time.monotonic()
            if self.next < n and self.needs[self.next] > self.progress and self.pacer.may_post():
                self._poll_progress()  # a partial holder: its next units, or it moved on
            if time.monotonic() - self.moved_at > self.config.source_stall_timeout_s:
                raise SourceStalled(f"range reads from {self.source.name}: none of {len(self.inflight)} in flight "
                                    f"completed and the holder's final units stayed {self.progress} of {self.total} "
                                    f"for {self.config.source_stall_timeout_s}s")
            sleep_unlocked(self.lock, self.pacer.sleep_s(now, POLL_MIN_S))

    def _poll_progress(self) -> None:
        v, p, _ = self._control()
        if v != self.version:
            raise TransferError(f"{self.source.name} moved on from version {self.version} (now {v}) "
                                f"while it was partial: the bytes read are void")
        if p > self.progress:
            self.progress = p
            self.moved_at = time.monotonic()

    def _post(self, k: int) -> None:
        req = self.requests[k]
        try:
            h = self.nx.initialize_xfer(
                "READ", self.nx.get_xfer_descs(req.local, self.region.mem_type),
                self.nx.get_xfer_descs(req.remote, self.remote_mem), self.source.name)
            state = self.nx.transfer(h)
        except Exception as e:
            raise TransferError(f"posting range request {k} from {self.source.name} failed: {e}") from e
        self.inflight[k] = h
        self.pacer.on_post(k, req.nbytes, time.monotonic())
        if state == XferState.ERR:
            raise TransferError(f"range request {k} from {self.source.name} failed")

    def _reap(self) -> bool:
        landed = []
        for k, h in list(self.inflight.items()):
            try:
                state = self.nx.check_xfer_state(h)
            except Exception as e:
                raise TransferError(f"range request {k} from {self.source.name} failed: {e}") from e
            if state == XferState.PROC:
                continue
            if state != XferState.DONE:
                raise TransferError(f"range request {k} from {self.source.name} failed ({state})")
            del self.inflight[k]
            h.release()
            landed.append(k)
            self.bytes_read += self.requests[k].nbytes
        if landed:
            self.pacer.on_done(landed, time.monotonic())
            self.moved_at = time.monotonic()
        return bool(landed)

    def _await_version(self, need: int) -> None:
        """Rule 2: wait (bounded) until the holder holds our version with at least ``need``
        final units; time the read."""
        deadline = time.monotonic() + self.config.source_stall_timeout_s
        delay = POLL_MIN_S
        while True:
            t = time.perf_counter()
            v, p, total = self._control()
            if not self.inflight:
                self.pacer.on_rtt(time.perf_counter() - t)
            if v > self.version:
                raise TransferError(f"{self.source.name} holds version {v}, newer than {self.version}")
            if v == self.version and p >= need:
                self.progress = max(self.progress, p)
                return
            if time.monotonic() > deadline:
                raise SourceStalled(f"{self.source.name} holds version {v} with {p} of {total} units final, "
                                    f"not version {self.version} with {need}, after {self.config.source_stall_timeout_s}s")
            sleep_unlocked(self.lock, delay)
            delay = min(2 * delay, POLL_MAX_S)

    def _check_version(self, when: str) -> None:
        """The seqlock: still our version, with every unit read from still final."""
        v, p, total = self._control()
        need = max(self.needs, default=0)
        if v != self.version or p < need:
            raise TransferError(f"{self.source.name} moved on from version {self.version} (now {v}, "
                                f"{p} of {total} units) {when}: the bytes read are void")

    def _control(self) -> tuple[int, int, int]:
        raw = self.source._read_control_raw(self.config.source_stall_timeout_s)
        return int(raw[0]), int(raw[1]), self.source.endpoint.unit_count

    def _drain(self, failure: Optional[BaseException]) -> None:
        """Rule 4: wait for every posted request to be terminal; keep the rest with the region."""
        if not self.inflight:
            return
        timeout = self.config.source_stall_timeout_s
        with unlocked(self.lock):
            await_terminal(self.nx, self.inflight, timeout, self.lock)
        if not self.inflight:
            return
        left = list(self.inflight.values())
        self.region.keep_range_reads(left)
        self.inflight = {}
        why = f"failed ({type(failure).__name__}: {failure})" if failure is not None else "ended"
        msg = (f"{len(left)} range reads from {self.source.name} still in flight {timeout}s after the call "
               f"{why}: they may still write the reader's tensors (Region.settle)")
        logger.error(msg)
        raise ReadsNotTerminal(msg) from failure


# --------------------------------------------------------------------------- same host


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _strided(flat: torch.Tensor, r: Run, offset: int, stride: int) -> torch.Tensor:
    """``r``'s bytes on one side as a (count, run_bytes) view of that side's bytes ``flat``."""
    return flat.as_strided((r.count, r.run_bytes), (stride if r.count > 1 else r.run_bytes, 1),
                           flat.storage_offset() + offset)


def copy_runs(region: Region, src: Any, runs: Sequence[Run], holder: HolderTensors, *,
              expect_version: int, config: Optional[Config] = None) -> int:
    """The same-host tier of :func:`read_runs`: copy ``runs`` from a holder's memory mapped in
    this process (``src``: a :class:`~tensorhub.transport.shm.ShmSource` or
    :class:`~tensorhub.transport.shm.LocalSource`) into ``region``'s tensors, one ``copy_`` per
    run between strided views of the two sides' bytes. ``holder`` names the holder's tensors in
    its endpoint's order with their sizes (the mapped memory's offsets are the endpoint's, not
    trusted past them). The holder must hold ``expect_version``, with the units under each run
    final before it is copied (all of them without ``holder.units``; a partial holder is waited
    for, at most ``config.source_stall_timeout_s`` without progress: :class:`SourceStalled`), and
    still after the last copy (a seqlock on its live control block): else :class:`TransferError`;
    memory that is gone is :class:`SourceUnreachable`; runs that do not fit
    :class:`LayoutMismatch` (nothing copied). Returns the bytes copied; every copy has ended
    when it returns or raises (plain memory copies)."""
    checked = []
    total = int(src.control.numel()) - 2
    for r in runs:
        i = _reader_index(region, r.reader_tensor)
        j = holder.index(r.holder_tensor)
        _check_run(r, region.layout.metas[i].nbytes, holder.nbytes[j])
        need = holder.need(j, _span(r, r.holder_offset, r.holder_stride))
        checked.append((total if need is None else min(need, total), r, i, j))
    checked.sort(key=lambda c: c[0])  # a partial holder's final units first
    if not src.still_same():
        raise SourceUnreachable(f"{src.name}: the memory mapped earlier is gone")
    timeout = (config or Config()).source_stall_timeout_s
    _await_near(src, expect_version, checked[0][0] if checked else total, timeout, "before the first copy")
    nbytes = 0
    for need, r, i, j in checked:
        if not r.nbytes:
            continue
        _await_near(src, expect_version, need, timeout, "before a copy")
        hspan = _span(r, 0, r.holder_stride)
        piece = src.piece(j, r.holder_offset, hspan)
        if piece.numel() != hspan:  # the endpoint's offsets run past the memory mapped
            raise SourceUnreachable(f"{src.name}: tensor {r.holder_tensor!r} lies outside the memory mapped")
        dst = _strided(_byte_view(region.tensors[i]), r, r.reader_offset, r.reader_stride)
        dst.copy_(_strided(piece, r, 0, r.holder_stride))
        nbytes += r.nbytes
    _check_near_version(src, expect_version, "after the last copy", max((c[0] for c in checked), default=0))
    return nbytes


def _await_near(src: Any, version: int, need: int, timeout_s: float, when: str) -> None:
    """Wait (bounded by ``timeout_s`` without progress) until the mapped holder holds
    ``version`` with ``need`` final units; a holder of another version is TransferError."""
    ctl = src.control
    last, moved = -1, time.monotonic()
    delay = POLL_MIN_S
    while True:
        v, p = int(ctl[0]), int(ctl[1])
        if v != version:
            raise TransferError(f"{src.name} holds version {v}, not version {version} ({when}): "
                                f"the bytes copied are void")
        if p >= need:
            return
        if p != last:
            last, moved = p, time.monotonic()
        elif time.monotonic() - moved > timeout_s:
            raise SourceStalled(f"{src.name}: version {version} stayed at {p} final units, {need} needed, "
                                f"for {timeout_s}s ({when})")
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)


def _check_near_version(src: Any, version: int, when: str, need: int) -> None:
    ctl = src.control
    v, p = int(ctl[0]), int(ctl[1])
    total = ctl.numel() - 2
    if v != version or p < need or int(ctl[0]) != v:
        raise TransferError(f"{src.name} holds version {v} with {p} of {total} units final {when}, "
                            f"not version {version} with {need}: the bytes copied are void")
