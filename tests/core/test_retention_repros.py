"""Regression tests for the protocol and retention defects of review issue 22, section 4
(``shared/repro/``): the reference core driven directly, the simulator, and the real client over
an in-process server (no Ray)."""

from __future__ import annotations

import logging
import threading

import pytest

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.reference import ReferenceCore
from tensorhub.core.retention import Retention
from tensorhub.core.state import NodeState
from tensorhub.ports import LocalPort
from tensorhub.server.requests import Mailboxes, PulseHolds, apply_request, holdable
from tensorhub.sim import run_scenario

LAY = m.LayoutInfo(fingerprint="f", unit_count=4, total_bytes=4096)


def _reg(cid: str, replica: str, shard: int = 0, num_shards: int = 1) -> m.Register:
    return m.Register(client_id=cid, model="policy", replica_id=replica, shard=shard, num_shards=num_shards,
                      layout=LAY, endpoint=cid.encode())


class _Server:
    """The core behind the shared serving rules (mailboxes, pulse holds), as every driver runs it;
    ``tick`` stamps held pulses as the drivers' tick loops do."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.core, self.mail, self.holds = ReferenceCore(cfg), Mailboxes(), PulseHolds()
        self.now = 0.0

    def call(self, req):
        for hold in self.holds.releases(req):
            self.holds.answer(hold, self.core, self.mail, self.now)
        reply, _ = apply_request(self.core, self.mail, req, self.now)
        return reply

    def hold_pulse(self, cid: str) -> None:
        """``cid``'s process goes idle: its pulse is held (after the one that brought its notes)."""
        pulse = m.Pulse(beats=(m.Beat(cid),))
        reply = self.call(pulse)
        if reply.notes:
            reply = self.call(pulse)
        assert holdable(pulse, reply, self.cfg.pulse_hold_s, self.cfg.pulse_hold_s)
        self.holds.start(pulse, self.core, self.now + self.cfg.pulse_hold_s, self.now)

    def tick(self, dt: float) -> None:
        self.now += dt
        if self.holds.of:
            self.core.touch(self.holds.attended(), self.now)
        self.mail.route(self.core.tick(self.now))

    def pop(self, cid: str) -> list:
        out = list(self.mail.pop_background(cid))
        while True:
            ev = self.mail.pop_terminal(cid)
            if ev is None:
                return out
            out.append(ev)


def _held_rollout(alive_s: float = 8.0) -> _Server:
    """trainer T publishes v1, rollout R reads it and makes its retention copy ahead, then R's
    pulse is held for ``alive_s`` while T heartbeats."""
    srv = _Server(Config(lease_timeout_s=10.0, heartbeat_interval_s=1.0, pulse_hold_s=30.0, versions_retained=2))
    srv.call(_reg("T", "trainer"))
    srv.call(m.Publish("T", 1))
    srv.call(_reg("R", "rollout"))
    srv.call(m.Replicate("R", "latest", seq=1))
    srv.call(m.ReplicateDone("R", 1))
    srv.call(m.HostCopy("R", 1, b"host:R:1"))
    srv.hold_pulse("R")
    for _ in range(int(alive_s / 0.5)):
        srv.tick(0.5)
        srv.call(m.Heartbeat("T"))
    return srv


def test_a_held_pulse_is_no_proof_that_the_last_other_copy_lives():
    """held_pulse_keeps_a_dead_holder_counted.py.

    trainer -> R (R's process died without Ray knowing; its pulse is held): T's unpublish of
    v1 must not trust R's copies; with no proof from R it offloads (before: UnpublishDone at once)."""
    srv = _held_rollout()
    reply = srv.call(m.Unpublish("T"))
    assert not isinstance(reply, m.UnpublishDone)
    assert any(isinstance(e, m.Probe) for e in srv.pop("R"))  # the held pulse is answered: prove it
    for _ in range(6):  # R is dead: no pulse comes
        srv.tick(0.5)
        srv.call(m.Heartbeat("T"))
    assert srv.core.nodes["T"].state is NodeState.OFFLOADING
    assert m.OffloadOrder(version=1) in srv.pop("T")
    assert srv.call(m.OffloadDone("T", 1, b"host:T:1")) == m.UnpublishDone(version=1)
    assert "T#host1" in srv.core.nodes


