"""The placement of one vLLM worker rank's parameters, derived from vLLM's own layers, and
applying a verified read of it to the live model (the *direct* path of ``backend="tensorhub"``).

:func:`derive` walks the model's parameters and says, for each, which boxes of which checkpoint
tensors it holds (:mod:`tensorhub.placement`), from what the parameter's layer declares: its
class (``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``ColumnParallelLinear``,
``RowParallelLinear``, ``ReplicatedLinear``, ``VocabParallelEmbedding`` / ``ParallelLMHead``), its
TP rank and size, its ``output_dim`` / ``input_dim``, the model's ``packed_modules_mapping``
(``qkv_proj`` = rows of ``q_proj``, ``k_proj``, ``v_proj``; ``gate_up_proj`` = ``gate_proj``,
``up_proj``), GQA's replicated KV heads, and the vocabulary padding of embeddings. It fails
closed, as vLLM's ``nccl_m2n`` resolver does: a parameter whose layer is quantized, packed,
pre-sharded, of an unknown class, or named nowhere in the checkpoint is not guessed at; it is
returned in ``fallback`` with the reason, and its layer is loaded the checkpoint way: the
checkpoint tensors no derived parameter takes (``residual``) are read whole into the same buffer
and go through the model's ``load_weights`` first (the engine's *mixed* path; ``path="direct"``
refuses it instead).

The direct path reads into a *slice buffer*: one tensor per parameter, exactly the rank's
slice (``1/TP`` of the model per rank, where the checkpoint-format path holds the whole model
per rank), registered with the derived placement, so the server plans a resharded read and each
rank receives only its bytes. :meth:`DirectLayout.apply` then puts the verified version into the
model: a copy into live parameters, and on vLLM's CPU build a re-pack of every layer whose GEMM
packs its weight (``dispatch_cpu_unquantized_gemm``: the packed copy is the only one the kernels
read, and linear layers free their unpacked weight). The buffer is never the live parameter, so
a failed or abandoned read leaves the engine on its previous weights (all or nothing); reading
straight into live GPU parameters, without the buffer, would give that up and is not built.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from tensorhub import errors
from tensorhub import placement as P

log = logging.getLogger(__name__)

DERIVATION = 2
"""Bumped when the derivation changes: part of :func:`layout_key`, so engines of an older and a
newer derivation never share a layout class."""


@dataclass
class Target:
    """One parameter the direct path fills: the live ``module.<attr>`` and its slice's placement.
    ``rows``: the parameter's leading rows that hold checkpoint bytes (fewer than its own rows
    when vLLM pads the vocabulary)."""

    name: str
    module: torch.nn.Module
    attr: str
    local: P.LocalPlacement
    rows: int


@dataclass
class DirectLayout:
    """What :func:`derive` found for one worker rank."""

    placement: Optional[P.Placement]
    """The rank's placement (the targets' slices in model order, then the residual checkpoint
    tensors whole), None when nothing could be derived."""
    targets: list[Target] = field(default_factory=list)
    fallback: dict[str, str] = field(default_factory=dict)
    """Parameters (or checkpoint tensors) the direct path cannot express, with the reason."""
    schema: Optional[P.Schema] = None
    """The checkpoint's schema it was derived over (:func:`layout_key` names it)."""
    residual: list[P.GlobalTensor] = field(default_factory=list)
    """The checkpoint tensors no target takes (what the layers in ``fallback`` load from), read
    whole and loaded with the model's ``load_weights``: the per-parameter mix of the two paths."""
    by_checkpoint: list[str] = field(default_factory=list)
    """The parameters ``load_weights`` must load from ``residual`` (every parameter of a layer
    with one in ``fallback``: a layer is loaded one way)."""

    @property
    def mixed(self) -> bool:
        """Whether some parameters are loaded from whole checkpoint tensors (``residual``)."""
        return bool(self.residual or self.by_checkpoint)

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """A slice buffer per target, then a whole buffer per residual checkpoint tensor, in
        placement order, on the parameters' device (zeroed: their memory is touched once, here,
        not by the first update)."""
        out = []
        for t in self.targets:
            param = getattr(t.module, t.attr)
            out.append((t.name, torch.zeros(t.local.shape, dtype=getattr(torch, t.local.dtype), device=param.device)))
        device = out[0][1].device if out else torch.device("cpu")
        out += [(g.name, torch.zeros(g.shape, dtype=getattr(torch, g.dtype), device=device)) for g in self.residual]
        return out

    def apply(self, model: torch.nn.Module, buffers: list[tuple[str, torch.Tensor]],
              load_weights: Optional[Callable[[list[tuple[str, torch.Tensor]]], Optional[set]]] = None) -> None:
        """Put the buffers' (verified) bytes into the model. The residual checkpoint tensors go
        first, through ``load_weights`` (the engine's layerwise reload around the model's own):
        when it says what it loaded (vLLM's models return the names), every parameter of
        ``by_checkpoint`` must be among them (``LayoutMismatch`` otherwise, before any direct
        parameter is touched). Then a copy into each live parameter
        (cast to its dtype when vLLM keeps it in another, as the CPU build does with some
        biases); a layer whose weight vLLM packed and freed gets it back for the time of a
        re-pack. Then every CPU-packed layer whose live weight changed is packed again, but an
        input embedding that computes no logits (:func:`lookup_only_embeddings`), whose packed
        copy is dropped and made again only if it is ever used. No copy of a layer is made on
        the way (but on a Zen CPU, whose packer may keep the tensor)."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.platforms import current_platform

        direct, whole = buffers[:len(self.targets)], buffers[len(self.targets):]
        assert [n for n, _ in whole] == [g.name for g in self.residual]
        if whole or self.by_checkpoint:
            if load_weights is None:
                raise errors.LayoutMismatch("a mixed layout needs load_weights for its residual checkpoint tensors")
            loaded = load_weights(whole)
            missing = [n for n in self.by_checkpoint if loaded is not None and n not in loaded]
            if missing:
                raise errors.LayoutMismatch(f"load_weights did not load {len(missing)} parameter(s) the direct path "
                                            f"left to it from the checkpoint, e.g. {missing[0]!r}")
        # a packer that may keep a reference to the weight it is given instead of copying it
        keeps_reference = current_platform.is_zen_cpu()
        changed: set[int] = set()
        for t, (name, buf) in zip(self.targets, direct):
            assert name == t.name
            param = getattr(t.module, t.attr)
            if _packed_and_freed(t.module, t.attr, param):
                # the weight lives only in the GEMM's packed copy: pack a new one from the buffer
                # (oneDNN and the SGL kernels copy it; measured, a oneDNN handle does not follow
                # writes to the tensor it was made from), then free the weight again
                t.module.weight = torch.nn.Parameter(buf.clone() if keeps_reference else buf, requires_grad=False)
                t.module.cpu_linear = None  # the old packed copy goes first: at most one layer's in flight
                dispatch_cpu_unquantized_gemm(t.module, remove_weight=True)
                if t.module.weight.numel():  # torch's linear: the weight stays live, not our buffer
                    t.module.weight = torch.nn.Parameter(buf.clone(), requires_grad=False)
                continue
            with torch.no_grad():
                param.data[: t.rows].copy_(buf)
            changed.add(id(param))
        # a packed copy of a live weight (embeddings, a tied lm_head): again now, or at its
        # first use for an input embedding that computes no logits
        stale = [m for w, mods in cpu_packed_users(model).items() if w in changed for m in mods]
        lookups = set(map(id, lookup_only_embeddings(model)))
        repack_live(m for m in stale if id(m) not in lookups)
        for m in stale:
            if id(m) in lookups:
                m.cpu_linear = PackOnFirstUse(m)  # the old packed copy goes now


def lookup_only_embeddings(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The input embeddings that compute no logits: ``embed_tokens`` when the model has a
    distinct ``lm_head`` (a ``ParallelLMHead`` that is neither the embedding nor shares its
    weight). vLLM's CPU build packs every embedding's weight for its ``apply`` (the product with
    the weight), which only the logits head calls; such an embedding is only looked up, so
    packing it again after each update is wasted (a quarter of a direct load in the benchmark:
    0.53 s with it, 0.40 s without)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    if not heads:
        return []
    return [m for m in model.modules() if type(m) is VocabParallelEmbedding and hasattr(m, "cpu_linear")
            and all(h is not m and h.weight is not m.weight for h in heads)]


class PackOnFirstUse:
    """A module's ``cpu_linear`` until first called: packs the module's live weight then (vLLM's
    dispatch replaces this attribute) and computes with the new packed copy, so a call that
    does come (a model that computes logits from its input embedding after all) never uses a
    stale copy."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, x, weight, bias):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(self.module, remove_weight=False)
        return self.module.cpu_linear(x, weight, bias)


