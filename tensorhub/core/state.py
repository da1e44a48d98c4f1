"""Lifecycle of a holder in the reference table, as one visible table.

A *node* is one shard handle of one replica (a client), or a host-memory copy that a client
serves after a retention offload. Its state says what the server may do with it:

    IDLE        holds nothing visible. May publish, replicate.
    PUBLISHED   a complete holder of ``version``: a source for readers.
    DRAINING    asked to unpublish: hidden from new readers; waits until its in-flight readers
                finish, then IDLE (or OFFLOADING).
    OFFLOADING  drained, but holds the last non-spot copy of a retained version: it copies the
                shard to host memory and publishes that copy before it becomes IDLE.
    WAITING     a reader of ``version`` with no source yet (queued FIFO).
    READING     a reader of ``version`` with a source: a *partial* holder others may read from.

``LEGAL`` lists in which states each request is accepted; any other pairing is an
``InvalidState`` error that changes nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

from tensorhub.core import messages as m
from tensorhub.core.messages import LayoutInfo


class NodeState(enum.Enum):
    IDLE = "idle"
    PUBLISHED = "published"
    OFFLOADING = "offloading"
    DRAINING = "draining"
    WAITING = "waiting"
    READING = "reading"


COMPLETE = frozenset({NodeState.PUBLISHED, NodeState.OFFLOADING, NodeState.DRAINING})
"""States whose node holds every unit of its version."""
SERVABLE = frozenset({NodeState.PUBLISHED, NodeState.OFFLOADING})
"""States whose node serves its version now or is about to publish a host copy of it."""
VISIBLE_SOURCE = frozenset({NodeState.PUBLISHED})
"""Complete states a *new* reader may be assigned to."""

LEGAL: dict[str, frozenset[NodeState]] = {
    "Publish": frozenset({NodeState.IDLE, NodeState.PUBLISHED}),
    "Unpublish": frozenset({NodeState.IDLE, NodeState.PUBLISHED, NodeState.OFFLOADING, NodeState.DRAINING}),
    "Replicate": frozenset({NodeState.IDLE, NodeState.PUBLISHED}),
    "SourceFailed": frozenset({NodeState.WAITING, NodeState.READING}),
    "Progress": frozenset({NodeState.WAITING, NodeState.READING}),
    "ReplicateDone": frozenset({NodeState.WAITING, NodeState.READING}),
    "ReplicateAbort": frozenset({NodeState.WAITING, NodeState.READING, NodeState.DRAINING}),  # draining: an update's old version
    "OffloadDone": frozenset({NodeState.OFFLOADING}),
    "HostCopy": frozenset(NodeState),
    "Heartbeat": frozenset(NodeState),
    "Leave": frozenset(NodeState),
    "Swap": frozenset({NodeState.IDLE, NodeState.PUBLISHED}),  # published: only the same swap again (ReadRequests.on_Swap)
    "OfferDelta": frozenset({NodeState.PUBLISHED}),  # of the version it publishes (Deltas.on_offer)
    "FindDelta": frozenset(NodeState),
    "CellSums": frozenset(NodeState),  # of the version it (or its host copy) holds whole: Cells.on_sums
    "FindCells": frozenset({NodeState.READING}),  # of the holders it reshards from (Cells.on_find)
}


@dataclasses.dataclass
class Node:
    id: str
    model: str
    replica_id: str
    shard: int
    num_shards: int
    datacenter: str
    spot: bool
    layout: LayoutInfo
    endpoint: bytes
    order: int
    """Registration order: the last tie-breaker, so decisions are deterministic."""
    last_seen: float = 0.0
    """Heard from at this time, for its lease: a request of its own, or a held pulse (``touch``)."""
    heard_at: float = 0.0
    """Its process's last request of its own: proof it was alive then. A held pulse proves
    nothing (a process that died without Ray knowing yet is held the same), so retention's
    "another live copy" counts this, not ``last_seen``."""
    host: bool = False
    owner: Optional[str] = None
    """For a host copy: the client that serves it (it lives and dies with that client)."""
    machine: str = ""
    """The host it runs on (a host copy: its owner's)."""
    stage_for: str = ""
    """A prefetch staging copy: the handle it stages for (``Register.stage_for``)."""
    layout_key: str = ""
    """The name its registration gave its replica's layout (``Register.layout_key``)."""
    placement: str = ""
    """The digest of its interned placement ("": none, today's identical layout; a host copy:
    its owner's): :mod:`tensorhub.core.placements`."""
    in_flight: int = -1
    """Smart skipping chose this node's current read/version: this newer one was seeding."""
    round_seq: int = -1
    """The replicate round this node's current read belongs to (sharded replicas)."""
    answered: Optional[tuple[int, Any]] = None
    """(call, reply) of this client's last numbered ``Replicate`` (``Replicate.call``) that got a
    final answer (``NoChange`` or an error its handle does not retry in the same call): that
    request again gets the same answer (:meth:`tensorhub.core.reference.ReferenceCore.handle`)."""
    copy_asked: int = -1
    """The version this holder was asked to copy to host memory ahead (MakeHostCopy)."""
    retains: bool = True
    """``Register.retains``: False, it never keeps a retention copy."""

    state: NodeState = NodeState.IDLE
    version: int = -1
    progress: int = 0
    source: Optional[str] = None
    reshard_from: tuple[str, ...] = ()
    """A resharded read (its source is another layout class): the holder shards it reads from,
    each listing it among its readers; ``source`` is the first of them."""
    readers: set[str] = dataclasses.field(default_factory=set)
    stamp: int = 0
    """FIFO position of a WAITING reader (kept across reassignments: no starvation)."""
    assign_no: int = 0
    suspects: set[str] = dataclasses.field(default_factory=set)
    suspected_at: Optional[float] = None
    """A reader reported this node failed at this time; it must heartbeat again to stay."""
    process: m.ProcessId = m.ProcessId()
    """Who runs this client (the server asks the cluster manager whether it is gone)."""
    unreachable: bool = False
    """A reader could not reach this node at all; no reader is sent to it until it talks to the
    server again (or it is found dead)."""
    failed_gone: bool = False
    """This reader's last reported source was removed as dead: say so in its next assignment."""
    failure: Optional[m.Failed] = None
    """The last read of this node failed with this (answered to late follow-ups of that read)."""
    awaiting_source: Optional[str] = None
    """Announced after a restart as reading from this source, which has not announced yet."""
    unconfirmed: Optional[tuple[int, int]] = None
    """(round, version): this holder's completion was announced after a restart without the old
    server's confirmation (``Holding.confirmed``); a sibling's confirmed conflicting completion
    of that round demotes it."""
    pending_read: Optional[tuple[int, int]] = None
    """update(): (version, resume_units) to read once the drain of the old version ends."""
    proof_until: Optional[float] = None
    """A drained holder waits until then for the holders of its version's other copies, whose
    pulses are held, to prove they are alive (``Probe``) before it skips the offload; then it
    offloads."""
    indexed: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)
    """What the core's index (``tensorhub.core.index``) last recorded for this node."""

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.model, self.version, self.shard)

    @property
    def complete(self) -> bool:
        return self.state in COMPLETE

    @property
    def keeps_copies(self) -> bool:
        """Whether its copy counts toward retention and it may keep a retention copy: not spot,
        not ``retains=False``."""
        return not self.spot and self.retains

    @property
    def units(self) -> int:
        return self.layout.unit_count


class ModelRecord:
    """What the table keeps per model besides its nodes: shard count, layouts, committed
    versions, retention's floor and cross-datacenter seeding state."""

    def __init__(self, name: str, num_shards: int) -> None:
        self.name = name
        self.num_shards = num_shards
        self.layouts: dict[int, m.LayoutInfo] = {}
        self.layout_key = ""
        """A layout class's key: the first ``Register.layout_key`` among its registrations ("" none)."""
        self.committed: list[int] = []  # ascending
        self.forgotten_below = 0  # versions under this are past retention
        self.origin_dc: dict[int, str] = {}
        """The datacenter of the replica that committed each version (cross-DC reads from there)."""
        self.seed_asked: dict[str, tuple[int, str, float]] = {}
        """Offload seeding: per datacenter, (version, replica, when) last asked to seed it;
        replica "" once the datacenter has (or reads) that version."""
        self.prefetch_told: dict[str, int] = {}
        """``prefetch_in_datacenter``: per datacenter, the newest version its replicas were told
        to prefetch (``PrefetchAhead``), so that each seed is announced there once."""
