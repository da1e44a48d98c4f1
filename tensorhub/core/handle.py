"""A shard handle's decisions as a pure state machine: events in, commands out.

The shipped handle (:class:`tensorhub.Hub`) and the simulator's client
(:mod:`tensorhub.sim.client`) are two drivers of this one machine: they carry out its commands
(send a request, pull units, offload to host memory, sleep) and feed back what happened (the
reply, the pull's outcome, the timer). Nothing here touches a clock, a thread, a transport or
the server; ``now`` comes with every event. The read in progress of a replicate/update call
is a part the machine holds (``machine.read``, :class:`tensorhub.core.handle_read.Read`): it owns
the read's assignments, failover budget, completion deadlines and lost-version retry, and never
sees the machine.

Rules, in the order they are applied:

1. One operation at a time. ``Start(op)`` is legal only in the phases of :data:`LEGAL`
   (``InvalidState`` otherwise, nothing changes); an operation ends exactly once, with
   :class:`Done` or :class:`Fail`.
2. Rounds. Every replicate/update call is one round ``seq``: the caller's ``round`` when given
   (the same number on every shard, e.g. the RL iteration), else the next count (``seq += 1``;
   the shards of one replica count alike). Round ``seq`` is one transaction across the shards.
   The server says where the replica's rounds are when a process registers
   (``Registered.round_seq``), so a restarted shard counts on with its siblings (a best effort:
   a process that restarts mid-round cannot know for sure which round its siblings are in;
   callers that restart shards independently pass ``round``). An internal retry (``VersionLost``
   on a relative spec) stays in its round.
3. A read that was asked for (``Replicate`` sent) ends on the server too: every exit that is not
   ``ReplicateDone``/``NoChange``/a server-side failure sends ``ReplicateAbort`` first -- a
   typed error, a timeout, a failover budget spent, or the driver's own exception
   (:class:`Interrupted`, e.g. KeyboardInterrupt). An ``update()`` that fails after the server
   drained its old version, before any byte of the new one was written, publishes the old
   version again (all or nothing); if it cannot, the handle ends unpublished.
4. A pull ends only when every posted read is terminal; only then is a failed pull reported
   (``SourceFailed``). A pull whose reads could not be brought to an end keeps nothing and
   aborts. Stated in full by the read's part, :mod:`tensorhub.core.handle_read`.
5. Failover: ``failovers_max`` failures in a row without progress end the read with
   ``TransferError``, with a growing pause between them; a source the server found dead costs
   nothing (:mod:`tensorhub.core.handle_read`).
6. A partial read left by an earlier call is hidden from its followers when the call fails (the
   control block says "nothing"), and resumed by a later call only as far as its units still
   match their recorded checksums (:class:`Recheck`): between calls the user may write them.
7. Server restarts: ``UnknownClient`` in a reply re-announces what this handle holds
   (:meth:`HandleMachine.holding`, with the round that gave it the version) and re-sends the
   request; ``ServerUnavailable`` reconnects with a growing pause, ``reconnects_max`` times. A
   holding says whether a server confirmed its published version (``Holding.confirmed``); a
   ``ReplicateDone`` that met the restart is announced unconfirmed, and the fresh server may
   hold it back until the replica's siblings are heard from (``ServerRecovering``: announced
   again after a pause, for as long as the completion may be tried), refuse it (``VersionLost``:
   the call fails, the next round retries) or, past its recovery window, later demote it
   (``Demoted``: the handle drops its published version and hides the region).
8. ``close()`` by the last live non-spot holder of a retained version, while other clients of
   the model remain, is refused by the server (``LastCopyHeld``): the handle stays open and keeps
   serving its host copy; ``close(drop_last_copy=True)`` drops it.
"""

from __future__ import annotations

import enum
from typing import Optional