def test_a_probed_holder_that_pulses_again_spares_the_offload():
    """trainer -> R (alive, idle, pulse held): the probe brings R's next pulse, which proves it
    alive; T's unpublish then ends without an offload."""
    srv = _held_rollout()
    assert isinstance(srv.call(m.Unpublish("T")), m.Waiting)
    assert any(isinstance(e, m.Probe) for e in srv.pop("R"))
    srv.now += 0.3
    srv.call(m.Pulse(beats=(m.Beat("R"),)))
    assert srv.pop("T") == [m.UnpublishDone(version=1)]
    assert srv.core.nodes["T"].state is NodeState.IDLE and "T#host1" not in srv.core.nodes
    assert not srv.core.retention.probing


def test_a_fleet_of_idle_holders_is_probed_a_few_at_a_time():
    """trainer -> R0..R9 (all idle, pulses held for 8 s): the unpublish wakes 4 of them, not 10;
    the first proof ends it without an offload."""
    srv = _Server(Config(lease_timeout_s=10.0, heartbeat_interval_s=1.0, pulse_hold_s=30.0, versions_retained=2,
                         readers_per_source_max=10))
    srv.call(_reg("T", "trainer"))
    srv.call(m.Publish("T", 1))
    rollouts = [f"R{i}" for i in range(10)]
    for cid in rollouts:
        srv.call(_reg(cid, cid))
        srv.call(m.Replicate(cid, "latest", seq=1))
        srv.call(m.ReplicateDone(cid, 1))
        srv.hold_pulse(cid)
    for _ in range(16):
        srv.tick(0.5)
        srv.call(m.Heartbeat("T"))
    assert isinstance(srv.call(m.Unpublish("T")), m.Waiting)
    probed = [cid for cid in rollouts if any(isinstance(e, m.Probe) for e in srv.pop(cid))]
    assert len(probed) == 4
    srv.call(m.Pulse(beats=(m.Beat(probed[-1]),)))
    assert srv.pop("T") == [m.UnpublishDone(version=1)]
    assert "T#host1" not in srv.core.nodes and not srv.core.retention.probing


def test_without_held_pulses_a_silent_holder_is_not_probed():
    """pulse_hold_s = 0: a silent holder is dead to retention at once (no probe, no wait)."""
    srv = _Server(Config(lease_timeout_s=10.0, heartbeat_interval_s=1.0, pulse_hold_s=0.0, versions_retained=2))
    srv.call(_reg("T", "trainer"))
    srv.call(m.Publish("T", 1))
    srv.call(_reg("R", "rollout"))
    srv.call(m.Replicate("R", "latest", seq=1))
    srv.call(m.ReplicateDone("R", 1))
    for _ in range(8):
        srv.tick(0.5)
        srv.call(m.Heartbeat("T"))
    assert srv.call(m.Unpublish("T")) == m.OffloadOrder(version=1)
    assert not any(isinstance(e, m.Probe) for e in srv.pop("R"))


def _drive(cfg: Config):
    core = ReferenceCore(cfg)
    clock = {"now": 0.0}

    def call(req, dt: float = 0.0):
        clock["now"] += dt
        return core.handle(req, clock["now"])
    return core, clock, call


def test_offload_done_keeps_a_holder_drained_while_a_late_announced_reader_still_reads_it():
    """reader_attached_to_an_offloading_holder.py.

    H (offloading v3 after a restart) -> R (re-announced late as reading from H): OffloadDone
    publishes H's host copy, but H may not write while R still reads; it drains until R is done."""
    core, clock, call = _drive(Config(versions_retained=2, lease_timeout_s=10.0, heartbeat_interval_s=1.0))
    call(m.Announce(_reg("H", "trainer"), m.Holding(published=3)))
    call(m.Unpublish("H"))
    for _ in range(21):
        call(m.Heartbeat("H"), dt=0.5)
    assert [e.event for e in core.tick(clock["now"])] == [m.OffloadOrder(version=3)]
    call(m.Announce(_reg("R", "r0"), m.Holding(reading_version=3, reading_source="H", reading_units=1)))
    assert core.nodes["R"].source == "H"
    reply, effects = call(m.OffloadDone("H", 3, b"host:H:3"))
    assert reply == m.Waiting(version=3) and not effects
    h = core.nodes["H"]
    assert h.state is NodeState.DRAINING and h.readers == {"R"} and "H#host3" in core.nodes
    assert call(m.Publish("H", 4))[0].code == "InvalidState"  # not told it may write
    reply, effects = call(m.ReplicateDone("R", 3))
    assert reply == m.Ok()
    assert [(e.client_id, e.event) for e in effects] == [("H", m.UnpublishDone(version=3))]
    assert h.state is NodeState.IDLE and not h.readers


