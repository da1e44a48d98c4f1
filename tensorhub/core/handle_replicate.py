"""The handle machine's replicate/update call: its requests and the server's replies to them.

A part of :class:`tensorhub.core.handle.HandleMachine` (``machine.replicating``):
:class:`Replicating` starts a read, rechecks a partial region it resumes, takes the server's
answers to ``Replicate`` (and to an update's ``OffloadDone``), ``SourceFailed`` and
``ReplicateDone``, and runs the pulls. What one read keeps from its ``Replicate`` to its end --
assignments, the failover budget, the completion's deadlines, the lost-version retry -- is the
read's own part (:class:`~tensorhub.core.handle_read.Read`, rules 4 and 5 in full there); this
part carries out its decisions on the shared :class:`~tensorhub.core.handle_state.HandleState`
and acts through functions the machine passes in (send a request, end or fail the operation,
offload).

Its rules:

- 2. Every call is one round ``seq``: the caller's ``round`` when given, else the next count;
  an internal retry (``VersionLost`` on a relative spec, :meth:`Replicating.retry_lost`) stays in
  its round. The server's ``NoChange`` or first ``Assignment`` is the round it resolved
  (``state.round``, announced with a holding after a restart).
- 6. A partial read left by an earlier call is resumed only as far as its units still match
  their recorded checksums (:class:`~tensorhub.core.handle_io.Recheck` before the
  ``Replicate``): between calls the user may write them.
- ``ReplicaIncomplete`` (siblings still registering) and ``ServerRecovering`` are asked again
  after a pause while the call's deadlines last; a completion a fresh server holds back is sent
  again (:meth:`Read.hold <tensorhub.core.handle_read.Read.hold>`).
- 9. A no-op ``update("latest")`` the handle's view answers (:mod:`~tensorhub.core.handle_view`:
  the newest version known, or a smart skip known) ends at ``start`` with a local ``noop``, its
  round counted and resolved as a ``NoChange`` would.
- ``update()``: once the server took the read it drained the old version (the handle is
  unpublished, an ``OffloadOrder`` first offloads its last copy); rule 3's all or nothing is
  the machine's ending (:meth:`HandleMachine._fail <tensorhub.core.handle.HandleMachine._fail>`).
"""

from __future__ import annotations

from typing import Callable

from tensorhub.core import messages as m
from tensorhub.core.handle_io import (
    Command, Done, Fail, Outcome, Phase, Pulled, Recheck, ReplicateOp, SetRegion, Sleep, is_error, waits,
)
from tensorhub.core.handle_link import RETRY_PAUSE_S
from tensorhub.core.handle_read import Read
from tensorhub.core.handle_state import HandleState, Step
from tensorhub.core.handle_view import View

Commands = list[Command]