from tensorhub.core import messages as m
from tensorhub.core.handle_read import Read
from tensorhub.core.handle_io import (  # re-exported: the machine's vocabulary
    Phase, RegisterOp, PublishOp, UnpublishOp, ReplicateOp, CloseOp, Op, LEGAL, Start, Replied,
    Unavailable, Rechecked, Pulled, Offloaded, TimerFired, Interrupted, Noted, Event, Send,
    Reconnect, Sleep, SetRegion, Recheck, Pull, Offload, DropHost, Outcome, Done, Fail, Command,
    AWAITING,
)

__all__ = [
    "HandleMachine", "Step", "RETRY_PAUSE_S", "BUSY_PAUSE_MAX_S",
    "Phase", "RegisterOp", "PublishOp", "UnpublishOp", "ReplicateOp", "CloseOp", "Op", "LEGAL",
    "Start", "Replied", "Unavailable", "Rechecked", "Pulled", "Offloaded", "TimerFired",
    "Interrupted", "Noted", "Event", "Send", "Reconnect", "Sleep", "SetRegion", "Recheck", "Pull",
    "Offload", "DropHost", "Outcome", "Done", "Fail", "Command", "AWAITING",
]

RETRY_PAUSE_S = 0.1
"""Pause before asking again when the server says "not yet" (siblings still registering)."""
BUSY_PAUSE_MAX_S = 60.0
"""The longest pause a ``ServerBusy`` reply can ask of a registering handle."""


class Step(enum.Enum):
    NONE = "none"
    SEND = "send"  # the reply to self._req
    ANNOUNCE = "announce"
    RECONNECT = "reconnect"
    RETRY_PAUSE = "retry-pause"
    ANNOUNCE_PAUSE = "announce-pause"  # a fresh server asked us to announce again later
    BACKOFF = "backoff"
    RECHECK = "recheck"
    PULL = "pull"
    OFFLOAD = "offload"


