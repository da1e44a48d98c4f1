"""The read in progress of a handle's replicate/update call: a part of the handle machine.

A part of :class:`tensorhub.core.handle.HandleMachine` (``machine.read``): :class:`Read` owns
what one read keeps from its ``Replicate`` to its end -- whether the server has it open, the
server's assignments and the sources they named, the failover budget, the completion's
deadlines, whether the server failed the read meanwhile, and the one retry of a lost version. It
never sees the machine: the machine passes in what a decision needs (the region's version and
progress, the operation, ``now``) and carries out what comes back -- a request to send, a
:class:`~tensorhub.core.handle_io.Pull`, a pause (:class:`~tensorhub.core.handle_io.Sleep`) or
the read's end (:class:`~tensorhub.core.handle_io.Fail`, :class:`~tensorhub.core.handle_io.Done`).

The machine's rules 4 and 5 (:mod:`tensorhub.core.handle`) are this part's, in full:

4. A pull ends only when every posted read is terminal (the driver's contract for
   :class:`~tensorhub.core.handle_io.Pulled`); a failed pull is reported (``SourceFailed``)
   only then, so the server never hands the source back to its writer while a read of ours may
   still land. A pull whose reads could not be brought to an end (``Pulled.not_terminal``)
   keeps nothing and aborts (:meth:`Read.pulled`).
5. Failover: after each failed pull the server assigns another source; a pull that failed on a
   source the server found dead costs nothing; ``failovers_max`` failures in a row without
   progress end the read with ``TransferError``, with a growing pause between them
   (:meth:`Read.reassigned`).

And what it keeps for rules 2 and 7: a relative ``update()`` whose version was lost mid-way
(``VersionLost``) retries once, in its round (:meth:`Read.may_retry_lost`); a completion
(``ReplicateDone``) is tried again past ``reconnects_max`` for a request timeout of its own, and
one a fresh server holds back (``ServerRecovering``) is sent again for a request timeout from
the first such answer (:meth:`Read.hold`); a completion the server had failed (its ``Failed``
note came first) ends as that failure, never announced complete (:meth:`Read.take_lost`).
"""

from __future__ import annotations

from typing import Optional, Union

from tensorhub.core import messages as m
from tensorhub.core.handle_io import Fail, Op, Outcome, Pull, Pulled, ReplicateOp, Sleep


