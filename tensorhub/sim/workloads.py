"""Workload drivers: trainer replicas, rollout replicas, spot churn.

A driver owns the shard clients of one replica and runs them in lock step (a tensor-parallel
group does collectives, so its shards start each round together, with a random skew). A
member that crashes is replaced after a restart delay by a fresh process (new client id, empty
memory) unless the driver is spot (a preempted spot replica is gone).

Builders at the bottom turn a seeded RNG into one of the named workloads.
"""

from __future__ import annotations

import random
from typing import Callable, Optional

from tensorhub.sim.client import SimClient
from tensorhub.sim.faults import restart_mid_read


_TRANSIENT = frozenset({"ServerUnavailable", "ServerRecovering", "RequestTimeout"})
"""Registration failures a starting process retries (the server comes back)."""
_NOT_PUBLISHED_YET = frozenset({"VersionNotFound", "UnknownModel", "DeltaPending", "VersionStalled"})
"""The codes of ``errors.VersionNotFound`` and its subclasses: what verl's rollout adapter waits
out, asking again (``tensorhub.integrations.verl``, ``_update_all``)."""

class Barrier:
    def __init__(self, sim, n: int, then: Callable[[], None]) -> None:
        self.sim, self.left, self.then, self.fired = sim, set(range(n)), then, False

    def done(self, i: int) -> None:
        if i in self.left:
            self.left.discard(i)
            if not self.left and not self.fired:
                self.fired = True
                self.sim.after(0.0, self.then)


class ReplicaDriver:
    role = "replica"

    def __init__(self, world, replica_id: str, hosts: list[str], dc: str, spot: bool, rng: random.Random,
                 client_cls: type = SimClient, layout: str = "", retains: bool = True) -> None:
        self.world = world
        self.layout = layout
        """The ``mixed`` workload's layout of this replica's shards ("": none, no placement)."""
        self.client_cls = client_cls
        """The class of the members (:class:`tensorhub.sim.seeding.SeedingClient` across datacenters)."""
        self.replica_id = replica_id
        self.num_shards = len(hosts)
        self.hosts = hosts
        self.dc = dc
        self.spot = spot
        self.retains = retains
        """False: its members register with ``retains=False`` (engines keeping no retention copy)."""
        self.rng = rng
        self.gen = 0
        self.process = None
        """The process the members share (``World.shared_processes``), None otherwise."""
        self.members: list[SimClient] = [self._spawn(i) for i in range(self.num_shards)]
        self.barrier: Optional[Barrier] = None
        self.idle = False
        self.restarting = 0
        self.gone = False
        self.broken = False  # a member crashed or was evicted: the current round is void

    def _spawn(self, i: int) -> SimClient:
        suffix = f".{self.gen}" if self.gen else ""
        extra = {"layout": self.layout} if self.layout else {}
        if not self.retains:
            extra["retains"] = False
        c = self.world.add_client(
            f"{self.replica_id}/s{i}{suffix}", cls=self.client_cls, replica_id=self.replica_id, shard=i,
            num_shards=self.num_shards, host=self.hosts[i], dc=self.dc, spot=self.spot, role=self.role, **extra,
        )
        c.driver, c.index = self, i
        if self.world.shared_processes and self.num_shards > 1:
            from tensorhub.sim.client import SimProcess

            if self.process is None or not self.process.alive:  # the first member of a (re)started process
                self.process = SimProcess(self.world, f"{self.replica_id}-p{self.gen}")
            self.process.members.append(c)
            c.process = self.process
        return c

    @property
    def busy(self) -> bool:
        return not self.idle or self.restarting > 0

    def on_crash(self, c: SimClient, restart: bool) -> None:
        self.broken = True
        if self.barrier is not None:
            self.barrier.done(c.index)
        if restart and not self.spot:
            self.restarting += 1
            self.world.sim.after(self.world.params.restart_delay_s, self._restart, c.index)
        else:
            self.gone = True
            if self.spot:
                # A spot engine whose rank is preempted or dies is not restarted, and its other
                # ranks end with it (their collectives fail: the engine exits). Left running, a
                # rank in an update would wait ``request_timeout_s`` for the dead sibling's
                # registration (ReplicaIncomplete), a bounded wait that outlives the run.
                for x in self.members:
                    if x is not c and x.alive:
                        self.world.crash(x, restart=False)

    def _restart(self, i: int) -> None:
        self.gen += 1
        c = self.members[i] = self._spawn(i)
        self.restarting -= 1
        # A restarted process registers as it starts (its siblings may be waiting for it in a
        # round: ReplicaIncomplete until every shard is registered).
        self.ensure_registered(c, lambda: None, lambda: None)

    def ensure_registered(self, c: SimClient, go: Callable[[], None], done: Callable[[], None]) -> None:
        if not c.alive:
            done()
        elif c.registered:
            go()
        elif c.op is not None:  # registering already (the restart's own registration)
            self.world.sim.after(0.2, self.ensure_registered, c, go, done)
        else:
            def registered(code: str, _v: int) -> None:
                if code == "ok":
                    go()
                elif code == "ShardTaken" and c.alive:  # the dead predecessor has not expired yet
                    self.world.sim.after(1.0, self.ensure_registered, c, go, done)
                elif code in _TRANSIENT and c.alive:
                    # The server was down or recovering: a process that starts keeps trying to
                    # join (given up, its siblings in a round would wait for it until their
                    # request timeout: mixed seed 111).
                    self.world.sim.after(1.0, self.ensure_registered, c, go, done)
                else:
                    done()
            c.register(registered)

    def each(self, fn: Callable[[SimClient, Callable[[], None]], None], then: Callable[[], None], skew_s: float) -> None:
        b = self.barrier = Barrier(self.world.sim, self.num_shards, then)
        for i, c in enumerate(self.members):
            if not c.alive:
                b.done(i)
                continue
            self.world.sim.after(self.rng.uniform(0, skew_s), self._each_one, fn, c, b, i)

    def _each_one(self, fn, c: SimClient, b: Barrier, i: int) -> None:
        if not c.alive or c is not self.members[i]:
            b.done(i)
            return
        fn(c, lambda: b.done(i))


