"""Checksum grids: per global tensor, the cells that every registered placement's boxes are made of.

Stage 2c of issue 24 (verification that survives resharding), pure and not yet wired into the
handle, the server or the transport. A reader of placement R that reads from holders of
placement H receives boxes that are neither R's nor H's units, so today's per-unit checksums
cannot check them. A *grid* can: for each global tensor, along each dim, the sorted set of every
box boundary of every placement given (``0`` and the dim's size included). Every box of every
one of those placements is then a union of whole *cells* (the products of consecutive
boundaries), and a cell's checksum (:mod:`tensorhub.gridsums`: xxh3-64 of its bytes in row-major
order) is the same whichever placement holds it. The rules:

1. A grid is data: :class:`Grid` of :class:`GridTensor` (a global tensor and its cuts per dim),
   sorted by name, frozen ``msgspec`` structs; :meth:`Grid.digest` is stable across processes.
   :func:`grid_of` is order-independent: the same placements in any order give an equal grid.
2. :meth:`Grid.refine` adds one placement's boundaries (a new placement registered); the cells
   of the old grid are unions of the new one's, never the other way round.
3. Cells are numbered row-major over the tensor's cell grid (:meth:`GridTensor.cell`,
   :meth:`GridTensor.index_of`, :meth:`GridTensor.cell_at`); a 0-d tensor has the one cell 0, a
   tensor with a dim of size 0 has none.
4. :func:`cells_of` cuts a box into its cells; a box not on the grid's lines is
   :class:`~tensorhub.errors.LayoutMismatch` naming the tensor and dim (its placement was not
   given to the grid: refine it first).
5. Placements are checked first (``Placement.check``) and their schemas must agree
   (``merge_schemas``): LayoutMismatch naming the tensor.
6. The number of cells is bounded: a grid of more than :data:`CELLS_MAX` cells in all is refused
   with :class:`~tensorhub.errors.OutOfBounds` and nothing is built. For scale: a Llama-70B-shaped
   schema (80 layers, hidden 8192, GQA 8 KV heads, MLP 28672, vocabulary 128256; 723 tensors)
   with vLLM-style TP=1, 2, 4 and 8 placements registered (fused ``qkv_proj`` and ``gate_up_proj``,
   row-parallel ``o_proj`` and ``down_proj``, vocabulary-parallel embedding and head, norms
   replicated) has 4,657 cells; adding an 8-shard row-split (FSDP-like) trainer makes it 14,744
   (``tests/core/test_grid.py`` computes both). The bound leaves over 70 times that.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence

import msgspec
import xxhash

from tensorhub.errors import LayoutMismatch, OutOfBounds
from tensorhub.placement import Box, GlobalTensor, Placement, merge_schemas

__all__ = ["CELLS_MAX", "Grid", "GridTensor", "cells_of", "grid_of"]

CELLS_MAX = 1 << 20
"""Most cells a grid may have over all its tensors (one 8-byte checksum each per version held)."""


class GridTensor(msgspec.Struct, frozen=True, array_like=True):
    """One global tensor's grid: ``cuts[d]`` are the sorted boundaries along dim ``d``, from 0 to
    the dim's size (a dim of size 0 has the single cut 0)."""

    tensor: GlobalTensor
    cuts: tuple[tuple[int, ...], ...]

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def counts(self) -> tuple[int, ...]:
        """Cells along each dim."""
        return tuple(len(c) - 1 for c in self.cuts)

    @property
    def cell_count(self) -> int:
        return math.prod(self.counts)

    def cell(self, index: int) -> Box:
        """The box of cell ``index`` (row-major over :attr:`counts`); IndexError outside."""
        if not 0 <= index < self.cell_count:
            raise IndexError(f"{self.name}: cell {index} of {self.cell_count}")
        at = []
        for n in reversed(self.counts):
            index, i = divmod(index, n)
            at.append(i)
        at.reverse()
        return Box(tuple(c[i] for c, i in zip(self.cuts, at)), tuple(c[i + 1] for c, i in zip(self.cuts, at)))

    def index_of(self, cell: Box) -> int:
        """The index of ``cell``, which must be exactly one cell (LayoutMismatch otherwise)."""
        ranges = _ranges(self, cell)
        if any(len(r) != 1 for r in ranges):
            raise LayoutMismatch(f"global tensor {self.name!r}: {cell} is not one cell of its grid")
        return _flat(self.counts, [r[0] for r in ranges])

    def cell_at(self, point: Sequence[int]) -> int:
        """The index of the cell holding the element at ``point`` (global coordinates)."""
        if len(point) != len(self.cuts) or any(not 0 <= x < c[-1] for x, c in zip(point, self.cuts)):
            raise IndexError(f"{self.name}: element {list(point)} outside shape {list(self.tensor.shape)}")
        return _flat(self.counts, [bisect.bisect_right(c, x) - 1 for x, c in zip(point, self.cuts)])


