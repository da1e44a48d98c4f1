"""Placements as data (issue 24, stage 1): the helpers build the layouts real stacks use, the
digest is stable, and every bad placement is refused with a LayoutMismatch that names it.

Shapes are tiny and drawn in each test's docstring as ``global -> local``. No process group:
DTensor boxes are checked against torch's own ``_compute_local_shape_and_global_offset``, and a
real DTensor is built on torch's fake process group when it is available.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from tensorhub import placement as P
from tensorhub.errors import LayoutMismatch
from tensorhub.placement import Box, GlobalTensor, Piece

Q = GlobalTensor("q", "bfloat16", (8, 4))
K = GlobalTensor("k", "bfloat16", (4, 4))
V = GlobalTensor("v", "bfloat16", (4, 4))
GATE = GlobalTensor("gate", "float32", (6, 4))
UP = GlobalTensor("up", "float32", (6, 4))
NORM = GlobalTensor("norm", "float32", (4,))
SCALE = GlobalTensor("scale", "float32", ())
EXPERTS = [GlobalTensor(f"experts.{e}.w1", "float16", (6, 4)) for e in range(4)]
SCHEMA = P.Schema.of([Q, K, V, GATE, UP, NORM, SCALE, *EXPERTS])


def B(*ranges: tuple[int, int]) -> Box:
    return Box(tuple(a for a, _ in ranges), tuple(b for _, b in ranges))


# --------------------------------------------------------------------------- helpers build layouts


HELPERS = [
    # id, built, expected (dtype, local shape, pieces)
    ("whole", lambda: P.whole(Q), ("bfloat16", (8, 4), (Piece("q", B((0, 8), (0, 4)), 0),))),
    ("TP row split q 8 -> rank 1 of 2", lambda: P.split(Q, 0, 1, 2),
     ("bfloat16", (4, 4), (Piece("q", B((4, 8), (0, 4)), 0),))),
    ("TP column split q 4 -> rank 3 of 4", lambda: P.split(Q, 1, 3, 4),
     ("bfloat16", (8, 1), (Piece("q", B((0, 8), (3, 4)), 0),))),
    ("negative dim counts from the end", lambda: P.split(Q, -1, 0, 2),
     ("bfloat16", (8, 2), (Piece("q", B((0, 8), (0, 2)), 0),))),
    ("uneven rows 3+5, part 1", lambda: P.split_sizes(Q, 0, [3, 5], 1),
     ("bfloat16", (5, 4), (Piece("q", B((3, 8), (0, 4)), 0),))),
    ("uneven with an empty part", lambda: P.split_sizes(Q, 0, [8, 0], 1),
     ("bfloat16", (0, 4), (Piece("q", B((8, 8), (0, 4)), 0),))),
    ("fused qkv, TP rank 1 of 2 (GQA: k, v smaller)",
     lambda: P.fused("qkv_proj", [(Q, 0, 1, 2), (K, 0, 1, 2), (V, 0, 1, 2)]),
     ("bfloat16", (8, 4), (Piece("q", B((4, 8), (0, 4)), 0), Piece("k", B((2, 4), (0, 4)), 4),
                           Piece("v", B((2, 4), (0, 4)), 6)))),
    ("fused gate_up, whole", lambda: P.fused("gate_up_proj", [GATE, UP]),
     ("float32", (12, 4), (Piece("gate", B((0, 6), (0, 4)), 0), Piece("up", B((0, 6), (0, 4)), 6)))),
    ("experts 2..3 stacked (EP rank 1 of 2)", lambda: P.stacked("w1", EXPERTS[2:]),
     ("float16", (2, 6, 4), (Piece("experts.2.w1", B((0, 6), (0, 4)), 0, True),
                             Piece("experts.3.w1", B((0, 6), (0, 4)), 1, True)))),
    ("experts stacked, each TP-split by rows", lambda: P.stacked("w1", [(e, 0, 0, 2) for e in EXPERTS[:2]]),
     ("float16", (2, 3, 4), (Piece("experts.0.w1", B((0, 3), (0, 4)), 0, True),
                             Piece("experts.1.w1", B((0, 3), (0, 4)), 1, True)))),
    ("1-D norm replicated", lambda: P.whole(NORM), ("float32", (4,), (Piece("norm", B((0, 4)), 0),))),
    ("0-d scalar", lambda: P.whole(SCALE), ("float32", (), (Piece("scale", Box((), ()), 0),))),
    ("0-d scalars stacked", lambda: P.stacked("scales", [SCALE]),
     ("float32", (1,), (Piece("scale", Box((), ()), 0, True),))),
]


@pytest.mark.parametrize("build, want", [h[1:] for h in HELPERS], ids=[h[0] for h in HELPERS])
def test_helpers_build_the_layouts_of_real_stacks(build, want):
    local = build()
    assert (local.dtype, local.shape, local.pieces) == want
    P.Placement.build([local], SCHEMA)  # a valid placement


def test_whole_placement_is_todays_identical_layout():
    pl = P.whole_placement(SCHEMA)
    assert pl.names == tuple(g.name for g in SCHEMA.tensors)
    assert pl.nbytes == sum(g.nbytes for g in SCHEMA.tensors)
    assert P.coverage([pl]) == {}


def test_itemsizes_agree_with_torch():
    pytest.importorskip("torch")
    from tensorhub.layout import _DTYPES

    for dtype, name in _DTYPES.items():
        assert P.itemsize(name) == dtype.itemsize, name


# --------------------------------------------------------------------------- digest and wire


def _tp2_qkv(rank: int) -> P.Placement:
    return P.Placement.build([P.fused("qkv_proj", [(Q, 0, rank, 2), (K, 0, rank, 2), (V, 0, rank, 2)])], SCHEMA)


def test_placement_crosses_a_process_and_keeps_its_digest():
    pl = _tp2_qkv(0)
    for codec in (msgspec.msgpack, msgspec.json):
        back = codec.decode(codec.encode(pl), type=P.Placement)
        assert back == pl and back.digest() == pl.digest()
        back.check()


def test_digest_tells_placements_apart_and_equal_ones_together():
    """Interning key: one copy per distinct placement, whoever built it."""
    assert _tp2_qkv(0).digest() == _tp2_qkv(0).digest()
    assert len({_tp2_qkv(0).digest(), _tp2_qkv(1).digest(), P.whole_placement(SCHEMA).digest()}) == 3
    assert SCHEMA.digest() == P.Schema.of(SCHEMA.tensors).digest()
    assert SCHEMA.digest() != P.Schema.of(SCHEMA.tensors[::-1]).digest()


def test_digest_is_pinned():
    """The digest is a wire value (servers of two versions must agree): change it on purpose."""
    assert P.Placement.build([P.whole(NORM)], SCHEMA).digest() == PINNED_DIGEST


PINNED_DIGEST = "cf17b793bf6652707a1bdd4a47026a20"


def test_placement_keeps_only_the_global_tensors_it_names_sorted():
    pl = P.Placement.build([P.whole(UP), P.whole(GATE)], SCHEMA)
    assert [g.name for g in pl.globals] == ["gate", "up"]
    assert pl.names == ("up", "gate")


# --------------------------------------------------------------------------- bad placements


def _local(name, dtype, shape, *pieces):
    return P.LocalPlacement(name, dtype, shape, tuple(pieces))


def _pl(*locals_, globals_=None):
    return P.Placement(tuple(sorted(globals_ or SCHEMA.tensors, key=lambda g: g.name)), tuple(locals_))


BAD = [
    ("box out of the global bounds",
     _pl(_local("q", "bfloat16", (4, 4), Piece("q", B((6, 10), (0, 4)), 0))), "outside global tensor 'q'"),
    ("box with too many dims",
     _pl(_local("norm", "float32", (4,), Piece("norm", B((0, 4), (0, 1)), 0))), "outside global tensor 'norm'"),
    ("local shape larger than its pieces",
     _pl(_local("q", "bfloat16", (9, 4), Piece("q", B((0, 8), (0, 4)), 0))), "pieces hold 8 rows"),
    ("local rows of another width",
     _pl(_local("q", "bfloat16", (8, 2), Piece("q", B((0, 8), (0, 4)), 0))), "rows of shape [4]"),
    ("a gap between pieces",
     _pl(_local("qk", "bfloat16", (12, 4), Piece("q", B((0, 8), (0, 4)), 0), Piece("k", B((0, 4), (0, 4)), 9))),
     "starts at row 9, expected 8"),
    ("dtype conversion asked of a placement",
     _pl(_local("q", "float32", (8, 4), Piece("q", B((0, 8), (0, 4)), 0))), "a dtype conversion is not a reshard"),
    ("fused parts of two dtypes",
     _pl(_local("mix", "float32", (10, 4), Piece("gate", B((0, 6), (0, 4)), 0), Piece("k", B((0, 4), (0, 4)), 6))),
     "dtype float32 holds global tensor 'k' of dtype bfloat16"),
    ("two pieces of one handle overlap",
     _pl(_local("a", "bfloat16", (5, 4), Piece("q", B((0, 5), (0, 4)), 0)),
         _local("b", "bfloat16", (5, 4), Piece("q", B((3, 8), (0, 4)), 0))), "overlap"),
    ("overlap inside one local tensor",
     _pl(_local("a", "bfloat16", (6, 4), Piece("q", B((0, 3), (0, 4)), 0), Piece("q", B((2, 5), (0, 4)), 3))),
     "overlap"),
    ("a global tensor the placement does not carry",
     _pl(_local("q", "bfloat16", (8, 4), Piece("q", B((0, 8), (0, 4)), 0)), globals_=[K]),
     "'q' is not in the placement's schema"),
    ("two local tensors of one name",
     _pl(_local("x", "float32", (4,), Piece("norm", B((0, 4)), 0)),
         _local("x", "float32", (), Piece("scale", Box((), ()), 0))), "duplicate name"),
    ("a local tensor with no pieces", _pl(_local("x", "float32", (0,))), "no pieces"),
    ("a 0-d tensor placed as rows",
     _pl(_local("x", "float32", (1,), Piece("scale", Box((), ()), 0))), "has no rows"),
    ("a 0-d local tensor of two pieces",
     _pl(_local("x", "float32", (), Piece("scale", Box((), ()), 0), Piece("scale", Box((), ()), 0))),
     "exactly one whole 0-d tensor"),
    ("an unknown dtype",
     _pl(globals_=[GlobalTensor("w", "float4", (2,))]), "unsupported dtype 'float4'"),
    ("globals out of order",
     P.Placement((Q, K), ()), "sorted by name"),
]


@pytest.mark.parametrize("pl, msg", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_placement_is_refused_naming_it(pl, msg):
    with pytest.raises(LayoutMismatch, match=msg.replace("[", r"\[").replace("]", r"\]")):
        pl.check()


def test_identical_replicas_inside_one_handle_are_allowed():
    """Tied weights: embed_tokens and lm_head hold the same box of one global tensor."""
    P.Placement.build([P.whole(Q, "embed_tokens"), P.whole(Q, "lm_head")], SCHEMA)


def test_a_decoded_bad_placement_is_caught_by_check_not_by_decoding():
    """The server decodes, then checks: the error stays typed (a __post_init__ error would
    become msgspec's ValidationError)."""
    bad = BAD[0][1]
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=P.Placement)
    with pytest.raises(LayoutMismatch):
        back.check()


