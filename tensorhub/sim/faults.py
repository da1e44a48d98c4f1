"""Named fault kinds with bounded knobs. The scenario seed picks which kinds run and their
parameters; every injection is traced and counted.

- ``worker_crash``     a rollout process dies (preferably mid-transfer); restarts fresh later.
- ``source_crash``     a process that is serving reads right now dies; restarts fresh later.
- ``server_restart``   the reference server dies (all state and in-flight messages lost) and a
                       fresh one starts after ``down_s``; clients re-announce.
- ``spot_preemption``  a wave of spot processes dies at once (no restart).
- ``slow_link``        a NIC or an inter-datacenter link runs ``factor`` times slower for a while.
- ``msg_delay``        control messages get up to ``max_s`` extra delay for a while (reorders
                       messages across channels).
- ``interrupt``        the user interrupts a replicate mid-read (KeyboardInterrupt): the handle
                       must end the read on the server too, and a later call must not resume on
                       units the user wrote meanwhile.
- ``trainer_replaced`` the trainer job restarts under a new replica id on new hosts while its
                       predecessor's processes hang (no death report: their leases still run);
                       versions go on from where it was.
- ``msg_loss``         while the server is up, a call's request or reply is lost with chance
                       ``p`` for a while (the caller sees the server unavailable and retries).
- ``msg_dup``          while the server is up, a request is delivered twice with chance ``p``.
- ``late_dup``         for a while, a ``Replicate`` is delivered a second time with chance ``p``,
                       up to ``delay_s`` later (a call Ray retried, overtaken by events: a version
                       published, a read finished), but never after its own client's next
                       request (one connection keeps a client's requests in order): the server
                       must answer it as it answered the first, and start nothing (the bug
                       class of mixed_spot seed 4730).
- ``push_delay``       for a while, a pulse answer that brings a ``Newest`` (the server's push of
                       a commit or withdrawal) is held up to ``max_s`` on its way: handles keep
                       answering no-op updates locally from what they knew, within
                       ``noop_staleness_s`` (the ``fresh`` checker).
- ``holders_hang``     every non-spot rollout process holding the trainer's newest published
                       version hangs at once (no death report; they restart fresh later): the
                       trainer's next unpublish must not count them as live copies.
- ``restart_mid_read`` armed at its time: the server restarts (after ``down_s``) as soon as the
                       trainer begins to unpublish while readers copy from it; their reads span
                       the restart and the trainer's unpublish reaches the fresh server first.
- ``restart_after_failed_read`` armed at its time: the server restarts ``delay_s`` after it fails
                       a sharded replica's read (VersionLost): the reader may or may not have
                       taken the Failed note, its ReplicateDone or announcement meets a fresh
                       server that must still keep the replica's round one version.
- ``broadcast_shard_crash`` armed at its time: as soon as every shard of a sharded rollout replica
                       copies the trainer's version from the trainer's shards (a weight
                       broadcast), the process of the trainer shard serving one of them dies
                       ``delay_s`` later (restarts fresh later): the server removes the trainer
                       replica and fails the reads of that version; the reader of the dead shard
                       learns at once (its pull fails), its siblings, still copying from the
                       trainer's live shards, with their next pulse. A retry may move the round.
- ``restart_after_round_moved`` armed from the start of every faulty run with sharded replicas
                       (not drawn with the kinds above: its knobs come from its own random
                       stream, so their draws stay as they were; it fires at most once, only
                       in the narrow situation below, in a few percent of sharded runs): the
                       server restarts ``delay_s`` after a shard of a sharded replica is given
                       another version in a round while a sibling is still copying the version
                       it was given (the round moved: that read was
                       failed with its version, the note not taken yet). The fresh server hears
                       the round's new version from one shard and the old one from the other,
                       whose read goes on and may finish there (typically after a trainer shard
                       died mid-read, its replica removed, its surviving shards re-announced).
- ``source_dies_at_done`` armed from the start of a third of the faulty runs (its own random
                       stream, as above; fires at most once): as a reader's ``ReplicateDone`` of
                       an ``update()`` of a relative spec reaches the server, the trainer process
                       it read from dies and is reported gone just before the server applies it.
                       Every byte had landed (on one host the dead holder's mapping stays
                       readable to the end), but the server failed the read: if that was the
                       version's only holder, ``ReplicateDone`` is answered ``VersionLost`` and
                       the update must retry once (an older retained version is still held).
                       Only in runs that plan no server restart, and never after one: with
                       restarts, at b765242, seeds 3034, 5104 and 5171 show ``restart``
                       violations (e.g. 5171: a trainer shard evicted with its dead sibling
                       while it drains writes its tensors under a read that spans the
                       restart), open.
"""