def test_a_host_copy_of_a_forgotten_version_announced_after_a_restart_is_dropped():
    """old_host_copy_announced_after_restart_never_dropped.py.

    After a restart the floor of retention is 4 (versions 3, 4, 5 announced; keep 2): R3's host
    copy of version 2 (its DropHostCopy was lost with the old server) is dropped, not kept --
    once the recovery window is over (simulator seed 9037: dropped at once, it was freed under a
    reader that had not re-announced yet); meanwhile no new reader is sent to it."""
    core, clock, call = _drive(Config(versions_retained=2, lease_timeout_s=10.0, heartbeat_interval_s=1.0))
    call(m.Announce(_reg("T", "trainer"), m.Holding(published=5)))
    call(m.Announce(_reg("R1", "r1"), m.Holding(published=4)))
    call(m.Announce(_reg("R2", "r2"), m.Holding(published=3)))
    assert core.models["policy"].forgotten_below == 4
    reply, effects = call(m.Announce(_reg("R3", "r3"), m.Holding(host_copies=((2, b"host:R3:2"),))))
    assert reply == m.Ok() and not effects, "not freed inside the recovery window"
    assert core.nodes["R3#host2"].state.value == "draining"
    drops = []
    for _ in range(24):
        for cid in ("T", "R1", "R2", "R3"):
            call(m.Heartbeat(cid), dt=0.125)
        drops += [(e.client_id, e.event) for e in core.tick(clock["now"])]
    assert drops == [("R3", m.DropHostCopy(version=2))]
    assert not any(n.host for n in core.nodes.values())


def test_a_host_copy_that_falls_out_of_retention_inside_the_recovery_window_is_dropped_when_it_ends():
    """Mixed seed 9617, one layout class's part of it: R announces its host copy of version 2
    first, while 2 is the newest version the restarted server knows (kept, and committed again);
    R2 then announces a completion of version 4, which pushes 2 out of retention (keep 1). The
    copy drains at once (hidden from new readers) but is freed only once the recovery window is
    over, as a copy announced past retention is: a reader copying from it under the old server
    may not have announced yet."""
    core, clock, call = _drive(Config(versions_retained=1, lease_timeout_s=10.0, heartbeat_interval_s=1.0))
    assert call(m.Announce(_reg("R", "r"), m.Holding(host_copies=((2, b"host:R:2"),)))) == (m.Ok(), [])
    assert core.nodes["R#host2"].state is NodeState.PUBLISHED and core.models["policy"].committed == [2]
    reply, effects = call(m.Announce(_reg("R2", "r2"), m.Holding(published=4)), dt=0.5)
    assert reply == m.Ok() and not effects, "not freed inside the recovery window"
    assert core.models["policy"].forgotten_below == 4 and core.nodes["R#host2"].state is NodeState.DRAINING
    drops = []
    for _ in range(48):  # 12 s: past the window (10 s from the first announcement)
        for cid in ("R", "R2"):
            call(m.Heartbeat(cid), dt=0.125)
        drops += [(e.client_id, e.event, clock["now"] >= 10.0) for e in core.tick(clock["now"])]
    assert drops == [("R", m.DropHostCopy(version=2), True)]
    assert not any(n.host for n in core.nodes.values())


def test_a_host_copy_of_an_uncommitted_version_goes_when_retention_moves_past_it():
    """Sharded (2 shards): R's host copy of version 2 shard 0 alone (never committed) is announced
    first; once commits raise the floor past 2, it drains and is dropped."""
    core, clock, call = _drive(Config(versions_retained=2, lease_timeout_s=10.0, heartbeat_interval_s=1.0))
    call(m.Announce(_reg("R/0", "r", 0, 2), m.Holding(host_copies=((2, b"host:R/0:2"),))))
    assert "R/0#host2" in core.nodes
    drops = []
    for v in (3, 4, 5):
        for s in (0, 1):
            _, effects = call(m.Announce(_reg(f"T{v}/{s}", f"t{v}", s, 2), m.Holding(published=v)))
            drops += [e for e in effects if isinstance(e.event, m.DropHostCopy)]
    for _ in range(25):
        call(m.Heartbeat("R/0"), dt=0.5)
        for v in (3, 4, 5):
            for s in (0, 1):
                call(m.Heartbeat(f"T{v}/{s}"))
        drops += [e for e in core.tick(clock["now"]) if isinstance(e.event, m.DropHostCopy)]
    assert core.models["policy"].forgotten_below == 4
    assert "R/0#host2" not in core.nodes
    assert [(e.client_id, e.event) for e in drops] == [("R/0", m.DropHostCopy(version=2))]


