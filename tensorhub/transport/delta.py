"""Lossless deltas between two versions of a shard: what crosses a slow link instead of a version.

An RL step changes few bf16 values (``benchmarks/RESULTS.md``, "Delta density": 1.7-11% of the
elements per step), each by a unit or two in the last place. :func:`encode` turns (base, new) into
one buffer that names the changed 16-bit words and how much each changed; :func:`apply` rebuilds
``new`` in place from ``base`` and that buffer, bit for bit, or raises and says what it left.

The bytes of a version are a list of *segments* (a shard's tensors, each a flat ``uint8`` array,
read as one stream in order); every segment is cut into little-endian 16-bit words (a bf16 or
fp16 element, or half of an fp32 one: lossless whatever the dtype), and an odd segment's last byte
travels as it is (``tails``).

Wire format (little-endian), one contiguous buffer: a fixed :data:`HEADER` then the payload::

    magic "THD1" | codec u8 | 0 u8 | 0 u16 | total_bytes u64 | changed u64
    | gaps_len u64 | diffs_len u64 | tails_len u64
    | base digest 16 B | new digest 16 B | payload xxh3-64 u64
    payload = compress(gap planes) | compress(diff planes) | tails

- ``changed`` words; their indices as gaps (``index - previous index - 1``, uint32), split into
  four byte planes (low byte first) and compressed as one frame: most gaps are under 256 at the
  densities measured, so the three high planes are nearly all zero and cost almost nothing.
- per changed word ``new - old`` (uint16, wrapping), its high byte plane then its low one,
  compressed as one frame (a step moves most values by +-1 ulp: a handful of distinct bytes).
- digests: xxh3-128 over every byte of the base and of the new version, in segment order.
  :func:`apply` checks the base before it writes anything (:class:`~tensorhub.errors.
  DeltaWrongBase`: the target is untouched) and the result after (a mismatch there means an
  encoder bug or a damaged target: the target is garbage, :class:`~tensorhub.errors.DeltaRejected`).
- the payload's own xxh3-64 catches bytes damaged in transit before anything is decoded.

Rules for a buffer that came from another process (:func:`apply` keeps them all before its first
write): every length in the header is checked against the buffer's length and against the
target's own size (``changed`` at most its words, decompressed sizes exactly ``4 * changed`` and
``2 * changed``, a frame's declared size checked before it is decompressed); indices strictly
increase and stay below the target's word count. Nothing is allocated from an unchecked length.

Codec: zstandard level 1 (``CODEC_ZSTD``): measured against zlib 1 on the same deltas it is
about as small and several times faster to encode and decode (``benchmarks/RESULTS.md``).
:data:`CODEC_ZLIB` (stdlib) is kept readable, and chosen where ``zstandard`` is missing.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import Optional, Sequence

import numpy as np
import torch
import xxhash

from tensorhub import errors
from tensorhub.layout import Layout, checksum_all

try:
    import zstandard
except ImportError:  # pragma: no cover - pinned in requirements/core.txt; zlib then
    zstandard = None

MAGIC = b"THD1"
CODEC_ZSTD = 1
CODEC_ZLIB = 2
HEADER = struct.Struct("<4sBBHQQQQQ16s16sQ")
"""The fixed header (see the module docstring); ``HEADER.size`` bytes."""
GAP_MAX = (1 << 32) - 1
"""Gaps are uint32: a shard of at most 8 GiB between two changed words. Past it :func:`encode`
raises (the seeder takes the full seed)."""
ZSTD_LEVEL = 1
ZLIB_LEVEL = 1


@dataclasses.dataclass(frozen=True)
class Info:
    """What a delta's header says (:func:`peek`)."""

    codec: int
    total_bytes: int
    changed: int
    """16-bit words that changed."""
    nbytes: int
    """The whole delta (header and payload)."""
    base_digest: bytes
    new_digest: bytes


def segments(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """The bytes of ``tensors`` as flat ``uint8`` arrays sharing their memory (host memory,
    contiguous; anything else raises ``DeltaRejected``: a delta needs the bytes in reach)."""
    out = []
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise errors.DeltaRejected(f"a delta needs contiguous host tensors, not {t.device} {tuple(t.shape)}")
        out.append(t.detach().reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8))
    return out


def digest(segs: Sequence[np.ndarray]) -> bytes:
    """xxh3-128 over every byte of ``segs`` in order (the digests a delta carries)."""
    h = xxhash.xxh3_128()
    for s in segs:
        if s.size:
            h.update(memoryview(s))
    return h.digest()


def _words(s: np.ndarray) -> np.ndarray:
    return s[: s.size - (s.size & 1)].view(np.uint16)


def _tails(segs: Sequence[np.ndarray]) -> bytes:
    return bytes(int(s[-1]) for s in segs if s.size & 1)


def default_codec() -> int:
    return CODEC_ZSTD if zstandard is not None else CODEC_ZLIB


