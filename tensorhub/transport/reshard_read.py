"""A resharded read: one reader shard's own tensors filled from a holder replica of another
placement, shard by shard, checked cell by cell, then served as a holder of its own placement.

Stage 3a of issue 24 (docs/placements.md): the reader's side of a resharded read, with the
transports that ship (:mod:`tensorhub.transport.ranges`) and the checksums that survive
resharding (:mod:`tensorhub.gridsums`). The handle drives it from the server's reshard
assignments (:mod:`tensorhub.handle.reshard`); tests and ``benchmarks/reshard.py`` name the
holder shards themselves.

    holder replica (placement H[0..n))          reader shard (placement R, its own tensors)
      shard 0 ---- runs of shard 0 ----\\
      shard 1 ---- runs of shard 1 -----+---->  read straight into place, no staging copy
      ...                               /       cells checked against the holders' checksums
      shard n-1 -- runs of shard n-1 --/        unit checksums published: R readers pipeline

:class:`ReshardRead` owns one read's state. Rules:

1. The plan is made once (:func:`~tensorhub.core.reshard.plan_reshard`, ``spread`` = the
   reader's shard so readers of replicated tensors spread out) and must be complete: a holder
   replica that lacks some of the reader's boxes, a schema that disagrees (a dtype conversion is
   not a reshard) or a reader placement that is not the region's layout is ``LayoutMismatch``
   before anything moves.
2. :meth:`ReshardRead.read` carries out one holder shard's runs from a source: a NIXL
   :class:`~tensorhub.transport.nixl.Source` (:func:`~tensorhub.transport.ranges.read_runs`, one-
   sided reads into the region's registered tensors) or a same-host source
   (:func:`~tensorhub.transport.ranges.copy_runs`). Its errors are the transport's, raised as
   they are; the shard stays not done and may be read again from another source of the same
   placement (a failover of that shard alone). Reading a shard twice rewrites the same bytes.
3. A unit of the reader's own layout is done once every holder shard writing into it is done
   (:meth:`units_done`: the prefix a same-placement reader could pipeline from).
4. :meth:`verify` hashes every cell the reader holds (in place, no copy) against the holders'
   cell checksums (computed by each holder at publish: :func:`~tensorhub.gridsums.cell_checksums`
   over a grid refined with the reader's and the holders' placements) and names, per holder
   shard, the cells that differ: :meth:`check` raises ``ChecksumMismatch`` naming the first
   shard's, and that shard is not done any more (read it again, from elsewhere).
5. :meth:`publish` makes the reader a holder of its own placement: its unit checksums (today's
   whole-unit scheme, so same-placement readers verify as before) and the version, complete.
   Only after every shard is done and verified.
6. :meth:`run` does 2 to 4 in one call with the hashing off the read path: the reader's
   tensors in layout order, in batches; a batch's runs from every holder shard writing it, then
   its cells checked and its units' checksums computed on a second thread while the next batch
   is read (the hashes let go of the GIL). :meth:`read` and :meth:`check` stay for a failover:
   read one shard again, check everything again.
7. A holder shard still receiving the version (a reader of the holder's placement, partial)
   serves the runs whose bytes lie in its final units: the reader waits for the rest (at most
   ``source_stall_timeout_s`` without progress), so a read across layouts pipelines behind a
   partial holder as a same-layout read does. Needs the holder's unit table, rebuilt from its
   placement with this process's ``unit_bytes``/``pack_below_bytes`` and used only when the
   holder's endpoint shows the same unit signature (else the holder must be complete).
8. A failover keeps what is in place and checked (:meth:`ReshardRead.kept`: the reader's own
   units whose every byte came and whose cells were checked, with their unit checksums). A
   read made with ``kept`` from an earlier read of the same version, from any holder replica of
   any placement, plans only the bytes of the other units
   (:func:`~tensorhub.core.reshard.clip_plan`): holder shards that write none of them are not
   needed (:attr:`shards`), and only the cells those bytes touch are checked against the new
   holders' checksums. So every byte the reader ends with was checked once, against the
   holders it came from.

Memory: nothing beyond the plan (a few runs per local tensor) and the cell map; the bytes move
straight into the reader's registered tensors and are hashed where they land.
"""

