"""Replicas of a model's other layout classes that can fill a node: the question both resharded
reads (:mod:`tensorhub.core.reading`) and retention (:mod:`tensorhub.core.retention`) ask.

Layout classes are :mod:`tensorhub.core.placements`'. A replica of another class *can fill* a
node when every one of its shards holds the node's version whole with a placement and the
planner finds every byte of the node's placement in them
(:meth:`~tensorhub.core.placements.Placements.reshard_shards`, with the node's shard as
``spread``: the shards it would read, exactly as the reader plans them). Read only: it changes
nothing, and owns nothing but what it is given.

A resharded read's sources (:meth:`OtherLayouts.sources`) are chosen shard by shard: every
replica of a class holds the same placement per shard (rule 5 of
:mod:`tensorhub.core.placements`), so the plan depends on the class, not the replica, and each
shard the reader needs may come from another replica of the class: the best holder of that
shard (same datacenter, least loaded, registration order). So a failed holder shard is replaced
by an equivalent shard of another replica while the read keeps the others (the per-shard
failover swap), and a replica whose other shard is down still serves the shards it has.
Retention's question (:meth:`OtherLayouts.holds`) still asks for a whole replica: it keeps a
copy rather than count on shards of several replicas that move on separately.

Cost of a question: the other classes' nodes of that version (no index yet: fine for a few
trainer replicas; linear in a class's replicas), and one cached plan per distinct pair of
layouts.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

from tensorhub.core.placements import logical
from tensorhub.core.state import COMPLETE, Node, NodeState
from tensorhub.core.table import Table

NOW, SUSPECTS_TOO, IN_TIME = 2, 1, 0
"""How strictly :func:`serves` judges a holder of a resharded read."""


class OtherLayouts:
    """Questions about the replicas of a node's other layout classes (see the module docstring).
    ``needed(reader digest, holder digests by shard, spread)``: the holder shards such a read
    takes, or None if such a replica cannot fill such a reader."""

    def __init__(self, table: Table, needed: Callable[[str, tuple[str, ...], int], Optional[tuple[int, ...]]]) -> None:
        self.table = table
        self._needed = needed

    def fillers(self, node: Node, version: int, usable: Callable[[Node], bool]) -> Iterator[tuple[list[Node], tuple[int, ...]]]:
        """(every shard in order, the shards ``node`` would read) of each replica of another
        class of ``node``'s model whose every shard is ``usable`` and which can fill ``node``'s
        placement at ``version``, in a fixed order."""
        if not node.placement or node.host:
            return
        table = self.table
        for cls in table.classes.get(logical(node.model), ()):
            if cls == node.model:
                continue
            looked: set[str] = set()
            for nid in sorted(table.groups.get((cls, version, 0), ())):
                first = table.nodes[nid]
                if first.host or first.replica_id in looked:
                    continue
                looked.add(first.replica_id)
                shards = sorted(table.replica_nodes(cls, first.replica_id), key=lambda n: n.shard)
                if len(shards) != table.models[cls].num_shards or not all(
                        n.version == version and n.placement and usable(n) for n in shards):
                    continue
                needed = self._needed(node.placement, tuple(n.placement for n in shards), node.shard)
                if needed is not None:
                    yield shards, needed

    def holds(self, node: Node, usable: Callable[[Node], bool]) -> bool:
        """A replica of another class holds ``node``'s version whole (each shard complete and
        ``usable``) and can fill ``node``."""
        return any(True for _ in self.fillers(node, node.version, lambda n: n.state in COMPLETE and usable(n)))

    def sources(self, reader: Node, *, room: bool = True) -> Optional[list[Node]]:
        """The holder shards ``reader`` would read its version from by a resharded read: those
        it needs of the best replica of another class whose every shard is published at that
        version (the same datacenter as the reader first, then the least loaded, then
        registration order), or None. ``room``: only replicas whose needed shards have fewer
        than ``readers_per_source_max`` reader replicas besides the reader's own
        (:meth:`replicas_reading`) and are reachable; holders suspected of having failed
        (reported by anyone, or by this reader) only when no other replica qualifies (the
        scheduler's rule 1). Without ``room``: any replica that could fill the reader in time."""
        if not room:
            return self._best(reader, IN_TIME)
        return self._best(reader, NOW) or self._best(reader, SUSPECTS_TOO)

    def _best(self, reader: Node, level: int) -> Optional[list[Node]]:
        cap = self.table.config.readers_per_source_max
        best: Optional[tuple[tuple, list[Node]]] = None
        for needed, by_shard in self._classes(reader):
            chosen: list[tuple[tuple, Node]] = []  # per needed shard: ((other dc, busy, order), holder)
            for k in needed:
                ranked = []
                for n in by_shard[k]:
                    if not serves(n, reader, level):
                        continue
                    busy = self.replicas_reading(n, reader.replica_id)
                    if level != IN_TIME and busy >= cap:
                        continue
                    ranked.append(((n.datacenter != reader.datacenter, busy, n.order), n))
                if not ranked:
                    break
                chosen.append(min(ranked, key=lambda r: r[0]))
            if len(chosen) != len(needed):
                continue
            rank = (any(key[0] for key, _ in chosen), max(key[1] for key, _ in chosen),
                    min(key[2] for key, _ in chosen))
            if best is None or rank < best[0]:
                best = (rank, [n for _, n in chosen])
        return None if best is None else best[1]

    def _classes(self, reader: Node) -> Iterator[tuple[tuple[int, ...], dict[int, list[Node]]]]:
        """(the shards ``reader`` would read, each such shard's nodes at its version) of every
        other class of its model that can fill it: the class's placement per shard is taken from
        any of its nodes at that version (one per shard in a class, rule 5); a class with a shard
        that has none there is skipped. In a fixed order."""
        if not reader.placement or reader.host:
            return
        table, version = self.table, reader.version
        for cls in table.classes.get(logical(reader.model), ()):
            if cls == reader.model or cls not in table.models:
                continue
            by_shard: dict[int, list[Node]] = {}
            digests: list[str] = []
            for k in range(table.models[cls].num_shards):
                nodes = [table.nodes[i] for i in sorted(table.groups.get((cls, version, k), ()))]
                nodes = [n for n in nodes if n.placement]  # host copies too: laid out as their owners
                if not nodes:
                    break
                by_shard[k] = nodes
                digests.append(nodes[0].placement)
            else:
                needed = self._needed(reader.placement, tuple(digests), reader.shard)
                if needed is not None:
                    yield needed, by_shard

    def replicas_reading(self, src: Node, own: str) -> int:
        """Reader replicas other than ``own`` among ``src``'s readers: a replica's shards count
        once (each reads its own slice: together one copy of the holder's bytes at most, so the
        shards of a TP=4 engine read from a trainer shard side by side)."""
        nodes = self.table.nodes
        return len({nodes[r].replica_id for r in src.readers if r in nodes} - {own})


def serves(n: Node, reader: Node, level: int) -> bool:
    """Whether ``n`` may serve ``reader``'s resharded read: published (complete, visible) and, at
    ``NOW``, neither unreachable nor suspected of having failed (by anyone, or by this reader);
    at ``SUSPECTS_TOO``, only reachable; at ``IN_TIME``, as it may become (a complete holder's
    group counts as rooted while its holder is suspected)."""
    if n.state is not NodeState.PUBLISHED:
        return False
    if level == NOW:
        return not (n.unreachable or n.suspected_at is not None or n.id in reader.suspects)
    return level == IN_TIME or not n.unreachable
