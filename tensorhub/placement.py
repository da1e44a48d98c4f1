"""Placements: which part of which global tensor each local tensor of a handle holds.

Stage 1 of issue 24 (any layout to any layout): the data model and its checks. Nothing on the
data path uses it yet; :mod:`tensorhub.core.reshard` plans byte copies between two placements.

A model has a logical *schema*: its global tensors (:class:`GlobalTensor`: name, dtype name,
global shape). A handle holds *local* tensors; its :class:`Placement` says, for each local tensor
(:class:`LocalPlacement`), which :class:`Box` of which global tensor(s) it holds. The rules:

1. A local tensor is the concatenation along its dim 0 of its pieces, in order: piece ``i``
   occupies local rows ``[row0, row0 + rows)`` and the next piece starts where it ends; the last
   ends at ``shape[0]``. A plain piece's rows are its box's dim 0 and its box's other dims are
   the local tensor's other dims (a row or column split, the whole tensor, ``q`` rows of a fused
   ``qkv``). A *stacked* piece (``stack=True``) is one local row whose remaining dims are its whole
   box (MoE experts stacked along a new leading dim). A 0-d local tensor has one plain 0-d piece.
2. So every piece is one C-contiguous block of its box's shape inside its local tensor, starting
   at byte ``row0 * row_bytes``: the planner needs nothing more.
3. A local tensor has its global tensors' dtype. A dtype conversion is not a reshard: a piece of
   a global tensor of another dtype is refused.
4. Inside one handle, two pieces of one global tensor either hold disjoint boxes or the same box
   (a replica of it, e.g. tied embeddings); a partial overlap is refused.
5. Boxes lie inside their global tensor's shape. A replica's shards together cover every global
   tensor (:func:`coverage` names what is missing; replication across shards is allowed).
6. Two placements that name one global tensor agree on its dtype and shape (:func:`merge_schemas`).

Every bad placement raises :class:`~tensorhub.errors.LayoutMismatch` naming the local and global
tensor; nothing is changed. The types are frozen ``msgspec`` structs with no torch in them, so
they cross processes and ``tensorhub.core`` may import them; :meth:`Placement.digest` is stable
across processes so a server can keep one copy per distinct placement. Only
:func:`dtensor_placement` touches torch objects, by duck typing (no torch import here).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import msgspec
import xxhash

from tensorhub.errors import LayoutMismatch

__all__ = [
    "Box",
    "GlobalTensor",
    "LocalPlacement",
    "Piece",
    "Placement",
    "Schema",
    "check_coverage",
    "concat",
    "coverage",
    "dtensor_box",
    "dtensor_placement",
    "from_dtensor",
    "fused",
    "itemsize",
    "merge_schemas",
    "split",
    "split_box",
    "split_sizes",
    "stacked",
    "whole",
    "whole_placement",
]

ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "complex64": 8, "complex128": 16, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "bool": 1,
}
"""Bytes per element of every dtype name :mod:`tensorhub.layout` can move (torch attribute names)."""


def itemsize(dtype: str) -> int:
    """Bytes per element of the dtype called ``dtype`` (``"bfloat16" -> 2``); LayoutMismatch if unknown."""
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise LayoutMismatch(f"unsupported dtype {dtype!r}") from None


def _digest(obj: object) -> str:
    # msgpack of a frozen struct is byte-stable for equal values, in any process.
    return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(obj))


# --------------------------------------------------------------------------- global schema


class GlobalTensor(msgspec.Struct, frozen=True, array_like=True):
    """One entry of the model's logical schema: a global tensor as if on one device."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def full(self) -> "Box":
        """The box of the whole tensor."""
        return Box.full(self.shape)

    def check(self) -> None:
        """LayoutMismatch for an unknown dtype or a negative dim."""
        if self.dtype not in ITEMSIZE:
            raise LayoutMismatch(f"global tensor {self.name!r}: unsupported dtype {self.dtype!r}")
        if any(s < 0 for s in self.shape):
            raise LayoutMismatch(f"global tensor {self.name!r}: negative dim in shape {list(self.shape)}")


