"""A trainer rank's part of a model split over ranks (``tensorhub.integrations.trainer_parts``):
real DTensors, built on torch's fake process group in a process per rank (torch caches device
meshes per process), their parts filled there and registered here as the shards of one replica,
then read back whole by a reader of another layout, byte for byte.

    w [10, 6]  Shard(0)     rows 0:5            | rows 5:10
    c [4, 6]   Shard(1)     cols 0:3            | cols 3:6
    u [3, 4]   Shard(0)     rows 0:2            | row 2            (uneven)
    t [1, 4]   Shard(0)     row 0               | nothing          (an empty shard: not held)
    r [4]      Replicate()  whole               | whole
    n [5]      a plain tensor: whole on both ranks
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

import tensorhub
from tensorhub import errors
from tensorhub import placement as P
from tensorhub.integrations.trainer_parts import RankPart
from tensorhub.ports import LocalPort
from tensorhub.testing import inproc
from tensorhub.testing.dtensors import copy_local, dtensor_params

dist = pytest.importorskip("torch.distributed")
fake = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
dt = pytest.importorskip("torch.distributed.tensor")

SHAPES = {"w": (10, 6), "c": (4, 6), "u": (3, 4), "t": (1, 4), "r": (4,), "n": (5,)}
PLACED = {"w": dt.Shard(0), "c": dt.Shard(1), "u": dt.Shard(0), "t": dt.Shard(0), "r": dt.Replicate()}
SCHEMA = [P.GlobalTensor(n, "float32", s) for n, s in SHAPES.items()]


def full(version: int) -> dict[str, torch.Tensor]:
    """The model's global tensors at ``version`` (every element distinct)."""
    out, base = {}, 0
    for name, shape in SHAPES.items():
        n = 1
        for s in shape:
            n *= s
        out[name] = torch.arange(base, base + n, dtype=torch.float32).reshape(shape) + 10000 * version
        base += n
    return out


def rank_params(rank: int, world: int = 2) -> list[tuple[str, torch.nn.Parameter]]:
    """Rank ``rank``'s parameters of version 0: DTensors whose local shards torch itself cuts,
    and the plain ``n``."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    return list(dtensor_params(full(0), PLACED, rank, world).items())


def step(params, version: int) -> None:
    """Move every rank's bytes to ``version`` (what an optimizer step does, shard by shard)."""
    copy_local(params, full(version))


def rank_run(rank: int, versions: int):
    """In a process of its own: rank ``rank``'s part (its placement) and what :meth:`RankPart.fill`
    copies of each of ``versions`` versions (each after a step of the rank's parameters)."""
    params = rank_params(rank)
    part = RankPart.of(params, SCHEMA)
    filled = []
    for v in range(versions):
        step(params, v)
        assert part.fill(params) == len(part.buffers)
        filled.append([(n, b.clone()) for n, b in part.buffers])
    return part.placement, filled


def test_each_rank_registers_its_local_shards_and_a_reader_reads_the_whole_model_exact():
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        ranks = list(pool.map(rank_run, [0, 1], [2, 2]))
    boxes = [{t.name: [(p.box.start, p.box.stop) for p in t.pieces] for t in pl.tensors} for pl, _ in ranks]
    assert boxes[0] == {"w": [((0, 0), (5, 6))], "c": [((0, 0), (4, 3))], "u": [((0, 0), (2, 4))],
                        "t": [((0, 0), (1, 4))], "r": [((0,), (4,))], "n": [((0,), (5,))]}
    assert boxes[1] == {"w": [((5, 0), (10, 6))], "c": [((0, 3), (4, 6))], "u": [((2, 0), (3, 4))],
                        "r": [((0,), (4,))], "n": [((0,), (5,))]}  # t: an empty shard, not held
    assert ranks[1][0].nbytes < ranks[0][0].nbytes < 0.75 * sum(t.numel() * 4 for t in full(0).values())

    cfg = dataclasses.replace(inproc.CONFIG)
    port = LocalPort(cfg)
    hubs, buffers = [], []
    try:
        for k, (placement, filled) in enumerate(ranks):
            hub = tensorhub.open("m", port=port, config=cfg, replica="trainer", shard=k, num_shards=2)
            buf = [(n, torch.zeros_like(t)) for n, t in filled[0]]
            hub.register(buf, placement=placement)
            hubs.append(hub)
            buffers.append(buf)
        whole = [(g.name, torch.zeros(g.shape)) for g in SCHEMA]
        reader = tensorhub.open("m", port=port, config=cfg, replica="engine")
        reader.register(whole, placement=P.whole_placement(SCHEMA))
        hubs.append(reader)
        for v in range(2):
            for hub, buf, (_, filled) in zip(hubs, buffers, ranks):
                hub.unpublish()
                for (_, b), (_, t) in zip(buf, filled[v]):
                    b.copy_(t)
                hub.publish(v)
            st = reader.update(v)
            assert st.version == v and sorted(h.split("/")[:3] for h in st.holders) == [["m", "trainer", "0"],
                                                                                      ["m", "trainer", "1"]], st
            want = full(v)
            for name, got in whole:
                assert torch.equal(got, want[name]), (v, name)
    finally:
        for hub in hubs:
            hub.close(drop_last_copy=True)


