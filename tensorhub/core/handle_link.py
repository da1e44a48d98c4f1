"""The handle machine's link to the server: sending, resending, reconnecting, re-announcing.

A part of :class:`tensorhub.core.handle.HandleMachine` (``machine.link``): :class:`Link` sends
the request in flight (:attr:`HandleState.req <tensorhub.core.handle_state.HandleState.req>`),
sends it again after a pause or a reconnect, and answers what any reply may say about the link
itself before the request's own part sees it. It works on the shared
:class:`~tensorhub.core.handle_state.HandleState` and the read in progress
(:class:`~tensorhub.core.handle_read.Read`), and acts through functions the machine passes in
(announce what the handle holds, route a reply, end the operation, the read's completion rules).

The machine's rule 7, in full:

7. Server restarts. ``UnknownClient`` in a reply re-announces what this handle holds
   (:meth:`HandleMachine.holding <tensorhub.core.handle.HandleMachine.holding>`, with the round
   that gave it the version) and re-sends the request, ``reconnects_max`` times;
   ``ServerUnavailable`` reconnects with a growing pause (0.2 s doubling, at most 2 s),
   ``reconnects_max`` times (a read's completion for a request timeout of its own), then fails the
   operation. After a reconnect a registered handle announces before it sends again (a
   ``Register`` or ``Leave`` is simply sent again). A holding says whether a server confirmed its
   published version (``Holding.confirmed``); a ``ReplicateDone`` that met the restart is
   announced unconfirmed, and the fresh server may hold it back until the replica's siblings are
   heard from (``ServerRecovering``: announced again after a pause, for as long as the completion
   may be tried), refuse it (``VersionLost``: the call fails, or a relative update retries once in
   its round) or, past its recovery window, later demote it (``Demoted``: the handle drops its
   published version and hides the region). A completion the server had failed before it was
   lost (its ``Failed`` note came first) ends as that failure, never announced complete.

And the link's other answers: a server that is recovering or busy (``ServerRecovering``, or
``ServerBusy`` with the pause it asks, at most :data:`BUSY_PAUSE_MAX_S`) is asked again after a
pause while a registration's deadline lasts; a waited request the server did not finish in time
(``Waiting``) fails with ``RequestTimeout``; ``Evicted`` ends a drain as an unpublish (the server
forgot this holder) and any other operation with ``UnknownClient``.
"""

from __future__ import annotations

from typing import Callable, Optional

from tensorhub.core import messages as m
from tensorhub.core.handle_io import Command, Reconnect, ReplicateOp, Send, Sleep, waits
from tensorhub.core.handle_read import Read
from tensorhub.core.handle_state import HandleState, Step

RETRY_PAUSE_S = 0.1
"""Pause before asking again when the server says "not yet" (siblings still registering)."""
BUSY_PAUSE_MAX_S = 60.0
"""The longest pause a ``ServerBusy`` reply can ask of a registering handle."""

Commands = list[Command]


