"""The client handle against an in-process server (LocalPort): no Ray needed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tensorhub
from tensorhub import errors
from tensorhub.config import Config
from tensorhub.ports import LocalPort
from tensorhub.testing import inproc, workload

CFG, SPEC = inproc.CONFIG, inproc.SPEC
"""The NIXL data path (every handle here shares one host); tests/transport/test_shm.py covers the same-host tier."""


@pytest.fixture
def port():
    return LocalPort(CFG)


def _hub(port, model="m", **kw):
    named = workload.allocate(SPEC)
    hub = tensorhub.open(model, port=port, config=CFG, **kw)
    hub.register(named)
    return hub, [t for _, t in named]


def test_public_surface_is_pinned():
    assert sorted(tensorhub.__all__) == ["Config", "Hub", "HubState", "ReadStats", "TensorHubError", "open"]


def test_config_from_env_and_relations():
    cfg = Config.from_env({"TENSORHUB_UNIT_BYTES": "8192", "TENSORHUB_CHECKSUMS": "off"})
    assert (cfg.unit_bytes, cfg.checksums) == (8192, False)
    with pytest.raises(errors.ConfigError):
        Config.from_env({"TENSORHUB_CHECKSUMS": "maybe"})
    with pytest.raises(errors.ConfigError, match="lease_timeout_s"):
        Config(heartbeat_interval_s=5.0, lease_timeout_s=6.0)


def test_in_process_publish_replicate_update_byte_exact(port):
    trainer, tt = _hub(port, replica="trainer")
    reader, rt = _hub(port, replica="r")
    workload.fill_version(tt, 1)
    trainer.publish(1)
    st = reader.replicate("latest")
    assert (st.action, st.version, st.bytes) == ("replicated", 1, sum(t.numel() * t.element_size() for t in tt))
    assert workload.digest(rt) == workload.digest(tt)
    assert reader.update("latest").action == "noop"
    trainer.unpublish()
    workload.fill_version(tt, 2)
    trainer.publish(2)
    st = reader.update("latest")
    assert st.version == 2 and workload.digest(rt) == workload.digest(tt)
    assert reader.version == 2 and reader.state is tensorhub.HubState.PUBLISHED
    reader.close(drop_last_copy=True); trainer.close(drop_last_copy=True)


def test_publish_rollback_when_server_rejects(port):
    a, at = _hub(port, replica="a")
    workload.fill_version(at, 5)
    a.publish(5)
    a.unpublish()
    # versions 6 and 7 commit, so 5 falls out of retention: publishing it again is rejected
    b, bt = _hub(port, replica="b")
    b.publish(6); b.unpublish(); b.publish(7)
    with pytest.raises(errors.VersionExpired):
        a.publish(5)
    assert a.version is None and a.state is tensorhub.HubState.IDLE
    a.close(drop_last_copy=True); b.close(drop_last_copy=True)


def test_asyncio_twins(port):
    import asyncio

    async def go():
        t, tt = _hub(port, replica="t")
        r, rt = _hub(port, replica="r")
        workload.fill_version(tt, 3)
        await t.apublish(3)
        st = await r.aupdate("latest")
        await r.aclose(drop_last_copy=True); await t.aclose(drop_last_copy=True)
        return st, workload.digest(tt) == workload.digest(rt)

    st, same = asyncio.run(go())
    assert st.version == 3 and same


def test_sharded_replica_requires_replica_name(port):
    with pytest.raises(errors.ConfigError):
        tensorhub.open("m", port=port, shard=0, num_shards=2)
    with pytest.raises(errors.ConfigError):
        tensorhub.open("m", port=port, shard=2, num_shards=2, replica="x")


def test_reader_fails_over_when_its_source_disappears(port):
    """h, t both hold version 1; h (registered first) is picked, but its memory is gone:
    r reports it, gets t, and finishes with exact bytes."""
    h, ht = _hub(port, replica="h")
    t, tt = _hub(port, replica="t")
    r, rt = _hub(port, replica="r")
    for hub, ts in ((h, ht), (t, tt)):
        workload.fill_version(ts, 1)
        hub.publish(1)
    h._memory.region.close()  # alive to the server, unreadable to readers
    st = r.replicate(1)
    assert st.sources == (h.client_id, t.client_id) and st.failovers == 1
    assert workload.digest(rt) == workload.digest(tt)


@pytest.mark.gpu
def test_cuda_tensors_round_trip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    port = LocalPort(CFG)
    named_t = [(n, t.cuda()) for n, t in workload.allocate(SPEC)]
    named_r = [(n, t.cuda()) for n, t in workload.allocate(SPEC)]
    workload.fill_version([t for _, t in named_t], 4)
    t = tensorhub.open("gpu", port=port, config=CFG, replica="t"); t.register(named_t); t.publish(4)
    r = tensorhub.open("gpu", port=port, config=CFG, replica="r"); r.register(named_r)
    r.replicate(4)
    assert workload.digest([x for _, x in named_r]) == workload.digest([x for _, x in named_t])
    r.close(drop_last_copy=True); t.close(drop_last_copy=True)


def test_server_restart_clients_reannounce_and_carry_on(port):
    """The server forgets everything; the trainer's next publish and the readers' next calls
    re-announce what they hold, and the version published during the outage is readable."""
    t, tt = _hub(port, replica="t")
    r1, r1t = _hub(port, replica="r1")
    r2, r2t = _hub(port, replica="r2")
    workload.fill_version(tt, 1)
    t.publish(1)
    r1.replicate(1)
    port.restart()
    t.unpublish()  # re-announces as holder of 1, then drains (deferred by the recovery window)
    workload.fill_version(tt, 2)
    t.publish(2)
    st = r2.replicate("latest")
    assert st.version == 2 and workload.digest(r2t) == workload.digest(tt)
    st1 = r1.update("latest")  # r1 re-announced holding 1, moves on to 2
    assert st1.version == 2 and workload.digest(r1t) == workload.digest(tt)
    status = port.core.status("m").models[0]
    assert {h.client_id for h in status.holders} >= {t.client_id, r1.client_id, r2.client_id}
    for h in (r1, r2, t):
        h.close(drop_last_copy=True)


def test_verify_mode_detects_write_while_published_naming_the_tensor():
    cfg = CFG.replace(verify_mutability=True)
    port = LocalPort(cfg)
    named = workload.allocate(SPEC)
    hub = tensorhub.open("m", port=port, config=cfg, replica="t")
    hub.register(named)
    workload.fill_version([t for _, t in named], 1)
    hub.publish(1)
    hub.unpublish()  # untouched: fine
    hub.publish(2)
    named[5][1][3] += 1.0  # a tiny tensor written while published
    with pytest.raises(errors.MutabilityViolation, match=named[5][0].replace(".", r"\.")):
        hub.unpublish()
    assert hub.version is None  # the unpublish itself completed
    hub.close(drop_last_copy=True)


# ------------------------------------------------------------------ bad inputs, one table

def _state_snapshot(port, hub, tensors):
    return port.core.status(), hub.state, hub.version, workload.digest(tensors)


BAD_CALLS = [
    # (state the handle is put in, call, expected error)
    ("open", lambda h, t: h.publish(1), errors.NotRegistered),
    ("open", lambda h, t: h.unpublish(), errors.NotRegistered),
    ("open", lambda h, t: h.replicate("latest"), errors.NotRegistered),
    ("open", lambda h, t: h.update("latest"), errors.NotRegistered),
    ("open", lambda h, t: h.register([("a", torch.zeros(4))]), errors.LayoutMismatch),  # differs from the model
    ("open", lambda h, t: h.register([]), errors.LayoutMismatch),
    ("open", lambda h, t: h.register([(n, x.t() if x.dim() == 2 else x[::2]) for n, x in t]), errors.LayoutMismatch),
    ("idle", lambda h, t: h.register(t), errors.InvalidState),
    ("idle", lambda h, t: h.publish(-1), errors.BadVersionSpec),
    ("idle", lambda h, t: h.publish("7"), errors.BadVersionSpec),
    ("idle", lambda h, t: h.publish(True), errors.BadVersionSpec),
    ("idle", lambda h, t: h.replicate(-3), errors.BadVersionSpec),
    ("idle", lambda h, t: h.replicate("latest-x"), errors.BadVersionSpec),
    ("idle", lambda h, t: h.replicate(12345), errors.VersionNotFound),
    ("idle", lambda h, t: h.replicate("latest-5"), errors.VersionNotFound),
    ("idle", lambda h, t: h.update(12345), errors.VersionNotFound),
    ("published", lambda h, t: h.publish(2), errors.InvalidState),
    ("published", lambda h, t: h.replicate(1), errors.InvalidState),
    ("closed", lambda h, t: h.publish(1), errors.HandleClosed),
    ("closed", lambda h, t: h.replicate(1), errors.HandleClosed),
    ("closed", lambda h, t: h.update("latest"), errors.HandleClosed),
    ("closed", lambda h, t: h.unpublish(), errors.HandleClosed),
    ("closed", lambda h, t: h.close(drop_last_copy=True), errors.HandleClosed),
]


@pytest.mark.parametrize("state, call, error", BAD_CALLS, ids=[f"{s}-{i}" for i, (s, _, _) in enumerate(BAD_CALLS)])
def test_bad_call_raises_typed_error_and_changes_nothing(port, state, call, error):
    owner, ot = _hub(port, replica="owner")
    workload.fill_version(ot, 1)
    owner.publish(1)
    owner.host_copies.stop_copy(cancel_it=False)  # its background host copy lands before the snapshot
    named = workload.allocate(SPEC)
    tensors = [t for _, t in named]
    workload.fill_version(tensors, 9)
    hub = tensorhub.open("m", port=port, config=CFG, replica="h")
    if state in ("idle", "published", "closed"):
        hub.register(named)
    if state == "published":
        hub.publish(1)
    if state == "closed":
        hub.close(drop_last_copy=True)
    before = _state_snapshot(port, hub, tensors)
    with pytest.raises(error):
        call(hub, named)
    assert issubclass(error, errors.TensorHubError) and error.__doc__
    assert _state_snapshot(port, hub, tensors) == before


def test_server_restart_during_offload_of_an_update_recovers():
    """r is the last holder of a retained version; during its update the server restarts right
    after ordering the offload: r re-announces (host copy included) and still reads the new version."""
    port = LocalPort(CFG)
    t, tt = _hub(port, replica="t")
    r, rt = _hub(port, replica="r")
    workload.fill_version(tt, 1)
    t.publish(1)
    r.replicate(1)
    t.unpublish()
    workload.fill_version(tt, 2)
    t.publish(2)
    real_offload = r.host_copies.offload

    def offload_then_crash(version):
        done = real_offload(version)
        port.restart()
        return done

    r.host_copies.offload = offload_then_crash
    st = r.update("latest")
    assert st.version == 2 and workload.digest(rt) == workload.digest(tt)
    assert any(h.host and h.version == 1 for h in port.core.status("m").models[0].holders)
    r.close(drop_last_copy=True); t.close(drop_last_copy=True)


def test_metrics_recording_never_raises(monkeypatch):
    """A zero-byte read (everything already in place) must not trip the metrics Counter."""
    from tensorhub import metrics

    class Strict:
        def inc(self, value, tags=None):
            if value <= 0:
                raise ValueError(f"value must be >0, got {value}")

        def observe(self, value, tags=None):
            pass

    monkeypatch.setattr(metrics, "_metrics", {k: Strict() for k in
                                              ("bytes", "reads", "failovers", "transfer_s", "stall_s", "publishes")})
    metrics.record_read("m", "replicated", 0.1, 0.0, 0, 0)
    metrics.record_publish("m")


def test_second_offload_of_the_same_version_reuses_the_host_copy(port):
    """A handle that offloads version 1, reads 1 back from its own host copy and is asked to
    offload 1 again keeps the first copy (replacing it would free memory the server still
    points readers to)."""
    t, tt = _hub(port, replica="t")
    workload.fill_version(tt, 1)
    t.publish(1)
    t.unpublish()  # last holder: host copy of 1
    first = t.host_copies.by_version[1][0]
    t.replicate(1)  # back from its own host copy
    t.unpublish()  # last GPU holder again; the host copy still serves, no new offload needed
    assert t.host_copies.by_version[1][0] is first
    done = t.host_copies.offload(1)
    assert t.host_copies.by_version[1][0] is first and done == tx_endpoint(first)
    r, rt = _hub(port, replica="r")
    r.replicate(1)
    assert workload.digest(rt) == workload.digest(tt)


def tx_endpoint(region):
    from tensorhub.transport import nixl as tx

    return tx.encode_endpoint(region.endpoint())


def _host_holders(port, model="m"):
    return sorted((h.client_id, h.version) for h in port.core.status(model).models[0].holders if "#host" in h.client_id)


def test_retention_buffer_is_ready_at_register_so_an_offload_touches_no_fresh_memory(port):
    """Every non-spot handle has a touched, registered retention buffer once register returns; the
    last holder's offload uses it (no allocation on the critical path) and the pool refills in
    the background. Spot handles keep none (they are never asked to offload)."""
    cfg = CFG.replace(host_copy_ahead=False, host_pool_refill_delay_s=0.2)
    t = tensorhub.open("m", port=port, config=cfg, replica="t")
    named = workload.allocate(SPEC)
    tt = [x for _, x in named]
    t.register(named)
    r = tensorhub.open("m", port=port, config=cfg, replica="r")
    rn = workload.allocate(SPEC)
    r.register(rn)
    spot, _ = _hub(port, replica="s", spot=True)
    assert len(t.host_copies.pool) == 1 and len(r.host_copies.pool) == 1 and spot.host_copies.pool == []
    workload.fill_version(tt, 1)
    t.publish(1)
    r.replicate(1)
    t.unpublish(); workload.fill_version(tt, 2); t.publish(2)
    st = r.update("latest")  # r holds the last copy of retained version 1: it offloads
    assert st.version == 2 and st.offload_s > 0
    assert r.host_buffers_inline == 0, "the offload used the ready buffer"
    assert ("m/r" in _host_holders(port)[0][0]) and _host_holders(port)[0][1] == 1
    deadline = time.monotonic() + 10
    while len(r.host_copies.pool) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(r.host_copies.pool) == 1, "refilled in the background"
    for h in (r, t, spot):
        h.close(drop_last_copy=True)


def test_a_reader_opened_with_retains_false_keeps_no_buffer_and_the_trainer_keeps_the_version(port):
    """``retains=False`` (a rollout engine): no pooled buffer from register, no copy made ahead,
    no offload at its updates; the trainer, asked at its publish (no reader of the model keeps
    copies), makes its host copy in the background, so its unpublish copies nothing, and the
    retained version is read from that host copy after the engine moved on."""
    cfg = CFG.replace(host_pool_refill_delay_s=0.2)
    t = tensorhub.open("m", port=port, config=cfg, replica="t")
    named = workload.allocate(SPEC)
    tt = [x for _, x in named]
    t.register(named)
    e = tensorhub.open("m", port=port, config=cfg, replica="e", retains=False)
    e.register(workload.allocate(SPEC))
    assert not e.retains and e.host_copies.pool == [] and len(t.host_copies.pool) == 1
    workload.fill_version(tt, 1); t.publish(1)
    e.replicate(1)
    time.sleep(0.3)
    assert e.host_copies.by_version == {}, "not asked to copy ahead"
    deadline = time.monotonic() + 10
    while 1 not in t.host_copies.by_version and time.monotonic() < deadline:
        time.sleep(0.02)
    ahead = t.host_copies.by_version.get(1)
    assert ahead is not None, "the trainer copies ahead, in the background"
    t.unpublish()
    assert _host_holders(port) == [(t.client_id + "#host1", 1)]
    assert t.host_copies.by_version[1] is ahead, "its unpublish copied nothing"
    workload.fill_version(tt, 2); t.publish(2)
    st = e.update("latest")
    assert st.version == 2 and st.offload_s == 0 and e.host_buffers_allocated == 0
    late, _ = _hub(port, replica="late")
    assert late.replicate(1).version == 1, "version 1 is still there: the trainer's host copy"
    for h in (late, e, t):
        h.close(drop_last_copy=True)


def test_a_host_copy_freed_by_a_commit_refills_the_pool_instead_of_a_fresh_buffer(port):
    """After an offload takes the pooled buffer, the pool thread waits: the copy that falls out
    of retention at the next commit comes back to the pool, and the next offload uses it. One
    buffer is allocated (at register) for all of it: nothing is touched again per version."""
    cfg = CFG.replace(host_copy_ahead=False, host_pool_refill_delay_s=60.0)
    t, tt = inproc.open_hub(port, config=cfg, replica="t")
    r, _ = inproc.open_hub(port, config=cfg, replica="r")
    workload.fill_version(tt, 1); t.publish(1)
    r.replicate(1)
    for v in (2, 3, 4):
        t.unpublish(); workload.fill_version(tt, v); t.publish(v)
        deadline = time.monotonic() + 10  # the drop of v-2's copy reaches r with its heartbeat
        while v >= 3 and not r.host_copies.pool and time.monotonic() < deadline:
            time.sleep(0.02)
        assert v < 3 or len(r.host_copies.pool) == 1, "the freed host copy went back to the pool"
        st = r.update("latest")  # r holds the last copy of v-1: it offloads into the pooled buffer
        assert st.version == v and st.offload_s > 0
        assert r.host_buffers_inline == 0 and r.host_buffers_allocated == 1
    r.close(drop_last_copy=True); t.close(drop_last_copy=True)


@pytest.mark.parametrize("refill_delay_s", [60.0, 0.0])
def test_copies_made_ahead_version_after_version_reuse_the_freed_buffers(port, refill_delay_s):
    """Issue 27: a copy made ahead that found the pooled buffer ready still woke the pool thread
    as if it waited, so the pool touched a fresh buffer at once and the copy that the next commit
    freed found the pool full and was closed: a fresh buffer every version. Now the freed copies
    come back to the pool and feed the next copies: a reader that copies ahead every version
    allocates at most the retained copies plus the pooled one, however many versions pass.
    With a refill delay shorter than a step (0 here; steps of an RL job are longer than the
    default 5 s), a copy made ahead used to wake the pool after that delay: the same fresh buffer
    every version. It no longer wakes it at all (the commit's freed copy refills the pool)."""
    cfg = CFG.replace(host_pool_refill_delay_s=refill_delay_s)
    t, tt = inproc.open_hub(port, config=cfg, replica="t")
    r, _ = inproc.open_hub(port, config=cfg, replica="r")
    try:
        for v in range(1, 9):
            if v > 1:
                t.unpublish()
            workload.fill_version(tt, v); t.publish(v)
            r.update("latest")
            r.host_copies.stop_copy(cancel_it=False)  # (the test waits for the background copy)
            assert v in r.host_copies.by_version, "the first reader copied the version ahead"
        assert r.host_buffers_inline == 0
        assert r.host_buffers_allocated <= cfg.versions_retained + cfg.host_copies_pooled, \
            "freed host copies are reused, not replaced by fresh buffers"
    finally:
        r.close(drop_last_copy=True); t.close(drop_last_copy=True)


def test_the_pool_touches_a_fresh_buffer_only_while_its_handle_does_not_read_unless_a_copy_waits(port):
    """Issue 27: a background first touch overlapping a same-host replicate() made it 3-40x
    slower. The pool thread pauses its touches while the handle reads; a copy that waits for
    the buffer (an offload) overrides the pause. The buffer is made in shared memory, so
    registering it moves nothing."""
    import threading

    from tensorhub.transport import storages

    cfg = CFG.replace(host_copy_ahead=False, host_pool_refill_delay_s=0.0, same_host=True)
    r, _ = inproc.open_hub(port, config=cfg, replica="r")
    try:
        hc = r.host_copies
        assert len(hc.pool) == 1
        region, copies = hc.pool[0]
        with storages._lock:
            files = storages._live_files()
        assert all(storages._file_holding(files, c.data_ptr()) is not None for c in copies if c.numel())
        r._driver.reading = True
        with hc.lock:
            hc.pool.pop()
        hc.pool_wake.set()
        time.sleep(0.5)
        assert hc.pool == [] and hc._pool_busy, "paused while the handle reads"
        got = []
        waiter = threading.Thread(target=lambda: got.append(hc._pooled_buffer(threading.Event())))
        waiter.start()
        waiter.join(10)
        assert got and got[0] is not None, "a copy waiting for the buffer gets it while the handle reads"
        region.close()
        got[0][0].close()
        hc.pool_wake.set()  # refill again: paused until the read ends
        time.sleep(0.3)
        assert hc.pool == []
        r._driver.reading = False
        deadline = time.monotonic() + 10
        while not hc.pool and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(hc.pool) == 1
    finally:
        r._driver.reading = False
        r.close(drop_last_copy=True)


def test_the_first_reader_copies_the_version_ahead_so_the_last_holder_need_not_offload(port):
    """The server asks the first reader to finish version 1 for its retention copy; the reader
    makes it in the background (in its own process, not the trainer's). When it later leaves 1
    as its last GPU holder, nothing is offloaded on its path, and 1 stays readable byte for byte."""
    t, tt = _hub(port, replica="t")
    r, rt = _hub(port, replica="r")
    workload.fill_version(tt, 1)
    v1 = workload.digest(tt)
    t.publish(1)
    r.replicate(1)
    r.host_copies.stop_copy(cancel_it=False)  # (the test waits for the background copy)
    assert _host_holders(port) == [(f"{r.client_id}#host1", 1)] and t.host_copies.by_version == {}
    t.unpublish()
    workload.fill_version(tt, 2)
    t.publish(2)
    st = r.update("latest")
    # 1 is in host memory already (nothing offloaded on the path); r, the first reader of
    # retained 2, may be copying 2 ahead in the background by now, as the server asks
    assert st.version == 2 and st.offload_s == 0.0 and 1 in r.host_copies.by_version
    late, lt = _hub(port, replica="late")
    assert late.replicate(1).sources == (f"{r.client_id}#host1",) and workload.digest(lt) == v1
    for h in (late, r, t):
        h.close(drop_last_copy=True)


def test_unpublish_cancels_a_background_copy_still_waiting_for_a_buffer(port):
    """No buffer is ready (the pool thread is still touching one): unpublish() cancels the
    background copy instead of waiting for it; retention falls back to the last holder's offload,
    which takes the buffer being touched (rather than touching a second one alongside it)."""
    t, tt = _hub(port, replica="t")
    gate = threading.Event()
    real = t.host_copies.new_buffer

    def slow(touch, background=False):
        if touch:
            gate.wait(10)
        return real(touch, background)

    t.host_copies.new_buffer = slow
    with t.host_copies.lock:
        taken = t.host_copies.pool.pop()
    t.host_copies.pool_wake.set()  # the pool thread starts touching a buffer (held at the gate)
    workload.fill_version(tt, 1)
    t.publish(1)
    t.host_copies.start_copy(1)  # as on MakeHostCopy: it waits for the pool thread's buffer
    copier = t.host_copies.copying[0]
    threading.Timer(0.5, gate.set).start()  # the touch in progress ends in 0.5 s
    t0 = time.monotonic()
    t.unpublish()  # last holder of retained 1: offloads itself
    assert 0.3 < time.monotonic() - t0 < 5 and not copier.is_alive()
    assert t.host_buffers_inline == 0 and list(t.host_copies.by_version) == [1]
    assert _host_holders(port) == [(f"{t.client_id}#host1", 1)]
    taken[0].close()
    t.close(drop_last_copy=True)


def test_progress_callback_and_stall_seconds(port, monkeypatch):
    """replicate(progress=) reports units as they land, in order, ending at the total; the call's
    stall_s (blocked waiting for bytes) is part of its wall time and reaches the stall metric."""
    from tensorhub import metrics

    recorded = []
    monkeypatch.setattr(metrics, "record_read", lambda *a, **k: recorded.append(k))
    t, tt = _hub(port, replica="t")
    r, rt = _hub(port, replica="r")
    workload.fill_version(tt, 1)
    t.publish(1)
    seen = []
    st = r.replicate(1, progress=lambda done, total: seen.append((done, total)))
    total = r._memory.layout.unit_count
    assert seen and seen[-1] == (total, total) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert 0.0 <= st.stall_s <= st.seconds and recorded[-1] == {"stall_s": st.stall_s}
    assert workload.digest(rt) == workload.digest(tt)
    r.close(drop_last_copy=True); t.close(drop_last_copy=True)


def test_copy_to_host_copies_every_byte():
    """The retention copy (offload and copy made ahead): the host tensors get every byte."""
    from tensorhub.handle.host_copies import copy_to_host

    held = [torch.randn(1000), torch.arange(7, dtype=torch.int64)]
    copies = [torch.empty_like(t) for t in held]
    copy_to_host(copies, held)
    assert all(torch.equal(c, t) for c, t in zip(copies, held))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: the CUDA branch is not run here")
def test_copy_to_host_of_cuda_tensors_runs_on_a_side_stream_and_returns_with_every_byte():
    """On CUDA the copy runs on a stream of its own (overlapping the process's GPU work) and
    returns only once every byte is in pinned host memory."""
    from tensorhub.handle.host_copies import copy_to_host

    held = [torch.randn(1 << 20, device="cuda"), torch.arange(7, device="cuda")]
    copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in held]
    copy_to_host(copies, held)
    assert all(torch.equal(c, t.cpu()) for c, t in zip(copies, held))
