"""How a client talks to the reference server: one port, two implementations.

``ServerPort.call(request, wait_s)`` sends one request and returns the reply; when the reply is
``Waiting`` and ``wait_s`` > 0 it instead returns the next *terminal* event for this client
(an Assignment, UnpublishDone, OffloadOrder or Failed) that arrives within ``wait_s``, or the
``Waiting`` reply itself on timeout. ``notes(client_id)`` returns background events
(DropHostCopy, Evicted) queued for the client.

- :class:`LocalPort` runs a :class:`ReferenceCore` in this process (tests, single-process use),
  with the server's request path (:mod:`tensorhub.server.requests`) and its own waiting.
- :class:`RayPort` talks to a model's detached ``ReferenceServer`` actor
  (:mod:`tensorhub.server.actor`); :func:`connect` finds or creates it.

Both sign each request with the capabilities of the handles they carry (:mod:`tensorhub.auth`).
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Optional, Protocol

import ray

from tensorhub.auth import Gate, Keyring, keyring_for, operator_proof
from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.reference import ReferenceCore
from tensorhub.errors import ServerUnavailable, from_code
from tensorhub.server.find import server_handle
from tensorhub.server.liveness import current_process
from tensorhub.server.naming import actor_name
from tensorhub.server.requests import Backlog, Mailboxes, PulseHolds, apply_request, busy_hold, holdable, shed_register


class CallCount:
    """The calls a port sent its server -- requests and notes fetches, pulses included -- counted
    per calling thread: what one user call cost in round trips is the difference around it on
    the thread that made it (:meth:`tensorhub.Hub.server_calls`), whatever the handle's
    background threads (pulses, prefetches) send meanwhile. Each thread writes only its own
    count (no lock)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def add(self) -> None:
        """One call sent from this thread."""
        self._local.n = self.here() + 1

    def here(self) -> int:
        """Calls sent from the calling thread so far."""
        return getattr(self._local, "n", 0)


class ServerPort(Protocol):
    counted: CallCount
    """Its calls, per calling thread (:class:`CallCount`)."""

    def call(self, request: m.Request, wait_s: float = 0.0) -> object: ...

    def notes(self, client_id: str) -> list: ...

    def reconnect(self) -> None: ...

    def process(self) -> m.ProcessId:
        """Who runs the caller, for the server's liveness checks."""
        ...

    def pulse_key(self) -> tuple:
        """Which server this port reaches: the handles of a process with the same key share one
        liveness loop (:mod:`tensorhub.handle.pulse`)."""
        ...


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
        self.holds = PulseHolds()
        """Pulses held here (``pulse_hold_s``), with the actor's rules."""
        self._held = threading.Condition(self._lock)
        self.backlog = Backlog(self.config.lease_stretch_max_s, time.monotonic())
        """Callers waiting for the lock, by arrival: leases stretch while they wait."""
        self.gate = Gate(self.config.model_secret)
        """The server's check of each request (:mod:`tensorhub.auth`), as in the actor."""
        self.shed = 0
        """Registrations refused ``ServerBusy`` (``Config.register_shed_s``)."""
        self.keys = Keyring()
        """The client side: the capabilities of the handles on this port."""
        self.counted = CallCount()

    def _apply(self, effects: list[m.Deliver]) -> None:
        self._wake(self.mail.route(effects))

    def _wake(self, client_ids) -> None:
        for cid in client_ids:
            w = self._waiters.get(cid)
            if w is not None:
                w.cond.notify_all()
        if self.holds.of and self.holds.held(client_ids, self.mail):
            self._held.notify_all()

    def _tick(self) -> None:
        now = time.monotonic()
        if self.holds.of:
            self.core.touch(self.holds.attended(), now)
        self._apply(self.core.tick(now, self.backlog.behind_s(now)))

    def tick(self) -> None:
        with self._lock:
            self._tick()

    def call(self, request: m.Request, wait_s: float = 0.0) -> object:
        """Sign ``request`` with its handles' capabilities (a :class:`~m.Signed` one goes as it
        is), then serve it as the actor does: the gate first, a refusal changes nothing."""
        self.counted.add()
        signed = self.keys.sign(request, self.config.model_secret)
        # Arrived now, read once applied: while it waits for the lock, no lease runs out for
        # what it (or any other waiting caller) carries.
        token = self.backlog.arrived(time.monotonic())
        try:
            with self._lock:
                return self._call(signed, wait_s, token)
        finally:
            self.backlog.read(token)

    def _call(self, signed: object, wait_s: float, token: int) -> object:
        """:meth:`call` under the lock."""
        request, refused = self.gate.admit(self.core, signed)
        if refused is not None:
            return refused
        shed = shed_register(request, self.core, self.backlog.behind_s(time.monotonic()), self.config,
                             random.random())
        if shed is not None:
            self.shed += 1
            return shed
        client_id = getattr(request, "client_id", None)
        if self.holds.releases(request):
            self._held.notify_all()
        self._tick()
        reply, woken = apply_request(self.core, self.mail, request, time.monotonic())
        self.backlog.read(token)
        reply = self.gate.answered(self.core, signed, reply)
        self.keys.answered(signed, reply, self.config.model_secret)
        self._wake(woken)
        hold_s = holdable(request, reply, wait_s, self.config.pulse_hold_max_s)
        if hold_s:
            behind = self.backlog.behind_s(time.monotonic())
            return self._hold(request, busy_hold(hold_s, behind, self.config.heartbeat_interval_s,
                                                 self.config.request_timeout_s))
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
                self._tick()
        finally:
            w.calls -= 1
            if not w.calls:
                del self._waiters[client_id]

    def _hold(self, pulse: m.Pulse, hold_s: float) -> m.PulseReply:
        """Keep an idle process's pulse (the caller holds the lock) until an event, a release
        or ``hold_s``; ticks every ``server_tick_s`` meanwhile (:class:`PulseHolds`)."""
        hold = self.holds.start(pulse, self.core, time.monotonic() + hold_s, time.monotonic())
        core = self.core
        while not hold.over and self.core is core:
            left = hold.deadline - time.monotonic()
            if left <= 0:
                break
            self._held.wait(min(left, self.config.server_tick_s))
            if not hold.over:
                self._tick()
        if self.core is not core:  # restarted while held: as a dead actor, every handle unknown
            return m.PulseReply(unknown=hold.client_ids)
        return self.holds.answer(hold, self.core, self.mail, time.monotonic())

    def notes(self, client_id: str) -> list:
        """The client's background events; Unauthorized without its capability."""
        self.counted.add()
        with self._lock:
            self.gate.check_notes(self.core, client_id, self.keys.cap(client_id))
            return self.mail.pop_background(client_id)

    def pulse_key(self) -> tuple:
        """Handles on this port share one liveness loop (:mod:`tensorhub.handle.pulse`)."""
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
            self.gate = Gate(self.config.model_secret)
            self.mail = Mailboxes()
            self.holds = PulseHolds()
            self._held.notify_all()
            self._wake(list(self._waiters))


