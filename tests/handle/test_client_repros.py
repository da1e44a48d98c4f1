"""Regression tests for the client's data-path defects reproduced in review (``shared/repro/``):
the real client over an in-process server (:class:`~tensorhub.ports.LocalPort`, no Ray), and the
transport pieces the client leans on (progress pushes, the drain of a pull, the copy threads).

    trainer -> rollout (-> rollout~prefetch, its staging copy)
"""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest
import torch

import tensorhub
from tensorhub import errors
from tensorhub.handle import pulse
from tensorhub import transport as tx
from tensorhub.config import Config
from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.ports import LocalPort
from tensorhub.testing import inproc, workload

CFG, SPEC = inproc.CONFIG, inproc.SPEC


def _pair(port, cfg=CFG):
    trainer, tt = inproc.open_hub(port, replica="trainer", config=cfg)
    rollout, rt = inproc.open_hub(port, replica="rollout", config=cfg)
    return trainer, tt, rollout, rt


def _double_buffered(port, cfg=CFG):
    """trainer publishes 1 then 2; the rollout (double buffer) holds 1, its staging copy 2."""
    trainer, tt = inproc.open_hub(port, replica="trainer")
    rollout = tensorhub.open("m", port=port, config=cfg, replica="rollout")
    rollout.register(workload.allocate(SPEC), double_buffer=workload.allocate(SPEC))
    inproc.publish(trainer, tt, 1)
    rollout.update("latest")
    inproc.publish(trainer, tt, 2)
    rollout.prefetch(2).result(timeout=30)
    return trainer, tt, rollout


def _close(*hubs):
    for h in hubs:
        if h.state is not tensorhub.HubState.CLOSED:
            h.close(drop_last_copy=True)


def _named(hub, tensors):
    return list(zip([meta.name for meta in hub._memory.layout.metas], tensors))


# --------------------------------------------------------------------------- prefetch buffer


@pytest.mark.parametrize("alias", ["the tensors", "views of them"])
def test_prefetch_refuses_a_buffer_that_shares_memory_with_the_registered_tensors(alias):
    """prefetch_buffer_aliases.py: a staging buffer over the published tensors would let the
    prefetch overwrite the version they serve. Refused (LayoutMismatch), nothing changed: no
    staging copy, no prefetch thread, the tensors still hold version 1."""
    port = LocalPort(CFG)
    trainer, tt, rollout, rt = _pair(port)
    inproc.publish(trainer, tt, 1)
    rollout.update("latest")
    d1 = workload.digest(rt)
    inproc.publish(trainer, tt, 2)
    buf = rt if alias == "the tensors" else [t.view(t.shape) for t in rt]
    with pytest.raises(errors.LayoutMismatch, match="shares memory"):
        rollout.prefetch("latest", buffer=_named(rollout, buf))
    assert rollout._staging.executor is None and rollout.staging is None
    assert rollout.version == 1 and workload.digest(rt) == d1
    # a buffer of its own is still taken by the (first) prefetch
    assert rollout.prefetch("latest", buffer=workload.allocate(SPEC)).result(timeout=30).version == 2
    assert workload.digest(rt) == d1
    _close(rollout, trainer)


# --------------------------------------------------------------------------- double buffer


def test_refused_swap_leaves_the_current_version_published():
    """swap_unpublishes_first.py: update() with a double buffer must not unpublish before the
    server may refuse the swap. update(current) is a noop; a failing update keeps version 1
    published (all or nothing); a relative spec the server resolves elsewhere is refused after
    the unpublish and the version is published again; the swap itself still works."""
    port = LocalPort(CFG)
    trainer, tt, rollout = _double_buffered(port)
    st = rollout.update(1)
    assert (st.action, st.bytes, rollout.version) == ("noop", 0, 1)
    with pytest.raises(errors.VersionNotFound):
        rollout.update(99)
    assert rollout.version == 1 and rollout.state is tensorhub.HubState.PUBLISHED
    st = rollout.update("latest-1")  # version 1: the server refuses the swap to 2
    assert (st.action, st.bytes, rollout.version) == ("noop", 0, 1)
    holder = {h.client_id: h for h in port.core.status("m").models[0].holders}[rollout.client_id]
    assert (holder.state, holder.version) == ("published", 1)
    st = rollout.update("latest")
    assert st.swapped and rollout.version == 2
    assert workload.digest([t for _, t in rollout.tensors]) == workload.digest(tt)
    _close(rollout, trainer)


