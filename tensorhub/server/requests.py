"""The server's request path, shared by every server (the Ray actor, ``LocalPort``, the simulator).

- :class:`Mailboxes`: per-client queues of the core's effects (terminal events a blocking call
  waits for; background notes a pulse carries).
- :class:`PulseHolds`: idle processes' pulses held until an event, a release or ``pulse_hold_s``.
- :class:`Backlog`: how far behind a server reads its queue (leases stretch by it).
- :func:`apply_request`, :func:`shed_register`, :func:`holdable`, :func:`busy_hold`: serving one
  request, the same everywhere; each server supplies only its waiting.

The client side of the conversation (``ServerPort``, ``LocalPort``, ``RayPort``) is
:mod:`tensorhub.ports`.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Optional

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.reference import ReferenceCore

TERMINAL = (m.Assignment, m.UnpublishDone, m.OffloadOrder, m.Failed, m.Evicted)
BACKGROUND = (m.DropHostCopy, m.MakeHostCopy, m.SeedAhead, m.PrefetchAhead, m.Probe, m.Evicted, m.Demoted, m.Newest,
              m.HashCells)


EVICTED_MAILBOXES_MAX = 1024
"""Mailboxes of evicted clients kept (their ``Evicted`` waits there); past that, the oldest go."""


class Mailboxes:
    """Per-client queues of events produced by the core's effects.

    Bounded by the live clients: a client's mailbox goes when it leaves (``forget``) and, once
    it is evicted (its process died, its lease ran out), after ``evicted_max`` later evictions
    (oldest eviction first) unless it registered again meanwhile (:meth:`revived`). Until then
    its ``Evicted`` waits for it; an evicted client that asks after that learns the same from
    ``UnknownClient``, and a dead one never asks.

    Background events are delivered at least once to a client whose beats acknowledge them
    (``Beat.acked`` >= 0): each gets a number, increasing across the server's restarts
    (``seq_base``: by default the start time in microseconds), and stays until a beat
    acknowledges it or a later one, so a pulse reply lost on its way loses nothing (the next
    pulse is answered with the same events; handles treat a repeated event as done). Other
    clients, and the explicit ``notes`` poll, take them once."""

    def __init__(self, evicted_max: int = EVICTED_MAILBOXES_MAX, seq_base: Optional[int] = None) -> None:
        self.terminal: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.background: dict[str, list[tuple[int, object]]] = collections.defaultdict(list)
        """Per client: (number, event), oldest first."""
        self.evicted_max = evicted_max
        self._evicted: dict[str, None] = {}
        """Evicted clients with a mailbox, oldest eviction first."""
        self._seq = time.time_ns() // 1000 if seq_base is None else seq_base
        self._acking: set[str] = set()
        """Clients whose beats acknowledge their events."""

    def route(self, effects: list[m.Deliver]) -> set[str]:
        """Queue each event; returns the client ids that got something."""
        woken = set()
        for eff in effects:
            if isinstance(eff.event, TERMINAL):
                self.terminal[eff.client_id].append(eff.event)
            if isinstance(eff.event, m.Newest):
                # Only the newest news counts: an older one still waiting is superseded.
                self._keep(eff.client_id, lambda e: not isinstance(e, m.Newest))
            if isinstance(eff.event, BACKGROUND):
                self._seq += 1
                self.background[eff.client_id].append((self._seq, eff.event))
            if isinstance(eff.event, m.Evicted):
                self._evicted.pop(eff.client_id, None)
                self._evicted[eff.client_id] = None
            woken.add(eff.client_id)
        while len(self._evicted) > self.evicted_max:
            self.forget(next(iter(self._evicted)))
        return woken

    def revived(self, client_id: str) -> None:
        """``client_id`` registered (or announced) again: its mailbox is a live client's (an
        ``Evicted`` of its earlier registration not yet acknowledged no longer applies)."""
        self._evicted.pop(client_id, None)
        self._keep(client_id, lambda e: not isinstance(e, m.Evicted))

    def ack(self, client_id: str, acked: int) -> None:
        """A beat of ``client_id`` acknowledged its events up to number ``acked`` (-1: it does
        not acknowledge)."""
        if acked < 0:
            return
        self._acking.add(client_id)
        q = self.background.get(client_id)
        if q and q[0][0] <= acked:
            q[:] = [(n, e) for n, e in q if n > acked]
            if not q:
                del self.background[client_id]

    def take_background(self, client_id: str) -> tuple[list, int]:
        """``client_id``'s waiting background events and the newest one's number (-1: none).
        They stay until acknowledged when the client acknowledges, else they are taken."""
        q = self.background.get(client_id)
        if not q:
            return [], -1
        if client_id not in self._acking:
            del self.background[client_id]
        return [e for _, e in q], q[-1][0]

    def clear_terminal(self, client_id: str) -> None:
        """A new blocking request supersedes events left from the previous one."""
        self.terminal.pop(client_id, None)

    def pop_terminal(self, client_id: str) -> Optional[object]:
        q = self.terminal.get(client_id)
        if q:
            ev = q.popleft()
            if not q:
                del self.terminal[client_id]
            return ev
        return None

    def pop_background(self, client_id: str) -> list:
        """Take ``client_id``'s background events, acknowledged or not (the ``notes`` poll) -- but
        a ``Newest``: it stays for the next pulse answer, which carries its number and the
        answer's freshness (:mod:`tensorhub.core.handle_view`); taken here it would be lost to
        the handle's view."""
        q = self.background.pop(client_id, [])
        kept = [(n, e) for n, e in q if isinstance(e, m.Newest)]
        if kept:
            self.background[client_id] = kept
        return [e for _, e in q if not isinstance(e, m.Newest)]

    def _keep(self, client_id: str, keep) -> None:
        q = self.background.get(client_id)
        if q:
            q[:] = [(n, e) for n, e in q if keep(e)]
            if not q:
                del self.background[client_id]

    def drop_superseded(self, client_id: str, host_versions: set[int]) -> None:
        """A (re-)announcement that carries host copies of ``host_versions`` gives the server
        its say on them anew: drops of them queued for the client's earlier registration no
        longer apply (freeing one now would leave the server pointing readers at nothing)."""
        self._keep(client_id, lambda e: not (isinstance(e, m.DropHostCopy) and e.version in host_versions))

    def forget(self, client_id: str) -> None:
        self.terminal.pop(client_id, None)
        self.background.pop(client_id, None)
        self._evicted.pop(client_id, None)
        self._acking.discard(client_id)


