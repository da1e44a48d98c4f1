"""Checksum grids (issue 24, stage 2c): every box of every given placement is whole cells.

Pure: no torch. The byte-level checks (a cell's checksum is the same in every placement that
holds it) are in ``tests/transport/test_gridsums.py``.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from tensorhub import placement as P
from tensorhub.core import grid as G
from tensorhub.errors import LayoutMismatch, OutOfBounds
from tensorhub.placement import Box, GlobalTensor

W = GlobalTensor("w", "float32", (8, 6))
Q = GlobalTensor("q", "bfloat16", (8, 4))
K = GlobalTensor("k", "bfloat16", (4, 4))
NORM = GlobalTensor("norm", "float32", (4,))
SCALE = GlobalTensor("scale", "float32", ())
EMPTY = GlobalTensor("empty", "int8", (0, 3))
SCHEMA = P.Schema.of([W, Q, K, NORM, SCALE, EMPTY])


def B(*ranges):
    return Box(tuple(a for a, _ in ranges), tuple(b for _, b in ranges))


def pl(*locals_):
    return P.Placement.build(locals_, SCHEMA)


def test_rows_tp2_and_columns_tp3_cut_w_into_2_by_3_cells():
    """holder: w rows TP=2; reader: w columns TP=3 -> cuts [0, 4, 8] x [0, 2, 4, 6]."""
    g = G.grid_of([pl(P.split(W, 0, r, 2)) for r in range(2)] + [pl(P.split(W, 1, r, 3)) for r in range(3)])
    gt = g["w"]
    assert gt.cuts == ((0, 4, 8), (0, 2, 4, 6)) and gt.counts == (2, 3) and g.cell_count == 6
    assert gt.cell(4) == B((4, 8), (2, 4)) and gt.index_of(B((4, 8), (2, 4))) == 4
    assert gt.cell_at((5, 3)) == 4
    # a holder's row half is 3 cells, a reader's column third 2, in row-major order
    assert G.cells_of(B((4, 8), (0, 6)), gt) == [(3, B((4, 8), (0, 2))), (4, B((4, 8), (2, 4))), (5, B((4, 8), (4, 6)))]
    assert [i for i, _ in G.cells_of(B((0, 8), (2, 4)), gt)] == [1, 4]


def test_fused_qkv_cuts_each_part_separately_and_a_replicated_norm_is_one_cell():
    """fused qkv_proj TP=2 (q rows 0:4 | k rows 0:2) + norm whole -> q, k two row cells, norm one."""
    g = G.grid_of([pl(P.fused("qkv", [(Q, 0, r, 2), (K, 0, r, 2)]), P.whole(NORM)) for r in range(2)])
    assert [t.name for t in g.tensors] == ["k", "norm", "q"]
    assert g["q"].cuts == ((0, 4, 8), (0, 4)) and g["k"].cuts == ((0, 2, 4), (0, 4))
    assert g["norm"].cell_count == 1 and g.cell_count == 5


def test_scalars_and_empty_tensors():
    """a 0-d tensor is the one cell 0; a tensor with a dim of size 0 has no cells."""
    g = G.grid_of([pl(P.whole(SCALE), P.whole(EMPTY))])
    assert g["scale"].cell_count == 1 and G.cells_of(Box((), ()), g["scale"]) == [(0, Box((), ()))]
    assert g["empty"].cuts == ((0,), (0, 3)) and g["empty"].cell_count == 0
    assert G.cells_of(B((0, 0), (0, 3)), g["empty"]) == []


def test_refine_adds_a_placement_and_the_old_cells_are_unions_of_the_new():
    rows = G.grid_of([pl(P.split(W, 0, r, 2)) for r in range(2)])
    finer = rows.refine(pl(P.split_sizes(W, 1, [1, 5], 0)))
    assert finer["w"].cuts == ((0, 4, 8), (0, 1, 6)) and rows["w"].cuts == ((0, 4, 8), (0, 6))
    for i in range(rows["w"].cell_count):
        parts = G.cells_of(rows["w"].cell(i), finer["w"])
        assert sum(b.numel for _, b in parts) == rows["w"].cell(i).numel
    assert rows.refine(pl(P.split(W, 0, 1, 2))) == rows  # nothing new, nothing changes


def test_grid_of_is_order_independent_and_its_digest_crosses_a_process():
    ps = [pl(P.split(W, 0, r, 2)) for r in range(2)] + [pl(P.split(W, 1, 0, 3), P.whole(Q))]
    g = G.grid_of(ps)
    assert G.grid_of(reversed(ps)) == g and G.grid_of(reversed(ps)).digest() == g.digest()
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(g), type=G.Grid)
    assert back == g and back.digest() == g.digest()
    assert G.grid_of(ps[:2]).digest() != g.digest()


def test_a_box_off_the_grid_is_refused_naming_tensor_and_dim():
    g = G.grid_of([pl(P.split(W, 0, r, 2)) for r in range(2)])
    with pytest.raises(LayoutMismatch, match=r"'w': box \[0:8, 0:3\] is not on the checksum grid along dim 1"):
        G.cells_of(B((0, 8), (0, 3)), g["w"])
    with pytest.raises(LayoutMismatch, match="outside shape"):
        G.cells_of(B((0, 9), (0, 6)), g["w"])
    with pytest.raises(LayoutMismatch, match="not one cell"):
        g["w"].index_of(B((0, 8), (0, 6)))


def test_disagreeing_schemas_and_bad_placements_are_refused_and_change_nothing():
    g = G.grid_of([pl(P.whole(W))])
    w16 = GlobalTensor("w", "float32", (16, 6))
    with pytest.raises(LayoutMismatch, match=r"'w': shape \[16, 6\] here, \[8, 6\] elsewhere"):
        g.refine(P.Placement.build([P.whole(w16)], [w16]))
    bad = P.Placement((W,), (P.LocalPlacement("w", "float32", (4, 6), (P.Piece("w", B((6, 10), (0, 6)), 0),)),))
    with pytest.raises(LayoutMismatch, match="outside global tensor 'w'"):
        g.refine(bad)
    assert g == G.grid_of([pl(P.whole(W))])


def test_a_grid_past_cells_max_is_refused_with_out_of_bounds(monkeypatch):
    monkeypatch.setattr(G, "CELLS_MAX", 3)
    rows = G.grid_of([pl(P.split(W, 0, r, 2)) for r in range(2)])
    with pytest.raises(OutOfBounds, match=r"4 cells, more than CELLS_MAX = 3 \(most in 'w'"):
        rows.refine(pl(P.split(W, 1, 0, 3)))


def test_random_cuts_every_box_is_whole_cells_and_cells_tile_the_tensor():
    """40 seeds: random uneven row and column splits of w into 1-4 parts, several placements;
    every box of every placement is the disjoint union of its cells, and the cells tile w."""
    for seed in range(40):
        rng = random.Random(seed)
        ps = []
        for _ in range(rng.randint(1, 4)):
            dim, n = rng.randrange(2), rng.randint(1, 4)
            points = sorted(rng.randint(0, W.shape[dim]) for _ in range(n - 1))
            sizes = [b - a for a, b in zip([0] + points, points + [W.shape[dim]])]
            ps += [pl(P.split_sizes(W, dim, sizes, r)) for r in range(n)]
        gt = G.grid_of(ps)["w"]
        seen = set()
        for p in ps:
            box = p.tensors[0].pieces[0].box
            cells = G.cells_of(box, gt)
            assert sum(c.numel for _, c in cells) == box.numel, seed
            assert all(box.contains(c) and gt.cell(i) == c for i, c in cells), seed
            seen.update(i for i, _ in cells)
        assert seen == set(range(gt.cell_count)), seed


# --------------------------------------------------------------------------- a real model's size


def llama70b(tp_degrees=(1, 2, 4, 8), fsdp_shards=0):
    """The Llama-70B-shaped schema and vLLM-style placements for every rank of each TP degree
    (fused qkv_proj and gate_up_proj split by rows, o_proj and down_proj by columns, embedding
    and lm_head by vocabulary rows, norms whole), plus an FSDP-like trainer cutting every tensor
    by rows into ``fsdp_shards`` (none when 0)."""
    layers, h, kv, inter, vocab = 80, 8192, 1024, 28672, 128256
    ts = [GlobalTensor("embed", "bfloat16", (vocab, h)), GlobalTensor("lm_head", "bfloat16", (vocab, h)),
          GlobalTensor("norm", "bfloat16", (h,))]
    for i in range(layers):
        ts += [GlobalTensor(f"{i}.{n}", "bfloat16", s) for n, s in [
            ("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h)), ("gate", (inter, h)),
            ("up", (inter, h)), ("down", (h, inter)), ("ln1", (h,)), ("ln2", (h,))]]
    schema = P.Schema.of(ts)
    g = schema.by_name()
    out = []
    for tp in tp_degrees:
        for r in range(tp):
            locals_ = [P.split(g["embed"], 0, r, tp), P.split(g["lm_head"], 0, r, tp), P.whole(g["norm"])]
            for i in range(layers):
                t = lambda n: g[f"{i}.{n}"]  # noqa: E731
                locals_ += [
                    P.fused(f"{i}.qkv_proj", [(t("q"), 0, r, tp), (t("k"), 0, r, tp), (t("v"), 0, r, tp)]),
                    P.split(t("o"), 1, r, tp, name=f"{i}.o_proj"),
                    P.fused(f"{i}.gate_up_proj", [(t("gate"), 0, r, tp), (t("up"), 0, r, tp)]),
                    P.split(t("down"), 1, r, tp, name=f"{i}.down_proj"),
                    P.whole(t("ln1")), P.whole(t("ln2"))]
            out.append(P.Placement.build(locals_, schema))
    for r in range(fsdp_shards):
        out.append(P.Placement.build([P.split(t, 0, r, fsdp_shards) for t in schema.tensors], schema))
    return schema, out


def test_a_llama_70b_shaped_grid_with_tp_1_2_4_8_is_far_inside_cells_max():
    """The module docstring's numbers: 723 tensors; TP 1/2/4/8 -> 4,657 cells (8 per split
    tensor, 1 per norm); with an 8-shard row-split trainer too -> 14,744 (o and down become 8x8, norms 8)."""
    schema, vllm = llama70b()
    assert len(schema.tensors) == 723
    grid = G.grid_of(vllm)
    assert grid.cell_count == 4657
    assert grid["0.o"].counts == (1, 8) and grid["0.q"].counts == (8, 1) and grid["0.ln1"].counts == (1,)
    _, trainer = llama70b(tp_degrees=(), fsdp_shards=8)
    both = grid.refine(trainer[0])
    for t in trainer[1:]:
        both = both.refine(t)
    assert both.cell_count == 14744 and both["0.o"].counts == (8, 8)
    assert both.cell_count * 70 < G.CELLS_MAX
