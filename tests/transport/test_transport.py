"""NIXL data path end to end, two or three agents in one process (UCX over shared memory).

Every test compares the received bytes with the source's bytes.
"""

import threading
import time

import pytest
import torch

from tensorhub.config import Config
from tensorhub.errors import (
    ChecksumMismatch,
    InvalidState,
    LayoutMismatch,
    ReadsNotTerminal,
    SourceStalled,
    TransferError,
)
from tensorhub.layout import Layout, checksum_all, checksum_unit
from tensorhub.transport import (
    Agent,
    Region,
    decode_endpoint,
    encode_endpoint,
    open_source,
    pull,
)
from tensorhub.transport import reader
from tensorhub.transport.agent import await_terminal
from tensorhub.transport.nixl import _unit_desc_index

CFG = Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10, reads_in_flight=4,
             source_stall_timeout_s=2.0)


@pytest.fixture(scope="module")
def agents():
    return [Agent(CFG, name=f"test-agent-{i}") for i in range(3)]


def _model(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    named = [(f"tiny{i}", torch.randn(100 + 13 * i, generator=g)) for i in range(30)]
    named += [
        ("big", torch.randn(400_000, generator=g)),
        ("empty", torch.empty(0)),
        ("bf16", torch.randn(30_000, generator=g).to(torch.bfloat16)),
        ("i8", torch.randint(-100, 100, (70_001,), dtype=torch.int8, generator=g)),
        ("last_tiny", torch.randn(5, generator=g)),
    ]
    return named


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same(src, dst):
    for (name, a), b in zip(src, dst):
        assert _bytes(a) == _bytes(b), name


@pytest.fixture
def setup(agents):
    """holder (agent 0) with a complete version 7, empty receiver tensors on agent 1."""
    named = _model()
    layout = Layout.build(named, CFG.unit_bytes, CFG.pack_below_bytes)
    src = [t for _, t in named]
    holder = Region.register(src, layout, CFG, agent=agents[0])
    holder.publish_complete(7, checksum_all(src, layout))
    dst = [torch.zeros_like(t) for t in src]
    recv = Region.register(dst, layout, CFG, agent=agents[1])
    source = open_source(encode_endpoint(holder.endpoint()), agent=agents[1])
    yield named, layout, holder, recv, source
    source.close()
    recv.close()
    holder.close()


def test_endpoint_roundtrips_through_msgpack(setup):
    _, layout, holder, _, _ = setup
    ep = holder.endpoint()
    assert decode_endpoint(encode_endpoint(ep)) == ep
    assert ep.unit_count == layout.unit_count and ep.fingerprint == layout.fingerprint


def test_read_control_sees_version_progress_and_checksums(setup):
    named, layout, holder, _, source = setup
    version, progress, sums = source.read_control()
    assert (version, progress) == (7, layout.unit_count)
    assert sums == checksum_all([t for _, t in named], layout)
    holder.set_progress(3)
    assert source.read_control()[1] == 3


def _spy_deregistrations(monkeypatch, nixl, watched) -> list:
    """(registration, whether ``watched()`` -- a weakref to the memory it covers -- was still
    alive) for each ``deregister_memory`` call on ``nixl`` from now on."""
    calls = []
    real = nixl.deregister_memory

    def spy(reg, *args, **kwargs):
        calls.append((reg, watched[0]() is not None))
        return real(reg, *args, **kwargs)
    monkeypatch.setattr(nixl, "deregister_memory", spy)
    return calls


def test_a_source_dropped_without_close_deregisters_its_scratch_block_before_it_is_freed(setup, agents, monkeypatch):
    """A Source garbage-collected without close() must not leave its control-read scratch block
    registered: the freed block is reused by later tensors, and NIXL refuses transfers into a
    registered tensor that a stale range overlaps (NIXL_ERR_NOT_FOUND: seen in test_reshard_read,
    where a source opened inline was never closed). A closed source deregisters once."""
    import gc
    import weakref

    _, _, holder, _, _ = setup
    watched = [lambda: None]
    calls = _spy_deregistrations(monkeypatch, agents[1].nixl, watched)

    src = open_source(holder.endpoint(), agent=agents[1])
    assert src.read_control()[0] == 7
    alive, reg = weakref.ref(src._scratch), src._scratch_reg
    watched[0] = alive
    del src
    gc.collect()
    assert [(r is reg, was_alive) for r, was_alive in calls] == [(True, True)], "deregistered once, before the free"
    assert alive() is None

    calls.clear()
    src = open_source(holder.endpoint(), agent=agents[1])
    alive, reg = weakref.ref(src._scratch), src._scratch_reg
    watched[0] = alive
    src.close()
    del src
    gc.collect()
    assert [r is reg for r, _ in calls] == [True] and alive() is None


def test_a_region_dropped_without_close_deregisters_its_memory_before_it_is_freed(agents, monkeypatch):
    """The same for a Region: one garbage-collected without close() deregisters its tensors'
    range and its control block while they are alive; a closed one deregisters them once."""
    import gc
    import weakref

    watched = [lambda: None]
    calls = _spy_deregistrations(monkeypatch, agents[1].nixl, watched)

    named = _model()
    layout = Layout.build(named, CFG.unit_bytes, CFG.pack_below_bytes)
    region = Region.register([torch.zeros_like(t) for _, t in named], layout, CFG, agent=agents[1])
    control, regs = weakref.ref(region.control), list(region._regs)
    watched[0] = control
    del region
    gc.collect()
    assert [(r, alive) for r, alive in calls] == [(r, True) for r in regs] and len(regs) == 2
    assert control() is None

    calls.clear()
    region = Region.register([torch.zeros_like(t) for _, t in named], layout, CFG, agent=agents[1])
    control, regs = weakref.ref(region.control), list(region._regs)
    watched[0] = control
    region.close()
    del region
    gc.collect()
    assert [r for r, _ in calls] == regs and control() is None


def test_full_pull_is_byte_exact_and_publishes_reader_progress(setup):
    named, layout, holder, recv, source = setup
    assert layout.unit_count > 10 and any(len(u) > 1 for u in layout.units)
    seen = []
    n = pull(recv, source, layout, expect_version=7, config=CFG, on_unit=seen.append)
    assert n == layout.total_bytes
    assert seen == list(range(layout.unit_count))
    _assert_same(named, recv.tensors)
    assert (recv.version, recv.progress) == (7, layout.unit_count)
    assert recv.checksums() == holder.checksums()


def test_pull_with_checksums_off_still_copies_source_checksums(setup):
    named, layout, holder, recv, source = setup
    pull(recv, source, layout, expect_version=7, config=CFG.replace(checksums=False, reads_in_flight=1))
    _assert_same(named, recv.tensors)
    assert recv.checksums() == holder.checksums()


def test_follows_a_partial_holder_whose_progress_advances(agents):
    """trainer -> r1 -> r2: r1 receives from a holder that is still being written unit by unit,
    r2 follows r1 while r1 is still receiving."""
    named = _model(1)
    layout = Layout.build(named, CFG.unit_bytes, CFG.pack_below_bytes)
    truth = [t for _, t in named]
    live = [torch.zeros_like(t) for t in truth]
    holder = Region.register(live, layout, CFG, agent=agents[0])
    holder.set_version(5)
    r1 = Region.register([torch.zeros_like(t) for t in truth], layout, CFG, agent=agents[1])
    r2 = Region.register([torch.zeros_like(t) for t in truth], layout, CFG, agent=agents[2])
    s1 = open_source(holder.endpoint(), agent=agents[1])
    s2 = open_source(r1.endpoint(), agent=agents[2])
    r2_saw_r1_partial = []

    def writer():
        for u, unit in enumerate(layout.units):
            for p in unit:
                dst = live[p.tensor_index].reshape(-1).view(torch.uint8)
                src = truth[p.tensor_index].reshape(-1).view(torch.uint8)
                dst[p.offset:p.offset + p.nbytes] = src[p.offset:p.offset + p.nbytes]
            holder.set_checksums([checksum_unit(live, unit)], start=u)
            holder.set_progress(u + 1)
            time.sleep(0.01)

    errors = []

    def first_reader():
        try:
            pull(r1, s1, layout, expect_version=5, config=CFG)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    r1.set_progress(0)
    r1.set_version(5)  # so r2 does not see a stale version before r1's pull starts
    threads = [threading.Thread(target=writer), threading.Thread(target=first_reader)]
    for t in threads:
        t.start()
    pull(r2, s2, layout, expect_version=5, config=CFG,
         on_unit=lambda u: r2_saw_r1_partial.append(r1.progress < layout.unit_count))
    for t in threads:
        t.join()
    assert not errors
    _assert_same(named, r1.tensors)
    _assert_same(named, r2.tensors)
    assert any(r2_saw_r1_partial), "r2 never overlapped with r1"
    # r1 pushed its progress to r2 (r2 followed it): r2 hardly polled r1's control block. r1's
    # own source (written by a thread, not a pull) pushes nothing: r1 fell back to polling.
    assert s2.control_reads < layout.unit_count / 2, (s2.control_reads, layout.unit_count)
    assert s1.control_reads > 2
    for x in (s2, s1, r2, r1, holder):
        x.close()


def test_resume_from_another_source_after_a_stall_refetches_nothing(agents):
    named = _model(2)
    layout = Layout.build(named, CFG.unit_bytes, CFG.pack_below_bytes)
    src = [t for _, t in named]
    sums = checksum_all(src, layout)
    partial = Region.register([t.clone() for t in src], layout, CFG, agent=agents[0])
    partial.set_checksums(sums)
    partial.set_version(9)
    partial.set_progress(4)  # this source dies with 4 units
    full = Region.register(src, layout, CFG, agent=agents[2])
    full.publish_complete(9, sums)
    recv = Region.register([torch.zeros_like(t) for t in src], layout, CFG, agent=agents[1])
    cfg = CFG.replace(source_stall_timeout_s=0.2)
    s_partial = open_source(partial.endpoint(), agent=agents[1])
    with pytest.raises(SourceStalled):
        pull(recv, s_partial, layout, expect_version=9, config=cfg)
    assert recv.progress == 4 and recv.version == 9
    s_full = open_source(full.endpoint(), agent=agents[1])
    seen = []
    n = pull(recv, s_full, layout, expect_version=9, config=cfg, start_unit=recv.progress,
             on_unit=seen.append)
    assert seen == list(range(4, layout.unit_count))
    assert n == sum(layout.unit_nbytes(u) for u in range(4, layout.unit_count))
    _assert_same(named, recv.tensors)
    with pytest.raises(InvalidState):
        pull(recv, s_full, layout, expect_version=10, config=cfg, start_unit=2)
    for x in (s_full, s_partial, recv, full, partial):
        x.close()




def test_checksum_mismatch_names_the_unit_and_keeps_the_prefix(setup):
    """Also what a reader sees when its source moved on to another version mid-read: with
    checksums on there is no seqlock round trip per unit, the checksums catch it."""
    named, layout, holder, recv, source = setup
    bad_unit = 3
    p = layout.units[bad_unit][0]
    holder.tensors[p.tensor_index].reshape(-1).view(torch.uint8)[p.offset] ^= 0xFF
    with pytest.raises(ChecksumMismatch, match=f"unit {bad_unit}"):
        pull(recv, source, layout, expect_version=7, config=CFG)
    assert recv.progress == bad_unit


def test_source_with_newer_version_is_a_transfer_error(setup):
    _, layout, _, recv, source = setup
    with pytest.raises(TransferError, match="version 7, expected 6"):
        pull(recv, source, layout, expect_version=6, config=CFG)
    assert recv.progress == 0


def test_source_not_yet_at_our_version_is_awaited_then_stalls(setup):
    """A partial source assigned before it started receiving shows an older version: wait."""
    _, layout, _, recv, source = setup
    t0 = time.monotonic()
    with pytest.raises(SourceStalled):
        pull(recv, source, layout, expect_version=8, config=CFG.replace(source_stall_timeout_s=0.2))
    assert time.monotonic() - t0 < 3
    assert recv.progress == 0


def test_source_that_starts_late_is_followed(setup):
    tensors, layout, holder, recv, source = setup
    holder.set_progress(0)
    holder.set_version(3)

    def start_later():
        time.sleep(0.2)
        holder.set_version(7)
        holder.set_progress(layout.unit_count)

    th = threading.Thread(target=start_later)
    th.start()
    pull(recv, source, layout, expect_version=7, config=CFG.replace(source_stall_timeout_s=5))
    th.join()
    assert recv.progress == layout.unit_count


def test_source_moving_on_mid_read_is_detected_by_the_seqlock_without_checksums(setup):
    _, layout, holder, recv, source = setup

    def bump(u):
        if u == 2:
            holder.set_version(8)

    with pytest.raises(TransferError, match="version 8"):
        pull(recv, source, layout, expect_version=7, config=CFG.replace(reads_in_flight=1, checksums=False),
             on_unit=bump)
    assert recv.progress == 3  # unit 3 landed after the source moved on: not counted


def test_two_pulls_of_one_process_interleave_while_one_waits(setup, agents):
    """A handle's read and its staging copy's seed run in one process, on one agent: a pull
    waiting for a slow or partial source must not hold the agent (the other pull, from a
    complete source, finishes meanwhile; it used to wait for the whole of the first)."""
    named, layout, holder, recv, source = setup
    starved = Region.register([t.clone() for _, t in named], layout, CFG, agent=agents[2])
    starved.set_version(7)
    starved.set_progress(0)  # a partial holder that does not move
    dst2 = Region.register([torch.zeros_like(t) for _, t in named], layout, CFG, agent=agents[1])
    slow = open_source(encode_endpoint(starved.endpoint()), agent=agents[1])
    failed = []

    def seed():
        try:
            pull(dst2, slow, layout, expect_version=7, config=CFG.replace(source_stall_timeout_s=3.0))
        except SourceStalled as e:
            failed.append(e)

    th = threading.Thread(target=seed)
    th.start()
    try:
        time.sleep(0.3)  # the seed is waiting for its source's next unit
        t0 = time.monotonic()
        pull(recv, source, layout, expect_version=7, config=CFG)
        took = time.monotonic() - t0
        assert th.is_alive(), "the slow pull ended before the fast one could show it was not blocked"
        assert took < 1.5, f"the second pull waited {took:.2f}s for the first"
        assert recv.progress == layout.unit_count
        _assert_same(named, recv.tensors)
    finally:
        th.join()
        slow.close()
        dst2.close()
        starved.close()
    assert failed and dst2.progress == 0


def test_stall_is_detected_within_the_timeout(setup):
    _, layout, holder, recv, source = setup
    holder.set_progress(0)
    t0 = time.monotonic()
    with pytest.raises(SourceStalled):
        pull(recv, source, layout, expect_version=7, config=CFG.replace(source_stall_timeout_s=0.2))
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert recv.progress == 0


def test_should_stop_returns_early_with_the_prefix(setup):
    named, layout, _, recv, source = setup
    # Without checksums progress advances in the read loop itself (with them, a helper thread
    # verifies and may run ahead of the check), so the stop is exact.
    n = pull(recv, source, layout, expect_version=7, config=CFG.replace(reads_in_flight=1, checksums=False),
             should_stop=lambda: recv.progress >= 2)
    assert recv.progress == 2
    assert n == layout.unit_nbytes(0) + layout.unit_nbytes(1)
    got = [checksum_unit(recv.tensors, layout.units[u]) for u in range(2)]
    assert got == [checksum_unit([t for _, t in named], layout.units[u]) for u in range(2)]


def test_layout_mismatch_between_source_and_reader(agents, setup):
    named, layout, holder, _, source = setup
    other = Layout.build(named, CFG.unit_bytes * 2, CFG.pack_below_bytes)
    dst = Region.register([torch.zeros_like(t) for _, t in named], other, CFG, agent=agents[1])
    with pytest.raises(LayoutMismatch):
        pull(dst, source, other, expect_version=7, config=CFG)
    dst.close()


def test_register_rejects_tensors_that_do_not_match_the_layout(agents):
    layout = Layout.build([("a", torch.zeros(10)), ("b", torch.zeros(5))], 4096, 0)
    with pytest.raises(LayoutMismatch, match="'b'"):
        Region.register([torch.zeros(10), torch.zeros(6)], layout, CFG, agent=agents[0])
    with pytest.raises(LayoutMismatch):
        Region.register([torch.zeros(10)], layout, CFG, agent=agents[0])


def test_newer_metadata_of_a_peer_keeps_prepared_reads_valid(agents, setup):
    """A peer's metadata grows as it registers memory (a host copy, a scratch block); loading it
    again (a follower's Follow carries it) must not break reads already prepared against the
    peer. Removing the peer first did: reads failed with NIXL_ERR_NOT_FOUND (seen on the emulated
    cluster when a reader that had followed its holder later read from it again)."""
    named, layout, holder, recv, source = setup
    pull(recv, source, layout, expect_version=7, config=CFG)
    more = Region.register([torch.zeros_like(t) for _, t in named], layout, CFG, agent=agents[0])
    agents[1].ensure_remote(agents[0].name, agents[0].metadata())  # newer metadata of the same peer
    for t in recv.tensors:
        t.zero_()
    pull(recv, source, layout, expect_version=7, config=CFG)  # the same Source, prepared before
    _assert_same(named, recv.tensors)
    more.close()


def test_metadata_that_names_another_agent_is_rejected(agents):
    """ensure_remote checks the name NIXL returns: metadata of another agent must not silently
    alias the peer asked for."""
    with pytest.raises(TransferError, match="names agent"):
        agents[1].ensure_remote("not-" + agents[0].name, agents[0].metadata())


# --------------------------------------------------------------------------- reads in flight
#
# The reader's agent keeps its real NIXL agent; the READs of chosen units are scripted
# (_ScriptedRead), so a test decides when, and how, a read ends.


class _ScriptedRead:
    """A READ handle whose state the test drives: ``PROC`` until :meth:`finish`. Releasing it is
    recorded with the state it was in (releasing a ``PROC`` handle is NIXL's abort, which does
    not stop a UCX READ: the bug these tests pin)."""

    def __init__(self):
        self.state = "PROC"
        self.posts = 0
        self.released_in = None

    def finish(self, state="DONE", land=None):
        """The read ends now; ``land()`` first writes the bytes it copies (a late READ)."""
        if land is not None:
            land()
        self.state = state

    def release(self):
        assert self.released_in is None, "released twice"
        self.released_in = self.state


class _ScriptedNixl:
    """The reader agent's nixl_agent with the first READ of each unit in ``script`` scripted;
    everything else goes to the real agent."""

    def __init__(self, real, layout, script):
        self._real = real
        self._unit_of = {tuple(idx): u for u, idx in enumerate(_unit_desc_index(layout))}
        self.script = script
        self.posted_units = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def make_prepped_xfer(self, op, local, lidx, remote, ridx, *args, **kwargs):
        u = self._unit_of[tuple(lidx)]
        self.posted_units.append(u)
        h = self.script.get(u)
        if h is not None and h.posts == 0:
            return h
        return self._real.make_prepped_xfer(op, local, lidx, remote, ridx, *args, **kwargs)

    def transfer(self, h, *args, **kwargs):
        if isinstance(h, _ScriptedRead):
            h.posts += 1
            return h.state
        return self._real.transfer(h, *args, **kwargs)

    def check_xfer_state(self, h):
        if isinstance(h, _ScriptedRead):
            return h.state
        return self._real.check_xfer_state(h)


def _scripted(monkeypatch, agent, layout, **script):
    nx = _ScriptedNixl(agent.nixl, layout, {int(k[1:]): v for k, v in script.items()})
    monkeypatch.setattr(agent, "nixl", nx)
    return nx


def _overwrite_unit(tensors, layout, u, byte):
    for p in layout.units[u]:
        tensors[p.tensor_index].reshape(-1).view(torch.uint8)[p.offset:p.offset + p.nbytes] = byte


def test_a_read_stuck_in_flight_is_never_released_and_the_region_refuses_pulls_until_it_lands(
        setup, agents, monkeypatch):
    """Review item 6. A READ that never ends must not be released after a bounded wait (that
    does not stop it) while the caller goes on: it could land later, over a unit a retry has
    re-read and verified. pull raises ReadsNotTerminal (from the SourceStalled), the region keeps
    the read and refuses pulls; once the late bytes have landed and the read is terminal,
    settle() releases it and a resumed pull repairs the unit: nothing is lost."""
    named, layout, _, recv, source = setup
    cfg = CFG.replace(source_stall_timeout_s=0.3, reads_in_flight=1)
    stuck = _ScriptedRead()
    nx = _scripted(monkeypatch, agents[1], layout, u3=stuck)
    t0 = time.monotonic()
    with pytest.raises(ReadsNotTerminal, match=r"units \[3\]") as err:
        pull(recv, source, layout, expect_version=7, config=cfg)
    assert time.monotonic() - t0 < 2.0
    assert isinstance(err.value.__cause__, SourceStalled)
    assert stuck.released_in is None, "an in-flight READ was released"
    assert recv.unsettled_units == [3] and recv.progress == 3 and not recv.settle()

    posted = len(nx.posted_units)
    with pytest.raises(ReadsNotTerminal):
        pull(recv, source, layout, expect_version=7, config=cfg, start_unit=recv.progress)
    assert len(nx.posted_units) == posted and recv.progress == 3  # refused before posting anything

    stuck.finish("DONE", land=lambda: _overwrite_unit(recv.tensors, layout, 3, 0xAB))  # the late bytes
    assert recv.settle(1.0) and recv.unsettled_units == []
    assert stuck.released_in == "DONE"
    pull(recv, source, layout, expect_version=7, config=cfg, start_unit=recv.progress)
    _assert_same(named, recv.tensors)


def test_a_read_still_in_flight_when_the_pull_fails_is_waited_for_then_released(setup, agents, monkeypatch):
    """The drain waits for a read to end by itself (within source_stall_timeout_s): the pull then
    raises its own error, with every read released only once terminal."""
    _, layout, _, recv, source = setup
    cfg = CFG.replace(source_stall_timeout_s=0.3, reads_in_flight=1)
    slow = _ScriptedRead()
    _scripted(monkeypatch, agents[1], layout, u3=slow)
    t0 = time.monotonic()
    timer = threading.Timer(0.45, slow.finish, ("ERR",))  # after the stall was detected (0.3 s)
    timer.start()
    with pytest.raises(SourceStalled):
        pull(recv, source, layout, expect_version=7, config=cfg)
    timer.join()
    assert time.monotonic() - t0 >= 0.45
    assert slow.released_in == "ERR" and recv.unsettled_units == []


def test_a_checksum_that_never_finishes_ends_the_pull_within_the_stall_timeout(setup, monkeypatch):
    """Review item 7: every wait of the read loop is bounded by source_stall_timeout_s, also the
    wait for a unit's checksum (the loop used to poll it forever)."""
    _, layout, _, recv, source = setup
    cfg = CFG.replace(source_stall_timeout_s=0.3)
    blocked = threading.Event()
    real = reader.checksum_unit

    def checksum(tensors, unit):
        if unit is layout.units[2]:
            blocked.wait(30)
        return real(tensors, unit)

    monkeypatch.setattr(reader, "checksum_unit", checksum)
    outcome = []

    def run():
        try:
            outcome.append(pull(recv, source, layout, expect_version=7, config=cfg))
        except Exception as e:  # noqa: BLE001 - inspected below
            outcome.append(e)

    th = threading.Thread(target=run)
    t0 = time.monotonic()
    th.start()
    try:
        th.join(3.0)
        took = time.monotonic() - t0
    finally:
        blocked.set()
        th.join()
    assert took < 3.0, "the pull waited for the checksum past the stall timeout"
    assert isinstance(outcome[0], SourceStalled) and "checksum of unit 2" in str(outcome[0])
    assert recv.progress == 2


def test_a_control_read_that_times_out_is_neither_posted_again_nor_released_in_flight(setup, agents, monkeypatch):
    """The same rule for the source's control block: a control read past its timeout may still
    land in the scratch block, so it is not re-posted, and closing the source keeps it."""
    _, layout, holder, _, _ = setup
    source = open_source(holder.endpoint(), agent=agents[1])
    real_handle = source._ctl_handle
    ctl = _ScriptedRead()
    source._ctl_handle = ctl
    _scripted(monkeypatch, agents[1], layout)
    with pytest.raises(SourceStalled):
        source.read_control(timeout_s=0.05)
    with pytest.raises(SourceStalled, match="still in flight"):
        source.read_control(timeout_s=0.05)
    assert ctl.posts == 1 and ctl.released_in is None
    ctl.finish("DONE")
    source.close()
    assert ctl.released_in == "DONE"
    real_handle.release()


@pytest.mark.parametrize("case, states, timeout_s, kept", [
    ("done at once", ["DONE"], 0.0, False),
    ("failed at once", ["ERR"], 0.0, False),
    ("done after a while", ["PROC"] * 5 + ["DONE"], 1.0, False),
    ("in flight past the wait", ["PROC"] * 1000, 0.01, True),
    ("state unreadable", [RuntimeError("nixl")] * 1000, 0.01, True),
])
def test_await_terminal_releases_a_read_only_once_it_is_terminal(case, states, timeout_s, kept):
    class Nixl:
        def check_xfer_state(self, h):
            s = h.states.pop(0) if len(h.states) > 1 else h.states[0]
            if isinstance(s, Exception):
                raise s
            h.state = s
            return s

    h = _ScriptedRead()
    h.states = list(states)
    handles = {7: h}
    await_terminal(Nixl(), handles, timeout_s)
    assert (7 in handles) == kept, case
    assert h.released_in is None if kept else h.released_in in ("DONE", "ERR"), case


_CHURN = r"""
import sys, threading, time, torch
from tensorhub.config import Config
from tensorhub.layout import Layout, checksum_all
from tensorhub.transport import Agent, Region, open_source, pull
cfg = Config(unit_bytes=64 << 10, source_stall_timeout_s=5.0)
agent = Agent(cfg, name="churn-agent")
named = [("w", torch.arange(1 << 18, dtype=torch.float32))]
layout = Layout.build(named, cfg.unit_bytes, cfg.pack_below_bytes)
src = Region.register([named[0][1]], layout, cfg, agent=agent)
src.publish_complete(1, checksum_all([named[0][1]], layout))
stop = time.monotonic() + float(sys.argv[1])
errors = []

def churn():  # a retention pool filling while another handle closes: register/deregister
    try:
        while time.monotonic() < stop:
            r = Region.register([torch.zeros(1 << 18, dtype=torch.float32)], layout, cfg, agent=agent)
            r.endpoint()
            r.close()
    except BaseException as e:
        errors.append(e)

def reads():
    try:
        while time.monotonic() < stop:
            dst = Region.register([torch.zeros(1 << 18, dtype=torch.float32)], layout, cfg, agent=agent)
            s = open_source(src.endpoint(), agent=agent)
            pull(dst, s, layout, expect_version=1, config=cfg)
            assert torch.equal(dst.tensors[0], named[0][1])
            s.close(); dst.close()
    except BaseException as e:
        errors.append(e)

ts = [threading.Thread(target=churn) for _ in range(3)] + [threading.Thread(target=reads)]
[t.start() for t in ts]; [t.join() for t in ts]
print("errors:", errors)
sys.exit(1 if errors else 0)
"""


def test_one_agent_survives_registrations_from_many_threads_while_pulling(tmp_path):
    """Regression (CI segfault in ``deregister_memory`` during ``Hub.close``): one handle's pool
    thread registered a retention buffer while another handle of the process deregistered. The
    agent must lock its own state (NIXL_THREAD_SYNC_RW); with the wrapper's default (NONE) this
    script corrupts the heap within seconds. Run in a subprocess: a crash must not take pytest."""
    import subprocess
    import sys

    script = tmp_path / "churn.py"
    script.write_text(_CHURN)
    proc = subprocess.run([sys.executable, str(script), "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])


def test_follow_requests_wait_for_the_pull_of_their_version_boundedly():
    """One process may pull two versions at once (a handle's read, its staging copy's seed):
    each pull takes only the follow requests for its version; the others wait, at most
    ``_FOLLOWS_KEPT`` of them (a follow for a read the process no longer does must not pile up)."""
    from tensorhub.transport import follow as fo

    class FakeNixl:
        def __init__(self):
            self.pending = {}

        def get_new_notifs(self):
            out, self.pending = self.pending, {}
            return out

    nx = FakeNixl()
    notes = fo.Inbox(nx)
    enc = fo._ENCODER.encode
    nx.pending = {"r1": [enc(fo.Follow("r1", b"m", 4, 0))], "r2": [enc(fo.Follow("r2", b"m", 5, 3))]}
    notes.poll()
    assert [f.reader for f in notes.take_follows(5)] == ["r2"]
    assert notes.take_follows(5) == []
    assert [(f.reader, f.version) for f in notes.take_follows(4)] == [("r1", 4)]
    nx.pending = {"x": [enc(fo.Follow(f"x{i}", b"m", 1, 0)) for i in range(fo._FOLLOWS_KEPT + 10)]}
    notes.poll()
    assert notes.take_follows(9) == []
    assert len(notes.take_follows(1)) == fo._FOLLOWS_KEPT  # the newest kept