class Hold:
    """One process's pulse held by the server (see :class:`PulseHolds`)."""

    __slots__ = ("client_ids", "process", "deadline", "over", "waker", "since")

    def __init__(self, client_ids: tuple[str, ...], process: Optional[m.ProcessId], deadline: float,
                 since: float = 0.0) -> None:
        self.client_ids = client_ids
        self.process = process
        self.deadline = deadline
        self.since = since
        """When the hold began (the answer says how long it held: ``PulseReply.held_s``)."""
        self.over = False
        """Released or answered: its handles no longer count as heard from."""
        self.waker = None
        """The server's way to answer it now (an asyncio.Event, a simulator callback)."""


class PulseHolds:
    """The pulses a server holds (``Config.pulse_hold_s``): an idle process's pulse waits at the
    server until an event for one of its handles, a release, or its deadline. The rules, shared
    by the Ray actor, :class:`LocalPort` and the simulated server (each supplies the waiting):

    - a pulse is held only when it brought nothing to answer (no event waiting, no unknown
      handle) and carries no read progress (progress pulses are answered at once);
    - while held, its handles count as heard from for their lease (:meth:`attended`, stamped by
      the server's ticks): the process is waiting on us, and its death reaches the server
      through the cluster manager, not through silence. Not as proof that it lives: before
      retention skips an offload because of their copies, the core asks for one
      (``Probe``, a background event that answers the hold; the next pulse is the proof);
    - :meth:`releases`: a ``Register`` (or ``Announce``) from its process (a new handle's
      first beat must not wait a whole hold), a ``Leave`` of one of its handles, or a reader's
      ``SourceFailed`` naming one of them (the probe: the process must pulse again within
      ``2.5 * heartbeat_interval_s`` or its replica goes). A released hold stops counting at
      once. Other requests do not release it: a handle that starts reading sends its progress
      in separate, unheld pulses, and a storm of ``Replicate`` does not cost a second reply
      each;
    - a background event for one of its handles answers it (:meth:`held`) with the events."""

    def __init__(self) -> None:
        self.of: dict[str, Hold] = {}
        self.by_process: dict[m.ProcessId, Hold] = {}

    def start(self, pulse: m.Pulse, core: ReferenceCore, deadline: float, now: float) -> Hold:
        cids = tuple(b.client_id for b in pulse.beats)
        first = core.nodes.get(cids[0]) if cids else None
        proc = first.process if first is not None and (first.process.pid or first.process.worker_id) else None
        hold = Hold(cids, proc, deadline, since=now)
        for cid in cids:
            old = self.of.get(cid)
            if old is not None:
                self.end(old)  # a newer pulse of the same handle supersedes the old hold
            self.of[cid] = hold
        if proc is not None:
            self.by_process[proc] = hold
        return hold

    def end(self, hold: Hold) -> None:
        """The hold is over (idempotent)."""
        if hold.over:
            return
        hold.over = True
        for cid in hold.client_ids:
            if self.of.get(cid) is hold:
                del self.of[cid]
        if hold.process is not None and self.by_process.get(hold.process) is hold:
            del self.by_process[hold.process]

    def releases(self, request: m.Request) -> list[Hold]:
        """The holds ``request`` (not a Pulse) ends now; they are over when this returns."""
        if isinstance(request, m.Pulse):
            return []
        out = []
        cid = getattr(request, "client_id", None)
        reg = request if isinstance(request, m.Register) else getattr(request, "register", None)
        if isinstance(reg, m.Register):
            cid = reg.client_id
            h = self.by_process.get(reg.process)
            if h is not None:
                out.append(h)
        if isinstance(request, m.SourceFailed):
            h = self.of.get(request.source_id)
            if h is not None:
                out.append(h)
        if cid is not None and isinstance(request, (m.Register, m.Announce, m.Leave)):
            h = self.of.get(cid)
            if h is not None:
                out.append(h)
        for h in out:
            self.end(h)
        return out

    def held(self, client_ids, mail: "Mailboxes") -> list[Hold]:
        """The holds an event for ``client_ids`` answers (a background event is waiting)."""
        out = []
        for cid in client_ids:
            h = self.of.get(cid)
            if h is not None and not h.over and mail.background.get(cid):
                self.end(h)
                out.append(h)
        return out

    def attended(self) -> list[str]:
        """The handles whose pulse is held now."""
        return list(self.of)

    def answer(self, hold: Hold, core: ReferenceCore, mail: "Mailboxes", now: float) -> m.PulseReply:
        """The reply to a hold that is over at ``now``: each handle's background events, the
        handles the server no longer knows (declared dead while held: they announce again), how
        long it held and how long what it brings may serve local no-op answers."""
        self.end(hold)
        unknown, notes, acks = [], {}, {}
        for cid in hold.client_ids:
            n = core.nodes.get(cid)
            if n is None or n.host:
                unknown.append(cid)
            events, last = mail.take_background(cid)
            if events:
                notes[cid], acks[cid] = events, last
        view_s = core.pulse_answered([c for c in hold.client_ids if c not in unknown], now)
        return m.PulseReply(unknown=tuple(unknown), notes=notes, acks=acks, held_s=max(0.0, now - hold.since),
                            view_s=view_s)


