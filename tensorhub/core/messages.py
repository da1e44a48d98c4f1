"""Every message that crosses a process boundary, in one place.

Requests go client -> reference server; replies come back on the same call; *events* are
delivered later to one client by an effect of the core (``Deliver``): an assignment that had to
wait for a free source, a finished drain, an offload order, a failure. All are frozen
``msgspec.Struct`` types tagged by class name, so one decoder reads any of them.
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec

from tensorhub.placement import GlobalTensor, Placement

VersionSpec = Union[int, str]
"""An int >= 0, ``"latest"`` or ``"latest-k"``."""


class _Msg(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    pass


# --------------------------------------------------------------------------- shared types


class TensorMeta(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class LayoutInfo(msgspec.Struct, frozen=True):
    """What the server needs to know of a shard's layout: the fingerprint it compares, the unit
    count that defines "complete", and the tensor list to name the first difference."""

    fingerprint: str
    unit_count: int
    total_bytes: int
    tensors: tuple[TensorMeta, ...] = ()


class Holding(msgspec.Struct, frozen=True):
    """What a client tells a fresh server it holds (re-announcement after a server restart)."""

    published: Optional[int] = None
    host_copies: tuple[tuple[int, bytes], ...] = ()
    """(version, endpoint) of host-memory copies this client serves."""
    txn_seq: int = -1
    txn_version: int = -1
    reading_version: int = -1
    """A read in progress: the version being received, from whom, and how far it got."""
    reading_source: str = ""
    reading_units: int = 0
    confirmed: bool = False
    """``published`` was confirmed by a server (its ``Publish``/``ReplicateDone`` got ``Ok``).
    False (the default, and what a handle sends when its ``ReplicateDone`` met a restart): a
    completion only the client saw; the fresh server refuses it if it conflicts with a sibling
    shard's completion of the same round, and demotes it (:class:`Demoted`) if a confirmed
    conflicting completion of a sibling is announced after it. Only with ``published``."""


class ProcessId(msgspec.Struct, frozen=True):
    """Who runs a client, as the cluster manager knows it (Ray: job, actor, worker, node ids;
    empty strings where not applicable, e.g. no actor for a driver). The server asks the cluster
    manager whether this process is gone, so a dead holder stops being a source at once instead
    of after a lease."""

    job_id: str = ""
    actor_id: str = ""
    worker_id: str = ""
    node_id: str = ""
    pid: int = 0


# --------------------------------------------------------------------------- requests


class Register(_Msg, frozen=True):
    client_id: str
    model: str
    replica_id: str
    shard: int
    num_shards: int
    layout: LayoutInfo
    endpoint: bytes = b""
    datacenter: str = "default"
    spot: bool = False
    retains: bool = True
    """False: this client never keeps a retention copy (a host copy of a retained version), and
    its copies do not count toward retention: other holders (the trainer) keep retained versions.
    Like ``spot`` for retention only: a rollout engine whose memory is for serving."""
    process: ProcessId = ProcessId()
    machine: str = ""
    """The host this client runs on ("" unknown): a reader gets a source on its own host first
    (the same-host tier copies memory directly)."""
    stage_for: str = ""
    """A prefetch staging copy: the client id of the handle it stages versions for (that handle
    reads from it first, whatever its load: a copy inside one process)."""
    placement: Optional[Placement] = None
    """Which part of which global tensor each of ``layout.tensors`` holds (docs/placements.md);
    None (the default, not encoded): today's identical per-shard layout. Its local tensors are
    ``layout.tensors`` (names, dtypes, shapes, order). The server checks it and keeps one copy
    per distinct :meth:`~tensorhub.placement.Placement.digest` (:mod:`tensorhub.core.placements`)."""
    layout_key: str = ""
    """With a placement: a name the client gives its replica's whole layout (e.g. ``"vllm-tp2"``),
    the same in every replica of that layout. Replicas that give one key share one layout class
    however their shards' registrations interleave (:meth:`~tensorhub.core.placements.Placements.class_of`);
    "" (the default): the class is found by fit."""

    def __repr__(self) -> str:
        # A placement may hold thousands of pieces: its digest stands for it; none, nothing shown
        # (a registration without one reads as it did before placements existed).
        shown = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__ if f != "placement")
        if self.placement is not None:
            shown += f", placement=<{self.placement.digest()[:16]}>"
        return f"Register({shown})"


class Announce(_Msg, frozen=True):
    """Register again after a server restart, with what this client holds."""

    register: Register
    holding: Holding


class Heartbeat(_Msg, frozen=True):
    client_id: str


class Beat(msgspec.Struct, frozen=True, array_like=True):
    """One handle's share of a :class:`Pulse`: a ``Heartbeat`` or, while it reads
    (``reading_units >= 0``), a ``Progress`` with its verified units."""

    client_id: str
    reading_units: int = -1
    acked: int = -1
    """The newest background event this handle has taken (``PulseReply.acks``); its server keeps
    every later one until a beat acknowledges it, so a reply lost on the way loses no event. -1:
    no acknowledgements (events are handed out once)."""


class Pulse(_Msg, frozen=True):
    """The liveness of every handle of one process on this server (one call, however many
    handles): each handle's heartbeat or read progress. Sent with ``wait_s`` > 0, an idle
    process's pulse is held by the server (``Config.pulse_hold_s``, :class:`tensorhub.server.requests.PulseHolds`). The reply
    (:class:`PulseReply`) carries the handles the server does not know and the background events
    waiting for each handle, so there is no separate ``notes`` poll."""

    beats: tuple[Beat, ...]


class Publish(_Msg, frozen=True):
    client_id: str
    version: int


class Unpublish(_Msg, frozen=True):
    client_id: str


class Replicate(_Msg, frozen=True):
    """Ask for a source of ``spec``. ``seq`` numbers this shard's replicate rounds (the client
    counts them); shards of one replica with equal ``seq`` form one transaction. ``update=True``
    makes it atomic: no-op when already published at the resolved version, else drain and
    unpublish the current version first. ``resume_version``/``resume_units`` say how much of a
    version this client already has in place (after a failure), so the read resumes there.
    ``call`` numbers the client's replicate calls (0: unnumbered): a request the server answered
    for good comes back (a duplicate in transit, a resend after a lost reply) with the same
    ``call`` and gets the same answer; a new call of the same round has a new one."""

    client_id: str
    spec: VersionSpec = "latest"
    seq: int = 0
    update: bool = False
    resume_version: int = -1
    resume_units: int = 0
    call: int = 0


class SourceFailed(_Msg, frozen=True):
    """The reader's source died, stalled or served bad bytes; ``units_done`` is its own progress.
    ``unreachable``: the reader could not reach the source at all (connection refused, agent
    unknown): strong evidence that its process is gone."""

    client_id: str
    source_id: str
    units_done: int
    unreachable: bool = False


class Progress(_Msg, frozen=True):
    client_id: str
    units_done: int


class ReplicateDone(_Msg, frozen=True):
    client_id: str
    version: int


class Swap(_Msg, frozen=True):
    """A handle takes over the memory of its prefetch staging copy instead of copying it (a
    double buffer, :meth:`tensorhub.Hub.register`): the two exchange endpoints, the handle then
    publishes the staging copy's ``version`` and the staging copy holds nothing. Refused
    (``InvalidState``, nothing changed) unless ``stage_id`` is this handle's staging copy, holds
    ``version`` complete and has no reader, this unsharded handle holds and reads nothing, and
    ``spec`` resolves to ``version`` now.

    ``endpoint``: the staging copy's endpoint, which the handle takes over. A handle that got no
    answer (the reply lost, the call timed out while the server was slow) sends the same swap
    again; a server that made it already recognises it by this endpoint (the handle publishes
    ``version`` from it) and answers ``Ok`` again, so the handle learns the outcome before it
    touches either set of tensors."""

    client_id: str
    stage_id: str
    version: int
    spec: VersionSpec = "latest"
    endpoint: bytes = b""


class ReplicateAbort(_Msg, frozen=True):
    """The reader gives up (bad bytes it cannot fix, user cancel); it holds nothing now."""

    client_id: str


class OffloadDone(_Msg, frozen=True):
    client_id: str
    version: int
    endpoint: bytes


class HostCopy(_Msg, frozen=True):
    """A holder copied its ``version`` to host memory in the background (after ``MakeHostCopy``:
    retention made ahead, off the readers' critical path): serve it as a host copy. Answered
    ``Ok``; a copy the server does not need (one exists, or the version is past retention, or no
    longer published by this client) is given back with a ``DropHostCopy`` event."""

    client_id: str
    version: int
    endpoint: bytes


class OfferDelta(_Msg, frozen=True):
    """A publisher of ``version`` holds its delta against ``base`` (:mod:`tensorhub.transport.
    delta`) in a registered buffer at ``endpoint`` (``capacity`` bytes, the delta the first
    ``nbytes``; its control block says ``version`` while it is valid), for a seeder whose staging
    copy holds ``base`` (``Config.seed_deltas``). Answered ``Ok``; the server keeps the newest
    offer per (model, shard), forgets it when the offering client leaves. ``base`` -1 (and
    ``nbytes`` 0): no delta of this version (the publisher holds no older one), but one of each
    version after it will be offered (seeders of the next version wait for it: ``DeltaPending``)."""

    client_id: str
    version: int
    base: int
    endpoint: bytes
    nbytes: int
    capacity: int


class FindDelta(_Msg, frozen=True):
    """Where a delta of ``version`` against ``base`` is offered for this client's shard
    (:class:`DeltaAt`); ``VersionNotFound`` if none is."""

    client_id: str
    version: int
    base: int


class CellSum(msgspec.Struct, frozen=True, array_like=True):
    """One cell's checksum (:mod:`tensorhub.gridsums`): global tensor, cell index in its grid."""

    tensor: str
    cell: int
    checksum: int


class CellSums(_Msg, frozen=True):
    """A holder's cell checksums of ``version`` over grid ``grid`` (the key of the placements a
    :class:`HashCells` named: :func:`tensorhub.core.cells.grid_key`), the cells it holds. Accepted
    only from a client asked for them that holds ``version`` whole now. ``host``: the cells of
    the client's host copy of ``version`` (asked by a ``HashCells`` with ``host``)."""

    client_id: str
    version: int
    grid: str
    cells: tuple[CellSum, ...]
    host: bool = False


class FindCells(_Msg, frozen=True):
    """A resharding reader asks for the cell checksums of ``version`` over ``grid`` of the
    holder shards it read (:class:`CellsAt`)."""

    client_id: str
    version: int
    grid: str
    holders: tuple[str, ...]


class Leave(_Msg, frozen=True):
    """Leave the server. Refused with ``LastCopyHeld`` when this client serves the last live
    non-spot copy of a retained version and other clients of the model remain, unless
    ``drop_last_copy``."""

    client_id: str
    drop_last_copy: bool = False


class Query(_Msg, frozen=True):
    """Ask for what a reader needs of a model (:class:`Status`): its shard count, available and
    retained versions and, with ``layouts``, its shard layouts (:attr:`ModelView.layouts`, e.g.
    for a reader that allocates its buffer from them). A server answers it without holders (no
    client id: docs/security.md); the whole table is its operator view (the actor's
    ``status()``, :func:`tensorhub.auth.Gate.operator_view`)."""

    model: str = ""
    layouts: bool = False


Request = Union[
    Register, Announce, Heartbeat, Publish, Unpublish, Replicate, SourceFailed, Progress,
    ReplicateDone, ReplicateAbort, OffloadDone, HostCopy, Leave, Query, Swap, Pulse, OfferDelta, FindDelta,
    CellSums, FindCells,
]


class Signed(_Msg, frozen=True):
    """A request with the credentials of the clients it acts for (docs/security.md;
    :mod:`tensorhub.auth`). The client's port wraps every request in one; the server checks it
    and hands only ``request`` on, so the core never sees a secret.

    ``caps``: client id -> capability, for every client the request acts for (its
    ``client_id``; a ``Register``'s ``stage_for``; a ``Swap``'s ``stage_id``; each beat of a
    ``Pulse``). ``model_proof``: for a ``Register`` or ``Announce`` to a server created with a
    model secret, ``HMAC-SHA256(secret, "tensorhub register" | client id | capability)``
    (:func:`tensorhub.auth.register_proof`). The repr shows neither."""

    request: Request
    caps: dict[str, bytes] = {}
    model_proof: bytes = b""

    def __repr__(self) -> str:
        return f"Signed({self.request!r}, caps=<{len(self.caps)} hidden>)"


# --------------------------------------------------------------------------- replies and events


class Ok(_Msg, frozen=True):
    pass


class DeltaAt(_Msg, frozen=True):
    """The answer to :class:`FindDelta`: the offer (:class:`OfferDelta`) of ``source_id``."""

    source_id: str
    endpoint: bytes
    nbytes: int
    capacity: int


class CellsAt(_Msg, frozen=True):
    """The answer to :class:`FindCells`: the cell checksums of the holders that sent theirs,
    merged; ``missing``: holders asked that have not sent them yet (ask again); ``gone``: holders
    that no longer hold the version whole (read those shards elsewhere)."""

    cells: tuple[CellSum, ...] = ()
    missing: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()


class Registered(_Msg, frozen=True):
    """Register accepted. ``round_seq``: the newest replicate round of this client's replica the
    server knows (a restarted shard continues its siblings' count from there)."""

    round_seq: int = 0
    proof: bytes = b""
    """From a server created with a model secret: ``HMAC-SHA256(secret, "tensorhub server" |
    client id | capability)``, so the client knows the server it registered with holds the
    model's secret (:func:`tensorhub.auth.server_proof`); empty without one."""


class ErrorReply(_Msg, frozen=True):
    code: str
    message: str
    retry_after_s: float = 0.0
    """``ServerBusy``: how long the client should wait before it asks again (0: not set)."""


class ReshardSource(msgspec.Struct, frozen=True, array_like=True):
    """One holder shard a resharded read takes bytes from: its shard, client, endpoint and the
    digest of its placement (the placement itself is in the assignment's ``placements``)."""

    shard: int
    client_id: str
    endpoint: bytes
    placement: str


class Assignment(_Msg, frozen=True):
    """Read ``version`` of this shard from ``source_id`` starting at unit ``start_unit``.
    ``assign_no`` grows with every assignment to this client; a client ignores an older one.

    A *resharded* read (``reshard`` not empty; docs/placements.md): the version's holder replica
    is of another layout class; the reader plans the byte ranges from its own placement and the
    holder shards' (``plan_reshard``, ``spread`` = its shard) and reads them from every shard
    named in ``reshard`` (``source_id`` is the first of them); ``placements`` holds each distinct
    holder placement once. ``start_unit`` counts units of the reader's own layout done."""

    version: int
    source_id: str
    source_endpoint: bytes
    source_partial: bool
    start_unit: int
    assign_no: int
    cross_datacenter: bool = False
    in_flight: int = -1
    """As in :class:`NoChange`: the version was chosen by smart skipping, this one is seeding."""
    failed_source_gone: bool = False
    """This assignment follows a ``SourceFailed`` whose source the server has removed as dead: the
    failure says nothing about the data path, so the reader does not count it against its budget."""
    reshard: tuple[ReshardSource, ...] = ()
    placements: tuple[Placement, ...] = ()

    def __repr__(self) -> str:
        # Without the reshard fields when empty, as it read before they existed.
        shown = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__
                          if f not in ("reshard", "placements") or getattr(self, f))
        return f"Assignment({shown})"


