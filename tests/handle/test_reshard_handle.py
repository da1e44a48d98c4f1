"""Resharded reads end to end (issue 24): real handles against an in-process server (LocalPort),
bytes over NIXL (or the same-host tier), cell checksums hashed by the holders on the server's
``HashCells`` and checked by the reader.

    model:   w [16, 8], b [16] (float32, every element distinct)
    trainer: 2 shards cut by rows          w[0:8], b[0:8]  |  w[8:16], b[8:16]
    cols:    2 shards (a TP=2 engine)      w[:, 0:4], b     |  w[:, 4:8], b
    whole:   1 shard                       w, b
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

import tensorhub
from tensorhub import errors
from tensorhub import placement as P
from tensorhub.core.placements import CLASS_SEP
from tensorhub.ports import LocalPort
from tensorhub.testing import inproc
from tensorhub.transport import reshard_read

SCHEMA = P.Schema.of([P.GlobalTensor("w", "float32", (16, 8)), P.GlobalTensor("b", "float32", (16,))])
G = SCHEMA.by_name()


def rows(k: int) -> P.Placement:
    return P.Placement.build([P.split(G["w"], 0, k, 2), P.split(G["b"], 0, k, 2)], SCHEMA)


def cols(k: int) -> P.Placement:
    return P.Placement.build([P.split(G["w"], 1, k, 2), P.whole(G["b"])], SCHEMA)


WHOLE = P.whole_placement(SCHEMA)


def global_w(version: int) -> torch.Tensor:
    return torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8) + 1000 * version


def global_b(version: int) -> torch.Tensor:
    return torch.arange(16, dtype=torch.float32) - 1000 * version


def local_of(p: P.Placement, version: int) -> list[tuple[str, torch.Tensor]]:
    """What a holder of placement ``p`` holds of ``version`` (each local tensor's single piece)."""
    full = {"w": global_w(version), "b": global_b(version)}
    out = []
    for t in p.tensors:
        (piece,) = t.pieces
        box = tuple(slice(a, z) for a, z in zip(piece.box.start, piece.box.stop))
        out.append((t.name, full[piece.tensor][box].contiguous().clone()))
    return out


@pytest.fixture(params=["nixl", "same_host"])
def cfg(request):
    return dataclasses.replace(inproc.CONFIG, same_host=request.param == "same_host")


@pytest.fixture
def port(cfg):
    return LocalPort(cfg)


def open_replica(port, cfg, replica, placements, version=None):
    hubs = []
    for k, p in enumerate(placements):
        hub = tensorhub.open("m", port=port, config=cfg, replica=replica, shard=k, num_shards=len(placements))
        named = local_of(p, version) if version is not None else [(n, torch.zeros_like(t)) for n, t in local_of(p, 0)]
        hub.register(named, placement=p)
        if version is not None:
            hub.publish(version)
        hubs.append((hub, named, p))
    return hubs


def replicate_all(hubs, spec="latest"):
    """Every shard of a replica replicates (concurrently, as a sharded replica's ranks do)."""
    out, errs = [None] * len(hubs), []

    def one(i):
        try:
            out[i] = hubs[i][0].replicate(spec)
        except Exception as e:  # noqa: BLE001 - handed to the test
            errs.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(hubs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errs:
        raise errs[0]
    return out


def assert_holds(hubs, version):
    for hub, named, p in hubs:
        for (name, got), (_, want) in zip(named, local_of(p, version)):
            assert torch.equal(got, want), (hub.client_id, name)


def close_all(*replicas):
    for hubs in replicas:
        for hub, _, _ in hubs:
            hub.close(drop_last_copy=True)


def test_readers_of_other_layouts_receive_exactly_their_slices_verified(port, cfg):
    trainer = open_replica(port, cfg, "trainer", [rows(0), rows(1)], version=3)
    tp2 = open_replica(port, cfg, "tp2", [cols(0), cols(1)])
    tp1 = open_replica(port, cfg, "tp1", [WHOLE])
    try:
        stats = replicate_all(tp2) + replicate_all(tp1)
        assert_holds(tp2, 3)
        assert_holds(tp1, 3)
        for st in stats:
            assert st.action == "replicated" and st.version == 3 and st.failovers == 0
            assert st.sources[0].startswith("m/trainer/")
        with port._lock:
            classes = port.core.table.classes["m"]
            assert len(classes) == 3 and all(CLASS_SEP in c for c in classes[1:])
            assert port.core.available(classes[1]) == [3] == port.core.available(classes[2])
            # Every trainer shard hashed its cells for each reader layout class's grid (tp2's
            # one, shared by its two ranks; tp1's one).
            kept = {hub.client_id: port.core.cells.kept.get(hub.client_id, {}) for hub, _, _ in trainer}
        assert all(len(v) == 2 and all(s for s in v.values()) for v in kept.values()), kept
    finally:
        close_all(tp1, tp2, trainer)


def test_a_retained_version_is_resharded_from_the_trainers_host_copies(port, cfg):
    """Engines that keep no retention copy (``retains=False``, vLLM's default) move on to version
    2; version 1 lives on only in the trainer's host copies (its offload at unpublish). An engine
    of another layout asking for version 1 (one that joined idle, or one restoring the version
    it ran) reshards it from those host copies, verified by the cell checksums the trainer sent
    while it held version 1: the host copies inherit them. (Nobody hashes a host copy: a grid its
    owner did not send while it held the version, e.g. of a layout class registered later, fails
    the read typed.)"""
    late = open_replica(port, cfg, "late", [WHOLE])  # its class exists: the trainer hashes its grid
    trainer = open_replica(port, cfg, "trainer", [rows(0), rows(1)])
    for hub, named, p in trainer:  # every shard registered before the first publishes (one grid)
        for (_, t), (_, want) in zip(named, local_of(p, 1)):
            t.copy_(want)
        hub.publish(1)
    tp2 = []
    for k, p in enumerate([cols(0), cols(1)]):
        hub = tensorhub.open("m", port=port, config=cfg, replica="tp2", shard=k, num_shards=2, retains=False)
        named = [(n, torch.zeros_like(t)) for n, t in local_of(p, 0)]
        hub.register(named, placement=p)
        tp2.append((hub, named, p))
    try:
        replicate_all(tp2, 1)
        assert_holds(tp2, 1)
        for hub, named, p in trainer:
            hub.unpublish()  # engines keep no copy: each trainer shard offloads version 1
            for (_, t), (_, want) in zip(named, local_of(p, 2)):
                t.copy_(want)
            hub.publish(2)
        for hub, _, _ in tp2:
            hub.unpublish()
        replicate_all(tp2, 2)
        assert_holds(tp2, 2)
        (st,) = replicate_all(late, 1)
        assert_holds(late, 1)
        assert st.version == 1 and all("#host1" in s for s in st.sources), st.sources
        for hub, _, _ in tp2:  # an engine goes back to version 1 (a restore): from the host copies too
            hub.unpublish()
        assert [st.version for st in replicate_all(tp2, 1)] == [1, 1]
        assert_holds(tp2, 1)
    finally:
        close_all(late, tp2, trainer)


def test_a_host_copy_is_hashed_by_its_owner_for_a_layout_that_came_later(port, cfg):
    """The trainer's shards publish version 1 one by one (the first before its sibling
    registered: the grid it hashed ahead is not the one readers use later), move on to 2 and keep
    1 in host copies; then an engine of a new layout asks for 1. The grid its read needs was
    never sent for those host copies: the server asks each owner's process (``HashCells`` with
    ``host``), which hashes its host copy, and the read completes verified."""
    trainer = open_replica(port, cfg, "trainer", [rows(0), rows(1)], version=1)
    late = []
    try:
        for hub, named, p in trainer:
            hub.unpublish()  # nobody else holds version 1: each shard offloads it
            for (_, t), (_, want) in zip(named, local_of(p, 2)):
                t.copy_(want)
            hub.publish(2)
        with port._lock:
            hosts = [n for n in port.core.nodes.values() if n.host]
            assert sorted(n.version for n in hosts) == [1, 1]
        late = open_replica(port, cfg, "late", [cols(0), cols(1)])
        stats = replicate_all(late, 1)
        assert_holds(late, 1)
        assert all(st.version == 1 and all("#host1" in s for s in st.sources) for st in stats), stats
        with port._lock:
            kept = {h.id: port.core.cells.kept.get(h.id, {}) for h in hosts}
        assert all(any(v is not None for v in entries.values()) for entries in kept.values()), kept
    finally:
        close_all(late, trainer)


def test_a_reader_of_the_same_layout_as_a_resharded_one_pipelines_from_it(port, cfg):
    trainer = open_replica(port, cfg, "trainer", [rows(0), rows(1)], version=1)
    first = open_replica(port, cfg, "first", [WHOLE])
    second = open_replica(port, cfg, "second", [WHOLE])
    try:
        replicate_all(first)
        (st,) = replicate_all(second)
        assert st.sources == (first[0][0].client_id,)  # a plain read, whole units, from `first`
        assert_holds(second, 1)
    finally:
        close_all(second, first, trainer)


def test_engines_that_name_their_layout_form_one_class_and_the_second_copies_whole_shards_from_the_first(port, cfg):
    """Two TP=2 engines whose ranks register interleaved (first rank 0, second rank 1, second
    rank 0, first rank 1) with ``layout_key``: one layout class, so after the first reshards
    from the trainer the second reads whole shards from it (a plain read per rank)."""
    trainer = open_replica(port, cfg, "trainer", [rows(0), rows(1)], version=1)
    first, second = [], []
    try:
        for replica, out, k in (("first", first, 0), ("second", second, 1), ("second", second, 0), ("first", first, 1)):
            hub = tensorhub.open("m", port=port, config=cfg, replica=replica, shard=k, num_shards=2)
            named = [(n, torch.zeros_like(t)) for n, t in local_of(cols(k), 0)]
            hub.register(named, placement=cols(k), layout_key="tp2")
            out.append((k, (hub, named, cols(k))))
        first = [h for _, h in sorted(first, key=lambda e: e[0])]
        second = [h for _, h in sorted(second, key=lambda e: e[0])]
        with port._lock:
            classes = {port.core.nodes[h.client_id].model for h, _, _ in first + second}
        assert classes == {f"m{CLASS_SEP}1"}
        replicate_all(first)
        stats = replicate_all(second)
        assert [st.sources for st in stats] == [(h.client_id,) for h, _, _ in first]
        assert_holds(second, 1)
    finally:
        close_all(second, first, trainer)


@pytest.mark.parametrize("key, placed, error", [("tp2", False, errors.ConfigError), (7, True, errors.OutOfBounds),
                                                ("k" * 10_000, True, errors.OutOfBounds)])
def test_a_bad_layout_key_is_refused_before_anything_is_registered(port, cfg, key, placed, error):
    hub = tensorhub.open("m", port=port, config=cfg, replica="r", shard=0, num_shards=2)
    try:
        with pytest.raises(error):
            hub.register(local_of(cols(0), 0), placement=cols(0) if placed else None, layout_key=key)
        with port._lock:
            assert not port.core.nodes
        hub.register(local_of(cols(0), 0), placement=cols(0), layout_key="tp2")  # the handle is unchanged
    finally:
        hub.close()


def test_bytes_damaged_in_transit_fail_the_shard_and_the_read_succeeds_again(port, cfg, monkeypatch, caplog):
    """The first read of a trainer shard flips one float: the cell check names that shard's
    holder (SourceFailed), the server plans again, the second read is clean."""
    trainer = open_replica(port, cfg, "trainer", [rows(0), rows(1)], version=2)
    tp1 = open_replica(port, cfg, "tp1", [WHOLE])
    real = reshard_read.ReshardRead._move
    damaged = []

    def move(self, shard, source, runs, strided):
        n = real(self, shard, source, runs, strided)
        if not damaged and shard == 1:
            damaged.append(shard)
            self.region.tensors[0][12, 3] += 1.0  # a byte of w that trainer shard 1 wrote
        return n
    monkeypatch.setattr(reshard_read.ReshardRead, "_move", move)
    try:
        (st,) = replicate_all(tp1)
        assert damaged == [1] and st.failovers == 1 and st.version == 2
        blamed = [r.getMessage() for r in caplog.records if "failed at unit" in r.getMessage()]
        assert len(blamed) == 1 and f"source {trainer[1][0].client_id} failed" in blamed[0], blamed
        assert_holds(tp1, 2)
    finally:
        close_all(tp1, trainer)


def test_a_reader_without_a_holder_of_its_layout_or_a_covering_replica_fails_typed(port, cfg):
    trainer = open_replica(port, cfg, "trainer", [rows(0), rows(1)], version=1)
    extra = P.GlobalTensor("extra", "float32", (4,))
    p = P.Placement.build([P.whole(G["w"]), P.whole(G["b"]), P.whole(extra)], P.Schema.of([G["w"], G["b"], extra]))
    hub = tensorhub.open("m", port=port, config=cfg, replica="odd", shard=0, num_shards=1)
    named = [("w", torch.zeros(16, 8)), ("b", torch.zeros(16)), ("extra", torch.zeros(4))]
    hub.register(named, placement=p)
    try:
        with pytest.raises(errors.VersionLost):
            hub.replicate(1)
        assert all(torch.count_nonzero(t) == 0 for _, t in named)
    finally:
        hub.close(drop_last_copy=True)
        close_all(trainer)


# ---------------------------------------------------------------------- failover keeps what is checked
#
#    model:   W [64, 64], B [64] (float32); 4 KiB units: the reader's W is 4 units of 16 rows, B one
#    trainer: 2 shards cut by rows      W[0:32], B[0:32]  |  W[32:64], B[32:64]
#    reader:  1 shard, whole            units 0-1 from trainer shard 0, 2-3 from shard 1, 4 from both

BIG = P.Schema.of([P.GlobalTensor("W", "float32", (64, 64)), P.GlobalTensor("B", "float32", (64,))])
BG = BIG.by_name()
SLICE = 64 * 64 * 4 + 64 * 4


def big_rows(k: int) -> P.Placement:
    return P.Placement.build([P.split(BG["W"], 0, k, 2), P.split(BG["B"], 0, k, 2)], BIG)


def big_cols(k: int) -> P.Placement:
    return P.Placement.build([P.split(BG["W"], 1, k, 2), P.whole(BG["B"])], BIG)


def big_local(p: P.Placement, version: int):
    full = {"W": torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64) + 10000 * version,
            "B": torch.arange(64, dtype=torch.float32) - 10000 * version}
    out = []
    for t in p.tensors:
        (piece,) = t.pieces
        out.append((t.name, full[piece.tensor][tuple(slice(a, z) for a, z in zip(piece.box.start, piece.box.stop))]
                    .contiguous().clone()))
    return out


@pytest.fixture
def big_cfg(cfg):
    return dataclasses.replace(cfg, unit_bytes=4096, unit_bytes_min=4096)


def open_big(port, cfg, replica, placements, version=None):
    hubs = []
    for k, p in enumerate(placements):
        hub = tensorhub.open("m", port=port, config=cfg, replica=replica, shard=k, num_shards=len(placements))
        named = big_local(p, version if version is not None else 0)
        if version is None:
            named = [(n, torch.zeros_like(t)) for n, t in named]
        hub.register(named, placement=p)
        if version is not None:
            hub.publish(version)
        hubs.append((hub, named, p))
    return hubs


def assert_big(hubs, version):
    for hub, named, p in hubs:
        for (name, got), (_, want) in zip(named, big_local(p, version)):
            assert torch.equal(got, want), (hub.client_id, name)


class Pulls:
    """Spies on every resharded pull's moves: per pull (a new ReshardRead), the holder shards
    it read and the bytes; ``fault(rd, shard, call)`` may raise or damage before a move."""

    def __init__(self, monkeypatch, fault=None):
        self.pulls: list[list[tuple[str, int]]] = []
        self.fault = fault
        real_init, real_move = reshard_read.ReshardRead.__init__, reshard_read.ReshardRead._move
        spy = self

        def init(rd, *args, **kw):
            real_init(rd, *args, **kw)
            rd._pull_no = len(spy.pulls)
            spy.pulls.append([])

        def move(rd, shard, source, runs, strided):
            if spy.fault is not None:
                spy.fault(rd, shard, rd._pull_no, len(spy.pulls[rd._pull_no]))
            n = real_move(rd, shard, source, runs, strided)
            spy.pulls[rd._pull_no].append((rd.holders[shard].digest(), n))
            return n
        monkeypatch.setattr(reshard_read.ReshardRead, "__init__", init)
        monkeypatch.setattr(reshard_read.ReshardRead, "_move", move)
        monkeypatch.setattr(reshard_read, "BATCH_BYTES", 1)  # one tensor per batch: W, then B

    def moved(self, pull: int) -> int:
        return sum(n for _, n in self.pulls[pull])


def test_a_damaged_range_rereads_only_its_cell_from_the_one_holder_shard_that_writes_it(port, big_cfg, monkeypatch):
    """Trainer shard 1's W rows land with a float damaged: the cell check (the grid cuts W at
    row 32 only: cell W[32:64], the reader's units 2-3) blames shard 1; the same replica is
    assigned again (there is no other), and the reread moves those 8 KiB from shard 1 alone
    (shard 0 writes only checked units: not contacted)."""
    trainer = open_big(port, big_cfg, "trainer", [big_rows(0), big_rows(1)], version=2)
    tp1 = open_big(port, big_cfg, "tp1", [P.whole_placement(BIG)])
    spy = Pulls(monkeypatch)
    real_move = reshard_read.ReshardRead._move

    def move(rd, shard, source, runs, strided):
        n = real_move(rd, shard, source, runs, strided)
        if rd._pull_no == 0 and shard == 1 and rd.region.tensors[0].shape == (64, 64) and runs[0].reader_tensor == "W":
            rd.region.tensors[0][35, 3] += 1.0  # a float of unit 2 (rows 32-47), from trainer shard 1
        return n
    monkeypatch.setattr(reshard_read.ReshardRead, "_move", move)
    try:
        (st,) = replicate_all(tp1)
        assert st.failovers == 1 and st.version == 2
        assert_big(tp1, 2)
        assert len(spy.pulls) == 2 and spy.moved(0) == SLICE
        assert spy.pulls[1] == [(big_rows(1).digest(), 8192)], spy.pulls[1]
        assert st.bytes == SLICE + 8192
    finally:
        close_all(tp1, trainer)


def test_a_holder_shard_failing_mid_read_is_replaced_and_only_the_missing_bytes_move(port, big_cfg, monkeypatch):
    """Trainer shard 1 fails reading B (W is in place and checked): the reader reads B alone
    again, from trainer shard 0 and the second replica's shard 1 (the failed shard swapped
    alone); then a float of B damaged from trainer shard 0 is caught and read again, from the
    second replica. Every byte ends exact; ReadStats counts what moved."""
    trainer = open_big(port, big_cfg, "trainer", [big_rows(0), big_rows(1)], version=2)
    spare = open_big(port, big_cfg, "spare", [big_rows(0), big_rows(1)], version=2)
    tp1 = open_big(port, big_cfg, "tp1", [P.whole_placement(BIG)])

    def fault(rd, shard, pull, calls):
        if pull == 0 and shard == 1 and calls == 3:  # W from 0 and 1, B from 0, then B from 1
            raise errors.SourceUnreachable("trainer shard 1 died")
    spy = Pulls(monkeypatch, fault)
    real_move = reshard_read.ReshardRead._move

    def move(rd, shard, source, runs, strided):
        n = real_move(rd, shard, source, runs, strided)
        if rd._pull_no == 1 and shard == 0:
            rd.region.tensors[1][5] += 1.0  # B[5], from the new source's shard 0
        return n
    monkeypatch.setattr(reshard_read.ReshardRead, "_move", move)
    try:
        (st,) = replicate_all(tp1)
        assert_big(tp1, 2)
        assert st.failovers == 2 and len(spy.pulls) == 3
        assert spy.moved(0) == SLICE - 128  # B's second half never came
        assert spy.moved(1) == spy.moved(2) == 256 < SLICE  # B alone, twice (the second time damaged)
        assert st.bytes == SLICE - 128 + 256 + 256
        # The per-shard swap: the failover kept trainer shard 0 and took shard 1 from spare (a
        # read over shards of two replicas); B damaged from trainer shard 0 then moved shard 0
        # to spare as well.
        assert [s.split("/")[1:3] for s in st.sources] == [["trainer", "0"], ["trainer", "0"], ["spare", "0"]], \
            st.sources
    finally:
        close_all(tp1, spare, trainer)


def test_a_failover_onto_a_replica_of_a_third_layout_reads_only_the_missing_bytes_exact(port, big_cfg, monkeypatch):
    """tp1 reads from the trainer (rows); trainer shard 1 fails reading B; the other replica
    that can fill tp1 is a TP=2 column-split engine (a third layout class): B alone is read from
    it, from the one shard the plan picks (both hold B whole), and tp1 ends exact."""
    trainer = open_big(port, big_cfg, "trainer", [big_rows(0), big_rows(1)], version=2)
    tp2 = open_big(port, big_cfg, "tp2", [big_cols(0), big_cols(1)])
    tp1 = open_big(port, big_cfg, "tp1", [P.whole_placement(BIG)])
    try:
        replicate_all(tp2)
        assert_big(tp2, 2)

        def fault(rd, shard, pull, calls):
            if pull == 0 and shard == 1 and calls == 3:
                raise errors.SourceUnreachable("trainer shard 1 died")
        spy = Pulls(monkeypatch, fault)
        (st,) = replicate_all(tp1)
        assert_big(tp1, 2)
        assert st.failovers == 1 and len(spy.pulls) == 2
        assert st.sources[-1].startswith("m/tp2/"), st.sources
        assert len(spy.pulls[1]) == 1 and spy.pulls[1][0][0] in {big_cols(0).digest(), big_cols(1).digest()}
        assert spy.moved(1) == 256 and st.bytes == SLICE - 128 + 256
    finally:
        close_all(tp1, tp2, trainer)


def test_cells_asked_before_the_handle_recorded_its_publish_are_still_hashed_and_sent():
    """Found by examples/reshard.py in CI: the server asks a holder for cell checksums when it
    publishes, and the note can reach the handle (on its pulse) before the publish's own reply.
    Such a note waits for the publish instead of being dropped (the readers waited for cells that
    never came: 7 failovers, TransferError). A note for a version the handle moved past is
    dropped at once."""
    from tensorhub.core import messages as m
    from tensorhub.core.cells import grid_key
    from tensorhub.handle.reshard import Resharding

    sent = []

    class Port:
        def call(self, msg):
            sent.append(msg)
            return m.Ok()

    state = {"published": None}
    named = local_of(rows(0), 3)
    res = Resharding(client_id="c", shard=0, config=inproc.CONFIG, port=Port(), placement=lambda: rows(0),
                     published=lambda: state["published"], held=lambda: ([t for _, t in named], None), sources=None)
    placements = (rows(0), rows(1), cols(0), cols(1))
    try:
        res.hash_asked(m.HashCells(3, grid_key(placements), placements))
        time.sleep(0.2)
        assert sent == []
        state["published"] = 3  # the publish's reply is handled now
        deadline = time.monotonic() + 5
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(s.version, s.grid) for s in sent] == [(3, grid_key(placements))] and sent[0].cells
        state["published"] = 4
        res.hash_asked(m.HashCells(3, grid_key(placements), placements))
        t0 = time.monotonic()
        res.stop()
        assert len(sent) == 1 and time.monotonic() - t0 < 1.0
    finally:
        res.stop()