HELPER_MISUSE = [
    ("split that does not divide", lambda: P.split(Q, 0, 0, 3), "use split_sizes"),
    ("split index past count", lambda: P.split(Q, 0, 2, 2), "part 2 of 2"),
    ("split of a dim that is not there", lambda: P.split(NORM, 1, 0, 2), "no dim 1"),
    ("sizes that do not sum", lambda: P.split_sizes(Q, 0, [3, 4], 0), "do not split dim 0 of size 8"),
    ("fused rows of another width", lambda: P.fused("x", [GATE, NORM]), "rows of shape"),
    ("stacked boxes of two shapes", lambda: P.stacked("x", [Q, K]), "rows of shape"),
    ("fused of two dtypes", lambda: P.fused("x", [K, GATE]), "a dtype conversion is not a reshard"),
    ("a name missing from the schema", lambda: P.Placement.build([P.whole(GlobalTensor("z", "int8", (1,)))], SCHEMA),
     "'z': not in the schema"),
]


@pytest.mark.parametrize("make, msg", [b[1:] for b in HELPER_MISUSE], ids=[b[0] for b in HELPER_MISUSE])
def test_helper_misuse_is_a_layout_mismatch(make, msg):
    with pytest.raises(LayoutMismatch, match=msg):
        make()


# --------------------------------------------------------------------------- schemas and coverage


