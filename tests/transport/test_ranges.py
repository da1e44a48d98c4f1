"""Range reads (tensorhub.transport.ranges): a resharding plan's runs carried out from each holder
shard straight into the reader's registered tensors, by NIXL (two agents in one process) and by
the same-host tier (the holder's memory mapped here).

    holder shard 0 --\\
                      >-- runs (plan_reshard) --> reader's own tensors
    holder shard 1 --/

Every test compares bytes: after each shard, the reader holds exactly the expected bytes of the
runs from the shards done so far (the reference executor ``apply_plan`` says which) and its
sentinel bytes everywhere else; after all shards, exactly its own slice of the global tensors.

Holder regions stay registered for the whole module (one set per case), and a test that closes
a holder uses an agent of its own: NIXL keeps the ranges of a peer's metadata it loaded before,
deregistered ones included (``Agent.ensure_remote`` loads newer metadata over the old), so a
holder agent that registers new memory at addresses it had registered and released before is
then refused by the reader's agent with NIXL_ERR_NOT_FOUND (seen here when every test registered
and closed its own holders; a fresh ``add_remote_agent`` of the peer cured it).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tensorhub import placement as P
from tensorhub.config import Config
from tensorhub.core.reshard import ReshardPlan, Run, apply_plan, plan_reshard
from tensorhub.errors import LayoutMismatch, ReadsNotTerminal, SourceStalled, TransferError
from tensorhub.layout import Layout, checksum_all
from tensorhub.transport import Agent, Region, open_source, shm
from tensorhub.transport.ranges import HolderTensors, copy_runs, range_descs, read_runs, runs_of

CFG = Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10, reads_in_flight=4, source_stall_timeout_s=2.0)
SENTINEL = 0xA5


_HOLDERS: dict[tuple, list] = {}
"""Holder shards per (case, dtype, same_host), registered once (see the module doc)."""


@pytest.fixture(scope="module")
def agents():
    """Holders on agent 0, readers on agent 1, agent 2 for a test that closes its holder."""
    yield [Agent(CFG, name=f"test-ranges-agent-{i}") for i in range(3)]
    for hs in _HOLDERS.values():
        for h in hs:
            h.region.close()
    _HOLDERS.clear()


# --------------------------------------------------------------------------- placements


def _schema(dtype="float32"):
    h, kv, inter = 96, 32, 160
    return P.Schema.of([P.GlobalTensor(n, dtype, s) for n, s in [
        ("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h)),
        ("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter)), ("norm", (h,))]])


def _rows(schema, rank, n):
    """FSDP-like: every tensor cut by rows into n shards."""
    return P.Placement.build([P.split(t, 0, rank, n) for t in schema.tensors], schema)


def _columns(schema, rank, n):
    """Every 2-D tensor cut by columns (the norm by rows)."""
    return P.Placement.build([P.split(t, len(t.shape) - 1, rank, n) for t in schema.tensors], schema)


def _uneven(schema, rank):
    sizes = {n: (lambda d: [d // 3, d - d // 3 - 5, 5])(g.shape[0]) for n, g in schema.by_name().items()}
    return P.Placement.build([P.split_sizes(t, 0, sizes[t.name], rank) for t in schema.tensors], schema)


def _vllm(schema, rank, tp):
    g = schema.by_name()
    return P.Placement.build([
        P.fused("qkv_proj", [(g["q"], 0, rank, tp), (g["k"], 0, rank, tp), (g["v"], 0, rank, tp)]),
        P.split(g["o"], 1, rank, tp, name="o_proj"),
        P.fused("gate_up_proj", [(g["gate"], 0, rank, tp), (g["up"], 0, rank, tp)]),
        P.split(g["down"], 1, rank, tp, name="down_proj"),
        P.whole(g["norm"]),
    ], schema)


CASES = {
    # name: (holder placements, reader placement)
    "rows -> rows (same)": (lambda s: [_rows(s, r, 2) for r in range(2)], lambda s: _rows(s, 1, 2)),
    "rows -> rows (2 -> 3)": (lambda s: [_rows(s, r, 2) for r in range(2)], lambda s: _uneven(s, 1)),
    "rows -> columns": (lambda s: [_rows(s, r, 2) for r in range(2)], lambda s: _columns(s, 1, 2)),
    "columns -> quarters": (lambda s: [_columns(s, r, 2) for r in range(2)], lambda s: _columns(s, 2, 4)),
    "rows -> fused qkv TP=2": (lambda s: [_rows(s, r, 2) for r in range(2)], lambda s: _vllm(s, 1, 2)),
    "whole -> fused qkv TP=4": (lambda s: [P.whole_placement(s)], lambda s: _vllm(s, 3, 4)),
    "uneven -> columns": (lambda s: [_uneven(s, r) for r in range(3)], lambda s: _columns(s, 0, 4)),
}


def _globals(schema, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in schema.tensors:
        dt = getattr(torch, t.dtype)
        out[t.name] = torch.randn(t.shape, generator=g).to(dt)
    return out


def _local(lp: P.LocalPlacement, globals_) -> torch.Tensor:
    """The local tensor ``lp`` cut out of the global tensors (the truth to compare with)."""
    out = torch.empty(lp.shape, dtype=getattr(torch, lp.dtype))
    for p in lp.pieces:
        chunk = globals_[p.tensor][tuple(slice(a, b) for a, b in zip(p.box.start, p.box.stop))]
        if not lp.shape:
            out.copy_(chunk)
        elif p.stack:
            out[p.row0] = chunk
        else:
            out[p.row0:p.row0 + p.rows] = chunk
    return out


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def _layout(pl: P.Placement, tensors):
    return Layout.build(list(zip(pl.names, tensors)), CFG.unit_bytes, CFG.pack_below_bytes)


class _Side:
    """One placement's tensors registered as a region (holders: published complete, version 3)."""

    def __init__(self, agent, pl, tensors, cfg=CFG, publish=True):
        self.placement, self.tensors = pl, tensors
        self.layout = _layout(pl, tensors)
        self.region = Region.register(tensors, self.layout, cfg, agent=agent)
        if publish:
            self.region.publish_complete(3, checksum_all(tensors, self.layout))

    @property
    def holder(self) -> HolderTensors:
        return HolderTensors.of(self.placement.names, self.region.endpoint().tensors)