class _SwapAnswersLost(LocalPort):
    """The server makes the first ``lost`` swaps it is sent, but their answers never come (a
    call that timed out while the server was slow, a reply lost): ``ServerUnavailable``."""

    def __init__(self, config, lost: int) -> None:
        super().__init__(config)
        self.lost, self.swaps = lost, 0

    def call(self, request, wait_s: float = 0.0):
        reply = super().call(request, wait_s)
        if isinstance(request, m.Swap):
            self.swaps += 1
            if self.swaps <= self.lost:
                raise errors.ServerUnavailable("the swap's answer was lost")
        return reply


def _swap_settled(port, rollout, tt, version: int) -> None:
    """The handle and the server agree on which set of tensors holds ``version``, and it does."""
    holder = {h.client_id: h for h in port.core.status("m").models[0].holders}[rollout.client_id]
    assert (holder.state, holder.version, rollout.version) == ("published", version, version)
    assert port.core.nodes[rollout.client_id].endpoint == rollout._machine.register_msg.endpoint
    assert workload.digest([t for _, t in rollout.tensors]) == workload.digest(tt)


def test_a_swap_whose_answer_is_lost_is_asked_again_and_taken():
    """Simulator (a double buffer, msg_loss on the Swap's reply): the server made the swap but the
    handle saw no answer, published its old version again and copied the new one into the set
    the server now lists as the staging copy's; it then reported version 2 from tensors that
    held 1. The handle sends the same swap again (the server knows it by the endpoint taken
    over: Ok) and takes it."""
    port = _SwapAnswersLost(CFG, lost=1)
    trainer, tt, rollout = _double_buffered(port)
    st = rollout.update("latest")
    assert st.swapped and port.swaps == 2
    _swap_settled(port, rollout, tt, 2)
    _close(rollout, trainer)


def test_a_swap_unanswered_past_the_timeout_is_settled_by_the_next_call():
    """No answer within request_timeout_s: update() raises ServerUnavailable and leaves both sets
    untouched; the next call asks again first and takes the swap the server made."""
    cfg = Config(**{**CFG.__dict__, "request_timeout_s": 0.3})
    port = _SwapAnswersLost(cfg, lost=100)
    trainer, tt, rollout = _double_buffered(port, cfg)
    with pytest.raises(errors.ServerUnavailable):
        rollout.update("latest")
    assert rollout._staging.unsettled_swap is not None and port.swaps >= 2
    port.lost = 0
    st = rollout.update("latest")
    assert (st.action, st.version) == ("noop", 2) and rollout._staging.unsettled_swap is None
    _swap_settled(port, rollout, tt, 2)
    _close(rollout, trainer)


def test_double_buffered_update_does_not_wait_for_a_prefetch_in_flight():
    """double_buffer_update_blocks_behind_prefetch.py: an update of the version the handle holds
    answers at once while a (slow) prefetch of the next one runs, instead of waiting behind the
    staging copy's lock and then re-reading what it had."""
    port = LocalPort(CFG)
    trainer, tt, rollout = _double_buffered(port)
    assert rollout.update("latest").swapped and rollout.version == 2
    inproc.publish(trainer, tt, 3)
    half, go = inproc.hold_half_way(rollout.staging)
    fut = rollout.prefetch(3)
    assert half.wait(30)
    timer = threading.Timer(3.0, go.set)
    timer.start()
    try:
        t0 = time.monotonic()
        st = rollout.update(2)
        took = time.monotonic() - t0
    finally:
        go.set()
        timer.cancel()
    assert took < 1.5, f"update(2) waited {took:.1f}s for the prefetch"
    assert (st.action, st.bytes, rollout.version) == ("noop", 0, 2)
    assert fut.result(timeout=30).version == 3
    st = rollout.update("latest")
    assert st.swapped and rollout.version == 3
    _close(rollout, trainer)