class Replicating:
    """A replicate/update call's decisions (see the module docstring)."""

    def __init__(self, state: HandleState, read: Read, *,
                 replicate_request: Callable[[], m.Replicate],
                 send: Callable[[m.Request, bool, float], Commands],
                 end: Callable[[Commands], Commands],
                 fail: Callable[[str, str], Commands],
                 fail_reply: Callable[[object], Commands],
                 offload: Callable[[int], Commands], view: View) -> None:
        self.state = state
        self.view = view
        self.read = read
        self._replicate_request = replicate_request
        self._send = send
        self._end = end
        self._fail = fail
        self._fail_reply = fail_reply
        self._offload = offload

    def start(self, op: ReplicateOp, now: float) -> Commands:
        s = self.state
        s.seq = op.round if op.round is not None else s.seq + 1
        s.calls += 1  # this call's number (``Replicate.call``): its resends carry the same
        local = self.view.answer(op.spec, s.published, now, sharded=s.register_msg is not None
                                 and s.register_msg.num_shards > 1) if op.update else None
        if local is not None:
            # Rule 9 of the machine: the newest version known, or a smart skip known, known
            # fresh; no call. The round is counted (an unsharded replica's round binds no sibling).
            s.round = (s.seq, local.version)
            return self._end([Done(local)])
        s.deadline = now + s.request_timeout_s
        self.read.begin(now, s.request_timeout_s if s.incomplete_wait_s is None else s.incomplete_wait_s)
        s.restoring = None
        if s.published is None and s.region_version >= 0 and s.region_progress > 0:
            s.step = Step.RECHECK
            return [Recheck(s.region_version, s.region_progress)]
        return self._send(self._replicate_request(), True, now)

    def rechecked(self, units: int, now: float) -> Commands:
        s = self.state
        assert s.step is Step.RECHECK
        s.region_progress = units
        return [SetRegion(s.region_version, units)] + self._send(self._replicate_request(), True, now)

    # ------------------------------------------------------------------ replies

    def answered(self, reply: object, now: float) -> Commands:
        """The reply to ``Replicate`` (or to an update's ``OffloadDone``)."""
        s = self.state
        op = s.op
        assert isinstance(op, ReplicateOp)
        if isinstance(reply, m.ErrorReply):
            by = self.read.incomplete_by if reply.code == "ReplicaIncomplete" else s.deadline
            if reply.code in ("ReplicaIncomplete", "ServerRecovering") and now < by:
                self.read.open = False
                s.step = Step.RETRY_PAUSE
                return [Sleep(RETRY_PAUSE_S)]
            self.read.open = False  # the server refused the read: nothing to abort
            if self.read.may_retry_lost(reply, op):
                return self.retry_lost(now)
            return self._fail_reply(reply)
        if not isinstance(reply, m.NoChange):
            self.read.drained_old = True  # the server took the read: an update drained the old version
        if isinstance(reply, m.Failed):
            self.read.open = False
            if self.read.may_retry_lost(reply, op):
                return self.retry_lost(now)
            return self._fail_reply(reply)
        if isinstance(reply, m.NoChange):
            self.read.open = False
            s.round = (s.seq, reply.version)
            return self._end([Done(Outcome(action="noop", version=reply.version, in_flight=reply.in_flight))])
        if isinstance(reply, m.OffloadOrder):
            return self._offload(reply.version)
        if isinstance(reply, m.UnpublishDone):
            # The server restarted during the offload: we are unpublished now; ask again.
            cmds = self.drop_published()
            return cmds + self._send(self._replicate_request(), True, now)
        if isinstance(reply, m.Assignment):
            s.round = (s.seq, reply.version)
            cmds = self.drop_published() if op.update else []
            if self.read.first_assigned(reply, s.region_version, s.region_progress) == 0:
                s.region_version, s.region_progress = reply.version, 0
            return cmds + self.assign(reply)
        return self._fail_reply(reply)

    def reported(self, reply: object, now: float) -> Commands:
        """The reply to ``SourceFailed``: another source, or the read's end."""
        if isinstance(reply, m.Assignment):
            return self.reassigned(reply, now)
        if is_error(reply):
            self.read.open = False  # the server ended the read
            if self.read.may_retry_lost(reply, self.state.op):
                return self.retry_lost(now)
        return self._fail_reply(reply)

    def completed(self, version: int, reply: object, now: float) -> Commands:
        """The reply to ``ReplicateDone``."""
        s = self.state
        if isinstance(reply, m.ErrorReply) and reply.code == "ServerRecovering":
            # A fresh server holds a completion of a sharded round back until every
            # sibling re-announced (ReadRequests.on_ReplicateDone): ask again after a pause.
            held = self.hold_completion(now, Step.RETRY_PAUSE)
            if held:
                return held
        if isinstance(reply, m.Ok):
            self.read.open = False
            s.published = version
            s.phase = Phase.PUBLISHED
            return self._end([Done(self.read.outcome(version))])
        if is_error(reply) and self.read.may_retry_lost(reply, s.op):
            # Every byte landed, but the server had failed the read (its source died;
            # a mapping of a dead holder's memory stays readable): the relative update
            # retries once in its round, as after a failed pull.
            return self.retry_lost(now)
        return self._fail_reply(reply)

    def end_lost_read(self, now: float) -> Commands:
        """A finished read whose completion got no answer, the server having failed it (its
        ``Failed`` note came first): retried once if the update is relative, else its failure."""
        lost = self.read.take_lost()
        if self.read.may_retry_lost(lost, self.state.op):
            return self.retry_lost(now)
        return self._fail(lost.code, lost.message)

    def hold_completion(self, now: float, step: Step) -> Commands:
        """A completion a fresh server held back (:meth:`Read.hold`): pause in ``step``, then
        send it again; empty: its time is up."""
        held = self.read.hold(now, RETRY_PAUSE_S)
        if held is None:
            return []
        self.state.step = step
        return [held]

    def retry_lost(self, now: float) -> Commands:
        """The one retry of a lost version (:meth:`Read.retry_lost`), in the same round."""
        self.read.retry_lost()
        return self._send(self._replicate_request(), True, now)

    def drop_published(self) -> Commands:
        if self.state.published is None:
            return []
        # The server drained and unpublished the old version before answering.
        self.state.unpublish()
        return []

    # ------------------------------------------------------------------ pulling

    def assign(self, a: m.Assignment) -> Commands:
        self.read.assign(a)
        return self.pull()

    def pull(self) -> Commands:
        s = self.state
        s.step = Step.PULL
        return [self.read.pull(s.region_version, s.region_progress)]

    def pulled(self, ev: Pulled, now: float) -> Commands:
        s = self.state
        assert s.step is Step.PULL
        assert ev.error is not None or ev.progress >= s.unit_count
        s.region_progress = ev.progress
        then = self.read.pulled(ev, now)  # rule 4
        if isinstance(then, Fail):  # its reads could not be stopped: keep nothing
            s.hide_region()
            return [SetRegion(-1, 0)] + self._fail(then.code, then.message)
        return self._send(then, waits(then), now)

    def reassigned(self, a: m.Assignment, now: float) -> Commands:
        then = self.read.reassigned(a, self.state.region_progress)  # rule 5
        if then is None:
            return self.pull()
        if isinstance(then, Fail):
            return self._fail(then.code, then.message)
        self.state.step = Step.BACKOFF
        return [then]