def _setup(agents, case, dtype="float32", holder_cfg=CFG, own_agent=None):
    """Holders (cached, unless on ``own_agent``: the caller closes those), a fresh reader with
    sentinel bytes, the plan, and the reader's true tensors."""
    schema = _schema(dtype)
    holders_of, reader_of = CASES[case]
    hp, rp = holders_of(schema), reader_of(schema)
    gl = _globals(schema)
    key = (case, dtype, holder_cfg.same_host)
    if own_agent is not None:
        holders = [_Side(own_agent, h, [_local(t, gl) for t in h.tensors], holder_cfg) for h in hp]
    else:
        if key not in _HOLDERS:
            _HOLDERS[key] = [_Side(agents[0], h, [_local(t, gl) for t in h.tensors], holder_cfg) for h in hp]
        holders = _HOLDERS[key]
        for h in holders:  # as published: a test may have changed its control block
            h.region.publish_complete(3)
    reader = _Side(agents[1], rp, [torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in rp.tensors],
                   CFG.replace(same_host=False), publish=False)
    for t in reader.tensors:
        _bytes(t)[:] = SENTINEL
    plan = plan_reshard(rp, hp, spread=1).require_complete()
    truth = [_local(t, gl) for t in rp.tensors]
    return holders, reader, plan, truth


def _close(holders, reader, sources=()):
    """Close the sources and the reader; the holders stay registered (see the module doc)."""
    for s in sources:
        s.close()
    reader.region.close()


def _expected_after(plan, shards, reader, holders):
    """Sentinel bytes, then the runs of ``shards`` applied by the reference executor."""
    out = {n: np.full(_bytes(t).shape, SENTINEL, dtype=np.uint8) for n, t in zip(reader.placement.names, reader.tensors)}
    sub = ReshardPlan(tuple(r for r in plan.runs if r.holder_shard in shards))
    apply_plan(sub, out, [{n: _bytes(t) for n, t in zip(h.placement.names, h.tensors)} for h in holders])
    return out