class Link:
    """The link's decisions (see the module docstring)."""

    def __init__(self, state: HandleState, read: Read, *,
                 announce_request: Callable[[Optional[m.Request]], m.Announce],
                 replicate_request: Callable[[], m.Replicate],
                 replied_to: Callable[[m.Request, object, float], Commands],
                 fail: Callable[[str, str], Commands],
                 unpublished: Callable[[float], Commands],
                 end_lost_read: Callable[[float], Commands],
                 hold_completion: Callable[[float, Step], Commands],
                 retry_lost: Callable[[float], Commands]) -> None:
        self.state = state
        self.read = read
        self._announce_request = announce_request
        self._replicate_request = replicate_request
        self._replied_to = replied_to
        self._fail = fail
        self._unpublished = unpublished
        self._end_lost_read = end_lost_read
        self._hold_completion = hold_completion
        self._retry_lost = retry_lost

    # ------------------------------------------------------------------ sending

    def send(self, request: m.Request, wait: bool, now: float, *, fresh: bool = True) -> Commands:
        """Send ``request`` (``fresh``: a new request, its reconnects not spent)."""
        s = self.state
        if fresh:
            s.attempt = 0
        s.req = request
        s.step = Step.SEND
        if isinstance(request, m.Replicate):
            self.read.open = True
        return [Send(request, wait=wait)]

    def resend(self, now: float) -> Commands:
        req = self.state.req
        return self.send(req, waits(req), now, fresh=False)

    def pause(self, delay_s: float) -> Commands:
        """Send the request in flight again after ``delay_s`` (the server said "not yet")."""
        self.state.step = Step.RETRY_PAUSE
        return [Sleep(delay_s)]

    # ------------------------------------------------------------------ reconnecting (rule 7)

    def unavailable(self, message: str, now: float) -> Commands:
        s = self.state
        if s.step not in (Step.SEND, Step.ANNOUNCE):
            raise AssertionError(f"Unavailable in step {s.step}")
        s.attempt += 1
        if s.attempt > s.reconnects_max and not self.read.outlasts_reconnects(s.req, now):
            return self._fail("ServerUnavailable", message or "the reference server is unavailable")
        s.step = Step.RECONNECT
        return [Reconnect(min(0.2 * 2 ** (s.attempt - 1), 2.0))]

    def reconnected(self, now: float) -> Commands:
        """The pause before a reconnect is over: send again, or announce first."""
        s = self.state
        if s.register_msg is None or isinstance(s.req, (m.Register, m.Leave)):
            return self.resend(now)
        if isinstance(s.req, m.ReplicateDone) and self.read.lost_at_server is not None:
            # The server we lost had failed this read: end it as that failure instead of
            # announcing it complete (that would split a sharded replica's round); a
            # relative update retries once in its round first.
            return self._end_lost_read(now)
        return self.announce(now)

    def announce(self, now: float) -> Commands:
        self.state.step = Step.ANNOUNCE
        return [Send(self._announce_request(self.state.req))]

    def announced(self, reply: object, now: float) -> Commands:
        s = self.state
        req = s.req
        if isinstance(reply, m.ErrorReply) and reply.code == "ServerRecovering":
            # An unconfirmed completion of a sharded round waits for its siblings to announce
            # (Rounds.holds_back): announce again after a pause.
            if isinstance(req, m.ReplicateDone):
                held = self._hold_completion(now, Step.ANNOUNCE_PAUSE)
                if held:
                    s.attempt = 0  # the server answered: held back is not lost
                    return held
            elif now + RETRY_PAUSE_S < s.deadline:
                s.attempt = 0
                s.step = Step.ANNOUNCE_PAUSE
                return [Sleep(RETRY_PAUSE_S)]
        if isinstance(reply, m.ErrorReply) and isinstance(req, m.ReplicateDone) and self.read.may_retry_lost(reply, s.op):
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
            req = self._replicate_request()  # with what is in place now
        return self.send(req, waits(req), now, fresh=False)

    # ------------------------------------------------------------------ replies

    def replied(self, reply: object, now: float) -> Commands:
        """A reply to the request in flight: what it says about the link is answered here, the
        rest by the request's own part (``replied_to``)."""
        s = self.state
        if s.step is Step.ANNOUNCE:
            return self.announced(reply, now)
        if s.step is not Step.SEND:
            raise AssertionError(f"a reply in step {s.step}")
        req = s.req
        if (isinstance(reply, m.ErrorReply) and reply.code == "UnknownClient" and isinstance(req, m.ReplicateDone)
                and self.read.lost_at_server is not None):
            # The server that forgot us had failed this read: it ends as that failure, not as a
            # complete holder (a relative update retries once, announcing the handle again).
            return self._end_lost_read(now)
        elif (isinstance(reply, m.ErrorReply) and reply.code == "UnknownClient"
                and not isinstance(req, (m.Register, m.Announce, m.Leave)) and s.register_msg is not None):
            s.attempt += 1
            if s.attempt <= s.reconnects_max:
                return self.announce(now)
        if isinstance(reply, m.Waiting) and waits(req):
            if isinstance(req, m.Replicate):
                self.read.drained_old = True  # the server took the read (and drained an update's old version)
            return self._fail("RequestTimeout",
                              f"{type(req).__name__} did not finish within {s.request_timeout_s}s")
        if isinstance(reply, m.Evicted):
            if isinstance(req, m.Unpublish) or (isinstance(req, m.OffloadDone) and not isinstance(s.op, ReplicateOp)):
                # Evicted while draining: the server failed this holder's readers over and forgot
                # it, so nobody is sent here again; once the control block says "nothing" (their
                # reads re-check it) the tensors are the user's: that is an unpublish.
                return self._unpublished(now)
            self.read.open = False  # the server dropped the read with the handle
            return self._fail("UnknownClient", f"evicted by the server: {reply.reason}")
        if isinstance(req, m.Register):
            paused = self._registering_paused(reply, now)
            if paused:
                return paused
        return self._replied_to(req, reply, now)

    def _registering_paused(self, reply: object, now: float) -> Commands:
        """A registration the server cannot take yet: pause and register again while its
        deadline lasts (empty: it may not)."""
        if not isinstance(reply, m.ErrorReply):
            return []
        if reply.code == "ServerRecovering" and now < self.state.deadline:
            return self.pause(RETRY_PAUSE_S)
        if reply.code == "ServerBusy":
            # Backpressure (Config.register_shed_s): pause as long as the server asks
            # (bounded: a hostile reply cannot park us) and register again.
            after = reply.retry_after_s
            pause = min(after, BUSY_PAUSE_MAX_S) if after >= RETRY_PAUSE_S else RETRY_PAUSE_S
            if now + pause < self.state.deadline:
                return self.pause(pause)
        return []