class NoChange(_Msg, frozen=True):
    """update(): already published at the resolved version. ``in_flight``: smart skipping
    answered the newest version complete in the reader's datacenter because this newer one is
    still being seeded into it (-1: no skip)."""

    version: int
    in_flight: int = -1


class Waiting(_Msg, frozen=True):
    """Accepted; the outcome arrives later as an event (an Assignment, UnpublishDone, Failed)."""

    version: int = -1


class UnpublishDone(_Msg, frozen=True):
    version: int


class OffloadOrder(_Msg, frozen=True):
    """Copy the shard of ``version`` to host memory and answer with OffloadDone before the
    unpublish (or update) can go on: this client holds the last non-spot copy of a retained version."""

    version: int


class MakeHostCopy(_Msg, frozen=True):
    """Background: copy ``version`` (which this client just finished reading and now holds) to
    host memory while idle, and offer it with ``HostCopy``: the version's retention copy, made
    ahead by a reader -- off every critical path, and outside the trainer's process, so that a
    trainer that dies takes only the newest version with it. A client may ignore it (the last
    holder then offloads when it leaves the version)."""

    version: int


class HashCells(_Msg, frozen=True):
    """Background: a reader of another layout reads ``version`` from this holder (a resharded
    read): compute the cell checksums of the cells this holder holds over the grid of
    ``placements`` (:func:`tensorhub.core.grid.grid_of`; ``grid`` is its key) and send them
    (:class:`CellSums`) while it still holds ``version``. The reader checks what it read with them.
    ``host``: the reader reads this client's host copy of ``version`` (laid out as the client's
    own tensors): hash that copy while it keeps it."""

    version: int
    grid: str
    placements: tuple[Placement, ...]
    host: bool = False