def encode(base: Sequence[np.ndarray], new: Sequence[np.ndarray], codec: int = 0) -> bytes:
    """The delta that turns ``base`` into ``new`` (segments of equal sizes, in the same order;
    see the module docstring). Reads both, writes neither; ``codec`` 0: :func:`default_codec`.
    Raises ``DeltaRejected`` where no delta can be made (sizes differ, a gap over
    :data:`GAP_MAX`, the codec missing)."""
    codec = codec or default_codec()
    if len(base) != len(new) or any(b.size != n.size for b, n in zip(base, new)):
        raise errors.DeltaRejected("base and new versions differ in layout")
    idx_parts, diff_parts, offset = [], [], 0
    for b, n in zip(base, new):
        bw, nw = _words(b), _words(n)
        i = np.flatnonzero(bw != nw)
        if i.size:
            idx_parts.append(i + offset)
            diff_parts.append(nw[i] - bw[i])  # uint16, wrapping
        offset += bw.size
    idx = np.concatenate(idx_parts) if idx_parts else np.zeros(0, np.int64)
    diffs = np.concatenate(diff_parts) if diff_parts else np.zeros(0, np.uint16)
    gaps = np.diff(idx, prepend=-1) - 1
    if gaps.size and int(gaps.max()) > GAP_MAX:
        raise errors.DeltaRejected(f"a gap of {int(gaps.max())} words between changes (over {GAP_MAX})")
    gap_planes = gaps.astype("<u4").view(np.uint8).reshape(-1, 4).T.tobytes()
    diff_planes = diffs.astype("<u2").view(np.uint8).reshape(-1, 2)[:, ::-1].T.tobytes()
    gz, dz = _compress(codec, gap_planes), _compress(codec, diff_planes)
    tails = _tails(new)
    payload = gz + dz + tails
    head = HEADER.pack(MAGIC, codec, 0, 0, sum(s.size for s in new), int(idx.size), len(gz), len(dz), len(tails),
                       digest(base), digest(new), xxhash.xxh3_64_intdigest(payload))
    return head + payload


