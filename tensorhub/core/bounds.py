"""The bounds of everything a request may carry, and the one check of them.

A reference server keeps what its clients tell it (names, layouts, endpoints, versions) and
labels its metrics with model names, so every value a request carries has a limit. The server
checks each request against them (:func:`check_request`) before its table sees it; the client
checks its own inputs in ``open()``, ``register()`` and ``publish()`` with the same functions,
so a user learns of a bad value at the call that brought it. A value out of bounds raises
:class:`~tensorhub.errors.OutOfBounds` (a request naming another server's model:
:class:`~tensorhub.errors.WrongModel`); nothing is changed.

The bounds (all inclusive):

- names (model, replica, datacenter, machine): 1 to ``NAME_CHARS_MAX`` printable characters
  (datacenter and machine may be empty); a client id or a source id: up to ``CLIENT_ID_CHARS_MAX``;
  a user's replica name leaves ``REPLICA_SUFFIX_CHARS`` for the handle's own suffixes;
- shards: ``1 <= num_shards <= SHARDS_MAX``, ``0 <= shard < num_shards``;
- versions: ``0 <= version <= VERSION_MAX`` (2**53 - 1: exact in a float, as the metrics
  gauges and JSON readers hold it); a spec string at most ``SPEC_CHARS_MAX`` characters;
  replicate round numbers ``0 <= seq <= VERSION_MAX``;
- a layout: a fingerprint of at most ``FINGERPRINT_CHARS_MAX`` characters, ``1 <= unit_count
  <= UNITS_MAX``, ``0 <= total_bytes <= BYTES_MAX``, at most ``TENSORS_MAX`` tensors, each named
  in at most ``TENSOR_NAME_CHARS_MAX`` characters, dtype at most ``NAME_CHARS_MAX``, at most
  ``DIMS_MAX`` dimensions of at most ``BYTES_MAX`` each, ``0 <= nbytes <= BYTES_MAX``;
- a placement (``Register.placement``): at most ``TENSORS_MAX`` global and local tensors, names
  and dtypes and shapes bounded as a layout's, at most ``PIECES_MAX`` pieces per local tensor and
  ``PLACEMENT_PIECES_MAX`` in all, at most ``PIECES_PER_GLOBAL_MAX`` naming one global tensor
  (its overlap check compares them pairwise), boxes of at most ``DIMS_MAX`` dims in
  ``[0, BYTES_MAX]``, at most ``PLACEMENT_BYTES_MAX`` bytes encoded. Its rules (a box inside its
  tensor, pieces tiling the local tensor...) are the core's (:mod:`tensorhub.core.placements`:
  ``LayoutMismatch``);
- an endpoint (one's own or a host copy's): at most ``ENDPOINT_BYTES_MAX`` bytes; a holding
  at most ``HOST_COPIES_MAX`` host copies;
- a pulse: at most ``BEATS_MAX`` beats; unit counts in ``0..UNITS_MAX`` (-1 where "none");
- cell checksums (``CellSums``): at most ``CELLS_MAX`` (a grid's own bound), each cell index
  below it, a checksum of 64 bits; ``FindCells`` of at most ``SHARDS_MAX`` holders;
- a whole encoded request: at most ``REQUEST_BYTES_MAX`` bytes;
- the other way, a ``Newest`` event a handle reads (:func:`check_newest`): versions as above,
  a smart skip's ``ready`` below its ``in_flight``, the newest version not above it;
- a server that serves every model (``server_per_model`` off): at most ``MODELS_MAX`` models.
"""

from __future__ import annotations

from typing import Collection, Optional

import msgspec

from tensorhub.core import messages as m
from tensorhub.core.grid import CELLS_MAX
from tensorhub.errors import OutOfBounds, WrongModel
from tensorhub.placement import Placement

NAME_CHARS_MAX = 256
CLIENT_ID_CHARS_MAX = 1024
REPLICA_SUFFIX_CHARS = 16
SHARDS_MAX = 4096
VERSION_MAX = 2**53 - 1
SPEC_CHARS_MAX = 32
FINGERPRINT_CHARS_MAX = 256
UNITS_MAX = 1 << 24
BYTES_MAX = 1 << 50
TENSORS_MAX = 1 << 18
TENSOR_NAME_CHARS_MAX = 1024
DIMS_MAX = 16
ENDPOINT_BYTES_MAX = 16 << 20
HOST_COPIES_MAX = 64
BEATS_MAX = 1 << 16
REQUEST_BYTES_MAX = 64 << 20
MODELS_MAX = 1024
PROCESS_FIELD_CHARS_MAX = 256
PIECES_MAX = 1 << 12
PLACEMENT_PIECES_MAX = 1 << 18
PIECES_PER_GLOBAL_MAX = 64
PLACEMENT_BYTES_MAX = 16 << 20