def _assert_reader(reader, expected):
    for n, t in zip(reader.placement.names, reader.tensors):
        got, want = _bytes(t), expected[n]
        bad = np.flatnonzero(got != want)
        assert not len(bad), f"{n}: {len(bad)} bytes differ, first at {bad[0]}"


# --------------------------------------------------------------------------- NIXL


@pytest.mark.parametrize("strided", ["rows", "multi"])
@pytest.mark.parametrize("case", list(CASES))
def test_nixl_range_reads_from_each_holder_shard_land_exactly_the_planned_bytes(agents, case, strided):
    holders, reader, plan, truth = _setup(agents, case)
    sources = [open_source(h.region.endpoint(), agent=agents[1]) for h in holders]
    try:
        if not case.startswith("rows -> rows"):
            assert any(r.count > 1 for r in plan.runs), "the case has strided runs"
        done = set()
        for shard, (h, src) in enumerate(zip(holders, sources)):
            runs = runs_of(plan, shard)
            # small requests: many of them, several in flight, rows cut and packed
            n = read_runs(reader.region, src, runs, h.holder, expect_version=3, config=CFG, strided=strided,
                          request_bytes=8 << 10)
            assert n == sum(r.nbytes for r in runs)
            done.add(shard)
            _assert_reader(reader, _expected_after(plan, done, reader, holders))
        for t, want in zip(reader.tensors, truth):
            assert np.array_equal(_bytes(t), _bytes(want))
        assert reader.region.settle(0.0) and reader.region.unsettled_ranges == 0
        assert reader.region.version == -1, "range reads leave the reader's control block alone"
    finally:
        _close(holders, reader, sources)


def test_bf16_columns_with_default_request_size(agents):
    holders, reader, plan, truth = _setup(agents, "rows -> columns", dtype="bfloat16")
    sources = [open_source(h.region.endpoint(), agent=agents[1]) for h in holders]
    try:
        for shard, (h, src) in enumerate(zip(holders, sources)):
            read_runs(reader.region, src, runs_of(plan, shard), h.holder, expect_version=3, config=CFG)
        for t, want in zip(reader.tensors, truth):
            assert np.array_equal(_bytes(t), _bytes(want))
    finally:
        _close(holders, reader, sources)


def test_range_descs_address_each_row():
    from tensorhub.transport.nixl import MemRegion
    d = range_descs(MemRegion(1000, 4096, "DRAM", 2), 16, 8, count=4, stride=100, first=1)
    assert d.tolist() == [[1116, 8, 2], [1216, 8, 2], [1316, 8, 2]]


@pytest.mark.parametrize("bad, match", [
    (Run("q", 0, 0, "q", 0, 1 << 20), "writes past reader tensor"),
    (Run("q", 0, 0, "q", 0, 64, count=10_000, reader_stride=64, holder_stride=1 << 20), "past"),
    (Run("nope", 0, 0, "q", 0, 4), "reader has no local tensor 'nope'"),
    (Run("q", 0, 0, "nope", 0, 4), "holder has no local tensor 'nope'"),
])
def test_a_run_outside_either_tensor_is_refused_before_anything_moves(agents, bad, match):
    holders, reader, plan, _ = _setup(agents, "rows -> columns")
    src = open_source(holders[0].region.endpoint(), agent=agents[1])
    try:
        good = runs_of(plan, 0)
        with pytest.raises(LayoutMismatch, match=match):
            read_runs(reader.region, src, good + (bad,), holders[0].holder, expect_version=3, config=CFG)
        with pytest.raises(LayoutMismatch, match=match):
            copy_runs(reader.region, shm.LocalSource(holders[0].region, "local"), good + (bad,),
                      holders[0].holder, expect_version=3)
        _assert_reader(reader, _expected_after(plan, set(), reader, holders))  # nothing moved
    finally:
        _close(holders, reader, [src])


