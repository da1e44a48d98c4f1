"""Synthetic model weights for the demo, tests and benchmarks.

``transformer_spec`` describes a decoder-only transformer of about ``total_bytes`` (a few
hundred tensors: big projection matrices plus many tiny norms and biases). ``fill_version``
writes content that depends on (version, tensor index) at memcpy speed, and ``digest``
hashes every byte, so two processes can compare what they hold without moving it.
``evolve_version`` changes a version the way an RL step does instead (a few elements by a unit
in the last place), so that deltas between versions mean what they would in a real run.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import xxhash

Spec = list[tuple[str, str, tuple[int, ...]]]

_BLOCK_BYTES = 1 << 22
_block_cache: dict[int, torch.Tensor] = {}


def transformer_spec(total_bytes: int = 600 << 20, layers: int = 24, dtype: str = "bfloat16",
                     vocab: int = 32000) -> Spec:
    """A spec of ``(name, dtype, shape)`` whose sizes add up to roughly ``total_bytes``."""
    if total_bytes <= 0 or layers <= 0:
        raise ValueError("total_bytes and layers must be positive")
    elt = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    # 12 h^2 per layer + 2 * vocab * h for the embeddings; solve for h (multiple of 64).
    params = total_bytes // elt
    h = 64
    while 12 * (h + 64) ** 2 * layers + 2 * vocab * (h + 64) <= params:
        h += 64
    spec: Spec = [("embed.weight", dtype, (vocab, h))]
    for i in range(layers):
        p = f"layers.{i}."
        spec += [
            (p + "attn_norm.weight", dtype, (h,)),
            (p + "attn.qkv.weight", dtype, (3 * h, h)),
            (p + "attn.qkv.bias", dtype, (3 * h,)),
            (p + "attn.o.weight", dtype, (h, h)),
            (p + "mlp_norm.weight", dtype, (h,)),
            (p + "mlp.up.weight", dtype, (4 * h, h)),
            (p + "mlp.up.bias", dtype, (4 * h,)),
            (p + "mlp.down.weight", dtype, (h, 4 * h)),
            (p + "mlp.down.bias", dtype, (h,)),
        ]
    spec += [("final_norm.weight", dtype, (h,)), ("lm_head.weight", dtype, (vocab, h))]
    return spec


def small_spec(total_bytes: int = 4 << 20, big: int = 3, tiny: int = 20, dtype: str = "float32") -> Spec:
    """A few big tensors and many tiny ones; for tests."""
    elt = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    tiny_elems = 256
    big_elems = max(1, (total_bytes // elt - tiny * tiny_elems) // max(big, 1))
    spec: Spec = [(f"big.{i}", dtype, (big_elems,)) for i in range(big)]
    spec += [(f"tiny.{i}", dtype, (tiny_elems,)) for i in range(tiny)]
    return spec


def spec_bytes(spec: Spec) -> int:
    """Total bytes of a spec, without allocating it."""
    total = 0
    for _, dt, shape in spec:
        n = 1
        for d in shape:
            n *= d
        total += n * torch.empty((), dtype=getattr(torch, dt)).element_size()
    return total


def allocate(spec: Spec, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Zeroed tensors for ``spec`` (zeroing touches every page once, up front)."""
    return [(name, torch.zeros(shape, dtype=getattr(torch, dt), device=device)) for name, dt, shape in spec]


def _block() -> torch.Tensor:
    blk = _block_cache.get(0)
    if blk is None:
        g = torch.Generator().manual_seed(1234)
        blk = torch.randint(0, 256, (2 * _BLOCK_BYTES,), dtype=torch.uint8, generator=g)
        _block_cache[0] = blk
    return blk


def fill_version(tensors: Sequence[torch.Tensor], version: int) -> None:
    """Overwrite every tensor with bytes that depend on (version, index)."""
    blk = _block()
    for i, t in enumerate(tensors):
        flat = t.view(-1).view(torch.uint8) if t.numel() else None
        if flat is None:
            continue
        start = (version * 1_000_003 + i * 7919) % _BLOCK_BYTES
        pos = 0
        n = flat.numel()
        while pos < n:
            k = min(_BLOCK_BYTES, n - pos)
            flat[pos:pos + k].copy_(blk[start:start + k])
            pos += k


def evolve_version(tensors: Sequence[torch.Tensor], version: int, density: float) -> int:
    """An RL step's change, in place: about ``density`` of the 16-bit words of every tensor
    (a bf16 element, half an fp32 one) move by one unit in the last place (9 in 10) or two,
    up or down, at positions drawn from (``version``, tensor index): the same bytes in every
    process that starts from the same version. ``benchmarks/RESULTS.md`` ("Delta density")
    measured 1.7%, 4.3% and 11% of bf16 elements per step at lr 1e-6, 3e-6 and 1e-5 (fp32
    master weights cast to bf16), 80-89% of them by one unit. Returns the words changed."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density {density} is not within [0, 1]")
    changed = 0
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size() // 2
        if n == 0 or density == 0.0:
            continue
        rng = np.random.default_rng([version, i])
        # Positions as geometric gaps: O(changed), not a random draw per word.
        gaps = rng.geometric(density, size=int(n * density * 1.2) + 16)
        idx = np.cumsum(gaps) - 1
        idx = idx[idx < n]
        step = np.where(rng.random(idx.size) < 0.9, 1, 2).astype(np.int32)
        step *= np.where(rng.random(idx.size) < 0.5, 1, -1).astype(np.int32)
        words = t.detach().reshape(-1).view(torch.uint8)[: 2 * n].view(torch.int16).numpy().view(np.uint16)
        words[idx] = (words[idx].astype(np.int32) + step).astype(np.uint16)
        changed += int(idx.size)
    return changed


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """xxh3-128 over every byte of every tensor, in order."""
    h = xxhash.xxh3_128()
    for t in tensors:
        if t.numel():
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()
