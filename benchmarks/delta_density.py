"""How many bf16 weights an RL step changes, and what a lossless delta of one step costs.

    python benchmarks/delta_density.py --json [--steps 8] [--lrs 1e-6,3e-6,1e-5] [--hidden 256]

Issue 26 item 4. A small Llama-style transformer in plain torch (``transformers`` is not installed
here; the shapes follow a Llama config: RMSNorm, rotary attention with grouped-query heads,
SwiGLU MLP, untied embeddings and head; ``--hidden 256``: 4 layers, 8 heads, 2 KV heads, MLP 704,
vocabulary 4096, 4.9 M parameters) is trained with Adam (betas 0.9/0.999, eps 1e-8, no weight
decay) on a policy-gradient-like loss over random tokens: ``-(A * log p(token | prefix)).mean()``
with one normalised random advantage ``A`` per sequence (8 sequences of 64 tokens per step, a
fresh seeded draw each step). Two ways to hold the weights, same initialisation and batches:

  fp32_master  fp32 parameters and Adam state, cast to bf16 (round to nearest) after each step:
               what real RL stacks publish (Megatron, FSDP mixed precision, verl)
  bf16         bf16 parameters trained directly (Adam state in bf16 too): updates below half a
               bf16 step round away

After each step the bf16 bits of the whole model (one flat buffer, ``F`` bytes) are compared with
the previous step's. Per step and learning rate: the fraction of elements whose bits changed
(overall and per kind: embed, attention, mlp, norm, head), the same fraction against the version
2, 4 and 8 steps back (a seeder that skipped versions), and for each codec the encoded delta's
bytes / ``F`` with encode and decode rates (GB/s of ``F``; decode applies the delta in place on a
copy of the base and is checked bit-exact against the new version):

  sparse_i32       int32 indices of the changed elements + their new bf16 values
  sparse_varint    the same with the gaps between indices as LEB128 varints
  sparse_diff_zlib1  varint gaps, and new bits minus old bits per changed element (uint16,
                   wrapping; high-byte plane then low-byte plane), each through zlib level 1
  xor_zlib1/6      the two versions' bits XORed, then stdlib zlib level 1 / 6
  xor_lzma         the same, stdlib lzma preset 0
  planes_*         the XOR split into its high bytes (sign, exponent) and low bytes (exponent's
                   last bit, mantissa), each compressed alone
  *_zstd1, *_lz4   (sparse_diff, xor, planes) only where ``zstandard`` / ``lz4`` are importable (``zstandard`` is a
                   dependency since tensorhub.transport.delta; ``lz4`` is not)

Baseline from the same run: ``random_fill``, two fresh ``randn`` fills of the same size (what
``benchmarks/crossdc.py`` publishes as versions today), through every codec.
Human lines go to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import statistics
import sys
import time
import zlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # optional codecs: measured only where installed (the lock pins zstandard, not lz4)
    import zstandard
except ImportError:
    zstandard = None
try:
    import lz4.frame as lz4frame
except ImportError:
    lz4frame = None

VOCAB, SEQ, BATCH = 4096, 64, 8
SPANS = (2, 4, 8)


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the model


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dim of ``x`` (batch, heads, seq, head_dim)."""
    t, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(t, dtype=torch.float32), inv).to(x.dtype)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, mlp: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hidden // heads
        self.input_layernorm = RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, heads * self.hd, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(heads * self.hd, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.gate_proj = nn.Linear(hidden, mlp, bias=False)
        self.up_proj = nn.Linear(hidden, mlp, bias=False)
        self.down_proj = nn.Linear(mlp, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        q, k = rotary(q), rotary(k).repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v.repeat_interleave(rep, dim=1), is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, hidden: int, layers: int = 4) -> None:
        super().__init__()
        heads = max(1, hidden // 32)
        mlp = int(math.ceil(hidden * 8 / 3 / 64) * 64)
        self.embed_tokens = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, max(1, heads // 4), mlp) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)
        for m in self.modules():  # Llama's initializer_range
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def kind(name: str) -> str:
    if "embed" in name:
        return "embed"
    if "lm_head" in name:
        return "head"
    if "norm" in name:
        return "norm"
    if any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention"
    return "mlp"


def pg_step(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> float:
    """One policy-gradient-like step on random tokens with normalised random advantages."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    adv = torch.randn(BATCH, generator=gen)
    adv = (adv - adv.mean()) / (adv.std() + 1e-6)
    logp = torch.log_softmax(model(tokens[:, :-1]).float(), dim=-1).gather(2, tokens[:, 1:, None]).squeeze(2)
    loss = -(adv.to(logp.dtype)[:, None] * logp).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def bf16_bits(model: nn.Module) -> np.ndarray:
    """The model's weights as bf16 (round to nearest), as one flat uint16 array."""
    with torch.no_grad():
        flat = torch.cat([p.detach().to(torch.bfloat16).flatten() for p in model.parameters()])
    return flat.view(torch.int16).numpy().view(np.uint16).copy()


def train_versions(hidden: int, mode: str, lr: float, steps: int, seed: int) -> list[np.ndarray]:
    """Version 0 (the initial weights) and one bf16 version after each of ``steps`` steps."""
    torch.manual_seed(seed)
    model = Llama(hidden)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
    gen = torch.Generator().manual_seed(seed + 1)
    versions = [bf16_bits(model)]
    for _ in range(steps):
        pg_step(model, opt, gen)
        versions.append(bf16_bits(model))
    return versions


# ----------------------------------------------------------------------------- the codecs


def varint_encode(v: np.ndarray) -> np.ndarray:
    """LEB128 of non-negative int64 values, vectorised."""
    n = 1 + sum((v >= (1 << (7 * k))).astype(np.int64) for k in range(1, 5))
    start = np.cumsum(n) - n
    out = np.empty(int(n.sum()), np.uint8)
    for k in range(5):
        sel = n > k
        more = (n[sel] > k + 1).astype(np.uint8) << 7
        out[start[sel] + k] = ((v[sel] >> (7 * k)) & 0x7F).astype(np.uint8) | more
    return out


def varint_decode(b: np.ndarray) -> np.ndarray:
    if b.size == 0:
        return np.zeros(0, np.int64)
    last = (b & 0x80) == 0
    group = np.concatenate(([0], np.cumsum(last)[:-1]))
    starts = np.flatnonzero(np.concatenate(([True], last[:-1])))
    pos = np.arange(b.size) - starts[group]
    return np.add.reduceat((b & 0x7F).astype(np.int64) << (7 * pos), starts)


class Sparse:
    """Changed elements' indices (int32, or varint gaps) and their new values."""

    def __init__(self, varint: bool) -> None:
        self.varint = varint

    def encode(self, base: np.ndarray, new: np.ndarray) -> list[bytes]:
        idx = np.flatnonzero(base != new)
        vals = new[idx]
        if self.varint:
            gaps = np.diff(idx, prepend=-1) - 1
            return [varint_encode(gaps).tobytes(), vals.tobytes()]
        return [idx.astype(np.int32).tobytes(), vals.tobytes()]

    def apply(self, out: np.ndarray, parts: list[bytes]) -> None:
        vals = np.frombuffer(parts[1], np.uint16)
        if self.varint:
            idx = np.cumsum(varint_decode(np.frombuffer(parts[0], np.uint8)) + 1) - 1
        else:
            idx = np.frombuffer(parts[0], np.int32)
        out[idx] = vals


class SparseDiff:
    """Varint gaps, then each changed element's new bits minus its old bits (uint16, wrapping):
    a step moves most values by a unit or two in the last place, so the differences compress."""

    def __init__(self, compress, decompress) -> None:
        self.compress, self.decompress = compress, decompress

    def encode(self, base: np.ndarray, new: np.ndarray) -> list[bytes]:
        idx = np.flatnonzero(base != new)
        gaps = varint_encode(np.diff(idx, prepend=-1) - 1)
        d = (new[idx] - base[idx]).view(np.uint8).reshape(-1, 2)
        return [self.compress(gaps.tobytes()),
                self.compress(np.ascontiguousarray(d[:, 1]).tobytes() + np.ascontiguousarray(d[:, 0]).tobytes())]

    def apply(self, out: np.ndarray, parts: list[bytes]) -> None:
        idx = np.cumsum(varint_decode(np.frombuffer(self.decompress(parts[0]), np.uint8)) + 1) - 1
        planes = np.frombuffer(self.decompress(parts[1]), np.uint8).reshape(2, -1)
        d = np.empty((idx.size, 2), np.uint8)
        d[:, 1], d[:, 0] = planes[0], planes[1]
        out[idx] += d.reshape(-1).view(np.uint16)


class Xor:
    """The two versions' bits XORed, then compressed whole or as two byte planes."""

    def __init__(self, compress, decompress, planes: bool) -> None:
        self.compress, self.decompress, self.planes = compress, decompress, planes

    def encode(self, base: np.ndarray, new: np.ndarray) -> list[bytes]:
        x = np.bitwise_xor(base, new)
        if not self.planes:
            return [self.compress(x.tobytes())]
        b = x.view(np.uint8).reshape(-1, 2)  # little-endian: [:, 0] low byte, [:, 1] high byte
        return [self.compress(np.ascontiguousarray(b[:, 1]).tobytes()),
                self.compress(np.ascontiguousarray(b[:, 0]).tobytes())]

    def apply(self, out: np.ndarray, parts: list[bytes]) -> None:
        if self.planes:
            b = np.empty((out.size, 2), np.uint8)
            b[:, 1] = np.frombuffer(self.decompress(parts[0]), np.uint8)
            b[:, 0] = np.frombuffer(self.decompress(parts[1]), np.uint8)
            x = b.reshape(-1).view(np.uint16)
        else:
            x = np.frombuffer(self.decompress(parts[0]), np.uint16)
        np.bitwise_xor(out, x, out=out)


def codecs() -> dict:
    comps = {"zlib1": (lambda d: zlib.compress(d, 1), zlib.decompress),
             "zlib6": (lambda d: zlib.compress(d, 6), zlib.decompress),
             "lzma": (lambda d: lzma.compress(d, preset=0), lzma.decompress)}
    if zstandard is not None:
        comps["zstd1"] = (zstandard.ZstdCompressor(level=1).compress, zstandard.ZstdDecompressor().decompress)
    if lz4frame is not None:
        comps["lz4"] = (lz4frame.compress, lz4frame.decompress)
    out = {"sparse_i32": Sparse(varint=False), "sparse_varint": Sparse(varint=True),
           "sparse_diff_zlib1": SparseDiff(*comps["zlib1"])}
    for name in ("zstd1", "lz4"):
        if name in comps:
            out[f"sparse_diff_{name}"] = SparseDiff(*comps[name])
    for planes in (False, True):
        for name, (c, d) in comps.items():
            out[f"{'planes' if planes else 'xor'}_{name}"] = Xor(c, d, planes)
    return out


def measure(codec, base: np.ndarray, new: np.ndarray) -> dict:
    full = new.nbytes
    t0 = time.perf_counter()
    parts = codec.encode(base, new)
    t1 = time.perf_counter()
    out = base.copy()
    t2 = time.perf_counter()
    codec.apply(out, parts)
    t3 = time.perf_counter()
    assert np.array_equal(out, new), "a codec is not lossless"
    return {"ratio": sum(len(p) for p in parts) / full,
            "enc_GBps": full / max(t1 - t0, 1e-9) / 1e9, "dec_GBps": full / max(t3 - t2, 1e-9) / 1e9}


# ----------------------------------------------------------------------------- the run


def kinds_of(hidden: int) -> dict[str, np.ndarray]:
    """Per kind, a boolean mask over the flat buffer (same order as ``model.parameters()``)."""
    model = Llama(hidden)
    names, sizes = zip(*[(n, p.numel()) for n, p in model.named_parameters()])
    owner = np.repeat(np.array([kind(n) for n in names]), sizes)
    return {k: owner == k for k in ("embed", "attention", "mlp", "norm", "head")}


def run(args) -> dict:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    cods = codecs()
    masks = kinds_of(args.hidden)
    elems = int(next(iter(masks.values())).size)
    runs = []
    for mode in ("fp32_master", "bf16"):
        for lr in args.lrs:
            t0 = time.perf_counter()
            vs = train_versions(args.hidden, mode, lr, args.steps, args.seed)
            train_s = time.perf_counter() - t0
            steps = []
            for s in range(1, len(vs)):
                diff = vs[s] != vs[s - 1]
                row = {"step": s, "changed": float(diff.mean()),
                       "changed_by_kind": {k: float(diff[m].mean()) for k, m in masks.items()},
                       "changed_vs_back": {str(k): float((vs[s] != vs[s - k]).mean()) for k in SPANS if s >= k}}
                row["codecs"] = {n: measure(c, vs[s - 1], vs[s]) for n, c in cods.items()}
                steps.append(row)
            runs.append({"mode": mode, "lr": lr, "train_s": round(train_s, 2), "steps": steps,
                         "summary": summarise(steps)})
            sm = runs[-1]["summary"]
            say(f"{mode:12s} lr {lr:.0e}: changed {sm['changed_median']:.4f} per step "
                f"(kinds {', '.join(f'{k} {v:.4f}' for k, v in sm['changed_by_kind_median'].items())}); "
                f"sparse_varint {sm['codecs']['sparse_varint']['ratio']:.4f}, "
                f"planes_zlib1 {sm['codecs']['planes_zlib1']['ratio']:.4f} of the version; train {train_s:.1f} s")
    rng = np.random.default_rng(args.seed)
    fills = [torch.from_numpy(rng.standard_normal(elems, dtype=np.float32)).to(torch.bfloat16)
             .view(torch.int16).numpy().view(np.uint16).copy() for _ in range(2)]
    random_fill = {n: measure(c, fills[0], fills[1]) for n, c in cods.items()}
    return {"bench": "delta_density", "hidden": args.hidden, "params": elems, "version_bytes": elems * 2,
            "steps": args.steps, "lrs": args.lrs, "seed": args.seed, "batch": [BATCH, SEQ], "vocab": VOCAB,
            "codecs": list(cods), "runs": runs, "random_fill": random_fill}


def summarise(steps: list[dict]) -> dict:
    med = statistics.median
    return {"changed_median": med(r["changed"] for r in steps),
            "changed_min": min(r["changed"] for r in steps), "changed_max": max(r["changed"] for r in steps),
            "changed_by_kind_median": {k: med(r["changed_by_kind"][k] for r in steps) for k in steps[0]["changed_by_kind"]},
            "changed_vs_back_last": steps[-1]["changed_vs_back"],
            "codecs": {n: {f: med(r["codecs"][n][f] for r in steps) for f in ("ratio", "enc_GBps", "dec_GBps")}
                       | {"ratio_max": max(r["codecs"][n]["ratio"] for r in steps)}
                       for n in steps[0]["codecs"]}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[1e-6, 3e-6, 1e-5])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for training")
    ap.add_argument("--json", action="store_true", help="print the JSON summary line on stdout")
    args = ap.parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