def check_name(what: str, value: object, *, max_chars: int = NAME_CHARS_MAX, empty_ok: bool = False) -> None:
    """``value`` is a str of printable characters, non-empty unless ``empty_ok``, at most
    ``max_chars`` long."""
    if not isinstance(value, str):
        raise OutOfBounds(f"{what} must be a str, got {type(value).__name__}")
    if not value and not empty_ok:
        raise OutOfBounds(f"{what} must not be empty")
    if len(value) > max_chars:
        raise OutOfBounds(f"{what} has {len(value)} characters, more than {max_chars}")
    if not value.isprintable():
        raise OutOfBounds(f"{what} {value[:40]!r} has non-printable characters")


def check_int(what: str, value: object, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise OutOfBounds(f"{what} must be an int in [{lo}, {hi}], got {value!r:.40}")


def check_version(what: str, value: object, *, unset_ok: bool = False) -> None:
    """A version number: ``0..VERSION_MAX`` (-1 also, where it means "none")."""
    check_int(what, value, -1 if unset_ok else 0, VERSION_MAX)


def check_newest(ev: m.Newest) -> None:
    """A ``Newest`` event (the server's, read by a handle): its version ``-1..VERSION_MAX``, and
    its smart-skip state none (``in_flight`` and ``ready`` -1) or ``0 <= ready < in_flight <=
    VERSION_MAX`` with ``version <= in_flight``. The handle takes an event out of bounds as no
    news at all (:func:`tensorhub.core.handle_view.viewed`)."""
    check_version("newest version", ev.version, unset_ok=True)
    check_version("in_flight", ev.in_flight, unset_ok=True)
    check_version("ready", ev.ready, unset_ok=True)
    if (ev.in_flight, ev.ready) == (-1, -1):
        return
    if not 0 <= ev.ready < ev.in_flight or ev.version > ev.in_flight:
        raise OutOfBounds(f"a smart skip of version {ev.in_flight} to {ev.ready} with newest {ev.version}")


def check_spec(spec: object) -> None:
    """A version spec's bounds (its syntax, a negative version included, is
    :func:`tensorhub.core.versions.parse_spec`'s: BadVersionSpec)."""
    if isinstance(spec, str) and len(spec) > SPEC_CHARS_MAX:
        raise OutOfBounds(f"a version spec has {len(spec)} characters, more than {SPEC_CHARS_MAX}")
    if isinstance(spec, int) and not isinstance(spec, bool) and spec > VERSION_MAX:
        raise OutOfBounds(f"version {spec} is above {VERSION_MAX}")


def check_shards(shard: object, num_shards: object) -> None:
    check_int("num_shards", num_shards, 1, SHARDS_MAX)
    check_int(f"shard of {num_shards}", shard, 0, num_shards - 1)


def check_endpoint(what: str, endpoint: object) -> None:
    if not isinstance(endpoint, bytes) or len(endpoint) > ENDPOINT_BYTES_MAX:
        raise OutOfBounds(f"{what} must be bytes of at most {ENDPOINT_BYTES_MAX}")


def check_layout(layout: m.LayoutInfo) -> None:
    check_name("layout fingerprint", layout.fingerprint, max_chars=FINGERPRINT_CHARS_MAX, empty_ok=True)
    check_int("layout unit_count", layout.unit_count, 1, UNITS_MAX)
    check_int("layout total_bytes", layout.total_bytes, 0, BYTES_MAX)
    if len(layout.tensors) > TENSORS_MAX:
        raise OutOfBounds(f"a layout of {len(layout.tensors)} tensors has more than {TENSORS_MAX}")
    for t in layout.tensors:
        check_name("tensor name", t.name, max_chars=TENSOR_NAME_CHARS_MAX, empty_ok=True)
        check_name(f"dtype of tensor {t.name[:40]!r}", t.dtype)
        if len(t.shape) > DIMS_MAX or any(not 0 <= d <= BYTES_MAX for d in t.shape):
            raise OutOfBounds(f"tensor {t.name[:40]!r}: shape of at most {DIMS_MAX} dims in [0, {BYTES_MAX}]")
        check_int(f"nbytes of tensor {t.name[:40]!r}", t.nbytes, 0, BYTES_MAX)


def _check_shape(what: str, shape: tuple) -> None:
    if len(shape) > DIMS_MAX or any(not 0 <= d <= BYTES_MAX for d in shape):
        raise OutOfBounds(f"{what}: at most {DIMS_MAX} dims in [0, {BYTES_MAX}]")


def check_placement(p: Placement) -> None:
    """The bounds of a placement (see the module docstring): counts first, then its encoded
    size. Its rules are the core's (:meth:`Placement.check`, LayoutMismatch)."""
    for what, items in (("global", p.globals), ("local", p.tensors)):
        if len(items) > TENSORS_MAX:
            raise OutOfBounds(f"a placement of {len(items)} {what} tensors has more than {TENSORS_MAX}")
    for g in p.globals:
        check_name("global tensor name", g.name, max_chars=TENSOR_NAME_CHARS_MAX)
        check_name(f"dtype of global tensor {g.name[:40]!r}", g.dtype)
        _check_shape(f"global tensor {g.name[:40]!r}'s shape", g.shape)
    per_global: dict[str, int] = {}
    total = 0
    for t in p.tensors:
        where = f"local tensor {t.name[:40]!r}"
        check_name("local tensor name", t.name, max_chars=TENSOR_NAME_CHARS_MAX, empty_ok=True)
        check_name(f"dtype of {where}", t.dtype)
        _check_shape(f"{where}'s shape", t.shape)
        if len(t.pieces) > PIECES_MAX:
            raise OutOfBounds(f"{where} has {len(t.pieces)} pieces, more than {PIECES_MAX}")
        total += len(t.pieces)
        if total > PLACEMENT_PIECES_MAX:
            raise OutOfBounds(f"a placement has more than {PLACEMENT_PIECES_MAX} pieces")
        for piece in t.pieces:
            check_name(f"a piece's tensor in {where}", piece.tensor, max_chars=TENSOR_NAME_CHARS_MAX)
            n = per_global[piece.tensor] = per_global.get(piece.tensor, 0) + 1
            if n > PIECES_PER_GLOBAL_MAX:
                raise OutOfBounds(f"more than {PIECES_PER_GLOBAL_MAX} pieces of global tensor {piece.tensor[:40]!r}")
            _check_shape(f"a box start in {where}", piece.box.start)
            _check_shape(f"a box stop in {where}", piece.box.stop)
            check_int(f"a piece's row0 in {where}", piece.row0, 0, BYTES_MAX)
    size = len(msgspec.msgpack.encode(p))
    if size > PLACEMENT_BYTES_MAX:
        raise OutOfBounds(f"a placement of {size} bytes encoded is more than {PLACEMENT_BYTES_MAX}")


def _client_id(what: str, value: object, empty_ok: bool = False) -> None:
    check_name(what, value, max_chars=CLIENT_ID_CHARS_MAX, empty_ok=empty_ok)


def _known_id(what: str, value: object) -> None:
    """An id a request names that the server looks up: bounded in length (its table holds only
    ids a registration checked in full; an unknown one is quoted in the error)."""
    if not isinstance(value, str) or len(value) > CLIENT_ID_CHARS_MAX:
        raise OutOfBounds(f"{what} must be a str of at most {CLIENT_ID_CHARS_MAX} characters")


def _register(reg: m.Register, served: str, models: Collection[str], known_layout) -> None:
    _client_id("client id", reg.client_id)
    check_name("model", reg.model)
    check_model(reg.model, served, models)
    check_name("replica", reg.replica_id)
    check_shards(reg.shard, reg.num_shards)
    if reg.layout != known_layout:  # the shard's layout, checked when it was first registered
        check_layout(reg.layout)
    if reg.placement is not None:
        check_placement(reg.placement)
    check_endpoint("endpoint", reg.endpoint)
    check_name("datacenter", reg.datacenter, empty_ok=True)
    check_name("machine", reg.machine, empty_ok=True)
    _client_id("stage_for", reg.stage_for, empty_ok=True)
    check_name("layout key", reg.layout_key, empty_ok=True)
    if reg.layout_key and reg.placement is None:
        raise OutOfBounds("a layout key names a layout of placements: it needs a placement")
    p = reg.process
    for name in ("job_id", "actor_id", "worker_id", "node_id"):
        check_name(f"process {name}", getattr(p, name), max_chars=PROCESS_FIELD_CHARS_MAX, empty_ok=True)
    check_int("process pid", p.pid, 0, 2**32)


def _holding(h: m.Holding) -> None:
    if h.published is not None:
        check_version("published version", h.published)
    if len(h.host_copies) > HOST_COPIES_MAX:
        raise OutOfBounds(f"{len(h.host_copies)} host copies announced, more than {HOST_COPIES_MAX}")
    for version, endpoint in h.host_copies:
        check_version("host copy version", version)
        check_endpoint("host copy endpoint", endpoint)
    check_version("txn_seq", h.txn_seq, unset_ok=True)
    check_version("txn_version", h.txn_version, unset_ok=True)
    check_version("reading_version", h.reading_version, unset_ok=True)
    _known_id("reading_source", h.reading_source)
    check_int("reading_units", h.reading_units, 0, UNITS_MAX)
    if not isinstance(h.confirmed, bool):
        raise OutOfBounds(f"confirmed must be a bool, got {type(h.confirmed).__name__}")
    if h.confirmed and h.published is None:
        raise OutOfBounds("a confirmed holding names no published version")


def check_model(model: str, served: str, models: Collection[str]) -> None:
    """``model`` may be used on a server that serves ``served`` ("": every model) and already
    knows ``models``."""
    if served and model != served:
        raise WrongModel(f"this server serves model {served[:NAME_CHARS_MAX]!r}, not {model[:NAME_CHARS_MAX]!r}")
    if not served and model not in models and len(models) >= MODELS_MAX:
        raise WrongModel(f"this server already serves {len(models)} models, the most one serves")


def check_request(req: m.Request, served: str = "", models: Collection[str] = (),
                  known_layout: Optional[m.LayoutInfo] = None) -> None:
    """Raise OutOfBounds (or WrongModel) unless every value of ``req`` is within its bound, on a
    server that serves model ``served`` ("": every model) and already knows ``models``.
    ``known_layout``: the layout the server knows for a registration's shard (one equal to it
    was checked when it was first registered: a registration's cost stays independent of its
    tensor count)."""
    match req:
        case m.Heartbeat() | m.Unpublish() | m.ReplicateAbort() | m.Leave():
            _known_id("client id", req.client_id)
        case m.Register():
            _register(req, served, models, known_layout)
        case m.Announce():
            _register(req.register, served, models, known_layout)
            _holding(req.holding)
        case m.Query():
            check_name("model", req.model, empty_ok=True)
            if req.model:
                check_model(req.model, served, (*models, req.model))
        case m.Pulse():
            if len(req.beats) > BEATS_MAX:
                raise OutOfBounds(f"a pulse of {len(req.beats)} beats has more than {BEATS_MAX}")
            for b in req.beats:
                _known_id("client id", b.client_id)
                check_int("reading_units", b.reading_units, -1, UNITS_MAX)
        case _:
            _known_id("client id", req.client_id)
            _fields(req)


def _fields(req: m.Request) -> None:
    """The bounded fields of the requests that act for one known client."""
    match req:
        case m.Publish() | m.ReplicateDone():
            check_version("version", req.version)
        case m.Replicate():
            check_spec(req.spec)
            check_version("seq", req.seq)
            check_version("resume_version", req.resume_version, unset_ok=True)
            check_int("resume_units", req.resume_units, 0, UNITS_MAX)
            check_version("call", req.call)
        case m.Swap():
            _known_id("stage_id", req.stage_id)
            check_version("version", req.version)
            check_spec(req.spec)
            check_endpoint("endpoint", req.endpoint)
        case m.SourceFailed():
            _known_id("source_id", req.source_id)
            check_int("units_done", req.units_done, 0, UNITS_MAX)
        case m.Progress():
            check_int("units_done", req.units_done, 0, UNITS_MAX)
        case m.OffloadDone() | m.HostCopy():
            check_version("version", req.version)
            check_endpoint("endpoint", req.endpoint)
        case m.OfferDelta():
            check_version("version", req.version)
            check_version("base", req.base, unset_ok=True)
            check_endpoint("endpoint", req.endpoint)
            check_int("capacity", req.capacity, 1, 1 << 62)
            check_int("nbytes", req.nbytes, 0 if req.base == -1 else 1, req.capacity)
        case m.FindDelta():
            check_version("version", req.version)
            check_version("base", req.base)
        case m.CellSums():
            check_version("version", req.version)
            check_name("grid", req.grid)
            if len(req.cells) > CELLS_MAX:
                raise OutOfBounds(f"{len(req.cells)} cell checksums, more than {CELLS_MAX}")
            for c in req.cells:
                check_name("global tensor", c.tensor)
                check_int("cell", c.cell, 0, CELLS_MAX - 1)
                check_int("checksum", c.checksum, 0, (1 << 64) - 1)
        case m.FindCells():
            check_version("version", req.version)
            check_name("grid", req.grid)
            if len(req.holders) > SHARDS_MAX:
                raise OutOfBounds(f"cell checksums of {len(req.holders)} holders, more than {SHARDS_MAX}")
            for h in req.holders:
                _known_id("holder", h)