def cpu_packed_users(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """The modules that keep a CPU-packed copy (``cpu_linear``) of a live 2-D weight, by the
    weight's id (several when a weight is tied)."""
    users: dict[int, list[torch.nn.Module]] = {}
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if hasattr(mod, "cpu_linear") and isinstance(w, torch.Tensor) and w.ndim == 2 and w.numel() and not w.is_meta:
            users.setdefault(id(w), []).append(mod)
    return users


def repack_live(modules) -> None:
    """Pack each module's live weight again (its old packed copy dropped first)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for mod in modules:
        mod.cpu_linear = None
        dispatch_cpu_unquantized_gemm(mod, remove_weight=False)


def _packed_and_freed(module: torch.nn.Module, attr: str, param: torch.Tensor) -> bool:
    return attr == "weight" and hasattr(module, "cpu_linear") and param.numel() == 0


def layout_key(schema: P.Schema, model: torch.nn.Module, tp_size: int) -> str:
    """The layout class key of a vLLM engine: the same in every engine of the same model class,
    checkpoint schema and TP degree (their ranks derive the same placements), different
    otherwise."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{DERIVATION}|{type(model).__module__}.{type(model).__qualname__}|tp={tp_size}|".encode())
    h.update(schema.digest().encode())
    return f"vllm-tp{tp_size}-{h.hexdigest()}"


