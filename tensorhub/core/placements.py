"""Placements at the reference core: checked, interned by digest, merged into a schema, covered.

Stage 2b of issue 24 (docs/placements.md): a registration may carry a
:class:`~tensorhub.placement.Placement` (``Register.placement``); stage 3b: replicas of another
layout form layout classes, between which bytes move by resharded reads
(:mod:`tensorhub.core.reading`). A part of
:class:`tensorhub.core.reference.ReferenceCore`, called by :class:`~tensorhub.core.members.Members`
(registration, removal) and :class:`~tensorhub.core.holders.Holders` (publish).

The rules a registration with a placement meets, in order (each a ``LayoutMismatch`` naming the
tensor; nothing changes). Without a placement only rule 3 applies.

1. The placement is well formed (:meth:`Placement.check`, run on every placement from elsewhere;
   skipped for one equal to an interned copy, which passed it; a different one with an interned
   digest is refused).
2. Its local tensors are the layout's tensors: names, dtypes, shapes, in order.
3. A replica's shards carry placements all or none (coverage is a replica's).
4. The model's schema is the union of its placements' global tensors: a placement that
   disagrees on a global tensor's dtype or shape is refused (:func:`merge_schemas`).
5. Shard ``k`` has one placement in every replica *of its layout class* that carries one (a
   class's shards copy whole units between each other, so two placements of one shard there
   would mix bytes).

**Layout classes** (stage 3b of issue 24). A replica whose shards do not fit the model's first
class (another shard count, another layout or placement of some shard) is not refused when it
carries placements: it joins (or opens) another *layout class* of the model, an internal model
record named :func:`class_name` (``model`` + ``"\x1f"`` + n, a name no client can give), so
every rule of the core (rounds, commits, retention, queues, pipelining) applies within the class
as it did within the model. :meth:`Placements.class_of` decides a registration's class: its
replica's class if one of its shards is registered; else the first class (in creation order) it
fits (shard count, the shard's layout and placement); else a new one. Only a registration with
a placement opens a class; one without is checked against the first class as before. A
class found by fit cannot take a shard it has not seen yet, so replicas of one layout whose
shards register interleaved may open two classes of equal placements. The later one is moved
into the earlier as soon as the earlier has seen every shard the later holds, provided the later
has not read, published or started a round yet (:meth:`Placements.earlier_fit`, checked by the
core after each registration); a registration that names its replica's layout
(``Register.layout_key``) joins that key's class whatever it has seen (and a shard that does not
fit it is refused). Across
classes bytes move only by resharded reads (:mod:`tensorhub.core.reading`, reshard
assignments), so rule 5 holds per class.

Then :meth:`Placements.add` keeps one copy per distinct digest, counted by the clients using it
and dropped with the last (:meth:`Placements.drop`); the model's schema counts the distinct
placements naming each global tensor, so it shrinks as they go. Host copies carry no placement:
they hold their owner's bytes and live and die with it.

6. Coverage (:meth:`Placements.check_covered`): a publish of a version not yet committed, by a
   shard of a replica with placements whose shards are all registered, is refused unless the
   replica's placements cover every global tensor of the schema (:func:`check_coverage`, the
   missing ranges named). Commit needs every shard published, so no uncovered version commits.
   A replica that passed is remembered until its membership or the model's schema changes.
   Recovery (a re-announced holding) and a reader's ``ReplicateDone`` are not checked here.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from tensorhub.core import messages as m
from tensorhub.core.reshard import plan_reshard
from tensorhub.core.state import Node
from tensorhub.core.table import Table
from tensorhub.errors import LayoutMismatch
from tensorhub.placement import GlobalTensor, Placement, Schema, check_coverage, merge_schemas

_PLANS_MAX = 4096
"""Cached reshard questions (:meth:`Placements.reshard_shards`); the cache is emptied past this."""


@dataclasses.dataclass
class Interned:
    """The one copy of a distinct placement and the clients (of any model) that use it."""

    placement: Placement
    nodes: int = 0


@dataclasses.dataclass
class ModelPlacements:
    """One model's placements (all its layout classes): their uses, the schema they make and which
    replicas cover it."""

    uses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """digest -> the model's clients that registered it."""
    schema: dict[str, GlobalTensor] = dataclasses.field(default_factory=dict)
    """The union of the model's placements' global tensors, by name."""
    naming: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """global tensor name -> the distinct placements that name it."""
    shard_digest: dict[tuple[str, int], str] = dataclasses.field(default_factory=dict)
    """(layout class, shard) -> its one placement (rule 5)."""
    shard_nodes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    covered: set[str] = dataclasses.field(default_factory=set)
    """Replicas whose placements cover the schema as it is (rule 6, remembered)."""


