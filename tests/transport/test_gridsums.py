"""Cell checksums (issue 24, stage 2c): the holder's and the reader's agree on every cell,
whatever the two placements, and one flipped byte fails exactly the cell that holds it.

    holder replica (placements H) --apply_plan--> reader replica (placements R)
    grid = grid_of(H + R); holder: cell_checksums(H's tensors); reader: verify_cells(R's tensors)

The random placement pairs are those of ``tests/core/test_reshard.py`` (row, column, uneven and
DTensor splits, fused qkv and gate_up, stacked experts, tied copies, scalars); small CPU tensors.
A failure prints its seed.
"""

from __future__ import annotations

import random

import pytest

from tensorhub import placement as P
from tensorhub.core import grid as G
from tensorhub.core import reshard as R
from tensorhub.errors import LayoutMismatch
from tensorhub.placement import Box, GlobalTensor

torch = pytest.importorskip("torch")
xxhash = pytest.importorskip("xxhash")

from tensorhub.gridsums import CellMismatch, cell_checksums, verify_cells  # noqa: E402
from tests.core.test_reshard import _random_tensor, materialize, seeded_pair  # noqa: E402

W = GlobalTensor("w", "bfloat16", (8, 12))
Q = GlobalTensor("q", "float32", (8, 4))
K = GlobalTensor("k", "float32", (4, 4))
SCHEMA = P.Schema.of([W, Q, K])


def reference(globals_: dict, name: str, cell: Box) -> int:
    """xxh3-64 of the cell cut out of the global tensor and made contiguous: the definition."""
    t = globals_[name][tuple(slice(a, b) for a, b in zip(cell.start, cell.stop))].contiguous()
    return xxhash.xxh3_64_intdigest(t.reshape(-1).view(torch.uint8).numpy())


def held(placement: P.Placement, globals_: dict) -> dict:
    return {t.name: materialize(t, globals_) for t in placement.tensors}


def test_a_row_holder_and_a_column_reader_agree_on_the_cells_they_share():
    """holder: w rows TP=2 (cells whole rows: one hash each); reader: w columns TP=4 (strided
    cells, hashed row by row); both equal the global cell's own hash."""
    gen = torch.Generator().manual_seed(0)
    globals_ = {"w": _random_tensor(W, gen)}
    holders = [P.Placement.build([P.split(W, 0, r, 2)], SCHEMA) for r in range(2)]
    readers = [P.Placement.build([P.split(W, 1, r, 4)], SCHEMA) for r in range(4)]
    grid = G.grid_of(holders + readers)
    assert grid["w"].counts == (2, 4)
    sums = {}
    for h in holders:
        sums.update(cell_checksums(held(h, globals_), h, grid))
    assert sums == {("w", i): reference(globals_, "w", grid["w"].cell(i)) for i in range(8)}
    for r in readers:
        mine = cell_checksums(held(r, globals_), r, grid)
        assert len(mine) == 2 and all(sums[k] == v for k, v in mine.items())
        assert verify_cells(held(r, globals_), r, grid, sums) == []


def test_fused_qkv_and_stacked_experts_hash_each_part_as_its_global_cells():
    gen = torch.Generator().manual_seed(1)
    globals_ = {g.name: _random_tensor(g, gen) for g in SCHEMA.tensors}
    fused = [P.Placement.build([P.fused("qkv", [(Q, 0, r, 2), (K, 0, r, 2)])], SCHEMA) for r in range(2)]
    half = Box((4, 2), (8, 4))  # rows 4:8 of q, 0:4 of k; right column half of both: strided cells
    stacked = P.Placement.build([P.stacked("experts", [(Q, half), (K, Box((0, 2), (4, 4)))])], SCHEMA)
    grid = G.grid_of(fused + [stacked])
    for pl in fused + [stacked]:
        for (name, i), v in cell_checksums(held(pl, globals_), pl, grid).items():
            assert v == reference(globals_, name, grid[name].cell(i)), (pl.tensors[0].name, name, i)


def test_a_tied_copy_is_hashed_once_and_checked_in_both_copies():
    gen = torch.Generator().manual_seed(2)
    globals_ = {"q": _random_tensor(Q, gen)}
    pl = P.Placement.build([P.whole(Q), P.whole(Q, name="q_tied")], SCHEMA)
    grid = G.grid_of([pl])
    tensors = held(pl, globals_)
    sums = cell_checksums(tensors, pl, grid)
    assert list(sums) == [("q", 0)]
    tensors["q_tied"].view(-1).view(torch.uint8)[5] ^= 1
    assert [(m.local, m.tensor, m.index) for m in verify_cells(tensors, pl, grid, sums)] == [("q_tied", "q", 0)]
    missing = verify_cells(tensors, pl, grid, {})
    assert [(m.local, m.expected) for m in missing] == [("q", None), ("q_tied", None)]
    assert isinstance(missing[0], CellMismatch) and missing[0].box == Q.full()


def test_bad_inputs_are_refused_naming_the_local_tensor():
    pl = P.Placement.build([P.split(W, 1, 0, 2)], SCHEMA)
    grid = G.grid_of([pl])
    t = torch.zeros(8, 6, dtype=torch.bfloat16)
    with pytest.raises(LayoutMismatch, match="'w': not given"):
        cell_checksums({}, pl, grid)
    with pytest.raises(LayoutMismatch, match=r"'w': float32\[8, 6\] given, the placement says bfloat16\[8, 6\]"):
        cell_checksums({"w": t.float()}, pl, grid)
    with pytest.raises(LayoutMismatch, match="'w': not contiguous"):
        cell_checksums({"w": torch.zeros(6, 8, dtype=torch.bfloat16).t()}, pl, grid)
    other = P.Placement.build([P.split(W, 1, 0, 3)], SCHEMA)
    with pytest.raises(LayoutMismatch, match="not on the checksum grid along dim 1"):
        cell_checksums({"w": torch.zeros(8, 4, dtype=torch.bfloat16)}, other, grid)
    with pytest.raises(LayoutMismatch, match="'q' is not in the grid"):
        cell_checksums({"q": torch.zeros(8, 4)}, P.Placement.build([P.whole(Q)], SCHEMA), grid)


