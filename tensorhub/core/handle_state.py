"""The state a shard handle's machine and its parts share: one owner for what they all read.

:class:`HandleState` holds what :class:`tensorhub.core.handle.HandleMachine` and its parts --
the link to the server (:mod:`~tensorhub.core.handle_link`), the offering calls
(:mod:`~tensorhub.core.handle_offer`), the replicate/update call
(:mod:`~tensorhub.core.handle_replicate`) -- all act on, as the reference core's parts share one
:class:`~tensorhub.core.table.Table`:

- what the handle holds: its phase, the published version, the region's version and progress
  (what its control block says), its host copies, its registration (re-announced after a server
  restart);
- its rounds: ``seq``, the round of the call in progress, and ``round``, the last one the server
  resolved for it (rule 2);
- the operation in progress: the operation, its :class:`Step`, the request in flight with its
  attempt (reconnects spent) and deadline, and the error an ``update()`` that is publishing its old
  version again ends with.

The machine exposes every field under its own name (``machine.phase`` is
``machine.state.phase``); drivers and tests read and set them there. Plain data, and two small
transitions that keep a pair together; every rule acts through the machine or one of its parts.
The read in progress is not here: it is a part of its own (:mod:`~tensorhub.core.handle_read`).
"""

from __future__ import annotations

import enum
from typing import Optional

from tensorhub.core import messages as m
from tensorhub.core.handle_io import Op, Phase


class Step(enum.Enum):
    """Where the operation in progress waits."""

    NONE = "none"
    SEND = "send"  # the reply to state.req
    ANNOUNCE = "announce"
    RECONNECT = "reconnect"
    RETRY_PAUSE = "retry-pause"
    ANNOUNCE_PAUSE = "announce-pause"  # a fresh server asked us to announce again later
    BACKOFF = "backoff"
    RECHECK = "recheck"
    PULL = "pull"
    OFFLOAD = "offload"


class HandleState:
    """One handle's shared state (see the module docstring). Not thread-safe: the machine's one
    driver reaches it through the machine."""

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
        self.calls = 0
        """Replicate calls so far (``Replicate.call``)."""
        self.round: tuple[int, int] = (-1, -1)
        """(seq, version) of the last round the server resolved for this handle."""
        self.register_msg: Optional[m.Register] = None
        self.op: Optional[Op] = None
        """The operation in progress."""
        self.step = Step.NONE
        self.req: Optional[m.Request] = None
        """The request in flight (sent again after a reconnect or a pause)."""
        self.attempt = 0
        """Reconnects (and re-announcements) spent on :attr:`req`."""
        self.deadline = 0.0
        """Until when a register or replicate call asks again when the server says "not yet"."""
        self.incomplete_wait_s: Optional[float] = None
        """How long a read waits for its replica's siblings to register (``ReplicaIncomplete``);
        None: ``request_timeout_s``. A staging copy's is one lease (its driver sets it): a sibling
        staging copy lost with its process is opened again only when that process is asked to
        seed, so waiting the whole request timeout only holds a seed that will not come."""
        self.restoring: Optional[tuple[str, str]] = None
        """update() failed after the drain: the old version is being published again; the error."""

    def hide_region(self) -> None:
        """The region holds nothing (its control block is set to say so by a ``SetRegion``)."""
        self.region_version, self.region_progress = -1, 0

    def unpublish(self) -> None:
        """The handle advertises nothing: registered, idle."""
        self.published = None
        self.phase = Phase.IDLE

    def round_txn(self, version: Optional[int]) -> dict:
        """The round that gave the handle ``version``, as a ``Holding``'s fields (none if another)."""
        seq, got = self.round
        return {"txn_seq": seq, "txn_version": got} if version is not None and got == version and seq > 0 else {}

    def partial_units(self) -> int:
        """Units of a partial read a ``Replicate`` offers to resume on."""
        return 0 if self.published is not None else self.region_progress
