"""The resharding planner (issue 24, stage 1): table tests of the runs it plans for the layouts
real stacks use, and a seeded property check that executes plans byte by byte.

The property check builds random small global tensors with torch (CPU), cuts them into holder
local tensors per a random holder replica's placements, fills a reader's local tensors with
garbage, runs :func:`tensorhub.core.reshard.apply_plan` and compares every reader tensor with
the slices of the global tensors it should hold; it also counts that each reader byte is written
exactly once. A failure prints its seed: ``pytest tests/core/test_reshard.py -k 'seed and 17'``.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from tensorhub import placement as P
from tensorhub.core import reshard as R
from tensorhub.core.reshard import Gap, Run
from tensorhub.errors import LayoutMismatch
from tensorhub.placement import Box, GlobalTensor

torch = pytest.importorskip("torch")

Q = GlobalTensor("q", "bfloat16", (8, 4))
K = GlobalTensor("k", "bfloat16", (4, 4))
V = GlobalTensor("v", "bfloat16", (4, 4))
W = GlobalTensor("w", "float32", (8, 6))
NORM = GlobalTensor("norm", "float32", (4,))
X3 = GlobalTensor("x3", "int8", (2, 3, 4))
SCHEMA = P.Schema.of([Q, K, V, W, NORM, X3])


def B(*ranges):
    return Box(tuple(a for a, _ in ranges), tuple(b for _, b in ranges))


def replica(*shards):
    """One placement per shard, each a list of local tensors."""
    return [P.Placement.build(locals_, SCHEMA) for locals_ in shards]


def tp(g, dim, n, name=None):
    """A replica of ``n`` shards, shard r holding part r of g along dim."""
    return replica(*[[P.split(g, dim, r, n, name)] for r in range(n)])


# --------------------------------------------------------------------------- tables

PLANS = [
    # id, reader placement, holder replica, spread, expected runs
    ("identical: trainer whole -> reader whole is one whole-tensor run",
     P.Placement.build([P.whole(W)], SCHEMA), tp(W, 0, 1), 0,
     [Run("w", 0, 0, "w", 0, 192)]),
    ("trainer TP=2 rows -> reader TP=4 rows (rank 1): one contiguous run",
     P.Placement.build([P.split(W, 0, 1, 4)], SCHEMA), tp(W, 0, 2), 0,
     [Run("w", 0, 0, "w", 48, 48)]),
    ("trainer TP=2 rows -> reader whole: one run per holder shard",
     P.Placement.build([P.whole(W)], SCHEMA), tp(W, 0, 2), 0,
     [Run("w", 0, 0, "w", 0, 96), Run("w", 96, 1, "w", 0, 96)]),
    ("trainer TP=2 rows -> reader TP=3 columns (rank 1): a strided run per holder, count = rows",
     P.Placement.build([P.split(W, 1, 1, 3)], SCHEMA), tp(W, 0, 2), 0,
     [Run("w", 0, 0, "w", 8, 8, 4, 8, 24), Run("w", 32, 1, "w", 8, 8, 4, 8, 24)]),
    ("trainer TP=2 columns -> reader whole: two strided runs interleaved",
     P.Placement.build([P.whole(W)], SCHEMA), tp(W, 1, 2), 0,
     [Run("w", 0, 0, "w", 0, 12, 8, 24, 12), Run("w", 12, 1, "w", 0, 12, 8, 24, 12)]),
    ("trainer q, k, v whole (FSDP gathered) -> reader TP=2 fused qkv_proj (rank 1): one run per piece",
     P.Placement.build([P.fused("qkv_proj", [(Q, 0, 1, 2), (K, 0, 1, 2), (V, 0, 1, 2)])], SCHEMA),
     replica([P.whole(Q), P.whole(K), P.whole(V)]), 0,
     [Run("qkv_proj", 0, 0, "q", 32, 32), Run("qkv_proj", 32, 0, "k", 16, 16), Run("qkv_proj", 48, 0, "v", 16, 16)]),
    ("trainer TP=2 fused qkv -> reader TP=2 fused qkv, same rank: one whole-tensor run",
     P.Placement.build([P.fused("qkv_proj", [(Q, 0, 1, 2), (K, 0, 1, 2), (V, 0, 1, 2)])], SCHEMA),
     replica(*[[P.fused("qkv_proj", [(Q, 0, r, 2), (K, 0, r, 2), (V, 0, r, 2)])] for r in range(2)]), 0,
     [Run("qkv_proj", 0, 1, "qkv_proj", 0, 64)]),
    ("reader fused [q rows 0:4, q rows 4:8] from q whole: adjacent runs merge into one",
     P.Placement.build([P.concat("qq", [(Q, B((0, 4), (0, 4))), (Q, B((4, 8), (0, 4)))])], SCHEMA),
     replica([P.whole(Q)]), 0,
     [Run("qq", 0, 0, "q", 0, 64)]),
    ("norm replicated on 2 holder shards, reader spread 0 reads shard 0",
     P.Placement.build([P.whole(NORM)], SCHEMA), replica([P.whole(NORM)], [P.whole(NORM)]), 0,
     [Run("norm", 0, 0, "norm", 0, 16)]),
    ("norm replicated on 2 holder shards, reader spread 1 reads shard 1",
     P.Placement.build([P.whole(NORM)], SCHEMA), replica([P.whole(NORM)], [P.whole(NORM)]), 1,
     [Run("norm", 0, 1, "norm", 0, 16)]),
    ("3-D x3 [2, 3, 4] split on dim 2 -> whole: the outer dims join the count (2 * 3)",
     P.Placement.build([P.whole(X3)], SCHEMA), tp(X3, 2, 2), 0,
     [Run("x3", 0, 0, "x3", 0, 2, 6, 4, 2), Run("x3", 2, 1, "x3", 0, 2, 6, 4, 2)]),
    ("3-D x3 whole -> dims 1 and 2 cut: the outer dim gives one strided run per index",
     P.Placement.build([P.concat("x3", [(X3, B((0, 2), (1, 3), (2, 4)))])], SCHEMA), tp(X3, 0, 1), 0,
     [Run("x3", 0, 0, "x3", 6, 2, 2, 2, 4), Run("x3", 4, 0, "x3", 18, 2, 2, 2, 4)]),
    ("holder with q rows 0:4 split unevenly in two shards 1+3 and q 4:8 whole",
     P.Placement.build([P.whole(Q)], SCHEMA),
     replica([P.split_sizes(Q, 0, [1, 3, 4], 0)], [P.split_sizes(Q, 0, [1, 3, 4], 1)],
             [P.split_sizes(Q, 0, [1, 3, 4], 2)]), 0,
     [Run("q", 0, 0, "q", 0, 8), Run("q", 8, 1, "q", 0, 24), Run("q", 32, 2, "q", 0, 32)]),
]


@pytest.mark.parametrize("reader, holders, spread, runs", [p[1:] for p in PLANS], ids=[p[0] for p in PLANS])
def test_plan_table(reader, holders, spread, runs):
    plan = R.plan_reshard(reader, holders, spread=spread)
    assert list(plan.runs) == runs
    assert plan.complete and R.plan_bytes(plan) == reader.nbytes


def test_a_reader_prefers_the_holder_piece_that_holds_its_whole_box():
    """holders: shard 0 q rows 0:4, shard 1 q whole -> reader q rows 2:6 reads shard 1 only."""
    holders = replica([P.split(Q, 0, 0, 2)], [P.whole(Q)])
    reader = P.Placement.build([P.split_sizes(Q, 0, [2, 4, 2], 1)], SCHEMA)
    assert R.plan_reshard(reader, holders).runs == (Run("q", 0, 1, "q", 16, 32),)
    assert R.shards_needed(reader, holders) == (1,)


@pytest.mark.parametrize("rank, shards", [(0, (0,)), (1, (0,)), (2, (1,)), (3, (1,))])
def test_shards_needed_trainer_tp2_rows_to_reader_tp4_rows(rank, shards):
    """trainer TP=2 rows -> reader TP=4 rows: reader r reads holder r // 2 only."""
    assert R.shards_needed(P.Placement.build([P.split(W, 0, rank, 4)], SCHEMA), tp(W, 0, 2)) == shards


