"""A shard handle's decisions as a pure state machine: events in, commands out.

The shipped handle (:class:`tensorhub.Hub`) and the simulator's client
(:mod:`tensorhub.sim.client`) are two drivers of this one machine: they carry out its commands
(send a request, pull units, offload to host memory, sleep) and feed back what happened (the
reply, the pull's outcome, the timer). Nothing here touches a clock, a thread, a transport or
the server; ``now`` comes with every event.

The machine is composed as the reference core is: the state its parts share is one
:class:`~tensorhub.core.handle_state.HandleState` (``machine.state``; the machine exposes each
field under its own name, ``machine.phase`` and so on), and each family of decisions is a part
that gets the state and what it acts through passed in, never the machine:
:attr:`~HandleMachine.link` (:mod:`~tensorhub.core.handle_link`: sending, reconnects,
re-announcing), :attr:`~HandleMachine.offering` (:mod:`~tensorhub.core.handle_offer`: register,
publish, unpublish, close), :attr:`~HandleMachine.replicating`
(:mod:`~tensorhub.core.handle_replicate`: a replicate/update call) and
:attr:`~HandleMachine.read` (:mod:`~tensorhub.core.handle_read`: the read in progress). This
module keeps the one entry point (:meth:`HandleMachine.handle`, dispatching each event to its
part), what the handle announces (:meth:`HandleMachine.holding`), the server's background notes
and how an operation ends (rules 3 and 6). What the handle knows of its model's newest version is
:attr:`~HandleMachine.view` (:mod:`~tensorhub.core.handle_view`: ``Viewed`` events feed it; a
no-op ``update("latest")`` it can answer ends at ``Start``, rule 9).

Rules, in the order they are applied (each stated in full where it lives):

1. One operation at a time. ``Start(op)`` is legal only in the phases of :data:`LEGAL`
   (``InvalidState`` otherwise, nothing changes); an operation ends exactly once, with
   :class:`Done` or :class:`Fail` (:func:`tensorhub.core.handle_io.refusal`).
2. Rounds. Every replicate/update call is one round ``seq``: the caller's ``round`` when given
   (the same number on every shard, e.g. the RL iteration), else the next count (``seq += 1``;
   the shards of one replica count alike). Round ``seq`` is one transaction across the shards.
   The server says where the replica's rounds are when a process registers
   (``Registered.round_seq``), so a restarted shard counts on with its siblings (a best effort:
   a process that restarts mid-round cannot know for sure which round its siblings are in;
   callers that restart shards independently pass ``round``). An internal retry (``VersionLost``
   on a relative spec) stays in its round (:mod:`~tensorhub.core.handle_replicate`).
3. A read that was asked for (``Replicate`` sent) ends on the server too: every exit that is not
   ``ReplicateDone``/``NoChange``/a server-side failure sends ``ReplicateAbort`` first -- a
   typed error, a timeout, a failover budget spent, or the driver's own exception
   (:class:`Interrupted`, e.g. KeyboardInterrupt). An ``update()`` that fails after the server
   drained its old version, before any byte of the new one was written, publishes the old
   version again (all or nothing); if it cannot, the handle ends unpublished
   (:meth:`HandleMachine._fail`, here).
4. A pull ends only when every posted read is terminal; only then is a failed pull reported
   (``SourceFailed``). A pull whose reads could not be brought to an end keeps nothing and
   aborts (:mod:`~tensorhub.core.handle_read`).
5. Failover: ``failovers_max`` failures in a row without progress end the read with
   ``TransferError``, with a growing pause between them; a source the server found dead costs
   nothing (:mod:`~tensorhub.core.handle_read`).
6. A partial read left by an earlier call is hidden from its followers when the call fails (the
   control block says "nothing": :meth:`HandleMachine._fail`, here), and resumed by a later call
   only as far as its units still match their recorded checksums (:class:`Recheck`:
   :mod:`~tensorhub.core.handle_replicate`): between calls the user may write them.
7. Server restarts: ``UnknownClient`` re-announces what this handle holds
   (:meth:`HandleMachine.holding`) and re-sends the request; ``ServerUnavailable`` reconnects with
   a growing pause, ``reconnects_max`` times; a completion that met a restart is announced
   unconfirmed and may be held back (``ServerRecovering``), refused (``VersionLost``) or later
   demoted (``Demoted``: the handle drops its published version and hides the region, here)
   (:mod:`~tensorhub.core.handle_link`).
8. ``close()`` by the last live non-spot holder of a retained version, while other clients of
   the model remain, is refused by the server (``LastCopyHeld``): the handle stays open and keeps
   serving its host copy; ``close(drop_last_copy=True)`` drops it
   (:mod:`~tensorhub.core.handle_offer`).
9. A no-op ``update("latest")`` of a handle that publishes the newest version it was told of
   -- or, while a newer one is still on its way into its datacenter, the newest version it was
   told is complete there (a smart skip, ``in_flight`` set) -- while that knowledge is fresh
   (``noop_staleness_s``), ends at once with ``Done`` (``noop``, ``local``), no request sent; it
   counts its round like any call
   (:mod:`~tensorhub.core.handle_view`, :mod:`~tensorhub.core.handle_replicate`).
"""