class Schema(msgspec.Struct, frozen=True):
    """The model's global tensors, in order (the order is the model's, e.g. its state dict's)."""

    tensors: tuple[GlobalTensor, ...]

    @classmethod
    def of(cls, tensors: Iterable[GlobalTensor]) -> "Schema":
        """A checked schema (LayoutMismatch on a duplicate name or a bad entry)."""
        s = cls(tuple(tensors))
        s.check()
        return s

    def check(self) -> None:
        seen: set[str] = set()
        for g in self.tensors:
            g.check()
            if g.name in seen:
                raise LayoutMismatch(f"global tensor {g.name!r}: duplicate name in the schema")
            seen.add(g.name)

    def by_name(self) -> dict[str, GlobalTensor]:
        return {g.name: g for g in self.tensors}

    def __getitem__(self, name: str) -> GlobalTensor:
        for g in self.tensors:
            if g.name == name:
                return g
        raise KeyError(name)

    def digest(self) -> str:
        """Hex digest of the schema (names, dtypes, shapes, order); equal schemas, equal digests."""
        return _digest(self)


def merge_schemas(schemas: Iterable[Union["Schema", "Placement", Iterable[GlobalTensor]]]) -> Schema:
    """The union of the global tensors named by ``schemas`` (schemas, placements or lists), by
    name in first-seen order. Raises LayoutMismatch naming the first global tensor whose dtype or
    shape differs between two of them; changes nothing."""
    seen: dict[str, GlobalTensor] = {}
    for s in schemas:
        tensors = s.tensors if isinstance(s, Schema) else s.globals if isinstance(s, Placement) else s
        for g in tensors:
            had = seen.setdefault(g.name, g)
            if had.dtype != g.dtype:
                raise LayoutMismatch(
                    f"global tensor {g.name!r}: dtype {g.dtype} here, {had.dtype} elsewhere "
                    "(the schemas disagree; a dtype conversion is not a reshard)")
            if had.shape != g.shape:
                raise LayoutMismatch(
                    f"global tensor {g.name!r}: shape {list(g.shape)} here, {list(had.shape)} elsewhere "
                    "(the schemas disagree)")
    return Schema.of(seen.values())


# --------------------------------------------------------------------------- boxes


