"""Prefetch and swap (issue 11 part 3): a handle receives the next version into its staging copy
in the background while its registered tensors keep serving the current one; ``update()`` then
only copies locally. In-process server (LocalPort), NIXL data path between handles; the copy
from the staging copy into the registered tensors is a local memory copy."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import tensorhub
from tensorhub import errors
from tensorhub.ports import LocalPort
from tensorhub.testing import inproc, workload

CFG, SPEC = inproc.CONFIG, inproc.SPEC


@pytest.fixture
def port():
    return LocalPort(CFG)


_hub, _publish = inproc.open_hub, inproc.publish


def _holders(port, model="m"):
    return {h.client_id: h for h in port.core.status(model).models[0].holders}


def test_prefetch_then_update_copies_locally_while_the_old_version_keeps_serving(port):
    trainer, tt = _hub(port, replica="trainer")
    rollout, rt = _hub(port, replica="rollout")
    _publish(trainer, tt, 1)
    assert rollout.update("latest").version == 1
    v1 = workload.digest(rt)
    _publish(trainer, tt, 2)

    st = rollout.prefetch("latest").result(timeout=30)
    assert (st.action, st.version) == ("replicated", 2)
    # The registered tensors still hold (and publish) version 1, untouched; the staging copy
    # is a complete holder of version 2 that others may read.
    assert rollout.version == 1 and workload.digest(rt) == v1
    stage = rollout.staging
    held = _holders(port)
    assert held[stage.client_id].version == 2 and held[stage.client_id].state == "published"
    assert held[rollout.client_id].version == 1

    # A third handle may read version 1 from the rollout meanwhile (it keeps serving).
    other, ot = _hub(port, replica="other")
    trainer.unpublish()  # only the rollout has version 1 now ... and the stage has version 2
    assert other.replicate(1).sources == (rollout.client_id,)
    assert workload.digest(ot) == v1
    trainer.publish(2)

    up = rollout.update("latest")
    assert (up.action, up.version, up.prefetched) == ("replicated", 2, True)
    assert up.sources == (stage.client_id,)
    assert workload.digest(rt) == workload.digest(tt)
    assert up.cross_datacenter is False
    for h in (other, rollout, trainer):
        h.close(drop_last_copy=True)
    assert stage.state is tensorhub.HubState.CLOSED


def test_staging_copy_is_a_partial_holder_others_read_from(port):
    trainer, tt = _hub(port, replica="trainer")
    rollout, _ = _hub(port, replica="rollout")
    _publish(trainer, tt, 1)
    rollout.prefetch(1).result(timeout=30)
    trainer.unpublish()  # the staging copy is now the only source of version 1
    late, lt = _hub(port, replica="late")
    st = late.replicate(1)
    assert st.sources == (rollout.staging.client_id,)
    workload.fill_version(tt, 1)
    assert workload.digest(lt) == workload.digest(tt)
    for h in (late, rollout, trainer):
        h.close(drop_last_copy=True)


def test_update_while_the_prefetch_is_still_arriving_copies_behind_it(port):
    """The staging copy is half way through version 3 (held there) when update(3) is called:
    the update reads from the partial staging copy (pipelined behind it), not from the trainer,
    and ends with exact bytes once the prefetch goes on."""
    trainer, tt = _hub(port, replica="trainer")
    rollout, rt = _hub(port, replica="rollout")
    _publish(trainer, tt, 1)
    rollout.prefetch(1).result(timeout=30)  # makes the staging copy
    stage = rollout.staging
    half, go = inproc.hold_half_way(stage)
    _publish(trainer, tt, 3)
    fut = rollout.prefetch(3)
    assert half.wait(30) and not fut.done()
    threading.Timer(0.3, go.set).start()
    up = rollout.update(3)
    assert (up.version, up.prefetched, up.sources) == (3, True, (stage.client_id,))
    assert up.partial_source and up.stall_s > 0.1
    assert workload.digest(rt) == workload.digest(tt)
    assert fut.result(timeout=30).version == 3
    for h in (rollout, trainer):
        h.close(drop_last_copy=True)


def test_prefetch_superseded_by_a_newer_version(port):
    """update("latest") after a newer publish reads the newer version from its holder, exact
    bytes; the stale staging copy is simply not used; the next prefetch moves it on."""
    trainer, tt = _hub(port, replica="trainer")
    rollout, rt = _hub(port, replica="rollout")
    _publish(trainer, tt, 1)
    assert rollout.prefetch("latest").result(timeout=30).version == 1
    _publish(trainer, tt, 2)
    up = rollout.update("latest")
    assert (up.version, up.prefetched) == (2, False) and up.sources == (trainer.client_id,)
    assert workload.digest(rt) == workload.digest(tt)
    assert rollout.prefetch("latest").result(timeout=30).version == 2
    _publish(trainer, tt, 3)
    f3 = rollout.prefetch("latest")
    assert f3.result(timeout=30).version == 3
    up = rollout.update("latest")
    assert (up.version, up.prefetched) == (3, True)
    assert workload.digest(rt) == workload.digest(tt)
    for h in (rollout, trainer):
        h.close(drop_last_copy=True)


def test_prefetch_whose_source_dies_fails_over_and_update_still_gets_exact_bytes(port):
    """The staging copy's first source is unreadable (its memory is gone): the prefetch fails
    over to the other holder like any read; update() then copies locally."""
    h, ht = _hub(port, replica="h")
    t, tt = _hub(port, replica="t")
    rollout, rt = _hub(port, replica="rollout")
    for hub, ts in ((h, ht), (t, tt)):
        _publish(hub, ts, 1)
    h._memory.region.close()  # alive to the server, unreadable to readers
    st = rollout.prefetch(1).result(timeout=30)
    assert st.sources == (h.client_id, t.client_id) and st.failovers == 1
    up = rollout.update(1)
    assert up.prefetched and workload.digest(rt) == workload.digest(tt)
    for x in (rollout, t):
        x.close(drop_last_copy=True)


def test_prefetch_whose_only_source_dies_fails_and_update_reads_anew(port):
    """The only source is gone for good: the prefetch's future holds the typed error, nothing
    else is affected, and a later update() of a newer version reads normally."""
    trainer, tt = _hub(port, replica="trainer")
    rollout, rt = _hub(port, replica="rollout")
    _publish(trainer, tt, 1)
    trainer._hb_stop.set()  # the trainer dies: no more heartbeats, its memory unreadable
    trainer._memory.region.close()
    with pytest.raises(errors.VersionLost):
        rollout.prefetch(1).result(timeout=60)
    assert rollout.version is None and rollout.state is tensorhub.HubState.IDLE
    t2, t2t = _hub(port, replica="trainer2")
    _publish(t2, t2t, 2)
    up = rollout.update("latest")
    assert (up.version, up.prefetched) == (2, False)
    assert workload.digest(rt) == workload.digest(t2t)
    for x in (rollout, t2):
        x.close(drop_last_copy=True)
    trainer._machine.phase = tensorhub.HubState.CLOSED  # declared dead by the server already


def test_prefetch_into_a_user_buffer_and_bad_input(port):
    trainer, tt = _hub(port, replica="trainer")
    rollout, rt = _hub(port, replica="rollout")
    with pytest.raises(errors.LayoutMismatch):
        rollout.prefetch(1, buffer=[("x", torch.zeros(3))])
    with pytest.raises(errors.BadVersionSpec):
        rollout.prefetch(1, round=0)
    fresh = tensorhub.open("m", port=port, config=CFG, replica="unregistered")
    with pytest.raises(errors.InvalidState):
        fresh.prefetch(1)
    spare = workload.allocate(SPEC)
    _publish(trainer, tt, 1)
    assert rollout.prefetch(1, buffer=spare).result(timeout=30).version == 1
    assert workload.digest([t for _, t in spare]) == workload.digest(tt)  # staged in the user's buffer
    with pytest.raises(errors.InvalidState):
        rollout.prefetch(1, buffer=spare)  # the buffer is chosen once
    assert rollout.update(1).prefetched and workload.digest(rt) == workload.digest(tt)
    rollout.close(drop_last_copy=True)
    with pytest.raises(errors.HandleClosed):
        rollout.prefetch(1)
    trainer.close(drop_last_copy=True)


def test_aprefetch(port):
    trainer, tt = _hub(port, replica="trainer")
    rollout, rt = _hub(port, replica="rollout")
    _publish(trainer, tt, 4)

    async def main():
        st = await rollout.aprefetch("latest")
        up = await rollout.aupdate("latest")
        return st, up

    st, up = asyncio.run(main())
    assert st.version == 4 and up.prefetched and workload.digest(rt) == workload.digest(tt)
    for h in (rollout, trainer):
        h.close(drop_last_copy=True)


@pytest.mark.parametrize("sizes", [[5, 7, 0, 100], [1], [1000, 3, 3, 3], [64] * 7])
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_local_copy_of_a_complete_staging_copy_cuts_the_bytes_into_exact_spans(sizes, threads, monkeypatch):
    """The bulk copy after a completed prefetch (one-thread torch: bytes cut into equal spans
    across tensor boundaries) copies every byte exactly once."""
    from tensorhub.transport import shm

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    src = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]

    class Region:
        tensors = src
        control = torch.zeros(2, dtype=torch.int64)

    dst = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    shm.LocalSource(Region(), "stage").copy_all(dst, threads)
    assert all(torch.equal(a, b) for a, b in zip(dst, src))


def _double(port, replica="rollout"):
    """A handle with a double buffer: (hub, primary tensors, spare tensors)."""
    named, spare = workload.allocate(SPEC), workload.allocate(SPEC)
    hub = tensorhub.open("m", port=port, config=CFG, replica=replica)
    hub.register(named, double_buffer=spare)
    return hub, [t for _, t in named], [t for _, t in spare]


def test_double_buffer_update_swaps_instead_of_copying_and_serves_from_the_new_set(port):
    trainer, tt = _hub(port, replica="trainer")
    rollout, primary, spare = _double(port)
    _publish(trainer, tt, 1)
    assert rollout.update("latest").version == 1 and workload.digest(primary) == workload.digest(tt)
    for v, live, other in ((2, spare, primary), (3, primary, spare)):
        _publish(trainer, tt, v)
        before = workload.digest(other)  # the set that serves version v-1 until the swap
        assert rollout.prefetch("latest").result(timeout=30).version == v
        assert workload.digest(other) == before and rollout.version == v - 1
        st = rollout.update("latest")
        assert (st.action, st.version, st.swapped, st.prefetched, st.bytes) == ("replicated", v, True, True, 0)
        assert [t.data_ptr() for _, t in rollout.tensors] == [t.data_ptr() for t in live]
        assert workload.digest(live) == workload.digest(tt) and rollout.version == v
        held = _holders(port)
        assert held[rollout.client_id].version == v and held[rollout.staging.client_id].version == -1
        # Others read version v from the rollout: the server gives them the new set's endpoint.
        trainer.unpublish()
        reader, rt = _hub(port, replica=f"reader{v}")
        got = reader.replicate(v)
        assert got.sources == (rollout.client_id,) and workload.digest(rt) == workload.digest(live)
        reader.close(drop_last_copy=True)
        trainer.publish(v)
    assert rollout.update("latest").action == "noop"
    rollout.close(drop_last_copy=True); trainer.close(drop_last_copy=True)


def _version_2_prefetched(port):
    """A trainer at version 2; a rollout with a double buffer that holds 1 and prefetched 2."""
    trainer, tt = _hub(port, replica="trainer")
    rollout, primary, spare = _double(port)
    _publish(trainer, tt, 1)
    rollout.update("latest")
    _publish(trainer, tt, 2)
    assert rollout.prefetch("latest").result(timeout=30).version == 2
    return trainer, tt, rollout, primary, spare


def test_double_buffer_copies_when_the_prefetch_is_not_what_update_asks(port):
    trainer, tt, rollout, primary, spare = _version_2_prefetched(port)
    _publish(trainer, tt, 3)  # "latest" moved on: the staging copy's version 2 is not it
    st = rollout.update("latest")
    assert (st.version, st.swapped) == (3, False) and st.bytes > 0
    assert [t.data_ptr() for _, t in rollout.tensors] == [t.data_ptr() for t in primary]
    assert workload.digest(primary) == workload.digest(tt)
    rollout.close(drop_last_copy=True); trainer.close(drop_last_copy=True)


def test_a_swapped_handle_reannounces_its_new_endpoint_after_a_server_restart(port):
    trainer, tt, rollout, primary, spare = _version_2_prefetched(port)
    assert rollout.update("latest").swapped
    trainer.close(drop_last_copy=True)
    port.restart()
    reader, rt = _hub(port, replica="reader")
    deadline = time.monotonic() + 20
    while True:  # the rollout re-announces with its next pulse
        try:
            got = reader.replicate(2)
            break
        except (errors.ServerRecovering, errors.VersionNotFound, errors.UnknownModel):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert got.sources == (rollout.client_id,) and workload.digest(rt) == workload.digest(spare)
    reader.close(drop_last_copy=True); rollout.close(drop_last_copy=True)


def test_double_buffer_bad_input(port):
    named, other = workload.allocate(SPEC), workload.allocate(workload.small_spec(1 << 20, big=1, tiny=3))
    with pytest.raises(errors.LayoutMismatch):
        tensorhub.open("m", port=port, config=CFG, replica="a").register(named, double_buffer=other)
    with pytest.raises(errors.LayoutMismatch, match="shares memory"):
        tensorhub.open("m", port=port, config=CFG, replica="b").register(named, double_buffer=named)
    rollout, _, _ = _double(port, replica="c")
    with pytest.raises(errors.InvalidState):
        rollout.prefetch("latest", buffer=workload.allocate(SPEC))
    rollout.close(drop_last_copy=True)


def test_swap_benchmark_runs_and_checks_its_bytes():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "benchmarks/swap.py", "--bytes", "4MiB", "--versions", "3", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["bytes"] > 3 << 20 and len(res["runs"]) == 3 and res["swap_update_s"] > 0