from __future__ import annotations

import random

from tensorhub.core import handle as hm
from tensorhub.core import messages as m

FAULT_KINDS = ("worker_crash", "source_crash", "server_restart", "spot_preemption", "slow_link", "msg_delay",
               "interrupt", "trainer_replaced", "msg_loss", "msg_dup", "holders_hang", "restart_mid_read",
               "restart_after_failed_read", "broadcast_shard_crash", "push_delay", "late_dup")
"""The kinds a seed may plan, in the order it draws them (new kinds go last: a seed's draws for the
earlier kinds stay as they were)."""

BOUNDS = {
    "server_restart.down_s": (0.2, 3.0),
    "slow_link.factor": (4.0, 20.0),
    "slow_link.duration_s": (1.0, 8.0),
    "msg_delay.max_s": (0.05, 0.8),
    "msg_delay.duration_s": (1.0, 8.0),
    "push_delay.max_s": (0.5, 3.0),
    "push_delay.duration_s": (2.0, 10.0),
    "spot_preemption.max_nodes": (1, 3),
    "msg_loss.p": (0.02, 0.2),
    "msg_loss.duration_s": (1.0, 6.0),
    "msg_dup.p": (0.05, 0.3),
    "msg_dup.duration_s": (1.0, 6.0),
    "late_dup.p": (0.1, 0.5),
    "late_dup.duration_s": (2.0, 8.0),
    "late_dup.delay_s": (0.3, 4.0),
    "restart_after_failed_read.delay_s": (0.0, 0.4),
    "broadcast_shard_crash.delay_s": (0.0, 0.5),
    "restart_after_round_moved.delay_s": (0.0, 0.3),
}


def plan_faults(world, rng: random.Random) -> list[tuple[float, str, dict]]:
    """Choose faults for this scenario: (time, kind, knobs). Returns the plan (also scheduled)."""
    p = world.params
    kinds = [k for k in FAULT_KINDS if (k != "spot_preemption" or p.workload in ("elastic", "mixed_spot"))
             and (k != "interrupt" or world.interrupts)]
    plan: list[tuple[float, str, dict]] = []
    if rng.random() < 0.12:
        return plan  # a clean run now and then: checks that need "no fault" get exercised
    lo, hi = 2.0, max(3.0, world.active_end - 3.0)
    for kind in kinds:
        if rng.random() >= 0.35:
            continue
        for _ in range(1 if rng.random() < 0.7 else 2):
            t = rng.uniform(lo, hi)
            knobs: dict = {}
            if kind in ("server_restart", "restart_mid_read", "restart_after_failed_read", "broadcast_shard_crash"):
                knobs["down_s"] = rng.uniform(*BOUNDS["server_restart.down_s"])
                if kind in ("restart_after_failed_read", "broadcast_shard_crash"):
                    knobs["delay_s"] = rng.uniform(*BOUNDS[f"{kind}.delay_s"])
            elif kind == "slow_link":
                knobs["factor"] = rng.uniform(*BOUNDS["slow_link.factor"])
                knobs["duration_s"] = rng.uniform(*BOUNDS["slow_link.duration_s"])
                knobs["pick"] = rng.random()
            elif kind == "msg_delay":
                knobs["max_s"] = min(rng.uniform(*BOUNDS["msg_delay.max_s"]), world.config.lease_timeout_s / 4)
                knobs["duration_s"] = rng.uniform(*BOUNDS["msg_delay.duration_s"])
            elif kind == "push_delay":
                # Held up to half a lease: longer, and the handle's next pulse (its liveness) waits
                # past its lease behind it.
                knobs["max_s"] = min(rng.uniform(*BOUNDS["push_delay.max_s"]), world.config.lease_timeout_s / 2)
                knobs["duration_s"] = rng.uniform(*BOUNDS["push_delay.duration_s"])
            elif kind == "spot_preemption":
                knobs["nodes"] = rng.randint(*BOUNDS["spot_preemption.max_nodes"])
            elif kind in ("msg_loss", "msg_dup", "late_dup"):
                knobs["p"] = rng.uniform(*BOUNDS[f"{kind}.p"])
                knobs["duration_s"] = rng.uniform(*BOUNDS[f"{kind}.duration_s"])
                if kind == "late_dup":
                    knobs["delay_s"] = rng.uniform(*BOUNDS["late_dup.delay_s"])
            knobs["pick"] = knobs.get("pick", rng.random())
            plan.append((t, kind, knobs))
    if p.num_shards > 1:
        own = world.sim.rng("round-moved")
        knobs = {"delay_s": own.uniform(*BOUNDS["restart_after_round_moved.delay_s"]),
                 "down_s": own.uniform(*BOUNDS["server_restart.down_s"])}
        plan.append((lo, "restart_after_round_moved", knobs))
    restarts = {"server_restart", "restart_mid_read", "restart_after_failed_read"}
    if world.sim.rng("dies-at-done").random() < 1 / 3 and not restarts & {k for _, k, _ in plan}:
        plan.append((lo, "source_dies_at_done", {"pick": 0.0}))
    plan.sort(key=lambda x: (x[0], x[1]))
    for t, kind, knobs in plan:
        world.sim.at(t, inject, world, kind, knobs)
    return plan


