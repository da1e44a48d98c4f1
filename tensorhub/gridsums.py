"""Cell checksums: one xxh3-64 per grid cell a handle holds, the same in every placement.

Stage 2c of issue 24 (verification that survives resharding): holders hash on the server's
``HashCells`` and resharding readers check with it (:mod:`tensorhub.handle.reshard`,
:mod:`tensorhub.core.cells`). :mod:`tensorhub.core.grid` cuts every global tensor into cells so
that every box of every registered placement is whole cells. Here the bytes are hashed:

1. A cell's checksum is xxh3-64 (an unsigned int in ``[0, 2**64)``, as
   :func:`tensorhub.layout.checksum_unit`) of the cell's elements in row-major order within the
   cell: the bytes of ``global[cell].contiguous()``. So a holder and a reader of different
   placements get the same checksum for the same cell, and a reader can check every byte it
   received against checksums its holder computed, whatever the two layouts.
2. The bytes are read in place from the local tensor (CPU: zero copy). A piece is one
   C-contiguous block (:mod:`tensorhub.placement` rule 2) and its cells a sub-grid of it: the
   trailing dims the grid does not cut join every cell's contiguous run, so cells cut along dim
   0 only (a row split) are one hash call each. Cells cut along a later dim (a column split)
   are strided blocks: the piece is walked in memory order and each row's segment goes to its
   cell's streaming xxh3, never copied, reads kept sequential (measured in
   ``benchmarks/gridsums.py``). Non-CPU tensors are copied to the host one cell at a time
   (untested here: no GPU on the development machines).
3. Local tensors are given by name (the placement's local tensor names); each must be
   contiguous, of the placement's dtype and shape, else LayoutMismatch naming it (names the
   placement lacks are ignored). A box not on the grid is LayoutMismatch (refine the grid with
   the placement first: :meth:`~tensorhub.core.grid.Grid.refine`).
4. A cell a handle holds twice (tied embeddings: identical boxes) is hashed once by
   :func:`cell_checksums` (its first copy) and checked in every copy by :func:`verify_cells`.

Both functions are pure over the tensors' bytes and block only for the hashing; they are safe
to call from any thread while nothing writes the tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterator, Mapping, Sequence
from typing import Callable, NamedTuple, Optional

import torch
import xxhash

from tensorhub.core.grid import Grid, GridTensor, cells_of
from tensorhub.core.reshard import c_strides
from tensorhub.errors import LayoutMismatch
from tensorhub.layout import dtype_name
from tensorhub.placement import Box, LocalPlacement, Piece, Placement, itemsize

__all__ = ["CellKey", "CellMismatch", "cell_checksums", "verify_cells"]

CellKey = tuple[str, int]
"""(global tensor name, cell index in its :class:`~tensorhub.core.grid.GridTensor`)."""


class CellMismatch(NamedTuple):
    """A held cell whose bytes do not hash to the expected checksum (``expected`` None: no
    checksum was given for it). ``local`` names the local tensor holding the bad copy."""

    local: str
    tensor: str
    index: int
    box: Box
    got: int
    expected: Optional[int]


def cell_checksums(local_tensors: Mapping[str, torch.Tensor], placement: Placement,
                   grid: Grid) -> dict[CellKey, int]:
    """The checksum of every grid cell ``placement`` holds, read from ``local_tensors`` (rules 1
    to 4), keyed by (global tensor, cell index) in placement order. Raises LayoutMismatch for
    a tensor that does not match its local placement or a box off the grid."""
    out: dict[CellKey, int] = {}
    for local, piece, gt, mv in _pieces(local_tensors, placement, grid):
        cells = cells_of(piece.box, gt)
        if all((gt.name, index) in out for index, _ in cells):
            continue  # a tied copy: pieces of one handle are disjoint or identical
        for (index, _), digest in zip(cells, _piece_sums(mv, local, piece, cells)):
            out.setdefault((gt.name, index), digest)
    return out


def verify_cells(local_tensors: Mapping[str, torch.Tensor], placement: Placement, grid: Grid,
                 expected: Mapping[CellKey, int], names: Optional[Container[str]] = None,
                 only: Optional[Callable[[LocalPlacement, Piece, Box], bool]] = None) -> list[CellMismatch]:
    """Every held cell copy whose checksum differs from ``expected`` (or has none there), in
    placement order; empty when all agree. ``names``: only these local tensors (None: all);
    ``only(local, piece, cell box)``: only the cells it is true of (a piece with none is not
    hashed; the others' cells are hashed whole, compared only where it is true). Raises as
    :func:`cell_checksums`."""
    bad = []
    for local, piece, gt, mv in _pieces(local_tensors, placement, grid, names):
        cells = cells_of(piece.box, gt)
        if only is not None and not any(only(local, piece, cell) for _, cell in cells):
            continue
        for (index, cell), got in zip(cells, _piece_sums(mv, local, piece, cells)):
            if only is not None and not only(local, piece, cell):
                continue
            want = expected.get((gt.name, index))
            if got != want:
                bad.append(CellMismatch(local.name, gt.name, index, cell, got, want))
    return bad


def _pieces(local_tensors: Mapping[str, torch.Tensor], placement: Placement, grid: Grid,
            names: Optional[Container[str]] = None) -> Iterator[tuple[LocalPlacement, Piece, GridTensor, object]]:
    """(local placement, piece, its grid tensor, the local tensor's bytes) for every non-empty
    piece (of the local tensors in ``names``, None: all); the bytes are a flat memoryview (CPU)
    or a flat uint8 tensor (elsewhere)."""
    grids = grid.by_name()
    for local in placement.tensors:
        if names is not None and local.name not in names:
            continue
        t = local_tensors.get(local.name)
        _check_tensor(local, t)
        flat = t.reshape(-1).view(torch.uint8)
        mv = memoryview(flat.numpy()) if flat.device.type == "cpu" else flat
        for piece in local.pieces:
            if piece.box.empty:
                continue
            gt = grids.get(piece.tensor)
            if gt is None:
                raise LayoutMismatch(f"local tensor {local.name!r}: global tensor {piece.tensor!r} is not in the grid")
            yield local, piece, gt, mv


def _check_tensor(local: LocalPlacement, t: Optional[torch.Tensor]) -> None:
    where = f"local tensor {local.name!r}"
    if not isinstance(t, torch.Tensor):
        raise LayoutMismatch(f"{where}: not given (a torch.Tensor per local tensor of the placement)")
    if dtype_name(t.dtype) != local.dtype or tuple(t.shape) != local.shape:
        raise LayoutMismatch(f"{where}: {dtype_name(t.dtype)}{list(t.shape)} given, the placement says "
                             f"{local.dtype}{list(local.shape)}")
    if not t.is_contiguous():
        raise LayoutMismatch(f"{where}: not contiguous")


def _piece_sums(mv, local: LocalPlacement, piece: Piece, cells: Sequence[tuple[int, Box]]) -> list[int]:
    """xxh3-64 of each of ``cells`` (those of ``piece``, row-major, :func:`cells_of`), each over
    its bytes in row-major order, read from the piece's block (rule 2). The cells of a piece
    form a sub-grid; the trailing dims it does not cut join every cell's contiguous run. When
    only dim 0 is cut, each cell is one contiguous call; otherwise the block is walked in memory
    order, band by band, feeding each row's segment to its cell's streaming hash, so the reads
    stay sequential (a cell hashed alone, row by row at the tensor's stride, ran 0.6x as fast:
    benchmarks/RESULTS.md)."""
    if not isinstance(mv, memoryview):  # not in host memory: copy each cell over, then one call
        return [xxhash.xxh3_64_intdigest(_device_cell(mv, local, piece, cell).cpu().numpy()) for _, cell in cells]
    e = itemsize(local.dtype)
    box, base = piece.box, local.offset_of(piece)
    shape = box.shape
    segs = [sorted({(cell.start[d] - box.start[d], cell.stop[d] - box.start[d]) for _, cell in cells})
            for d in range(box.ndim)]
    c = box.ndim - 1
    while c > 0 and len(segs[c]) == 1:
        c -= 1
    strides = c_strides(shape, e)
    if c <= 0:  # cut along dim 0 at most: each cell is contiguous
        run, spans = (strides[0], segs[0]) if shape else (e, [(0, 1)])
        return [xxhash.xxh3_64_intdigest(mv[base + a * run:base + b * run]) for a, b in spans]
    hashers = [xxhash.xxh3_64() for _ in cells]
    trail = strides[c]
    row_segs = [slice(a * trail, b * trail) for a, b in segs[c]]
    m = len(row_segs)
    for band in itertools.product(*(range(len(segs[d])) for d in range(c))):
        first = 0
        for d, i in enumerate(band):
            first = first * len(segs[d]) + i
        updates = [h.update for h in hashers[first * m:first * m + m]]
        span = strides[c - 1]
        lo, hi = segs[c - 1][band[c - 1]]
        for outer in itertools.product(*(range(*segs[d][band[d]]) for d in range(c - 1))):
            off = base + sum(i * st for i, st in zip(outer, strides)) + lo * span
            for _ in range(hi - lo):  # one row of the band: each cell's segment, in memory order
                row = mv[off:off + span]
                for update, cut in zip(updates, row_segs):
                    update(row[cut])
                off += span
    return [h.intdigest() for h in hashers]


def _device_cell(flat: torch.Tensor, local: LocalPlacement, piece: Piece, cell: Box) -> torch.Tensor:
    """The cell's bytes as a contiguous uint8 tensor on the local tensor's device."""
    e = itemsize(local.dtype)
    start = local.offset_of(piece)
    block = flat[start:start + piece.box.numel * e].view(piece.box.shape + (e,))
    index = tuple(slice(a - b, z - b) for a, z, b in zip(cell.start, cell.stop, piece.box.start))
    return block[index].contiguous().reshape(-1)
