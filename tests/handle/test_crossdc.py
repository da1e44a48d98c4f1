"""Cross-datacenter rules with real handles against an in-process server (LocalPort): offload
seeding (the server asks one replica per remote datacenter to prefetch a committed version),
smart skipping while that seed is in flight, the datacenter's readers reading the seed
locally, and (``prefetch_in_datacenter``) prefetching it there ahead of their updates. The
byte counts on real (emulated) links are in tests/cluster/test_crossdc_cluster.py."""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import pytest

import tensorhub
from tensorhub.config import Config
from tensorhub.ports import LocalPort
from tensorhub.testing import inproc, workload

# The one-seeder flow (the datacenter's other readers read the seed at update time); the tests
# of prefetches inside the datacenter turn them on (PREFETCH).
CFG = Config(unit_bytes=256 << 10, heartbeat_interval_s=0.1, lease_timeout_s=5.0, source_stall_timeout_s=2.0,
             same_host=False, versions_retained=3, prefetch_in_datacenter=False)
PREFETCH = CFG.replace(prefetch_in_datacenter=True)
SPEC = workload.small_spec(2 << 20, big=2, tiny=12)


@pytest.fixture
def port():
    return LocalPort(CFG)


def _hub(port, dc, config=CFG, **kw):
    return inproc.open_hub(port, config=config, spec=SPEC, datacenter=dc, **kw)


_publish = inproc.publish


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _staged(hub, version):
    stage = hub.staging
    return stage is not None and stage.version == version


def test_a_committed_version_is_seeded_into_each_remote_datacenter_once(port):
    """dc a: trainer ; dc b: b0, b1 ; dc c: c0. Publishing asks b0 and c0 (idle, first
    registered) to seed: their staging copies read across, everybody else in b reads inside b,
    and the seeders' own updates are local copies."""
    trainer, tt = _hub(port, "a", replica="trainer")
    b0, b0t = _hub(port, "b", replica="b0")
    b1, b1t = _hub(port, "b", replica="b1")
    c0, c0t = _hub(port, "c", replica="c0")
    _publish(trainer, tt, 1)
    _wait(lambda: _staged(b0, 1) and _staged(c0, 1))
    assert b1.staging is None  # one seeder per datacenter
    st = b1.update("latest")
    assert st.version == 1 and st.sources == (b0.staging.client_id,) and not st.cross_datacenter
    for hub, ts in ((b0, b0t), (c0, c0t)):
        up = hub.update("latest")
        assert up.prefetched and not up.cross_datacenter and workload.digest(ts) == workload.digest(tt)
    assert workload.digest(b1t) == workload.digest(tt)
    for h in (b1, b0, c0, trainer):
        h.close(drop_last_copy=True)


def _seeded(port, config: Config):
    """dc a: trainer ; dc b: b0, b1. b0 seeds version 1 and both read it: trainer, its tensors,
    b0, b1, b1's tensors."""
    trainer, tt = _hub(port, "a", config=config, replica="trainer")
    b0, _ = _hub(port, "b", config=config, replica="b0")
    b1, b1t = _hub(port, "b", config=config, replica="b1")
    _publish(trainer, tt, 1)
    _wait(lambda: _staged(b0, 1))
    assert b1.update("latest").version == 1 and b0.update("latest").prefetched
    return trainer, tt, b0, b1, b1t


class HeldSeed(NamedTuple):
    """What :func:`held_seed` set up: the hubs, their tensors, b0's staging copy (the seeder)
    and the event that lets its held read of version 2 go on."""
    trainer: tensorhub.Hub
    tt: list
    b0: tensorhub.Hub
    b1: tensorhub.Hub
    b1t: list
    stage: tensorhub.Hub
    go: threading.Event


@pytest.fixture
def held_seed():
    """dc a: trainer ; dc b: b0, b1. b0 seeds version 1 and both read it; then b0's seed of
    version 2 is held half way (``HeldSeed.go`` lets it on). A factory: call it with the
    config (one LocalPort of it). At teardown the seed is let go and the hubs closed."""
    made: list[HeldSeed] = []

    def setup(config: Config = CFG) -> HeldSeed:
        trainer, tt, b0, b1, b1t = _seeded(LocalPort(config), config)
        stage = b0.staging
        half, go = inproc.hold_half_way(stage)
        _publish(trainer, tt, 2)
        assert half.wait(20)
        made.append(HeldSeed(trainer, tt, b0, b1, b1t, stage, go))
        return made[-1]

    yield setup
    for h in made:
        h.go.set()  # a test that failed while the seed was held must not hang the close
        for hub in (h.b1, h.b0, h.trainer):
            hub.close(drop_last_copy=True)