# --------------------------------------------------------------------------- close


def test_a_seed_asked_during_close_starts_no_staging_copy():
    """seed_during_close_leaks_stage.py: a SeedAhead the pulse delivers while close() drains
    (after the staging copy was closed) must not create a staging handle nobody closes."""
    port = LocalPort(CFG)
    trainer, tt, rollout, rt = _pair(port)
    inproc.publish(trainer, tt, 1)
    rollout.update("latest")
    inproc.publish(trainer, tt, 2)
    real_run = rollout._run

    def run(op):
        if isinstance(op, hm.CloseOp):
            seed = threading.Thread(target=rollout._staging.seed_asked, args=(2,))
            seed.start()
            seed.join(20)
            job = rollout._staging.executor
            if job is not None:  # the defect: a prefetch was started; let it register its copy
                job.shutdown(wait=True)
        return real_run(op)

    rollout._run = run
    rollout.close(drop_last_copy=True)
    stage, left = rollout.staging, rollout._staging.executor
    try:
        assert rollout.state is tensorhub.HubState.CLOSED
        assert left is None and stage is None
        assert not any(n.stage_for == rollout.client_id for n in port.core.nodes.values())
    finally:
        if left is not None:
            left.shutdown(wait=True)
        _close(*(h for h in (stage, trainer) if h is not None))


def test_a_failure_closing_the_staging_copy_still_closes_the_handle():
    """close_stage_error_leaves_handle_open.py: the server unreachable for the staging copy's
    calls: close() raises that error, after closing the handle itself (not published, no
    registration, no pool thread, not a pulse member, gone from the server)."""
    port = LocalPort(CFG)
    trainer, tt, rollout, rt = _pair(port)
    inproc.publish(trainer, tt, 1)
    rollout.update("latest")
    inproc.publish(trainer, tt, 2)
    rollout.prefetch("latest").result(timeout=30)
    stage = rollout.staging
    real = port.call

    def flaky(req, wait_s=0.0):
        if getattr(req, "client_id", None) == stage.client_id and isinstance(req, (m.Unpublish, m.Leave)):
            raise errors.ServerUnavailable("server unreachable (simulated)")
        return real(req, wait_s)

    port.call = flaky
    try:
        with pytest.raises(errors.ServerUnavailable):
            rollout.close(drop_last_copy=True)
    finally:
        port.call = real
    assert stage.state is tensorhub.HubState.CLOSED and rollout.state is tensorhub.HubState.CLOSED
    assert rollout._memory.region is None and rollout.staging is None
    assert not rollout.host_copies.pool_thread.is_alive()
    assert not any(rollout.client_id in p._members for p in pulse._pulses.values())
    assert rollout.client_id not in port.core.nodes
    with pytest.raises(errors.HandleClosed):
        rollout.close()
    _close(trainer)  # the staging copy's Leave was lost: its lease expires it on the server


def test_a_staging_copy_holding_the_last_copy_keeps_both_open_and_prefetching():
    """The one failure of the staging copy's close that keeps everything open (LastCopyHeld):
    the handle is not half-closed, and prefetches still start afterwards."""
    port = LocalPort(CFG)
    trainer, tt, rollout, rt = _pair(port)
    inproc.publish(trainer, tt, 1)
    rollout.prefetch(1).result(timeout=30)
    trainer.close(drop_last_copy=True)  # the staging copy holds the only copy of version 1
    with pytest.raises(errors.LastCopyHeld):
        rollout.close()
    assert rollout.state is tensorhub.HubState.IDLE and rollout.staging is not None
    assert rollout.prefetch(1).result(timeout=30).version == 1
    _close(rollout)


# --------------------------------------------------------------------------- verify mode


