"""Tensors -> transfer units: chunking, tiny-tensor packing, fingerprints and checksums.

A shard's registered tensors, in order, are cut into *transfer units*. A unit is a tuple of
:class:`Piece` (a byte range of one tensor). Tensors of at least ``min(pack_below_bytes,
unit_bytes)`` bytes are cut into chunks of at most ``unit_bytes`` (one piece per unit); runs of
consecutive smaller tensors share units of at most ``unit_bytes`` in total, so a model with many
tiny tensors is not one round trip per tensor. A packed unit moves as ONE transfer request with
several descriptors; nothing is ever copied into a pack buffer.

The unit table is a pure function of the tensor metadata (names, dtypes, shapes) and the two unit
knobs, so holder and reader compute the same table independently; :attr:`Layout.fingerprint` and
:attr:`Layout.unit_signature` let them check that cheaply.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Union

import msgspec
import torch
import xxhash

from tensorhub.errors import LayoutMismatch

logger = logging.getLogger(__name__)

__all__ = [
    "Layout",
    "NamedTensors",
    "Piece",
    "TensorMeta",
    "checksum_all",
    "checksum_unit",
    "dtype_name",
    "unit_size_for",
]

NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]

# Every dtype whose bytes we can move: anything with a fixed element size. Names are the
# torch attribute names, so ``getattr(torch, name)`` round-trips.
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "complex64", "complex128", "complex32",
    "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
)
_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, n): n for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}
_DEVICE_TYPES = ("cpu", "cuda")


def dtype_name(dtype: torch.dtype) -> str:
    """The stable string name of a supported torch dtype (``torch.bfloat16 -> "bfloat16"``).

    Raises :class:`LayoutMismatch` for dtypes TensorHub cannot move (e.g. quantized types)."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise LayoutMismatch(f"unsupported dtype {dtype}") from None


