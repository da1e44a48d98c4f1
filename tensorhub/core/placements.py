"""Placements at the reference core: checked, interned by digest, merged into a schema, covered.

Stage 2b of issue 24 (docs/placements.md): a registration may carry a
:class:`~tensorhub.placement.Placement` (``Register.placement``); the data path does not use it
yet (it still moves whole shards between equal layouts). A part of
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
5. Shard ``k`` has one placement in every replica that carries one: the data path still copies
   whole shards, so two placements of one shard would mix bytes (planning across placements is
   the next stage).

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
from tensorhub.core.state import Node
from tensorhub.core.table import Table
from tensorhub.errors import LayoutMismatch
from tensorhub.placement import GlobalTensor, Placement, Schema, check_coverage, merge_schemas


@dataclasses.dataclass
class Interned:
    """The one copy of a distinct placement and the clients (of any model) that use it."""

    placement: Placement
    nodes: int = 0


@dataclasses.dataclass
class ModelPlacements:
    """One model's placements: their uses, the schema they make and which replicas cover it."""

    uses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """digest -> the model's clients that registered it."""
    schema: dict[str, GlobalTensor] = dataclasses.field(default_factory=dict)
    """The union of the model's placements' global tensors, by name."""
    naming: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """global tensor name -> the distinct placements that name it."""
    shard_digest: dict[int, str] = dataclasses.field(default_factory=dict)
    """shard -> its one placement (rule 5)."""
    shard_nodes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    covered: set[str] = dataclasses.field(default_factory=set)
    """Replicas whose placements cover the schema as it is (rule 6, remembered)."""


class Placements:
    """The core's placements (see the module docstring). Owns its registries; reads the table's
    replicas and nodes."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.interned: dict[str, Interned] = {}
        """digest -> the one copy of that placement (every model's)."""
        self.models: dict[str, ModelPlacements] = {}

    def get(self, digest: str) -> Optional[Placement]:
        """The interned placement of ``digest`` (None for "", no placement)."""
        return self.interned[digest].placement if digest else None

    def check(self, req: m.Register) -> None:
        """Raise LayoutMismatch if ``req``'s placement breaks rules 1 to 5; changes nothing."""
        where = f"{req.model} replica {req.replica_id} shard {req.shard}"
        placed = self._replica_placed(req.model, req.replica_id)
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
                other = mp.shard_digest.get(req.shard, digest)
                if other != digest:
                    raise LayoutMismatch(
                        f"placement {digest[:12]} differs from the model's shard {req.shard} placement {other[:12]}: "
                        "whole shards are copied between equal placements (reading across placements is not built yet)")
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
        mp = self.models.setdefault(node.model, ModelPlacements())
        if not mp.uses[digest]:
            for g in entry.placement.globals:
                if not mp.naming[g.name]:
                    mp.schema[g.name] = g
                    mp.covered.clear()
                mp.naming[g.name] += 1
        mp.uses[digest] += 1
        mp.shard_digest.setdefault(node.shard, digest)
        mp.shard_nodes[node.shard] += 1
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
        mp = self.models[node.model]
        mp.covered.discard(node.replica_id)
        mp.shard_nodes[node.shard] -= 1
        if not mp.shard_nodes[node.shard]:
            del mp.shard_nodes[node.shard], mp.shard_digest[node.shard]
        mp.uses[digest] -= 1
        if not mp.uses[digest]:
            del mp.uses[digest]
            for g in entry.placement.globals:
                mp.naming[g.name] -= 1
                if not mp.naming[g.name]:
                    del mp.naming[g.name], mp.schema[g.name]
                    mp.covered.clear()
        if not mp.uses:
            del self.models[node.model]

    def check_covered(self, node: Node) -> None:
        """Rule 6, for a publish by ``node`` of a version not yet committed: LayoutMismatch
        naming the missing ranges unless its replica's placements cover the model's schema (or
        the replica has no placements, or some of its shards are not registered yet)."""
        mp = self.models.get(node.model)
        if not node.placement or mp is None or node.replica_id in mp.covered:
            return
        shards = self.table.replica_nodes(node.model, node.replica_id)
        if len(shards) < node.num_shards:
            return  # the publish of the last shard to register is checked: commit waits for it
        distinct = {n.placement for n in shards}
        try:
            check_coverage([self.interned[d].placement for d in sorted(distinct)], Schema(tuple(mp.schema.values())))
        except LayoutMismatch as err:
            raise LayoutMismatch(f"{node.model} replica {node.replica_id}: {err}") from None
        mp.covered.add(node.replica_id)

    def view(self, model: str) -> tuple[m.PlacementUse, ...]:
        """The model's distinct placements and their clients, by digest."""
        mp = self.models.get(model)
        return () if mp is None else tuple(m.PlacementUse(d, c) for d, c in sorted(mp.uses.items()))

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
