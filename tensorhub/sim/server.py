"""The simulated reference server: the server actor's request path in virtual time.

Requests go through :func:`tensorhub.server.requests.apply_request` and :class:`~tensorhub.server.requests.Mailboxes`
like in the Ray actor: a blocking request (``wait``) whose reply is ``Waiting`` is held as a long
poll and answered with the client's next terminal event, or ``Waiting`` after
``request_timeout_s``; background events (DropHostCopy, Evicted) wait in the mailbox for the
client's next pulse. An idle process's pulse is held (``pulse_hold_s``) under the actor's rules
(:class:`~tensorhub.server.requests.PulseHolds`): released by its handles' requests, answered by an event
or at its deadline, its handles stamped as heard from on every tick while held. The server
ticks every ``server_tick_s``.

A crash loses all state and every message in flight to or from it (the epoch changes); every
call that had not been answered fails with ``Unavailable`` after the cluster's detection delay
(Ray raises ``RayActorError``), and so does a call sent while the server is down. A restart is a
fresh core.

Every request goes through the server's gate (:class:`tensorhub.auth.Gate`) first, as in the
actor: the simulated clients sign their requests with their capabilities (:attr:`SimServer.keys`,
the client side, drawn from the client id so a seed replays) and a request the gate refuses
changes nothing. A restarted server has a fresh gate; the clients keep their keys.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional

from tensorhub.auth import Gate, Keyring
from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.reference import ReferenceCore
from tensorhub.server.requests import Mailboxes, PulseHolds, apply_request, holdable
from tensorhub.sim import faults

CoreFactory = Callable[[Config], ReferenceCore]

NAME = "server"


def _sim_capability(client_id: str) -> bytes:
    """A simulated client's capability: fixed by its id (no draw from the seeded streams)."""
    return hashlib.sha256(b"tensorhub sim capability\0" + client_id.encode()).digest()


class Call:
    __slots__ = ("client", "req", "wait", "token", "on_reply", "epoch", "signed")

    def __init__(self, client, req, wait: bool, token: Optional[int], on_reply, epoch: int, signed=None) -> None:
        self.client, self.req, self.wait, self.token, self.on_reply, self.epoch = client, req, wait, token, on_reply, epoch
        self.signed = signed
        """``req`` as it goes over the wire: with its clients' capabilities."""


def _pushes(reply) -> bool:
    """Whether ``reply`` is a pulse answer that brings a ``Newest`` (a push)."""
    return isinstance(reply, m.PulseReply) and any(
        isinstance(e, m.Newest) for events in reply.notes.values() for e in events)


