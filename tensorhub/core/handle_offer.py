"""The handle machine's offering calls: register, publish, unpublish (with its offload), close.

A part of :class:`tensorhub.core.handle.HandleMachine` (``machine.offering``): :class:`Offering`
starts these operations and decides on their replies. It works on the shared
:class:`~tensorhub.core.handle_state.HandleState` and acts through functions the machine passes
in (send a request, end the operation, fail it on a reply); the link's own answers (restarts,
pauses, timeouts, eviction: :mod:`tensorhub.core.handle_link`) come first.

Its rules:

- ``register()`` asks until its deadline (a request timeout) while the server is recovering or
  busy (the link's pauses); ``Registered.round_seq`` says where the replica's rounds are, so a
  restarted shard counts on with its siblings (rule 2).
- ``publish(v)`` writes the region's control block (``v``, every unit, the checksums) before it
  asks; a publish that is refused or gets no answer advertises nothing (the machine's ending
  hides the region, rule 6). The publish an ``update()`` sends to restore its old version
  (rule 3: all or nothing) ends the call with the update's error either way; if the server
  refused it, the handle ends unpublished, its region hidden.
- ``unpublish()`` waits for the server's drain (``UnpublishDone``), then hides the region: the
  tensors are the user's again. The last copy of a retained version offloads to host memory
  first (``OffloadOrder``); a version offloaded earlier keeps its host copy (the same bytes), so
  it is not copied again.
- 8. ``close()`` unpublishes first when something is published, then leaves. By the last live
  non-spot holder of a retained version, while other clients of the model remain, it is refused
  by the server (``LastCopyHeld``): the handle stays open and keeps serving its host copy;
  ``close(drop_last_copy=True)`` drops it. A handle that never registered closes at once.
"""

from __future__ import annotations

from typing import Callable, Optional

from tensorhub.core import messages as m
from tensorhub.core.handle_io import (
    CloseOp, Command, Done, Fail, Offload, Op, Outcome, Phase, PublishOp, RegisterOp, SetRegion, UnpublishOp,
)
from tensorhub.core.handle_state import HandleState, Step

Commands = list[Command]


class Offering:
    """The offering calls' decisions (see the module docstring)."""

    def __init__(self, state: HandleState, *,
                 send: Callable[[m.Request, bool, float], Commands],
                 end: Callable[[Commands], Commands],
                 fail_reply: Callable[[object], Commands]) -> None:
        self.state = state
        self._send = send
        self._end = end
        self._fail_reply = fail_reply

    def start(self, op: Op, now: float) -> Optional[Commands]:
        """Start ``op`` (the machine checked it may start); None: not one of these calls."""
        s = self.state
        match op:
            case RegisterOp(request):
                s.register_msg = request
                s.deadline = now + s.request_timeout_s
                return self._send(request, False, now)
            case PublishOp(version, sums):
                s.region_version, s.region_progress = version, s.unit_count
                return [SetRegion(version, s.unit_count, sums or None)] + self._send(
                    m.Publish(s.client_id, version), False, now)
            case UnpublishOp():
                return self._send(m.Unpublish(s.client_id), True, now)
            case CloseOp():
                if s.phase is Phase.OPEN:
                    s.phase = Phase.CLOSED
                    return self._end([Done(Outcome())])
                if s.published is not None:
                    return self._send(m.Unpublish(s.client_id), True, now)
                return self._send(m.Leave(s.client_id, drop_last_copy=op.drop_last_copy), False, now)
        return None

    # ------------------------------------------------------------------ replies

    def registered(self, reply: object) -> Commands:
        if isinstance(reply, m.Registered):
            self.state.seq = max(self.state.seq, reply.round_seq)
            reply = m.Ok()
        if isinstance(reply, m.Ok):
            self.state.phase = Phase.IDLE
            return self._end([Done(Outcome())])
        return self._fail_reply(reply)

    def published_reply(self, version: int, reply: object) -> Commands:
        s = self.state
        if s.restoring is not None:
            code, message = s.restoring
            s.restoring = None
            if not isinstance(reply, m.Ok):
                s.unpublish()
                s.hide_region()
                return self._end([SetRegion(-1, 0), Fail(code, message)])
            return self._end([Fail(code, message)])
        if isinstance(reply, m.Ok):
            s.published = version
            s.phase = Phase.PUBLISHED
            return self._end([Done(Outcome(version=version))])
        return self._fail_reply(reply)  # hides the region (the machine's _fail)

    def unpublish_reply(self, reply: object, now: float) -> Commands:
        """A drain's reply (to ``Unpublish``, or to ``OffloadDone`` outside a read)."""
        if isinstance(reply, m.OffloadOrder):
            return self.offload(reply.version)
        if isinstance(reply, m.UnpublishDone):
            return self.unpublished(now)
        return self._fail_reply(reply)

    def left(self, reply: object) -> Commands:
        if isinstance(reply, m.ErrorReply) and reply.code == "LastCopyHeld":
            return self._fail_reply(reply)  # stays open: it serves the last copy
        self.state.phase = Phase.CLOSED
        self.state.published = None
        return self._end([Done(Outcome())])

    # ------------------------------------------------------------------ the drain

    def offload(self, version: int) -> Commands:
        s = self.state
        s.step = Step.OFFLOAD
        if version in s.host_copies:
            # Offloaded earlier (the version came back to the tensors by a later read): the host
            # copy holds the same bytes; keep serving that one.
            return self.offloaded(version, s.host_copies[version], s.deadline)
        return [Offload(version)]

    def offloaded(self, version: int, endpoint: bytes, now: float) -> Commands:
        """The host copy of ``version`` serves at ``endpoint``: tell the server."""
        s = self.state
        assert s.step is Step.OFFLOAD
        s.host_copies[version] = endpoint
        return self._send(m.OffloadDone(s.client_id, version, endpoint), True, now)

    def unpublished(self, now: float) -> Commands:
        s = self.state
        was = s.published
        s.unpublish()
        s.hide_region()
        cmds: Commands = [SetRegion(-1, 0)]
        if isinstance(s.op, CloseOp):
            return cmds + self._send(m.Leave(s.client_id, drop_last_copy=s.op.drop_last_copy), False, now)
        return cmds + self._end([Done(Outcome(was_published=was))])
