"""The ``mixed`` workload's model: one schema, several layouts, and what a resharded read moves.

A trainer of one layout (rows cut in 2 or 4 shards) and rollout replicas of others (one whole
shard; TP=2 with a fused ``qkv`` and ``o`` cut by columns; 4 shards by rows) register
placements (:mod:`tensorhub.placement`), so the server puts them in layout classes and hands
out resharded reads (:mod:`tensorhub.core.reading`). This module is the world's knowledge of
those layouts, pure and cached:

- :meth:`MixedModel.placement` / :meth:`MixedModel.layout_info`: a shard's placement and the
  layout it registers; its units are the shipped unit table (:class:`tensorhub.layout.Layout`
  over the placement's local tensors, ``UNIT_BYTES``, ``PACK_BELOW_BYTES``).
- :meth:`MixedModel.deps`: for a reader shard and a holder replica (their placements), the
  plan the reader makes (:func:`~tensorhub.core.reshard.plan_reshard`, ``spread`` = its shard)
  cut at both sides' unit boundaries: per reader unit, the holder ``(shard, unit)`` pairs whose
  bytes land in it, and the bytes taken from each holder unit. A reader unit is done when every
  holder range writing into it landed (``ReshardRead.units_done``, at range granularity).

Memory stays a list of per-unit tags; in this workload a tag names its layout:
``(version, "layout:shard", unit)`` (:meth:`MixedModel.tag_shard`), so a unit copied from a
shard of another layout never passes for the reader's own. Sizes are tiny in real bytes (the
planner runs on them); a real byte stands for ``Params.unit_bytes / UNIT_BYTES`` simulated ones.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tensorhub.core import messages as m
from tensorhub.core.reshard import plan_reshard
from tensorhub.placement import GlobalTensor, Placement, Schema, fused, split, whole

UNIT_BYTES = 128
"""Real bytes per unit of the mixed layouts (a unit of the simulated world is ``Params.unit_bytes``)."""
PACK_BELOW_BYTES = 128

SCHEMA = Schema.of([
    GlobalTensor("q", "float32", (16, 8)),
    GlobalTensor("k", "float32", (8, 8)),
    GlobalTensor("v", "float32", (8, 8)),
    GlobalTensor("o", "float32", (16, 16)),
    GlobalTensor("norm", "float32", (16,)),
])

TRAINER_LAYOUTS = ("rows2", "rows4")
ROLLOUT_LAYOUTS = ("whole", "tp2", "rows4", "rows2")
SHARDS = {"rows2": 2, "rows4": 4, "whole": 1, "tp2": 2}
KEYED = ("tp2", "rows4")
"""Layouts whose replicas name their layout (``Register.layout_key``: one layout class however
their shards interleave); the others' classes are found by fit (a seed with both runs both ways)."""


def _placement(layout: str, shard: int) -> Placement:
    g = SCHEMA.by_name()
    n = SHARDS[layout]
    if layout == "whole":
        locals_ = [whole(t) for t in SCHEMA.tensors]
    elif layout.startswith("rows"):  # FSDP-like: every tensor cut by rows
        locals_ = [split(t, 0, shard, n) for t in SCHEMA.tensors]
    elif layout == "tp2":  # vLLM-like: fused qkv by output rows, o by input columns, norm replicated
        locals_ = [fused("qkv", [(g["q"], 0, shard, n), (g["k"], 0, shard, n), (g["v"], 0, shard, n)]),
                   split(g["o"], 1, shard, n), whole(g["norm"])]
    else:
        raise ValueError(f"unknown mixed layout {layout!r}")
    return Placement.build(locals_, SCHEMA)


@dataclasses.dataclass(frozen=True)
class Deps:
    """What a reader shard takes from a holder replica (see the module docstring)."""

    shards: tuple[int, ...]
    """The holder shards the plan needs (ascending), as the server computes them."""
    units: tuple[frozenset, ...]
    """Per reader unit: the ``(holder shard, holder unit)`` pairs writing into it."""
    nbytes: dict
    """``(holder shard, holder unit)`` -> real bytes the reader takes from it."""
    complete: bool
    """The holders cover the reader (a plan with no gaps)."""