def test_a_holder_of_another_version_is_refused_or_waited_for_boundedly(agents):
    holders, reader, plan, _ = _setup(agents, "rows -> columns")
    src = open_source(holders[0].region.endpoint(), agent=agents[1])
    args = (reader.region, src, runs_of(plan, 0), holders[0].holder)
    try:
        with pytest.raises(TransferError, match="newer"):
            read_runs(*args, expect_version=2, config=CFG)
        t0 = time.monotonic()
        with pytest.raises(SourceStalled):
            read_runs(*args, expect_version=4, config=CFG.replace(source_stall_timeout_s=0.2))
        assert time.monotonic() - t0 < 1.5
        holders[0].region.set_progress(1)  # partial: not served yet
        with pytest.raises(SourceStalled, match="1 of"):
            read_runs(*args, expect_version=3, config=CFG.replace(source_stall_timeout_s=0.2))
        _assert_reader(reader, _expected_after(plan, set(), reader, holders))
    finally:
        _close(holders, reader, [src])


class _Scripted:
    """The reader agent's nixl_agent, with the n-th request posted replaced by ``fake`` (or a
    hook called after the n-th post); everything else goes to the real agent."""

    def __init__(self, real, at, fake=None, after_post=None):
        self._real, self.at, self.fake, self.after_post = real, at, fake, after_post
        self.posts = 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def initialize_xfer(self, *args, **kwargs):
        self.posts += 1
        if self.posts == self.at and self.fake is not None:
            return self.fake
        return self._real.initialize_xfer(*args, **kwargs)

    def transfer(self, h, *args, **kwargs):
        if h is self.fake:
            return h.state
        state = self._real.transfer(h, *args, **kwargs)
        if self.posts == self.at and self.after_post is not None:
            self.after_post()
        return state

    def check_xfer_state(self, h):
        return h.state if h is self.fake else self._real.check_xfer_state(h)


class _FakeRead:
    def __init__(self, state="PROC"):
        self.state, self.released_in = state, None

    def release(self):
        assert self.released_in is None, "released twice"
        self.released_in = self.state


def test_a_holder_closed_mid_way_is_a_transfer_error_with_nothing_left_in_flight(agents, monkeypatch):
    """The holder deregisters its memory and the reader drops the peer after the 3rd request was
    posted: later requests cannot be posted (TransferError), every posted one is terminal and
    released, nothing is kept with the region."""
    holders, reader, plan, _ = _setup(agents, "rows -> columns", own_agent=agents[2])
    src = open_source(holders[0].region.endpoint(), agent=agents[1])
    h0 = holders[0]

    def gone():
        h0.region.close()
        agents[1].forget_remote(src.name)

    nx = _Scripted(agents[1].nixl, 3, after_post=gone)
    monkeypatch.setattr(agents[1], "nixl", nx)
    try:
        with pytest.raises(TransferError, match="range request"):
            read_runs(reader.region, src, runs_of(plan, 0), h0.holder, expect_version=3,
                      config=CFG, request_bytes=4 << 10)
        assert nx.posts >= 3
        assert reader.region.settle(0.0) and reader.region.unsettled_ranges == 0
    finally:
        monkeypatch.undo()
        src.close()
        reader.region.close()
        holders[1].region.close()


def test_a_failed_request_is_a_transfer_error_and_the_others_are_drained(agents, monkeypatch):
    holders, reader, plan, _ = _setup(agents, "rows -> columns")
    src = open_source(holders[0].region.endpoint(), agent=agents[1])
    fake = _FakeRead("ERR")
    monkeypatch.setattr(agents[1], "nixl", _Scripted(agents[1].nixl, 2, fake=fake))
    try:
        with pytest.raises(TransferError, match="failed"):
            read_runs(reader.region, src, runs_of(plan, 0), holders[0].holder, expect_version=3,
                      config=CFG, request_bytes=4 << 10)
        assert fake.released_in == "ERR" and reader.region.unsettled_ranges == 0
    finally:
        monkeypatch.undo()
        _close(holders, reader, [src])


