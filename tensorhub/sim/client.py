"""A simulated shard handle: a thin driver of the shipped handle machine.

Every decision (rounds, retries, re-announce, failover budget, aborts, what a restart announces)
is :class:`tensorhub.core.handle.HandleMachine`, the same code :class:`tensorhub.Hub` drives.
This module only carries out its commands in the simulated world:

- ``Send``: a call through :class:`~tensorhub.sim.server.SimServer` (the server actor's
  request path: mailboxes and long polls); a crashed server answers ``Unavailable``.
- ``Pull``: the simulated transport (:mod:`tensorhub.sim.transport`). Memory is a list of
  per-unit content tags ``(version, shard, unit)``.
- ``Offload``/``DropHost``: host copies (tags), ``Recheck``: the leading units that still hold
  their version (none with ``Config.checksums`` off, as the Hub), ``Sleep``/``Reconnect``:
  virtual timers.

Heartbeats carry progress while reading and poll background notes; ``UnknownClient`` on a
heartbeat re-announces (at once while reading: the holder's drain waits for the edge).
Every user operation is an :class:`Op` that ends exactly once with ``"ok"`` or an error code;
the checkers time them.
"""

from __future__ import annotations

from typing import Callable, Optional

from tensorhub.core import background as bg
from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.sim import mixed
from tensorhub.sim.transport import SimTransport

DIRTY = ("dirty",)
FREED = ("freed",)
DIRTY_VERSION = -2
FREED_VERSION = -3

Callback = Callable[[str, int], None]


def version_tags(version: int, shard: int, units: int) -> list:
    return [(version, shard, k) for k in range(units)]


class Op:
    __slots__ = ("kind", "cid", "start", "cb", "relative_update")

    def __init__(self, kind: str, cid: str, start: float, cb: Optional[Callback]) -> None:
        self.kind, self.cid, self.start, self.cb = kind, cid, start, cb
        self.relative_update = False
        """An ``update()`` of a relative spec ("latest", "latest-k"): one lost version retries."""


class SimProcess:
    """Several handles in one process (``World(shared_processes=True)``): one pulse carries all
    their beats, as :mod:`tensorhub.handle.pulse` sends it (held by the server, plus a progress pulse
    per interval while some of them read), and they share one fate: a crash takes every handle
    of the process with it (``World.crash``)."""

    def __init__(self, world, name: str) -> None:
        self.world, self.name = world, name
        self.members: list["SimClient"] = []
        self.alive = True
        world.sim.after(world.rng_client.random() * world.config.heartbeat_interval_s, self._pulse)
        if world.config.pulse_hold_s > 0:
            world.sim.after(world.config.heartbeat_interval_s, self._progress)

    def _pulse(self) -> None:
        if not self.alive:
            return
        w = self.world
        members = [c for c in self.members if c.alive and c.registered]
        if not members:
            w.sim.after(w.config.heartbeat_interval_s, self._pulse)
            return
        beats = tuple(c._liveness_beat() for c in members)
        sent = w.sim.now
        w.server.call(members[0], m.Pulse(beats=beats), _held(w, beats), None,
                      on_reply=lambda reply: self._answer(members, reply, sent))

    def _answer(self, members: list["SimClient"], reply, sent: float) -> None:
        if not self.alive:
            return
        for c in members:
            if c.alive:
                c._pulse_answer(reply, sent=sent)
        _next_pulse(self.world, sent, reply, self._pulse)

    def _progress(self) -> None:
        """The unheld progress pulse of the reading members (``Pulse._progress_loop``)."""
        if not self.alive:
            return
        w = self.world
        readers = [c for c in self.members if c.alive and c.registered and c.machine.reading]
        if readers:
            beats = tuple(m.Beat(c.cid, c.region_progress, acked=c.notes_acked)
                          for c in readers)
            sent = w.sim.now
            w.server.call(readers[0], m.Pulse(beats=beats), False, None,
                          on_reply=lambda reply: [c._pulse_answer(reply, announce=False, sent=sent)
                                                  for c in readers if c.alive])
        w.sim.after(w.config.heartbeat_interval_s, self._progress)


def _held(world, beats) -> bool:
    """The Hub's liveness pulse asks the server to hold it when pulses may be held (its beats
    are plain heartbeats then) or none of its handles reads."""
    return world.config.pulse_hold_s > 0 or all(b.reading_units < 0 for b in beats)


