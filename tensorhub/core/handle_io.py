"""The vocabulary of a shard handle's machine (:class:`tensorhub.core.handle.HandleMachine`):
its phases, the operations a driver starts, the events it feeds back and the commands it
carries out; the start checks of rule 1 (:func:`refusal`).

A driver (the Hub, the simulator's client) sends :class:`Start` with an operation
(:data:`Op`), then answers each command (:data:`Command`) that waits (:data:`AWAITING`) with the
event it names (:data:`Event`); an operation ends with :class:`Done` or :class:`Fail`. An
operation is legal only in the phases of :data:`LEGAL`. All of these are frozen values, so a
recorded run replays as it ran. ``tensorhub.core.handle`` re-exports every name but the three
functions the machine's parts use: :func:`refusal`, :func:`waits` and :func:`is_error`.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Union

from tensorhub.core import messages as m


class Phase(enum.Enum):
    OPEN = "open"  # not registered yet
    IDLE = "idle"  # registered, holds nothing visible
    PUBLISHED = "published"
    CLOSED = "closed"


# --------------------------------------------------------------------------- operations


@dataclasses.dataclass(frozen=True)
class RegisterOp:
    request: m.Register


@dataclasses.dataclass(frozen=True)
class PublishOp:
    version: int
    checksums: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class UnpublishOp:
    pass


@dataclasses.dataclass(frozen=True)
class ReplicateOp:
    spec: m.VersionSpec
    update: bool
    round: Optional[int] = None
    """The caller's round number (the same on every shard of the replica), or None: count calls."""


@dataclasses.dataclass(frozen=True)
class CloseOp:
    drop_last_copy: bool = False


Op = Union[RegisterOp, PublishOp, UnpublishOp, ReplicateOp, CloseOp]

LEGAL: dict[type, tuple[Phase, ...]] = {
    RegisterOp: (Phase.OPEN,),
    PublishOp: (Phase.IDLE, Phase.PUBLISHED),
    UnpublishOp: (Phase.IDLE, Phase.PUBLISHED),
    ReplicateOp: (Phase.IDLE, Phase.PUBLISHED),
    CloseOp: (Phase.OPEN, Phase.IDLE, Phase.PUBLISHED),
}
"""Which operation may start in which phase."""


def refusal(op: Op, phase: Phase, published: Optional[int], busy: Optional[Op]) -> Optional[Union[Done, Fail]]:
    """Rule 1 (:mod:`tensorhub.core.handle`): how ``Start(op)`` ends at once on a handle in
    ``phase`` publishing ``published`` with ``busy`` in progress -- refused (:class:`Fail`), or
    with nothing to do (:class:`Done`: the version is published already, nothing to unpublish);
    None: the operation starts. One operation at a time, only in the phases of :data:`LEGAL`."""
    if busy is not None:
        return Fail("InvalidState", f"{type(busy).__name__} is in progress on this handle")
    if phase is Phase.CLOSED:
        return Fail("HandleClosed", "handle is closed")
    if phase not in LEGAL[type(op)]:
        if phase is Phase.OPEN:
            return Fail("NotRegistered", "register() the tensors first")
        return Fail("InvalidState", "register() was already called on this handle")
    match op:
        case PublishOp(version):
            if published == version:
                return Done(Outcome(version=version))
            if published is not None:
                return Fail("InvalidState", f"version {published} is published: unpublish() first")
        case UnpublishOp():
            if published is None:
                return Done(Outcome())
        case ReplicateOp(update=update):
            if not update and published is not None:
                return Fail("InvalidState", f"version {published} is published: unpublish() first, or update()")
    return None

# --------------------------------------------------------------------------- events


@dataclasses.dataclass(frozen=True)
class Start:
    op: Op


@dataclasses.dataclass(frozen=True)
class Replied:
    """The reply to the last :class:`Send` (for ``wait=True``: the terminal event, or
    ``Waiting`` when the wait ran out)."""

    reply: object


@dataclasses.dataclass(frozen=True)
class Unavailable:
    """The server could not be reached for the last :class:`Send`."""

    message: str = ""


@dataclasses.dataclass(frozen=True)
class Rechecked:
    """Of the partial read's units, the first ``units`` still match their checksums."""

    units: int