from __future__ import annotations

from typing import Any, Optional

from tensorhub.core import messages as m
from tensorhub.core.handle_link import BUSY_PAUSE_MAX_S, RETRY_PAUSE_S, Link
from tensorhub.core.handle_offer import Offering
from tensorhub.core.handle_read import Read
from tensorhub.core.handle_replicate import Replicating
from tensorhub.core.handle_state import HandleState, Step
from tensorhub.core.handle_view import View, Viewed, viewed
from tensorhub.core.handle_io import (  # re-exported: the machine's vocabulary
    Phase, RegisterOp, PublishOp, UnpublishOp, ReplicateOp, CloseOp, Op, LEGAL, Start, Replied,
    Unavailable, Rechecked, Pulled, Offloaded, TimerFired, Interrupted, Noted, Event, Send,
    Reconnect, Sleep, SetRegion, Recheck, Pull, Offload, DropHost, Outcome, Done, Fail, Command,
    AWAITING, refusal,
)

__all__ = [
    "HandleMachine", "HandleState", "Step", "RETRY_PAUSE_S", "BUSY_PAUSE_MAX_S",
    "Phase", "RegisterOp", "PublishOp", "UnpublishOp", "ReplicateOp", "CloseOp", "Op", "LEGAL",
    "Start", "Replied", "Unavailable", "Rechecked", "Pulled", "Offloaded", "TimerFired",
    "Interrupted", "Noted", "Event", "Send", "Reconnect", "Sleep", "SetRegion", "Recheck", "Pull",
    "Offload", "DropHost", "Outcome", "Done", "Fail", "Command", "AWAITING", "View", "Viewed", "viewed",
]


