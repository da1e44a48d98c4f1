"""The reference core's rules across datacenters: offload seeding and smart skipping.

A part of :class:`tensorhub.core.reference.ReferenceCore`, kept apart because it is one concern:
:class:`CrossDatacenter` gets the core's shared :class:`~tensorhub.core.table.Table` passed in and
owns the candidate seeders (:class:`SeedCandidates`); what it decides about host copies (a seed's
datacenter copy kept: :meth:`CrossDatacenter.keeps_dc_copy`) retention acts on.

- **Offload seeding** (:meth:`CrossDatacenter.seed_remote`): when a version is committed, ask one replica of every
  other datacenter with readers (idle before busy, non-spot before spot) to prefetch it into its
  staging copy (``SeedAhead``), so that exactly one copy crosses the slow link and the seeder's
  own ``update()`` is a local copy. A datacenter's readers wait for that seed (:meth:`CrossDatacenter.seed_pending`)
  for up to ``seed_wait_s`` before one of them crosses itself.
- **Prefetch inside the datacenter** (:meth:`CrossDatacenter.prefetch_in_datacenters`,
  ``prefetch_in_datacenter``): once the seed is partial there (every shard has a holder in the
  datacenter), the datacenter's other replicas are asked to prefetch it too (``PrefetchAhead``):
  their staging copies pipeline behind the seed (the scheduler's rule 3 keeps them inside), so
  every engine's ``update()`` there is a local copy or a swap. Once per (datacenter, version).
- **Smart skipping** (:meth:`CrossDatacenter.smart_skip`): while a newer version is on its way into the reader's
  datacenter, ``"latest"`` answers the newest version already complete there instead of queueing
  behind the slow link.
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable, Optional

from tensorhub.core import messages as m
from tensorhub.core.placements import logical
from tensorhub.core.state import SERVABLE, ModelRecord, Node, NodeState
from tensorhub.core.table import Table


log = logging.getLogger("tensorhub.core.reference")

SERVABLE_OR_READING = frozenset({NodeState.PUBLISHED, NodeState.OFFLOADING, NodeState.READING, NodeState.WAITING})
"""A datacenter with a node of a version in one of these states has (or is getting) it."""
IN_PLAY = SERVABLE_OR_READING | {NodeState.DRAINING}
"""A version with a node of every shard in one of these states is, or is about to be, available."""
_BUSY = frozenset({NodeState.READING, NodeState.WAITING, NodeState.DRAINING, NodeState.OFFLOADING})
"""A replica with a node in one of these states is busy: asked to seed only if no idle one is."""
NO_SKIP = (-1, -1)
""":meth:`CrossDatacenter.skip_news` when smart skipping would not skip."""
SEED_LOOK_MAX = 64
"""Candidate seeders of a datacenter looked at, best rank first, for an idle one; when all of
those are busy, the best-ranked is asked (a bounded look: a datacenter of 10,000 busy replicas
is not scanned on every removal)."""


class SeedCandidates:
    """The replicas that may seed a datacenter, kept as replicas register and leave (not
    scanned when a seeder is needed): per (model, datacenter), the *whole* replicas there --
    every shard registered, all in that datacenter, not a prefetch staging copy -- sorted by
    rank: non-spot before spot, then the earliest registration among their shards. The core
    calls :meth:`update` whenever a replica gains or loses a client; an update costs
    O(shards + log n)."""

    def __init__(self) -> None:
        self._ranked: dict[str, dict[str, list[tuple[bool, int, str]]]] = {}
        """model -> datacenter -> (any shard spot, first registration, replica id), ascending."""
        self._entry: dict[tuple[str, str], tuple[str, tuple[bool, int, str]]] = {}
        """(model, replica) -> (datacenter, its entry in ``_ranked``)."""

    def update(self, model: str, replica_id: str, nodes: list[Node], num_shards: int) -> None:
        """``nodes``: the replica's clients now (host copies excluded)."""
        old = self._entry.pop((model, replica_id), None)
        if old is not None:
            dc, item = old
            ranked = self._ranked[model][dc]
            del ranked[bisect.bisect_left(ranked, item)]
            if not ranked:
                del self._ranked[model][dc]
                if not self._ranked[model]:
                    del self._ranked[model]
        if len(nodes) != num_shards or any(n.stage_for for n in nodes):
            return
        dc = nodes[0].datacenter
        if any(n.datacenter != dc for n in nodes):
            return
        item = (any(n.spot for n in nodes), min(n.order for n in nodes), replica_id)
        self._entry[(model, replica_id)] = (dc, item)
        bisect.insort(self._ranked.setdefault(model, {}).setdefault(dc, []), item)

    def datacenters(self, model: str) -> dict[str, list]:
        """The datacenters with a candidate seeder of ``model`` (read only)."""
        return self._ranked.get(model, {})

    def has(self, model: str, dc: str, replica_id: str) -> bool:
        """``replica_id`` is a whole replica of ``model`` registered in ``dc``."""
        entry = self._entry.get((model, replica_id))
        return entry is not None and entry[0] == dc

    def choose(self, model: str, dc: str, nodes_of: Callable[[str], list[Node]]) -> list[Node]:
        """The seeder of ``dc`` (which has candidates): the best-ranked idle replica among the
        first :data:`SEED_LOOK_MAX`, else the best-ranked one. Returns its nodes."""
        ranked = self._ranked[model][dc]
        for _, _, rid in ranked[:SEED_LOOK_MAX]:
            nodes = nodes_of(rid)
            if not any(n.state in _BUSY for n in nodes):
                return nodes
        return nodes_of(ranked[0][2])


