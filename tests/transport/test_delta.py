"""Lossless deltas (tensorhub/transport/delta.py): bit-exact round trips, a wrong base refused
before any write, damaged or malformed delta bytes refused, sizes bounded by the target.

    trainer: (v-1, v) -> encode -> delta bytes ==slow link==> seeder: v-1 bytes + delta -> v
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from tensorhub import errors
from tensorhub.transport import delta


def _evolve(t: torch.Tensor, density: float, seed: int) -> torch.Tensor:
    """A copy of ``t`` with about ``density`` of its elements nudged (an RL step's shape)."""
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    flat = out.view(-1)
    mask = torch.rand(flat.numel(), generator=g) < density
    flat[mask] = flat[mask] * (1 + 1e-2 * torch.randn(int(mask.sum()), generator=g)).to(t.dtype)
    return out


def _pair(dtype, density=0.05, seed=0, shapes=((257, 64), (3,), (1000,), (0,))):
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    new = [_evolve(t, density, seed + 1 + i) for i, t in enumerate(base)]
    return base, new


def _roundtrip(base, new, codec=0):
    buf = delta.encode(delta.segments(base), delta.segments(new), codec)
    target = [t.clone() for t in base]
    info = delta.apply(buf, delta.segments(target))
    return buf, target, info


@pytest.mark.parametrize("codec", [delta.CODEC_ZSTD, delta.CODEC_ZLIB])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.uint8])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.3, 1.0])
def test_a_delta_rebuilds_the_new_version_bit_for_bit(codec, dtype, density):
    base, new = _pair(dtype, density) if dtype is not torch.uint8 else (
        [torch.arange(n, dtype=torch.uint8) for n in (7, 0, 300)],  # odd segments: tails
        [torch.arange(n, dtype=torch.uint8) + (1 if density else 0) for n in (7, 0, 300)])
    buf, target, info = _roundtrip(base, new, codec)
    for a, b in zip(target, new):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert info.nbytes == len(buf) and info.codec == codec


def test_a_sparse_step_crosses_in_a_fraction_of_the_version():
    base, new = _pair(torch.bfloat16, density=0.02, shapes=((512, 512),))
    buf, _, info = _roundtrip(base, new)
    assert 0 < info.changed <= 0.03 * 512 * 512
    assert len(buf) < 0.05 * base[0].numel() * 2
    assert delta.peek(buf).changed == info.changed


def test_a_wrong_base_is_refused_before_anything_is_written():
    base, new = _pair(torch.bfloat16)
    buf = delta.encode(delta.segments(base), delta.segments(new))
    other = [_evolve(t, 0.01, 99) for t in base]  # another version: v-2, or a host copy of elsewhere
    before = [t.clone() for t in other]
    with pytest.raises(errors.DeltaWrongBase):
        delta.apply(buf, delta.segments(other))
    assert all(torch.equal(a, b) for a, b in zip(other, before))


def test_a_base_digest_passed_in_is_trusted_and_the_result_still_checked():
    """A caller that knows its base's digest skips that pass; a target that is not that base
    is then caught by the result's digest (the target holds garbage)."""
    base, new = _pair(torch.bfloat16)
    buf = delta.encode(delta.segments(base), delta.segments(new))
    other = [_evolve(t, 0.01, 99) for t in base]
    with pytest.raises(errors.DeltaRejected) as e:
        delta.apply(buf, delta.segments(other), base_digest=delta.peek(buf).base_digest)
    assert not isinstance(e.value, errors.DeltaWrongBase)


