"""Regression tests for the defects reproduced in review (``shared/repro/``), each against the
shipped code: the reference core, or the real client over an in-process server (no Ray)."""

from __future__ import annotations

import time

import pytest

import tensorhub
from tensorhub import errors
from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.reference import ReferenceCore
from tensorhub.ports import LocalPort
from tensorhub.testing import workload

CFG = Config(unit_bytes=256 << 10, heartbeat_interval_s=0.2, lease_timeout_s=5.0,
             source_stall_timeout_s=1.0, failovers_max=1)
SPEC = workload.small_spec(2 << 20, big=2, tiny=12)


def _hub(port, model="m", cfg=CFG, **kw):
    named = workload.allocate(SPEC)
    hub = tensorhub.open(model, port=port, config=cfg, **kw)
    hub.register(named)
    return hub, [t for _, t in named]


# --------------------------------------------------------------------------- ghost holder


def test_retention_does_not_count_a_silent_holder():
    """ghost_holder_loses_version.py: the trainer dies (no one reports it) while its lease runs;
    the rollouts drain the retained version it published. A silent holder must not count as
    the live copy: one rollout offloads, and after the ghost expires the version is still there."""
    layout = m.LayoutInfo("fp", 4, 400, ())
    core = ReferenceCore(Config(heartbeat_interval_s=0.3, lease_timeout_s=2.0))
    events = []

    def h(req, t):
        reply, effects = core.handle(req, t)
        events.extend(effects)
        return reply

    def register(cid, spot=False, t=0.0):
        assert isinstance(h(m.Register(cid, "chaos", cid, 0, 1, layout, b"", "default", spot), t), m.Registered)

    offloaded = []

    def update(cid, seq, t):
        r = h(m.Replicate(cid, "latest", seq=seq, update=True), t)
        if isinstance(r, m.OffloadOrder):
            offloaded.append((cid, r.version))
            r = h(m.OffloadDone(cid, r.version, f"{cid}-host".encode()), t)
        return r

    rollouts = {"r0": False, "r1": True, "r2": False, "r3": True}  # id -> spot
    register("t1")
    for r, spot in rollouts.items():
        register(r, spot)
    for v in (1, 2):
        h(m.Unpublish("t1"), 0.1)
        h(m.Publish("t1", v), 0.1)
        for r in rollouts:
            update(r, v, 0.1)
            h(m.ReplicateDone(r, v), 0.1)
    # t1 dies silently at 0.1; its successor publishes 3 under a new replica id at 1.1
    for r in rollouts:
        h(m.Heartbeat(r), 1.0)
    register("t2", t=1.1)
    h(m.Publish("t2", 3), 1.1)
    for r in rollouts:
        update(r, 3, 1.1)
    assert any(v == 2 for _, v in offloaded), "nobody kept version 2 although its only other holder is silent"
    h(m.SourceFailed("r0", "t2", 0), 1.2)  # t2 dies too: version 3 is lost
    for t in (1.5, 1.8, 2.1, 2.4):
        for r in rollouts:
            h(m.Heartbeat(r), t)
        events.extend(core.tick(t))
    assert "t1" not in core.nodes
    reply = h(m.Replicate("r0", "latest", seq=4, update=True), 2.5)
    assert isinstance(reply, m.Assignment) and reply.version == 2


# --------------------------------------------------------------------------- transactions


def _two_shard_replica(port, replica, cfg=CFG):
    return [_hub(port, cfg=cfg, replica=replica, shard=s, num_shards=2) for s in (0, 1)]