class CrossDatacenter:
    """Offload seeding and smart skipping (see the module docstring): a part of the reference
    core. It reads the shared :class:`~tensorhub.core.table.Table`, keeps its own candidate
    seeders (:attr:`candidates`) and each model's ``seed_asked`` entries, and delivers
    ``SeedAhead``; it changes no node's state."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.candidates = SeedCandidates()
        """Per (model, datacenter), the whole replicas that may seed it; the core updates it as
        a replica gains or loses a client."""

    def seed_remote(self, model: str, dcs: Optional[set[str]] = None) -> None:
        """Offload seeding: every datacenter (of ``dcs``, default all) with readers of ``model``
        but neither a holder nor a read of its newest committed version gets one seeder replica,
        asked to prefetch it in the background (:class:`~tensorhub.core.messages.SeedAhead`): the
        one cross-datacenter copy starts at once, not when the first reader there calls
        ``update``. The seeder: a whole replica registered there, idle before busy, non-spot
        before spot, then registration order; prefetch staging copies and host copies are never
        asked. Asked again when the asked replica (or the datacenter's reader of the version)
        is gone, when a newer version is committed, or when a reader registers in a datacenter
        not yet asked. Only on those events, and only for the datacenters they concern.

        Cost, per datacenter looked at: O(shards) through the index (whether it has or reads
        the version, whether its asked seeder is still registered); when a seeder is chosen,
        the candidates passed over, at most :data:`SEED_LOOK_MAX` (:class:`SeedCandidates`).
        Never a scan of the model's replicas: a removal among 10,000 clients costs what it costs
        among 100."""
        mod = self.table.models.get(model)
        if not self.table.config.offload_seeding or mod is None or not mod.committed:
            return
        v = mod.committed[-1]
        groups = [self.table.group((model, v, s)) for s in range(mod.num_shards)]
        if not any(g.counts[st] for g in groups for st in SERVABLE):
            return  # nothing to seed from (yet, or any more)
        here = self.candidates.datacenters(model)
        for dc in sorted(here if dcs is None else dcs & here.keys()):
            asked = mod.seed_asked.get(dc)
            if any(g.visible_dc[dc] or g.active_dc[dc] or g.offloading_dc[dc] for g in groups):
                if asked is None or asked[0] < v:
                    self.set_seed_asked(mod, dc, (v, "", self.table.now))
                continue
            if asked is not None and asked[0] >= v and self.candidates.has(model, dc, asked[1]):
                continue  # asked already, and alive
            nodes = self.candidates.choose(model, dc, lambda rid: self.table.replica_nodes(model, rid))
            self.set_seed_asked(mod, dc, (v, nodes[0].replica_id, self.table.now))
            log.info("model=%s version=%d: replica %s seeds datacenter %s", model, v, nodes[0].replica_id, dc)
            for n in sorted(nodes, key=lambda n: n.shard):
                self.table.deliver(n.id, m.SeedAhead(version=v))

    def prefetch_in_datacenters(self, models: set[str]) -> None:
        """``prefetch_in_datacenter``: in every datacenter where the seed asked of a replica
        (``seed_asked``, a seeder named) has reached every shard -- each has a candidate source
        there, complete or partial (PUBLISHED or READING) -- every *other* whole replica
        registered there (:class:`SeedCandidates`; never a staging copy, a host copy or the
        seeder) gets ``PrefetchAhead(version)``, once per (datacenter, version)
        (``ModelRecord.prefetch_told``; soft state: a restarted server may tell again, and a
        handle that has the version ignores it). Their staging
        copies then read inside the datacenter behind the seed (the scheduler's rule 3: a
        candidate there, busy or not, means no crossing), so no second copy crosses.

        Called at the end of every request and tick for the models it touched. Cost per model:
        O(asked datacenters x shards) through the index, plus the replicas told when a seed
        first reaches a datacenter (each needs its note anyway)."""
        config = self.table.config
        if not (config.offload_seeding and config.prefetch_in_datacenter):
            return
        for model in sorted(models):
            mod = self.table.models.get(model)
            if mod is None or not mod.seed_asked:
                continue
            for dc, (v, rid, _) in sorted(mod.seed_asked.items()):
                if not rid or mod.prefetch_told.get(dc, -1) >= v or v < mod.forgotten_below:
                    continue
                if not all(self.table.group((model, v, s)).cands_dc.get(dc) for s in range(mod.num_shards)):
                    continue  # not every shard has a holder here yet: a prefetch would cross
                mod.prefetch_told[dc] = v
                others = [r for _, _, r in self.candidates.datacenters(model).get(dc, ()) if r != rid]
                if others:
                    log.info("model=%s version=%d: the seed is in datacenter %s: %d replicas there prefetch it",
                             model, v, dc, len(others))
                for other in others:
                    for n in sorted(self.table.replica_nodes(model, other), key=lambda n: n.shard):
                        self.table.deliver(n.id, m.PrefetchAhead(version=v))

    def set_seed_asked(self, mod: ModelRecord, dc: str, entry: Optional[tuple[int, str, float]]) -> None:
        """Replace (or drop) ``dc``'s seed entry. Readers of the old entry's version there may
        have been waiting for that seeder (``seed_pending``): look at them again."""
        old = mod.seed_asked.pop(dc, None)
        if entry is not None:
            mod.seed_asked[dc] = entry
        if old is not None and old[1]:
            self.table.touched.update((mod.name, old[0], sh) for sh in range(mod.num_shards)
                                 if (mod.name, old[0], sh) in self.table.groups)

    def seed_pending(self, model: str, version: int) -> dict[str, str]:
        """Datacenter -> asked seeder replica, where that seeder of ``version`` was asked less
        than ``seed_wait_s`` ago: the datacenter's other readers wait for its copy (then read
        it there) instead of crossing on their own; the seeder itself may cross (a client that
        does not prefetch seeds in its own update). After that, the first reader crosses
        (``tick`` re-pumps)."""
        mod = self.table.models.get(model)
        if mod is None or not mod.seed_asked:
            return {}
        return {dc: rid for dc, (v, rid, t) in mod.seed_asked.items()
                if v == version and rid and (self.table.now - t < self.table.config.seed_wait_s
                                             or self.seeder_busy(model, rid))}

    def seeder_busy(self, model: str, replica_id: str) -> bool:
        """The replica's staging copy (replica ``<replica>~prefetch``) is reading a version:
        an asked seeder still crossing an older version keeps its datacenter's claim on the
        link (it takes the newer one next) instead of letting every reader there cross."""
        for i in self.table.replicas.get((model, f"{replica_id}~prefetch"), ()):
            n = self.table.nodes[i]
            if n.stage_for and n.state in (NodeState.READING, NodeState.WAITING):
                return True
        return False

    def keeps_dc_copy(self, node: Node) -> bool:
        """Offload seeding keeps a landed seed in its datacenter: a staging copy moving on (to
        the next seed, the link starts at once) that holds the only copy of its version in its
        datacenter, newer than every other version complete there, offloads it first -- a host
        copy there, for the datacenter's readers to skip to while the next seed crosses. Without
        it, a seed slower than the trainer's step was overwritten the moment it landed and the
        datacenter's engines ran on a version several steps old."""
        if not node.stage_for or node.spot or not self.table.config.smart_skipping:
            return False
        if node.version not in self.table.retained(node.model):
            return False
        if self.table.group(node.key).visible_dc[node.datacenter] > 0:
            return False  # another holder there keeps it
        return not any(self.complete_in(node.model, v, node.datacenter)
                       for v in self.table.retained(node.model) if v > node.version)

    def complete_in(self, model: str, version: int, dc: str) -> bool:
        """Every shard of ``version`` has a visible complete holder in datacenter ``dc``."""
        return all(self.table.group((model, version, s)).visible_dc[dc] > 0
                   for s in range(self.table.models[model].num_shards))

    def newest_in_play(self, model: str, avail: list[int]) -> int:
        """The newest retained committed version that is available or on its way to being so:
        every shard has a complete holder (its only one may be draining: a trainer waiting for
        its readers to finish before it writes the next version) or a reader. While the trainer
        drains, ``avail[-1]`` falls back to an older version held elsewhere; skipping decisions
        must not follow it there."""
        mod = self.table.models[model]
        for v in reversed(mod.committed):
            if v < mod.forgotten_below or v <= avail[-1]:
                break
            if all(any(self.table.group((model, v, s)).counts[st] for st in IN_PLAY) for s in range(mod.num_shards)):
                return v
        return avail[-1]

    def smart_skip(self, node: Node, avail: list[int]) -> Optional[tuple[int, int]]:
        """While a newer version is on its way into the reader's datacenter (a seed asked of a
        replica there, or any read of it there), answer the newest version already complete
        there instead of queueing behind it -- or the version the reader itself publishes, if
        that is newer (it may be past retention: the engine keeps what it has until the seed
        lands rather than fetching across on its own).

        Returns ``(version, in_flight)``: ``in_flight >= 0``, the version skipped (still on its
        way); ``-1``, not a skip: the reader holds nothing to keep and reads ``version``, the one
        seeding into its datacenter (behind the local seed, never an older one across). None:
        no skipping rule applies (resolve as usual). "Newest" is the newest version in play
        (:meth:`newest_in_play`), not merely the newest with a visible holder now."""
        newest = self.newest_in_play(node.model, avail)
        dc = node.datacenter
        if self.complete_in(node.model, newest, dc):
            return None
        local = self._ready(node.model, dc, avail, newest)
        own = node.version if node.state is NodeState.PUBLISHED and node.version < newest else -1
        keep = max(local, own)
        if not self._seeding(node.model, dc, newest, keep, node):
            return None
        if keep < 0:
            return newest, -1
        return keep, newest

    def skip_news(self, model: str, dc: str, avail: list[int]) -> tuple[int, int]:
        """What :meth:`smart_skip` answers now, in datacenter ``dc``, a reader of ``model`` that
        publishes the newest version complete there: ``(in_flight, ready)``, ``ready`` that
        version and ``in_flight`` the newer one it skips, still on its way into ``dc``;
        :data:`NO_SKIP` when it would not skip (smart skipping off, nothing complete there, the
        newest version in play complete there already -- the seed landed -- or nothing seeding
        into ``dc``, or a model of several layout classes). The same rules as :meth:`smart_skip`
        for a published reader of ``ready``
        (pushed to the datacenter's handles, :mod:`tensorhub.core.views`). Cost: that of one
        :meth:`smart_skip`."""
        if not (self.table.config.smart_skipping and avail):
            return NO_SKIP
        if len(self.table.classes.get(logical(model), ())) > 1:
            # Several layout classes: a class's skip ignores what another class holds in the
            # datacenter (a resharded read would bring it): the server decides each no-op
            # (simulator mixed seed 701: a local skip the server's rules never gave).
            return NO_SKIP
        newest = self.newest_in_play(model, avail)
        if self.complete_in(model, newest, dc):
            return NO_SKIP
        ready = self._ready(model, dc, avail, newest)
        if ready < 0 or not self._seeding(model, dc, newest, ready, None):
            return NO_SKIP
        return newest, ready

    def skip_datacenters(self, model: str) -> set[str]:
        """The datacenters where :meth:`skip_news` may find a skip: those with a seed entry of
        ``model`` and those with a read of a retained version; everywhere else nothing seeds.
        Cost: O(retained versions x shards x datacenters), never a scan of the clients."""
        mod = self.table.models.get(model)
        if mod is None or not self.table.config.smart_skipping:
            return set()
        dcs = set(mod.seed_asked)
        for v in self.table.retained(model):
            for s in range(mod.num_shards):
                dcs.update(dc for dc, n in self.table.group((model, v, s)).active_dc.items() if n > 0)
        return dcs

    def _ready(self, model: str, dc: str, avail: list[int], newest: int) -> int:
        """The newest available version older than ``newest`` complete in ``dc`` (-1: none)."""
        return next((v for v in reversed(avail) if v < newest and self.complete_in(model, v, dc)), -1)

    def _seeding(self, model: str, dc: str, newest: int, keep: int, reader: Optional[Node]) -> bool:
        """Whether a version newer than ``keep`` is on its way into ``dc``: ``newest``'s seed is
        asked there and pending, or a node there (not ``reader`` itself) reads a newer one."""
        if dc in self.seed_pending(model, newest):
            return True

        def active_here(v: int, s: int) -> int:
            me = 1 if (reader is not None and reader.version == v and s == reader.shard
                       and reader.state in (NodeState.READING, NodeState.WAITING)) else 0
            return self.table.group((model, v, s)).active_dc[dc] - me

        shards = range(self.table.models[model].num_shards)
        return any(active_here(v, s) > 0 for v in self.table.retained(model) if v > keep for s in shards)