from __future__ import annotations

import bisect
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple, Optional, Union

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.grid import Grid
from tensorhub.core.placements import check_locals
from tensorhub.core.reshard import ReshardPlan, Run, c_strides, clip_plan, plan_reshard
from tensorhub.errors import ChecksumMismatch, InvalidState
from tensorhub.gridsums import CellKey, CellMismatch, verify_cells
from tensorhub.layout import Layout, TensorMeta, checksum_all, checksum_unit
from tensorhub.placement import Placement, itemsize
from tensorhub.transport.nixl import Region, Source
from tensorhub.transport.ranges import HolderTensors, UnitMap, copy_runs, read_runs, runs_of, unit_map

__all__ = ["Kept", "ReshardRead", "ShardMismatch"]


class Kept(NamedTuple):
    """What a failed resharded read leaves in place and checked (rule 8): the reader's own
    units of ``version`` whose every byte came and was checked, and their unit checksums (empty
    without checksums)."""

    version: int
    units: frozenset[int]
    sums: Mapping[int, int]


class ShardMismatch(NamedTuple):
    """Cells written from holder shard ``shard`` whose bytes differ from its checksums."""

    shard: int
    cells: tuple[CellMismatch, ...]


class ReshardRead:
    """One reader shard's resharded read of ``version`` from one holder replica (the module
    docstring's rules). ``region``: the reader's registered tensors (layout order = the reader
    placement's local tensors); ``holders[i]``: holder shard ``i``'s placement. Not
    thread-safe: one caller drives it."""

    def __init__(self, region: Region, reader: Placement, holders: Sequence[Placement], *, version: int,
                 config: Config, spread: int = 0, kept: Optional[Kept] = None) -> None:
        check_locals(_layout_info(region), reader)
        self.region = region
        self.reader = reader
        self.holders = tuple(holders)
        self.version = int(version)
        self.config = config
        self.full_plan: ReshardPlan = plan_reshard(reader, self.holders, spread=spread).require_complete()
        """Every reader byte's run (what a read without ``kept`` moves)."""
        self._spans = _unit_spans(region)
        self.checked: set[int] = set()
        """The reader's own units whose every byte came and was checked (rule 8)."""
        self._kept_sums: dict[int, int] = {}
        if kept is not None and kept.version == self.version:
            self.checked = set(kept.units)
            self._kept_sums = dict(kept.sums)
        self.plan: ReshardPlan = (clip_plan(self.full_plan, self._unchecked_ranges()) if self.checked
                                  else self.full_plan)
        """The runs this read moves: those writing the units not :attr:`checked` yet."""
        self._before = frozenset(self.checked)
        """The units checked before this read began: their cells are not checked again."""
        self.failed_shard: Optional[int] = None
        """The holder shard whose read made :meth:`run` raise (None: none)."""
        self.done: set[int] = set()
        self.bytes_read = 0
        self._unit_shards = _unit_writers(region, self.plan)
        self._units: dict[int, tuple[Layout, UnitMap]] = {}
        """Per holder shard: its layout as this process's config cuts it, and its unit table."""
        self._unit_sums: Optional[list[int]] = None
        """The unit checksums :meth:`run` computed (None: compute them at :meth:`publish`)."""

    @property
    def shards(self) -> tuple[int, ...]:
        """The holder shards this read needs (ascending): those writing units not checked yet."""
        return self.plan.shards

    def kept(self) -> Kept:
        """The units in place and checked so far, with their unit checksums (rule 8): give it to
        the next read of this version after a failover."""
        sums = {u: x for u, x in self._kept_sums.items() if u in self.checked}
        return Kept(self.version, frozenset(self.checked), sums)

    def _unchecked_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """Per reader tensor, the byte ranges of units not :attr:`checked`, sorted and merged."""
        lay = self.region.layout
        out: dict[str, list[tuple[int, int]]] = {}
        for ti, spans in self._spans.items():
            ranges = out.setdefault(lay.names[ti], [])
            for lo, hi, u in spans:
                if u in self.checked:
                    continue
                if ranges and ranges[-1][1] == lo:
                    ranges[-1] = (ranges[-1][0], hi)
                else:
                    ranges.append((lo, hi))
        return out

    def holder_tensors(self, shard: int, source: Any = None) -> HolderTensors:
        """Holder shard ``shard``'s local tensors as its endpoint lists them (its placement's
        order), with its unit table when ``source`` shows the holder cut its units as this
        process's config would (the same unit signature, or unit count for a mapped holder):
        then a partial holder serves what it has (rule 7)."""
        p = self.holders[shard]
        nbytes = tuple(t.nbytes for t in p.tensors)
        units = self._units.get(shard)
        if units is None:
            metas = [TensorMeta(t.name, t.dtype, t.shape, t.nbytes) for t in p.tensors]
            layout = Layout.from_metas(metas, self.config.unit_bytes, self.config.pack_below_bytes)
            units = self._units[shard] = (layout, unit_map(layout))
        layout, table = units
        if isinstance(source, Source):
            same = source.endpoint.unit_signature == layout.unit_signature
        else:
            control = getattr(source, "control", None)
            same = control is not None and int(control.numel()) - 2 == layout.unit_count
        return HolderTensors(p.names, nbytes, table if same else None)

    def read(self, shard: int, source: Any, *, strided: Optional[str] = None) -> int:
        """Carry out holder shard ``shard``'s runs from ``source`` (rule 2); returns the bytes
        moved. The shard is done when this returns."""
        if shard not in self.shards:
            raise InvalidState(f"holder shard {shard} has nothing this reader needs (it reads {list(self.shards)})")
        self._unit_sums = None  # bytes changed since run() hashed them
        # Units it writes into are checked again (none checked before this read: rule 8).
        self.checked -= {u for u, w in enumerate(self._unit_shards) if shard in w}
        n = self._move(shard, source, runs_of(self.plan, shard), strided)
        self.done.add(shard)
        return n

    def run(self, sources: Mapping[int, Any], grid: Grid,
            expected: Union[Mapping[CellKey, int], Callable[[], Mapping[CellKey, int]]], *,
            batch_bytes: Optional[int] = None, strided: Optional[str] = None, advertise: bool = False) -> int:
        """Rules 2 to 4 in one call, the hashing overlapped with the reads (rule 6): the
        reader's tensors in layout order, in batches of about ``batch_bytes`` (None:
        :data:`BATCH_BYTES`); each batch's runs read from every holder shard writing into it
        (``sources[shard]``), then its cells checked and the checksums of the units it completes
        computed on a second thread while the next batch is read. A batch with nothing left to
        read (rule 8) is neither read nor checked. Returns the bytes moved. Raises as
        :meth:`read` (the shards whose runs all landed are done; the units of every batch read
        and checked before are :attr:`checked`, for :meth:`kept`; :attr:`failed_shard` names the
        shard whose read failed) or, once every read ended, ``ChecksumMismatch`` as :meth:`check`
        (the units holding no bad cell are :attr:`checked`), or what ``expected`` raised.
        :meth:`publish` then uses the unit checksums computed here.

        ``expected`` may be a function that returns the checksums: it is called once, on the
        hashing thread, before the first batch is checked, so the reads start before the holders'
        checksums are known (a holder hashing on demand). ``advertise``: the region says the
        version with the units already checked (rule 8) from the start, then, as batches are
        checked, the leading units checked with their checksums (rule 3's prefix, verified):
        readers of the reader's own placement pipeline from it while it reads. A bad cell stops
        the prefix at its unit."""
        lacking = [s for s in self.shards if s not in sources]
        if lacking:
            raise InvalidState(f"no source for holder shards {lacking}")
        self.failed_shard = None
        lay = self.region.layout
        batches = _batches(lay.metas, BATCH_BYTES if batch_bytes is None else batch_bytes)
        last_batch = {i: b for b, names in enumerate(batches) for i in (lay.index_of(n) for n in names)}
        completes: dict[int, list[int]] = {}  # batch -> the units whose last bytes it holds
        for u, unit in enumerate(lay.units):
            completes.setdefault(last_batch[max(p.tensor_index for p in unit)], []).append(u)
        left = {s: len(runs_of(self.plan, s)) for s in self.shards}
        tensors = dict(zip(lay.names, self.region.tensors))
        sums = self._kept_sums
        checksums = self.config.checksums
        known: list[Any] = []  # the checksums, or what fetching them raised (raised for every batch)
        bad_spans: dict[int, list[tuple[int, int]]] = {}  # reader tensor index -> spans of bad cells
        shown = [self._prefix()]  # units advertised
        if advertise:
            self.region.set_progress(0)
            self.region.set_version(self.version)
            if shown[0]:
                if checksums:
                    self.region.set_checksums([sums[u] for u in range(shown[0])], start=0)
                self.region.set_progress(shown[0])

        def hash_batch(b: int, names: frozenset[str]) -> list[CellMismatch]:
            if not known:
                try:
                    known.append(expected() if callable(expected) else expected)
                except BaseException as e:  # noqa: BLE001 - raised by every batch's future
                    known.append(e)
            if isinstance(known[0], BaseException):
                raise known[0]
            bad = verify_cells(tensors, self.reader, grid, known[0], names,
                               only=self._unchecked_cell if self._before else None)
            for c in bad:
                local = self.reader.local(c.local)
                bad_spans.setdefault(lay.index_of(c.local), []).append(_cell_span(local, _piece_of(local, c), c.box))
            self._checked_in(completes.get(b, ()), bad_spans)
            if advertise:
                end = self._prefix()
                if end > shown[0]:
                    if checksums:
                        self.region.set_checksums([sums[u] for u in range(shown[0], end)], start=shown[0])
                    self.region.set_progress(end)
                    shown[0] = end
            return bad

        self._unit_sums = None
        moved = 0
        futures = []
        with ThreadPoolExecutor(1, thread_name_prefix="tensorhub-reshard-hash") as pool:
            for b, names in enumerate(batches):
                runs = [r for n in lay.names if n in names for r in self.plan.runs_for(n)]
                if not runs:
                    continue  # every unit it completes is checked already (rule 8)
                for shard in sorted({r.holder_shard for r in runs}):
                    mine = [r for r in runs if r.holder_shard == shard]
                    try:
                        moved += self._move(shard, sources[shard], mine, strided)
                    except BaseException:
                        self.failed_shard = shard
                        raise  # the pool still checks the batches read before (rule 8)
                    left[shard] -= len(mine)
                    if not left[shard]:
                        self.done.add(shard)
                futures.append(pool.submit(hash_batch, b, names))
            bad = [c for f in futures for c in f.result()]
        self._raise_bad(self._by_shard(bad))
        self._unit_sums = [sums[u] for u in range(lay.unit_count)] if checksums else None
        return moved

    def _checked_in(self, units, bad_spans: Mapping[int, Sequence[tuple[int, int]]]) -> None:
        """``units`` (every byte came, every cell checked) are :attr:`checked` unless a bad cell
        touches them; with checksums, their unit checksums are computed."""
        lay = self.region.layout
        for u in units:
            if u in self.checked or any(lo < p.offset + p.nbytes and p.offset < hi for p in lay.units[u]
                                        for lo, hi in bad_spans.get(p.tensor_index, ())):
                continue
            if self.config.checksums:
                self._kept_sums[u] = checksum_unit(self.region.tensors, lay.units[u])
            self.checked.add(u)

    def _prefix(self) -> int:
        """The leading units :attr:`checked`."""
        k = 0
        while k in self.checked:
            k += 1
        return k

    def _unchecked_cell(self, local, piece, box) -> bool:
        """Whether the cell ``box`` of ``piece`` touches a unit not checked before this read."""
        lo, hi = _cell_span(local, piece, box)
        return any(a < hi and lo < z and u not in self._before
                   for a, z, u in self._spans.get(self.region.layout.index_of(local.name), ()))

    def units_done(self) -> int:
        """The reader's leading units every writer of which is done (rule 3)."""
        k = 0
        for writers in self._unit_shards:
            if not writers <= self.done:
                break
            k += 1
        return k

    def verify(self, grid: Grid, expected: Mapping[CellKey, int]) -> list[ShardMismatch]:
        """Every differing cell, grouped by the holder shard that wrote it (rule 4); empty when
        all agree. ``expected``: the holder shards' cell checksums, merged (the cells of units
        checked before this read began are not looked at: rule 8)."""
        tensors = dict(zip(self.region.layout.names, self.region.tensors))
        return self._by_shard(verify_cells(tensors, self.reader, grid, expected,
                                           only=self._unchecked_cell if self._before else None))

    def check(self, grid: Grid, expected: Mapping[CellKey, int]) -> None:
        """:meth:`verify`, raising ``ChecksumMismatch`` naming the first bad shard and its first
        cell; every bad shard is no longer done. The units every writer of which is done and
        that hold no bad cell are :attr:`checked`."""
        bad = self.verify(grid, expected)
        spans: dict[int, list[tuple[int, int]]] = {}
        for c in (c for b in bad for c in b.cells):
            local = self.reader.local(c.local)
            spans.setdefault(self.region.layout.index_of(c.local), []).append(_cell_span(local, _piece_of(local, c), c.box))
        self._checked_in([u for u, w in enumerate(self._unit_shards) if w <= self.done], spans)
        self._raise_bad(bad)

    def _by_shard(self, bad: Sequence[CellMismatch]) -> list[ShardMismatch]:
        by_shard: dict[int, list[CellMismatch]] = {}
        for c in bad:
            by_shard.setdefault(self._writer_of(c), []).append(c)
        return [ShardMismatch(s, tuple(cs)) for s, cs in sorted(by_shard.items())]

    def _raise_bad(self, bad: Sequence[ShardMismatch]) -> None:
        if not bad:
            return
        for b in bad:
            self.done.discard(b.shard)
        first = bad[0].cells[0]
        raise ChecksumMismatch(
            f"version {self.version}: {sum(len(b.cells) for b in bad)} cells differ from their holders' checksums, "
            f"from holder shards {[b.shard for b in bad]}; first: {first.local} <- {first.tensor} {first.box}")

    def publish(self) -> None:
        """Rule 5: the reader holds ``version`` complete, with its own unit checksums."""
        missing = [s for s in self.shards if s not in self.done]
        if missing:
            raise InvalidState(f"holder shards {missing} are not read (and verified) yet")
        unchecked = self.region.layout.unit_count - len(self.checked)
        if unchecked:
            raise InvalidState(f"{unchecked} units are not verified yet")
        sums = self._unit_sums
        if sums is None and self.config.checksums:
            sums = checksum_all(self.region.tensors, self.region.layout)
        self.region.publish_complete(self.version, sums)

    def _move(self, shard: int, source: Any, runs: Sequence[Run], strided: Optional[str]) -> int:
        """``runs`` (all of holder shard ``shard``) from ``source``: NIXL or same-host."""
        holder = self.holder_tensors(shard, source)
        if isinstance(source, Source):
            n = read_runs(self.region, source, runs, holder, expect_version=self.version, config=self.config,
                          strided=strided)
        else:
            n = copy_runs(self.region, source, runs, holder, expect_version=self.version, config=self.config)
        self.bytes_read += n
        return n

    def _writer_of(self, c: CellMismatch) -> int:
        """The holder shard whose run wrote the first byte of cell ``c`` (a cell lies inside one
        holder piece: the grid is refined with the holders' placements)."""
        local = self.reader.local(c.local)
        off, _ = _cell_span(local, _piece_of(local, c), c.box)
        return _run_at(self.full_plan.runs_for(c.local), off).holder_shard