def test_schemas_that_disagree_are_refused_naming_the_tensor():
    """trainer says q is bf16 [8, 4]; a reader says float32, another [16, 4]."""
    trainer = P.Placement.build([P.whole(Q)], SCHEMA)
    q32, q16 = GlobalTensor("q", "float32", (8, 4)), GlobalTensor("q", "bfloat16", (16, 4))
    fp32 = P.Placement.build([P.whole(q32)], [q32])
    wide = P.Placement.build([P.whole(q16)], [q16])
    with pytest.raises(LayoutMismatch, match=r"'q': dtype float32 here, bfloat16 elsewhere.*not a reshard"):
        P.merge_schemas([trainer, fp32])
    with pytest.raises(LayoutMismatch, match=r"'q': shape \[16, 4\] here, \[8, 4\] elsewhere"):
        P.merge_schemas([trainer, wide])
    with pytest.raises(LayoutMismatch, match="'q'"):
        P.coverage([trainer, wide])
    assert [g.name for g in P.merge_schemas([trainer, _tp2_qkv(1)]).tensors] == ["q", "k", "v"]


COVERAGE = [
    # id, placements (one per shard), schema, missing
    ("TP=2 rows, both shards", [[P.split(Q, 0, 0, 2)], [P.split(Q, 0, 1, 2)]], [Q], {}),
    ("TP=2 rows, shard 1 missing", [[P.split(Q, 0, 0, 2)]], [Q], {"q": (B((4, 8), (0, 4)),)}),
    ("columns 0 and 2 of 4", [[P.split(Q, 1, 0, 4)], [P.split(Q, 1, 2, 4)]], [Q],
     {"q": (B((0, 8), (1, 2)), B((0, 8), (3, 4)))}),
    ("replicated norm on every shard", [[P.whole(NORM)], [P.whole(NORM)]], [NORM], {}),
    ("overlapping shards still cover", [[P.split_sizes(Q, 0, [5, 3], 0)], [P.split_sizes(Q, 0, [3, 5], 1)]], [Q], {}),
    ("a tensor no shard names (only the schema knows)", [[P.whole(NORM)]], [NORM, SCALE],
     {"scale": (Box((), ()),)}),
    ("fused qkv TP=2 without v on shard 1",
     [[P.fused("qkv", [(Q, 0, 0, 2), (K, 0, 0, 2), (V, 0, 0, 2)])], [P.fused("qk", [(Q, 0, 1, 2), (K, 0, 1, 2)])]],
     [Q, K, V], {"v": (B((2, 4), (0, 4)),)}),
    ("experts EP=2, shard 1 holds expert 3 only", [[P.stacked("w1", EXPERTS[:2])], [P.stacked("w1", EXPERTS[3:])]],
     EXPERTS, {"experts.2.w1": (B((0, 6), (0, 4)),)}),
]