def test_what_the_holder_replica_lacks_is_returned_not_raised():
    """holder: w rows 0:4 only; reader: w whole -> rows 4:8 missing, named."""
    plan = R.plan_reshard(P.Placement.build([P.whole(W)], SCHEMA), tp(W, 0, 2)[:1])
    assert plan.runs == (Run("w", 0, 0, "w", 0, 96),)
    assert plan.missing == (Gap("w", "w", B((4, 8), (0, 6))),)
    with pytest.raises(LayoutMismatch, match=r"w <- w \[4:8, 0:6\]"):
        plan.require_complete()


def test_schemas_that_disagree_are_refused_naming_the_tensor():
    """trainer holds q as float32: reading it into bf16 would be a conversion, not a reshard."""
    q32 = GlobalTensor("q", "float32", (8, 4))
    holder = P.Placement.build([P.whole(q32)], [q32])
    with pytest.raises(LayoutMismatch, match="'q': dtype float32 here, bfloat16 elsewhere.*not a reshard"):
        R.plan_reshard(P.Placement.build([P.whole(Q)], SCHEMA), [holder])


def test_a_bad_placement_is_refused_before_planning():
    bad = P.Placement((Q,), (P.LocalPlacement("q", "bfloat16", (4, 4), (P.Piece("q", B((6, 10), (0, 4)), 0),)),))
    with pytest.raises(LayoutMismatch, match="outside global tensor 'q'"):
        R.plan_reshard(bad, tp(Q, 0, 1))
    with pytest.raises(LayoutMismatch, match="outside global tensor 'q'"):
        R.plan_reshard(P.Placement.build([P.whole(Q)], SCHEMA), [bad])