class _Shared:
    """A machine attribute whose storage is the machine's :class:`HandleState` (``machine.x``
    reads and sets ``machine.state.x``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, machine: Any, owner: Optional[type] = None) -> Any:
        return self if machine is None else getattr(machine.state, self.name)

    def __set__(self, machine: Any, value: Any) -> None:
        setattr(machine.state, self.name, value)


class HandleMachine:
    """One shard handle's protocol state. Not thread-safe: a driver feeds it from one thread at
    a time (the shipped handle holds a lock).

    Its state shared with its parts is :attr:`state` (:class:`HandleState`); the fields below are
    the state's own, by their names. Its parts (see the module docstring) are attributes, each
    built once here with what it acts through."""

    client_id = _Shared()
    request_timeout_s = _Shared()
    reconnects_max = _Shared()
    failovers_max = _Shared()
    unit_count = _Shared()
    phase = _Shared()
    published = _Shared()
    region_version = _Shared()
    region_progress = _Shared()
    host_copies = _Shared()
    seq = _Shared()
    round = _Shared()
    register_msg = _Shared()
    op = _Shared()
    step = _Shared()
    incomplete_wait_s = _Shared()

    def __init__(self, client_id: str, *, request_timeout_s: float, reconnects_max: int, failovers_max: int,
                 unit_count: int = 0, noop_staleness_s: float = 0.0) -> None:
        self.state = HandleState(client_id, request_timeout_s=request_timeout_s, reconnects_max=reconnects_max,
                                 failovers_max=failovers_max, unit_count=unit_count)
        """What the machine and its parts share (:mod:`tensorhub.core.handle_state`)."""
        self.view = View(noop_staleness_s)
        """The model's newest version as the server told it, and until when a no-op
        ``update("latest")`` is answered from it (:mod:`tensorhub.core.handle_view`; 0: never)."""
        self.read = Read(client_id, request_timeout_s=request_timeout_s, failovers_max=failovers_max)
        """The read in progress of a replicate/update call (:mod:`tensorhub.core.handle_read`)."""
        self.offering = Offering(self.state, send=self._send, end=self._end, fail_reply=self._fail_reply)
        """Register, publish, unpublish, close (:mod:`tensorhub.core.handle_offer`)."""
        self.replicating = Replicating(
            self.state, self.read, replicate_request=self.replicate_request, send=self._send, end=self._end,
            fail=self._fail, fail_reply=self._fail_reply, offload=self.offering.offload, view=self.view)
        """A replicate/update call (:mod:`tensorhub.core.handle_replicate`)."""
        self.link = Link(
            self.state, self.read, announce_request=self.announce_request, replicate_request=self.replicate_request,
            replied_to=self._replied_to, fail=self._fail, unpublished=self.offering.unpublished,
            end_lost_read=self.replicating.end_lost_read, hold_completion=self.replicating.hold_completion,
            retry_lost=self.replicating.retry_lost)
        """The link to the server (:mod:`tensorhub.core.handle_link`)."""

    def _send(self, request: m.Request, wait: bool, now: float) -> list[Command]:
        return self.link.send(request, wait, now)

    # ------------------------------------------------------------------ a double buffer's swap

    def swapped_in(self, version: int, register: m.Register) -> None:
        """The server let this handle take over its staging copy's memory (``Swap``): it
        publishes ``version`` from the region it has now; ``register`` (the registration with
        the new endpoint) is what it re-announces after a server restart."""
        s = self.state
        s.phase, s.published = Phase.PUBLISHED, version
        s.region_version, s.region_progress = version, s.unit_count
        s.register_msg = register

    def swapped_out(self, register: m.Register) -> None:
        """The staging side of a ``Swap``: it holds nothing now, at its new endpoint."""
        s = self.state
        s.phase, s.published = Phase.IDLE, None
        s.hide_region()
        s.register_msg = register

    # ------------------------------------------------------------------ queries

    @property
    def reading(self) -> bool:
        """A pull may be writing the region (heartbeats report progress)."""
        return self.state.step is Step.PULL or (self.read.open and self.read.assignment is not None)

    @property
    def current_source(self) -> str:
        a = self.read.assignment
        return a.source_id if a is not None and self.state.step is Step.PULL else ""

    @property
    def read_source(self) -> Optional[str]:
        """The holder of the current read's latest assignment (None outside a read, or before
        its first assignment)."""
        return self.read.source

    def replicate_request(self) -> m.Replicate:
        """The Replicate this round sends (also used by a compiled graph's member)."""
        s = self.state
        op = s.op
        assert isinstance(op, ReplicateOp)
        return m.Replicate(s.client_id, op.spec, seq=s.seq, update=op.update,
                           resume_version=s.region_version, resume_units=s.partial_units(), call=s.calls)

    def holding(self, request: Optional[m.Request] = None, reading_units: Optional[int] = None) -> m.Holding:
        """What this handle holds, for a (re-)announcement to a fresh server; ``request``: the
        request that met ``UnknownClient``; ``reading_units``: a pull's progress right now."""
        s = self.state
        hosts = tuple(sorted(s.host_copies.items()))
        if isinstance(request, m.ReplicateDone):
            # Complete here, but the server never confirmed it (unconfirmed: a sibling's
            # completion of this round at another version wins over it).
            return m.Holding(published=request.version, host_copies=hosts, **s.round_txn(request.version))
        if isinstance(request, m.OffloadDone):
            # Drained on the old server already; the host copy (in `hosts`) holds the version.
            return m.Holding(published=None, host_copies=hosts)
        if self.reading and s.region_version >= 0:
            units = s.region_progress if reading_units is None else reading_units
            src = "" if isinstance(request, m.SourceFailed) else self.current_source
            return m.Holding(host_copies=hosts, reading_version=s.region_version, reading_source=src,
                             reading_units=units, txn_seq=s.seq, txn_version=s.region_version)
        return m.Holding(published=s.published, host_copies=hosts, confirmed=s.published is not None,
                         **s.round_txn(s.published))

    def announce_request(self, request: Optional[m.Request] = None, reading_units: Optional[int] = None) -> m.Announce:
        assert self.state.register_msg is not None
        return m.Announce(self.state.register_msg, self.holding(request, reading_units))

    # ------------------------------------------------------------------ the one entry point

    def handle(self, event: Event, now: float) -> list[Command]:
        """Apply ``event``; returns the commands to carry out, in order. At most one of them
        awaits an answer, and it is the last."""
        match event:
            case Start(op):
                return self._start(op, now)
            case Noted(ev):
                return self._noted(ev)
            case Interrupted(message):
                return self._interrupted(message)
            case Viewed():
                self.view.viewed(event)
                return []
        if self.state.op is None:
            raise AssertionError(f"{self.state.client_id}: {event!r} with no operation in progress")
        match event:
            case Replied(reply):
                return self.link.replied(reply, now)
            case Unavailable(message):
                return self.link.unavailable(message, now)
            case TimerFired():
                return self._timer(now)
            case Rechecked(units):
                return self.replicating.rechecked(units, now)
            case Pulled():
                return self.replicating.pulled(event, now)
            case Offloaded(version, endpoint):
                return self.offering.offloaded(version, endpoint, now)
        raise AssertionError(f"unknown event {event!r}")

    def _start(self, op: Op, now: float) -> list[Command]:
        s = self.state
        refused = refusal(op, s.phase, s.published, s.op)  # rule 1
        if refused is not None:
            return [refused]
        s.op = op
        if isinstance(op, ReplicateOp):
            return self.replicating.start(op, now)
        started = self.offering.start(op, now)
        if started is None:
            raise AssertionError(op)
        return started

    def _timer(self, now: float) -> list[Command]:
        match self.state.step:
            case Step.RECONNECT:
                return self.link.reconnected(now)
            case Step.RETRY_PAUSE:
                return self.link.resend(now)
            case Step.ANNOUNCE_PAUSE:
                return self.link.announce(now)
            case Step.BACKOFF:
                return self.replicating.pull()
        raise AssertionError(f"timer in step {self.state.step}")

    def _replied_to(self, req: m.Request, reply: object, now: float) -> list[Command]:
        """The reply to ``req`` once the link answered what it says about the link
        (:meth:`Link.replied <tensorhub.core.handle_link.Link.replied>`): the request's part decides."""
        match req:
            case m.Register():
                return self.offering.registered(reply)
            case m.Publish(version=version):
                return self.offering.published_reply(version, reply)
            case m.Unpublish() | m.OffloadDone() if not isinstance(self.state.op, ReplicateOp):
                return self.offering.unpublish_reply(reply, now)
            case m.Replicate() | m.OffloadDone():
                return self.replicating.answered(reply, now)
            case m.SourceFailed():
                return self.replicating.reported(reply, now)
            case m.ReplicateDone(version=version):
                return self.replicating.completed(version, reply, now)
            case m.Leave():
                return self.offering.left(reply)
        return self._fail_reply(reply)

    # ------------------------------------------------------------------ background, endings

    def _noted(self, ev: object) -> list[Command]:
        s = self.state
        if isinstance(ev, m.Failed):
            self.read.noted_failed(ev, s.op)
            return []
        if isinstance(ev, m.Demoted):
            if s.published != ev.version:
                return []  # a repeated or stale note
            # The server holds this handle as idle now: a sibling's confirmed completion of the
            # round won over this one's unconfirmed one. Advertise nothing (unless a read of the
            # next call is writing the region already).
            s.published = None
            if s.phase is Phase.PUBLISHED:
                s.phase = Phase.IDLE
            if s.region_version == ev.version and not self.reading:
                s.hide_region()
                return [SetRegion(-1, 0)]
            return []
        if isinstance(ev, m.DropHostCopy) and ev.version in s.host_copies:
            # Keep the host copy while an operation may still announce it (the server restarted
            # mid-offload); otherwise drop it now.
            del s.host_copies[ev.version]
            return [DropHost(ev.version)]
        return []

    def _interrupted(self, message: str) -> list[Command]:
        if self.state.op is None:
            return []
        return self._fail("Interrupted", message or "interrupted")

    def _fail_reply(self, reply: object) -> list[Command]:
        if isinstance(reply, (m.ErrorReply, m.Failed)):
            return self._fail(reply.code, reply.message)
        return self._fail("TensorHubError", f"unexpected reply {reply!r} to {type(self.state.req).__name__}")

    def _fail(self, code: str, message: str) -> list[Command]:
        s = self.state
        cmds: list[Command] = []
        if self.read.open:
            # Rule 3: the server must not keep a phantom reader (it would attach it to a source
            # whose unpublish() then waits for a read that never finishes).
            self.read.open = False
            cmds.append(Send(m.ReplicateAbort(s.client_id), fire=True))
        op = s.op
        unanswered = self._maybe_applied(code)
        if unanswered is not None:
            # No reply: the server may have applied the request (its reply lost, or a restart
            # after it) and be sending readers here (mixed_spot seed 5092: after a completion,
            # a reader was). The handle holds the version as published, its region shown: the
            # user must unpublish() before writing the tensors (idempotent at the server if it
            # never applied it; a reconnect announces it). Hiding it instead would let the user
            # overwrite bytes the server still hands out, and refuse the next publish.
            what, version = unanswered
            s.published = version
            s.phase = Phase.PUBLISHED
            return self._end(cmds + [Fail(code, f"{message} (the {what} of version {version} may have been "
                                                "applied: the handle holds it as published; unpublish() before "
                                                "writing the tensors)")])
        if isinstance(op, ReplicateOp) and s.region_version >= 0 and s.region_version != s.published:
            # Hide the partial copy from its followers before the user may write the idle
            # tensors (their reads check the control block), whoever ended the read (this
            # handle, or the server: VersionLost, a refused resume); the units and their
            # checksums stay, for a later call to resume on after a recheck.
            cmds.append(SetRegion(-1, 0))
        if isinstance(op, PublishOp) and s.published != op.version:
            # A publish the server refused advertises nothing: the user may write the tensors next.
            cmds.append(SetRegion(-1, 0))
            s.hide_region()
        if isinstance(op, ReplicateOp) and op.update and s.published is not None and self.read.drained_old:
            old = s.published
            if s.region_version == old and s.region_progress >= s.unit_count:
                # update() is all or nothing: no byte of the new version was written, so the
                # tensors still hold the old one; publish it again.
                s.restoring = (code, message)
                s.step = Step.SEND
                s.req = m.Publish(s.client_id, old)
                return cmds + [Send(s.req)]
            s.unpublish()
        return self._end(cmds + [Fail(code, message)])

    def _maybe_applied(self, code: str) -> Optional[tuple[str, int]]:
        """("publish" | "completion", version) when the request in flight got no answer
        (``ServerUnavailable``) and may have been applied: a publish, or a read's completion
        (``ReplicateDone``) after every unit landed."""
        s, op = self.state, self.state.op
        if code != "ServerUnavailable":
            return None
        done = s.req if isinstance(s.req, m.ReplicateDone) else None
        if (isinstance(op, ReplicateOp) and done is not None and s.region_version == done.version
                and s.region_progress >= s.unit_count and s.published != done.version):
            return "completion", done.version
        if (isinstance(op, PublishOp) and s.published != op.version and s.region_version == op.version
                and s.restoring is None):
            return "publish", op.version
        return None

    def _end(self, cmds: list[Command]) -> list[Command]:
        s = self.state
        s.op = None
        s.step = Step.NONE
        s.req = None
        self.read.assignment = None
        return cmds