def test_smart_skipping_while_the_seed_is_in_flight_then_the_seed_is_read_locally(held_seed):
    trainer, tt, b0, b1, b1t, stage, go = held_seed()
    st = b1.update("latest")
    assert (st.action, st.version, st.skipped_in_flight) == ("noop", 1, 2)
    st = b0.update("latest")  # the seeder's own engine also keeps version 1 meanwhile
    assert (st.action, st.version, st.skipped_in_flight) == ("noop", 1, 2)
    go.set()
    _wait(lambda: _staged(b0, 2))
    st = b1.update("latest")
    assert (st.version, st.skipped_in_flight, st.cross_datacenter) == (2, None, False)
    assert st.sources == (stage.client_id,)
    workload.fill_version(tt, 2)
    assert workload.digest(b1t) == workload.digest(tt)


def test_a_smart_skip_is_answered_locally_without_a_call_until_the_seed_landed(held_seed):
    """With ``noop_staleness_s``, the server pushes dc b's skip to its handles: while b0's seed
    of 2 is held half way, b1's ``update("latest")`` skips 2 with no server call and the same
    ``ReadStats`` as the server's skip; once the news that the seed landed reached b1, its
    update asks the server and reads 2 inside dc b."""
    trainer, tt, b0, b1, b1t, stage, go = held_seed(CFG.replace(noop_staleness_s=5.0))
    view = b1._machine.view
    _wait(lambda: (view.in_flight, view.ready) == (2, 1))  # the push of dc b's skip reached b1
    before = b1.server_calls()
    st = b1.update("latest")
    assert (st.action, st.version, st.skipped_in_flight) == ("noop", 1, 2)
    assert b1.server_calls() == before, "answered locally"
    go.set()
    _wait(lambda: _staged(b0, 2) and view.in_flight == -1)  # landed, and b1 was told
    before = b1.server_calls()
    st = b1.update("latest")
    assert (st.version, st.skipped_in_flight, st.cross_datacenter) == (2, None, False)
    assert b1.server_calls() > before
    workload.fill_version(tt, 2)
    assert workload.digest(b1t) == workload.digest(tt)


def test_a_landed_seed_stays_in_its_datacenter_while_the_next_one_crosses(port):
    """The seeder's staging copy lands version 2 and, before any engine there took it, version
    3 is committed: the staging copy keeps 2 in its datacenter as a host copy before it starts
    3 (it used to overwrite it). While 3 crosses, "latest" in dc b answers 2, read there from
    that host copy; when 3 lands and 4 follows, the copy of 2 goes (a newer one is kept).
    Without retention copies made ahead (those go to the first reader anywhere)."""
    trainer, tt, b0, b1, b1t = _seeded(port, CFG.replace(host_copy_ahead=False))
    _publish(trainer, tt, 2)
    _wait(lambda: _staged(b0, 2))  # landed; nobody in dc b updates
    stage = b0.staging
    half, go = inproc.hold_half_way(stage)
    _publish(trainer, tt, 3)
    assert half.wait(20)
    kept = f"{stage.client_id}#host2"
    assert kept in port.core.nodes and port.core.nodes[kept].datacenter == "b"
    st = b1.update("latest")
    assert (st.version, st.skipped_in_flight, st.cross_datacenter) == (2, 3, False)
    assert st.sources == (kept,)
    ref = [t.clone() for t in tt]  # the trainer's own tensors hold 3 now, being read
    workload.fill_version(ref, 2)
    assert workload.digest(b1t) == workload.digest(ref)
    go.set()
    _wait(lambda: _staged(b0, 3))
    _publish(trainer, tt, 4)
    _wait(lambda: f"{stage.client_id}#host3" in port.core.nodes and kept not in port.core.nodes)
    for h in (b1, b0, trainer):
        h.close(drop_last_copy=True)