class Box(msgspec.Struct, frozen=True, array_like=True):
    """Per dimension ``[start, stop)`` within a global tensor's shape. A 0-d box holds the one
    element of a 0-d tensor; a box with ``start == stop`` on some dim is empty."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.start)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def empty(self) -> bool:
        return self.numel == 0

    def inside(self, shape: Sequence[int]) -> bool:
        """Whether the box lies within a tensor of ``shape`` (same number of dims)."""
        return len(shape) == self.ndim and len(self.stop) == self.ndim and all(
            0 <= a <= b <= s for a, b, s in zip(self.start, self.stop, shape))

    def contains(self, other: "Box") -> bool:
        return all(a <= c and d <= b for a, b, c, d in zip(self.start, self.stop, other.start, other.stop))

    def intersect(self, other: "Box") -> Optional["Box"]:
        """The common box, or None when it holds no element."""
        start = tuple(max(a, c) for a, c in zip(self.start, other.start))
        stop = tuple(min(b, d) for b, d in zip(self.stop, other.stop))
        if any(a >= b for a, b in zip(start, stop)):
            return None
        return Box(start, stop)

    def minus(self, other: "Box") -> list["Box"]:
        """Disjoint boxes covering exactly the elements of ``self`` not in ``other`` (at most
        two per dim: below and above the cut, earlier dims already clipped to it)."""
        cut = self.intersect(other)
        if cut is None:
            return [] if self.empty else [self]
        out = []
        start, stop = list(self.start), list(self.stop)
        for d in range(self.ndim):
            if start[d] < cut.start[d]:
                out.append(Box(tuple(start), tuple(stop[:d] + [cut.start[d]] + stop[d + 1:])))
            if cut.stop[d] < stop[d]:
                out.append(Box(tuple(start[:d] + [cut.stop[d]] + start[d + 1:]), tuple(stop)))
            start[d], stop[d] = cut.start[d], cut.stop[d]
        return out

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}:{b}" for a, b in zip(self.start, self.stop)) + "]"


def _subtract_all(boxes: list[Box], cuts: Iterable[Box]) -> list[Box]:
    for cut in cuts:
        boxes = [rest for b in boxes for rest in b.minus(cut)]
        if not boxes:
            break
    return boxes


# --------------------------------------------------------------------------- local tensors


class Piece(msgspec.Struct, frozen=True, array_like=True):
    """The box ``box`` of global tensor ``tensor``, at local rows ``[row0, row0 + rows)`` of its
    local tensor. ``stack``: the box is one local row (its dims are the local tensor's dims 1..),
    else its dim 0 runs along the local rows."""

    tensor: str
    box: Box
    row0: int
    stack: bool = False

    @property
    def rows(self) -> int:
        return 1 if self.stack else (self.box.shape[0] if self.box.ndim else 1)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one local row this piece fills."""
        return self.box.shape if self.stack else self.box.shape[1:]


class LocalPlacement(msgspec.Struct, frozen=True):
    """One local tensor of a handle: its name, dtype, local shape and pieces (rows in order)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes of one local row (of the whole tensor when 0-d)."""
        return math.prod(self.shape[1:]) * itemsize(self.dtype)

    def offset_of(self, piece: Piece) -> int:
        """Byte offset of ``piece``'s block in this tensor (rule 2)."""
        return piece.row0 * self.row_bytes

    def check(self, globals_: Mapping[str, GlobalTensor]) -> None:
        """LayoutMismatch unless the pieces tile the local tensor (rules 1, 3 and 5)."""
        where = f"local tensor {self.name!r}"
        if self.dtype not in ITEMSIZE:
            raise LayoutMismatch(f"{where}: unsupported dtype {self.dtype!r}")
        if not self.pieces:
            raise LayoutMismatch(f"{where}: no pieces (it holds nothing of the model)")
        for p in self.pieces:
            _check_piece_bounds(where, p, globals_, self.dtype)
        if not self.shape:
            p = self.pieces[0]
            if len(self.pieces) != 1 or p.stack or p.box.ndim or p.row0:
                raise LayoutMismatch(f"{where}: a 0-d local tensor holds exactly one whole 0-d tensor")
            return
        row = 0
        for p in self.pieces:
            if not p.stack and p.box.ndim == 0:
                raise LayoutMismatch(f"{where}: 0-d tensor {p.tensor!r} has no rows: stack it or hold it 0-d")
            if p.row0 != row:
                raise LayoutMismatch(f"{where}: piece of {p.tensor!r} starts at row {p.row0}, expected {row} "
                                     "(pieces tile the rows in order)")
            if p.row_shape != self.shape[1:]:
                raise LayoutMismatch(f"{where}: piece of {p.tensor!r} {p.box} has rows of shape "
                                     f"{list(p.row_shape)}, the tensor's are {list(self.shape[1:])}")
            row += p.rows
        if row != self.shape[0]:
            raise LayoutMismatch(f"{where}: shape {list(self.shape)} but its pieces hold {row} rows")


def _check_piece_bounds(where: str, p: Piece, globals_: Mapping[str, GlobalTensor], dtype: str) -> None:
    g = globals_.get(p.tensor)
    if g is None:
        raise LayoutMismatch(f"{where}: global tensor {p.tensor!r} is not in the placement's schema")
    if g.dtype != dtype:
        raise LayoutMismatch(f"{where}: dtype {dtype} holds global tensor {p.tensor!r} of dtype {g.dtype} "
                             "(a dtype conversion is not a reshard)")
    if not p.box.inside(g.shape):
        raise LayoutMismatch(f"{where}: box {p.box} is outside global tensor {p.tensor!r} of shape {list(g.shape)}")


class Placement(msgspec.Struct, frozen=True):
    """What one handle holds: the global tensors it names (sorted by name: one encoding per
    placement) and its local tensors in registration order."""

    globals: tuple[GlobalTensor, ...]
    tensors: tuple[LocalPlacement, ...]

    @classmethod
    def build(cls, locals_: Iterable[LocalPlacement],
              schema: Union[Schema, Iterable[GlobalTensor]]) -> "Placement":
        """A checked placement of ``locals_`` (in order); ``schema`` supplies the global tensors
        they name (only those are kept). Raises LayoutMismatch (see :meth:`check`)."""
        by_name = (schema if isinstance(schema, Schema) else Schema(tuple(schema))).by_name()
        tensors = tuple(locals_)
        names = sorted({p.tensor for t in tensors for p in t.pieces})
        missing = [n for n in names if n not in by_name]
        if missing:
            raise LayoutMismatch(f"global tensor {missing[0]!r}: not in the schema")
        out = cls(tuple(by_name[n] for n in names), tensors)
        out.check()
        return out

    def check(self) -> "Placement":
        """Check every rule of the module docstring that one handle can break (1 to 5, but
        coverage, which takes the whole replica); returns ``self``. Raises LayoutMismatch naming
        the local and global tensor; run it on every placement received from elsewhere."""
        Schema(self.globals).check()
        if [g.name for g in self.globals] != sorted(g.name for g in self.globals):
            raise LayoutMismatch("placement: global tensors must be sorted by name")
        by_name = {g.name: g for g in self.globals}
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise LayoutMismatch(f"local tensor {t.name!r}: duplicate name")
            seen.add(t.name)
            t.check(by_name)
        _check_overlaps(self.tensors)
        return self

    def local(self, name: str) -> LocalPlacement:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def digest(self) -> str:
        """Hex digest of the whole placement: equal placements (in any process) share it."""
        return _digest(self)


def _check_overlaps(tensors: Sequence[LocalPlacement]) -> None:
    held: dict[str, list[tuple[str, Box]]] = {}
    for t in tensors:
        for p in t.pieces:
            if p.box.empty:
                continue
            others = held.setdefault(p.tensor, [])
            for name, box in others:
                if box != p.box and box.intersect(p.box) is not None:
                    raise LayoutMismatch(
                        f"global tensor {p.tensor!r}: {box} in local tensor {name!r} and {p.box} in "
                        f"{t.name!r} overlap (one handle holds disjoint boxes or identical replicas)")
            others.append((t.name, p.box))


# --------------------------------------------------------------------------- coverage


def coverage(placements: Iterable[Placement],
             schema: Optional[Union[Schema, Iterable[GlobalTensor]]] = None) -> dict[str, tuple[Box, ...]]:
    """What the placements of one replica's shards leave uncovered: global tensor name -> the
    missing boxes (disjoint), only for tensors with something missing. ``schema``: the tensors
    that must be covered (default: those the placements name, so a tensor no shard names is only
    caught with a schema). Raises LayoutMismatch when the placements' schemas disagree."""
    placements = list(placements)
    if schema is not None and not isinstance(schema, Schema):
        schema = Schema.of(schema)
    merged = merge_schemas(placements + ([schema] if schema is not None else []))
    want = schema if schema is not None else merged
    boxes: dict[str, list[Box]] = {}
    for pl in placements:
        for t in pl.tensors:
            for p in t.pieces:
                boxes.setdefault(p.tensor, []).append(p.box)
    out = {}
    for g in want.tensors:
        rest = _subtract_all([] if g.full().empty else [g.full()], boxes.get(g.name, ()))
        if rest:
            out[g.name] = tuple(rest)
    return out


def check_coverage(placements: Iterable[Placement],
                   schema: Optional[Union[Schema, Iterable[GlobalTensor]]] = None) -> None:
    """LayoutMismatch naming the missing ranges (the first few tensors) if :func:`coverage`
    finds any; a replica is refused at its first publish with this message."""
    missing = coverage(placements, schema)
    if missing:
        shown = "; ".join(f"{name} {', '.join(map(str, boxes))}" for name, boxes in list(missing.items())[:4])
        more = f" (and {len(missing) - 4} more tensors)" if len(missing) > 4 else ""
        raise LayoutMismatch(f"the replica's shards leave global tensors uncovered: {shown}{more}")


# --------------------------------------------------------------------------- helpers


def split_box(g: GlobalTensor, dim: int, index: int, count: int) -> Box:
    """Part ``index`` of ``count`` equal parts of ``g`` along ``dim`` (a TP split). LayoutMismatch
    unless ``count`` divides the dim; use :func:`split_sizes` for uneven parts."""
    dim = _dim(g, dim)
    if count <= 0 or not 0 <= index < count:
        raise LayoutMismatch(f"global tensor {g.name!r}: part {index} of {count}")
    if g.shape[dim] % count:
        raise LayoutMismatch(f"global tensor {g.name!r}: dim {dim} of size {g.shape[dim]} does not split "
                             f"into {count} equal parts (use split_sizes)")
    size = g.shape[dim] // count
    return _slab(g, dim, index * size, (index + 1) * size)


def _dim(g: GlobalTensor, dim: int) -> int:
    if not -len(g.shape) <= dim < len(g.shape):
        raise LayoutMismatch(f"global tensor {g.name!r}: no dim {dim} in shape {list(g.shape)}")
    return dim % len(g.shape)


def _slab(g: GlobalTensor, dim: int, a: int, b: int) -> Box:
    full = g.full()
    return Box(full.start[:dim] + (a,) + full.start[dim + 1:], full.stop[:dim] + (b,) + full.stop[dim + 1:])


def _sizes_box(g: GlobalTensor, dim: int, sizes: Sequence[int], index: int) -> Box:
    dim = _dim(g, dim)
    if any(s < 0 for s in sizes) or sum(sizes) != g.shape[dim] or not 0 <= index < len(sizes):
        raise LayoutMismatch(f"global tensor {g.name!r}: sizes {list(sizes)} (part {index}) do not split "
                             f"dim {dim} of size {g.shape[dim]}")
    a = sum(sizes[:index])
    return _slab(g, dim, a, a + sizes[index])


def concat(name: str, parts: Sequence[tuple[GlobalTensor, Box]], stack: bool = False) -> LocalPlacement:
    """The general builder: a local tensor ``name`` made of ``(global tensor, box)`` parts
    concatenated along dim 0 (``stack``: each part one row of a new leading dim). The dtype is
    the parts'. Checked against the parts' global tensors (LayoutMismatch)."""
    if not parts:
        raise LayoutMismatch(f"local tensor {name!r}: no parts")
    pieces, row = [], 0
    for g, box in parts:
        p = Piece(g.name, box, row, stack)
        pieces.append(p)
        row += p.rows
    first_box = parts[0][1]
    if stack:
        shape = (row,) + first_box.shape
    elif first_box.ndim == 0:
        shape = ()
    else:
        shape = (row,) + first_box.shape[1:]
    local = LocalPlacement(name, parts[0][0].dtype, shape, tuple(pieces))
    local.check({g.name: g for g, _ in parts})
    return local


def whole(g: GlobalTensor, name: Optional[str] = None) -> LocalPlacement:
    """The whole of ``g`` as one local tensor (named ``g.name`` by default): today's layout."""
    return concat(name or g.name, [(g, g.full())])


def split(g: GlobalTensor, dim: int, index: int, count: int, name: Optional[str] = None) -> LocalPlacement:
    """Part ``index`` of ``count`` equal parts of ``g`` along ``dim`` (:func:`split_box`)."""
    return concat(name or g.name, [(g, split_box(g, dim, index, count))])


def split_sizes(g: GlobalTensor, dim: int, sizes: Sequence[int], index: int,
                name: Optional[str] = None) -> LocalPlacement:
    """Part ``index`` of an uneven split of ``g`` along ``dim`` into parts of ``sizes`` (their
    sum is the dim's size; a part may be empty)."""
    return concat(name or g.name, [(g, _sizes_box(g, dim, sizes, index))])


FusedPart = Union[GlobalTensor, tuple[GlobalTensor, int, int, int], tuple[GlobalTensor, Box]]


def _part_box(part: FusedPart) -> tuple[GlobalTensor, Box]:
    if isinstance(part, GlobalTensor):
        return part, part.full()
    if len(part) == 2:
        return part[0], part[1]
    g, dim, index, count = part
    return g, split_box(g, dim, index, count)


def fused(name: str, parts: Sequence[FusedPart]) -> LocalPlacement:
    """A fused local tensor: its parts' boxes concatenated along dim 0. A part is a global tensor
    (whole), ``(g, dim, index, count)`` (an equal split, :func:`split_box`) or ``(g, box)``.
    vLLM's ``qkv_proj`` on TP rank r of T: ``fused("qkv_proj", [(q, 0, r, T), (k, 0, r, T), (v, 0, r, T)])``."""
    return concat(name, [_part_box(p) for p in parts])


def stacked(name: str, parts: Sequence[FusedPart]) -> LocalPlacement:
    """Parts stacked along a new leading dim (MoE experts: ``stacked("w1", [e0, e1, ...])``);
    parts as in :func:`fused`, all of one box shape."""
    return concat(name, [_part_box(p) for p in parts], stack=True)


def whole_placement(schema: Union[Schema, Iterable[GlobalTensor]]) -> Placement:
    """Every global tensor whole, under its own name, in schema order: the identical layout of
    today, where every handle holds the same tensors."""
    schema = schema if isinstance(schema, Schema) else Schema.of(schema)
    return Placement.build([whole(g) for g in schema.tensors], schema)


# --------------------------------------------------------------------------- DTensor


_PLAIN = re.compile(r"^\s*(?:S|Shard)\(\s*(?:dim\s*=\s*)?(-?\d+)\s*\)\s*$|^\s*(R|Replicate(?:\(\))?)\s*$")


def _shard_dim(p: Any, ndim: int) -> Optional[int]:
    """The tensor dim a DTensor placement shards (None: replicated). Accepts torch's placement
    objects (duck typed) and their plain forms: ``"S(0)"``, ``"Shard(1)"``, ``"R"``, ``"Replicate()"``."""
    if isinstance(p, str):
        m = _PLAIN.match(p)
        if not m:
            raise LayoutMismatch(f"DTensor placement {p!r}: only Shard(dim) and Replicate() are boxes")
        return None if m.group(2) else int(m.group(1)) % max(ndim, 1)
    if getattr(p, "split_factor", None) is not None or type(p).__name__ == "_StridedShard":
        raise LayoutMismatch(f"DTensor placement {p!r}: strided sharding is not a box (not supported yet)")
    if callable(getattr(p, "is_shard", None)) and p.is_shard():
        return int(p.dim) % max(ndim, 1)
    if callable(getattr(p, "is_replicate", None)) and p.is_replicate():
        return None
    raise LayoutMismatch(f"DTensor placement {p!r}: only Shard(dim) and Replicate() are boxes "
                         "(a partial sum is not a slice of the tensor)")


def dtensor_box(shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                placements: Sequence[Any]) -> Box:
    """The box the mesh rank at ``coordinate`` holds of a tensor of global ``shape`` sharded by
    ``placements`` (one per mesh dim), as torch's DTensor cuts it: mesh dims in order, each
    ``Shard(d)`` cutting the current range of dim ``d`` the way ``torch.chunk`` does (chunks of
    ``ceil(n / k)``, trailing ranks possibly short or empty)."""
    if not (len(mesh_shape) == len(coordinate) == len(placements)):
        raise LayoutMismatch(f"DTensor: mesh {list(mesh_shape)}, coordinate {list(coordinate)} and "
                             f"{len(placements)} placements disagree")
    start, stop = [0] * len(shape), [int(s) for s in shape]
    for k, c, p in zip(mesh_shape, coordinate, placements):
        if not 0 <= c < k:
            raise LayoutMismatch(f"DTensor: coordinate {list(coordinate)} outside mesh {list(mesh_shape)}")
        d = _shard_dim(p, len(shape))
        if d is None:
            continue
        if not shape:
            raise LayoutMismatch("DTensor: a 0-d tensor cannot be sharded")
        n = stop[d] - start[d]
        chunk = -(-n // k)
        a = start[d] + min(c * chunk, n)
        start[d], stop[d] = a, start[d] + min((c + 1) * chunk, n)
    return Box(tuple(start), tuple(stop))


def from_dtensor(g: GlobalTensor, mesh_shape: Sequence[int], coordinate: Sequence[int],
                 placements: Sequence[Any], name: Optional[str] = None) -> LocalPlacement:
    """The local tensor a DTensor of global tensor ``g`` has on the rank at ``coordinate`` of a
    device mesh of ``mesh_shape`` (:func:`dtensor_box`). No process group needed: placements are
    torch's ``Shard``/``Replicate`` objects or their plain forms (``"S(0)"``, ``"R"``)."""
    return concat(name or g.name, [(g, dtensor_box(g.shape, mesh_shape, coordinate, placements))])


def dtensor_placement(name: str, dtensor: Any) -> tuple[GlobalTensor, LocalPlacement]:
    """The global tensor and this rank's local placement of a live ``torch.distributed.tensor.DTensor``
    (read by attribute: ``shape``, ``dtype``, ``device_mesh``, ``placements``). LayoutMismatch when
    this rank is not in the mesh or a placement is not a box."""
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise LayoutMismatch(f"DTensor {name!r}: this rank is not in its device mesh")
    g = GlobalTensor(name, str(dtensor.dtype).removeprefix("torch."), tuple(int(s) for s in dtensor.shape))
    g.check()
    return g, from_dtensor(g, tuple(mesh.shape), tuple(coordinate), tuple(dtensor.placements))