class Backlog:
    """How far behind a server is in reading what was sent to it, in seconds, at most
    ``max_s`` (0: never behind): leases are judged against it (``ReferenceCore.tick``'s
    ``grace_s``), so a client whose pulse waits unread in the server's queue is not declared
    dead for that wait, and a slow server does not turn an overload into an outage.

    A server knows it one of two ways:

    - every request marks its arrival before it queues (:meth:`arrived`) and is marked
      :meth:`read` once the server has applied it (:class:`LocalPort`: a caller arrives before
      it waits for the lock): behind = the age of the oldest request not yet read, 0 when
      none waits;
    - ``probed``: the server sends itself a probe through the queue its clients' calls wait in,
      which it cannot see into (the Ray actor: a call to itself, every ``server_tick_s``),
      and marks it read when it runs: behind = the age of the newest probe read (whatever was
      sent before it has been read: one queue, first come first served). So a server whose
      loop stalls falls behind even while it sends no probe; an idle one is behind by at most
      one probe period.

    Either way a client that really stopped is declared dead at most ``max_s`` later than on
    an idle server. Thread-safe (a :class:`LocalPort`'s callers arrive from many threads). At
    most ``PENDING_MAX`` requests are remembered unread: the oldest beyond are forgotten (a
    probe that never returns must not grow the server)."""

    PENDING_MAX = 4096

    def __init__(self, max_s: float, now: float, probed: bool = False) -> None:
        assert max_s >= 0, max_s
        self.max_s = max_s
        self.probed = probed
        self._pending: dict[int, float] = {}
        self._tokens = 0
        self._read_upto = now
        """``probed``: when the newest probe read was sent."""
        self._lock = threading.Lock()
        self.max_seen_s = 0.0
        """The most this server was found behind (observability)."""

    def arrived(self, at: float) -> int:
        """A request (a probe) sent or arrived at ``at``; returns its token for :meth:`read`."""
        with self._lock:
            self._tokens += 1
            self._pending[self._tokens] = at
            if len(self._pending) > self.PENDING_MAX:
                del self._pending[next(iter(self._pending))]
            return self._tokens

    def read(self, token: int, heard: bool = True) -> None:
        """The server has read request ``token`` (idempotent; unknown tokens are ignored).
        ``heard=False``: it never will (a probe that failed), forget it without learning."""
        with self._lock:
            at = self._pending.pop(token, None)
            if at is not None and heard and at > self._read_upto:
                self._read_upto = at

    def behind_s(self, now: float) -> float:
        """How long the oldest unread request may have waited at ``now`` (0 to ``max_s``)."""
        if self.max_s <= 0:
            return 0.0
        with self._lock:
            if self.probed:
                oldest = self._read_upto
            elif self._pending:
                oldest = min(self._pending.values())
            else:
                return 0.0
        behind = min(self.max_s, max(0.0, now - oldest))
        if behind > self.max_seen_s:
            self.max_seen_s = behind
        return behind