class Probe(_Msg, frozen=True):
    """Background: the server needs proof that this client's process is alive. Its pulse is
    held (which proves nothing: a process that died without Ray knowing yet looks the same),
    and the last live copy of a retained version rests on it. The event answers the held pulse;
    the next pulse is the proof. Nothing else to do."""


class SeedAhead(_Msg, frozen=True):
    """Background (offload seeding): receive ``version`` into a staging copy now
    (:meth:`tensorhub.Hub.prefetch`), while the registered tensors keep serving the
    current one. Sent to one replica per remote datacenter when a version is committed, so the
    one cross-datacenter copy starts at once; the datacenter's other readers then read it there.
    A client may ignore it (the first reader to ask then seeds, in its own update)."""

    version: int


class PrefetchAhead(_Msg, frozen=True):
    """Background (offload seeding, ``Config.prefetch_in_datacenter``): ``version`` is arriving
    in this client's datacenter -- every shard of it has a holder there, the asked seeder's
    staging copy at least, a partial one -- so receive it into a staging copy now, from there
    (:meth:`tensorhub.Hub.prefetch`; the scheduler keeps the read inside the datacenter, behind
    the seed), and the next ``update()`` is a local copy or a swap. Sent once per version to
    every other whole replica registered in a datacenter that a ``SeedAhead`` seeds. Never a
    delta (those are for the slow link). A client may ignore it (its update then reads the
    seed inside the datacenter, as before)."""

    version: int