def test_plan_for_some_tensors_only_and_it_crosses_a_process():
    reader = P.Placement.build([P.whole(W), P.whole(NORM)], SCHEMA)
    holders = replica([P.whole(W), P.whole(NORM)])
    plan = R.plan_reshard(reader, holders, tensors=["norm"])
    assert plan.runs == (Run("norm", 0, 0, "norm", 0, 16),)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=R.ReshardPlan) == plan


# --------------------------------------------------------------------------- executing plans

_DTYPES = ["float32", "bfloat16", "float16", "int8", "int64", "uint8"]


def _random_tensor(g: GlobalTensor, gen: torch.Generator) -> torch.Tensor:
    dtype = getattr(torch, g.dtype)
    if dtype.is_floating_point:
        return torch.randn(g.shape, generator=gen).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, g.shape, generator=gen).to(dtype)


def materialize(local: P.LocalPlacement, globals_: dict[str, torch.Tensor]) -> torch.Tensor:
    """What ``local`` should hold: its pieces' slices of the global tensors, rows concatenated."""
    parts = []
    for p in local.pieces:
        t = globals_[p.tensor][tuple(slice(a, b) for a, b in zip(p.box.start, p.box.stop))]
        parts.append(t.reshape((p.rows,) + local.shape[1:]) if local.shape else t)
    if not local.shape:
        return parts[0].clone()
    return torch.cat(parts).contiguous()


def _bytes(t: torch.Tensor):
    return t.reshape(-1).view(torch.uint8).numpy()


def execute(plan, reader: P.Placement, holders, globals_):
    """Run ``plan`` and check every reader tensor and that each reader byte was written once."""
    import numpy as np

    held = [{t.name: _bytes(materialize(t, globals_)) for t in h.tensors} for h in holders]
    out = {t.name: np.full(t.nbytes, 0xA5, dtype=np.uint8) for t in reader.tensors}
    assert R.apply_plan(plan, out, held) == reader.nbytes
    for t in reader.tensors:
        assert (out[t.name] == _bytes(materialize(t, globals_))).all(), t.name
        writes = np.zeros(t.nbytes, dtype=np.int64)
        for r in plan.runs_for(t.name):
            for i in range(r.count):
                writes[r.reader_offset + i * r.reader_stride:][:r.run_bytes] += 1
        assert (writes == 1).all(), t.name


def random_schema(rng: random.Random) -> dict:
    """A transformer-ish model: q, k, v (GQA), gate, up, an embedding, a norm, a 3-D tensor,
    a scalar and E experts; sizes 0..7, one dtype per family."""
    d = lambda lo=1: rng.randint(lo, 7)  # noqa: E731
    dt = lambda: rng.choice(_DTYPES)  # noqa: E731
    h, att, ffn = d(), dt(), dt()
    fam = {
        "attn": [GlobalTensor("q", att, (d(), h)), GlobalTensor("k", att, (d(0), h)), GlobalTensor("v", att, (d(), h))],
        "mlp": [GlobalTensor("gate", ffn, (d(), h)), GlobalTensor("up", ffn, (d(), h))],
        "emb": [GlobalTensor("emb", dt(), (d(), d()))],
        "norm": [GlobalTensor("norm", dt(), (d(),))],
        "x3": [GlobalTensor("x3", dt(), (d(), d(), d()))],
        "scalar": [GlobalTensor("scale", "float32", ())],
    }
    shape, edt = (d(), d()), dt()
    fam["experts"] = [GlobalTensor(f"experts.{e}", edt, shape) for e in range(rng.randint(1, 4))]
    return fam