def schema_of(tensors) -> P.Schema:
    """The checkpoint's schema from tensors with ``name``, ``dtype`` (a name) and ``shape`` (a
    trainer shard's layout, ``LayoutInfo.tensors``)."""
    return P.Schema.of(P.GlobalTensor(t.name, t.dtype, tuple(t.shape)) for t in tensors)


def derive(model: torch.nn.Module, schema: P.Schema) -> DirectLayout:
    """This worker rank's placement of ``model``'s parameters over ``schema`` (the checkpoint's
    tensors, as the trainer publishes them), or the parameters it cannot express (module doc)."""
    from vllm.model_executor.layers.layernorm import LayerNorm, RMSNorm
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    globals_ = schema.by_name()
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    targets: list[Target] = []
    fallback: dict[str, str] = {}
    fallen: set[int] = set()  # the modules with a parameter in fallback
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            name = f"{mod_name}.{attr}" if mod_name else attr
            if id(param) in seen:
                continue
            seen.add(id(param))
            try:
                if any(getattr(param, a, None) is not None for a in ("packed_dim", "packed_factor",
                                                                   "marlin_tile_size")) \
                        or any(bool(getattr(param, a, False)) for a in ("is_sharded_weight", "is_transposed",
                                                                       "needs_scalar_to_array")):
                    raise _Unsupported("packed, pre-sharded or transformed storage")
                qm = getattr(module, "quant_method", None)
                if isinstance(module, VocabParallelEmbedding):
                    if not isinstance(qm, UnquantizedEmbeddingMethod):
                        raise _Unsupported(f"quantized ({type(qm).__name__})")
                    local, rows = _embedding(name, module, attr, param, globals_)
                elif isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
                    if not isinstance(qm, UnquantizedLinearMethod):
                        raise _Unsupported(f"quantized ({type(qm).__name__})")
                    parts = _linear_parts(mod_name, module, attr, param, packed, globals_)
                    local, rows = P.concat(name, parts), None
                elif type(module) in (RMSNorm, LayerNorm) and attr in ("weight", "bias"):
                    g = _global(globals_, name)
                    if tuple(g.shape) != tuple(param.shape):
                        raise _Unsupported(f"a norm of shape {list(param.shape)}, the checkpoint's is {list(g.shape)}")
                    local, rows = P.whole(g, name=name), None
                else:
                    raise _Unsupported(f"a {type(module).__name__} parameter (no known placement)")
                if rows is None:
                    rows = local.shape[0] if local.shape else 0
                _check_local(name, module, attr, param, local, rows)
                targets.append(Target(name, module, attr, local, rows))
            except _Unsupported as e:
                fallback[name] = str(e)
                fallen.add(id(module))
    # a layer is loaded one way: a parameter that falls back takes its layer's others with it
    by_checkpoint = [t.name for t in targets if id(t.module) in fallen] + [n for n in fallback]
    targets = [t for t in targets if id(t.module) not in fallen]
    covered = {p.tensor for t in targets for p in t.local.pieces}
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    residual = [g for g in schema.tensors if g.name not in covered and not (tied and g.name.endswith("lm_head.weight"))]
    for g in residual:
        fallback.setdefault(g.name, "a checkpoint tensor no parameter of the engine takes directly")
    names = {t.name for t in targets}
    if not targets or any(g.name in names for g in residual):
        return DirectLayout(None, [], fallback, schema)
    used = sorted(covered | {g.name for g in residual})
    placement = P.Placement.build([t.local for t in targets] + [P.whole(g) for g in residual],
                                  P.Schema.of(globals_[n] for n in used))
    params = {n for n, _ in model.named_parameters()}
    return DirectLayout(placement, targets, fallback, schema, residual, [n for n in by_checkpoint if n in params])


