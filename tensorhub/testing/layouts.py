"""Llama-shaped models and the layouts real stacks hold them in (tests, examples, benchmarks).

- :func:`llama_schema`: a bf16 (or other dtype) Llama-shaped logical model: embedding, per layer
  q/k/v/o with GQA (k and v a quarter of q), gate/up/down (MLP 2.75x hidden), two norms; a final
  norm and the head.
- :func:`fsdp`: a trainer that holds every tensor cut by rows into ``shards`` (FSDP-like; one
  shard: the whole model).
- :func:`vllm_tp`: what vLLM's worker of TP rank ``rank`` holds: vocabulary-parallel embedding
  and head, fused column-parallel ``qkv_proj`` and ``gate_up_proj``, row-parallel ``o_proj``
  and ``down_proj``, norms replicated.
- :func:`model_at` / :func:`slice_of`: a version's whole model, reproducible in every process, and
  what a rank of a placement should hold of it (to check a read byte for byte).
"""

from __future__ import annotations

import torch

from tensorhub import placement as P


def llama_schema(layers: int, hidden: int, vocab: int = 32000, dtype: str = "bfloat16") -> P.Schema:
    """A Llama-shaped model of ``layers`` layers of width ``hidden`` (a multiple of 4)."""
    kv, inter = hidden // 4, hidden * 11 // 4
    ts = [("embed", (vocab, hidden))]
    for i in range(layers):
        ts += [(f"l{i}.q", (hidden, hidden)), (f"l{i}.k", (kv, hidden)), (f"l{i}.v", (kv, hidden)),
               (f"l{i}.o", (hidden, hidden)), (f"l{i}.gate", (inter, hidden)), (f"l{i}.up", (inter, hidden)),
               (f"l{i}.down", (hidden, inter)), (f"l{i}.in_norm", (hidden,)), (f"l{i}.post_norm", (hidden,))]
    ts += [("norm", (hidden,)), ("head", (vocab, hidden))]
    return P.Schema.of([P.GlobalTensor(n, dtype, s) for n, s in ts])


def fsdp(s: P.Schema, rank: int, shards: int) -> P.Placement:
    """FSDP-like: every tensor split by rows into ``shards``; rank ``rank``'s part."""
    return P.Placement.build([P.split(t, 0, rank, shards) for t in s.tensors], s)


def vllm_tp(s: P.Schema, rank: int, tp: int) -> P.Placement:
    """vLLM's tensor parallelism of a :func:`llama_schema` model: TP rank ``rank`` of ``tp``."""
    g = s.by_name()
    out = [P.split(g["embed"], 0, rank, tp, name="embed_tokens")]
    for i in range(sum(1 for n in g if n.endswith(".q"))):
        L = lambda n: g[f"l{i}.{n}"]  # noqa: E731
        out += [P.fused(f"l{i}.qkv_proj", [(L("q"), 0, rank, tp), (L("k"), 0, rank, tp), (L("v"), 0, rank, tp)]),
                P.split(L("o"), 1, rank, tp, name=f"l{i}.o_proj"),
                P.fused(f"l{i}.gate_up_proj", [(L("gate"), 0, rank, tp), (L("up"), 0, rank, tp)]),
                P.split(L("down"), 1, rank, tp, name=f"l{i}.down_proj"),
                P.whole(L("in_norm")), P.whole(L("post_norm"))]
    out += [P.whole(g["norm"]), P.split(g["head"], 0, rank, tp, name="lm_head")]
    return P.Placement.build(out, s)


def model_at(s: P.Schema, version: int) -> dict[str, torch.Tensor]:
    """Version ``version`` of the whole model: the same values in every process."""
    gen = torch.Generator().manual_seed(version)
    return {t.name: torch.randn(t.shape, generator=gen).to(getattr(torch, t.dtype)) for t in s.tensors}


def slice_of(p: P.Placement, full: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """What a handle of placement ``p`` should hold of ``full``: its local tensors, in order."""
    out = []
    for t in p.tensors:
        parts = []
        for pc in t.pieces:
            part = full[pc.tensor][tuple(slice(a, z) for a, z in zip(pc.box.start, pc.box.stop))]
            parts.append(part.unsqueeze(0) if pc.stack else part)
        out.append(torch.cat(parts) if len(parts) > 1 else parts[0].clone())
    return out