@dataclasses.dataclass(frozen=True)
class Pulled:
    """The :class:`Pull` ended; every posted read is terminal unless ``not_terminal``.
    ``progress``: units of the version in place (a prefix). ``error``: None on success, else
    what went wrong (``unreachable``: the source could not be reached at all)."""

    progress: int
    error: Optional[str] = None
    unreachable: bool = False
    not_terminal: bool = False
    failed_source: str = ""
    """The holder at fault when not the assignment's source: one shard of a resharded read's."""


@dataclasses.dataclass(frozen=True)
class Offloaded:
    version: int
    endpoint: bytes


@dataclasses.dataclass(frozen=True)
class TimerFired:
    pass


@dataclasses.dataclass(frozen=True)
class Interrupted:
    """The driver's own exception escaped while a command ran (KeyboardInterrupt, a bug): the
    operation ends; the machine says what to clean up. The driver re-raises its exception."""

    message: str = ""


@dataclasses.dataclass(frozen=True)
class Noted:
    """A background event from the server (``DropHostCopy``)."""

    event: object


Event = Union[Start, Replied, Unavailable, Rechecked, Pulled, Offloaded, TimerFired, Interrupted, Noted]

# --------------------------------------------------------------------------- commands


@dataclasses.dataclass(frozen=True)
class Send:
    """Send ``request``; ``wait``: wait up to ``request_timeout_s`` for its outcome (an
    event). Answer with :class:`Replied` or :class:`Unavailable` unless ``fire``."""

    request: m.Request
    wait: bool = False
    fire: bool = False
    """Fire and forget: no answer expected (an abort on the way out)."""


@dataclasses.dataclass(frozen=True)
class Reconnect:
    """Pause ``delay_s``, reconnect to the (maybe new) server, answer :class:`TimerFired`."""

    delay_s: float


@dataclasses.dataclass(frozen=True)
class Sleep:
    delay_s: float


@dataclasses.dataclass(frozen=True)
class SetRegion:
    """Write the region's control block: it holds ``version`` (-1: nothing) with ``progress``
    units final. ``checksums``: the units' checksums when the whole version is in place."""

    version: int
    progress: int
    checksums: Optional[tuple[int, ...]] = None


@dataclasses.dataclass(frozen=True)
class Recheck:
    """Count the leading units of the region (holding ``version``, ``units`` of it) whose bytes
    still match their recorded checksums; answer :class:`Rechecked`."""

    version: int
    units: int


@dataclasses.dataclass(frozen=True)
class Pull:
    """Read ``assignment.version`` from its source, from unit ``start_unit`` to the end; answer
    :class:`Pulled` once every posted read is terminal."""

    assignment: m.Assignment
    start_unit: int


@dataclasses.dataclass(frozen=True)
class Offload:
    """Copy the tensors (holding ``version``) to host memory and serve that copy; answer
    :class:`Offloaded`."""

    version: int


@dataclasses.dataclass(frozen=True)
class DropHost:
    version: int


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How an operation ended well. For reads: ``action`` is ``"replicated"`` or ``"noop"``."""

    action: str = "ok"
    version: int = -1
    sources: tuple[str, ...] = ()
    holders: tuple[str, ...] = ()
    """Reads: every client an assignment named (a resharded read's holder shards too), in order."""
    failovers: int = 0
    start_units: int = 0
    first: Optional[m.Assignment] = None
    was_published: Optional[int] = None
    """unpublish: the version that was published (the driver's mutability check)."""
    in_flight: int = -1
    """Reads: smart skipping chose ``version``; this newer one is still seeding (-1: no skip)."""
    local: bool = False
    """A no-op ``update("latest")`` answered without a call (:mod:`tensorhub.core.handle_view`)."""


@dataclasses.dataclass(frozen=True)
class Done:
    outcome: Outcome


@dataclasses.dataclass(frozen=True)
class Fail:
    """The operation failed with the typed error named ``code``."""

    code: str
    message: str


Command = Union[Send, Reconnect, Sleep, SetRegion, Recheck, Pull, Offload, DropHost, Done, Fail]
AWAITING = (Reconnect, Sleep, Recheck, Pull, Offload)
"""Commands whose answer the machine waits for (and :class:`Send` unless ``fire``)."""


def waits(request: m.Request) -> bool:
    """Whether a request's :class:`Send` waits for its outcome (``wait=True``)."""
    return isinstance(request, (m.Unpublish, m.Replicate, m.SourceFailed, m.OffloadDone))


def is_error(reply: object) -> bool:
    """A reply that ends a request with a typed error."""
    return isinstance(reply, (m.ErrorReply, m.Failed))