def fault_end(plan: list[tuple[float, str, dict]], world) -> float:
    """When the last fault's effects may still start (crash restarts, windows closing, leases)."""
    end = 0.0
    p = world.params
    for t, kind, knobs in plan:
        e = t + knobs.get("duration_s", 0.0) + knobs.get("down_s", 0.0)
        if kind == "restart_mid_read":
            e += world.params.hold_s[1] + world.params.train_s[1]  # when it fires: the next unpublish
        if kind in ("restart_after_failed_read", "broadcast_shard_crash", "restart_after_round_moved"):
            e = world.active_end + knobs["delay_s"] + knobs["down_s"]  # it may fire any time until then
        if kind == "source_dies_at_done":
            e = world.active_end + p.restart_delay_s + world.config.lease_timeout_s
        if kind in ("worker_crash", "source_crash", "spot_preemption", "trainer_replaced", "holders_hang",
                    "broadcast_shard_crash"):
            e += p.restart_delay_s + world.config.lease_timeout_s
        end = max(end, e)
    return end


def _pick(items: list, u: float):
    return items[min(int(u * len(items)), len(items) - 1)] if items else None


def inject(world, kind: str, knobs: dict) -> None:
    sim = world.sim
    done = False
    if kind == "worker_crash":
        alive = [c for c in world.clients_alive() if c.role == "rollout"]
        busy = [c for c in alive if c.reading is not None and c.reading.inflight]
        c = _pick(busy or alive, knobs["pick"])
        if c is not None:
            world.crash(c, restart=True)
            done = True
    elif kind == "source_crash":
        owners = sorted({k.split("#")[0] for k, reads in world.net.reads_by_source.items() if reads})
        cands = [world.clients[o] for o in owners if world.clients[o].alive]
        if not cands:
            cands = [c for c in world.clients_alive() if c.published is not None]
        c = _pick(cands, knobs["pick"])
        if c is not None:
            world.crash(c, restart=True)
            done = True
    elif kind == "server_restart":
        if world.server.up:
            world.server.crash()
            world.checker.note_loss("server restart")
            sim.after(knobs["down_s"], _restart, world)
            done = True
    elif kind == "spot_preemption":
        spots = [c for c in world.clients_alive() if c.spot]
        rng = random.Random(knobs["pick"])
        rng.shuffle(spots)
        for c in spots[: knobs["nodes"]]:
            world.crash(c, restart=False)
            done = True
    elif kind == "slow_link":
        res = []
        for name in sorted(world.net.hosts):
            h = world.net.hosts[name]
            res.append((h.tx, h.rx))
        for key in sorted(world.net.links):
            res.append((world.net.links[key][0],))
        target = _pick(res, knobs["pick"])
        for r in target:
            r.factor *= knobs["factor"]
        sim.after(knobs["duration_s"], _unslow, target, knobs["factor"])
        sim.trace(f"fault slow_link {[r.name for r in target]} x{knobs['factor']:.1f}")
        done = True
    elif kind == "interrupt":
        reading = [c for c in world.clients_alive() if c.reading is not None and c.op is not None]
        c = _pick(reading, knobs["pick"])
        done = c is not None and c.interrupt()
    elif kind == "trainer_replaced":
        done = world.replace_trainer()
        if done:
            world.checker.note_loss("trainer replaced")
    elif kind == "msg_loss":
        world.net.loss_p = knobs["p"]
        sim.after(knobs["duration_s"], setattr, world.net, "loss_p", 0.0)
        done = True
    elif kind == "msg_dup":
        world.net.dup_p = knobs["p"]
        sim.after(knobs["duration_s"], setattr, world.net, "dup_p", 0.0)
        done = True
    elif kind == "late_dup":
        world.net.late_p, world.net.late_delay_max_s = knobs["p"], knobs["delay_s"]
        sim.after(knobs["duration_s"], setattr, world.net, "late_p", 0.0)
        done = True
    elif kind == "restart_mid_read":
        world.restart_armed = knobs["down_s"]
        sim.trace("fault restart_mid_read armed")
        return
    elif kind == "restart_after_failed_read":
        world.restart_after_failed = (knobs["delay_s"], knobs["down_s"])
        sim.trace("fault restart_after_failed_read armed")
        return
    elif kind == "broadcast_shard_crash":
        world.broadcast_crash_armed = (knobs["delay_s"], knobs["pick"])
        sim.trace("fault broadcast_shard_crash armed")
        return
    elif kind == "restart_after_round_moved":
        world.restart_after_moved = (knobs["delay_s"], knobs["down_s"])
        sim.trace("fault restart_after_round_moved armed")
        return
    elif kind == "source_dies_at_done":
        world.dies_at_done_armed = True
        world.dies_at_done_epoch = world.server.epoch  # disarmed by a restart
        sim.trace("fault source_dies_at_done armed")
        return
    elif kind == "holders_hang":
        newest = max((c.published for d in world.trainers for c in d.members
                      if c.alive and c.published is not None), default=None)
        hang = [c for c in world.clients_alive() if c.role == "rollout" and not c.spot and newest is not None
                and c.published == newest]
        for c in hang:
            world.crash(c, restart=True, report=False)
        done = bool(hang)
    elif kind == "push_delay":
        world.server.push_delay_max_s = knobs["max_s"]
        sim.after(knobs["duration_s"], _unpush_delay, world)
        done = True
    elif kind == "msg_delay":
        world.net.extra_delay_max_s = knobs["max_s"]
        world.checker.observer.max_delay_s = max(world.checker.observer.max_delay_s, knobs["max_s"])
        sim.after(knobs["duration_s"], _undelay, world)
        done = True
    if done:
        world.faults[kind] = world.faults.get(kind, 0) + 1
        world.faults_injected = True
        sim.trace(f"fault {kind} {sorted(knobs.items())}")