def test_verify_mode_checks_the_version_an_update_leaves():
    """verify_mode_skips_update.py: the engine writes a published tensor; the update() that
    moves on must raise MutabilityViolation (checked once drained, before the new bytes land),
    and end idle without a reader left on the server."""
    cfg = CFG.replace(verify_mutability=True)
    port = LocalPort(cfg)
    trainer, tt, rollout, rt = _pair(port, cfg)
    inproc.publish(trainer, tt, 1)
    rollout.update("latest")
    rt[0].view(-1)[0] += 1  # the engine writes a published tensor
    inproc.publish(trainer, tt, 2)
    with pytest.raises(errors.MutabilityViolation, match="version 1"):
        rollout.update("latest")
    assert rollout.version is None and rollout.state is tensorhub.HubState.IDLE
    node = port.core.nodes[rollout.client_id]
    assert node.state.value == "idle" and rollout.client_id not in {
        r for n in port.core.nodes.values() for r in n.readers}
    assert rollout.update("latest").version == 2  # the next update reads afresh
    assert workload.digest(rt) == workload.digest(tt)
    rt[1].view(-1)[0] += 1
    with pytest.raises(errors.MutabilityViolation, match="version 2"):
        rollout.close(drop_last_copy=True)
    assert rollout.state is tensorhub.HubState.CLOSED and rollout._memory.region is None
    _close(trainer)


def test_verify_mode_passes_an_unchanged_update_and_close():
    cfg = CFG.replace(verify_mutability=True)
    port = LocalPort(cfg)
    trainer, tt, rollout, rt = _pair(port, cfg)
    for v in (1, 2):
        inproc.publish(trainer, tt, v)
        assert rollout.update("latest").version == v
    rollout.close(drop_last_copy=True)
    _close(trainer)


# --------------------------------------------------------------------------- register


