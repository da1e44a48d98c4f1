"""How a client talks to the reference server: a small port with two implementations.

``ServerPort.call(request, wait_s)`` sends one request and returns the reply; when the reply is
``Waiting`` and ``wait_s`` > 0 it instead returns the next *terminal* event for this client
(an Assignment, UnpublishDone, OffloadOrder or Failed) that arrives within ``wait_s``, or the
``Waiting`` reply itself on timeout. ``notes(client_id)`` returns background events
(DropHostCopy, Evicted) queued for the client.

- :class:`LocalPort` runs a :class:`ReferenceCore` in this process (tests, single-process use).
- ``tensorhub.actors.server.RayPort`` talks to the detached ``ReferenceServer`` actor.

The mailbox logic is shared by both (:class:`Mailboxes`), so the Ray actor stays a thin shell.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Optional, Protocol

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.reference import ReferenceCore

TERMINAL = (m.Assignment, m.UnpublishDone, m.OffloadOrder, m.Failed, m.Evicted)
BACKGROUND = (m.DropHostCopy, m.MakeHostCopy, m.SeedAhead, m.Evicted)


class ServerPort(Protocol):
    def call(self, request: m.Request, wait_s: float = 0.0) -> object: ...

    def notes(self, client_id: str) -> list: ...

    def reconnect(self) -> None: ...

    def process(self) -> m.ProcessId:
        """Who runs the caller, for the server's liveness checks."""
        ...

    def pulse_key(self) -> tuple:
        """Which server this port reaches: the handles of a process with the same key share one
        liveness loop (:mod:`tensorhub.pulse`)."""
        ...


class Mailboxes:
    """Per-client queues of events produced by the core's effects."""

    def __init__(self) -> None:
        self.terminal: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.background: dict[str, list] = collections.defaultdict(list)

    def route(self, effects: list[m.Deliver]) -> set[str]:
        """Queue each event; returns the client ids that got something."""
        woken = set()
        for eff in effects:
            if isinstance(eff.event, TERMINAL):
                self.terminal[eff.client_id].append(eff.event)
            if isinstance(eff.event, BACKGROUND):
                self.background[eff.client_id].append(eff.event)
            woken.add(eff.client_id)
        return woken

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
        return self.background.pop(client_id, [])

    def drop_superseded(self, client_id: str, host_versions: set[int]) -> None:
        """A (re-)announcement that carries host copies of ``host_versions`` gives the server
        its say on them anew: drops of them queued for the client's earlier registration no
        longer apply (freeing one now would leave the server pointing readers at nothing)."""
        q = self.background.get(client_id)
        if q:
            q[:] = [e for e in q if not (isinstance(e, m.DropHostCopy) and e.version in host_versions)]
            if not q:
                del self.background[client_id]

    def forget(self, client_id: str) -> None:
        self.terminal.pop(client_id, None)
        self.background.pop(client_id, None)


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
    return reply, woken


def _apply_pulse(core: ReferenceCore, mail: Mailboxes, pulse: m.Pulse, now: float,
                 tap=None) -> tuple[m.PulseReply, set[str]]:
    """A process's pulse: each handle's heartbeat (or read progress) as if sent alone, then the
    background events waiting for each handle, in one reply."""
    unknown, woken, failed = [], set(), {}
    for beat in pulse.beats:
        req = m.Progress(beat.client_id, beat.reading_units) if beat.reading_units >= 0 else m.Heartbeat(beat.client_id)
        reply, w = apply_request(core, mail, req, now, tap)
        woken |= w
        if isinstance(reply, m.ErrorReply) and reply.code == "UnknownClient":
            unknown.append(beat.client_id)
        elif isinstance(reply, m.ErrorReply) and beat.reading_units >= 0:
            # The read this progress belongs to has failed here: the reader learns it now too,
            # not only when its read ends (the server may be gone by then).
            failed[beat.client_id] = m.Failed(code=reply.code, message=reply.message)
    notes = {}
    for beat in pulse.beats:
        events = mail.pop_background(beat.client_id)
        if beat.client_id in failed:
            events = [failed[beat.client_id], *events]
        if events:
            notes[beat.client_id] = events
    return m.PulseReply(unknown=tuple(unknown), notes=notes), woken


class LocalPort:
    """The core in this process, guarded by one lock; ticks on every call and from ``tick()``.
    A blocking call waits on its client's own condition: an event wakes only the calls waiting
    for that client (and each waiting call wakes every ``server_tick_s`` to tick the core)."""

    def __init__(self, config: Optional[Config] = None, core: Optional[ReferenceCore] = None) -> None:
        self.config = config or Config()
        self.core = core or ReferenceCore(self.config)
        self.mail = Mailboxes()
        self._lock = threading.RLock()
        self._waiters: dict[str, _Waiter] = {}

    def _apply(self, effects: list[m.Deliver]) -> None:
        self._wake(self.mail.route(effects))

    def _wake(self, client_ids) -> None:
        for cid in client_ids:
            w = self._waiters.get(cid)
            if w is not None:
                w.cond.notify_all()

    def tick(self) -> None:
        with self._lock:
            self._apply(self.core.tick(time.monotonic()))

    def call(self, request: m.Request, wait_s: float = 0.0) -> object:
        with self._lock:
            client_id = getattr(request, "client_id", None)
            self._apply(self.core.tick(time.monotonic()))
            reply, woken = apply_request(self.core, self.mail, request, time.monotonic())
            self._wake(woken)
            if not isinstance(reply, m.Waiting) or wait_s <= 0 or not client_id:
                return reply
            deadline = time.monotonic() + wait_s
            w = self._waiters.get(client_id)
            if w is None:
                w = self._waiters[client_id] = _Waiter(threading.Condition(self._lock))
            w.calls += 1
            try:
                while True:
                    ev = self.mail.pop_terminal(client_id)
                    if ev is not None:
                        return ev
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return reply
                    w.cond.wait(min(left, self.config.server_tick_s))
                    self._apply(self.core.tick(time.monotonic()))
            finally:
                w.calls -= 1
                if not w.calls:
                    del self._waiters[client_id]

    def notes(self, client_id: str) -> list:
        with self._lock:
            return self.mail.pop_background(client_id)

    def pulse_key(self) -> tuple:
        """Handles on this port share one liveness loop (:mod:`tensorhub.pulse`)."""
        return ("local", id(self))

    def reconnect(self) -> None:
        """Nothing to do in process (see :meth:`restart`)."""

    def process(self) -> m.ProcessId:
        return m.ProcessId(pid=os.getpid())

    def restart(self) -> None:
        """Replace the core by a fresh one, as if the server died and a new one started:
        every client is unknown until it re-announces."""
        with self._lock:
            self.core = ReferenceCore(self.config)
            self.mail = Mailboxes()
            self._wake(list(self._waiters))


class _Waiter:
    """The blocking calls of one client waiting in a :class:`LocalPort`."""

    __slots__ = ("cond", "calls")

    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.calls = 0
