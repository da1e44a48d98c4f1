"""Process-level liveness: one server call per process per heartbeat interval, whatever the
number of handles in it.

Every handle of a process that talks to one reference server joins that server's
:class:`Pulse` (:func:`join`; a process with handles of two models served by two servers has two
pulses). Each interval the pulse sends one :class:`~tensorhub.core.messages.Pulse` with every
member's heartbeat, or its read progress while it reads, and hands each member its share of the
reply: whether the server knows it (else it announces again) and the background events waiting
for it (host copies to make or drop, seeds, evictions), which a separate ``notes`` poll per handle
used to fetch. A prefetch staging handle is a member like any other, so a rollout with a staging
copy costs one call per interval, not four.

The server holds the pulse (``Config.pulse_hold_s``, a long poll): it answers at once when it
has an event for one of the members, early when a new handle of the process registers or a
reader reports one of the members failed, and otherwise at the end of the hold; the next pulse
then leaves at once. So an idle process costs the server one call per hold, not one per
interval, and events still arrive without delay. Pulses never leave closer together than
``heartbeat_interval_s`` (a server that does not hold them gets one per interval), except that
one whose reply brought events is followed after 10 ms: events come in bursts (a step's
publishes each ask the holders for cell checksums), and each later one would otherwise wait up
to an interval. While members
read, a second, unheld pulse carries their progress once per ``heartbeat_interval_s``
(:meth:`Pulse._progress_loop`); the held one stays where it is. With ``pulse_hold_s = 0`` the
one pulse per interval carries the progress itself.

The pulse's thread runs while it has members. A member's own work on the reply (announcing,
starting a host copy) runs on that thread, one member after the other; a member that raises is
logged and the others still get their share.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Hashable, Optional, Protocol

from tensorhub import errors
from tensorhub.core import messages as m
from tensorhub.core.handle_view import viewed

log = logging.getLogger(__name__)

__all__ = ["Member", "Pulse", "join", "leave"]


class Member(Protocol):
    """What a pulse needs of a handle (:class:`tensorhub.Hub` implements it)."""

    client_id: str
    _port: object

    def _beat(self) -> Optional[m.Beat]:
        """This interval's heartbeat (None: nothing to say yet, e.g. not registered)."""

    def _after_beat(self, known: bool, notes: list, acked: int = -1, may_announce: bool = True,
                    viewed: Optional[object] = None) -> None:
        """The server's answer for this handle: known or not, its background events, whether
        this reply may announce it again (the liveness stream's may), and what it says of the
        model's newest version (a :class:`tensorhub.core.handle_view.Viewed`; None: nothing)."""

    def _beat_interval(self) -> float:
        """The heartbeat interval this handle was configured with."""

    def _pulse_hold(self) -> float:
        """How long the server may hold this handle's pulse while it is idle (0: never)."""