def peek(buf) -> Info:
    """The header of ``buf`` (any bytes-like), checked for shape only: magic, codec, and that
    its lengths add up to ``len(buf)``. Raises ``DeltaRejected``."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < HEADER.size:
        raise errors.DeltaRejected(f"a delta of {mv.nbytes} bytes is shorter than its header")
    magic, codec, _, _, total, changed, gl, dl, tl, bd, nd, _ph = HEADER.unpack_from(mv, 0)
    if magic != MAGIC or codec not in (CODEC_ZSTD, CODEC_ZLIB):
        raise errors.DeltaRejected(f"not a delta (magic {magic!r}, codec {codec})")
    if HEADER.size + gl + dl + tl != mv.nbytes:
        raise errors.DeltaRejected(f"a delta's lengths ({gl} + {dl} + {tl}) do not add up to its "
                                   f"{mv.nbytes - HEADER.size} payload bytes")
    return Info(codec=codec, total_bytes=total, changed=changed, nbytes=mv.nbytes, base_digest=bd, new_digest=nd)


def apply(buf, target: Sequence[np.ndarray], *, base_digest: bytes = b"") -> Info:
    """Turn ``target`` (segments holding the base, writable) into the new version in place.

    Checks, in order, before the first write: the header and lengths (:func:`peek`), the
    payload's checksum, that the delta is for a version of ``target``'s sizes, that ``target``
    is the base (its digest, computed here unless the caller passes the one it knows as
    ``base_digest``; else ``DeltaWrongBase``, ``target`` untouched), then decodes everything and
    checks every index. Then writes, and checks the result's digest: a mismatch raises
    ``DeltaRejected`` and ``target`` holds garbage (take the full version). Returns the header."""
    info = peek(buf)
    mv = memoryview(buf).cast("B")
    _, _, _, _, _, _, gl, dl, tl, _, _, ph = HEADER.unpack_from(mv, 0)
    payload = mv[HEADER.size:]
    if xxhash.xxh3_64_intdigest(payload) != ph:
        raise errors.DeltaRejected("a delta's payload does not match its checksum (damaged in transit)")
    total = sum(s.size for s in target)
    words = sum(s.size // 2 for s in target)
    odd = sum(s.size & 1 for s in target)
    if info.total_bytes != total or tl != odd or info.changed > words:
        raise errors.DeltaRejected(f"a delta of a {info.total_bytes}-byte version ({info.changed} words changed, "
                                   f"{tl} tails) does not fit a {total}-byte target ({words} words, {odd} odd)")
    if (base_digest or digest(target)) != info.base_digest:
        raise errors.DeltaWrongBase("the delta was made against another base version; nothing was written")
    n = info.changed
    gap_planes = _decompress(info.codec, payload[:gl], 4 * n)
    diff_planes = _decompress(info.codec, payload[gl:gl + dl], 2 * n)
    gaps = np.ascontiguousarray(np.frombuffer(gap_planes, np.uint8).reshape(4, n).T).view("<u4").reshape(-1)
    idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if n and idx[-1] >= words:
        raise errors.DeltaRejected(f"a delta names word {int(idx[-1])} of a target of {words}; nothing was written")
    d = np.frombuffer(diff_planes, np.uint8).reshape(2, n)
    diffs = np.ascontiguousarray(np.stack([d[1], d[0]], axis=1)).view("<u2").reshape(-1)
    tails = bytes(payload[gl + dl:])
    _write(target, idx, diffs, tails)
    if digest(target) != info.new_digest:
        raise errors.DeltaRejected("the delta's result does not match the new version's digest; the target "
                                   "holds garbage")
    return info


def rebuild(buf, base: Sequence[torch.Tensor], layout: Layout, expected_sums: Optional[Sequence[int]] = None,
            scratch: Optional[Sequence[torch.Tensor]] = None) -> tuple[list[torch.Tensor], list[int]]:
    """The new version rebuilt from a published ``base`` (host tensors in ``layout`` order,
    read only: a base may be serving readers) and the delta ``buf``: what a seeder's staging
    copy takes in place of the full seed. Checked against the new version's digest the delta
    carries (its holder computed it from the version's bytes) and, where given, unit by unit
    against ``expected_sums`` (the checksums its holder published). ``scratch``: tensors of the
    same shapes to write into (default: new ones); they hold garbage after a failure. Returns
    the tensors and their unit checksums. Raises ``DeltaWrongBase`` (``base`` is not the
    delta's base; nothing written) or ``DeltaRejected`` (damaged, malformed, or the result is
    not that version): the caller takes the full version."""
    if expected_sums is not None and len(expected_sums) != layout.unit_count:
        raise errors.DeltaRejected(f"{len(expected_sums)} checksums for a layout of {layout.unit_count} units")
    base_segs = segments(base)
    info = peek(buf)
    if digest(base_segs) != info.base_digest:  # before the copy: a wrong base costs one read of it
        raise errors.DeltaWrongBase("the delta was made against another base version; nothing was written")
    out = [torch.empty_like(t) for t in base] if scratch is None else list(scratch)
    for o, b in zip(out, base):
        o.copy_(b)
    apply(buf, segments(out), base_digest=info.base_digest)
    sums = checksum_all(out, layout)
    if expected_sums is not None:
        bad = [u for u, (got, want) in enumerate(zip(sums, expected_sums)) if got != want]
        if bad:
            raise errors.DeltaRejected(f"{len(bad)} units of the rebuilt version (first {bad[0]}) do not match "
                                       "the checksums its holder published")
    return out, sums


def _write(target: Sequence[np.ndarray], idx: np.ndarray, diffs: np.ndarray, tails: bytes) -> None:
    offset, k, t = 0, 0, 0
    for s in target:
        w = _words(s)
        end = int(np.searchsorted(idx, offset + w.size, side="left"))
        if end > k:
            local = idx[k:end] - offset
            w[local] += diffs[k:end]
            k = end
        offset += w.size
        if s.size & 1:
            s[-1] = tails[t]
            t += 1


def _compress(codec: int, data: bytes) -> bytes:
    if codec == CODEC_ZSTD:
        if zstandard is None:
            raise errors.DeltaRejected("zstandard is not installed here")
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
    if codec == CODEC_ZLIB:
        return zlib.compress(data, ZLIB_LEVEL)
    raise errors.DeltaRejected(f"unknown codec {codec}")


def _decompress(codec: int, data: memoryview, size: int) -> bytes:
    """``data`` decompressed, which must be exactly ``size`` bytes (never more is allocated)."""
    try:
        if codec == CODEC_ZSTD:
            if zstandard is None:
                raise errors.DeltaRejected("a zstandard delta, and zstandard is not installed here")
            declared = zstandard.frame_content_size(data)
            if declared != size:
                raise errors.DeltaRejected(f"a delta's frame declares {declared} bytes where {size} belong")
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
        else:
            d = zlib.decompressobj()
            out = d.decompress(data, size)
            if d.unconsumed_tail or not d.eof:
                raise errors.DeltaRejected(f"a delta's frame holds more than the {size} bytes that belong")
    except (zlib.error, ValueError, TypeError) as e:
        raise errors.DeltaRejected(f"a delta's frame does not decompress: {e}") from e
    except Exception as e:  # zstandard.ZstdError is not importable where zstandard is missing
        if zstandard is not None and isinstance(e, zstandard.ZstdError):
            raise errors.DeltaRejected(f"a delta's frame does not decompress: {e}") from e
        raise
    if len(out) != size:
        raise errors.DeltaRejected(f"a delta's frame gave {len(out)} bytes where {size} belong")
    return out