def test_a_request_stuck_in_flight_is_never_released_and_blocks_the_region_until_it_lands(agents, monkeypatch):
    """A READ that never ends: SourceStalled within the stall timeout, then ReadsNotTerminal
    (from it); the region keeps the read, refuses further range reads and pulls, and releases it
    once it is terminal (settle). Then a new read of the same runs repairs every byte."""
    holders, reader, plan, truth = _setup(agents, "rows -> columns")
    src = open_source(holders[0].region.endpoint(), agent=agents[1])
    cfg = CFG.replace(source_stall_timeout_s=0.3)
    stuck = _FakeRead()
    monkeypatch.setattr(agents[1], "nixl", _Scripted(agents[1].nixl, 2, fake=stuck))
    args = (reader.region, src, runs_of(plan, 0), holders[0].holder)
    try:
        t0 = time.monotonic()
        with pytest.raises(ReadsNotTerminal) as err:
            read_runs(*args, expect_version=3, config=cfg, request_bytes=4 << 10)
        assert time.monotonic() - t0 < 2.0
        assert isinstance(err.value.__cause__, SourceStalled)
        assert stuck.released_in is None and reader.region.unsettled_ranges == 1
        assert not reader.region.settle(0.0)
        with pytest.raises(ReadsNotTerminal):
            read_runs(*args, expect_version=3, config=cfg)
        threading.Timer(0.05, lambda: setattr(stuck, "state", "DONE")).start()
        assert reader.region.settle(2.0) and stuck.released_in == "DONE"
        monkeypatch.undo()
        for shard, h in enumerate(holders):
            s = src if shard == 0 else open_source(h.region.endpoint(), agent=agents[1])
            read_runs(reader.region, s, runs_of(plan, shard), h.holder, expect_version=3, config=cfg)
            if s is not src:
                s.close()
        for t, want in zip(reader.tensors, truth):
            assert np.array_equal(_bytes(t), _bytes(want))
    finally:
        monkeypatch.undo()
        _close(holders, reader, [src])


# --------------------------------------------------------------------------- same host


@pytest.mark.parametrize("case", list(CASES))
def test_same_host_range_copies_land_exactly_the_planned_bytes(agents, case):
    holders, reader, plan, truth = _setup(agents, case)
    sources = [shm.ShmSource(h.region.endpoint().shm) for h in holders]
    try:
        done = set()
        for shard, (h, src) in enumerate(zip(holders, sources)):
            runs = runs_of(plan, shard)
            assert copy_runs(reader.region, src, runs, h.holder, expect_version=3) == sum(r.nbytes for r in runs)
            done.add(shard)
            _assert_reader(reader, _expected_after(plan, done, reader, holders))
        for t, want in zip(reader.tensors, truth):
            assert np.array_equal(_bytes(t), _bytes(want))
    finally:
        _close(holders, reader, sources)


def test_same_host_copies_from_a_region_of_this_process(agents):
    holders, reader, plan, truth = _setup(agents, "rows -> fused qkv TP=2", dtype="bfloat16",
                                          holder_cfg=CFG.replace(same_host=False))
    try:
        for shard, h in enumerate(holders):
            copy_runs(reader.region, shm.LocalSource(h.region, f"local{shard}"), runs_of(plan, shard), h.holder,
                      expect_version=3)
        for t, want in zip(reader.tensors, truth):
            assert np.array_equal(_bytes(t), _bytes(want))
    finally:
        _close(holders, reader)


def test_same_host_copy_from_a_holder_of_another_version_is_void(agents):
    holders, reader, plan, _ = _setup(agents, "rows -> columns")
    src = shm.ShmSource(holders[0].region.endpoint().shm)
    try:
        with pytest.raises(TransferError, match="version 3"):
            copy_runs(reader.region, src, runs_of(plan, 0), holders[0].holder, expect_version=4)
        holders[0].region.set_progress(0)  # partial: waited for, boundedly (no unit map: all units)
        with pytest.raises(SourceStalled, match="stayed at 0 final units"):
            copy_runs(reader.region, src, runs_of(plan, 0), holders[0].holder, expect_version=3,
                      config=CFG.replace(source_stall_timeout_s=0.2))
        _assert_reader(reader, _expected_after(plan, set(), reader, holders))
    finally:
        _close(holders, reader, [src])