class TrainerDriver(ReplicaDriver):
    """publish(v) on every shard (random order) -> hold -> unpublish everywhere -> train -> v+1."""

    role = "trainer"

    def __init__(self, *a, max_versions: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.max_versions = max_versions
        self.version = 0

    def start(self) -> None:
        self.world.sim.after(self.rng.uniform(0, 0.3), self._step)

    def _step(self) -> None:
        w = self.world
        if self.gone:
            self.idle = True
            return
        if self.restarting:
            w.sim.after(0.5, self._step)
            return
        if w.sim.now >= w.active_end or self.version >= self.max_versions:
            self.idle = True
            return
        self.version += 1
        v = self.version
        self.each(lambda c, done: self.ensure_registered(c, lambda: self._publish(c, v, done), done),
                  self._published, w.params.shard_skew_s)

    def _publish(self, c: SimClient, v: int, done) -> None:
        def write_and_publish() -> None:
            c.write_version(v)
            c.publish(v, lambda code, _v: done())

        if c.published is not None:
            self._unpublish(c, write_and_publish)
        else:
            if c.mem[0] is not None and c.mem[0][0] != "dirty":
                c.mutate()  # after an eviction or a restart: the server no longer lists us
            write_and_publish()

    def _unpublish(self, c: SimClient, then) -> None:
        def unpublished(code: str, _v: int) -> None:
            if code in ("ok", "Evicted", "UnknownClient"):
                c.mutate()
            elif code in ("ServerUnavailable", "RequestTimeout") and c.alive and c.published is not None:
                # The server may still list the version (a timed-out unpublish is still draining
                # it): the tensors stay as they are until an unpublish succeeds (a user must not
                # write a published version).
                self.world.sim.after(1.0, lambda: self._unpublish(c, then) if c.alive and c.op is None else then())
                return
            then()
        c.unpublish(unpublished)

    def _published(self) -> None:
        p = self.world.params
        self.world.sim.after(self.rng.uniform(*p.hold_s), self._unpublish_all)

    def _unpublish_all(self) -> None:
        def one(c: SimClient, done) -> None:
            if c.registered and c.published is not None:
                restart_mid_read(self.world, c.cid)
                self._unpublish(c, done)
            else:
                done()
        p = self.world.params
        self.each(one, lambda: self.world.sim.after(self.rng.uniform(*p.train_s), self._step), p.shard_skew_s)


class RolloutDriver(ReplicaDriver):
    """Rounds of update("latest") on every shard (one transaction), then generate, repeat. A
    stepped replica (``World.stepped``) asks for the trainer's next step once it holds the
    current one, and a shard answered ``VersionNotFound`` asks again in the same named round
    (:meth:`_stepped_target`), as verl's rollout adapter does."""

    role = "rollout"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seq = 0
        self.leaving = False
        self.retry: dict[str, int] = {}
        self.got = -1
        """The version of this replica's last round that ended ok on every shard (-1: none)."""
        self._steps_rng: Optional[random.Random] = None
        """The sleeps of a stepped replica between its calls (a stream of its own: the driver's
        draws stay as they were)."""

    def start(self, delay: float = 0.0) -> None:
        self.world.sim.after(delay + self.rng.uniform(0, 0.5), self._round)

    def _round(self) -> None:
        w = self.world
        if self.gone:
            self.idle = True
            return
        if self.restarting:
            w.sim.after(0.5, self._round)
            return
        if self.leaving:
            self._leave()
            return
        if w.sim.now >= w.active_end:
            self.idle = True
            return
        self.seq += 1
        seq = self.seq
        self.broken = False
        results: dict[int, tuple[str, int]] = {}
        target = self._stepped_target()
        deadline = w.sim.now + w.stepped_wait_s

        def one(c: SimClient, done) -> None:
            def replicated(code: str, v: int) -> None:
                if target is not None and code in _NOT_PUBLISHED_YET and self._waits_for(c, target, deadline):
                    # verl's ``_update_all``: the same spec, the SAME named round, after a sleep;
                    # a new call (its own ``Replicate.call``) that the server must resolve afresh.
                    w.checker.observer.path("round_asked_again")
                    w.sim.after(self._sleep_s(), ask)
                    return
                results[c.index] = (code, v)
                done()

            def ask() -> None:
                if not c.alive or c is not self.members[c.index]:
                    done()  # the shard died while it waited: the round is void (``broken``)
                    return
                self.ensure_registered(c, lambda: c.replicate(spec, True, replicated, round=rnd), done)
            # A sharded replica names its rounds (the recommended use: its shards restart
            # independently); a one-shard replica lets the handle count them.
            rnd = seq if self.num_shards > 1 and not w.default_rounds else None
            if self.num_shards > 1 and rnd is None:
                w.checker.observer.path("default_rounds")
            if target is not None:
                spec = target
            else:
                # After an interrupted call a one-shard replica asks again for the version it was
                # reading (a user retrying the call), which resumes on its partial units.
                spec = self.retry.pop(c.cid, "latest") if self.num_shards == 1 or w.pinned_retry else "latest"
            ask()

        self.each(one, lambda: self._round_done(results), w.params.shard_skew_s)

    def _stepped_target(self) -> Optional[int]:
        """The version a stepped replica (``World.stepped``: a sharded one naming its rounds) asks
        for in this round, None: "latest". Once it holds the trainer's step it asks for the next
        one, as verl's manager asks its rollouts for the step the trainer is taking
        (``receive_weights(global_steps)``): not published until the trainer has trained and
        published it, so its shards are answered ``VersionNotFound`` and ask again in the same
        round. Behind the trainer (or once the trainer takes no more steps) it catches up with
        "latest", as verl's ``receive_weights()`` without a step does: the newest version, which a
        round re-resolves if it is lost (the paths of "latest" stay covered in these seeds)."""
        w = self.world
        if not w.stepped or self.num_shards == 1 or w.default_rounds or not w.trainers:
            return None
        if w.params.workload == "crossdc":
            return None  # its rollouts ask "latest": smart skipping and offload seeding are its paths
        trainer = w.trainers[-1]  # a replaced trainer's successor resumes its steps
        step = trainer.version
        if (step <= self.got and not trainer.idle and not trainer.gone and step < trainer.max_versions
                and w.sim.now < w.active_end):
            return step + 1
        return None

    def _waits_for(self, c: SimClient, target: int, deadline: float) -> bool:
        """After ``VersionNotFound``: this shard asks again (verl sleeps ``_POLL_S`` and does)
        while it lives, the wait (verl's ``wait_timeout_s``) has not run out, and the trainer may
        still publish ``target`` (verl's manager asks for no step its trainer never takes: the
        simulated one stops at the end of the active phase)."""
        w = self.world
        if not c.alive or c is not self.members[c.index] or w.sim.now >= deadline:
            return False
        return any(not d.idle or d.version >= target for d in w.trainers)

    def _sleep_s(self) -> float:
        if self._steps_rng is None:
            self._steps_rng = self.world.sim.rng(f"{self.replica_id}-steps")
        return self._steps_rng.uniform(0.05, 0.5)

    def _round_done(self, results: dict[int, tuple[str, int]]) -> None:
        w = self.world
        w.checker.on_round(self, results)
        ok = len(results) == self.num_shards and all(code == "ok" for code, _ in results.values())
        if ok and not self.broken:
            self.got = max(v for _, v in results.values())
        if not ok:
            self._scribble()
            for i, (code, _v) in results.items():
                c = self.members[i]
                if code == "Interrupted" and c.alive and c.machine.region_version >= 0:
                    self.retry[c.cid] = c.machine.region_version
        p = w.params
        delay = self.rng.uniform(*p.generate_s) if ok else self.rng.uniform(0.3, 1.0)
        if ok and w.user_prefetch and self.num_shards == 1 and hasattr(self.members[0], "prefetch"):
            self._prefetch_during(delay)
        w.sim.after(delay, self._round)

    def _prefetch_during(self, generate_s: float) -> None:
        """While generating, the user prefetches "latest" (its own stream: the driver's draws
        stay as they were), so that the next update copies locally."""
        rng = self.world.sim.rng(f"{self.replica_id}-prefetch-{self.seq}")
        c = self.members[0]
        self.world.sim.after(rng.uniform(0.0, generate_s), lambda: c is self.members[0] and c.prefetch())

    def _scribble(self) -> None:
        """Between calls the user may write an idle handle's tensors (its engine reuses them):
        a failed read's partial units are then stale, and the next read must not resume on them."""
        rng = self.world.sim.rng(f"{self.replica_id}-scribble-{self.seq}")
        for c in self.members:
            # Units a later call may resume on, or that the control block still advertises (a
            # region that was not hidden: followers would read what the user writes).
            kept = max(c.machine.region_progress, c.region_progress if c.region_version >= 0 else 0)
            if c.alive and c.op is None and c.published is None and kept > 0:
                c.scribble(rng.randrange(kept))

    def _leave(self) -> None:
        def one(c: SimClient, done) -> None:
            def left(code: str, _v: int) -> None:
                if code == "LastCopyHeld" and c.alive:
                    done()  # refused: the handle stays open and serves the last copy of a version
                    return
                c.retire()
                done()

            def unpublished(code: str, _v: int) -> None:
                if c.alive and c.registered:
                    c.leave(left)
                else:
                    left(code, _v)
            if c.alive and c.op is not None:  # a restarted member still registering: leave after it
                self.world.sim.after(0.2, one, c, done)
            elif c.registered:
                c.unpublish(unpublished)
            else:
                left("ok", -1)

        def finished() -> None:
            self.gone = True
            self.idle = True
        self.each(one, finished, 0.0)


class SpotChurn:
    """Elastic fleet: spot replicas join and leave at random times during the active phase."""

    def __init__(self, world, rng: random.Random, events: int) -> None:
        self.world, self.rng, self.n = world, rng, 0
        for _ in range(events):
            world.sim.at(rng.uniform(1.0, max(1.5, world.active_end - 4.0)), self._churn)

    def _churn(self) -> None:
        w = self.world
        spots = [d for d in w.rollouts if d.spot and not d.leaving and not d.gone]
        if spots and (self.rng.random() < 0.5 or len(w.clients_alive()) >= w.params.max_clients):
            d = spots[self.rng.randrange(len(spots))]
            d.leaving = True
            w.sim.trace(f"churn leave {d.replica_id}")
        elif len(w.clients_alive()) < w.params.max_clients:
            self.n += 1
            dc = w.dcs[self.rng.randrange(len(w.dcs))]
            host = w.add_host(dc)
            d = RolloutDriver(w, f"spot-j{self.n}", [host], dc, True, w.sim.rng(f"spot-j{self.n}"))
            w.rollouts.append(d)
            w.sim.trace(f"churn join {d.replica_id}")
            d.start()