def test_without_skipping_the_reader_waits_for_the_seed_and_reads_it_locally(port):
    cfg = Config(**{**CFG.__dict__, "smart_skipping": False})
    trainer, tt = _hub(port, "a", config=cfg, replica="trainer")
    b0, _ = _hub(port, "b", config=cfg, replica="b0")
    b1, b1t = _hub(port, "b", config=cfg, replica="b1")
    _publish(trainer, tt, 1)
    _wait(lambda: b0.staging is not None)
    st = b1.update("latest")
    assert st.version == 1 and st.skipped_in_flight is None and not st.cross_datacenter
    assert workload.digest(b1t) == workload.digest(tt)
    for h in (b1, b0, trainer):
        h.close(drop_last_copy=True)


def test_a_seeder_that_leaves_before_seeding_is_replaced(port):
    cfg = Config(**{**CFG.__dict__, "heartbeat_interval_s": 30.0, "lease_timeout_s": 100.0})
    trainer, tt = _hub(port, "a", config=cfg, replica="trainer")
    b0, _ = _hub(port, "b", config=cfg, replica="b0")  # heartbeats rarely: takes its notes late
    b1, b1t = _hub(port, "b", config=cfg, replica="b1")
    _publish(trainer, tt, 1)
    b0.close(drop_last_copy=True)  # asked to seed, never did
    b1._background.take_notes()
    _wait(lambda: _staged(b1, 1))
    assert b1.update("latest").prefetched and workload.digest(b1t) == workload.digest(tt)
    for h in (b1, trainer):
        h.close(drop_last_copy=True)


def test_no_seeding_inside_one_datacenter_or_when_off(port):
    trainer, tt = _hub(port, "a", replica="trainer")
    r, _ = _hub(port, "a", replica="r")
    off = Config(**{**CFG.__dict__, "offload_seeding": False})
    port_off = LocalPort(off)
    t2, t2t = _hub(port_off, "a", config=off, replica="trainer")
    b, _ = _hub(port_off, "b", config=off, replica="b")
    _publish(trainer, tt, 1)
    _publish(t2, t2t, 1)
    time.sleep(0.5)
    assert r.staging is None and b.staging is None
    assert b.update("latest").cross_datacenter
    for h in (r, trainer, b, t2):
        h.close(drop_last_copy=True)


def _reading_in(port, hub, dc):
    """``hub``'s staging copy reads from a source in datacenter ``dc`` now."""
    node = port.core.nodes.get(hub.staging.client_id) if hub.staging is not None else None
    src = port.core.nodes.get(node.source) if node is not None and node.source else None
    return src is not None and src.datacenter == dc


def test_every_reader_of_a_remote_datacenter_prefetches_behind_the_seed_and_updates_locally():
    """dc a: trainer ; dc b: b0 (the seeder), b1, b2.

        trainer -> b0~prefetch (across) -> b1~prefetch / b2~prefetch (inside dc b)

    While the seed of version 2 is held half way across, b1's and b2's staging copies already
    read it inside dc b (the seed is partial there); once it lands, every engine's update is a
    local copy of its own staging copy, and every copy is exact."""
    port = LocalPort(PREFETCH)
    trainer, tt = _hub(port, "a", config=PREFETCH, replica="trainer")
    hubs = [_hub(port, "b", config=PREFETCH, replica=f"b{i}") for i in range(3)]
    (b0, _), (b1, _), (b2, _) = hubs
    _publish(trainer, tt, 1)
    _wait(lambda: all(_staged(h, 1) for h, _ in hubs))
    for h, ts in hubs:
        st = h.update("latest")
        assert (st.version, st.prefetched, st.cross_datacenter) == (1, True, False)
        assert workload.digest(ts) == workload.digest(tt)
    half, go = inproc.hold_half_way(b0.staging)
    _publish(trainer, tt, 2)
    assert half.wait(20)
    # Neither can have version 2 but through dc b's held seed: both read it there, behind it.
    _wait(lambda: _reading_in(port, b1, "b") and _reading_in(port, b2, "b"))
    assert not _staged(b1, 2) and not _staged(b2, 2)
    go.set()
    _wait(lambda: all(_staged(h, 2) for h, _ in hubs))
    for h, ts in hubs:
        st = h.update("latest")
        assert (st.version, st.prefetched, st.cross_datacenter, st.sources) == (2, True, False,
                                                                               (h.staging.client_id,))
        assert workload.digest(ts) == workload.digest(tt)
    for h, _ in (*hubs[::-1], (trainer, tt)):
        h.close(drop_last_copy=True)