def busy_hold(hold_s: float, behind_s: float, interval_s: float, request_timeout_s: float) -> float:
    """The hold of a pulse on a server behind by ``behind_s`` (:class:`Backlog`): once it is
    behind by more than one ``interval_s``, longer by the backlog, up to twice ``hold_s`` and
    by at most half of ``request_timeout_s`` (a client waits a hold out for its wait plus
    ``request_timeout_s``), so the fleet's next round of pulses comes after the server has
    caught up: load is shed before leases are."""
    if hold_s <= 0 or behind_s <= interval_s:
        return hold_s
    return hold_s + min(hold_s, behind_s, request_timeout_s / 2)


def shed_register(request: m.Request, core: ReferenceCore, behind_s: float, config: Config,
                  spread: float) -> Optional[m.ErrorReply]:
    """Backpressure on new clients (``Config.register_shed_s``): the ``ServerBusy`` reply to
    send instead of serving ``request``, or None to serve it. Only a ``Register`` of an id the
    table does not know is shed (an ``Announce`` is a known client coming back; a duplicate id
    gets its own error from the core), and only while the server is behind by more than
    ``register_shed_s``. ``spread`` in [0, 1) (the caller's randomness) spreads the retries over
    0.5-1.5x the backlog, at most ``lease_timeout_s``. Nothing changes: it is sent before the
    core sees the request."""
    shed_s = config.register_shed_s
    if shed_s <= 0 or behind_s <= shed_s or not isinstance(request, m.Register) or request.client_id in core.nodes:
        return None
    after = min(behind_s * (0.5 + spread), config.lease_timeout_s)
    return m.ErrorReply(code="ServerBusy", retry_after_s=round(after, 3),
                        message=f"server behind by {behind_s:.1f}s (> register_shed_s {shed_s}s): "
                                f"register again in {after:.1f}s")