class Newest(_Msg, frozen=True):
    """Background: the model's newest readable version is now ``version`` (-1: none): a commit
    made a newer one readable, or the newest was withdrawn (lost, past retention, its last
    holder of some shard gone). Sent to every handle of the model when it changes, and to a
    handle when it registers; a handle that publishes it answers ``update("latest")`` locally
    while what it knows is fresh (``Config.noop_staleness_s``, :mod:`tensorhub.core.handle_view`).

    With it, for a model of unsharded replicas, smart skipping's state in the handle's
    datacenter (``Config.smart_skipping``):
    ``in_flight`` (>= ``version``) is still on its way into that datacenter and ``ready``
    (``0 <= ready < in_flight``) is the newest version complete there, so a handle that
    publishes ``ready`` answers ``update("latest")`` locally as a skip of ``in_flight``, as the
    server would; both -1: no skip (the seed landed, nothing seeds, or the server does not
    tell). Sent again to the datacenter's handles whenever that state changes, the seed's
    landing included. Bounds: :func:`tensorhub.core.bounds.check_newest`."""

    version: int
    in_flight: int = -1
    ready: int = -1

    def __repr__(self) -> str:
        # Without the skip when there is none, as it read before it existed.
        skip = f", in_flight={self.in_flight}, ready={self.ready}" if self.in_flight >= 0 or self.ready >= 0 else ""
        return f"Newest(version={self.version}{skip})"