def test_holder_tensors_must_match_the_endpoint(agents):
    holders, reader, plan, _ = _setup(agents, "rows -> columns")
    src = open_source(holders[0].region.endpoint(), agent=agents[1])
    try:
        with pytest.raises(LayoutMismatch):
            HolderTensors.of(holders[0].placement.names[:-1], holders[0].region.endpoint().tensors)
        wrong = HolderTensors(holders[0].holder.names, tuple(n + 1 for n in holders[0].holder.nbytes))
        with pytest.raises(LayoutMismatch, match="do not match"):
            read_runs(reader.region, src, runs_of(plan, 0), wrong, expect_version=3, config=CFG)
    finally:
        _close(holders, reader, [src])


_CHILD_HOLDER = (
    "import sys, torch\n"
    "from tensorhub.config import Config\n"
    "from tensorhub.layout import Layout\n"
    "from tensorhub.transport import Region, encode_endpoint\n"
    "t = torch.arange(1024 * 1024, dtype=torch.float32).view(1024, 1024)\n"
    "lay = Layout.build([('w', t)], 64 << 10, 16 << 10)\n"
    "r = Region.register([t], lay, Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10, same_host=False))\n"
    "r.publish_complete(3)\n"
    "sys.stdout.buffer.write(b'EP:' + encode_endpoint(r.endpoint()).hex().encode() + b'\\n'); sys.stdout.flush()\n"
    "sys.stdin.readline()\n"
)


def test_a_holder_process_killed_mid_way_is_a_transfer_error_with_nothing_left_in_flight(agents, monkeypatch):
    """The real case: the holder is another process, killed (SIGKILL) once the first request
    has landed. The read ends with a TransferError within the stall timeout; every request it
    posted is terminal and released."""
    import subprocess
    import sys

    from tensorhub.transport import decode_endpoint

    child = subprocess.Popen([sys.executable, "-c", _CHILD_HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    reader = None
    src = None
    try:
        line = b""
        while not line.startswith(b"EP:"):
            line = child.stdout.readline()
            assert line, "the child exited"
        ep = decode_endpoint(bytes.fromhex(line[3:].decode().strip()))
        g = P.GlobalTensor("w", "float32", (1024, 1024))
        schema = P.Schema.of([g])
        rp = P.Placement.build([P.split(g, 1, 1, 2)], schema)
        plan = plan_reshard(rp, [P.whole_placement(schema)])
        dst = torch.zeros(1024, 512)
        reader = Region.register([dst], _layout(rp, [dst]), CFG.replace(same_host=False), agent=agents[1])
        src = open_source(ep, agent=agents[1])
        real = agents[1].nixl
        done = []

        class KillAfterFirst(_Scripted):
            def check_xfer_state(self, h):
                state = self._real.check_xfer_state(h)
                if state == "DONE" and not done and h is not src._ctl_handle:  # a range request
                    done.append(h)
                    child.kill()
                    child.wait(10)
                return state

        monkeypatch.setattr(agents[1], "nixl", KillAfterFirst(real, 0))
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            read_runs(reader, src, plan.runs, HolderTensors(("w",), (ep.tensors[0].nbytes,)), expect_version=3,
                      config=CFG.replace(source_stall_timeout_s=3.0), request_bytes=16 << 10)
        assert time.monotonic() - t0 < 10 and done
        monkeypatch.undo()
        assert reader.settle(0.0) and reader.unsettled_ranges == 0
        truth = torch.arange(1024 * 1024, dtype=torch.float32).view(1024, 1024)[:, 512:]
        landed = (dst == truth).all(dim=1)
        assert landed.sum() >= 8, "the first request's rows landed"
        assert ((dst == truth) | (dst == 0)).all(), "no foreign bytes"
    finally:
        monkeypatch.undo()
        if child.poll() is None:
            child.kill()
        child.wait(10)
        if src is not None:
            src.close()
        if reader is not None:
            reader.close()