@pytest.mark.parametrize("shards, schema, missing", [c[1:] for c in COVERAGE], ids=[c[0] for c in COVERAGE])
def test_coverage_names_the_missing_ranges_per_tensor(shards, schema, missing):
    placements = [P.Placement.build(s, SCHEMA) for s in shards]
    assert P.coverage(placements, schema) == missing
    if missing:
        with pytest.raises(LayoutMismatch, match="uncovered: " + sorted(missing)[0].replace(".", r"\.")):
            P.check_coverage(placements, schema)
    else:
        P.check_coverage(placements, schema)


def test_box_minus_covers_exactly_the_rest():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 3)
        a = _rand_box(rng, n)
        b = _rand_box(rng, n)
        rest = a.minus(b)
        cells = {c for r in rest for c in _cells(r)}
        assert cells == _cells(a) - _cells(b)
        assert sum(r.numel for r in rest) == len(cells), "disjoint"


def _rand_box(rng, n):
    start = [rng.randint(0, 4) for _ in range(n)]
    return Box(tuple(start), tuple(s + rng.randint(0, 3) for s in start))


def _cells(box):
    import itertools

    return set(itertools.product(*(range(a, b) for a, b in zip(box.start, box.stop))))


# --------------------------------------------------------------------------- DTensor


def test_dtensor_boxes_match_torch_for_random_meshes():
    """mesh (2, 3) [Shard(0), Shard(0)] etc.: our boxes are torch's local shape and offset."""
    torch = pytest.importorskip("torch")
    dt = pytest.importorskip("torch.distributed.tensor")
    utils = pytest.importorskip("torch.distributed.tensor._utils")
    reference = getattr(utils, "_compute_local_shape_and_global_offset", None)
    if reference is None:
        pytest.skip("this torch has no mesh-free local shape function")
    rng = random.Random(24)
    for _ in range(300):
        shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3)))
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        placements = [dt.Shard(rng.randrange(len(shape))) if rng.random() < 0.7 else dt.Replicate() for _ in mesh]
        coord = [rng.randrange(k) for k in mesh]
        local_shape, offset = reference(torch.Size(shape), mesh, coord, placements)
        box = P.dtensor_box(shape, mesh, coord, placements)
        plain = P.dtensor_box(shape, mesh, coord, [repr(p) if p.is_replicate() else f"S({p.dim})" for p in placements])
        assert box == plain
        assert box.shape == tuple(local_shape), (shape, mesh, coord, placements)
        assert all(a == o for a, o, s in zip(box.start, offset, box.shape) if s), (shape, mesh, coord, placements)


