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

The pulse's thread runs while it has members. A member's own work on the reply (announcing,
starting a host copy) runs on that thread, one member after the other; a member that raises is
logged and the others still get their share.
"""

from __future__ import annotations

import logging
import threading
from typing import Hashable, Optional, Protocol

from tensorhub import errors
from tensorhub.core import messages as m

log = logging.getLogger(__name__)

__all__ = ["Member", "Pulse", "join", "leave"]


class Member(Protocol):
    """What a pulse needs of a handle (:class:`tensorhub.client.Hub` implements it)."""

    client_id: str
    _port: object

    def _beat(self) -> Optional[m.Beat]:
        """This interval's heartbeat (None: nothing to say yet, e.g. not registered)."""

    def _after_beat(self, known: bool, notes: list) -> None:
        """The server's answer for this handle: known or not, and its background events."""

    def _beat_interval(self) -> float:
        """The heartbeat interval this handle was configured with."""


class Pulse:
    """The liveness loop of one process towards one server (see the module docstring)."""

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.calls = 0
        """Pulses sent (observability, tests)."""

    def add(self, member: Member) -> None:
        with self._lock:
            self._members[member.client_id] = member
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=f"tensorhub-pulse-{id(self):x}", daemon=True)
                self._thread.start()

    def remove(self, member: Member) -> bool:
        """Drop ``member``; True when the pulse has no member left (its thread then ends)."""
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
        while True:
            members = self.members()
            if not members:
                return
            interval = min(x._beat_interval() for x in members)
            self._wake.wait(interval)
            self._wake.clear()
            members = self.members()
            if not members:
                return
            try:
                self.once(members)
            except Exception:  # noqa: BLE001 - liveness must survive a flaky server
                log.debug("pulse failed", exc_info=True)

    def once(self, members: Optional[list[Member]] = None) -> None:
        """One pulse now, for ``members`` (default: all)."""
        members = self.members() if members is None else members
        beats, by_id = [], {}
        for x in members:
            b = x._beat()
            if b is not None:
                beats.append(b)
                by_id[b.client_id] = x
        if not beats:
            return
        port = next(iter(by_id.values()))._port
        self.calls += 1
        try:
            reply = port.call(m.Pulse(beats=tuple(beats)))
        except errors.ServerUnavailable:
            port.reconnect()
            reply = m.PulseReply(unknown=tuple(by_id))
        if isinstance(reply, m.ErrorReply):  # a server that predates pulses, or a bug: say so
            log.warning("pulse refused: %s %s", reply.code, reply.message)
            return
        unknown = set(reply.unknown)
        for cid, x in by_id.items():
            try:
                x._after_beat(cid not in unknown, list(reply.notes.get(cid, ())))
            except Exception:  # noqa: BLE001 - one member's trouble is not the others'
                log.warning("handle %s: handling its pulse failed", cid, exc_info=True)


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