def test_seed_4300_replays_without_violations():
    """Colocated, a server restart: the run quiesced before an idle trainer shard had re-announced
    its host copy, and the end check found version 3 'not available'. The end waits for every
    live client to be known to the server again."""
    r = run_scenario(4300)
    assert r.workload == "colocated"
    assert r.violations == []


class _HeldPulseTrustedRetention(Retention):
    """The rule before the fix: a held pulse counts as proof of life for the last-copy rule."""

    def heard_lately(self, node, attended: bool = False) -> bool:
        return super().heard_lately(node, attended=True)


def _held_pulse_trusted(*args, **kwargs) -> ReferenceCore:
    core = ReferenceCore(*args, **kwargs)
    core.retention.__class__ = _HeldPulseTrustedRetention  # the same part, with the old rule
    return core


@pytest.mark.parametrize("seed", [31, 125])  # re-found (were 1 and 28) when seeds of named rounds came to wait for the trainer's next step (tensorhub.sim STEPPED_SHARE)
def test_ghost_checker_flags_an_offload_skipped_for_copies_on_crashed_held_processes(seed):
    """sim_held_pulse_ghost_holders_unflagged.py: the simulator's ``ghost`` checker. With the
    old rule an unpublish skipped the offload while its only other copies were on processes dead for seconds, kept 'heard from' by their
    held pulses; with the rule fixed, the same seed is clean."""
    kinds = [k for k, _, _ in run_scenario(seed, core_factory=_held_pulse_trusted).violations]
    assert "ghost" in kinds
    assert run_scenario(seed).violations == []


def test_a_sharded_seeder_that_skips_a_seed_stays_in_its_siblings_rounds():
    """sharded_seed_rounds_drift.py.

    Sharded seeder (2 shards, dc1): shard 0 skips seed 2 (busy, seed 3 already asked), shard 1
    takes it. Rounds of seeds are named by their version, so seed 4 asked of shard 0 first
    still meets shard 1 in one round (before: shard 0 a round behind, TransactionMismatch)."""
    from tensorhub.testing import inproc

    logging.disable(logging.WARNING)
    cfg = inproc.CONFIG.replace(versions_retained=3, offload_seeding=False)  # seeds asked by hand
    port = LocalPort(cfg)
    trainers = [inproc.open_hub(port, config=cfg, replica="trainer", shard=s, num_shards=2) for s in (0, 1)]
    seeders = [inproc.open_hub(port, config=cfg, replica="seeder", shard=s, num_shards=2, datacenter="dc1")
               for s in (0, 1)]
    r0, r1 = seeders[0][0], seeders[1][0]

    def publish(v: int) -> None:
        for h, t in trainers:
            inproc.publish(h, t, v)

    def settle(hub) -> None:
        hub._staging.executor.submit(lambda: None).result(timeout=60)  # one worker: after every seed

    try:
        for v in (1, 2, 3):
            publish(v)
        r0._staging.seed_asked(1), r1._staging.seed_asked(1)
        settle(r0), settle(r1)
        gate = threading.Event()
        busy = r0._staging.executor.submit(gate.wait, 60)
        r0._staging.seed_asked(2), r0._staging.seed_asked(3)  # queued behind the busy job: seed 2 is skipped
        r1._staging.seed_asked(2)
        settle(r1)
        gate.set()
        busy.result(timeout=60)
        settle(r0)
        r1._staging.seed_asked(3)
        settle(r1)
        publish(4)
        for hub in (r0, r1):  # shard 0 first: it meets the round shard 1 is in
            hub._staging.seed_asked(4)
            settle(hub)
        assert r0.staging.version == r1.staging.version == 4
        assert r0.staging._machine.seq == r1.staging._machine.seq
        assert all(sorted(consumed) == [0, 1] for (_, rid, _), (_, _, consumed) in port.core.txns.items()
                   if rid == "seeder~prefetch")
    finally:
        for h, _ in seeders + trainers:
            h.close(drop_last_copy=True)
        logging.disable(logging.NOTSET)