def test_a_replica_whose_ranks_leave_a_tensor_uncovered_is_refused_at_its_first_publish():
    """Rank 1 holds ``w``'s rows 5:10 and rank 0 holds every tensor whole but ``w`` (its
    ``held`` names): rows 0:5 of ``w`` are nobody's. Each rank's publish is refused, naming
    them, and nothing is published."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        placement, filled = pool.submit(rank_run, 1, 1).result()
    parts = [RankPart.whole(SCHEMA, held={"c", "u", "t", "r", "n"}), RankPart(filled[0], placement)]
    cfg = dataclasses.replace(inproc.CONFIG)
    port = LocalPort(cfg)
    hubs = []
    try:
        for k, part in enumerate(parts):
            hub = tensorhub.open("m", port=port, config=cfg, replica="trainer", shard=k, num_shards=2)
            hub.register(part.buffers, placement=part.placement)
            hubs.append(hub)
        for hub in hubs:
            with pytest.raises(errors.LayoutMismatch, match=r"uncovered: w \[0:5, 0:6\]"):
                hub.publish(0)
            assert hub.version is None
        with port._lock:
            assert port.core.available("m") == []
    finally:
        for hub in hubs:
            hub.close(drop_last_copy=True)


def test_whole_parts_of_held_names_fill_from_a_source_that_yields_none_for_the_others():
    g = full(3)
    part = RankPart.whole(SCHEMA, held={"w", "n"})
    assert [n for n, _ in part.buffers] == ["w", "n"]
    assert part.fill([(n, g[n] if n in ("w", "n") else None) for n in SHAPES]) == 2
    assert torch.equal(dict(part.buffers)["w"], g["w"])
    with pytest.raises(errors.LayoutMismatch, match="did not yield 1 parameter.*'n'"):
        part.fill([("w", g["w"])])
    with pytest.raises(errors.LayoutMismatch, match="'x'.*not in its metadata"):
        part.fill([("x", g["w"])])
    with pytest.raises(errors.LayoutMismatch, match="'w' twice"):
        part.fill([("w", g["w"]), ("w", g["w"])])
    with pytest.raises(errors.LayoutMismatch, match="'w' is torch.float64"):
        part.fill([("w", g["w"].double()), ("n", g["n"])])
    with pytest.raises(errors.LayoutMismatch, match="holds no parameter"):
        RankPart.whole(SCHEMA, held={"x"})


def test_parameters_that_disagree_with_the_schema_are_refused_naming_them():
    params = [(n, torch.nn.Parameter(t)) for n, t in full(0).items()]
    with pytest.raises(errors.LayoutMismatch, match="'x': not in the model's schema"):
        RankPart.of([*params, ("x", torch.nn.Parameter(torch.zeros(2)))], SCHEMA)
    with pytest.raises(errors.LayoutMismatch, match=r"'n': float32 \[6\] here, the schema says float32 \[5\]"):
        RankPart.of([*params[:-1], ("n", torch.nn.Parameter(torch.zeros(6)))], SCHEMA)
    with pytest.raises(errors.LayoutMismatch, match="holds no parameter"):
        RankPart.of([], SCHEMA)
    part = RankPart.of(params, SCHEMA)
    assert part.placement == P.whole_placement(SCHEMA) and part.nbytes == sum(t.numel() * 4 for _, t in params)


def test_an_unstaged_part_registers_the_parameters_themselves_and_copies_nothing():
    params = [(n, torch.nn.Parameter(t)) for n, t in full(0).items()]
    part = RankPart.of(params, SCHEMA, stage=False)
    assert not part.staged
    assert [(n, t.data_ptr()) for n, t in part.buffers] == [(n, p.data_ptr()) for n, p in params]
    with torch.no_grad():
        params[0][1].add_(1)  # what an optimizer step does (after the trainer unpublished)
    assert part.fill(params) == len(params)
    assert torch.equal(part.buffers[0][1], full(0)["w"] + 1)  # the same memory, nothing copied
    moved = [(n, torch.nn.Parameter(p.detach().clone())) if n == "c" else (n, p) for n, p in params]
    with pytest.raises(errors.LayoutMismatch, match="'c' is no longer the tensor registered"):
        part.fill(moved)
    strided = [(n, torch.nn.Parameter(t.t().contiguous().t())) if n == "w" else (n, torch.nn.Parameter(t))
               for n, t in full(0).items()]
    with pytest.raises(errors.ConfigError, match="'w' is not contiguous"):
        RankPart.of(strided, SCHEMA, stage=False)
    assert RankPart.of(strided, SCHEMA).staged  # staged, a strided parameter is copied as usual
