"""Reading: the readers of the reference core, from queued to assigned to detached.

A part of :class:`tensorhub.core.reference.ReferenceCore` (docs/design.md, section 1, rules 2
and 5): :class:`Reading` gets the core's shared :class:`~tensorhub.core.table.Table` and the
few functions of the core it acts through passed in, and owns the queue order of readers (their
``stamp``). What it does:

- a reader is queued (``enqueue``: WAITING at a version, FIFO by stamp), assigned a source by
  :func:`tensorhub.core.scheduler.choose_source` when its group is pumped (``pump``: READING,
  an ``Assignment`` delivered), sent back to wait when its source fails (``wait``), detached
  when it finishes or stops (``detach``, which may end the source's drain);
- a reader that stops (abort, a lost version) takes its own readers' source away: they wait
  again and are reassigned from their progress (``stop``, ``orphan``);
- a group with no complete holder left can never finish a read: its readers fail with
  ``VersionLost`` (outside the recovery window after a restart, when holders may still
  re-announce);
- smart skipping's read that would have to cross datacenters after all fails instead (a
  ``latest`` caller retries and resolves anew);
- a reader whose layout class (:mod:`tensorhub.core.placements`) holds no free source of its
  version gets a *resharded read* (:meth:`Reading.reshard`): the holder shards it needs of
  another class, each published at that version and chosen shard by shard among the class's
  replicas (:class:`~tensorhub.core.other_layouts.OtherLayouts`), each of which counts it among its readers
  (their drains wait for it). One such reader per group at a time while it has room: the
  class's other readers pipeline from it, unit by unit of their own layout, as from any partial
  holder. A group with no holder of its own class is not lost while another class can still
  fill it.

Cost: a pump costs the readers it assigns plus those it looks at while some source is still
free; once every source is busy, at most :data:`_CROSS_LOOK_MAX` (the origin's
per-datacenter slots).
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable, Iterable, Optional

from tensorhub.core import messages as m
from tensorhub.core import scheduler
from tensorhub.core.other_layouts import OtherLayouts
from tensorhub.core.placements import Placements, logical, shown
from tensorhub.core.state import VISIBLE_SOURCE, Node, NodeState
from tensorhub.core.table import Key, Table
from tensorhub.errors import TensorHubError, VersionLost, code_of

log = logging.getLogger("tensorhub.core.reference")

_CROSS_LOOK_MAX = 64
"""Waiting readers a pump looks at once every source is busy, for an origin slot of their
datacenter (``scheduler.choose_source``); the rest wait for the next event of the group."""


class Reading:
    """The readers' queues and assignments (see the module docstring): a part of the reference
    core. It reads and changes nodes of the shared :class:`~tensorhub.core.table.Table` (their
    state through :meth:`Table.set_version`), owns the readers' queue order, and acts through the
    functions of the core it is given: ``finish_drain`` (a source whose last reader left),
    ``seed_pending`` (offload seeding's datacenters that wait for their seeder,
    :meth:`~tensorhub.core.crossdc.CrossDatacenter.seed_pending`), ``recovering`` (whether the
    core's recovery window after a restart is open)."""

    def __init__(self, table: Table, *, finish_drain: Callable[[Node], None],
                 seed_pending: Callable[[str, int], dict[str, str]], recovering: Callable[[], bool],
                 placements: Placements, others: OtherLayouts,
                 ask_cells: Callable[[Node, list[Node]], None],
                 grid_digests: Callable[[Node, str, str], tuple[str, ...]]) -> None:
        self.table = table
        self._finish_drain = finish_drain
        self._seed_pending = seed_pending
        self._recovering = recovering
        self._placements = placements
        """The interned placements (read only)."""
        self._others = others
        """Which replicas of other layout classes can fill a reader (read only)."""
        self._ask_cells = ask_cells
        """Asks the holders of a resharded read for their cell checksums
        (:meth:`tensorhub.core.cells.Cells.ask`)."""
        self._grid_digests = grid_digests
        """The placements of a resharded read's checksum grid (:meth:`tensorhub.core.cells.Cells.grid_digests`)."""
        self._stamp = 0
        self._reshard_waits: dict[tuple[str, int], set[Key]] = {}
        """(model, version) -> groups of its layout classes whose waiting readers found no
        other class's holder with room: touched again when a group of that version changes."""
        self._joining: dict[Key, set[str]] = {}
        """Group -> its waiting readers a shard of whose replica reads that version by a
        resharded read: they reshard before the queue's head (:meth:`_reshard_waiting`)."""

    def stamp(self, node: Node) -> None:
        """``node`` joins the end of its group's queue."""
        self._stamp += 1
        node.stamp = self._stamp
        self.table.index.mark(node)

    def enqueue(self, node: Node, version: int, resume: int) -> None:
        """``node`` waits to read ``version`` from unit ``resume`` on (clamped to its units)."""
        self.table.set_version(node, version, NodeState.WAITING, max(0, min(resume, node.units)))
        node.suspects.clear()
        self.stamp(node)
        if node.placement and any(n.reshard_from and n.version == version
                                  for n in self.table.replica_nodes(node.model, node.replica_id)):
            self._joining.setdefault(node.key, set()).add(node.id)

    def wait(self, node: Node) -> None:
        """``node`` lost its source: it waits for another, keeping its place and progress."""
        node.state = NodeState.WAITING
        node.source = None
        self.table.index.mark(node)
        self.table.touched.add(node.key)

    def detach(self, node: Node) -> None:
        """``node`` no longer reads from its source(s) (a source's drain may end here)."""
        self._leave_sources(node, "")

    def _leave_sources(self, node: Node, gone: str) -> None:
        """``node`` leaves every source it reads from but ``gone`` (which is being removed)."""
        ids = node.reshard_from or ((node.source,) if node.source else ())
        node.source = None
        node.reshard_from = ()
        for sid in ids:
            src = self.table.nodes.get(sid) if sid != gone else None
            if src is not None:
                src.readers.discard(node.id)
                self.table.index.mark(src)
                self.table.touched.add(src.key)
                if src.state is NodeState.DRAINING and not src.readers:
                    self._finish_drain(src)

    def stop(self, node: Node) -> None:
        """The node stops receiving (abort, lost version): its own readers lose their source."""
        self.detach(node)
        for r in sorted(node.readers):
            self.orphan(r, node.id)
        node.readers.clear()
        self.table.set_version(node, -1, NodeState.IDLE, 0)

    def orphan(self, reader_id: str, source_id: str) -> None:
        """Source ``source_id`` of ``reader_id`` is gone (the caller clears its readers): a
        reading reader waits for another, leaving its other sources (a resharded read's)."""
        reader = self.table.nodes.get(reader_id)
        if reader is not None and reader.state is NodeState.READING:
            self._leave_sources(reader, source_id)
            self.wait(reader)

    def fail(self, node: Node, err: TensorHubError) -> None:
        """``node``'s read ends with ``err`` (delivered, and kept as its ``failure``)."""
        log.info("model=%s version=%d reader=%s fails: %s", node.model, node.version, node.id, err)
        version = node.version  # stop() forgets it
        self.stop(node)
        node.failure = m.Failed(code=code_of(err), message=str(err), version=version)
        self.table.deliver(node.id, node.failure)

    def attach(self, reader: Node, src: Node) -> None:
        """``reader`` reads from ``src`` now (the caller delivers the assignment, or not: an
        edge announced after a restart is restored as it was)."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("model=%s version=%d reader=%s (%s) reads from %s (%s, %s, %d units)", reader.model,
                      reader.version, reader.id, reader.datacenter, src.id, src.datacenter, src.state.name,
                      src.progress)
        reader.state = NodeState.READING
        reader.source = src.id
        reader.assign_no += 1
        src.readers.add(reader.id)
        self.table.index.mark(reader)
        self.table.index.mark(src)

    def assignment(self, node: Node) -> m.Assignment:
        """The assignment of a reading node, as its reader gets it."""
        src = self.table.nodes[node.source]
        gone, node.failed_gone = node.failed_gone, False
        if node.reshard_from:
            # Every shard of the holder class (the reader plans over all of them), each
            # distinct placement once; it reads only those in reshard_from, which may be of
            # several replicas of the class (OtherLayouts: chosen shard by shard), the others
            # listed from src's replica for their placements. Then the reader class's (the
            # checksum grid is over both: tensorhub.core.cells).
            shards = self._reshard_listing(src, node.reshard_from)
            digests = list(dict.fromkeys([*(n.placement for n in shards),
                                          *self._grid_digests(src, node.model, node.placement)]))
            return m.Assignment(
                version=node.version, source_id=src.id, source_endpoint=src.endpoint, source_partial=False,
                start_unit=node.progress, assign_no=node.assign_no, failed_source_gone=gone, in_flight=node.in_flight,
                cross_datacenter=any(self.table.nodes[i].datacenter != node.datacenter for i in node.reshard_from),
                reshard=tuple(m.ReshardSource(n.shard, n.id, n.endpoint, n.placement) for n in shards),
                placements=tuple(self._placements.get(d) for d in digests),
            )
        return m.Assignment(
            version=node.version, source_id=src.id, source_endpoint=src.endpoint,
            source_partial=not src.complete, start_unit=node.progress, assign_no=node.assign_no,
            cross_datacenter=src.datacenter != node.datacenter, failed_source_gone=gone,
            in_flight=node.in_flight,
        )

    # ------------------------------------------------------------------ resharded reads

    def _reshard_listing(self, src: Node, chosen_ids: tuple[str, ...]) -> list[Node]:
        """One node per shard of ``src``'s class, in shard order: the chosen holder of each
        shard a resharded read takes, else ``src``'s replica's node of that shard (else any of
        the class at ``src``'s version): only its placement counts there."""
        nodes = self.table.nodes
        chosen = {nodes[i].shard: nodes[i] for i in chosen_ids if i in nodes}
        own = {n.shard: n for n in self.table.replica_nodes(src.model, src.replica_id)}
        out = []
        for k in range(self.table.models[src.model].num_shards):
            n = chosen.get(k) or own.get(k)
            if n is None:  # a live holder's placement, else a host copy's (the same: its owner's)
                n = min((nodes[i] for i in self.table.groups.get((src.model, src.version, k), ()) if nodes[i].placement),
                        key=lambda x: (x.host, x.id), default=None)
            if n is not None:
                out.append(n)
        return out

    def reshard(self, reader: Node, srcs: list[Node]) -> None:
        """``reader`` reads its version from the holder shards ``srcs`` (another layout class):
        each lists it among its readers; the caller delivers the assignment."""
        reader.state = NodeState.READING
        reader.source = srcs[0].id
        reader.reshard_from = tuple(s.id for s in srcs)
        reader.assign_no += 1
        for s in srcs:
            s.readers.add(reader.id)
            self.table.index.mark(s)
        self.table.index.mark(reader)
        self._ask_cells(reader, srcs)
        for n in self.table.replica_nodes(reader.model, reader.replica_id):
            if n.state is NodeState.WAITING and n.version == reader.version:
                self._joining.setdefault(n.key, set()).add(n.id)
                self.table.touched.add(n.key)
        log.debug("model=%s version=%d reader=%s reshards from %s", reader.model, reader.version, reader.id,
                  ", ".join(reader.reshard_from))

    def _reshard_waiting(self, key: Key, g) -> None:
        """Readers of ``key`` (a group with no complete holder of its own class) with no free
        source of their class: the first in FIFO order that another class can fill gets a
        resharded read (the others then pipeline from it). None can: the group waits for a
        change at that version in another class.

        Before the queue's head: readers another shard of whose replica reshards already (the
        holders count a replica's shards once, so they add no load there). Without this, a
        replica's first shard to ask takes the holder, another replica's shard queues for it
        ahead of the first one's siblings, and the pipeline of the class waits for the whole
        resharded read instead of following it."""
        if not g.waiting:
            self._joining.pop(key, None)
            return
        if g.free_all:
            return
        if self._reshard_joining(key):
            return
        for _, rid in list(g.waiting):
            reader = self.table.nodes[rid]
            if reader.awaiting_source is not None:
                continue
            srcs = self._others.sources(reader)
            if srcs is None:
                self._reshard_waits.setdefault((logical(key[0]), key[1]), set()).add(key)
                return
            self.reshard(reader, srcs)
            self.table.deliver(reader.id, self.assignment(reader))
            return

    def _reshard_joining(self, key: Key) -> bool:
        """Give the waiting readers of ``key`` that join their replica's resharded read theirs;
        whether any got one. One that finds no holder with room stays in line for the next
        pump; one no longer waiting there is forgotten."""
        ids = self._joining.pop(key, None)
        if not ids:
            return False
        nodes, assigned, left = self.table.nodes, False, set()
        for rid in sorted(ids, key=lambda i: nodes[i].stamp if i in nodes else 0):
            reader = nodes.get(rid)
            if reader is None or reader.state is not NodeState.WAITING or reader.key != key:
                continue
            srcs = None if reader.awaiting_source is not None else self._others.sources(reader)
            if srcs is None:
                left.add(rid)
                continue
            self.reshard(reader, srcs)
            self.table.deliver(reader.id, self.assignment(reader))
            assigned = True
        if left:
            self._joining.setdefault(key, set()).update(left)
        return assigned

    def _reshard_rooted(self, key: Key) -> bool:
        """Whether a reader of ``key`` (no complete holder of its own class) can still finish: one
        reads by a reshard already, or another class has a replica complete at the version."""
        nodes = self.table.nodes
        ids = self.table.groups.get(key, ())
        if any(nodes[i].reshard_from for i in ids):
            return True
        probe = next((nodes[i] for i in sorted(ids) if nodes[i].placement), None)
        return probe is not None and self._others.sources(probe, room=False) is not None

    def downstream(self, node: Node) -> set[str]:
        """Every node that reads from ``node``, directly or through others (never its source)."""
        nodes = self.table.nodes
        out: set[str] = set()
        todo = list(node.readers)
        while todo:
            r = todo.pop()
            if r in out or r not in nodes:
                continue
            out.add(r)
            todo.extend(nodes[r].readers)
        return out

    def pump(self, key: Key) -> None:
        """Assign the waiting readers of one group, FIFO. Cost: the readers assigned plus those
        looked at while some source is still free (none once every source is busy)."""
        table = self.table
        waits = self._reshard_waits.get((logical(key[0]), key[1]))
        g = table.index.group(key)
        stuck = g is not None and bool(g.waiting) and not g.complete()
        if waits and any(k[0] != key[0] for k in waits) and not stuck:
            # Something changed at this version in a layout class: readers of other classes
            # waiting for a resharded read look again. Not from a group that waits itself with
            # no complete holder: nothing another class could read from is there, and two such
            # groups would wake each other without end (only the groups woken here wait so).
            table.touched.update(k for k in waits if k[0] != key[0])
            waits.intersection_update(k for k in waits if k[0] == key[0])
            if not waits:
                del self._reshard_waits[(logical(key[0]), key[1])]
        if g is None or (not g.waiting and not g.counts[NodeState.READING]):
            return
        if not g.complete():
            self._reshard_waiting(key, g)
            g = table.index.group(key)
        if not self._recovering() and not g.complete() and not self._reshard_rooted(key):
            # Every chain of partial holders roots at a complete one (or at a resharded read
            # from another layout class); with none left, no reader of this group can finish.
            lost = VersionLost(f"{shown(key[0])} version {key[1]} shard {key[2]}: no holder is left")
            for n in sorted((table.nodes[i] for i in table.groups.get(key, ())), key=lambda n: n.stamp):
                if n.state in (NodeState.WAITING, NodeState.READING):
                    self.fail(n, lost)
            return
        blocked_dcs = self._seed_pending(key[0], key[1])
        passed_over = False
        pool = _GroupPool(table, key)
        origin = table.models[key[0]].origin_dc.get(key[1]) if key[0] in table.models else None
        after: tuple = ()
        tried: set[str] = set()
        looked = 0
        while True:
            g = table.index.group(key)
            if g is None:
                return
            cross_only = not (g.free_all or g.staged)
            if cross_only and not (origin is not None and g.visible_dc[origin]
                                   and any(dc != origin and n for dc, n in g.active_dc.items())):
                return  # every source is busy: no reader can be assigned (rules 2 and 4)
            i = bisect.bisect_right(g.waiting, after)
            if i == len(g.waiting):
                return
            after = g.waiting[i]
            reader = table.nodes[after[1]]
            if reader.awaiting_source is not None:
                continue
            if cross_only:
                # Only the origin's per-datacenter slots may be left: one look per remote
                # datacenter, and a bounded one (a queue of thousands is not scanned per event).
                looked += 1
                if looked > _CROSS_LOOK_MAX:
                    return
                if reader.datacenter == origin or reader.datacenter in tried:
                    continue
                tried.add(reader.datacenter)
            src = scheduler.choose_source(
                reader, pool, downstream=self.downstream(reader),
                readers_per_source_max=table.config.readers_per_source_max,
                seeding_blocked=reader.datacenter in blocked_dcs and not reader.stage_for
                and blocked_dcs.get(reader.datacenter) != reader.replica_id,
                origin_dc=origin,
            )
            if src is None:
                blocked_dcs.setdefault(reader.datacenter, "")
                passed_over = True
                continue
            if reader.in_flight >= 0 and src.datacenter != reader.datacenter:
                # Smart skipping chose this version because it was complete here; its holders
                # here moved on meanwhile. Fetching it across would cost the link for a version
                # already stale: end the read (a "latest" caller retries and resolves anew).
                self.fail(reader, VersionLost(
                    f"{key[0]} version {key[1]} shard {key[2]}: chosen by smart skipping, no longer held in "
                    f"datacenter {reader.datacenter}"))
                continue
            self.attach(reader, src)
            table.deliver(reader.id, self.assignment(reader))
            if passed_over:
                # An earlier reader found no source; this one may now be its source (a seeder
                # staging copy that started after it asked): look again.
                table.touched.add(key)


class _GroupPool:
    """The scheduler's view (:class:`scheduler.Pool`) of one group through the core's index. A
    host copy stands in for its owner's GPU copy only once the owner stops serving the version:
    both live behind the owner's NIC, so serving from both would double its load (and break the
    pipeline) instead of spreading it."""

    def __init__(self, table: Table, key: Key) -> None:
        self.table = table
        self.key = key

    def _nodes(self, ids: Iterable[str]) -> Iterable[Node]:
        nodes = self.table.nodes
        for i in ids:
            n = nodes[i]
            if n.host:
                owner = nodes.get(n.owner)
                if owner is not None and owner.key == self.key and owner.state in VISIBLE_SOURCE:
                    continue
            yield n

    def everyone(self) -> Iterable[Node]:
        return self._nodes(self.table.group(self.key).all_candidates())

    def in_datacenter(self, dc: str) -> Iterable[Node]:
        return self._nodes(self.table.group(self.key).candidates_in(dc))

    def staged_for(self, reader_id: str) -> Iterable[Node]:
        return self._nodes(self.table.group(self.key).staged.get(reader_id, ()))

    def free(self, dc: Optional[str], machine: str) -> Iterable[Node]:
        return self._nodes(self.table.group(self.key).free(dc, machine))

    def readers_in(self, cand: Node, dc: str) -> int:
        nodes = self.table.nodes
        return sum(1 for r in cand.readers if r in nodes and nodes[r].datacenter == dc)