class Grid(msgspec.Struct, frozen=True):
    """The grids of a model's global tensors, sorted by name (rule 1)."""

    tensors: tuple[GridTensor, ...] = ()

    def __getitem__(self, name: str) -> GridTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def by_name(self) -> dict[str, GridTensor]:
        return {t.name: t for t in self.tensors}

    @property
    def cell_count(self) -> int:
        return sum(t.cell_count for t in self.tensors)

    def digest(self) -> str:
        """Hex digest of the grid (tensors, cuts): equal grids, in any process, share it."""
        return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(self))

    def refine(self, placement: Placement) -> "Grid":
        """This grid with ``placement``'s box boundaries added (rule 2). Raises LayoutMismatch for
        a bad placement or one whose schema disagrees with the grid's, OutOfBounds past
        :data:`CELLS_MAX`; ``self`` is unchanged either way."""
        return _build(self, [placement])


def grid_of(placements: Iterable[Placement]) -> Grid:
    """The grid of every box of ``placements`` (rules 1, 5, 6): LayoutMismatch for a bad placement
    or disagreeing schemas, OutOfBounds past :data:`CELLS_MAX`."""
    return _build(Grid(), list(placements))


def _build(grid: Grid, placements: Sequence[Placement]) -> Grid:
    for p in placements:
        p.check()
    merged = merge_schemas([[t.tensor for t in grid.tensors], *placements])
    cuts: dict[str, list[set[int]]] = {t.name: [set(c) for c in t.cuts] for t in grid.tensors}
    for g in merged.tensors:
        cuts.setdefault(g.name, [{0, s} for s in g.shape])
    for p in placements:
        for local in p.tensors:
            for piece in local.pieces:
                if piece.box.empty:
                    continue
                for d, (a, b) in enumerate(zip(piece.box.start, piece.box.stop)):
                    cuts[piece.tensor][d].update((a, b))
    by_name = merged.by_name()
    out = tuple(GridTensor(by_name[n], tuple(tuple(sorted(c)) for c in cuts[n])) for n in sorted(cuts))
    total = sum(t.cell_count for t in out)
    if total > CELLS_MAX:
        worst = max(out, key=lambda t: t.cell_count)
        raise OutOfBounds(f"checksum grid of {total} cells, more than CELLS_MAX = {CELLS_MAX} "
                          f"(most in {worst.name!r}: {worst.cell_count}, {list(worst.counts)} per dim)")
    return Grid(out)


def _ranges(gt: GridTensor, box: Box) -> list[range]:
    """Per dim, the cell indices ``box`` spans; LayoutMismatch unless it lies on the grid's lines."""
    if not box.inside(gt.tensor.shape):
        raise LayoutMismatch(f"global tensor {gt.name!r}: box {box} is outside shape {list(gt.tensor.shape)}")
    out = []
    for d, (a, b, c) in enumerate(zip(box.start, box.stop, gt.cuts)):
        if a == b:
            return [range(0)] * len(gt.cuts)
        i, j = bisect.bisect_left(c, a), bisect.bisect_left(c, b)
        if i == len(c) or c[i] != a or j == len(c) or c[j] != b:
            raise LayoutMismatch(f"global tensor {gt.name!r}: box {box} is not on the checksum grid along "
                                 f"dim {d} (cuts {_show(c)}): its placement is not in the grid")
        out.append(range(i, j))
    return out


def _show(cuts: Sequence[int]) -> str:
    return str(list(cuts)) if len(cuts) <= 8 else f"[{cuts[0]}, {cuts[1]}, ..., {cuts[-1]}] ({len(cuts)})"


def _flat(counts: Sequence[int], at: Sequence[int]) -> int:
    index = 0
    for n, i in zip(counts, at):
        index = index * n + i
    return index


def cells_of(box: Box, grid_tensor: GridTensor) -> list[tuple[int, Box]]:
    """The cells ``box`` is made of, as ``(cell index, cell box)`` in row-major order (rule 4);
    an empty box has none. LayoutMismatch when ``box`` is outside the tensor or not on its grid."""
    ranges = _ranges(grid_tensor, box)
    counts, cuts = grid_tensor.counts, grid_tensor.cuts
    out = []
    for at in itertools.product(*ranges):
        cell = Box(tuple(c[i] for c, i in zip(cuts, at)), tuple(c[i + 1] for c, i in zip(cuts, at)))
        out.append((_flat(counts, at), cell))
    return out