def restart_mid_read(world, source_cid: str) -> None:
    """The armed ``restart_mid_read``: called as the trainer begins to unpublish."""
    down_s = getattr(world, "restart_armed", None)
    if down_s is None or not world.server.up or not world.net.reads_from(source_cid):
        return
    world.restart_armed = None
    _crash_server(world, "restart_mid_read", down_s)
    world.sim.trace(f"fault restart_mid_read (unpublish of {source_cid}) down {down_s:.2f}s")


def restart_after_failed_read(world, effects) -> None:
    """The armed ``restart_after_failed_read``: called with every batch of the server's effects."""
    armed = getattr(world, "restart_after_failed", None)
    if armed is None or not world.server.up:
        return
    failed = [e.client_id for e in effects if isinstance(e.event, m.Failed)
              and getattr(world.clients.get(e.client_id), "num_shards", 1) > 1]
    if not failed:
        return
    world.restart_after_failed = None
    _restart_later(world, "restart_after_failed_read", *armed, f"{failed[0]}'s read failed")


def broadcast_shard_crash(world, client_id, reply, effects) -> None:
    """The armed ``broadcast_shard_crash``: called with every reply and batch of effects of the
    server. It fires when an assignment completes a sharded rollout replica's broadcast: every
    live shard copies one version from a shard of a trainer."""
    armed = getattr(world, "broadcast_crash_armed", None)
    if armed is None or not world.server.up:
        return
    given = [(client_id, reply)] if isinstance(reply, m.Assignment) else []
    given += [(e.client_id, e.event) for e in effects if isinstance(e.event, m.Assignment)]
    for cid, a in given:
        c = world.clients.get(cid)
        d = getattr(c, "driver", None)
        if c is None or c.num_shards < 2 or c.role != "rollout" or d is None:
            continue
        # The assigned shard's handle has not taken its assignment yet (it is on its way).
        members = [s for s in d.members if s.alive and s is not c]
        sources = [world.source_client(a.source_id)] + [world.source_client(s.machine.current_source) for s in members]
        if (len(members) + 1 == c.num_shards and all(s.machine.reading and s.machine.region_version == a.version
                                                     and s.machine.seq == c.machine.seq for s in members)
                and all(src is not None and src.role == "trainer" and src.alive for src in sources)):
            break
    else:
        return
    world.broadcast_crash_armed = None
    delay_s, pick = armed
    victim = _pick(sources, pick)

    def crash() -> None:
        if victim.alive:
            world.crash(victim, restart=True)
            world.faults["broadcast_shard_crash"] = world.faults.get("broadcast_shard_crash", 0) + 1
            world.faults_injected = True
            world.sim.trace(f"fault broadcast_shard_crash {victim.cid}")
    world.sim.after(delay_s, crash)
    world.sim.trace(f"fault broadcast_shard_crash (replica {d.replica_id} copies {a.version} from the trainer): "
                    f"{victim.cid} dies in {delay_s:.2f}s")