class HandleMachine:
    """One shard handle's protocol state. Not thread-safe: a driver feeds it from one thread at
    a time (the shipped handle holds a lock)."""

    def __init__(self, client_id: str, *, request_timeout_s: float, reconnects_max: int, failovers_max: int,
                 unit_count: int = 0) -> None:
        self.client_id = client_id
        self.request_timeout_s = request_timeout_s
        self.reconnects_max = reconnects_max
        self.failovers_max = failovers_max
        self.unit_count = unit_count
        self.phase = Phase.OPEN
        self.published: Optional[int] = None
        self.region_version = -1
        self.region_progress = 0
        self.host_copies: dict[int, bytes] = {}
        self.seq = 0
        self.round: tuple[int, int] = (-1, -1)
        """(seq, version) of the last round the server resolved for this handle."""
        self.register_msg: Optional[m.Register] = None
        # the operation in progress
        self.op: Optional[Op] = None
        self.step = Step.NONE
        self._req: Optional[m.Request] = None
        self._attempt = 0
        self._deadline = 0.0
        self.incomplete_wait_s: Optional[float] = None
        """How long a read waits for its replica's siblings to register (``ReplicaIncomplete``);
        None: ``request_timeout_s``. A staging copy's is one lease (its driver sets it): a sibling
        staging copy lost with its process is opened again only when that process is asked to
        seed, so waiting the whole request timeout only holds a seed that will not come."""
        self.read = Read(client_id, request_timeout_s=request_timeout_s, failovers_max=failovers_max)
        """The read in progress of a replicate/update call (:mod:`tensorhub.core.handle_read`)."""
        self._restoring: Optional[tuple[str, str]] = None
        """update() failed after the drain: the old version is being published again; the error."""

    # ------------------------------------------------------------------ a double buffer's swap

    def swapped_in(self, version: int, register: m.Register) -> None:
        """The server let this handle take over its staging copy's memory (``Swap``): it
        publishes ``version`` from the region it has now; ``register`` (the registration with
        the new endpoint) is what it re-announces after a server restart."""
        self.phase, self.published = Phase.PUBLISHED, version
        self.region_version, self.region_progress = version, self.unit_count
        self.register_msg = register

    def swapped_out(self, register: m.Register) -> None:
        """The staging side of a ``Swap``: it holds nothing now, at its new endpoint."""
        self.phase, self.published = Phase.IDLE, None
        self.region_version, self.region_progress = -1, 0
        self.register_msg = register

    # ------------------------------------------------------------------ queries

    @property
    def reading(self) -> bool:
        """A pull may be writing the region (heartbeats report progress)."""
        return self.step is Step.PULL or (self.read.open and self.read.assignment is not None)

    @property
    def current_source(self) -> str:
        a = self.read.assignment
        return a.source_id if a is not None and self.step is Step.PULL else ""

    @property
    def read_source(self) -> Optional[str]:
        """The holder of the current read's latest assignment (None outside a read, or before
        its first assignment)."""
        return self.read.source

    def replicate_request(self) -> m.Replicate:
        """The Replicate this round sends (also used by a compiled graph's member)."""
        op = self.op
        assert isinstance(op, ReplicateOp)
        return m.Replicate(self.client_id, op.spec, seq=self.seq, update=op.update,
                           resume_version=self.region_version, resume_units=self._partial_units())

    def holding(self, request: Optional[m.Request] = None, reading_units: Optional[int] = None) -> m.Holding:
        """What this handle holds, for a (re-)announcement to a fresh server; ``request``: the
        request that met ``UnknownClient``; ``reading_units``: a pull's progress right now."""
        hosts = tuple(sorted(self.host_copies.items()))
        if isinstance(request, m.ReplicateDone):
            # Complete here, but the server never confirmed it (unconfirmed: a sibling's
            # completion of this round at another version wins over it).
            return m.Holding(published=request.version, host_copies=hosts, **self._round_txn(request.version))
        if isinstance(request, m.OffloadDone):
            # Drained on the old server already; the host copy (in `hosts`) holds the version.
            return m.Holding(published=None, host_copies=hosts)
        if self.reading and self.region_version >= 0:
            units = self.region_progress if reading_units is None else reading_units
            src = "" if isinstance(request, m.SourceFailed) else self.current_source
            return m.Holding(host_copies=hosts, reading_version=self.region_version, reading_source=src,
                             reading_units=units, txn_seq=self.seq, txn_version=self.region_version)
        return m.Holding(published=self.published, host_copies=hosts, confirmed=self.published is not None,
                         **self._round_txn(self.published))

    def announce_request(self, request: Optional[m.Request] = None, reading_units: Optional[int] = None) -> m.Announce:
        assert self.register_msg is not None
        return m.Announce(self.register_msg, self.holding(request, reading_units))

    def _round_txn(self, version: Optional[int]) -> dict:
        seq, got = self.round
        return {"txn_seq": seq, "txn_version": got} if version is not None and got == version and seq > 0 else {}

    def _partial_units(self) -> int:
        return 0 if self.published is not None else self.region_progress

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
        if self.op is None:
            raise AssertionError(f"{self.client_id}: {event!r} with no operation in progress")
        match event:
            case Replied(reply):
                return self._replied(reply, now)
            case Unavailable(message):
                return self._unavailable(message, now)
            case TimerFired():
                return self._timer(now)
            case Rechecked(units):
                assert self.step is Step.RECHECK
                self.region_progress = units
                return [SetRegion(self.region_version, units)] + self._send(self.replicate_request(), True, now)
            case Pulled():
                return self._pulled(event, now)
            case Offloaded(version, endpoint):
                assert self.step is Step.OFFLOAD
                self.host_copies[version] = endpoint
                return self._send(m.OffloadDone(self.client_id, version, endpoint), True, now)
        raise AssertionError(f"unknown event {event!r}")

    # ------------------------------------------------------------------ starting

    def _start(self, op: Op, now: float) -> list[Command]:
        if self.op is not None:
            return [Fail("InvalidState", f"{type(self.op).__name__} is in progress on this handle")]
        if self.phase is Phase.CLOSED:
            return [Fail("HandleClosed", "handle is closed")]
        if self.phase not in LEGAL[type(op)]:
            if self.phase is Phase.OPEN:
                return [Fail("NotRegistered", "register() the tensors first")]
            return [Fail("InvalidState", "register() was already called on this handle")]
        match op:
            case PublishOp(version):
                if self.published == version:
                    return [Done(Outcome(version=version))]
                if self.published is not None:
                    return [Fail("InvalidState", f"version {self.published} is published: unpublish() first")]
            case UnpublishOp():
                if self.published is None:
                    return [Done(Outcome())]
            case ReplicateOp(spec, update):
                if not update and self.published is not None:
                    return [Fail("InvalidState",
                                 f"version {self.published} is published: unpublish() first, or update()")]
        self.op = op
        match op:
            case RegisterOp(request):
                self.register_msg = request
                self._deadline = now + self.request_timeout_s
                return self._send(request, False, now)
            case PublishOp(version, sums):
                self.region_version, self.region_progress = version, self.unit_count
                return [SetRegion(version, self.unit_count, sums or None)] + self._send(
                    m.Publish(self.client_id, version), False, now)
            case UnpublishOp():
                return self._send(m.Unpublish(self.client_id), True, now)
            case ReplicateOp(round=round_no):
                self.seq = round_no if round_no is not None else self.seq + 1
                self._deadline = now + self.request_timeout_s
                self.read.begin(now, self.request_timeout_s if self.incomplete_wait_s is None else self.incomplete_wait_s)
                self._restoring = None
                if self.published is None and self.region_version >= 0 and self.region_progress > 0:
                    self.step = Step.RECHECK
                    return [Recheck(self.region_version, self.region_progress)]
                return self._send(self.replicate_request(), True, now)
            case CloseOp():
                if self.phase is Phase.OPEN:
                    self.phase = Phase.CLOSED
                    return self._end([Done(Outcome())])
                if self.published is not None:
                    return self._send(m.Unpublish(self.client_id), True, now)
                return self._send(m.Leave(self.client_id, drop_last_copy=op.drop_last_copy), False, now)
        raise AssertionError(op)

    # ------------------------------------------------------------------ sending and recovery

    def _send(self, request: m.Request, wait: bool, now: float, *, fresh: bool = True) -> list[Command]:
        if fresh:
            self._attempt = 0
        self._req = request
        self.step = Step.SEND
        if isinstance(request, m.Replicate):
            self.read.open = True
        return [Send(request, wait=wait)]

    def _resend(self, now: float) -> list[Command]:
        req = self._req
        return self._send(req, _waits(req), now, fresh=False)

    def _unavailable(self, message: str, now: float) -> list[Command]:
        if self.step not in (Step.SEND, Step.ANNOUNCE):
            raise AssertionError(f"Unavailable in step {self.step}")
        self._attempt += 1
        if self._attempt > self.reconnects_max and not self.read.outlasts_reconnects(self._req, now):
            return self._fail("ServerUnavailable", message or "the reference server is unavailable")
        self.step = Step.RECONNECT
        return [Reconnect(min(0.2 * 2 ** (self._attempt - 1), 2.0))]

    def _announce(self, now: float) -> list[Command]:
        self.step = Step.ANNOUNCE
        return [Send(self.announce_request(self._req))]

    def _timer(self, now: float) -> list[Command]:
        match self.step:
            case Step.RECONNECT:
                if self.register_msg is None or isinstance(self._req, (m.Register, m.Leave)):
                    return self._resend(now)
                if isinstance(self._req, m.ReplicateDone) and self.read.lost_at_server is not None:
                    # The server we lost had failed this read: end it as that failure instead of
                    # announcing it complete (that would split a sharded replica's round); a
                    # relative update retries once in its round first.
                    return self._end_lost_read(now)
                return self._announce(now)
            case Step.RETRY_PAUSE:
                return self._resend(now)
            case Step.ANNOUNCE_PAUSE:
                return self._announce(now)
            case Step.BACKOFF:
                return self._pull()
        raise AssertionError(f"timer in step {self.step}")

    def _announced(self, reply: object, now: float) -> list[Command]:
        req = self._req
        if isinstance(reply, m.ErrorReply) and reply.code == "ServerRecovering":
            # An unconfirmed completion of a sharded round waits for its siblings to announce
            # (Rounds.holds_back): announce again after a pause.
            if isinstance(req, m.ReplicateDone):
                held = self._hold_completion(now, Step.ANNOUNCE_PAUSE)
                if held:
                    self._attempt = 0  # the server answered: held back is not lost
                    return held
            elif now + RETRY_PAUSE_S < self._deadline:
                self._attempt = 0
                self.step = Step.ANNOUNCE_PAUSE
                return [Sleep(RETRY_PAUSE_S)]
        if isinstance(reply, m.ErrorReply) and isinstance(req, m.ReplicateDone) and self.read.may_retry_lost(reply, self.op):
            # A completion that met a restart is refused by the fresh server (a sibling shard's
            # round moved on to another version, or the version is gone): the table keeps us
            # idle, and the relative update retries once in its round, as after a failed pull.
            return self._retry_lost(now)
        if isinstance(reply, m.ErrorReply):
            return self._fail(reply.code, reply.message)
        if isinstance(req, m.ReplicateDone):
            return self._replied_to(req, m.Ok(), now)  # announced as a complete holder already
        if isinstance(req, m.OffloadDone):
            return self._replied_to(req, m.UnpublishDone(version=req.version), now)  # announced unpublished
        if isinstance(req, m.Replicate):
            self.read.open = False
            req = self.replicate_request()  # with what is in place now
        return self._send(req, _waits(req), now, fresh=False)

    # ------------------------------------------------------------------ replies

    def _replied(self, reply: object, now: float) -> list[Command]:
        if self.step is Step.ANNOUNCE:
            return self._announced(reply, now)
        if self.step is not Step.SEND:
            raise AssertionError(f"a reply in step {self.step}")
        req = self._req
        if (isinstance(reply, m.ErrorReply) and reply.code == "UnknownClient" and isinstance(req, m.ReplicateDone)
                and self.read.lost_at_server is not None):
            # The server that forgot us had failed this read: it ends as that failure, not as a
            # complete holder (a relative update retries once, announcing the handle again).
            return self._end_lost_read(now)
        elif (isinstance(reply, m.ErrorReply) and reply.code == "UnknownClient"
                and not isinstance(req, (m.Register, m.Announce, m.Leave)) and self.register_msg is not None):
            self._attempt += 1
            if self._attempt <= self.reconnects_max:
                return self._announce(now)
        if isinstance(reply, m.Waiting) and _waits(req):
            if isinstance(req, m.Replicate):
                self.read.drained_old = True  # the server took the read (and drained an update's old version)
            return self._fail("RequestTimeout",
                              f"{type(req).__name__} did not finish within {self.request_timeout_s}s")
        if isinstance(reply, m.Evicted):
            if isinstance(req, m.Unpublish) or (isinstance(req, m.OffloadDone) and not isinstance(self.op, ReplicateOp)):
                # Evicted while draining: the server failed this holder's readers over and forgot
                # it, so nobody is sent here again; once the control block says "nothing" (their
                # reads re-check it) the tensors are the user's: that is an unpublish.
                return self._unpublished(now)
            self.read.open = False  # the server dropped the read with the handle
            return self._fail("UnknownClient", f"evicted by the server: {reply.reason}")
        return self._replied_to(req, reply, now)

    def _replied_to(self, req: m.Request, reply: object, now: float) -> list[Command]:
        match req:
            case m.Register():
                if isinstance(reply, m.ErrorReply) and reply.code == "ServerRecovering" and now < self._deadline:
                    self.step = Step.RETRY_PAUSE
                    return [Sleep(RETRY_PAUSE_S)]
                if isinstance(reply, m.ErrorReply) and reply.code == "ServerBusy":
                    # Backpressure (Config.register_shed_s): pause as long as the server asks
                    # (bounded: a hostile reply cannot park us) and register again.
                    after = reply.retry_after_s
                    pause = min(after, BUSY_PAUSE_MAX_S) if after >= RETRY_PAUSE_S else RETRY_PAUSE_S
                    if now + pause < self._deadline:
                        self.step = Step.RETRY_PAUSE
                        return [Sleep(pause)]
                if isinstance(reply, m.Registered):
                    self.seq = max(self.seq, reply.round_seq)
                    reply = m.Ok()
                if isinstance(reply, m.Ok):
                    self.phase = Phase.IDLE
                    return self._end([Done(Outcome())])
            case m.Publish(version=version) if self._restoring is not None:
                code, message = self._restoring
                self._restoring = None
                if not isinstance(reply, m.Ok):
                    self.published = None
                    self.phase = Phase.IDLE
                    self.region_version, self.region_progress = -1, 0
                    return self._end([SetRegion(-1, 0), Fail(code, message)])
                return self._end([Fail(code, message)])
            case m.Publish(version=version):
                if isinstance(reply, m.Ok):
                    self.published = version
                    self.phase = Phase.PUBLISHED
                    return self._end([Done(Outcome(version=version))])
                if _is_error(reply):
                    return self._fail_reply(reply)  # hides the region (_fail)
            case m.Unpublish() | m.OffloadDone() if not isinstance(self.op, ReplicateOp):
                if isinstance(reply, m.OffloadOrder):
                    return self._offload(reply.version)
                if isinstance(reply, m.UnpublishDone):
                    return self._unpublished(now)
            case m.Replicate() | m.OffloadDone():
                return self._replicate_reply(reply, now)
            case m.SourceFailed():
                if isinstance(reply, m.Assignment):
                    return self._reassigned(reply, now)
                if _is_error(reply):
                    self.read.open = False  # the server ended the read
                    if self.read.may_retry_lost(reply, self.op):
                        return self._retry_lost(now)
            case m.ReplicateDone(version=version):
                if isinstance(reply, m.ErrorReply) and reply.code == "ServerRecovering":
                    # A fresh server holds a completion of a sharded round back until every
                    # sibling re-announced (ReadRequests.on_ReplicateDone): ask again after a pause.
                    held = self._hold_completion(now, Step.RETRY_PAUSE)
                    if held:
                        return held
                if isinstance(reply, m.Ok):
                    self.read.open = False
                    self.published = version
                    self.phase = Phase.PUBLISHED
                    return self._end([Done(self.read.outcome(version))])
                if _is_error(reply) and self.read.may_retry_lost(reply, self.op):
                    # Every byte landed, but the server had failed the read (its source died;
                    # a mapping of a dead holder's memory stays readable): the relative update
                    # retries once in its round, as after a failed pull.
                    return self._retry_lost(now)
            case m.Leave():
                if isinstance(reply, m.ErrorReply) and reply.code == "LastCopyHeld":
                    return self._fail_reply(reply)  # stays open: it serves the last copy
                self.phase = Phase.CLOSED
                self.published = None
                return self._end([Done(Outcome())])
        return self._fail_reply(reply)

    def _replicate_reply(self, reply: object, now: float) -> list[Command]:
        op = self.op
        assert isinstance(op, ReplicateOp)
        if isinstance(reply, m.ErrorReply):
            by = self.read.incomplete_by if reply.code == "ReplicaIncomplete" else self._deadline
            if reply.code in ("ReplicaIncomplete", "ServerRecovering") and now < by:
                self.read.open = False
                self.step = Step.RETRY_PAUSE
                return [Sleep(RETRY_PAUSE_S)]
            self.read.open = False  # the server refused the read: nothing to abort
            if self.read.may_retry_lost(reply, op):
                return self._retry_lost(now)
            return self._fail_reply(reply)
        if not isinstance(reply, m.NoChange):
            self.read.drained_old = True  # the server took the read: an update drained the old version
        if isinstance(reply, m.Failed):
            self.read.open = False
            if self.read.may_retry_lost(reply, op):
                return self._retry_lost(now)
            return self._fail_reply(reply)
        if isinstance(reply, m.NoChange):
            self.read.open = False
            self.round = (self.seq, reply.version)
            return self._end([Done(Outcome(action="noop", version=reply.version, in_flight=reply.in_flight))])
        if isinstance(reply, m.OffloadOrder):
            return self._offload(reply.version)
        if isinstance(reply, m.UnpublishDone):
            # The server restarted during the offload: we are unpublished now; ask again.
            cmds = self._drop_published()
            return cmds + self._send(self.replicate_request(), True, now)
        if isinstance(reply, m.Assignment):
            self.round = (self.seq, reply.version)
            cmds = self._drop_published() if op.update else []
            if self.read.first_assigned(reply, self.region_version, self.region_progress) == 0:
                self.region_version, self.region_progress = reply.version, 0
            return cmds + self._assign(reply)
        return self._fail_reply(reply)

    def _end_lost_read(self, now: float) -> list[Command]:
        """A finished read whose completion got no answer, the server having failed it (its
        ``Failed`` note came first): retried once if the update is relative, else its failure."""
        lost = self.read.take_lost()
        if self.read.may_retry_lost(lost, self.op):
            return self._retry_lost(now)
        return self._fail(lost.code, lost.message)

    def _hold_completion(self, now: float, step: Step) -> list[Command]:
        """A completion a fresh server held back (:meth:`Read.hold`): pause in ``step``, then
        send it again; empty: its time is up."""
        held = self.read.hold(now, RETRY_PAUSE_S)
        if held is None:
            return []
        self.step = step
        return [held]

    def _retry_lost(self, now: float) -> list[Command]:
        """The one retry of a lost version (:meth:`Read.retry_lost`), in the same round."""
        self.read.retry_lost()
        return self._send(self.replicate_request(), True, now)

    def _drop_published(self) -> list[Command]:
        if self.published is None:
            return []
        # The server drained and unpublished the old version before answering.
        self.published = None
        self.phase = Phase.IDLE
        return []

    def _offload(self, version: int) -> list[Command]:
        self.step = Step.OFFLOAD
        if version in self.host_copies:
            # Offloaded earlier (the version came back to the tensors by a later read): the host
            # copy holds the same bytes; keep serving that one.
            return self.handle(Offloaded(version, self.host_copies[version]), self._deadline)
        return [Offload(version)]

    def _unpublished(self, now: float) -> list[Command]:
        was = self.published
        self.published = None
        self.phase = Phase.IDLE
        cmds = [SetRegion(-1, 0)] + self._region_reset()
        if isinstance(self.op, CloseOp):
            return cmds + self._send(m.Leave(self.client_id, drop_last_copy=self.op.drop_last_copy), False, now)
        return cmds + self._end([Done(Outcome(was_published=was))])

    def _region_reset(self) -> list[Command]:
        self.region_version, self.region_progress = -1, 0
        return []

    # ------------------------------------------------------------------ reading

    def _assign(self, a: m.Assignment) -> list[Command]:
        self.read.assign(a)
        return self._pull()

    def _pull(self) -> list[Command]:
        self.step = Step.PULL
        return [self.read.pull(self.region_version, self.region_progress)]

    def _pulled(self, ev: Pulled, now: float) -> list[Command]:
        assert self.step is Step.PULL
        assert ev.error is not None or ev.progress >= self.unit_count
        self.region_progress = ev.progress
        then = self.read.pulled(ev, now)  # rule 4
        if isinstance(then, Fail):  # its reads could not be stopped: keep nothing
            self.region_version, self.region_progress = -1, 0
            return [SetRegion(-1, 0)] + self._fail(then.code, then.message)
        return self._send(then, _waits(then), now)

    def _reassigned(self, a: m.Assignment, now: float) -> list[Command]:
        then = self.read.reassigned(a, self.region_progress)  # rule 5
        if then is None:
            return self._pull()
        if isinstance(then, Fail):
            return self._fail(then.code, then.message)
        self.step = Step.BACKOFF
        return [then]

    # ------------------------------------------------------------------ background, endings

    def _noted(self, ev: object) -> list[Command]:
        if isinstance(ev, m.Failed):
            self.read.noted_failed(ev, self.op)
            return []
        if isinstance(ev, m.Demoted):
            if self.published != ev.version:
                return []  # a repeated or stale note
            # The server holds this handle as idle now: a sibling's confirmed completion of the
            # round won over this one's unconfirmed one. Advertise nothing (unless a read of the
            # next call is writing the region already).
            self.published = None
            if self.phase is Phase.PUBLISHED:
                self.phase = Phase.IDLE
            if self.region_version == ev.version and not self.reading:
                self.region_version, self.region_progress = -1, 0
                return [SetRegion(-1, 0)]
            return []
        if isinstance(ev, m.DropHostCopy) and ev.version in self.host_copies:
            # Keep the host copy while an operation may still announce it (the server restarted
            # mid-offload); otherwise drop it now.
            del self.host_copies[ev.version]
            return [DropHost(ev.version)]
        return []

    def _interrupted(self, message: str) -> list[Command]:
        if self.op is None:
            return []
        return self._fail("Interrupted", message or "interrupted")

    def _fail_reply(self, reply: object) -> list[Command]:
        if isinstance(reply, (m.ErrorReply, m.Failed)):
            return self._fail(reply.code, reply.message)
        return self._fail("TensorHubError", f"unexpected reply {reply!r} to {type(self._req).__name__}")

    def _fail(self, code: str, message: str) -> list[Command]:
        cmds: list[Command] = []
        if self.read.open:
            # Rule 3: the server must not keep a phantom reader (it would attach it to a source
            # whose unpublish() then waits for a read that never finishes).
            self.read.open = False
            cmds.append(Send(m.ReplicateAbort(self.client_id), fire=True))
        op = self.op
        if isinstance(op, ReplicateOp) and self.region_version >= 0 and self.region_version != self.published:
            # Hide the partial copy from its followers before the user may write the idle
            # tensors (their reads check the control block), whoever ended the read (this
            # handle, or the server: VersionLost, a refused resume); the units and their
            # checksums stay, for a later call to resume on after a recheck.
            cmds.append(SetRegion(-1, 0))
        if isinstance(op, PublishOp) and self.published != op.version:
            # A publish that failed (refused, or no reply: ServerUnavailable) advertises nothing:
            # the user may write the tensors next.
            cmds.append(SetRegion(-1, 0))
            self._region_reset()
        if isinstance(op, ReplicateOp) and op.update and self.published is not None and self.read.drained_old:
            old = self.published
            if self.region_version == old and self.region_progress >= self.unit_count:
                # update() is all or nothing: no byte of the new version was written, so the
                # tensors still hold the old one; publish it again.
                self._restoring = (code, message)
                self.step = Step.SEND
                self._req = m.Publish(self.client_id, old)
                return cmds + [Send(self._req)]
            self.published = None
            self.phase = Phase.IDLE
        return self._end(cmds + [Fail(code, message)])

    def _end(self, cmds: list[Command]) -> list[Command]:
        self.op = None
        self.step = Step.NONE
        self._req = None
        self.read.assignment = None
        return cmds


def _waits(req: m.Request) -> bool:
    return isinstance(req, (m.Unpublish, m.Replicate, m.SourceFailed, m.OffloadDone))


def _is_error(reply: object) -> bool:
    return isinstance(reply, (m.ErrorReply, m.Failed))