def holdable(request: m.Request, reply: object, wait_s: float, hold_max_s: float) -> float:
    """How long a server may hold ``request`` after answering it with ``reply`` (0: answer
    now): a pulse asked to wait (``wait_s``), up to the server's ``hold_max_s``
    (``Config.pulse_hold_max_s``), that brought
    nothing to answer and carries no read progress."""
    if (not isinstance(request, m.Pulse) or wait_s <= 0 or hold_max_s <= 0 or not request.beats
            or not isinstance(reply, m.PulseReply) or reply.unknown or reply.notes
            or any(b.reading_units >= 0 for b in request.beats)):
        return 0.0
    return min(wait_s, hold_max_s)


def is_blocking(request: m.Request) -> bool:
    return isinstance(request, (m.Unpublish, m.Replicate, m.SourceFailed, m.OffloadDone))


def apply_request(core: ReferenceCore, mail: Mailboxes, request: m.Request, now: float,
                  tap=None) -> tuple[object, set[str]]:
    """The part of serving one request that every server shares: a blocking request first drops
    events left from the previous one, the core answers, effects go to mailboxes, a leaving
    client's mailbox is forgotten. Returns (reply, the clients that got an event: wake only
    the requests waiting for them). ``tap(reply,
    effects)`` sees both before they are routed (the simulator's checkers)."""
    if isinstance(request, m.Pulse):
        return _apply_pulse(core, mail, request, now, tap)
    client_id = getattr(request, "client_id", None)
    if client_id and is_blocking(request):
        mail.clear_terminal(client_id)
    if isinstance(request, m.Announce) and request.holding.host_copies:
        mail.drop_superseded(request.register.client_id, {v for v, _ in request.holding.host_copies})
    reply, effects = core.handle(request, now)
    if tap is not None:
        tap(reply, effects)
    woken = mail.route(effects)
    if isinstance(request, m.Leave) and isinstance(reply, m.Ok):
        mail.forget(request.client_id)
    elif isinstance(request, (m.Register, m.Announce)) and not isinstance(reply, m.ErrorReply):
        mail.revived(request.client_id if isinstance(request, m.Register) else request.register.client_id)
    return reply, woken


def _apply_pulse(core: ReferenceCore, mail: Mailboxes, pulse: m.Pulse, now: float,
                 tap=None) -> tuple[m.PulseReply, set[str]]:
    """A process's pulse: each handle's heartbeat (or read progress) as if sent alone, then the
    background events waiting for each handle, in one reply."""
    unknown, woken, failed = [], set(), {}
    for beat in pulse.beats:
        mail.ack(beat.client_id, beat.acked)
        req = m.Progress(beat.client_id, beat.reading_units) if beat.reading_units >= 0 else m.Heartbeat(beat.client_id)
        reply, w = apply_request(core, mail, req, now, tap)
        woken |= w
        if isinstance(reply, m.ErrorReply) and reply.code == "UnknownClient":
            unknown.append(beat.client_id)
        elif isinstance(reply, m.ErrorReply) and beat.reading_units >= 0 and core.read_failed(beat.client_id):
            # The read this progress belongs to has failed here: the reader learns it now too,
            # not only when its read ends (the server may be gone by then). Any other refusal
            # (InvalidState: the server completed the read and the handle has not heard yet, a
            # ReplicateDone reply lost) is not a failure of the read. The note names the read's
            # version: it may reach the handle after its call moved on to another read.
            failed[beat.client_id] = core.read_failed(beat.client_id)
    notes, acks = {}, {}
    for beat in pulse.beats:
        events, last = mail.take_background(beat.client_id)
        if events:
            acks[beat.client_id] = last
        if beat.client_id in failed:
            events = [failed[beat.client_id], *events]
        if events:
            notes[beat.client_id] = events
    view_s = core.pulse_answered([b.client_id for b in pulse.beats if b.client_id not in unknown], now)
    return m.PulseReply(unknown=tuple(unknown), notes=notes, acks=acks, view_s=view_s), woken