class SimServer:
    def __init__(self, world, core_factory: Optional[CoreFactory] = None) -> None:
        self.world = world
        self.core_factory: CoreFactory = core_factory or ReferenceCore
        self.epoch = 0
        self.up = True
        self.core: Optional[ReferenceCore] = self.core_factory(world.config)
        self.mail = self._mailboxes()
        self.calls: set[Call] = set()
        """Calls sent and not answered yet (a crash fails them)."""
        self._late: dict[str, list[list]] = {}
        """client -> its ``late_dup`` copies not sent yet: [call, epoch]."""
        self.polls: dict[str, Call] = {}
        """Long polls: a blocking call waiting for its client's next terminal event."""
        self.holds = PulseHolds()
        """Idle processes' pulses held here (``pulse_hold_s``), with the actor's rules."""
        self.holds_answered = 0
        self.requests = 0
        self.gate = Gate(world.config.model_secret)
        self.keys = Keyring(token=_sim_capability)
        """The clients' side: every simulated client's capability (they outlive a crash)."""
        self.push_delay_max_s = 0.0
        """The ``push_delay`` fault: pulse answers that bring a ``Newest`` are delayed up to this long."""
        self.push_rng = world.sim.rng("push-delay")
        world.sim.after(world.config.server_tick_s, self._tick)

    def _mailboxes(self) -> Mailboxes:
        """Event numbers grow across restarts, as the actor's (its start time) do."""
        return Mailboxes(seq_base=self.epoch << 32)

    # ------------------------------------------------------------------ faults

    def crash(self) -> None:
        self.world.sim.trace("server CRASH")
        self.up = False
        self.core = None
        self.epoch += 1
        self.mail = self._mailboxes()
        self.polls = {}
        self.holds = PulseHolds()
        calls, self.calls = self.calls, set()
        for call in sorted(calls, key=lambda c: (c.client.cid, c.token or 0)):
            self._unavailable(call)

    def restart(self) -> None:
        self.world.sim.trace("server RESTART")
        self.up = True
        self.epoch += 1
        self.core = self.core_factory(self.world.config)
        self.gate = Gate(self.world.config.model_secret)

    def declare_dead(self, cid: str) -> None:
        """The cluster manager (Ray, in production) reports client ``cid``'s process gone."""
        if not self.up:
            return
        effects = self.core.declare_dead([cid], self.world.sim.now, "process gone")
        self.world.checker.freshness.observe(self.core, self.world.sim.now)
        self.world.sim.trace(f"srv declare_dead {cid}")
        self._route(effects)

    # ------------------------------------------------------------------ calls

    def call(self, client, req: m.Request, wait: bool, token: Optional[int], on_reply=None) -> None:
        """Client -> server. The answer goes to ``on_reply(reply)`` if given, else to
        ``client.on_reply(token, reply)`` / ``client.on_unavailable(token)``."""
        c = Call(client, req, wait, token, on_reply, self.epoch, self.keys.sign(req, self.world.config.model_secret))
        if not self.up:
            self._unavailable(c)
            return
        self.calls.add(c)
        net = self.world.net
        if token is not None:
            self._flush_late(client.cid)  # a client's own requests stay in order (one connection)
        if net.lose():
            self._lost(c, "request")
            return
        net.send(client.cid, NAME, self._arrive, c, self.epoch)
        if token is not None and not isinstance(req, m.Pulse) and net.duplicate():
            self.world.sim.trace(f"duplicate {client.cid} {req!r}")
            self.world.checker.observer.path("msg_duplicated")
            net.send(client.cid, NAME, self._arrive, c, self.epoch)
        if token is not None and isinstance(req, m.Replicate):
            late = net.late_duplicate()
            if late is not None:
                self.world.sim.trace(f"late duplicate in {late:.3f}s {client.cid} {req!r}")
                self.world.checker.observer.path("msg_late_dup")
                entry = [c, self.epoch]
                self._late.setdefault(client.cid, []).append(entry)
                self.world.sim.after(late, self._send_late, client.cid, entry)

    def _send_late(self, cid: str, entry: list) -> None:
        """A ``late_dup`` copy goes out now (unless the client's next request sent it already)."""
        pending = self._late.get(cid, [])
        if any(e is entry for e in pending):
            pending[:] = [e for e in pending if e is not entry]
            self.world.net.send(cid, NAME, self._arrive, *entry)

    def _flush_late(self, cid: str) -> None:
        """The client sends another request: its late copies go out first. A connection keeps a
        client's requests in order, so a late copy can overtake other clients' requests (a version
        published meanwhile), never its own later ones."""
        for entry in self._late.pop(cid, []):
            self.world.net.send(cid, NAME, self._arrive, *entry)

    def _lost(self, c: Call, what: str) -> None:
        """The ``msg_loss`` fault: the call's request or reply is lost; its caller sees the
        server unavailable after the detection delay (and retries, as over a broken connection)."""
        self.world.sim.trace(f"lost {what} of {c.client.cid} {c.req!r}")
        self.world.checker.observer.path("msg_lost")
        self.calls.discard(c)
        self._unavailable(c)

    def notes(self, client, on_notes) -> None:
        """The client's background-event poll (``ServerPort.notes``); lost if the server is down."""
        if self.up:
            cap = self.keys.cap(client.cid)
            self.world.net.send(client.cid, NAME, self._notes, client, on_notes, self.epoch, cap)

    def _unavailable(self, c: Call) -> None:
        w = self.world
        if c.on_reply is not None:
            w.sim.after(w.params.detect_delay_s, c.on_reply, m.ErrorReply(code="ServerUnavailable", message="down"))
        else:
            w.sim.after(w.params.detect_delay_s, c.client.on_unavailable, c.token)

    def _arrive(self, c: Call, epoch: int) -> None:
        sim = self.world.sim
        if not self.up or epoch != self.epoch:
            return
        self.requests += 1
        req, refused = self.gate.admit(self.core, c.signed)
        cid = c.client.cid
        if refused is not None:
            sim.trace(f"srv {cid} {req!r} REFUSED {refused!r}")
            self._answer(c, refused)
            return

        def tap(reply, effects):
            sim.trace(f"srv {cid} {req!r} -> {reply!r}")
            self.world.checker.on_server(cid, req, reply, effects, self.epoch)
            for eff in effects:
                sim.trace(f"evt {eff.client_id} {eff.event!r}")
            faults.restart_after_failed_read(self.world, effects)
            faults.broadcast_shard_crash(self.world, cid, reply, effects)
            faults.restart_after_round_moved(self.world, cid, reply, effects)

        faults.source_dies_at_done(self.world, c.client, req)
        released = self.holds.releases(req)  # as the actor: before the request is applied
        reply, _ = apply_request(self.core, self.mail, req, sim.now, tap)
        reply = self.gate.answered(self.core, c.signed, reply)
        for hold in released:
            self._answer_hold(hold)
        hold_s = holdable(req, reply, self.world.config.pulse_hold_max_s if c.wait else 0.0,
                          self.world.config.pulse_hold_max_s)
        if isinstance(reply, m.Waiting) and c.wait:
            self.polls[cid] = c
            sim.after(self.world.config.request_timeout_s, self._poll_expired, c, reply)
        elif hold_s:
            hold = self.holds.start(req, self.core, sim.now + hold_s, sim.now)
            hold.waker = c
            sim.trace(f"srv hold pulse of {list(hold.client_ids)}")
            sim.after(hold_s, self._answer_hold, hold)
        else:
            self._answer(c, reply)
        self._serve_polls()

    def _answer_hold(self, hold) -> None:
        """A held pulse is answered (released, an event, or its deadline; once)."""
        if not isinstance(hold.waker, Call):
            return
        c, hold.waker = hold.waker, False
        if c.epoch != self.epoch or not self.up:
            return
        reply = self.holds.answer(hold, self.core, self.mail, self.world.sim.now)
        self.holds_answered += 1
        self.world.sim.trace(f"srv answer held pulse of {list(hold.client_ids)} -> {reply!r}")
        self._answer(c, reply)

    def _poll_expired(self, c: Call, reply) -> None:
        if self.polls.get(c.client.cid) is c:
            del self.polls[c.client.cid]
            self._answer(c, reply)

    def _serve_polls(self) -> None:
        for cid in sorted(self.polls):
            ev = self.mail.pop_terminal(cid)
            if ev is not None:
                self._answer(self.polls.pop(cid), ev)
        if self.holds.of:
            for hold in self.holds.held(sorted(self.holds.of), self.mail):
                self._answer_hold(hold)

    def _answer(self, c: Call, reply) -> None:
        if c not in self.calls:
            return  # answered already (a duplicated request), or its reply was lost
        if self.world.net.lose():
            self._lost(c, "reply")
            return
        if self.push_delay_max_s > 0 and _pushes(reply):
            # The push_delay fault: a pulse answer that brings a Newest is held up on its way.
            delay = self.push_rng.random() * self.push_delay_max_s
            self.world.sim.after(delay, self.world.net.send, NAME, c.client.cid, self._reply, c, reply, self.epoch)
            return
        self.world.net.send(NAME, c.client.cid, self._reply, c, reply, self.epoch)

    def _reply(self, c: Call, reply, epoch: int) -> None:
        if epoch != self.epoch:
            return  # the crash already failed this call
        if c not in self.calls:
            return  # a duplicated request's second reply: one answer per call
        self.calls.discard(c)
        if not c.client.alive:
            return
        self.keys.answered(c.signed, reply, self.world.config.model_secret)
        if c.on_reply is not None:
            c.on_reply(reply)
        else:
            c.client.on_reply(c.token, reply)

    def _notes(self, client, on_notes, epoch: int, cap: bytes) -> None:
        if not self.up or epoch != self.epoch:
            return
        self.gate.check_notes(self.core, client.cid, cap)  # an honest client's: an error is a bug here
        notes = self.mail.pop_background(client.cid)
        self.world.net.send(NAME, client.cid, self._notes_reply, client, on_notes, notes, self.epoch)

    def _notes_reply(self, client, on_notes, notes, epoch: int) -> None:
        if epoch == self.epoch and client.alive:
            on_notes(notes)

    def _route(self, effects: list[m.Deliver]) -> None:
        if not effects:
            return
        self.world.checker.on_server(None, None, None, effects, self.epoch)
        for eff in effects:
            self.world.sim.trace(f"evt {eff.client_id} {eff.event!r}")
        faults.restart_after_failed_read(self.world, effects)
        faults.broadcast_shard_crash(self.world, None, None, effects)
        faults.restart_after_round_moved(self.world, None, None, effects)
        self.mail.route(effects)
        self._serve_polls()

    def _tick(self) -> None:
        if self.up:
            if self.holds.of:
                self.core.touch(self.holds.attended(), self.world.sim.now)
            effects = self.core.tick(self.world.sim.now)
            self.world.checker.freshness.observe(self.core, self.world.sim.now)
            self._route(effects)
        self.world.sim.after(self.world.config.server_tick_s, self._tick)

    def status(self, model: str = "") -> Optional[m.Status]:
        return self.core.status(model) if self.up else None