def test_with_a_double_buffer_the_datacenters_other_readers_swap():
    """dc b: b0 seeds, b1 registered a double buffer: its prefetch lands in the spare set and its
    update swaps the two sets (no copy), holding the version exactly."""
    port = LocalPort(PREFETCH)
    trainer, tt = _hub(port, "a", config=PREFETCH, replica="trainer")
    b0, _ = _hub(port, "b", config=PREFETCH, replica="b0")
    b1 = tensorhub.open("m", port=port, config=PREFETCH, datacenter="b", replica="b1")
    b1.register(workload.allocate(SPEC), double_buffer=workload.allocate(SPEC))
    _publish(trainer, tt, 1)
    # The staging copy holds version 1 a moment before its prefetch job ends, and a swap does not
    # take a staging copy whose job still runs (it copies then): wait for the job too (a
    # clean-clone run hit that moment).
    _wait(lambda: _staged(b0, 1) and _staged(b1, 1) and not b1._staging._jobs)
    st = b1.update("latest")
    assert (st.version, st.swapped, st.cross_datacenter) == (1, True, False)
    assert workload.digest([t for _, t in b1.tensors]) == workload.digest(tt)
    for h in (b1, b0, trainer):
        h.close(drop_last_copy=True)


def test_a_prefetch_inside_the_datacenter_waits_until_the_engine_took_the_staged_version():
    """b1's staging copy holds version 1, which b1's engine has not taken, when version 2's seed
    reaches dc b: replacing 1 then would send b1's next update over the network for it (smart
    skipping answers 1 while 2 crosses). The prefetch of 2 waits; b1's update takes 1 from its
    own staging copy, and only then does the staging copy read 2, behind the seed."""
    port = LocalPort(PREFETCH)
    trainer, tt = _hub(port, "a", config=PREFETCH, replica="trainer")
    b0, _ = _hub(port, "b", config=PREFETCH, replica="b0")
    b1, b1t = _hub(port, "b", config=PREFETCH, replica="b1")
    _publish(trainer, tt, 1)
    _wait(lambda: _staged(b0, 1) and _staged(b1, 1))
    assert b0.update("latest").prefetched  # only the seeder's engine takes version 1
    half, go = inproc.hold_half_way(b0.staging)
    ref = [t.clone() for t in tt]
    _publish(trainer, tt, 2)
    assert half.wait(20)
    time.sleep(0.5)  # PrefetchAhead(2) reached b1 (pulses every 0.1 s)
    assert b1.staging.version == 1, "the staged version 1 is kept for b1's engine"
    st = b1.update("latest")
    assert (st.version, st.prefetched, st.skipped_in_flight) == (1, True, 2)
    assert workload.digest(b1t) == workload.digest(ref)
    _wait(lambda: _reading_in(port, b1, "b"))  # now it reads 2, inside dc b
    go.set()
    _wait(lambda: _staged(b1, 2))
    st = b1.update("latest")
    assert (st.version, st.prefetched, st.cross_datacenter) == (2, True, False)
    assert workload.digest(b1t) == workload.digest(tt)
    for h in (b1, b0, trainer):
        h.close(drop_last_copy=True)


def test_a_no_op_update_answered_locally_costs_no_server_call():
    """With ``noop_staleness_s``, once the push of the newest version reached the handle, a no-op
    ``update("latest")`` sends nothing (``Hub.server_calls`` around it: 0); without, one call."""
    local = PREFETCH.replace(noop_staleness_s=5.0)
    for cfg, expect in ((local, 0), (PREFETCH, 1)):
        port = LocalPort(cfg)
        trainer, tt = _hub(port, "a", config=cfg, replica="trainer")
        r, _ = _hub(port, "a", config=cfg, replica="r")
        _publish(trainer, tt, 1)
        assert r.update("latest").version == 1
        time.sleep(0.5)  # the push of version 1's commit reaches r's pulse
        before = r.server_calls()
        st = r.update("latest")
        assert st.action == "noop" and r.server_calls() - before == expect, cfg.noop_staleness_s
        for h in (r, trainer):
            h.close(drop_last_copy=True)