@pytest.mark.parametrize("where", ["header_len", "payload_middle", "payload_last", "magic", "truncated", "extra"])
def test_damaged_delta_bytes_are_refused_and_the_target_untouched(where):
    base, new = _pair(torch.bfloat16)
    buf = bytearray(delta.encode(delta.segments(base), delta.segments(new)))
    if where == "header_len":
        buf[28] ^= 1  # changed: the lengths no longer fit
    elif where == "payload_middle":
        buf[delta.HEADER.size + (len(buf) - delta.HEADER.size) // 2] ^= 0x10
    elif where == "payload_last":
        buf[-1] ^= 0x80
    elif where == "magic":
        buf[0:4] = b"XXXX"
    elif where == "truncated":
        buf = buf[:-3]
    else:
        buf += b"\0"
    target = [t.clone() for t in base]
    with pytest.raises(errors.DeltaRejected):
        delta.apply(bytes(buf), delta.segments(target))
    assert all(torch.equal(a, b) for a, b in zip(target, base))


def _forge(base, *, changed=None, gaps=None, diffs=None, total=None, frame_size=None):
    """A delta with a consistent payload checksum but hostile contents (another process's bug)."""
    n = changed if changed is not None else len(gaps)
    gaps = np.asarray(gaps, "<u4")
    diffs = np.asarray(diffs if diffs is not None else [1] * len(gaps), "<u2")
    import zstandard

    gz = zstandard.ZstdCompressor().compress(gaps.view(np.uint8).reshape(-1, 4).T.tobytes())
    if frame_size is not None:
        gz = zstandard.ZstdCompressor().compress(b"\0" * frame_size)
    dz = zstandard.ZstdCompressor().compress(diffs.view(np.uint8).reshape(-1, 2)[:, ::-1].T.tobytes())
    segs = delta.segments(base)
    payload = gz + dz
    import xxhash

    head = delta.HEADER.pack(delta.MAGIC, delta.CODEC_ZSTD, 0, 0, total or sum(s.size for s in segs), n, len(gz),
                             len(dz), 0, delta.digest(segs), b"\0" * 16, xxhash.xxh3_64_intdigest(payload))
    return head + payload


@pytest.mark.parametrize("case", ["index_past_end", "more_changed_than_words", "frame_bigger_than_declared",
                                  "other_size"])
def test_hostile_lengths_and_indices_are_refused_before_any_write(case):
    base = [torch.zeros(64, dtype=torch.bfloat16)]
    kw = {"index_past_end": dict(gaps=[10, 60]),  # indices 10 and 71 of 64 words
          "more_changed_than_words": dict(changed=65, gaps=[0] * 65),
          "frame_bigger_than_declared": dict(gaps=[1, 2], frame_size=1 << 20),
          "other_size": dict(gaps=[1], total=256)}[case]
    buf = _forge(base, **kw)
    target = [t.clone() for t in base]
    with pytest.raises(errors.DeltaRejected):
        delta.apply(buf, delta.segments(target))
    assert torch.equal(target[0], base[0])


def test_versions_of_another_layout_get_no_delta():
    with pytest.raises(errors.DeltaRejected):
        delta.encode(delta.segments([torch.zeros(4)]), delta.segments([torch.zeros(5)]))
    with pytest.raises(errors.DeltaRejected):
        delta.peek(b"THD1")
    assert struct.calcsize("<4sBBHQQQQQ16s16sQ") == delta.HEADER.size


@pytest.mark.parametrize("density", [0.017, 0.043, 0.11])
def test_benchmark_versions_evolve_at_the_measured_density_and_their_deltas_are_small(density):
    """``workload.evolve_version`` (what benchmarks/crossdc.py publishes): about ``density`` of
    the words change, the same in every process, and the delta stays far under 0.15 of a shard."""
    from tensorhub.testing import workload

    spec = workload.small_spec(2 << 20, big=4, tiny=8, dtype="bfloat16")
    a = [t for _, t in workload.allocate(spec)]
    workload.fill_version(a, 0)
    b = [t.clone() for t in a]
    changed = workload.evolve_version(b, 1, density)
    again = [t.clone() for t in a]
    workload.evolve_version(again, 1, density)
    assert workload.digest(again) == workload.digest(b)
    words = sum(t.numel() for t in a)
    assert abs(changed / words - density) < 0.15 * density
    buf, target, _ = _roundtrip(a, b)
    assert workload.digest(target) == workload.digest(b)
    assert len(buf) / (2 * words) < min(0.15, 1.5 * density)


def test_a_seeder_rebuilds_the_new_version_from_its_published_base_checked_against_its_checksums():
    """trainer (v-1, v) -> delta -> seeder's staging copy (v-1, published, not written) -> v
    in a scratch copy, every unit checked against v's checksums as the trainer published them."""
    from tensorhub.layout import Layout, checksum_all

    base, new = _pair(torch.bfloat16, shapes=((257, 64), (3,), (1000,)))
    layout = Layout.build([(f"t{i}", t) for i, t in enumerate(new)], unit_bytes=4096, pack_below_bytes=1024)
    sums = checksum_all(new, layout)
    buf = delta.encode(delta.segments(base), delta.segments(new))
    kept = [t.clone() for t in base]
    out, got = delta.rebuild(buf, base, layout, sums)
    assert got == sums and delta.rebuild(buf, base, layout)[1] == sums
    assert all(torch.equal(a, b) for a, b in zip(out, new))
    assert all(torch.equal(a, b) for a, b in zip(base, kept))  # the published base is untouched
    with pytest.raises(errors.DeltaWrongBase):
        delta.rebuild(buf, new, layout, sums)  # the seeder holds another version than the base
    with pytest.raises(errors.DeltaRejected):
        delta.rebuild(buf, base, layout, [s ^ 1 for s in sums])  # checksums of another version