class TensorMeta(msgspec.Struct, frozen=True):
    """Name, dtype name, shape and byte size of one registered tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class Piece(NamedTuple):
    """Byte range ``[offset, offset + nbytes)`` of the tensor at ``tensor_index``."""

    tensor_index: int
    offset: int
    nbytes: int


Unit = tuple[Piece, ...]


def _items(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    if isinstance(named_tensors, Mapping):
        return list(named_tensors.items())
    return list(named_tensors)


def _meta_of(name: str, t: torch.Tensor) -> TensorMeta:
    if not isinstance(t, torch.Tensor):
        raise LayoutMismatch(f"tensor {name!r}: not a torch.Tensor ({type(t).__name__})")
    if t.device.type not in _DEVICE_TYPES:
        raise LayoutMismatch(f"tensor {name!r}: unsupported device {t.device}")
    if t.is_sparse or t.layout != torch.strided:
        raise LayoutMismatch(f"tensor {name!r}: only dense strided tensors are supported")
    if not t.is_contiguous():
        raise LayoutMismatch(f"tensor {name!r}: not contiguous")
    try:
        dt = dtype_name(t.dtype)
    except LayoutMismatch:
        raise LayoutMismatch(f"tensor {name!r}: unsupported dtype {t.dtype}") from None
    return TensorMeta(name, dt, tuple(int(s) for s in t.shape), t.numel() * t.element_size())


def metas_of(named_tensors: NamedTensors) -> tuple[TensorMeta, ...]:
    """Validate ``named_tensors`` and describe them. Raises :class:`LayoutMismatch` naming the
    first offending tensor (duplicate name, non-contiguous, unsupported dtype/device) or when the
    collection is empty."""
    items = _items(named_tensors)
    if not items:
        raise LayoutMismatch("no tensors to register")
    seen: set[str] = set()
    metas = []
    for name, t in items:
        if not isinstance(name, str):
            raise LayoutMismatch(f"tensor name {name!r} is not a string")
        if name in seen:
            raise LayoutMismatch(f"tensor {name!r}: duplicate name")
        seen.add(name)
        metas.append(_meta_of(name, t))
    return tuple(metas)


def _hash_hex(obj: object) -> str:
    # msgpack of plain lists/ints/strs is byte-stable, so the hash is stable across processes.
    return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(obj))


_UNIT_ALIGN = 64 << 10


def unit_size_for(total_bytes: int, unit_bytes: int, unit_bytes_min: int, unit_count_target: int) -> int:
    """The unit size for a shard of ``total_bytes``: about ``total_bytes / unit_count_target``
    (rounded up to 64 KiB) so a pipeline through partial holders advances in small steps, but no
    smaller than ``unit_bytes_min`` (per-read overhead) and no larger than ``unit_bytes``, which
    wins over the minimum. ``unit_count_target <= 0`` means always ``unit_bytes``."""
    if unit_count_target <= 0:
        return unit_bytes
    want = -(-max(total_bytes, 1) // unit_count_target)
    want = -(-want // _UNIT_ALIGN) * _UNIT_ALIGN
    return min(unit_bytes, max(unit_bytes_min, want))


def _plan_units(metas: Sequence[TensorMeta], unit_bytes: int, pack_below_bytes: int) -> tuple[Unit, ...]:
    threshold = min(pack_below_bytes, unit_bytes)
    units: list[Unit] = []
    pack: list[Piece] = []
    pack_bytes = 0
    for i, m in enumerate(metas):
        n = m.nbytes
        if n == 0:
            continue  # no bytes to move; does not break a run of tiny tensors
        if n >= threshold:
            if pack:
                units.append(tuple(pack))
                pack, pack_bytes = [], 0
            for off in range(0, n, unit_bytes):
                units.append((Piece(i, off, min(unit_bytes, n - off)),))
        else:
            if pack_bytes + n > unit_bytes:
                units.append(tuple(pack))
                pack, pack_bytes = [], 0
            pack.append(Piece(i, 0, n))
            pack_bytes += n
    if pack:
        units.append(tuple(pack))
    return tuple(units)


class Layout:
    """The transfer-unit table of one shard. Immutable; build with :meth:`build` (from tensors)
    or :meth:`from_metas` (from metadata received over the wire); both give equal layouts for
    equal inputs.

    Attributes: ``metas`` (tuple of :class:`TensorMeta`, registration order), ``units`` (tuple of
    units, each a tuple of :class:`Piece`), ``unit_count``, ``total_bytes``, ``unit_bytes``,
    ``pack_below_bytes``, ``fingerprint`` (hex hash of names, dtypes and shapes only) and
    ``unit_signature`` (hex hash of the fingerprint plus the unit table, so two sides with
    different unit settings are told apart).
    """

    __slots__ = ("metas", "units", "unit_bytes", "pack_below_bytes", "total_bytes",
                 "fingerprint", "unit_signature", "_index")

    def __init__(self, metas: Sequence[TensorMeta], unit_bytes: int, pack_below_bytes: int):
        if unit_bytes <= 0:
            raise LayoutMismatch(f"unit_bytes must be > 0, got {unit_bytes}")
        if pack_below_bytes < 0:
            raise LayoutMismatch(f"pack_below_bytes must be >= 0, got {pack_below_bytes}")
        if not metas:
            raise LayoutMismatch("no tensors to register")
        self.metas: tuple[TensorMeta, ...] = tuple(metas)
        names = [m.name for m in self.metas]
        if len(set(names)) != len(names):
            dup = next(n for i, n in enumerate(names) if n in names[:i])
            raise LayoutMismatch(f"tensor {dup!r}: duplicate name")
        self.unit_bytes = int(unit_bytes)
        self.pack_below_bytes = int(pack_below_bytes)
        self.units: tuple[Unit, ...] = _plan_units(self.metas, self.unit_bytes, self.pack_below_bytes)
        self.total_bytes = sum(m.nbytes for m in self.metas)
        self.fingerprint = _hash_hex([[m.name, m.dtype, list(m.shape)] for m in self.metas])
        self.unit_signature = _hash_hex(
            [self.fingerprint, self.unit_bytes, self.pack_below_bytes,
             [[list(p) for p in u] for u in self.units]]
        )
        self._index = {m.name: i for i, m in enumerate(self.metas)}

    @classmethod
    def build(cls, named_tensors: NamedTensors, unit_bytes: int, pack_below_bytes: int) -> "Layout":
        """Validate tensors and compute their unit table. ``named_tensors`` is an ordered mapping
        or a list of ``(name, tensor)``; the order is the registration order. Raises
        :class:`LayoutMismatch` (naming the tensor) for an empty collection, duplicate names,
        non-contiguous tensors, or unsupported dtypes/devices. Zero-element tensors are allowed
        and get no pieces."""
        return cls(metas_of(named_tensors), unit_bytes, pack_below_bytes)

    @classmethod
    def for_config(cls, named_tensors: NamedTensors, config) -> "Layout":
        """:meth:`build` with the unit size a :class:`~tensorhub.config.Config` asks for this
        shard's size (:func:`unit_size_for`): every process with the same config and tensors gets
        the same table."""
        metas = metas_of(named_tensors)
        unit = unit_size_for(sum(m.nbytes for m in metas), config.unit_bytes, config.unit_bytes_min,
                             config.unit_count_target)
        return cls(metas, unit, config.pack_below_bytes)

    @classmethod
    def from_metas(cls, metas: Sequence[TensorMeta], unit_bytes: int, pack_below_bytes: int) -> "Layout":
        """The layout of tensors described by ``metas`` (e.g. received from a holder)."""
        return cls(metas, unit_bytes, pack_below_bytes)

    @property
    def unit_count(self) -> int:
        return len(self.units)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.metas)

    def index_of(self, name: str) -> int:
        """Registration index of the tensor called ``name`` (KeyError if unknown)."""
        return self._index[name]

    def unit_nbytes(self, unit_index: int) -> int:
        return sum(p.nbytes for p in self.units[unit_index])

    def check_same(self, other: "Layout") -> None:
        """Raise :class:`LayoutMismatch` naming the first differing tensor if ``other`` describes
        different tensors, or naming the unit settings if only the unit tables differ."""
        _compare_metas(self.metas, other.metas)
        if self.unit_signature != other.unit_signature:
            raise LayoutMismatch(
                "same tensors but different unit tables: unit_bytes/pack_below_bytes "
                f"{self.unit_bytes}/{self.pack_below_bytes} vs {other.unit_bytes}/{other.pack_below_bytes}"
            )

    def check_tensors(self, named_tensors: NamedTensors) -> None:
        """Raise :class:`LayoutMismatch` naming the first tensor that is missing, extra, of a
        different dtype/shape, non-contiguous or unsupported. Data pointers may differ from the
        registered ones (that is the caller's business)."""
        _compare_metas(self.metas, metas_of(named_tensors))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other.unit_signature == self.unit_signature

    def __hash__(self) -> int:
        return hash(self.unit_signature)

    def __repr__(self) -> str:
        return (f"Layout(tensors={len(self.metas)}, units={self.unit_count}, "
                f"bytes={self.total_bytes}, fingerprint={self.fingerprint[:12]})")


def _compare_metas(mine: Sequence[TensorMeta], theirs: Sequence[TensorMeta]) -> None:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a.name != b.name:
            raise LayoutMismatch(f"tensor #{i}: expected {a.name!r}, got {b.name!r}")
        if a.dtype != b.dtype:
            raise LayoutMismatch(f"tensor {a.name!r}: dtype {b.dtype}, expected {a.dtype}")
        if a.shape != b.shape:
            raise LayoutMismatch(f"tensor {a.name!r}: shape {list(b.shape)}, expected {list(a.shape)}")
    if len(mine) > len(theirs):
        raise LayoutMismatch(f"tensor {mine[len(theirs)].name!r}: missing")
    if len(theirs) > len(mine):
        raise LayoutMismatch(f"tensor {theirs[len(mine)].name!r}: not in the layout")


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def checksum_unit(tensors: Sequence[torch.Tensor], unit: Unit) -> int:
    """xxh3-64 of the unit's pieces, in order, as an unsigned int in ``[0, 2**64)``.

    ``tensors`` are the shard's tensors in layout order. CPU bytes are hashed in place (zero
    copy); CUDA pieces are copied to host first. Does not block other threads beyond the hash."""
    h = xxhash.xxh3_64()
    for p in unit:
        piece = _byte_view(tensors[p.tensor_index])[p.offset:p.offset + p.nbytes]
        if piece.device.type != "cpu":
            piece = piece.cpu()  # untested here: no GPU on the development machines
        h.update(memoryview(piece.numpy()))
    return h.intdigest()


def checksum_all(tensors: Sequence[torch.Tensor], layout: Layout) -> list[int]:
    """:func:`checksum_unit` of every unit of ``layout``, in unit order."""
    return [checksum_unit(tensors, u) for u in layout.units]