CLASS_SEP = "\x1f"
"""Separates a model's name from its layout class's number in the class's internal model name
(a character the server's bounds refuse in any name a client gives)."""


def logical(model: str) -> str:
    """The model a layout class's internal name belongs to (``model`` itself for its first class)."""
    return model.split(CLASS_SEP, 1)[0]


def class_name(model: str, n: int) -> str:
    """The internal model name of layout class ``n`` of ``model`` (0: ``model`` itself)."""
    return model if n == 0 else f"{model}{CLASS_SEP}{n}"


def shown(model: str) -> str:
    """A layout class's internal name as messages show it: ``policy (layout class 1)``."""
    name, _, n = model.partition(CLASS_SEP)
    return f"{name} (layout class {n})" if n else name


class Placements:
    """The core's placements (see the module docstring). Owns its registries; reads the table's
    replicas and nodes."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.interned: dict[str, Interned] = {}
        """digest -> the one copy of that placement (every model's)."""
        self.models: dict[str, ModelPlacements] = {}
        """model (not a layout class's internal name) -> its placements."""
        self._plans: dict[tuple[str, tuple[str, ...], int], tuple[int, ...]] = {}
        """(reader digest, holder digests, spread) -> the holder shards a resharded read takes
        (``()``: that replica cannot fill the reader): :meth:`reshard_shards`."""

    def get(self, digest: str) -> Optional[Placement]:
        """The interned placement of ``digest`` (None for "", no placement)."""
        return self.interned[digest].placement if digest else None

    def class_of(self, req: m.Register) -> str:
        """The layout class (an internal model name, :func:`class_name`) ``req`` registers in: its
        replica's if a shard of it is registered; else the first class it fits (its shard count,
        its shard's layout, known there, and placement: a class that has not seen this shard yet
        cannot tell whether it fits its replicas' other shards, so two replicas of one layout may
        open two classes when their shards interleave); else, with a placement, a new class (the first free
        name); without one, the first class, whose checks then refuse it as before. A
        registration with a ``layout_key`` takes the class of that key if there is one, whether
        or not it has seen the shard (the checks then refuse a shard that does not fit it), and
        fits only classes without a key otherwise: replicas that name their layout share one
        class however their registrations interleave. Changes nothing."""
        classes = self.table.classes.get(req.model, ())
        for c in classes:
            if (c, req.replica_id) in self.table.replicas:
                return c
        if req.placement is None:
            return classes[0] if classes else req.model
        if req.layout_key:
            keyed = next((c for c in classes if self.table.models[c].layout_key == req.layout_key), None)
            if keyed is not None:
                return keyed
        digest = req.placement.digest()
        mp = self.models.get(req.model)
        for c in classes:
            mod = self.table.models[c]
            if req.layout_key and mod.layout_key:
                continue  # a class of another key
            known = mod.layouts.get(req.shard)
            # A class that does not know this shard's layout yet cannot tell whether the shard
            # fits its replicas' other shards (two layouts of one shard count register their
            # shards interleaved, after a server restart in any order): only its own replica's
            # shards join it so (above).
            if mod.num_shards != req.num_shards or known is None or (known.fingerprint, known.unit_count) \
                    != (req.layout.fingerprint, req.layout.unit_count):
                continue
            if mp is None or mp.shard_digest.get((c, req.shard), digest) == digest:
                return c
        n = 0
        while class_name(req.model, n) in self.table.models:
            n += 1
        return class_name(req.model, n)

    def earlier_fit(self, cls: str) -> Optional[str]:
        """The first layout class of ``cls``'s model, created before it, that every shard
        registered in ``cls`` fits (the same shard count, and per registered shard the same
        layout and placement, both known there), or None; none for a class with a ``layout_key``
        (it is that key's class). Two replicas of one layout whose ranks registered interleaved
        may have opened two classes (:meth:`class_of` cannot judge a shard a class has not seen);
        once the earlier class has seen those shards this finds it, and the core moves a class
        that has not read or published anything into it (:meth:`moved`). Changes nothing."""
        table = self.table
        mod = table.models.get(cls)
        mp = self.models.get(logical(cls))
        if mod is None or mp is None or mod.layout_key:
            return None
        mine = {k: d for (c, k), d in mp.shard_digest.items() if c == cls}
        if not mine:
            return None
        for other in table.classes.get(logical(cls), ()):
            if other == cls:
                return None
            om = table.models.get(other)
            if om is None or om.num_shards != mod.num_shards:
                continue
            if all(mp.shard_digest.get((other, k)) == d and k in om.layouts
                   and (om.layouts[k].fingerprint, om.layouts[k].unit_count)
                   == (mod.layouts[k].fingerprint, mod.layouts[k].unit_count) for k, d in mine.items()):
                return other
        return None

    def moved(self, node: Node, old: str) -> None:
        """``node`` moved from layout class ``old`` to ``node.model`` (:meth:`earlier_fit`, the
        same placement per shard in both): its shard's use of the placement moves with it."""
        if not node.placement:
            return
        mp = self.models[logical(node.model)]
        at = (old, node.shard)
        mp.shard_nodes[at] -= 1
        if not mp.shard_nodes[at]:
            del mp.shard_nodes[at], mp.shard_digest[at]
        mp.shard_digest.setdefault((node.model, node.shard), node.placement)
        mp.shard_nodes[(node.model, node.shard)] += 1

    def check(self, req: m.Register, cls: str) -> None:
        """Raise LayoutMismatch if ``req``'s placement breaks rules 1 to 5 in layout class
        ``cls`` (:meth:`class_of`); changes nothing."""
        where = f"{req.model} replica {req.replica_id} shard {req.shard}"
        placed = self._replica_placed(cls, req.replica_id)
        p = req.placement
        if placed is not None and placed != (p is not None):
            raise LayoutMismatch(f"{where}: {'has no' if p is None else 'has a'} placement, its replica's other "
                                 f"shards {'do' if placed else 'do not'} (a replica's shards carry placements all or none)")
        if p is None:
            return
        digest = p.digest()
        known = self.interned.get(digest)
        try:
            if known is None:
                p.check()
            elif known.placement != p:
                raise LayoutMismatch(f"placement digest {digest} names another placement")
            check_locals(req.layout, p)
            mp = self.models.get(req.model)
            if mp is not None:
                merge_schemas([[mp.schema[g.name] for g in p.globals if g.name in mp.schema], p.globals])
                other = mp.shard_digest.get((cls, req.shard), digest)
                if other != digest:
                    keyed = f" (layout key {req.layout_key!r})" if req.layout_key else ""
                    raise LayoutMismatch(
                        f"placement {digest[:12]} differs from shard {req.shard}'s placement {other[:12]} in its "
                        f"replica's layout class{keyed}: a class copies whole shards between equal placements")
        except LayoutMismatch as err:
            raise LayoutMismatch(f"{where}: {err}") from None

    def add(self, node: Node, p: Optional[Placement]) -> None:
        """``node`` registered with ``p`` (checked by :meth:`check`): it uses the interned copy."""
        if p is None:
            return
        digest = p.digest()
        entry = self.interned.get(digest)
        if entry is None:
            entry = self.interned[digest] = Interned(p)
        entry.nodes += 1
        node.placement = digest
        mp = self.models.setdefault(logical(node.model), ModelPlacements())
        if not mp.uses[digest]:
            for g in entry.placement.globals:
                if not mp.naming[g.name]:
                    mp.schema[g.name] = g
                    mp.covered.clear()
                mp.naming[g.name] += 1
        mp.uses[digest] += 1
        mp.shard_digest.setdefault((node.model, node.shard), digest)
        mp.shard_nodes[(node.model, node.shard)] += 1
        mp.covered.discard(node.replica_id)

    def drop(self, node: Node) -> None:
        """``node`` left: its use of its placement ends; the last use drops the copy."""
        digest = node.placement
        if not digest:
            return
        entry = self.interned[digest]
        entry.nodes -= 1
        if not entry.nodes:
            del self.interned[digest]
        mp = self.models[logical(node.model)]
        mp.covered.discard(node.replica_id)
        at = (node.model, node.shard)
        mp.shard_nodes[at] -= 1
        if not mp.shard_nodes[at]:
            del mp.shard_nodes[at], mp.shard_digest[at]
        mp.uses[digest] -= 1
        if not mp.uses[digest]:
            del mp.uses[digest]
            for g in entry.placement.globals:
                mp.naming[g.name] -= 1
                if not mp.naming[g.name]:
                    del mp.naming[g.name], mp.schema[g.name]
                    mp.covered.clear()
        if not mp.uses:
            del self.models[logical(node.model)]

    def class_digests(self, cls: str) -> tuple[str, ...]:
        """The placements (digests, sorted, distinct) of layout class ``cls``'s shards registered
        now: every replica of the class holds the same one per shard (rule 5)."""
        mp = self.models.get(logical(cls))
        if mp is None:
            return ()
        return tuple(sorted({d for (c, _), d in mp.shard_digest.items() if c == cls}))

    def check_covered(self, node: Node) -> None:
        """Rule 6, for a publish by ``node`` of a version not yet committed: LayoutMismatch
        naming the missing ranges unless its replica's placements cover the model's schema (or
        the replica has no placements, or some of its shards are not registered yet)."""
        mp = self.models.get(logical(node.model))
        if not node.placement or mp is None or node.replica_id in mp.covered:
            return
        shards = self.table.replica_nodes(node.model, node.replica_id)
        if len(shards) < node.num_shards:
            return  # the publish of the last shard to register is checked: commit waits for it
        distinct = {n.placement for n in shards}
        try:
            check_coverage([self.interned[d].placement for d in sorted(distinct)], Schema(tuple(mp.schema.values())))
        except LayoutMismatch as err:
            raise LayoutMismatch(f"{shown(node.model)} replica {node.replica_id}: {err}") from None
        mp.covered.add(node.replica_id)

    def reshard_shards(self, reader: str, holders: tuple[str, ...], spread: int) -> Optional[tuple[int, ...]]:
        """The holder shards a reader of placement ``reader`` reads from a replica whose shard
        ``i`` has placement ``holders[i]`` (digests), under
        :func:`~tensorhub.core.reshard.plan_reshard` with ``spread`` (the reader's shard), as the
        reader will plan it; None if that replica cannot fill the reader (a box it lacks, a dtype
        conversion, schemas that disagree). Cached per distinct question (a few layouts meet)."""
        key = (reader, holders, spread)
        hit = self._plans.get(key)
        if hit is None:
            try:
                plan = plan_reshard(self.interned[reader].placement,
                                    [self.interned[h].placement for h in holders], spread=spread)
                hit = () if plan.missing else plan.shards
            except LayoutMismatch:
                hit = ()
            if len(self._plans) >= _PLANS_MAX:
                self._plans.clear()
            self._plans[key] = hit
        return hit or None

    def view(self, model: str) -> tuple[m.PlacementUse, ...]:
        """The model's distinct placements (every layout class's) and their clients, by digest."""
        mp = self.models.get(model)
        return () if mp is None else tuple(m.PlacementUse(d, c) for d, c in sorted(mp.uses.items()))

    def schema(self, model: str) -> tuple[GlobalTensor, ...]:
        """The model's schema as its placements make it now (global tensors sorted by name)."""
        mp = self.models.get(model)
        return () if mp is None else tuple(sorted(mp.schema.values(), key=lambda g: g.name))

    def _replica_placed(self, model: str, replica_id: str) -> Optional[bool]:
        """Whether the replica's registered shards carry placements (None: no shard registered)."""
        ids = self.table.replicas.get((model, replica_id))
        if not ids:
            return None
        return bool(self.table.nodes[next(iter(ids))].placement)


def check_locals(layout: m.LayoutInfo, p: Placement) -> None:
    """Rule 2: the placement's local tensors are the layout's, in order (``LayoutMismatch``
    naming the first that differs). The handle checks it too, before it registers anything."""
    for i, (t, lp) in enumerate(zip(layout.tensors, p.tensors)):
        if (t.name, t.dtype, tuple(t.shape)) != (lp.name, lp.dtype, lp.shape):
            raise LayoutMismatch(f"tensor #{i} is {t.name} {t.dtype}{list(t.shape)} in the layout, "
                                 f"{lp.name} {lp.dtype}{list(lp.shape)} in the placement")
    if len(layout.tensors) != len(p.tensors):
        raise LayoutMismatch(f"the placement has {len(p.tensors)} local tensors, the layout {len(layout.tensors)}")