def _cuts(rng: random.Random, size: int, n: int) -> list[int]:
    """Random sizes of n parts of ``size`` (some may be empty)."""
    points = sorted(rng.randint(0, size) for _ in range(n - 1))
    return [b - a for a, b in zip([0] + points, points + [size])]


def _boxes(rng: random.Random, g: GlobalTensor, n: int, kind: str) -> list[Box]:
    """Shard r's box of g for an n-shard replica cut as ``kind`` (together they cover g)."""
    if kind == "replicate" or not g.shape:
        return [g.full()] * n
    if kind == "dtensor":
        mesh = (2, n // 2) if n % 2 == 0 and n > 2 and rng.random() < 0.5 else (n,)
        places = [rng.choice(["R", f"S({rng.randrange(len(g.shape))})"]) for _ in mesh]
        coords = [(r // mesh[1], r % mesh[1]) if len(mesh) == 2 else (r,) for r in range(n)]
        return [P.dtensor_box(g.shape, mesh, c, places) for c in coords]
    dim = 0 if kind == "rows" else rng.randrange(len(g.shape))
    sizes = _cuts(rng, g.shape[dim], n)
    return [P._sizes_box(g, dim, sizes, r) for r in range(n)]


def random_replica(rng: random.Random, fam: dict, n: int) -> list[P.Placement]:
    """n placements that together cover every global tensor, built from the helpers' cases:
    whole, row/column/uneven splits, DTensor meshes, replication, fused qkv and gate_up,
    stacked experts, tied copies."""
    shards: list[list[P.LocalPlacement]] = [[] for _ in range(n)]
    kinds = ["replicate", "rows", "any", "dtensor"]
    for name in ("attn", "mlp"):
        gs = fam[name]
        if rng.random() < 0.5:  # fused, each part cut by rows
            parts = [_boxes(rng, g, n, rng.choice(["rows", "replicate"])) for g in gs]
            for r in range(n):
                shards[r].append(P.concat(name, [(g, parts[i][r]) for i, g in enumerate(gs)]))
        else:
            for g in gs:
                boxes = _boxes(rng, g, n, rng.choice(kinds))
                for r in range(n):
                    shards[r].append(P.concat(g.name, [(g, boxes[r])]))
    for name in ("emb", "norm", "x3", "scalar"):
        g = fam[name][0]
        boxes = _boxes(rng, g, n, rng.choice(kinds))
        for r in range(n):
            shards[r].append(P.concat(g.name, [(g, boxes[r])]))
            if name == "emb" and rng.random() < 0.3:
                shards[r].append(P.concat("lm_head", [(g, boxes[r])]))  # tied: an identical replica
    experts = fam["experts"]
    if rng.random() < 0.5:  # expert parallel: contiguous groups of experts, stacked, maybe TP-cut too
        groups = _cuts(rng, len(experts), n)
        kind = rng.choice(["replicate", "rows", "any"])
        first = 0
        for r, k in enumerate(groups):
            mine = experts[first:first + k]
            first += k
            if mine:
                cut = _boxes(rng, mine[0], 1, "replicate")[0] if kind == "replicate" else None
                shards[r].append(P.stacked("experts", [(e, cut or e.full()) for e in mine]))
    else:  # every shard stacks all experts, each expert cut the same way per shard
        boxes = _boxes(rng, experts[0], n, rng.choice(["rows", "any", "replicate"]))
        for r in range(n):
            shards[r].append(P.stacked("experts", [(e, boxes[r]) for e in experts]))
    schema = [g for gs in fam.values() for g in gs]
    out = [P.Placement.build(s, schema) for s in shards]
    assert P.coverage(out, schema) == {}
    return out


def seeded_pair(seed: int):
    """Seed ``seed``'s random global tensors and a holder and a reader replica (1-4 shards each)
    over them: ``(globals_, holders, readers)``. test_gridsums.py draws the same pairs."""
    rng = random.Random(seed)
    fam = random_schema(rng)
    gen = torch.Generator().manual_seed(seed)
    globals_ = {g.name: _random_tensor(g, gen) for gs in fam.values() for g in gs}
    holders = random_replica(rng, fam, rng.randint(1, 4))
    readers = random_replica(rng, fam, rng.randint(1, 4))
    return globals_, holders, readers


def _run_seed(seed: int) -> int:
    globals_, holders, readers = seeded_pair(seed)
    for r, reader in enumerate(readers):
        plan = R.plan_reshard(reader, holders, spread=r)
        assert plan.complete and R.plan_bytes(plan) == reader.nbytes
        execute(plan, reader, holders, globals_)
    return len(readers)


SEEDS = range(150)


@pytest.mark.parametrize("block", range(5))
def test_random_placement_pairs_give_every_reader_byte_once_and_right(block):
    """150 seeded holder/reader replica pairs (1-4 shards each): every reader shard's plan,
    executed, fills each of its tensors exactly with its slices of the global tensors."""
    for seed in SEEDS[block::5]:
        try:
            _run_seed(seed)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e


def test_the_same_seed_gives_the_same_plans():
    rng1, rng2 = random.Random(3), random.Random(3)
    fam1, fam2 = random_schema(rng1), random_schema(rng2)
    h1, h2 = random_replica(rng1, fam1, 3), random_replica(rng2, fam2, 3)
    r1, r2 = random_replica(rng1, fam1, 2), random_replica(rng2, fam2, 2)
    assert [R.plan_reshard(r, h1, spread=i) for i, r in enumerate(r1)] == \
           [R.plan_reshard(r, h2, spread=i) for i, r in enumerate(r2)]


JOINS = [
    # id, a, b, merged (None: kept apart)
    ("contiguous on both sides", Run("t", 0, 0, "h", 8, 4), Run("t", 4, 0, "h", 12, 4), Run("t", 0, 0, "h", 8, 8)),
    ("contiguous on the reader only", Run("t", 0, 0, "h", 8, 4), Run("t", 4, 0, "h", 16, 4), None),
    ("another holder shard", Run("t", 0, 0, "h", 8, 4), Run("t", 4, 1, "h", 12, 4), None),
    ("strided continues strided", Run("t", 0, 0, "h", 0, 2, 3, 4, 8), Run("t", 12, 0, "h", 24, 2, 2, 4, 8),
     Run("t", 0, 0, "h", 0, 2, 5, 4, 8)),
    ("single run then strided at its strides", Run("t", 0, 0, "h", 0, 2), Run("t", 4, 0, "h", 8, 2, 2, 4, 8),
     Run("t", 0, 0, "h", 0, 2, 3, 4, 8)),
    ("strided at other strides", Run("t", 0, 0, "h", 0, 2, 3, 4, 8), Run("t", 12, 0, "h", 24, 2, 2, 6, 8), None),
    ("strided with other run bytes", Run("t", 0, 0, "h", 0, 2, 3, 4, 8), Run("t", 12, 0, "h", 24, 3, 2, 4, 8), None),
    ("strides equal to the run become one contiguous run", Run("t", 0, 0, "h", 0, 4, 2, 4, 4),
     Run("t", 8, 0, "h", 8, 4, 2, 4, 4), Run("t", 0, 0, "h", 0, 16)),
]


@pytest.mark.parametrize("a, b, merged", [j[1:] for j in JOINS], ids=[j[0] for j in JOINS])
def test_a_run_that_continues_the_one_before_merges_into_it(a, b, merged):
    assert R._join(a, b) == merged
    assert R._merged([a, b]) == ([merged] if merged else [a, b])


def test_the_docs_example_fsdp_tp2_rows_to_vllm_tp2_fused():
    """docs/placements.md at small sizes: trainer FSDP rows TP=2 -> vLLM TP=2 with fused
    qkv_proj and gate_up_proj, row-parallel o_proj and down_proj, the norm cut by the trainer:
    qkv 3 runs, o 2 strided, gate_up 2, down 2 strided, norm 2 = 11 runs; executed, right."""
    h, kv, i = 8, 2, 12
    schema = P.Schema.of([GlobalTensor(n, "bfloat16", s) for n, s in [
        ("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h)),
        ("gate", (i, h)), ("up", (i, h)), ("down", (h, i)), ("norm", (h,))]])
    g = schema.by_name()
    holders = [P.Placement.build([P.split(t, 0, r, 2) for t in schema.tensors], schema) for r in range(2)]
    P.check_coverage(holders, schema)
    for rank in range(2):
        reader = P.Placement.build([
            P.fused("qkv_proj", [(g["q"], 0, rank, 2), (g["k"], 0, rank, 2), (g["v"], 0, rank, 2)]),
            P.split(g["o"], 1, rank, 2, name="o_proj"),
            P.fused("gate_up_proj", [(g["gate"], 0, rank, 2), (g["up"], 0, rank, 2)]),
            P.split(g["down"], 1, rank, 2, name="down_proj"),
            P.whole(g["norm"]),
        ], schema)
        plan = R.plan_reshard(reader, holders, spread=rank)
        assert [len(plan.runs_for(n)) for n in reader.names] == [3, 2, 2, 2, 2]
        assert [r.count for r in plan.runs_for("o_proj")] == [h // 2, h // 2]
        assert {r.holder_shard for r in plan.runs_for("qkv_proj")} == {rank}
        gen = torch.Generator().manual_seed(rank)
        execute(plan, reader, holders, {t.name: _random_tensor(t, gen) for t in schema.tensors})


CLIPS = [
    # id, run, keep [lo, hi), clipped runs
    ("contiguous, inside", Run("t", 8, 0, "h", 100, 16), [(12, 20)], [Run("t", 12, 0, "h", 104, 8)]),
    ("contiguous, two ranges", Run("t", 0, 1, "h", 0, 16), [(0, 4), (8, 10)],
     [Run("t", 0, 1, "h", 0, 4), Run("t", 8, 1, "h", 8, 2)]),
    ("contiguous, outside", Run("t", 0, 0, "h", 0, 16), [(16, 32)], []),
    ("strided, whole copies", Run("t", 2, 0, "h", 0, 2, 4, 8, 2), [(8, 26)], [Run("t", 10, 0, "h", 2, 2, 2, 8, 2)]),
    ("strided, cut at both ends", Run("t", 0, 0, "h", 0, 4, 4, 8, 4), [(2, 27)],
     [Run("t", 2, 0, "h", 2, 2), Run("t", 24, 0, "h", 12, 3), Run("t", 8, 0, "h", 4, 4, 2, 8, 4)]),
    ("strided, one whole copy", Run("t", 0, 0, "h", 0, 4, 4, 8, 4), [(8, 12)], [Run("t", 8, 0, "h", 4, 4)]),
    ("strided, between copies", Run("t", 0, 0, "h", 0, 4, 4, 8, 4), [(4, 8)], []),
    ("strided, inside one copy", Run("t", 0, 0, "h", 0, 4, 4, 8, 4), [(9, 11)], [Run("t", 9, 0, "h", 5, 2)]),
]


@pytest.mark.parametrize("run, keep, want", [c[1:] for c in CLIPS], ids=[c[0] for c in CLIPS])
def test_clip_plan_table(run, keep, want):
    got = R.clip_plan(R.ReshardPlan((run,)), {"t": keep})
    assert sorted(got.runs, key=lambda r: r.reader_offset) == sorted(want, key=lambda r: r.reader_offset)


@pytest.mark.parametrize("block", range(3))
def test_a_clipped_plan_writes_exactly_the_kept_bytes_once_from_the_same_holder_bytes(block):
    """60 seeded pairs, random kept ranges per reader tensor: the clipped plan, executed, writes
    every kept byte once and right, and nothing else."""
    import numpy as np

    for seed in range(block, 60, 3):
        globals_, holders, readers = seeded_pair(seed)
        rng = random.Random(seed)
        held = [{t.name: _bytes(materialize(t, globals_)) for t in h.tensors} for h in holders]
        for r, reader in enumerate(readers):
            plan = R.plan_reshard(reader, holders, spread=r)
            keep = {}
            for t in reader.tensors:
                cuts = sorted({0, t.nbytes, *(rng.randint(0, t.nbytes) for _ in range(4))})
                keep[t.name] = [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b and rng.random() < 0.5]
            clipped = R.clip_plan(plan, keep)
            out = {t.name: np.full(t.nbytes, 0xA5, dtype=np.uint8) for t in reader.tensors}
            R.apply_plan(clipped, out, held)
            for t in reader.tensors:
                mask = np.zeros(t.nbytes, dtype=bool)
                for a, b in keep[t.name]:
                    mask[a:b] = True
                want = _bytes(materialize(t, globals_))
                assert (out[t.name][mask] == want[mask]).all(), (seed, t.name)
                writes = np.zeros(t.nbytes, dtype=np.int64)
                for x in clipped.runs_for(t.name):
                    for i in range(x.count):
                        writes[x.reader_offset + i * x.reader_stride:][:x.run_bytes] += 1
                assert (writes == mask).all(), (seed, t.name)
            assert {x.holder_shard for x in clipped.runs} <= set(plan.shards)