class DropHostCopy(_Msg, frozen=True):
    """A host copy of ``version`` is no longer needed (past retention); free it."""

    version: int


class Failed(_Msg, frozen=True):
    """The server failed this client's read (an outcome, and a background event)."""

    code: str
    message: str
    version: int = -1
    """The version the failed read was reading (-1: not said). A note can arrive after its read
    ended and the call began another: the handle takes it only for the read of that version."""


class Evicted(_Msg, frozen=True):
    """The server removed this client (lease expired, or a sibling shard of its replica died)."""

    reason: str


class Demoted(_Msg, frozen=True):
    """This client's announced (unconfirmed) completion of ``version`` lost to a sibling shard's
    confirmed completion of another version in the same round: the server holds it as idle now;
    the handle drops its published version (a background event)."""

    version: int
    reason: str


class HolderView(_Msg, frozen=True):
    """One node of the server's table as ``status()`` shows it. ``progress``: units done as
    the server last heard (a reader reports them with each heartbeat, at a failover and at the
    end of its read).
    ``source``: the client id a reader reads from ("" when it reads from nobody). ``units`` and
    ``total_bytes``: the shard layout's unit count and size (0 from a server older than them)."""

    client_id: str
    replica_id: str
    shard: int
    datacenter: str
    spot: bool
    host: bool
    state: str
    version: int
    progress: int
    readers: int
    source: str = ""
    units: int = 0
    total_bytes: int = 0