class Read:
    """One read's state and decisions (see the module docstring). ``request_timeout_s`` and
    ``failovers_max``: the machine's, given at construction."""

    def __init__(self, client_id: str, *, request_timeout_s: float, failovers_max: int) -> None:
        self.client_id = client_id
        self.request_timeout_s = request_timeout_s
        self.failovers_max = failovers_max
        self.open = False
        """A Replicate was sent and the read has not ended on the server."""
        self.drained_old = False
        """update(): the server drained and unpublished the old version for this read."""
        self.retried_lost = False
        """The one retry of a lost version (:meth:`may_retry_lost`) is spent in this call."""
        self.lost_at_server: Optional[m.Failed] = None
        """The server failed the read in progress (its liveness reply said so, ``Noted(Failed)``):
        if the server then restarts before the read's own call learns it, the read must not be
        announced as complete (that would split a sharded replica's round)."""
        self.incomplete_by = 0.0
        """Until when a ``ReplicaIncomplete`` answer is asked again."""
        self.done_by = 0.0
        """Until when a read's completion (``ReplicateDone``) is tried again."""
        self.held_by: Optional[float] = None
        """Until when a completion a fresh server holds back (``ServerRecovering``) is announced
        again: a request timeout from the first such answer."""
        self.assignment: Optional[m.Assignment] = None
        self.first: Optional[m.Assignment] = None
        self.sources: list[str] = []
        self.holders: dict[str, None] = {}
        """Every client an assignment named (a resharded read's holder shards too), in order."""
        self.failovers = 0
        self.stuck = 0
        self.last_progress = -1
        self.start_units = 0
        self.last_error = ""

    def begin(self, now: float, incomplete_wait_s: float) -> None:
        """A replicate/update call starts: nothing of an earlier read carries over."""
        self.retried_lost = False
        self.incomplete_by = now + min(self.request_timeout_s, incomplete_wait_s)
        self.open = self.drained_old = False
        self.assignment = self.first = None
        self.sources = []
        self.holders = {}
        self.failovers = self.stuck = 0
        self.last_progress = -1
        self.start_units = 0

    @property
    def source(self) -> Optional[str]:
        """The holder of the latest assignment (None before the first)."""
        return self.sources[-1] if self.sources else None

    # ------------------------------------------------------------------ assignments and pulls

    def first_assigned(self, a: m.Assignment, region_version: int, region_progress: int) -> int:
        """The server's first answer to the ``Replicate``: the unit the read starts from (the
        region's progress when it holds that version already, else 0: it starts afresh)."""
        self.first = a
        self.start_units = region_progress if region_version == a.version else 0
        return self.start_units

    def assign(self, a: m.Assignment) -> None:
        self.lost_at_server = None
        self.assignment = a
        self.sources.append(a.source_id)
        self._named(a)

    def _named(self, a: m.Assignment) -> None:
        self.holders.update(dict.fromkeys((a.source_id, *(r.client_id for r in a.reshard))))

    def pull(self, region_version: int, region_progress: int) -> Pull:
        """Pull from the current assignment, on from what the region holds of its version."""
        a = self.assignment
        return Pull(a, region_progress if region_version == a.version else 0)

    def pulled(self, ev: Pulled, now: float) -> Union[m.Request, Fail]:
        """The pull ended (rule 4): the completion to send, the failure to report, or the read's
        end when its reads could not be stopped (the machine then keeps nothing of the region)."""
        a = self.assignment
        if ev.error is None:
            # Every byte is in place: giving up on the server's answer now could leave it listing
            # a holder this handle no longer advertises, so the completion is tried again, past
            # ``reconnects_max``, for a whole request timeout of its own.
            self.done_by = now + self.request_timeout_s
            self.held_by = None
            return m.ReplicateDone(self.client_id, a.version)
        self.failovers += 1
        self.last_error = ev.error
        if ev.not_terminal:
            # A late read may still land in the region: keep nothing, and do not tell the
            # server the source failed (it would hand the source back to its writer).
            return Fail("TransferError", f"{a.source_id}: reads could not be stopped: {ev.error}")
        return m.SourceFailed(self.client_id, ev.failed_source or a.source_id, ev.progress, unreachable=ev.unreachable)

    def reassigned(self, a: m.Assignment, progress: int) -> Optional[Union[Sleep, Fail]]:
        """The server's next source after a failed pull (rule 5), the region at ``progress``:
        None to pull from it now, a pause before pulling, or the read's end."""
        if a.version != self.assignment.version:
            return Fail("InvalidState", f"server reassigned version {a.version} during read of {self.assignment.version}")
        if a.failed_source_gone:
            self.assign(a)
            return None
        self.stuck = self.stuck + 1 if progress == self.last_progress else 1
        self.last_progress = progress
        if self.stuck > self.failovers_max:
            return Fail("TransferError", f"version {a.version}: {self.stuck} live sources failed without progress "
                                         f"at unit {progress}; last error: {self.last_error}")
        self.assignment = a
        self.sources.append(a.source_id)
        self._named(a)
        return Sleep(min(0.05 * 2 ** (self.stuck - 1), 1.0))

    def outcome(self, version: int) -> Outcome:
        """The read's outcome once the server confirmed its completion."""
        first = self.first
        return Outcome(action="replicated", version=version, sources=tuple(self.sources), holders=tuple(self.holders),
                       failovers=self.failovers,
                       start_units=self.start_units, first=first, in_flight=first.in_flight if first is not None else -1)

    # ------------------------------------------------------------------ the completion, lost reads

    def outlasts_reconnects(self, req: Optional[m.Request], now: float) -> bool:
        """Whether ``req`` is a completion still tried again past ``reconnects_max``."""
        return isinstance(req, m.ReplicateDone) and now < self.done_by

    def hold(self, now: float, pause: float) -> Optional[Sleep]:
        """A fresh server held this completion back (``ServerRecovering``): pause, then send it
        again, for a request timeout from the first such answer. A lost answer once the server
        takes it is still tried again as long as after the last byte (the wait does not use up
        the completion's own time). None: that time is up."""
        if self.held_by is None:
            self.held_by = now + self.request_timeout_s
        if now + pause >= self.held_by:
            return None
        self.done_by = max(self.done_by, now + self.request_timeout_s)
        return Sleep(pause)

    def noted_failed(self, ev: m.Failed, op: Optional[Op]) -> None:
        """The server's note that it failed this handle's read (a pulse's reply). A note of
        another version's read is about a read this call already ended (its follow-up's reply
        said so first, and the call retried with another version): not taken."""
        if isinstance(op, ReplicateOp) and self.assignment is not None and ev.version in (-1, self.assignment.version):
            self.lost_at_server = ev

    def take_lost(self) -> m.Failed:
        """A finished read whose completion got no answer, the server having failed it: its
        failure (the read is over on the server)."""
        lost, self.lost_at_server = self.lost_at_server, None
        self.open = False
        return lost

    def may_retry_lost(self, reply, op: Optional[Op]) -> bool:
        """update() of a relative spec whose version was lost mid-way retries once."""
        return (reply.code == "VersionLost" and isinstance(op, ReplicateOp) and op.update
                and not isinstance(op.spec, int) and not self.retried_lost)

    def retry_lost(self) -> None:
        """The one retry of a relative update whose version was lost: the read it ends is over
        (nothing to abort). Same round: the server keeps every shard of this replica in one
        transaction (it re-resolves the round only if no sibling holds its version)."""
        self.open = False
        self.retried_lost = True
        self.assignment = None