# --------------------------------------------------------------------------- random placement pairs


def _flip_cell(reader: P.Placement, grid: G.Grid, name: str, offset: int) -> tuple[str, str, int]:
    """(local, global tensor, cell index) of the byte at ``offset`` of local tensor ``name``."""
    local = reader.local(name)
    e = P.itemsize(local.dtype)
    for piece in local.pieces:
        start = local.offset_of(piece)
        if start <= offset < start + piece.box.numel * e:
            at, rest = [], (offset - start) // e
            for size in reversed(piece.box.shape):
                rest, i = divmod(rest, size)
                at.append(i)
            point = [a + i for a, i in zip(piece.box.start, reversed(at))]
            return name, piece.tensor, grid[piece.tensor].cell_at(point)
    raise AssertionError((name, offset))


def _run_seed(seed: int) -> int:
    globals_, holders, readers = seeded_pair(seed)
    rng = random.Random(-seed - 1)  # where the bits flip
    grid = G.grid_of(holders + readers)
    holder_tensors = [held(h, globals_) for h in holders]
    sums: dict = {}
    for h, tensors in zip(holders, holder_tensors):
        for key, v in cell_checksums(tensors, h, grid).items():
            assert sums.setdefault(key, v) == v, key  # a replicated cell hashes alike on every shard
    assert sums == {(t.name, i): reference(globals_, t.name, t.cell(i))
                    for t in grid.tensors for i in range(t.cell_count)}
    flips = 0
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8).numpy()  # noqa: E731
    for r, reader in enumerate(readers):
        tensors = {t.name: torch.full(t.shape, 0, dtype=getattr(torch, t.dtype)) for t in reader.tensors}
        plan = R.plan_reshard(reader, holders, spread=r)
        R.apply_plan(plan, {n: as_bytes(t) for n, t in tensors.items()},
                     [{n: as_bytes(t) for n, t in ht.items()} for ht in holder_tensors])
        mine = cell_checksums(tensors, reader, grid)
        assert all(sums[k] == v for k, v in mine.items())
        assert verify_cells(tensors, reader, grid, sums) == []
        for t in reader.tensors:
            if not t.nbytes:
                continue
            offset = rng.randrange(t.nbytes)
            flat = tensors[t.name].reshape(-1).view(torch.uint8)
            mask = 1 << rng.randrange(8)
            flat[offset] ^= mask
            bad = verify_cells(tensors, reader, grid, sums)
            assert [(m.local, m.tensor, m.index) for m in bad] == [_flip_cell(reader, grid, t.name, offset)], \
                (t.name, offset)
            flat[offset] ^= mask
            flips += 1
        assert verify_cells(tensors, reader, grid, sums) == []
    return flips


@pytest.mark.parametrize("block", range(4))
def test_random_placement_pairs_agree_on_every_cell_and_a_flip_fails_exactly_its_cell(block):
    """80 seeded holder/reader replica pairs: holder cell checksums equal the global cells'
    own; each reader, filled by apply_plan, verifies clean; a flipped bit in any of its local
    tensors fails exactly the cell (and copy) that holds it."""
    for seed in range(block, 80, 4):
        try:
            _run_seed(seed)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e


def _device_case():
    """holder w rows TP=2, readers columns TP=4 and a stacked 3-D piece: strided and contiguous cells."""
    gen = torch.Generator().manual_seed(3)
    globals_ = {g.name: _random_tensor(g, gen) for g in SCHEMA.tensors}
    pls = [P.Placement.build([P.split(W, 0, r, 2), P.fused("qk", [(Q, 0, r, 2), (K, 0, r, 2)])], SCHEMA)
           for r in range(2)]
    pls += [P.Placement.build([P.split(W, 1, r, 4)], SCHEMA) for r in range(4)]
    pls.append(P.Placement.build([P.stacked("experts", [(Q, Box((4, 2), (8, 4))), (K, Box((0, 2), (4, 4)))])],
                                 SCHEMA))
    return globals_, pls, G.grid_of(pls)


def test_the_copy_per_cell_path_for_device_memory_gives_the_in_place_checksums():
    """The branch for tensors not in host memory (each cell copied over), driven on CPU with a
    flat uint8 tensor in place of the host memoryview: the same checksums as in place."""
    from tensorhub import gridsums
    from tensorhub.core.grid import cells_of

    globals_, pls, grid = _device_case()
    for pl in pls:
        for local in pl.tensors:
            t = materialize(local, globals_)
            flat = t.reshape(-1).view(torch.uint8)
            for piece in local.pieces:
                cells = cells_of(piece.box, grid[piece.tensor])
                assert gridsums._piece_sums(flat, local, piece, cells) == \
                    gridsums._piece_sums(memoryview(flat.numpy()), local, piece, cells), (local.name, piece.tensor)


@pytest.mark.gpu
def test_cuda_tensors_give_the_same_checksums_as_host_ones():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    globals_, pls, grid = _device_case()
    for pl in pls:
        host = held(pl, globals_)
        device = {n: t.cuda() for n, t in host.items()}
        assert cell_checksums(device, pl, grid) == cell_checksums(host, pl, grid)
        assert verify_cells(device, pl, grid, cell_checksums(host, pl, grid)) == []