def test_update_retry_after_version_lost_stays_in_its_round():
    """txn_split_after_version_lost.py with the real client: shard 1 of replica A finishes v2,
    then v2's shard 0 loses every holder before shard 0 reads it. The retry inside update() must
    stay in the round: shard 0 gets VersionLost (its sibling holds v2; moving shard 0 alone to
    another version would split the replica), and the next round realigns both shards."""
    cfg = Config(unit_bytes=256 << 10, heartbeat_interval_s=0.2, lease_timeout_s=5.0, versions_retained=2)
    port = LocalPort(cfg)
    trainer = _two_shard_replica(port, "T", cfg)
    a = _two_shard_replica(port, "A", cfg)
    for v in (1, 2):
        for (h, tt) in trainer:
            if h.version is not None:
                h.unpublish()
            workload.fill_version(tt, v)
            h.publish(v)
        if v == 1:
            for (h, _) in a:
                assert h.replicate("latest").version == 1
    assert a[1][0].update("latest").version == 2
    # the trainer dies before shard 0 reads v2 (its heartbeats stop, the cluster manager says so)
    for (h, _) in trainer:
        h._hb_stop.set()
    with port._lock:
        port._apply(port.core.declare_dead([h.client_id for h, _ in trainer], time.monotonic(), "test"))
    with pytest.raises(errors.VersionLost):
        a[0][0].update("latest")
    assert a[0][0]._machine.seq == a[1][0]._machine.seq, "one user call, one round, on every shard"
    t2 = _two_shard_replica(port, "T2", cfg)
    for (h, tt) in t2:
        workload.fill_version(tt, 3)
        h.publish(3)
    got = [h.update("latest").version for h, _ in (a[1], a[0])]
    assert got == [3, 3]
    for (h, tt), (_, at) in zip(t2, a):
        assert workload.digest(at) == workload.digest(tt)
    for h, _ in a + t2:
        h.close(drop_last_copy=True)


def test_restart_between_shards_of_a_round_keeps_the_round():
    """txn_split_after_server_restart.py with the real client: shard 0 of replica A replicated
    round 1 (v1); the trainer publishes v2; the server restarts before shard 1 asks. Shard 0's
    re-announcement carries its round, so shard 1 gets v1 in round 1, not v2."""
    port = LocalPort(CFG)
    trainer = _two_shard_replica(port, "T")
    a = _two_shard_replica(port, "A")
    for (h, tt) in trainer:
        workload.fill_version(tt, 1)
        h.publish(1)
    assert a[0][0].replicate("latest").version == 1
    for (h, tt) in trainer:
        h.unpublish()
        workload.fill_version(tt, 2)
        h.publish(2)
    port.restart()
    st = a[1][0].replicate("latest")
    assert st.version == 1
    v1 = [t for _, t in workload.allocate(SPEC)]
    workload.fill_version(v1, 1)
    assert workload.digest(a[1][1]) == workload.digest(v1)
    for h, _ in a + trainer:
        h.close(drop_last_copy=True)


# --------------------------------------------------------------------------- stale resume


def _failed_partial_read(port):
    """A trainer publishes v1; a reader's replicate(1) fails after 3 units (the source becomes
    unreachable). Returns (trainer, its tensors, reader, its tensors)."""
    t, tt = _hub(port, replica="t")
    r, rt = _hub(port, replica="r")
    workload.fill_version(tt, 1)
    t.publish(1)
    real = type(r.reads).pull_range
    calls = {"n": 0}

    def flaky(self, a, end_unit, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            real(self, a, 3)
        raise errors.TransferError("injected: source unreachable")

    r.reads.pull_range = flaky.__get__(r.reads)
    with pytest.raises(errors.TransferError):
        r.replicate(1)
    del r.reads.pull_range
    # three units of version 1 stay in place for a later call, hidden from followers meanwhile
    assert (r._machine.region_version, r._machine.region_progress) == (1, 3)
    assert (r._memory.region.version, r._memory.region.progress) == (-1, 0)
    return t, tt, r, rt


def test_resume_after_failed_read_refetches_units_the_user_wrote():
    """stale_resume_accepts_foreign_bytes.py: a failed replicate leaves (v, k) in the control
    block; the user writes the idle handle's tensors; the next replicate(v) must not keep the
    user's bytes in units [0, k)."""
    t, tt, r, rt = _failed_partial_read(LocalPort(CFG))
    workload.fill_version(rt, 99)  # idle handle: the user loads other weights
    st = r.replicate(1)
    assert st.bytes == r._memory.layout.total_bytes
    assert workload.digest(rt) == workload.digest(tt)
    r.close(drop_last_copy=True); t.close(drop_last_copy=True)


def test_resume_after_failed_read_keeps_untouched_units():
    """The same, without a write in between: the units already in place are not fetched again."""
    t, tt, r, rt = _failed_partial_read(LocalPort(CFG))
    st = r.replicate(1)
    assert st.bytes == r._memory.layout.total_bytes - r.reads.units_bytes(0, 3)
    assert workload.digest(rt) == workload.digest(tt)
    r.close(drop_last_copy=True); t.close(drop_last_copy=True)