BATCH_BYTES = 64 << 20
"""The reader's tensors are read and checked in batches of about this many bytes (:meth:`ReshardRead.run`)."""


def _piece_of(local, c: CellMismatch):
    """The piece of ``local`` that holds cell ``c``."""
    return next(p for p in local.pieces if p.tensor == c.tensor and p.box.contains(c.box))


def _cell_span(local, piece, box) -> tuple[int, int]:
    """The first byte of cell ``box`` (of ``piece`` of local tensor ``local``) and one past its
    last, in the local tensor (a strided cell's span holds bytes of other cells too)."""
    e = itemsize(local.dtype)
    strides = c_strides(piece.box.shape, e)
    base = local.offset_of(piece)
    lo = base + sum((a - b) * s for a, b, s in zip(box.start, piece.box.start, strides))
    hi = base + sum((z - 1 - b) * s for z, b, s in zip(box.stop, piece.box.start, strides)) + e
    return lo, hi


def _unit_spans(region: Region) -> dict[int, list[tuple[int, int, int]]]:
    """Per reader tensor index, the byte ranges ``(start, stop, unit)`` of its units, ascending."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for u, unit in enumerate(region.layout.units):
        for p in unit:
            out.setdefault(p.tensor_index, []).append((p.offset, p.offset + p.nbytes, u))
    return {i: sorted(v) for i, v in out.items()}


def _layout_info(region: Region) -> m.LayoutInfo:
    """The region's layout as the core compares it with a placement (names, dtypes, shapes)."""
    lay = region.layout
    return m.LayoutInfo(lay.fingerprint, lay.unit_count, lay.total_bytes,
                        tuple(m.TensorMeta(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in lay.metas))


def _batches(metas, batch_bytes: int) -> list[frozenset[str]]:
    """Consecutive tensors (layout order) in groups of at least ``batch_bytes`` (the last less)."""
    out, cur, size = [], [], 0
    for t in metas:
        cur.append(t.name)
        size += t.nbytes
        if size >= batch_bytes:
            out.append(frozenset(cur))
            cur, size = [], 0
    if cur:
        out.append(frozenset(cur))
    return out


def _run_at(runs: Sequence[Run], off: int) -> Run:
    """The run (sorted by reader offset) that writes reader byte ``off``."""
    i = bisect.bisect_right([r.reader_offset for r in runs], off) - 1
    while i >= 0:
        r = runs[i]
        d = off - r.reader_offset
        if r.count == 1 and d < r.run_bytes or r.count > 1 and d // r.reader_stride < r.count and d % r.reader_stride < r.run_bytes:
            return r
        i -= 1
    raise LookupError(f"no run writes reader byte {off}")  # a planner bug: every byte has one run


def _unit_writers(region: Region, plan: ReshardPlan) -> list[frozenset[int]]:
    """Per reader unit, the holder shards whose runs may write into it (a strided run counts
    for every unit its span from first to last byte touches: at most a few too many)."""
    lay = region.layout
    spans: dict[int, list[tuple[int, int, int]]] = {}  # reader tensor index -> (start, end, shard)
    for r in plan.runs:
        end = r.reader_offset + (r.count - 1) * r.reader_stride + r.run_bytes
        spans.setdefault(lay.index_of(r.reader_tensor), []).append((r.reader_offset, end, r.holder_shard))
    out = []
    for unit in lay.units:
        writers = set()
        for piece in unit:
            lo, hi = piece.offset, piece.offset + piece.nbytes
            writers.update(s for a, b, s in spans.get(piece.tensor_index, ()) if a < hi and lo < b)
        out.append(frozenset(writers))
    return out
