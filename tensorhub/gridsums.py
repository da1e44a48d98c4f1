"""Cell checksums: one xxh3-64 per grid cell a handle holds, the same in every placement.

Stage 2c of issue 24 (verification that survives resharding); not wired into the handle, the
server or the transport yet. :mod:`tensorhub.core.grid` cuts every global tensor into cells so
that every box of every registered placement is whole cells. Here the bytes are hashed:

1. A cell's checksum is xxh3-64 (an unsigned int in ``[0, 2**64)``, as
   :func:`tensorhub.layout.checksum_unit`) of the cell's elements in row-major order within the
   cell: the bytes of ``global[cell].contiguous()``. So a holder and a reader of different
   placements get the same checksum for the same cell, and a reader can check every byte it
   received against checksums its holder computed, whatever the two layouts.
2. The bytes are read in place from the local tensor (CPU: zero copy). A cell inside a piece is
   a block of the piece's C-contiguous block (:mod:`tensorhub.placement` rule 2): the innermost
   dims the cell spans whole join one contiguous run, so a cell of whole rows (a row split) is
   one hash call, and a column cell is hashed run by run with a streaming xxh3 (one update per
   row of the cell), never copied. Non-CPU tensors are copied to the host one cell at a time
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
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple, Optional

import torch
import xxhash

from tensorhub.core.grid import Grid, GridTensor, cells_of
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
        for index, cell in cells_of(piece.box, gt):
            if (gt.name, index) not in out:
                out[(gt.name, index)] = _hash_cell(mv, local, piece, cell)
    return out


def verify_cells(local_tensors: Mapping[str, torch.Tensor], placement: Placement, grid: Grid,
                 expected: Mapping[CellKey, int]) -> list[CellMismatch]:
    """Every held cell copy whose checksum differs from ``expected`` (or has none there), in
    placement order; empty when all agree. Raises as :func:`cell_checksums`."""
    bad = []
    for local, piece, gt, mv in _pieces(local_tensors, placement, grid):
        for index, cell in cells_of(piece.box, gt):
            got = _hash_cell(mv, local, piece, cell)
            want = expected.get((gt.name, index))
            if got != want:
                bad.append(CellMismatch(local.name, gt.name, index, cell, got, want))
    return bad


def _pieces(local_tensors: Mapping[str, torch.Tensor], placement: Placement,
            grid: Grid) -> Iterator[tuple[LocalPlacement, Piece, GridTensor, object]]:
    """(local placement, piece, its grid tensor, the local tensor's bytes) for every non-empty
    piece; the bytes are a flat memoryview (CPU) or a flat uint8 tensor (elsewhere)."""
    grids = grid.by_name()
    for local in placement.tensors:
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


def _strides(shape: Sequence[int], e: int) -> list[int]:
    """C-order byte strides of a block of ``shape``."""
    out, acc = [], e
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return out[::-1]


def _hash_cell(mv, local: LocalPlacement, piece: Piece, cell: Box) -> int:
    """xxh3-64 of ``cell``'s bytes in row-major order, read from the piece's block (rule 2)."""
    e = itemsize(local.dtype)
    block, cs = piece.box.shape, cell.shape
    strides = _strides(block, e)
    base = local.offset_of(piece) + sum((c - b) * st for c, b, st in zip(cell.start, piece.box.start, strides))
    n = len(cs)
    c = n - 1
    while c > 0 and cs[c] == block[c]:  # trailing dims spanned whole join the contiguous run
        c -= 1
    run = math.prod(cs[max(c, 0):]) * e
    if not isinstance(mv, memoryview):  # not in host memory: copy this cell over, then one call
        return xxhash.xxh3_64_intdigest(_device_cell(mv, local, piece, cell).cpu().numpy())
    if c <= 0:
        return xxhash.xxh3_64_intdigest(mv[base:base + run])
    h = xxhash.xxh3_64()
    step, count = strides[c - 1], cs[c - 1]
    for outer in itertools.product(*(range(k) for k in cs[:c - 1])):
        off = base + sum(i * st for i, st in zip(outer, strides))
        for _ in range(count):
            h.update(mv[off:off + run])
            off += step
    return h.intdigest()


def _device_cell(flat: torch.Tensor, local: LocalPlacement, piece: Piece, cell: Box) -> torch.Tensor:
    """The cell's bytes as a contiguous uint8 tensor on the local tensor's device."""
    e = itemsize(local.dtype)
    start = local.offset_of(piece)
    block = flat[start:start + piece.box.numel * e].view(piece.box.shape + (e,))
    index = tuple(slice(a - b, z - b) for a, z, b in zip(cell.start, cell.stop, piece.box.start))
    return block[index].contiguous().reshape(-1)
