"""A resharded read (tensorhub.transport.reshard_read): a reader shard's own tensors filled from
every holder shard of a replica of another placement, checked cell by cell against checksums the
holders computed, then published as a holder of the reader's placement.

The placements are test_ranges' (FSDP-like rows, column splits, uneven splits, vLLM-style fused
qkv/gate_up with row- and column-parallel layers). Every test compares bytes with the truth cut
out of the global tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorhub.core.grid import grid_of
from tensorhub.errors import ChecksumMismatch, InvalidState, LayoutMismatch
from tensorhub.gridsums import cell_checksums
from tensorhub.layout import checksum_all
from tensorhub.transport import Agent, Region, open_source, shm
from tensorhub.transport.reshard_read import ReshardRead

from tests.transport.test_ranges import CASES, CFG, SENTINEL, _bytes, _globals, _layout, _local, _schema

VERSION = 3


@pytest.fixture(scope="module")
def agents():
    """Holders on agent 0, readers on agent 1, and the holders made so far (registered once per
    case and copy, closed here: see test_ranges' module doc on re-registering)."""
    cache: dict[tuple, list] = {}
    yield [Agent(CFG, name=f"test-reshard-read-{i}") for i in range(2)], cache
    for hs in cache.values():
        for h in hs:
            h.region.close()


class Holder:
    """One holder shard: its placement, its tensors registered and published complete, and the
    checksums of the grid cells it holds."""

    def __init__(self, agent, pl, tensors):
        self.placement, self.tensors = pl, tensors
        self.layout = _layout(pl, tensors)
        self.region = Region.register(tensors, self.layout, CFG, agent=agent)
        self.region.publish_complete(VERSION, checksum_all(tensors, self.layout))


def _world(agents, case, dtype="float32", copy=0):
    """(holders, reader placement, reader region, truth, grid, holders' cell checksums)."""
    (made, cache) = agents
    schema = _schema(dtype)
    holders_of, reader_of = CASES[case]
    hp, rp = holders_of(schema), reader_of(schema)
    gl = _globals(schema)
    key = (case, dtype, copy)
    if key not in cache:
        cache[key] = [Holder(made[0], h, [_local(t, gl) for t in h.tensors]) for h in hp]
    holders = cache[key]
    for h in holders:
        h.region.publish_complete(VERSION)
    tensors = [torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in rp.tensors]
    for t in tensors:
        _bytes(t)[:] = SENTINEL
    region = Region.register(tensors, _layout(rp, tensors), CFG.replace(same_host=False), agent=made[1])
    grid = grid_of([rp, *hp])
    sums = {}
    for h in holders:
        sums.update(cell_checksums(dict(zip(h.placement.names, h.tensors)), h.placement, grid))
    truth = [_local(t, gl) for t in rp.tensors]
    return holders, rp, region, truth, grid, sums


def _sources(agents, holders, tier):
    """Holder shard -> an open source of it: NIXL (``tier`` "nixl") or its memory mapped here."""
    if tier == "nixl":
        return {i: open_source(h.region.endpoint(), agent=agents[0][1]) for i, h in enumerate(holders)}
    return {i: shm.ShmSource(h.region.endpoint().shm) for i, h in enumerate(holders)}


def _assert_published(region, truth) -> None:
    """The reader holds the version complete, its bytes the truth, its unit checksums today's
    (same-placement readers verify as today)."""
    assert (region.version, region.progress) == (VERSION, region.layout.unit_count)
    assert region.checksums() == checksum_all(truth, region.layout)
    for t, want in zip(region.tensors, truth):
        assert np.array_equal(_bytes(t), _bytes(want))


def _unit_bytes_equal(region, truth, unit) -> bool:
    for piece in unit:
        got = _bytes(region.tensors[piece.tensor_index])[piece.offset:piece.offset + piece.nbytes]
        want = _bytes(truth[piece.tensor_index])[piece.offset:piece.offset + piece.nbytes]
        if not np.array_equal(got, want):
            return False
    return True


@pytest.mark.parametrize("tier", ["nixl", "same_host"])
@pytest.mark.parametrize("case", ["rows -> fused qkv TP=2", "whole -> fused qkv TP=4", "columns -> quarters",
                                  "uneven -> columns", "rows -> rows (2 -> 3)", "rows -> rows (same)"])
def test_a_reader_reshards_from_every_holder_shard_checks_its_cells_and_holds_its_own_placement(agents, case, tier):
    holders, rp, region, truth, grid, sums = _world(agents, case)
    sources = _sources(agents, holders, tier)
    try:
        rd = ReshardRead(region, rp, [h.placement for h in holders], version=VERSION, config=CFG, spread=1)
        assert rd.units_done() == 0
        seen = 0
        for shard in rd.shards:
            rd.read(shard, sources[shard])
            done = rd.units_done()
            assert done >= seen, "units done only grow"
            seen = done
            for unit in region.layout.units[:done]:
                assert _unit_bytes_equal(region, truth, unit), "a unit counted done holds its final bytes"
        assert seen == region.layout.unit_count
        assert rd.bytes_read == region.layout.total_bytes, "every byte of the reader's slice once, nothing more"
        assert rd.verify(grid, sums) == []
        rd.check(grid, sums)
        assert region.version == -1, "published only by publish()"
        rd.publish()
        _assert_published(region, truth)
    finally:
        for s in sources.values():
            s.close()
        region.close()


def test_a_corrupt_holder_shard_is_named_and_read_again_from_another_copy(agents):
    """Holder shard 1's bytes change after it computed its cell checksums: the check names shard
    1 (only), and reading shard 1 again from another replica's shard 1 repairs the read."""
    case = "rows -> fused qkv TP=2"
    holders, rp, region, truth, grid, sums = _world(agents, case)
    good, _, region2, _, _, _ = _world(agents, case, copy=1)
    region2.close()
    made = agents[0]
    flat = _bytes(holders[1].tensors[0])
    old = flat[5].copy()
    flat[5] ^= 0xFF
    sources = {i: open_source(h.region.endpoint(), agent=made[1]) for i, h in enumerate(holders)}
    spare = open_source(good[1].region.endpoint(), agent=made[1])
    try:
        rd = ReshardRead(region, rp, [h.placement for h in holders], version=VERSION, config=CFG, spread=1)
        for shard in rd.shards:
            rd.read(shard, sources[shard])
        bad = rd.verify(grid, sums)
        assert [b.shard for b in bad] == [1] and len(bad[0].cells) == 1
        with pytest.raises(ChecksumMismatch, match=r"holder shards \[1\]"):
            rd.check(grid, sums)
        assert 1 not in rd.done and rd.units_done() < region.layout.unit_count
        with pytest.raises(InvalidState, match=r"\[1\] are not read"):
            rd.publish()
        rd.read(1, spare)  # the failover of that shard alone
        rd.check(grid, sums)
        rd.publish()
        for t, want in zip(region.tensors, truth):
            assert np.array_equal(_bytes(t), _bytes(want))
    finally:
        flat[5] = old
        for s in [*sources.values(), spare]:
            s.close()
        region.close()


def test_a_holder_replica_that_does_not_cover_the_reader_is_refused_before_anything_moves(agents):
    holders, rp, region, _, _, _ = _world(agents, "rows -> columns")
    try:
        with pytest.raises(LayoutMismatch, match="does not hold what the reader needs"):
            ReshardRead(region, rp, [holders[0].placement], version=VERSION, config=CFG)
        assert all((_bytes(t) == SENTINEL).all() for t in region.tensors)
    finally:
        region.close()


def test_a_dtype_conversion_is_not_a_reshard(agents):
    holders, _, region, _, _, _ = _world(agents, "rows -> columns")
    region.close()
    rp16 = CASES["rows -> columns"][1](_schema("bfloat16"))
    tensors = [torch.zeros(t.shape, dtype=torch.bfloat16) for t in rp16.tensors]
    r16 = Region.register(tensors, _layout(rp16, tensors), CFG.replace(same_host=False), agent=agents[0][1])
    try:
        with pytest.raises(LayoutMismatch, match="bfloat16|float32"):
            ReshardRead(r16, rp16, [h.placement for h in holders], version=VERSION, config=CFG)
    finally:
        r16.close()


def test_the_reader_placement_must_be_its_regions_layout_and_a_shard_must_be_needed(agents):
    holders, rp, region, _, _, _ = _world(agents, "whole -> fused qkv TP=4")
    try:
        other = CASES["rows -> columns"][1](_schema())
        with pytest.raises(LayoutMismatch):
            ReshardRead(region, other, [h.placement for h in holders], version=VERSION, config=CFG)
        rd = ReshardRead(region, rp, [h.placement for h in holders], version=VERSION, config=CFG)
        assert rd.shards == (0,)
        with pytest.raises(InvalidState, match="nothing this reader needs"):
            rd.read(1, None)
    finally:
        region.close()


def test_a_holder_of_another_version_leaves_the_shard_not_done(agents):
    from tensorhub.errors import TransferError
    holders, rp, region, _, _, _ = _world(agents, "rows -> columns")
    src = shm.ShmSource(holders[0].region.endpoint().shm)
    try:
        holders[0].region.publish_complete(VERSION + 1)
        rd = ReshardRead(region, rp, [h.placement for h in holders], version=VERSION, config=CFG)
        with pytest.raises(TransferError):
            rd.read(0, src)
        assert rd.done == set() and rd.units_done() == 0
    finally:
        holders[0].region.publish_complete(VERSION)
        src.close()
        region.close()


def test_a_placement_whose_tensor_is_whole_reads_it_as_one_run(agents):
    """The same-placement case is today's copy: one run per local tensor, no strided reads."""
    holders, rp, region, _, _, _ = _world(agents, "rows -> rows (same)")
    try:
        rd = ReshardRead(region, rp, [h.placement for h in holders], version=VERSION, config=CFG, spread=1)
        assert rd.shards == (1,) and all(r.count == 1 for r in rd.plan.runs)
        assert len(rd.plan.runs) == len(rp.tensors)
    finally:
        region.close()


@pytest.mark.parametrize("tier", ["nixl", "same_host"])
@pytest.mark.parametrize("case", ["rows -> fused qkv TP=2", "columns -> quarters", "uneven -> columns"])
def test_run_overlaps_the_hashing_with_the_reads_and_publishes_the_same_checksums(agents, case, tier):
    holders, rp, region, truth, grid, sums = _world(agents, case)
    sources = _sources(agents, holders, tier)
    try:
        rd = ReshardRead(region, rp, [h.placement for h in holders], version=VERSION, config=CFG, spread=1)
        # batches smaller than most tensors: one per tensor or so, hashed while the next is read
        assert rd.run(sources, grid, sums, batch_bytes=16 << 10) == region.layout.total_bytes
        assert rd.done == set(rd.shards) and rd.units_done() == region.layout.unit_count
        rd.publish()
        _assert_published(region, truth)
    finally:
        for s in sources.values():
            s.close()
        region.close()


def test_run_names_a_corrupt_shard_after_every_read_ended_and_a_failover_recomputes_the_sums(agents):
    case = "rows -> fused qkv TP=2"
    holders, rp, region, truth, grid, sums = _world(agents, case)
    good, _, region2, _, _, _ = _world(agents, case, copy=1)
    region2.close()
    made = agents[0]
    flat = _bytes(holders[1].tensors[-1])
    old = flat[-1].copy()
    flat[-1] ^= 0x01
    sources = {i: open_source(h.region.endpoint(), agent=made[1]) for i, h in enumerate(holders)}
    spare = open_source(good[1].region.endpoint(), agent=made[1])
    try:
        rd = ReshardRead(region, rp, [h.placement for h in holders], version=VERSION, config=CFG, spread=1)
        with pytest.raises(ChecksumMismatch, match=r"holder shards \[1\]"):
            rd.run(sources, grid, sums, batch_bytes=16 << 10)
        assert rd.done == {0} and region.settle(0.0)
        rd.read(1, spare)
        rd.check(grid, sums)
        rd.publish()
        assert region.checksums() == checksum_all(truth, region.layout), "not the sums of the corrupt bytes"
    finally:
        flat[-1] = old
        for s in [*sources.values(), spare]:
            s.close()
        region.close()


def test_run_advertises_the_checked_prefix_fetches_the_checksums_once_and_stops_at_a_bad_batch(agents):
    """``advertise``: the region says the version at progress 0 from the start and each batch
    checked clean extends the advertised prefix, with the units' checksums; the checksums come
    from a function called once (on the hashing thread). A corrupt byte in the last tensor stops
    the prefix before that tensor's units; the prefix advertised is the truth's."""
    case = "rows -> fused qkv TP=2"
    holders, rp, region, truth, grid, sums = _world(agents, case)
    flat = _bytes(holders[1].tensors[-1])
    old = flat[-1].copy()
    flat[-1] ^= 0x01
    sources = {i: open_source(h.region.endpoint(), agent=agents[0][1]) for i, h in enumerate(holders)}
    calls, seen = [], []
    real = ReshardRead._move

    def move(self, shard, source, runs, strided):
        seen.append((self.region.version, self.region.progress))
        return real(self, shard, source, runs, strided)

    def fetch():
        calls.append(region.progress)
        return sums
    try:
        rd = ReshardRead(region, rp, [h.placement for h in holders], version=VERSION, config=CFG, spread=1)
        ReshardRead._move = move
        with pytest.raises(ChecksumMismatch):
            rd.run(sources, grid, fetch, batch_bytes=16 << 10, advertise=True)
        assert calls == [0] and seen[0] == (VERSION, 0)
        progress = region.progress
        last = region.layout.index_of(rp.tensors[-1].name)
        first_unit_of_last = next(u for u, unit in enumerate(region.layout.units)
                                  if any(p.tensor_index == last for p in unit))
        assert 0 < progress <= first_unit_of_last, (progress, first_unit_of_last)
        assert region.checksums()[:progress] == checksum_all(truth, region.layout)[:progress]
        assert all(_unit_bytes_equal(region, truth, region.layout.units[u]) for u in range(progress))
        assert [p for _, p in seen] == sorted(p for _, p in seen)  # never goes back
    finally:
        ReshardRead._move = real
        flat[-1] = old
        for s in sources.values():
            s.close()
        region.close()


def test_run_with_a_source_missing_or_moved_on_leaves_that_shard_not_done(agents):
    from tensorhub.errors import TransferError
    holders, rp, region, _, grid, sums = _world(agents, "rows -> columns")
    sources = {i: shm.ShmSource(h.region.endpoint().shm) for i, h in enumerate(holders)}
    try:
        rd = ReshardRead(region, rp, [h.placement for h in holders], version=VERSION, config=CFG)
        with pytest.raises(InvalidState, match=r"no source for holder shards \[1\]"):
            rd.run({0: sources[0]}, grid, sums)
        holders[1].region.publish_complete(VERSION + 1)
        with pytest.raises(TransferError):
            rd.run(sources, grid, sums)
        assert 1 not in rd.done
    finally:
        holders[1].region.publish_complete(VERSION)
        for s in sources.values():
            s.close()
        region.close()


@pytest.mark.parametrize("tier", ["nixl", "same_host"])
def test_a_partial_holder_serves_the_runs_under_its_final_units_and_the_read_waits_for_the_rest(agents, tier):
    """Holder shard 0 is still receiving (its progress a prefix of its units): the reader reads
    what lies in that prefix at once and waits for the rest, then gets every byte right."""
    import threading
    import time as _time

    holders, rp, region, truth, grid, sums = _world(agents, "rows -> columns")
    h = holders[0]
    made = agents[0]
    src = (open_source(h.region.endpoint(), agent=made[1]) if tier == "nixl"
           else shm.ShmSource(h.region.endpoint().shm))
    units = h.layout.unit_count
    assert units >= 3, "the case needs a holder of several units"
    h.region.set_progress(1)  # version 3 with only its first unit final
    cfg = CFG.replace(source_stall_timeout_s=30.0)
    src1 = None
    try:
        rd = ReshardRead(region, rp, [x.placement for x in holders], version=VERSION, config=cfg)
        table = rd.holder_tensors(0, src).units
        assert table is not None and table.unit_count == units, "the holder's unit table is known"
        early = [r for r in rd.plan.runs if r.holder_shard == 0
                 and table.need(h.placement.names.index(r.holder_tensor),
                                r.holder_offset + (r.count - 1) * r.holder_stride + r.run_bytes) <= 1]
        assert early, "some runs lie in the holder's first unit"
        done = threading.Event()
        errors_seen = []

        def read():
            try:
                rd.read(0, src)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors_seen.append(e)
            done.set()

        t = threading.Thread(target=read)
        t.start()
        deadline = _time.monotonic() + 10
        dst = dict(zip(rp.names, region.tensors))
        want = dict(zip(rp.names, truth))

        def landed(r) -> bool:
            got, exp = _bytes(dst[r.reader_tensor]), _bytes(want[r.reader_tensor])
            return all(np.array_equal(got[r.reader_offset + i * r.reader_stride:][:r.run_bytes],
                                      exp[r.reader_offset + i * r.reader_stride:][:r.run_bytes])
                       for i in range(r.count))

        while not all(landed(r) for r in early) and _time.monotonic() < deadline:
            _time.sleep(0.01)
        assert all(landed(r) for r in early), "the runs under the final unit were read while the holder was partial"
        assert not done.is_set(), "the read waits for the holder's other units"
        for k in range(2, units + 1):
            h.region.set_progress(k)
            _time.sleep(0.02)
        assert done.wait(10) and not errors_seen, errors_seen
        src1 = (open_source(holders[1].region.endpoint(), agent=made[1]) if tier == "nixl"
                else shm.ShmSource(holders[1].region.endpoint().shm))
        rd.read(1, src1)
        rd.check(grid, sums)
        for got, exp in zip(region.tensors, truth):
            assert np.array_equal(_bytes(got), _bytes(exp))
    finally:
        h.region.publish_complete(VERSION)
        src.close()
        if src1 is not None:
            src1.close()  # left open, its scratch block stayed registered after it was freed
        region.close()


def test_a_partial_holder_that_moves_on_voids_the_read(agents):
    holders, rp, region, _, _, _ = _world(agents, "rows -> columns")
    h = holders[0]
    src = shm.ShmSource(h.region.endpoint().shm)
    h.region.set_progress(1)
    try:
        rd = ReshardRead(region, rp, [x.placement for x in holders], version=VERSION,
                         config=CFG.replace(source_stall_timeout_s=5.0))
        import threading

        t = threading.Timer(0.2, lambda: (h.region.set_progress(0), h.region.set_version(VERSION + 1)))
        t.start()
        from tensorhub.errors import TransferError
        with pytest.raises(TransferError, match="version 4"):
            rd.read(0, src)
        t.join()
        assert 0 not in rd.done
    finally:
        h.region.publish_complete(VERSION)
        src.close()
        region.close()


def test_a_failover_reads_only_the_units_not_checked_yet_from_a_replica_of_a_third_placement(agents, monkeypatch):
    """Rule 8. rows (2 shards) -> vLLM TP=2 rank 1, one tensor per batch (5 units, one per
    tensor): trainer shard 1 fails reading the third tensor, so qkv_proj and o_proj are kept,
    checked. The failover reads from an uneven 3-shard replica: only the other three tensors'
    bytes move; a byte damaged in that replica's copy of down is caught, naming its shard, and
    gate_up_proj and the norm are kept; the last failover, from the first replica again, moves
    down_proj's bytes alone. The reader ends exact, with today's unit checksums."""
    from tensorhub.errors import TransferError

    holders, rp, region, truth, _, _ = _world(agents, "rows -> fused qkv TP=2")
    uneven, _, other, _, _, _ = _world(agents, "uneven -> columns")
    other.close()
    lay = region.layout
    assert lay.unit_count == 5 and all(len(u) == 1 for u in lay.units)
    unit_of = {rp.tensors[u[0].tensor_index].name: i for i, u in enumerate(lay.units)}
    moved_by = {}
    real = ReshardRead._move
    calls = []

    def failing(self, shard, source, runs, strided):
        if shard == 1 and sum(c == 1 for c in calls) == 2:
            raise TransferError("trainer shard 1 died")
        calls.append(shard)
        return real(self, shard, source, runs, strided)

    def sums_of(hs):
        grid = grid_of([rp, *[h.placement for h in hs]])
        out = {}
        for h in hs:
            out.update(cell_checksums(dict(zip(h.placement.names, h.tensors)), h.placement, grid))
        return grid, out
    made = agents[0]
    opened = []

    def sources_of(hs):
        out = {i: open_source(h.region.endpoint(), agent=made[1]) for i, h in enumerate(hs)}
        opened.extend(out.values())
        return out
    down = uneven[1].placement.names.index("down")
    flat = _bytes(uneven[1].tensors[down])
    at = 100 * 4  # row 0, column 100 of uneven shard 1's down: in the reader's columns [80, 160)
    old = flat[at].copy()
    try:
        rd = ReshardRead(region, rp, [h.placement for h in holders], version=VERSION, config=CFG, spread=1)
        monkeypatch.setattr(ReshardRead, "_move", failing)
        grid, sums = sums_of(holders)
        with pytest.raises(TransferError):
            rd.run(sources_of(holders), grid, sums, batch_bytes=1, advertise=True)
        monkeypatch.setattr(ReshardRead, "_move", real)
        kept = rd.kept()
        assert rd.failed_shard == 1 and kept.units == {unit_of["qkv_proj"], unit_of["o_proj"]}
        assert region.progress == 2 and region.checksums()[:2] == checksum_all(truth, lay)[:2]

        grid, sums = sums_of(uneven)
        flat[at] ^= 0x01  # the holder's checksums are of the right bytes; its memory is damaged
        rd2 = ReshardRead(region, rp, [h.placement for h in uneven], version=VERSION, config=CFG, spread=1, kept=kept)
        left = sum(lay.unit_nbytes(u) for u in range(5) if u not in kept.units)
        from tensorhub.core.reshard import plan_bytes
        assert plan_bytes(rd2.plan) == left
        with pytest.raises(ChecksumMismatch, match=r"holder shards \[1\]"):
            moved_by["uneven"] = rd2.run(sources_of(uneven), grid, sums, batch_bytes=1, advertise=True)
        assert rd2.bytes_read == left
        kept2 = rd2.kept()
        assert kept2.units == set(range(5)) - {unit_of["down_proj"]}
        flat[at] = old

        grid, sums = sums_of(holders)
        rd3 = ReshardRead(region, rp, [h.placement for h in holders], version=VERSION, config=CFG, spread=1, kept=kept2)
        srcs = sources_of(holders)
        assert rd3.run(srcs, grid, sums, batch_bytes=1, advertise=True) == lay.unit_nbytes(unit_of["down_proj"])
        rd3.publish()
        _assert_published(region, truth)
    finally:
        flat[at] = old
        for s in opened:
            s.close()
        region.close()


def test_a_holder_shard_writing_only_kept_units_is_not_needed_and_kept_units_of_another_version_count_for_nothing(agents):
    """rows (2 shards) -> vLLM TP=2 rank 1: with every unit trainer shard 0 writes into kept,
    the read needs trainer shard 1 alone, and moves the other units' bytes only."""
    from tensorhub.core.reshard import plan_bytes
    from tensorhub.transport.reshard_read import Kept

    holders, rp, region, truth, grid, sums = _world(agents, "rows -> fused qkv TP=2")
    try:
        placements = [h.placement for h in holders]
        rd = ReshardRead(region, rp, placements, version=VERSION, config=CFG, spread=1)
        assert rd.shards == (0, 1)
        touched0 = frozenset(u for u, w in enumerate(rd._unit_shards) if 0 in w)
        assert 0 < len(touched0) < region.layout.unit_count
        rd2 = ReshardRead(region, rp, placements, version=VERSION, config=CFG, spread=1,
                          kept=Kept(VERSION, touched0, {}))
        assert rd2.shards == (1,)
        assert plan_bytes(rd2.plan) == sum(region.layout.unit_nbytes(u) for u in range(region.layout.unit_count)
                                           if u not in touched0)
        stale = ReshardRead(region, rp, placements, version=VERSION, config=CFG, spread=1,
                            kept=Kept(VERSION + 1, touched0, {}))
        assert stale.shards == (0, 1) and not stale.checked and stale.plan == rd.plan
    finally:
        region.close()