def restart_after_round_moved(world, client_id, reply, effects) -> None:
    """The armed ``restart_after_round_moved``: called with every reply and batch of effects of
    the server. It fires when a shard of a sharded replica is given a version (an assignment,
    or NoChange on the one it holds) in the round its handle is in, while a live sibling's handle
    is still reading another version in that same round."""
    armed = getattr(world, "restart_after_moved", None)
    if armed is None or not world.server.up:
        return
    given = [(client_id, reply.version)] if isinstance(reply, (m.Assignment, m.NoChange)) else []
    given += [(e.client_id, e.event.version) for e in effects if isinstance(e.event, m.Assignment)]
    for cid, version in given:
        c = world.clients.get(cid)
        if c is None or c.num_shards < 2 or c.driver is None:
            continue
        behind = [s for s in c.driver.members if s is not c and s.alive and s.machine.reading
                  and s.machine.seq == c.machine.seq and s.machine.region_version not in (-1, version)]
        if behind:
            break
    else:
        return
    world.restart_after_moved = None
    _restart_later(world, "restart_after_round_moved", *armed, f"{cid} given {version} in round {c.machine.seq} "
                   f"while {behind[0].cid} reads {behind[0].machine.region_version}")


def source_dies_at_done(world, client, req) -> None:
    """The armed ``source_dies_at_done``: called with every request before the server applies it."""
    if not getattr(world, "dies_at_done_armed", False) or not world.server.up or not isinstance(req, m.ReplicateDone):
        return
    if world.server.epoch != world.dies_at_done_epoch:
        return  # not after a server restart (open there: see the fault's notes)
    op = client.machine.op
    if not (isinstance(op, hm.ReplicateOp) and op.update and not isinstance(op.spec, int)):
        return
    source = client.machine.read_source  # the holder of the reader's last assignment: the read it ends
    src = world.source_client(source) if source is not None else None
    if src is None or not src.alive or src.role != "trainer" or src.published != req.version:
        return
    world.dies_at_done_armed = False
    world.sim.trace(f"fault source_dies_at_done: {src.cid} dies as {client.cid}'s ReplicateDone({req.version}) arrives")
    world.crash(src, restart=True, report=False)
    world.server.declare_dead(src.cid)
    world.faults["source_dies_at_done"] = world.faults.get("source_dies_at_done", 0) + 1
    world.faults_injected = True


def _restart_later(world, kind: str, delay_s: float, down_s: float, why: str) -> None:
    """An armed restart fires ``delay_s`` from now (unless the server restarted meanwhile)."""
    epoch = world.server.epoch

    def crash() -> None:
        if world.server.up and world.server.epoch == epoch:
            _crash_server(world, kind, down_s)
    world.sim.after(delay_s, crash)
    world.sim.trace(f"fault {kind} ({why}) in {delay_s:.2f}s, down {down_s:.2f}s")


def _crash_server(world, kind: str, down_s: float) -> None:
    """An armed restart fires: the server dies now and a fresh one starts ``down_s`` later."""
    world.server.crash()
    world.checker.note_loss("server restart")
    world.sim.after(down_s, _restart, world)
    world.faults[kind] = world.faults.get(kind, 0) + 1
    world.faults_injected = True


def _restart(world) -> None:
    world.server.restart()
    world.checker.note_restart()


def _unslow(target, factor: float) -> None:
    for r in target:
        r.factor /= factor


def _unpush_delay(world) -> None:
    world.server.push_delay_max_s = 0.0


def _undelay(world) -> None:
    world.net.extra_delay_max_s = 0.0
