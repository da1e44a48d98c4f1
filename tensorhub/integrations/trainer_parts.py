"""What one trainer rank holds of a model split over ranks, and the staging buffer it serves it from.

A trainer whose weights are split over ranks (FSDP or TP ``DTensor`` shards, pipeline stages)
publishes them as one TensorHub replica with a shard per rank, each laid out by its placement
(:mod:`tensorhub.placement`), so that no rank gathers the whole model: readers (vLLM engines,
for one) reshard exactly the bytes they need from the ranks that hold them (docs/placements.md).
What a rank holds:

- a ``DTensor`` parameter: its local shard, as the box the device mesh gives this rank
  (:func:`tensorhub.placement.dtensor_placement`: ``Shard(dim)`` and ``Replicate()`` only, else
  ``LayoutMismatch``); nothing when the rank holds none of it (an uneven split's empty shard, a
  rank outside the mesh);
- any other parameter: the whole tensor, on every rank that has it (a pipeline stage's layers;
  a replicated parameter is registered by each rank that has it, and readers spread their reads
  of it over those ranks).

:class:`RankPart` is a staging buffer of those bytes with its placement: the registered copy
buffer of the paper's RDMA-copy mode (parameters change at every optimizer step, so what readers
see is the copy :meth:`RankPart.fill` makes of each version, taken while the buffer is not
published). Unstaged (``stage=False``), its buffers are the parameters' own (local) tensors,
registered as they are: no copy and no memory of its own, but the trainer must unpublish before
its optimizer changes them. The whole replica must cover every global tensor: the server refuses
its first publish otherwise, naming what is missing. vLLM-free; the vLLM trainer engine
(:mod:`tensorhub.integrations.vllm`) builds on it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, Optional

import torch

from tensorhub import errors
from tensorhub import placement as P
from tensorhub.layout import dtype_name

__all__ = ["RankPart", "is_dtensor"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (by what it has: a device mesh,
    placements and a local tensor)."""
    return hasattr(t, "device_mesh") and hasattr(t, "placements") and callable(getattr(t, "to_local", None))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The bytes this rank has of ``t``: a DTensor's local shard, else ``t``; detached."""
    return (t.to_local() if is_dtensor(t) else t).detach()