class ShardLayout(msgspec.Struct, frozen=True):
    """The layout the model's clients registered for shard ``shard`` (the first one fixes it)."""

    shard: int
    layout: LayoutInfo


class PlacementUse(msgspec.Struct, frozen=True, array_like=True):
    """One distinct placement a model's clients registered: its digest and how many of them use it."""

    digest: str
    nodes: int


class ModelView(_Msg, frozen=True):
    model: str
    num_shards: int
    available: tuple[int, ...]
    committed: tuple[int, ...]
    holders: tuple[HolderView, ...]
    layouts: tuple[ShardLayout, ...] = ()
    """Known shard layouts in shard order; only when the :class:`Query` asked for them."""
    placements: tuple[PlacementUse, ...] = ()
    """The model's distinct placements by digest (empty, not encoded, when none registered one)."""
    publishing: tuple[int, ...] = ()
    """Versions some shard of the class publishes that it does not hold whole (a sharded replica
    part way through publishing one: its other shards have not yet), ascending. A trainer rank
    restarted alone joins the version its peers publish (:mod:`tensorhub.integrations.vllm`)."""
    schema: tuple[GlobalTensor, ...] = ()
    """The model's global tensors (sorted by name), the union of its placements': only when the
    :class:`Query` asked for layouts and some client registered a placement. A reader derives its
    own placement from it whatever the shards that hold it (e.g. a vLLM engine from an FSDP
    trainer: :mod:`tensorhub.integrations.vllm`)."""

    def __repr__(self) -> str:
        # Without placements, as it read before they existed.
        shown = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__
                          if f not in ("placements", "schema") or getattr(self, f))
        return f"ModelView({shown})"


class Status(_Msg, frozen=True):
    models: tuple[ModelView, ...]


Event = Union[Assignment, UnpublishDone, OffloadOrder, DropHostCopy, MakeHostCopy, SeedAhead, PrefetchAhead, Probe,
              Failed, Evicted, Demoted, Newest, HashCells]


class PulseReply(_Msg, frozen=True):
    """The answer to a :class:`Pulse`: handles the server does not know (expired, or the server
    restarted: they announce again), and per handle the background events it had waiting."""

    unknown: tuple[str, ...] = ()
    notes: dict[str, list[Event]] = {}
    acks: dict[str, int] = {}
    """Per handle in ``notes``: the number of its newest event there (the next beat's ``acked``)."""
    held_s: float = 0.0
    """How long the server held the pulse before this answer (0: answered on arrival). The
    answer left at least this long after the pulse was sent, so what it brings is current as of
    the pulse's sending plus ``held_s`` on the handle's clock (``Viewed``)."""
    view_s: float = 0.0
    """For how long after that what this answer brings may serve local no-op answers
    (``update("latest")``: the server's ``noop_staleness_s``; 0: not at all, e.g. a server
    older than them, or one inside its recovery window)."""

    def __repr__(self) -> str:
        # Without held_s when not held, as it read before it existed.
        shown = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__
                          if f not in ("held_s", "view_s") or getattr(self, f))
        return f"PulseReply({shown})"


Reply = Union[Ok, Registered, ErrorReply, Assignment, NoChange, Waiting, UnpublishDone, Status, PulseReply, DeltaAt,
              CellsAt]


class Deliver(msgspec.Struct, frozen=True):
    """Effect: send ``event`` to ``client_id``."""

    client_id: str
    event: Event


_REQ_DECODER = msgspec.msgpack.Decoder(Union[Request, Signed])
_ANY_DECODER = msgspec.msgpack.Decoder(Union[
    Ok, Registered, ErrorReply, Assignment, NoChange, Waiting, UnpublishDone, Status, OffloadOrder,
    DropHostCopy, MakeHostCopy, SeedAhead, PrefetchAhead, Probe, Failed, Evicted, Demoted, Newest, PulseReply, DeltaAt,
    CellsAt, HashCells,
])
_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _ENCODER.encode(msg)


def decode_request(data: bytes) -> Union[Request, Signed]:
    """Decode a request, bare or :class:`Signed`."""
    return _REQ_DECODER.decode(data)


def decode_reply(data: bytes):
    """Decode a reply or an event."""
    return _ANY_DECODER.decode(data)
