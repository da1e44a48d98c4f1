"""Resharding plans: which bytes of which holder shard land where in a reader's local tensors.

Stage 1 of issue 24: a pure planner over two placements (:mod:`tensorhub.placement`), not yet
used by the data path. A reader handle of placement R reads a holder *replica* whose shards have
placements H[0..n). For each of the reader's local tensors, :func:`plan_reshard` lists strided
runs (:class:`Run`): ``count`` copies of ``run_bytes`` bytes, from ``holder_offset`` in a holder
shard's local tensor to ``reader_offset`` in the reader's, each next copy ``holder_stride`` /
``reader_stride`` bytes further on. Rules, in order:

1. Schemas agree: a global tensor both sides name has one dtype and shape, else LayoutMismatch
   naming it (a dtype conversion is not a reshard). Both placements are checked first.
2. A reader local tensor identical to a holder's (same dtype, shape and pieces) is one run of
   its whole bytes: today's same-layout copy.
3. Otherwise each reader piece is filled from holder pieces of its global tensor: first those
   that contain the whole reader box, then those with the same box, then any; ties go to holder
   shard ``(spread + i) % n`` for i = 0, 1, ... so readers of a replicated tensor spread their
   reads. Each holder piece fills only what earlier ones left, so every reader byte is written
   by exactly one run.
4. An intersection of two boxes becomes 2-level runs: the innermost dims that are whole on both
   sides join the contiguous run (a row slice is one run), the next dims outward, while whole on
   both sides, join its count (a column slice of a 2-D tensor is one run of count = rows); any
   dims further out give one run each.
5. Runs of one reader tensor are sorted by reader offset, and a run that continues the one
   before it on both sides (contiguous, or at the same strides) is merged into it.
6. What no holder piece covers is returned in :attr:`ReshardPlan.missing` (reader tensor, global
   tensor, box), not raised: the server may try another holder replica.
   :meth:`ReshardPlan.require_complete` raises LayoutMismatch naming it.

:func:`clip_plan` keeps only the bytes of a plan that land in given reader byte ranges (a read
after a failover moves what the reader does not hold yet, nothing twice).

:func:`apply_plan` carries a plan out with plain byte copies: the reference executor for tests
and the simulator (the transport will read the same runs one-sidedly).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Optional

import msgspec

from tensorhub.errors import LayoutMismatch
from tensorhub.placement import Box, LocalPlacement, Piece, Placement, itemsize, merge_schemas

__all__ = ["Gap", "ReshardPlan", "Run", "apply_plan", "clip_plan", "plan_bytes", "plan_reshard", "shards_needed"]


class Run(msgspec.Struct, frozen=True, array_like=True):
    """``count`` copies of ``run_bytes`` bytes: copy ``i`` reads holder shard ``holder_shard``'s
    local tensor ``holder_tensor`` at ``holder_offset + i * holder_stride`` and writes the
    reader's local tensor ``reader_tensor`` at ``reader_offset + i * reader_stride``. Strides are
    0 when ``count`` is 1."""

    reader_tensor: str
    reader_offset: int
    holder_shard: int
    holder_tensor: str
    holder_offset: int
    run_bytes: int
    count: int = 1
    reader_stride: int = 0
    holder_stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.run_bytes * self.count


class Gap(msgspec.Struct, frozen=True, array_like=True):
    """A box of global tensor ``tensor`` that reader tensor ``reader_tensor`` needs and no holder
    shard of the replica holds."""

    reader_tensor: str
    tensor: str
    box: Box


class ReshardPlan(msgspec.Struct, frozen=True):
    """The runs for a reader's local tensors (grouped by reader tensor in the reader's order,
    by reader offset inside one) and what the holder replica could not supply."""

    runs: tuple[Run, ...]
    missing: tuple[Gap, ...] = ()

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def shards(self) -> tuple[int, ...]:
        """The holder shards the plan reads from, ascending."""
        return tuple(sorted({r.holder_shard for r in self.runs}))

    def runs_for(self, reader_tensor: str) -> tuple[Run, ...]:
        return tuple(r for r in self.runs if r.reader_tensor == reader_tensor)

    def require_complete(self) -> "ReshardPlan":
        """``self``, or LayoutMismatch naming the first missing ranges (rule 6)."""
        if self.missing:
            shown = "; ".join(f"{g.reader_tensor} <- {g.tensor} {g.box}" for g in self.missing[:4])
            raise LayoutMismatch(f"the holder replica does not hold what the reader needs: {shown}"
                                 + (f" (and {len(self.missing) - 4} more)" if len(self.missing) > 4 else ""))
        return self


def plan_bytes(plan: ReshardPlan) -> int:
    """Bytes the plan moves (each reader byte once)."""
    return sum(r.nbytes for r in plan.runs)


class _Slot(msgspec.Struct, frozen=True):
    """One holder piece where the planner may read: shard, its local tensor, the piece, its byte
    offset in that tensor."""

    shard: int
    local: LocalPlacement
    piece: Piece
    base: int


def plan_reshard(reader: Placement, holders: Sequence[Placement], *, spread: int = 0,
                 tensors: Optional[Sequence[str]] = None) -> ReshardPlan:
    """The copy plan for ``reader``'s local tensors (all, or those named in ``tensors``) from the
    holder replica whose shard ``i`` has placement ``holders[i]``. ``spread``: the reader's shard
    index or any small int, to spread reads of replicated pieces (rule 3). Pure and deterministic.
    Raises LayoutMismatch for a bad placement or disagreeing schemas (rule 1), KeyError for a
    name in ``tensors`` the reader does not hold; a holder replica that lacks something is not
    an error (rule 6)."""
    reader.check()
    for h in holders:
        h.check()
    merge_schemas([reader, *holders])
    slots = _slots(holders)
    twins = _twins(holders)
    wanted = reader.tensors if tensors is None else tuple(reader.local(n) for n in tensors)
    runs: list[Run] = []
    missing: list[Gap] = []
    for local in wanted:
        same = _identical(local, twins, spread, len(holders))
        if same is not None:
            shard, holder_tensor = same
            if local.nbytes:
                runs.append(Run(local.name, 0, shard, holder_tensor, 0, local.nbytes))
            continue
        mine: list[Run] = []
        for piece in local.pieces:
            left = _fill(local, piece, slots.get(piece.tensor, ()), spread, len(holders), mine)
            missing.extend(Gap(local.name, piece.tensor, b) for b in left)
        runs.extend(_merged(sorted(mine, key=lambda r: r.reader_offset)))
    return ReshardPlan(tuple(runs), tuple(missing))


def shards_needed(reader: Placement, holders: Sequence[Placement], *, spread: int = 0,
                  tensors: Optional[Sequence[str]] = None) -> tuple[int, ...]:
    """The holder shards a reader shard reads from under :func:`plan_reshard` (ascending): the
    sources a reader must reach."""
    return plan_reshard(reader, holders, spread=spread, tensors=tensors).shards


def clip_plan(plan: ReshardPlan, keep: Mapping[str, Sequence[tuple[int, int]]]) -> ReshardPlan:
    """The part of ``plan`` that writes reader bytes in ``keep``: per reader tensor, sorted
    disjoint ``[start, stop)`` byte ranges (a tensor not named: none of its bytes). Every kept
    byte is still written exactly once, by the same holder shard and from the same holder byte as
    in ``plan``; a strided run is cut into the whole copies inside a range (one strided run) and
    the cut copies at its ends (a contiguous run each). Runs stay sorted by reader offset within
    a reader tensor. Pure; ``missing`` is kept as it is."""
    by_tensor: dict[str, list[Run]] = {}  # in the plan's reader tensor order
    for r in plan.runs:
        mine = by_tensor.setdefault(r.reader_tensor, [])
        mine.extend(p for lo, hi in keep.get(r.reader_tensor, ()) for p in _clip_run(r, lo, hi))
    return ReshardPlan(tuple(r for rs in by_tensor.values() for r in sorted(rs, key=lambda x: x.reader_offset)),
                       plan.missing)


def _clip_run(r: Run, lo: int, hi: int) -> list[Run]:
    """The bytes of ``r`` that land in reader bytes ``[lo, hi)``."""
    if r.count == 1 or r.reader_stride == 0:
        a, b = max(lo, r.reader_offset), min(hi, r.reader_offset + r.nbytes)
        return [_part(r, 0, a - r.reader_offset, b - a)] if a < b else []
    s, n, off = r.reader_stride, r.run_bytes, r.reader_offset
    first = max(0, -(-(lo - off - n + 1) // s))  # the first copy that ends past lo
    last = min(r.count - 1, (hi - 1 - off) // s)  # the last copy that starts before hi
    if first > last:
        return []

    def whole(i: int) -> bool:
        return off + i * s >= lo and off + i * s + n <= hi

    def cut(i: int) -> Run:
        a, b = max(lo, off + i * s), min(hi, off + i * s + n)
        return _part(r, i, a - off - i * s, b - a)

    out, i0, i1 = [], first, last
    if not whole(first):
        out.append(cut(first))
        i0 += 1
    if last >= i0 and not whole(last):
        out.append(cut(last))
        i1 -= 1
    if i0 <= i1:
        k = i1 - i0 + 1
        out.append(Run(r.reader_tensor, off + i0 * s, r.holder_shard, r.holder_tensor,
                       r.holder_offset + i0 * r.holder_stride, n, k,
                       s if k > 1 else 0, r.holder_stride if k > 1 else 0))
    return out


def _part(r: Run, i: int, skip: int, nbytes: int) -> Run:
    """``nbytes`` bytes of copy ``i`` of ``r`` from ``skip`` bytes into it: one contiguous run."""
    return Run(r.reader_tensor, r.reader_offset + i * r.reader_stride + skip, r.holder_shard, r.holder_tensor,
               r.holder_offset + i * r.holder_stride + skip, nbytes)


def _rotation(shard: int, spread: int, n: int) -> int:
    return (shard - spread) % max(n, 1)


def _slots(holders: Sequence[Placement]) -> dict[str, list[_Slot]]:
    out: dict[str, list[_Slot]] = {}
    for shard, h in enumerate(holders):
        for t in h.tensors:
            for p in t.pieces:
                if not p.box.empty:
                    out.setdefault(p.tensor, []).append(_Slot(shard, t, p, t.offset_of(p)))
    return out


def _twins(holders: Sequence[Placement]) -> dict[tuple, list[tuple[int, str]]]:
    """Holder local tensors by what they hold (dtype, shape, pieces): (shard, name), first per shard."""
    out: dict[tuple, list[tuple[int, str]]] = {}
    for shard, h in enumerate(holders):
        for t in h.tensors:
            found = out.setdefault((t.dtype, t.shape, t.pieces), [])
            if not found or found[-1][0] != shard:
                found.append((shard, t.name))
    return out


def _identical(local: LocalPlacement, twins: Mapping[tuple, list[tuple[int, str]]], spread: int,
               n: int) -> Optional[tuple[int, str]]:
    """(shard, holder tensor name) of a holder local tensor identical to ``local`` (rule 2)."""
    found = twins.get((local.dtype, local.shape, local.pieces))
    if not found:
        return None
    return min(found, key=lambda sn: _rotation(sn[0], spread, n))


def _fill(local: LocalPlacement, piece: Piece, slots: Sequence[_Slot], spread: int, n: int,
          out: list[Run]) -> list[Box]:
    """Append runs filling ``piece`` of ``local`` from ``slots`` (rule 3); return what is left."""
    want = piece.box
    left = [] if want.empty else [want]
    order = sorted(slots, key=lambda s: (not s.piece.box.contains(want), s.piece.box != want,
                                         _rotation(s.shard, spread, n)))
    e = itemsize(local.dtype)
    base = local.offset_of(piece)
    for s in order:
        if not left:
            break
        rest = []
        for box in left:
            cut = box.intersect(s.piece.box)
            if cut is None:
                rest.append(box)
                continue
            for r_off, h_off, nbytes, count, r_stride, h_stride in _runs(cut, want, base, s.piece.box, s.base, e):
                out.append(Run(local.name, r_off, s.shard, s.local.name, h_off, nbytes, count, r_stride, h_stride))
            rest.extend(box.minus(cut))
        left = rest
    return left


def c_strides(shape: Sequence[int], e: int) -> list[int]:
    """C-order byte strides of a block of ``shape``."""
    out, acc = [], e
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return out[::-1]


def _runs(cut: Box, rbox: Box, rbase: int, hbox: Box, hbase: int, e: int):
    """2-level runs copying ``cut`` from the holder block (``hbox`` at ``hbase``) to the reader
    block (``rbox`` at ``rbase``), both C-contiguous (rule 4). Yields (reader offset, holder
    offset, run bytes, count, reader stride, holder stride)."""
    n = cut.ndim
    if n == 0:
        yield rbase, hbase, e, 1, 0, 0
        return
    cs, rs, hs = cut.shape, rbox.shape, hbox.shape

    def whole(d: int) -> bool:
        return cs[d] == rs[d] == hs[d]

    c = n - 1
    while c > 0 and whole(c):
        c -= 1
    run_bytes = math.prod(cs[c:]) * e
    rst, hst = c_strides(rs, e), c_strides(hs, e)
    k, count = c, 1
    if c > 0:
        k = c - 1
        count = cs[k]
        while k > 0 and whole(k):
            k -= 1
            count *= cs[k]
        r_stride, h_stride = rst[c - 1], hst[c - 1]
    else:
        r_stride = h_stride = 0
    if count == 1:
        r_stride = h_stride = 0
    for outer in itertools.product(*(range(cut.start[d], cut.stop[d]) for d in range(k))):
        at = outer + cut.start[k:]
        r_off = rbase + sum((x - a) * st for x, a, st in zip(at, rbox.start, rst))
        h_off = hbase + sum((x - a) * st for x, a, st in zip(at, hbox.start, hst))
        yield r_off, h_off, run_bytes, count, r_stride, h_stride


def _merged(runs: Sequence[Run]) -> list[Run]:
    """Rule 5: merge each run into the one before it when it continues it on both sides."""
    out: list[Run] = []
    for r in runs:
        prev = out[-1] if out else None
        joined = _join(prev, r) if prev is not None else None
        if joined is None:
            out.append(r)
        else:
            out[-1] = joined
    return out


def _join(a: Run, b: Run) -> Optional[Run]:
    if (a.holder_shard, a.holder_tensor) != (b.holder_shard, b.holder_tensor):
        return None
    if a.count == b.count == 1:
        if (b.reader_offset == a.reader_offset + a.run_bytes and b.holder_offset == a.holder_offset + a.run_bytes):
            return msgspec.structs.replace(a, run_bytes=a.run_bytes + b.run_bytes)
        return None
    if a.run_bytes != b.run_bytes:
        return None
    rs = a.reader_stride if a.count > 1 else b.reader_stride
    hs = a.holder_stride if a.count > 1 else b.holder_stride
    if b.count > 1 and (b.reader_stride, b.holder_stride) != (rs, hs):
        return None
    if b.reader_offset != a.reader_offset + a.count * rs or b.holder_offset != a.holder_offset + a.count * hs:
        return None
    count = a.count + b.count
    if rs == hs == a.run_bytes:  # stride equals the run: one contiguous run
        return msgspec.structs.replace(a, run_bytes=a.run_bytes * count, count=1, reader_stride=0, holder_stride=0)
    return msgspec.structs.replace(a, count=count, reader_stride=rs, holder_stride=hs)


def apply_plan(plan: ReshardPlan, reader: Mapping[str, object],
               holders: Sequence[Mapping[str, object]]) -> int:
    """Carry ``plan`` out with plain byte copies, one per run copy: the reference executor for
    tests and the simulator. ``reader`` maps the reader's local tensor names to writable
    bytes-like buffers (its tensors' bytes, e.g. a uint8 numpy view); ``holders[i]`` maps holder
    shard ``i``'s local tensor names to readable ones. Returns the bytes copied. An out-of-range
    run is a planner bug (assert)."""
    views = {name: memoryview(buf).cast("B") for name, buf in reader.items()}
    copied = 0
    for r in plan.runs:
        dst = views[r.reader_tensor]
        src = memoryview(holders[r.holder_shard][r.holder_tensor]).cast("B")
        for i in range(r.count):
            d, s = r.reader_offset + i * r.reader_stride, r.holder_offset + i * r.holder_stride
            assert d + r.run_bytes <= len(dst) and s + r.run_bytes <= len(src), r
            dst[d:d + r.run_bytes] = src[s:s + r.run_bytes]
            copied += r.run_bytes
    return copied