def test_from_dtensor_tp2_by_fsdp2_mesh():
    """mesh (dp=2, tp=2), placements [Shard(0), Shard(1)]: rank (1, 0) of q [8, 4] holds rows 4:8, cols 0:2."""
    local = P.from_dtensor(Q, (2, 2), (1, 0), ["S(0)", "Shard(dim=1)"])
    assert local.pieces == (Piece("q", B((4, 8), (0, 2)), 0),) and local.shape == (4, 2)
    assert P.from_dtensor(Q, (2,), (1,), ["R"]).pieces == P.whole(Q).pieces


def test_dtensor_placements_that_are_not_boxes_are_refused():
    dt = pytest.importorskip("torch.distributed.tensor")
    with pytest.raises(LayoutMismatch, match="partial sum"):
        P.from_dtensor(Q, (2,), (0,), [dt.Partial()])
    with pytest.raises(LayoutMismatch, match="only Shard"):
        P.from_dtensor(Q, (2,), (0,), ["P(sum)"])
    with pytest.raises(LayoutMismatch, match="outside mesh"):
        P.from_dtensor(Q, (2,), (2,), ["S(0)"])
    with pytest.raises(LayoutMismatch, match="disagree"):
        P.from_dtensor(Q, (2, 2), (0,), ["S(0)"])
    strided = getattr(pytest.importorskip("torch.distributed.tensor.placement_types"), "_StridedShard", None)
    if strided is not None:
        with pytest.raises(LayoutMismatch, match="strided"):
            P.from_dtensor(Q, (2,), (0,), [strided(0, split_factor=2)])


def test_dtensor_placement_reads_a_live_dtensor_on_a_fake_process_group():
    """A real DTensor (world of 4 on torch's fake backend, this process is rank 3 = mesh (1, 1)):
    rows 4:8 of mesh dim 0, then cols 2:4 of mesh dim 1."""
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    fake = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dt = pytest.importorskip("torch.distributed.tensor")
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=fake.FakeStore(), rank=3, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        d = dt.DTensor.from_local(torch.zeros(4, 2, dtype=torch.bfloat16), mesh, [dt.Shard(0), dt.Shard(1)],
                                  run_check=False, shape=torch.Size([8, 4]), stride=(4, 1))
        g, local = P.dtensor_placement("q", d)
        assert g == Q
        assert local.pieces == (Piece("q", B((4, 8), (2, 4)), 0),) and local.shape == tuple(d.to_local().shape)
    finally:
        dist.destroy_process_group()