def test_register_takes_a_generator_of_named_tensors():
    """register_generator.py: register(model.named_parameters()) registers the parameters (the
    generator was consumed by the layout before the tensors were listed)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    port = LocalPort(CFG)
    hub = tensorhub.open("g", port=port, config=CFG, replica="r")
    hub.register(model.named_parameters())
    assert [n for n, _ in hub.tensors] == [n for n, _ in model.named_parameters()]
    assert all(t is p for (_, t), p in zip(hub.tensors, model.parameters()))
    hub.close()


def test_aregister_takes_a_double_buffer():
    port = LocalPort(CFG)
    trainer, tt = inproc.open_hub(port, replica="trainer")
    hub = tensorhub.open("m", port=port, config=CFG, replica="rollout")
    spare = workload.allocate(SPEC)
    asyncio.run(hub.aregister(workload.allocate(SPEC), double_buffer=(p for p in spare)))
    assert hub._staging.double is not None and len(hub._staging.double) == len(spare)
    _close(hub, trainer)


@pytest.mark.parametrize("first_off", [True, False])
def test_mixed_checksums_are_refused_at_register_with_a_config_error(first_off):
    """mixed_checksums.py: a holder with checksums off publishes none; a reader with them on
    failed every unit (TransferError) long after both had registered. The second to register
    gets ConfigError naming the setting, and nothing of it stays registered."""
    port = LocalPort(CFG)
    off, on = CFG.replace(checksums=False), CFG
    first, _ = inproc.open_hub(port, replica="first", config=off if first_off else on)
    second = tensorhub.open("m", port=port, config=on if first_off else off, replica="second")
    with pytest.raises(errors.ConfigError, match="checksums"):
        second.register(workload.allocate(SPEC))
    assert second.state is tensorhub.HubState.OPEN and second._memory.region is None
    assert second.client_id not in port.core.nodes
    _close(second, first)


def test_a_layout_mismatch_other_than_checksums_stays_a_layout_mismatch():
    port = LocalPort(CFG)
    first, _ = inproc.open_hub(port, replica="first")
    other = tensorhub.open("m", port=port, config=CFG, replica="other")
    with pytest.raises(errors.LayoutMismatch):
        other.register(workload.allocate(workload.small_spec(1 << 20, big=1, tiny=3)))
    _close(other, first)


def test_register_deregisters_the_region_when_the_request_cannot_be_built(monkeypatch):
    """A registration whose Register message fails to build (after the transport registered
    the memory) leaves no transport registration behind."""
    made = []
    real = tx.Region.register

    def register(*a, **kw):
        region = real(*a, **kw)
        made.append(region)
        return region

    monkeypatch.setattr(tx.Region, "register", register)
    port = LocalPort(CFG)
    hub = tensorhub.open("m", port=port, config=CFG, replica="r")
    monkeypatch.setattr(hub._port, "process", lambda: (_ for _ in ()).throw(errors.ConfigError("no process id")))
    with pytest.raises(errors.ConfigError):
        hub.register(workload.allocate(SPEC))
    assert len(made) == 1 and made[0]._closed
    assert hub.state is tensorhub.HubState.OPEN and hub._memory.region is None


# --------------------------------------------------------------------------- transport pieces


def test_progress_pushes_nobody_takes_are_kept_boundedly():
    """Inbox: a holder keeps pushing to a reader whose pull ended; those pushes are never taken.
    At most _PUSHES_PER_PEER_KEPT per holder (the newest) and _PEERS_KEPT holders stay."""
    from tensorhub.transport import follow as fo

    class FakeNixl:
        pending: dict = {}

        def get_new_notifs(self):
            out, self.pending = self.pending, {}
            return out

    nx = FakeNixl()
    notes = fo.Inbox(nx)
    enc = fo._ENCODER.encode
    n = fo._PUSHES_PER_PEER_KEPT + 50
    nx.pending = {"h": [enc(fo.Advanced(1, i, [i])) for i in range(n)]}
    notes.poll()
    kept = notes.take_advanced("h")
    assert [a.start for a in kept] == list(range(50, n))  # the newest
    nx.pending = {f"h{i}": [enc(fo.Advanced(1, 0, [0]))] for i in range(fo._PEERS_KEPT + 10)}
    notes.poll()
    assert sum(len(v) for v in notes._advanced.values()) == fo._PEERS_KEPT
    assert notes.take_advanced("h0") == [] and len(notes.take_advanced(f"h{fo._PEERS_KEPT + 9}")) == 1


def test_the_drain_of_a_pull_lets_go_of_the_agent_while_it_waits():
    """_Puller._drain waits up to source_stall_timeout_s for reads in flight: meanwhile another
    pull of the process (or a registration) must get the agent's transfer lock."""
    from tensorhub.transport import reader

    class Read:
        state = "PROC"
        released = False

        def release(self):
            self.released = True

    class Nixl:
        def check_xfer_state(self, h):
            return h.state

    lock = threading.RLock()
    read = Read()
    p = object.__new__(reader._Puller)
    p.st = types.SimpleNamespace(forget_posted=lambda: None)
    p.inflight = {3: read}
    p.nx = Nixl()
    p.config = Config(source_stall_timeout_s=5.0)
    p.region = types.SimpleNamespace(agent=types.SimpleNamespace(xfer_lock=lock), _keep_unsettled=lambda d: None)
    p.source = types.SimpleNamespace(name="src")
    started = threading.Event()

    def drain():
        with lock:
            started.set()
            p._drain(None)

    t = threading.Thread(target=drain)
    t.start()
    assert started.wait(5)
    time.sleep(0.05)
    got = lock.acquire(timeout=1.0)
    read.state = "DONE"
    if got:
        lock.release()
    t.join(10)
    assert got, "the drain held the agent's lock while it waited"
    assert read.released and p.inflight == {}


def test_copy_threads_replaced_by_a_larger_pool_are_shut_down():
    """shm._copier: a pull asking for more threads replaces the pool; the old one is shut down
    (its threads exit once its queued copies ran) instead of left running."""
    from tensorhub.transport import shm

    small = shm._copier(1)
    old = getattr(small, "_pool", small)
    slow = small.submit(time.sleep, 0.2)
    shm._copier(getattr(old, "_max_workers", 1) + 8)
    assert old._shutdown, "the replaced pool was left running"
    assert slow.result(timeout=5) is None  # queued work of the old pool still runs
    assert shm._copier(1).submit(sum, [1, 2]).result(timeout=5) == 3