def _next_pulse(world, sent: float, reply, pulse) -> None:
    """As :mod:`tensorhub.handle.pulse`: the next pulse leaves ``heartbeat_interval_s`` after the last
    was sent, at once if it was held that long (a failed call: a whole interval later)."""
    gap = world.config.heartbeat_interval_s
    left = gap if isinstance(reply, m.ErrorReply) else max(0.0, sent + gap - world.sim.now)
    world.sim.after(left, pulse)


class SimClient:
    def __init__(self, world, cid: str, *, replica_id: str, shard: int, num_shards: int,
                 host: str, dc: str, spot: bool, role: str, layout: str = "", retains: bool = True) -> None:
        self.world = world
        self.cid = cid
        self.replica_id, self.shard, self.num_shards = replica_id, shard, num_shards
        self.host, self.dc, self.spot, self.role = host, dc, spot, role
        self.retains = retains
        """False: registered with ``retains=False`` (an engine that never keeps a retention copy)."""
        p, cfg = world.params, world.config
        self.layout_name = layout
        """The ``mixed`` workload's layout of this replica (:mod:`tensorhub.sim.mixed`); "": none."""
        self.placement = world.mixed.placement(layout, shard) if layout else None
        self.tag_shard = world.mixed.tag_shard(layout, shard) if layout else shard
        """What this shard's memory tags name besides version and unit (its layout's, when it has one)."""
        self.units = world.mixed.unit_count(layout, shard) if layout else p.units
        self.unit_bytes = p.unit_bytes
        self.machine = hm.HandleMachine(cid, request_timeout_s=cfg.request_timeout_s,
                                        reconnects_max=cfg.reconnects_max, failovers_max=cfg.failovers_max,
                                        unit_count=self.units, noop_staleness_s=cfg.noop_staleness_s)
        self.mem: list = [None] * self.units
        self.endpoint = cid.encode()
        """What names :attr:`mem` to readers (a region's endpoint); a double buffer's swap
        exchanges it with its staging copy's, as the server exchanges the two holders'."""
        self.mem_wtime: list[float] = [0.0] * self.units
        self.region_version = -1
        self.region_progress = 0
        """The region's control block: which version it holds and how many units are final."""
        self.host_copies: dict[int, list] = {}
        self.copy_gen = 0
        self.notes_acked = 0
        """The newest background event taken (``Background._notes_acked``)."""
        self.unoffered: set[int] = set()
        """Host copies whose offer got no answer (``HostCopies.unoffered``)."""
        self.alive = True
        self.retired = False
        self.op: Optional[Op] = None
        self.step_done: Optional[Callable[[str], None]] = None
        """The machine's operation in progress is one step of the user's (a swap's unpublish or
        re-publish): its end goes here (with its code) instead of ending the user's operation."""
        self.transport = SimTransport(self)
        self.delta_ready: Optional[tuple[int, list]] = None
        """A staging copy's next read of this version copies these tags locally (a version
        rebuilt from a delta: :mod:`tensorhub.sim.deltas`)."""
        self.token = 0
        """Answers to the awaited command carry this; a stale one is dropped."""
        self.waiters: dict[str, bool] = {}
        self.driver = None
        self.index = 0
        self.process: Optional[SimProcess] = None
        """The process this handle shares with others (None: a process of its own)."""
        world.sim.after(world.rng_client.random() * cfg.heartbeat_interval_s, self._heartbeat)
        if cfg.pulse_hold_s > 0:
            world.sim.after(cfg.heartbeat_interval_s, self._progress)

    # ------------------------------------------------------------------ identity and views

    @property
    def published(self) -> Optional[int]:
        return self.machine.published

    @property
    def registered(self) -> bool:
        return bg.registered_phase(self.machine.phase)

    @property
    def keeps_copies(self) -> bool:
        """Its copies count toward retention (the core's ``Node.keeps_copies``)."""
        return not self.spot and self.retains

    def registration(self) -> m.Register:
        w = self.world
        layout = w.mixed.layout_info(self.layout_name, self.shard) if self.layout_name else w.layout(self.shard)
        return m.Register(
            client_id=self.cid, model=w.params.model, replica_id=self.replica_id, shard=self.shard,
            num_shards=self.num_shards, layout=layout, endpoint=self.endpoint,
            datacenter=self.dc, spot=self.spot, retains=self.retains, machine=self.host, placement=self.placement,
            layout_key=self.layout_name if self.layout_name in mixed.KEYED and w.layout_keys else "",
        )

    def want(self, version: int) -> list:
        """The tags of this shard's memory holding ``version`` whole."""
        return version_tags(version, self.tag_shard, self.units)

    def serves(self) -> list[str]:
        return [self.cid] + [f"{self.cid}#host{v}" for v in sorted(self.host_copies)]

    def served_units(self, version: int) -> int:
        """The progress counter a reader sees for ``version`` (0: this memory does not hold it)."""
        if not self.alive or self.region_version != version:
            return 0
        return self.region_progress

    # ------------------------------------------------------------------ user operations

    def register(self, cb: Callback) -> None:
        self._begin("register", cb, hm.RegisterOp(self.registration()))

    def publish(self, version: int, cb: Callback) -> None:
        deltas = self.world.deltas
        if deltas is not None:
            def published(code: str, v: int) -> None:
                if code == "ok" and self.alive:
                    deltas.published(self, version)  # Hub.publish -> Offers.published
                if cb is not None:
                    cb(code, v)
            self._begin("publish", published, hm.PublishOp(version))
            return
        self._begin("publish", cb, hm.PublishOp(version))

    def unpublish(self, cb: Callback) -> None:
        self._begin("unpublish", cb, hm.UnpublishOp())

    def replicate(self, spec, update: bool, cb: Callback, round: Optional[int] = None) -> None:
        self._open_op("replicate", cb)
        self.op.relative_update = update and not isinstance(spec, int)
        self.transport.begin_read()
        self._feed(hm.Start(hm.ReplicateOp(spec, update, round)))

    def leave(self, cb: Callback) -> None:
        self._begin("leave", cb, hm.CloseOp())

    # user writes (the training step; a rollout scribbling on idle tensors)
    def mutate(self) -> None:
        """Overwrite the registered tensors (allowed while nothing is published)."""
        self.world.checker.on_write(self.cid, None, DIRTY_VERSION)
        self.mem = [DIRTY] * self.units
        self.mem_wtime = [self.world.sim.now] * self.units

    def scribble(self, unit: int) -> None:
        """The user writes one unit of the idle handle's tensors."""
        assert self.published is None and self.op is None
        self.world.checker.on_write(self.cid, unit, DIRTY_VERSION)
        self.mem[unit] = DIRTY
        self.mem_wtime[unit] = self.world.sim.now
        self.world.stats_scribbles += 1

    def write_version(self, version: int) -> None:
        self.world.checker.on_write(self.cid, None, version)
        self.mem = version_tags(version, self.tag_shard, self.units)
        self.mem_wtime = [self.world.sim.now] * self.units
        self.world.checker.trainer_wrote(self, version)

    def retire(self) -> None:
        """The process exits after a clean leave: its memory is freed."""
        self.world.checker.on_write(self.cid, None, FREED_VERSION)
        for v in sorted(self.host_copies):
            self._free_host(v)
        self.alive = False
        self.retired = True
        self.mem = [FREED] * self.units

    def die(self) -> None:
        """The process crashed: its operation ends with it (no reply will come), reads stop."""
        self.alive = False
        self.step_done = None
        if self.op is not None:
            self.world.checker.op_abandon(self.op)
            self.op = None
        self.transport.died()
        self.host_copies = {}

    def interrupt(self) -> bool:
        """The user interrupts a replicate mid-read (KeyboardInterrupt, a cancelled task): the
        pull stops once its posted reads have ended (the shipped read loop drains before the
        exception leaves it), then the machine ends the operation. False if nothing to interrupt."""
        if not self.alive or self.op is None or self.op.kind != "replicate":
            return False
        rs = self.transport.stop()
        if rs is None:
            return False
        self.token += 1  # the pull's own answer is dropped
        self.world.sim.at(rs.ends_at, self._interrupted, rs)
        return True

    def _interrupted(self, rs) -> None:
        if self.alive and self.transport.finish(rs):
            self._feed(hm.Interrupted("user interrupt"))

    # the simulated transport: its reads, and what the world tells it
    @property
    def reading(self):
        """The pull in progress (its posted reads are ``reading.inflight``), or None."""
        return self.transport.current

    def poke(self, source_cid: str) -> None:
        self.transport.poke(source_cid)

    def source_died(self) -> None:
        self.transport.source_died()

    def _write_unit(self, unit: int, tag, version: int) -> None:
        self.world.checker.on_write(self.cid, unit, version)
        self.mem[unit] = tag
        self.mem_wtime[unit] = self.world.sim.now

    def _notify_waiters(self) -> None:
        if not self.waiters:
            return
        w = self.world
        for cid in sorted(self.waiters):
            reader = w.clients.get(cid)
            if reader is not None:
                w.sim.after(w.params.poll_s, reader.poke, self.cid)
        self.waiters = {}

    # ------------------------------------------------------------------ driving the machine

    def _begin(self, kind: str, cb: Optional[Callback], op: hm.Op) -> None:
        self._open_op(kind, cb)
        self._feed(hm.Start(op))

    def _open_op(self, kind: str, cb: Optional[Callback]) -> None:
        """The user's call begins (the checkers time it until :meth:`_finish`)."""
        assert self.op is None, f"{self.cid}: {kind} while {self.op.kind} is in progress"
        assert self.alive
        self.op = Op(kind, self.cid, self.world.sim.now, cb)
        self.copy_gen += 1  # Hub: every call stops the background copy first
        self.world.checker.op_start(self.op)

    def _feed(self, event: hm.Event) -> None:
        if not self.alive:
            return
        self._run(self.machine.handle(event, self.world.sim.now))

    def _answer(self, token: int, event: hm.Event) -> None:
        if self.alive and token == self.token:
            self._feed(event)

    def _run(self, cmds: list) -> None:
        w = self.world
        for i, cmd in enumerate(cmds):
            match cmd:
                case hm.Done(outcome):
                    self._machine_done("ok", outcome)
                case hm.Fail(code, _):
                    self._machine_done(code, None)
                case hm.SetRegion(version, progress):
                    self.region_version, self.region_progress = version, progress
                case hm.DropHost(version):
                    if version in self.host_copies:
                        self._free_host(version)
                case hm.Send(request, wait, fire):
                    if fire:
                        # Like the shipped driver, the rest waits until the server has it (or is
                        # found gone): the user must not see the call end before its abort landed.
                        rest = cmds[i + 1:]
                        w.server.call(self, request, False, None, on_reply=lambda _r, rest=rest: self._run(rest))
                        return
                    else:
                        self.token += 1
                        w.server.call(self, request, wait, self.token)
                case hm.Sleep(delay_s):
                    self.token += 1
                    w.sim.after(delay_s, self._answer, self.token, hm.TimerFired())
                case hm.Reconnect(delay_s):
                    self.token += 1
                    w.sim.after(delay_s, self._reconnect, self.token, w.sim.now + delay_s + w.config.request_timeout_s)
                case hm.Recheck(version, units):
                    self.token += 1
                    w.sim.after(0.0, self._answer, self.token, hm.Rechecked(self._recheck(version, units)))
                case hm.Pull(assignment, start_unit):
                    self.token += 1
                    self.transport.pull(assignment, start_unit, self.token)
                case hm.Offload(version):
                    self.token += 1
                    dur = self.units * self.unit_bytes / w.params.host_bw
                    w.sim.after(dur, self._offloaded, version, self.token)
                case _:
                    raise AssertionError(f"unknown command {cmd!r}")

    def _machine_done(self, code: str, outcome: Optional[hm.Outcome]) -> None:
        """The machine ended its operation: the user's operation ends with it, unless that
        machine operation was one step of a longer one (:attr:`step_done`)."""
        step, self.step_done = self.step_done, None
        if step is not None:
            step(code)
            return
        if outcome is None:
            self._finish(code)
            return
        if outcome.local:
            self.world.checker.freshness.on_local_answer(self, outcome.version, outcome.in_flight)
        if self.op is not None and self.op.kind == "replicate":
            self.world.checker.on_replicated(self, outcome.version)
        self._finish("ok", outcome.version, prefetched=self._from_own_stage(outcome))

    def _from_own_stage(self, outcome: hm.Outcome) -> bool:
        """Hub's ``ReadStats.prefetched``: the read came first from this handle's staging copy."""
        stage = getattr(self, "stage", None)
        return bool(stage is not None and outcome.action == "replicated" and outcome.sources
                    and outcome.sources[0] == stage.cid)

    def _finish(self, code: str, version: int = -1, prefetched: bool = False) -> None:
        op = self.op
        if op is None:
            return
        self.op = None
        self.world.checker.op_end(op, code)
        if op.kind == "replicate" and code == "ok" and self.alive and not prefetched:
            # Hub: notes taken before the call returns, unless the read was prefetched (the
            # staging copy, first to finish the version, was asked for its retention copy).
            self.world.server.notes(self, self._notes)
        if op.cb is not None:
            self.world.sim.after(0.0, op.cb, code, version)

    def on_reply(self, token: Optional[int], reply) -> None:
        """The server answered a call (``token`` None: fire and forget)."""
        if token is not None:
            self._answer(token, hm.Replied(reply))

    def on_unavailable(self, token: Optional[int]) -> None:
        if token is not None:
            self._answer(token, hm.Unavailable("server gone"))

    def _reconnect(self, token: int, deadline: float) -> None:
        # RayPort.reconnect: find (or create) the server under its name, up to a deadline.
        if self.world.server.up or self.world.sim.now >= deadline:
            self._answer(token, hm.TimerFired())
        elif self.alive and token == self.token:
            self.world.sim.after(0.1, self._reconnect, token, deadline)

    def _recheck(self, version: int, units: int) -> int:
        """``Driver._recheck`` (:mod:`tensorhub.handle.driver`): the leading units that still hold
        ``version``; none without checksums (nothing could tell whether the user wrote them), so the read starts over."""
        if not self.world.config.checksums:
            self.world.checker.observer.path("checksums_off")
            return 0
        keep = 0
        while keep < units and self.mem[keep] == (version, self.tag_shard, keep):
            keep += 1
        return keep

    def _offloaded(self, version: int, token: int) -> None:
        if not self.alive or token != self.token:
            return
        self.host_copies[version] = list(self.mem)
        self._feed(hm.Offloaded(version, f"host:{self.cid}:{version}".encode()))

    def _start_host_copy(self, version: int) -> None:
        """What ``Hub`` starts on ``MakeHostCopy`` (:func:`~tensorhub.core.background.host_copy_wanted`):
        a background copy of the held version to host memory, offered to the server as its
        retention copy (``HostCopy``); none when it has that copy already."""
        w = self.world
        if version in self.host_copies:
            return
        self.copy_gen += 1
        w.sim.after(self.units * self.unit_bytes / w.params.host_bw, self._host_copied, version, self.copy_gen)

    def _host_copied(self, version: int, gen: int) -> None:
        if not self.alive or gen != self.copy_gen or self.published != version or version in self.host_copies:
            return
        endpoint = f"host:{self.cid}:{version}".encode()
        self.host_copies[version] = list(self.mem)
        self.machine.host_copies[version] = endpoint
        if self.role == "trainer":  # its readers keep no copies (Retention.ask_sole_keeper)
            self.world.checker.observer.path("publisher_copy_ahead")
        # Whatever the answer, the copy stays until the server drops it: a call lost to a server
        # restart may already have been overtaken by an announcement that carried the copy.
        self._offer_host_copy(version, endpoint, 0, self.copy_gen)

    def _offer_host_copy(self, version: int, endpoint: bytes, attempt: int, gen: int) -> None:
        """``HostCopies._offer``: offered again with a growing pause while the server does
        not answer, ``reconnects_max`` times, until the handle's next call stops it; then once
        after each pulse the server answers (``HostCopies.reoffer``)."""
        if not self.alive or version not in self.host_copies:
            return
        if gen != self.copy_gen or self.op is not None:
            self.unoffered.add(version)
            return
        self.world.server.call(self, m.HostCopy(self.cid, version, endpoint), False, None,
                               on_reply=lambda r: self._host_copy_answered(version, endpoint, attempt, gen, r))

    def _host_copy_answered(self, version: int, endpoint: bytes, attempt: int, gen: int, reply: object) -> None:
        if isinstance(reply, m.ErrorReply) and reply.code == "ServerUnavailable":
            if attempt < self.world.config.reconnects_max:
                self.world.sim.after(min(0.2 * 2 ** attempt, 2.0), self._offer_host_copy, version, endpoint,
                                     attempt + 1, gen)
            else:
                self.unoffered.add(version)
                self.world.checker.unoffered.add((self.cid, version))

    def _free_host(self, version: int) -> None:
        self.world.checker.on_write(f"{self.cid}#host{version}", None, FREED_VERSION)
        del self.host_copies[version]

    # ------------------------------------------------------------------ heartbeats and notes

    def _heartbeat(self) -> None:
        if not self.alive or self.process is not None:
            return  # a shared process pulses for all its handles
        w = self.world
        if not self.registered:
            w.sim.after(w.config.heartbeat_interval_s, self._heartbeat)
            return
        # The Hub's liveness loop (tensorhub.handle.pulse): one Pulse per process, held by the server;
        # the reply brings this handle's background events. Read progress goes by _progress
        # (with pulse_hold_s = 0, on this pulse).
        beat = self._liveness_beat()
        sent = w.sim.now
        w.server.call(self, m.Pulse(beats=(beat,)), _held(w, (beat,)), None,
                      on_reply=lambda reply: self._heartbeat_reply(reply, sent))

    def _liveness_beat(self) -> m.Beat:
        if self.world.config.pulse_hold_s > 0 or not self.machine.reading:
            return m.Beat(self.cid, acked=self.notes_acked)
        return m.Beat(self.cid, self.region_progress, acked=self.notes_acked)

    def _progress(self) -> None:
        """The unheld progress pulse while reading (``Pulse._progress_loop``)."""
        if not self.alive or self.process is not None:
            return
        w = self.world
        if self.registered and self.machine.reading:
            beat = m.Beat(self.cid, self.region_progress, acked=self.notes_acked)
            sent = w.sim.now
            w.server.call(self, m.Pulse(beats=(beat,)), False, None,
                          on_reply=lambda reply: self.alive and self._pulse_answer(reply, announce=False, sent=sent))
        w.sim.after(w.config.heartbeat_interval_s, self._progress)

    def _heartbeat_reply(self, reply, sent: float) -> None:
        if self.alive:
            self._pulse_answer(reply, sent=sent)
            _next_pulse(self.world, sent, reply, self._heartbeat)

    def _pulse_answer(self, reply, announce: bool = True, sent: Optional[float] = None) -> None:
        """This handle's share of a pulse's reply (``Hub._after_beat``; ``announce`` False: the
        progress stream's reply, ``Pulse._send``)."""
        if isinstance(reply, m.ErrorReply):
            if not (announce and reply.code == "ServerUnavailable"):
                return  # the progress stream: the next pulse tries again
            # Pulse._send: a liveness pulse that got no answer reconnects and announces every
            # handle, as if the server did not know them (it may have restarted).
            reply = m.PulseReply(unknown=(self.cid,))
        self._notes(list(reply.notes.get(self.cid, ())))  # the rule's order: notes first
        seen = hm.viewed(reply, self.cid, sent) if sent is not None else None
        if seen is not None:
            if seen.newest is not None:
                self.world.checker.freshness.on_told(self.cid, seen.number, seen.newest, seen.in_flight, seen.ready)
            self._feed(seen)
        answer = bg.after_pulse(known=self.cid not in reply.unknown, may_announce=announce,
                                acked_before=self.notes_acked, acked=reply.acks.get(self.cid, -1),
                                reading=self.machine.reading, idle=self.op is None and self.registered, unoffered=bool(self.unoffered))
        self.notes_acked = answer.acked
        if answer.reoffer:
            pending, self.unoffered = sorted(self.unoffered), set()
            for v in pending:
                endpoint = self.machine.host_copies.get(v)
                if endpoint is not None:
                    self._offer_host_copy(v, endpoint, self.world.config.reconnects_max, self.copy_gen)
        if answer.announce:
            self.world.stats_recoveries += 1
            self.world.server.call(self, self.machine.announce_request(reading_units=self.region_progress),
                                   False, None)

    def _notes(self, notes: list) -> None:
        for note in notes:
            kind = bg.kind_of(note)
            if kind is bg.Kind.SEED:
                continue  # offload seeding needs a prefetch staging copy: SeedingClient
            if kind is bg.Kind.HOST_COPY:
                c = self.world.config
                if bg.host_copy_wanted(note.version, between_calls=self.op is None, phase=self.machine.phase,
                                       published=self.published, keeps_copies=self.keeps_copies,
                                       host_copy_ahead=c.host_copy_ahead,
                                       versions_retained=c.versions_retained, host_copies_pooled=c.host_copies_pooled):
                    self._start_host_copy(note.version)
                continue
            if isinstance(note, m.Evicted):
                self.world.checker.note_loss("evicted")
                if self.driver is not None:
                    self.driver.broken = True
            self._feed(hm.Noted(note))