class MixedModel:
    """The layouts of one ``mixed`` scenario (pure; plans cached)."""

    def __init__(self, trainer: str, rollouts: tuple[str, ...]) -> None:
        self.trainer = trainer
        self.rollouts = rollouts
        self._layouts: dict[tuple[str, int], tuple[m.LayoutInfo, tuple]] = {}
        self._deps: dict[tuple, Deps] = {}
        self._by_digest: dict[str, tuple[str, int]] = {}

    # ------------------------------------------------------------------ layouts

    def placement(self, layout: str, shard: int) -> Placement:
        p = _placement(layout, shard)
        self._by_digest.setdefault(p.digest(), (layout, shard))
        return p

    def _layout(self, layout: str, shard: int) -> tuple[m.LayoutInfo, tuple]:
        got = self._layouts.get((layout, shard))
        if got is None:
            from tensorhub.layout import Layout, TensorMeta  # torch: only this workload needs it

            p = self.placement(layout, shard)
            metas = [TensorMeta(t.name, t.dtype, t.shape, t.nbytes) for t in p.tensors]
            lay = Layout.from_metas(metas, UNIT_BYTES, PACK_BELOW_BYTES)
            info = m.LayoutInfo(fingerprint=f"sim-mixed-{layout}-{shard}", unit_count=lay.unit_count,
                                total_bytes=lay.total_bytes,
                                tensors=tuple(m.TensorMeta(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in metas))
            units = tuple(tuple((pc.tensor_index, pc.offset, pc.nbytes) for pc in u) for u in lay.units)
            got = self._layouts[(layout, shard)] = (info, units)
        return got

    def layout_info(self, layout: str, shard: int) -> m.LayoutInfo:
        return self._layout(layout, shard)[0]

    def unit_count(self, layout: str, shard: int) -> int:
        return self._layout(layout, shard)[0].unit_count

    def units_max(self) -> int:
        return max(self.unit_count(lay, s) for lay in (self.trainer,) + self.rollouts for s in range(SHARDS[lay]))

    @staticmethod
    def tag_shard(layout: str, shard: int) -> str:
        return f"{layout}:{shard}"

    def of_digest(self, digest: str) -> Optional[tuple[str, int]]:
        """The (layout, shard) whose placement has ``digest`` (None: not one of ours)."""
        return self._by_digest.get(digest)

    # ------------------------------------------------------------------ resharded reads

    def deps(self, reader: Placement, holders: tuple[Placement, ...], spread: int) -> Deps:
        """The reader's plan over ``holders`` (shard order) cut into unit pairs (cached)."""
        key = (reader.digest(), tuple(h.digest() for h in holders), spread)
        got = self._deps.get(key)
        if got is None:
            got = self._deps[key] = self._plan(reader, holders, spread)
        return got

    def _plan(self, reader: Placement, holders: tuple[Placement, ...], spread: int) -> Deps:
        plan = plan_reshard(reader, list(holders), spread=spread)
        r_units = self._units_of(reader)
        h_units = [self._units_of(h) for h in holders]
        r_index = {t.name: i for i, t in enumerate(reader.tensors)}
        h_index = [{t.name: i for i, t in enumerate(h.tensors)} for h in holders]
        deps: list[set] = [set() for _ in range(1 + max((u for spans in r_units.values() for _, _, u in spans), default=-1))]
        nbytes: dict[tuple[int, int], int] = {}
        for run in plan.runs:
            rt, ht = r_index[run.reader_tensor], h_index[run.holder_shard][run.holder_tensor]
            for i in range(run.count):
                ra, ha = run.reader_offset + i * run.reader_stride, run.holder_offset + i * run.holder_stride
                for ru, hu, n in _segments(r_units[rt], ra, h_units[run.holder_shard][ht], ha, run.run_bytes):
                    deps[ru].add((run.holder_shard, hu))
                    nbytes[(run.holder_shard, hu)] = nbytes.get((run.holder_shard, hu), 0) + n
        return Deps(plan.shards, tuple(frozenset(d) for d in deps), nbytes, plan.complete)

    def _units_of(self, p: Placement) -> dict[int, list[tuple[int, int, int]]]:
        """Local tensor index -> its unit spans ``(start, end, unit)`` by offset."""
        layout, shard = self._by_digest[p.digest()]
        out: dict[int, list[tuple[int, int, int]]] = {}
        for u, pieces in enumerate(self._layout(layout, shard)[1]):
            for ti, off, n in pieces:
                out.setdefault(ti, []).append((off, off + n, u))
        for spans in out.values():
            spans.sort()
        return out


def _segments(r_spans, ra: int, h_spans, ha: int, n: int):
    """``n`` bytes from holder offset ``ha`` to reader offset ``ra`` cut at both sides' unit
    boundaries: ``(reader unit, holder unit, bytes)``."""
    done = 0
    while done < n:
        r = next(s for s in r_spans if s[0] <= ra + done < s[1])
        h = next(s for s in h_spans if s[0] <= ha + done < s[1])
        step = min(n - done, r[1] - (ra + done), h[1] - (ha + done))
        yield r[2], h[2], step
        done += step