class _Unsupported(Exception):
    pass


def _global(globals_: dict, name: str) -> P.GlobalTensor:
    g = globals_.get(name)
    if g is None:
        raise _Unsupported(f"no checkpoint tensor {name!r}")
    return g


def _tp(module) -> tuple[int, int]:
    return int(getattr(module, "tp_rank", 0) or 0), int(getattr(module, "tp_size", 1) or 1)


def _rows(g: P.GlobalTensor, a: int, b: int) -> tuple[P.GlobalTensor, P.Box]:
    if not 0 <= a <= b <= g.shape[0]:
        raise _Unsupported(f"rows [{a}:{b}] outside {g.name!r} of {g.shape[0]} rows")
    return g, P.Box((a,) + (0,) * (len(g.shape) - 1), (b,) + tuple(g.shape[1:]))


def _linear_parts(mod_name, module, attr, param, packed, globals_):
    """The (global tensor, box) parts of a linear layer's weight or bias, in local row order."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear as Column
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear as Merged
    from vllm.model_executor.layers.linear import QKVParallelLinear as QKV
    from vllm.model_executor.layers.linear import RowParallelLinear as Row

    tp_rank, tp_size = _tp(module)
    prefix, _, leaf = mod_name.rpartition(".")
    subs = packed.get(leaf)

    def sub_global(i: int) -> P.GlobalTensor:
        if not subs or i >= len(subs):
            raise _Unsupported(f"fused layer {leaf!r} is not in the model's packed_modules_mapping")
        return _global(globals_, f"{prefix}.{subs[i]}.{attr}" if prefix else f"{subs[i]}.{attr}")

    own = f"{mod_name}.{attr}"
    out_dim, in_dim = _dims(module, attr, param)
    if isinstance(module, QKV):
        if out_dim != 0:
            raise _Unsupported("a QKV parameter without output_dim 0")
        kv_rank = tp_rank // module.num_kv_head_replicas
        q, k, v = sub_global(0), sub_global(1), sub_global(2)
        nq, nk, nv = (module.num_heads * module.head_size, module.num_kv_heads * module.head_size,
                      module.num_kv_heads * module.v_head_size)
        return [_rows(q, tp_rank * nq, (tp_rank + 1) * nq), _rows(k, kv_rank * nk, (kv_rank + 1) * nk),
                _rows(v, kv_rank * nv, (kv_rank + 1) * nv)]
    if isinstance(module, Merged):
        if out_dim != 0:
            raise _Unsupported("a merged parameter without output_dim 0")
        parts = []
        for i, size in enumerate(module.output_sizes):
            n = size // tp_size
            parts.append(_rows(sub_global(i), tp_rank * n, (tp_rank + 1) * n))
        return parts
    if isinstance(module, Column):
        g = _global(globals_, own)
        if out_dim != 0:
            raise _Unsupported("a column-parallel parameter without output_dim 0")
        n = g.shape[0] // tp_size
        return [_rows(g, tp_rank * n, (tp_rank + 1) * n)]
    g = _global(globals_, own)
    if isinstance(module, Row) and in_dim == 1 and tp_size > 1:
        if len(g.shape) != 2 or g.shape[1] % tp_size:
            raise _Unsupported(f"a row-parallel weight of shape {list(g.shape)} for TP={tp_size}")
        n = g.shape[1] // tp_size
        return [(g, P.Box((0, tp_rank * n), (g.shape[0], (tp_rank + 1) * n)))]
    if in_dim not in (None, 1) or out_dim not in (None, 0):
        raise _Unsupported("unexpected input_dim / output_dim")
    return [(g, g.full())]  # replicated: a ReplicatedLinear, a row-parallel bias, TP=1


def _dims(module, attr, param) -> tuple[Optional[int], Optional[int]]:
    """A parameter's ``output_dim`` and ``input_dim``. A CPU-packed layer's freed weight is a new,
    empty ``Parameter`` without them: an unquantized linear weight declares output 0, input 1
    (``UnquantizedLinearMethod.create_weights``)."""
    if _packed_and_freed(module, attr, param):
        return 0, 1
    return getattr(param, "output_dim", None), getattr(param, "input_dim", None)


def _embedding(name, module, attr, param, globals_) -> tuple[P.LocalPlacement, int]:
    if attr != "weight":
        raise _Unsupported(f"an embedding's {attr!r}")
    g = _global(globals_, name)
    si = module.shard_indices
    if si.num_added_elements:
        raise _Unsupported("an embedding with added (LoRA) vocabulary")
    a, b = si.org_vocab_start_index, si.org_vocab_end_index
    if b - a == 0:
        raise _Unsupported("an empty vocabulary shard")
    return P.concat(name, [_rows(g, a, b)]), b - a


def _check_local(name, module, attr, param, local: P.LocalPlacement, rows: int) -> None:
    """The derived slice must be the parameter's shape (its leading ``rows`` for a padded
    vocabulary); a CPU-packed layer's freed weight is checked against the layer's sizes."""
    shape = tuple(param.shape)
    if _packed_and_freed(module, attr, param):
        shape = (int(module.output_size_per_partition), int(module.input_size_per_partition))
    want = (rows,) + shape[1:] if shape else ()
    if tuple(local.shape) != want or (shape and rows > shape[0]):
        raise _Unsupported(f"derived slice {list(local.shape)} does not fit the parameter {list(shape)}")
    if not param.data.is_contiguous() and param.numel():
        raise _Unsupported("a non-contiguous parameter")
    if not param.dtype.is_floating_point:
        raise _Unsupported(f"a {param.dtype} parameter")