class Pulse:
    """The liveness loop of one process towards one server (see the module docstring)."""

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._progress_thread: Optional[threading.Thread] = None
        self.calls = 0
        """Pulses sent (observability, tests)."""

    def add(self, member: Member) -> None:
        with self._lock:
            self._members[member.client_id] = member
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=f"tensorhub-pulse-{id(self):x}", daemon=True)
                self._thread.start()
            if member._pulse_hold() > 0 and (self._progress_thread is None or not self._progress_thread.is_alive()):
                self._progress_thread = threading.Thread(target=self._progress_loop, daemon=True,
                                                         name=f"tensorhub-progress-{id(self):x}")
                self._progress_thread.start()

    def remove(self, member: Member) -> bool:
        """Drop ``member``; True when the pulse has no member left (its threads then end)."""
        with self._lock:
            self._members.pop(member.client_id, None)
            empty = not self._members
        if empty:
            self._wake.set()
        return empty

    def members(self) -> list[Member]:
        with self._lock:
            return list(self._members.values())

    def _loop(self) -> None:
        """The liveness stream: one pulse of every member, held by the server while idle."""
        last = time.monotonic()
        while True:
            members = self.members()
            if not members:
                return
            interval = min(x._beat_interval() for x in members)
            left = last + interval - time.monotonic()
            if left > 0:
                self._wake.wait(left)
                self._wake.clear()
            members = self.members()
            if not members:
                return
            last = time.monotonic()
            try:
                if self.once(members):
                    # The server answered early with events: more may follow within the interval
                    # (a step's notes come in bursts: a holder's cell-checksum request after each
                    # shard's publish). Waiting out the interval delayed each later one by up to
                    # a heartbeat (an engine's resharded update took a heartbeat, not 0.2 s).
                    last = time.monotonic() - interval + min(interval, _AFTER_EVENTS_S)
            except Exception:  # noqa: BLE001 - liveness must survive a flaky server
                log.debug("pulse failed", exc_info=True)

    def _progress_loop(self) -> None:
        """With held pulses: every interval, one unheld pulse of the members that read, with
        their progress (the held one stays where it is and keeps bringing events)."""
        while True:
            members = self.members()
            if not members:
                return
            time.sleep(min(x._beat_interval() for x in members))
            readers = []
            for x in self.members():
                if x._pulse_hold() <= 0:
                    continue  # its progress rides on the liveness stream
                b = x._beat()
                if b is not None and b.reading_units >= 0:
                    readers.append((x, b))
            if readers:
                try:
                    self._send(readers, 0.0, announce=False)
                except Exception:  # noqa: BLE001
                    log.debug("progress pulse failed", exc_info=True)

    def once(self, members: Optional[list[Member]] = None) -> bool:
        """One liveness pulse now, for ``members`` (default: all). Members whose pulses may be
        held send plain heartbeats (their progress goes by :meth:`_progress_loop`) and ask the
        server to hold it; the others send their progress and are answered at once. True: the
        reply brought events."""
        members = self.members() if members is None else members
        beats = []
        for x in members:
            b = x._beat()
            if b is None:
                continue
            if x._pulse_hold() > 0:
                b = m.Beat(b.client_id, acked=b.acked)
            beats.append((x, b))
        if not beats:
            return False
        held = [x._pulse_hold() for x, b in beats if b.reading_units < 0]
        return self._send(beats, min(held) if len(held) == len(beats) else 0.0)

    def _send(self, beats: list, hold: float, announce: bool = True) -> bool:
        """One pulse of ``beats`` ((member, beat) pairs). ``announce``: members the server does
        not know announce again; the progress stream leaves that to the liveness stream (one
        announcement per restart, not two racing each other), which learns it at once: a held
        pulse fails with its server, and a handle forgotten while held gets an event. True: the
        reply brought events."""
        by_id = {b.client_id: x for x, b in beats}
        port = beats[0][0]._port
        self.calls += 1
        sent_at = time.monotonic()  # the machine's clock: what the answer brings is current as of then + held_s
        try:
            reply = port.call(m.Pulse(beats=tuple(b for _, b in beats)), hold)
        except errors.ServerUnavailable:
            if not announce:
                return False
            port.reconnect()
            reply = m.PulseReply(unknown=tuple(by_id))
        if isinstance(reply, m.ErrorReply):  # a server that predates pulses, or a bug: say so
            log.warning("pulse refused: %s %s", reply.code, reply.message)
            return False
        unknown = set(reply.unknown)
        for cid, x in by_id.items():
            try:
                x._after_beat(cid not in unknown, list(reply.notes.get(cid, ())), reply.acks.get(cid, -1),
                              may_announce=announce, viewed=viewed(reply, cid, sent_at))
            except Exception:  # noqa: BLE001 - one member's trouble is not the others'
                log.warning("handle %s: handling its pulse failed", cid, exc_info=True)
        return any(reply.notes.get(cid) for cid in by_id)


_AFTER_EVENTS_S = 0.01
"""The gap before the next pulse after one whose reply brought events (instead of the interval)."""

_pulses: dict[Hashable, Pulse] = {}
_registry_lock = threading.Lock()


def _key_of(port) -> Hashable:
    key = getattr(port, "pulse_key", None)
    return key() if callable(key) else ("port", id(port))


def join(member: Member) -> Pulse:
    """Add ``member`` to its server's pulse in this process (created on first use)."""
    key = _key_of(member._port)
    with _registry_lock:
        pulse = _pulses.get(key)
        if pulse is None:
            pulse = _pulses[key] = Pulse(key)
        pulse.add(member)
    return pulse


def leave(member: Member) -> None:
    """Remove ``member`` from its pulse (idempotent); the pulse goes when its last member does."""
    key = _key_of(member._port)
    with _registry_lock:
        pulse = _pulses.get(key)
        if pulse is not None and pulse.remove(member):
            del _pulses[key]