class RankPart:
    """One trainer rank's staging buffer (``buffers``: (name, tensor), registration order) and
    its placement over the model's schema (see the module docstring). Build it with :meth:`of`
    (from the rank's parameters) or :meth:`whole` (whole tensors of a schema)."""

    def __init__(self, buffers: list[tuple[str, torch.Tensor]], placement: P.Placement,
                 not_held: Collection[str] = (), *, staged: bool = True) -> None:
        self.buffers = buffers
        self.placement = placement
        self.staged = staged
        """False: ``buffers`` are the parameters' own tensors (:meth:`fill` copies nothing)."""
        self._by_name = dict(buffers)
        self._not_held = frozenset(not_held)
        """Names of the schema this rank holds none of: skipped by :meth:`fill`."""

    @property
    def nbytes(self) -> int:
        """Bytes registered (staged or not)."""
        return sum(t.numel() * t.element_size() for _, t in self.buffers)

    @classmethod
    def of(cls, params: Iterable[tuple[str, torch.Tensor]], schema: Sequence[P.GlobalTensor], *,
           device: str = "cpu", stage: bool = True) -> "RankPart":
        """The part of a rank whose parameters are ``params`` (a module's ``named_parameters()``:
        DTensors give their local shards, other tensors are whole), over ``schema`` (the whole
        model's global tensors: names, dtypes, global shapes): a staging buffer on ``device``,
        or (``stage=False``) the parameters' own tensors. ``LayoutMismatch`` names a parameter
        that is not in the schema or disagrees with it (dtype, global shape), a DTensor placement
        that is not a box, or a rank that holds nothing; ``ConfigError`` one that cannot be
        registered unstaged (not contiguous)."""
        by_name = {g.name: g for g in schema}
        locals_: list[P.LocalPlacement] = []
        buffers: list[tuple[str, torch.Tensor]] = []
        not_held: list[str] = []
        for name, t in params:
            g = by_name.get(name)
            if g is None:
                raise errors.LayoutMismatch(f"parameter {name!r}: not in the model's schema (its metadata)")
            mine = P.GlobalTensor(name, dtype_name(t.dtype), tuple(int(s) for s in t.shape))
            if mine != g:
                raise errors.LayoutMismatch(f"parameter {name!r}: {mine.dtype} {list(mine.shape)} here, the schema "
                                            f"says {g.dtype} {list(g.shape)}")
            local = _local(t)
            if local.numel() == 0 or (is_dtensor(t) and t.device_mesh.get_coordinate() is None):
                not_held.append(name)
                continue
            placed = P.dtensor_placement(name, t)[1] if is_dtensor(t) else P.whole(g)
            if tuple(placed.shape) != tuple(local.shape):
                raise errors.LayoutMismatch(f"parameter {name!r}: its local shard is {list(local.shape)}, its "
                                            f"device mesh gives this rank {list(placed.shape)}")
            if not stage and not local.is_contiguous():
                raise errors.ConfigError(f"parameter {name!r} is not contiguous: it cannot be registered as it is "
                                         "(stage it)")
            locals_.append(placed)
            buffers.append((name, torch.zeros(local.shape, dtype=local.dtype, device=device) if stage else local))
        if not buffers:
            raise errors.LayoutMismatch("this trainer rank holds no parameter of the model")
        return cls(buffers, P.Placement.build(locals_, schema), not_held, staged=stage)

    @classmethod
    def whole(cls, schema: Sequence[P.GlobalTensor], held: Optional[Collection[str]] = None, *,
              device: str = "cpu") -> "RankPart":
        """Whole tensors of ``schema`` (in its order): those named in ``held``, or all of them
        (None). ``LayoutMismatch`` when ``held`` names none of the schema."""
        names = [g.name for g in schema]
        keep = [g for g in schema if held is None or g.name in held]
        if not keep:
            raise errors.LayoutMismatch("this trainer rank holds no parameter of the model")
        buffers = [(g.name, torch.zeros(g.shape, dtype=getattr(torch, g.dtype), device=device)) for g in keep]
        kept = {g.name for g in keep}
        return cls(buffers, P.Placement.build([P.whole(g) for g in keep], schema),
                   [n for n in names if n not in kept])

    def fill(self, params: Iterable[tuple[str, Optional[torch.Tensor]]]) -> int:
        """Copy a version into the buffers: each (name, tensor) of ``params`` that this part
        holds (a DTensor: its local shard; a full tensor: whole), skipping those it holds none
        of and ``None`` (a name another rank holds). Returns the tensors copied.
        ``LayoutMismatch`` when a name is not in the registration, comes twice, disagrees in
        dtype or shape, or one the part holds does not come; the buffers may then hold parts of
        two versions (publish nothing). Unstaged, nothing is copied: each tensor must still be
        the one registered (same memory), else ``LayoutMismatch`` (it was reallocated)."""
        seen: set[str] = set()
        for name, t in params:
            if t is None or name in self._not_held:
                continue
            buf = self._by_name.get(name)
            if buf is None:
                raise errors.LayoutMismatch(f"the source yields {name!r}, which is not in its metadata")
            if name in seen:
                raise errors.LayoutMismatch(f"the source yields {name!r} twice")
            local = _local(t)
            if local.shape != buf.shape or local.dtype != buf.dtype:
                raise errors.LayoutMismatch(f"parameter {name!r} is {local.dtype} {tuple(local.shape)} here, "
                                            f"{buf.dtype} {tuple(buf.shape)} when registered")
            if self.staged:
                buf.copy_(local)
            elif local.data_ptr() != buf.data_ptr() or local.stride() != buf.stride():
                raise errors.LayoutMismatch(f"parameter {name!r} is no longer the tensor registered (reallocated): "
                                            "register the parameters again")
            seen.add(name)
        if len(seen) != len(self.buffers):
            missing = [n for n, _ in self.buffers if n not in seen]
            raise errors.LayoutMismatch(f"the source did not yield {len(missing)} parameter(s) of its metadata: "
                                        f"{', '.join(map(repr, missing[:4]))}{' ...' if len(missing) > 4 else ''}")
        return len(seen)