class _Waiter:
    """The blocking calls of one client waiting in a :class:`LocalPort`."""

    __slots__ = ("cond", "calls")

    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.calls = 0


class RayPort:
    """A :class:`ServerPort` over the ReferenceServer actor of one model."""

    def __init__(self, handle, config: Config, model: str) -> None:
        self.handle = handle
        self.config = config
        self.model = model
        self.keys = keyring_for(self.pulse_key())
        """The capabilities of this process's handles on this server (shared by its ports)."""
        self.counted = CallCount()

    def call(self, request: m.Request, wait_s: float = 0.0) -> object:
        """Send ``request`` signed with its handles' capabilities (and the model secret's
        proof on a registration) and return the reply. Raises Unauthorized if the server
        cannot prove the model secret this port's config holds."""
        self.counted.add()
        signed = self.keys.sign(request, self.config.model_secret)
        ref = self.handle.call.remote(m.encode(signed), float(wait_s))
        try:
            data = ray.get(ref, timeout=wait_s + self.config.request_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise ServerUnavailable(f"reference server did not answer {type(signed.request).__name__}") from e
        except ray.exceptions.RayActorError as e:
            raise ServerUnavailable(f"reference server is gone: {e}") from e
        reply = m.decode_reply(data)
        self.keys.answered(signed, reply, self.config.model_secret)
        return reply

    def notes(self, client_id: str) -> list:
        self.counted.add()
        try:
            ref = self.handle.notes.remote(client_id, self.keys.cap(client_id))
            return [m.decode_reply(b) for b in ray.get(ref, timeout=self.config.request_timeout_s)]
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
            raise ServerUnavailable(str(e)) from e

    def process(self) -> m.ProcessId:
        return current_process()

    def pulse_key(self) -> tuple:
        """The handles of this process on this model's server share one liveness loop."""
        return ("ray", self.config.namespace, actor_name(self.config, self.model))

    def reconnect(self) -> None:
        """Find (or create) this model's server under its name again (blocks up to
        ``request_timeout_s``, then ServerUnavailable). Other models' servers are not touched."""
        deadline = time.monotonic() + self.config.request_timeout_s
        delay = 0.1
        while True:
            try:
                self.handle = server_handle(self.config, self.model)
                return
            except Exception as e:  # noqa: BLE001 - the old actor's name may still be held
                if time.monotonic() > deadline:
                    raise ServerUnavailable(f"cannot reach or recreate the reference server: {e}") from e
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def status(self, model: str = "") -> m.Status:
        """The operator view (every holder), proving the model secret if the config has one;
        raises Unauthorized where the server refuses it."""
        proof = operator_proof(self.config.model_secret, model) if self.config.model_secret else b""
        reply = m.decode_reply(ray.get(self.handle.status.remote(model, proof), timeout=self.config.request_timeout_s))
        if isinstance(reply, m.ErrorReply):
            raise from_code(reply.code, reply.message)
        return reply


def connect(config: Config, model: str) -> RayPort:
    """A port to the server of ``model``, created on first use (see :func:`server_handle`)."""
    return RayPort(server_handle(config, model), config, model)
