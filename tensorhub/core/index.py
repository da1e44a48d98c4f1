"""Indexes over the reference table, so that no request scans every node of a model.

The table (``ReferenceCore.nodes``) stays the one truth; this module keeps derived views of it
that the scheduler and the core query: per *group* (model, version, shard) the FIFO queue of
waiting readers, counts by state and datacenter, the staging copies, host copies, and the
*free* sources (fewer than ``readers_per_source_max`` readers) sorted by the scheduler's rank,
per datacenter and per machine. Costs: an update is O(log n) searches plus list inserts (a
memmove of n pointers); a query is O(1) or walks a sorted list from its best end.

Contract with the core: after it changes a field of a node that an index reads (state,
version, progress, readers, stamp, copy_asked, suspected_at, awaiting_source), the core calls
:meth:`Index.mark`; the views are brought up to date lazily, before the next query
(:meth:`Index.group` and the ``Index`` sets flush first). Each node remembers what was last
recorded for it (``Node.indexed``), so an update removes exactly what it added.
"""

from __future__ import annotations

import bisect
import collections
from typing import Iterator, Optional

from tensorhub.core.scheduler import rank
from tensorhub.core.state import COMPLETE, Node, NodeState

Key = tuple[str, int, int]
_CANDIDATE = frozenset({NodeState.PUBLISHED, NodeState.READING})
"""States a scheduler may pick a source from (``scheduler.eligible`` narrows further)."""
_ACTIVE = frozenset({NodeState.READING, NodeState.WAITING})


def _entry(node: Node, free_max: int):
    key = node.key if node.version >= 0 else None
    cand = key is not None and node.state in _CANDIDATE
    free = rank(node) if cand and len(node.readers) < free_max else None
    return (
        key, node.state, node.datacenter, node.machine, node.stamp, cand, free, node.stage_for,
        node.host, key is not None and node.copy_asked == node.version, node.model,
        node.suspected_at is not None, node.awaiting_source is not None,
    )


def _remove_sorted(lst: list, item) -> None:
    i = bisect.bisect_left(lst, item)
    assert i < len(lst) and lst[i] == item, "index out of step with the table"
    del lst[i]


class Group:
    """The derived views of one (model, version, shard)."""

    __slots__ = ("counts", "waiting", "cands_dc", "free_all", "free_dc", "free_machine", "staged",
                 "hosts", "asked", "visible_dc", "active_dc", "offloading_dc", "size")

    def __init__(self) -> None:
        self.size = 0
        self.counts: collections.Counter = collections.Counter()
        self.waiting: list[tuple[int, str]] = []
        """(stamp, id) of WAITING readers, ascending: the FIFO queue."""
        self.cands_dc: dict[str, set[str]] = {}
        """PUBLISHED or READING nodes by datacenter."""
        self.free_all: list[tuple[tuple, str]] = []
        """(rank, id) of candidates with a free reader slot, best first."""
        self.free_dc: dict[str, list] = {}
        self.free_machine: dict[str, list] = {}
        self.staged: dict[str, set[str]] = {}
        """Candidates that are prefetch staging copies, by the handle they stage for."""
        self.hosts: set[str] = set()
        self.asked: set[str] = set()
        """Nodes asked to make a host copy of this version (MakeHostCopy)."""
        self.visible_dc: collections.Counter = collections.Counter()
        """PUBLISHED nodes per datacenter."""
        self.active_dc: collections.Counter = collections.Counter()
        """READING or WAITING nodes per datacenter."""
        self.offloading_dc: collections.Counter = collections.Counter()
        """OFFLOADING nodes per datacenter (with the two above: the datacenters that have, or
        are getting, this version, for offload seeding)."""

    def complete(self) -> int:
        return sum(self.counts[s] for s in COMPLETE)

    def candidates_in(self, dc: str) -> set[str]:
        return self.cands_dc.get(dc, set())

    def all_candidates(self) -> Iterator[str]:
        for ids in self.cands_dc.values():
            yield from ids

    def free(self, dc: Optional[str], machine: str = "") -> Iterator[str]:
        """Ids of free candidates, best rank first: on ``machine`` only when it is not "" (in any
        datacenter: the caller filters), else in ``dc`` only when it is not None, else all."""
        if machine:
            for _, nid in self.free_machine.get(machine, ()):
                yield nid
        elif dc is not None:
            for _, nid in self.free_dc.get(dc, ()):
                yield nid
        else:
            for _, nid in self.free_all:
                yield nid


class Index:
    """Derived views of the whole table (see the module docstring)."""

    def __init__(self, readers_per_source_max: int) -> None:
        self.free_max = readers_per_source_max
        self.groups: dict[Key, Group] = {}
        self.state_counts: collections.Counter = collections.Counter()
        """(model, state value) -> nodes."""
        self._draining: set[str] = set()
        self._suspected: set[str] = set()
        self._awaiting: set[str] = set()
        self._dirty: dict[str, Node] = {}

    # ------------------------------------------------------------------ updates

    def mark(self, node: Node) -> None:
        """``node`` changed a field an index reads (or is new)."""
        self._dirty[node.id] = node

    def drop(self, node: Node) -> None:
        """``node`` leaves the table."""
        self._dirty.pop(node.id, None)
        if node.indexed is not None:
            self._unrecord(node.id, node.indexed)
            node.indexed = None

    def flush(self) -> None:
        while self._dirty:
            _, node = self._dirty.popitem()
            new = _entry(node, self.free_max)
            if new == node.indexed:
                continue
            if node.indexed is not None:
                self._unrecord(node.id, node.indexed)
            self._record(node.id, new)
            node.indexed = new

    def _record(self, nid: str, e) -> None:
        key, state, dc, machine, stamp, cand, free, stage_for, host, asked, model, suspected, awaiting = e
        self.state_counts[(model, state.value)] += 1
        if state is NodeState.DRAINING:
            self._draining.add(nid)
        if suspected:
            self._suspected.add(nid)
        if awaiting:
            self._awaiting.add(nid)
        if key is None:
            return
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = Group()
        g.size += 1
        g.counts[state] += 1
        if state is NodeState.WAITING:
            bisect.insort(g.waiting, (stamp, nid))
        if state in _ACTIVE:
            g.active_dc[dc] += 1
        if state is NodeState.PUBLISHED:
            g.visible_dc[dc] += 1
        if state is NodeState.OFFLOADING:
            g.offloading_dc[dc] += 1
        if host:
            g.hosts.add(nid)
        if asked:
            g.asked.add(nid)
        if cand:
            g.cands_dc.setdefault(dc, set()).add(nid)
            if stage_for:
                g.staged.setdefault(stage_for, set()).add(nid)
        if free is not None:
            item = (free, nid)
            bisect.insort(g.free_all, item)
            bisect.insort(g.free_dc.setdefault(dc, []), item)
            if machine:
                bisect.insort(g.free_machine.setdefault(machine, []), item)

    def _unrecord(self, nid: str, e) -> None:
        key, state, dc, machine, stamp, cand, free, stage_for, host, asked, model, suspected, awaiting = e
        _dec(self.state_counts, (model, state.value))
        self._draining.discard(nid)
        self._suspected.discard(nid)
        self._awaiting.discard(nid)
        if key is None:
            return
        g = self.groups[key]
        g.size -= 1
        _dec(g.counts, state)
        if state is NodeState.WAITING:
            _remove_sorted(g.waiting, (stamp, nid))
        if state in _ACTIVE:
            _dec(g.active_dc, dc)
        if state is NodeState.PUBLISHED:
            _dec(g.visible_dc, dc)
        if state is NodeState.OFFLOADING:
            _dec(g.offloading_dc, dc)
        g.hosts.discard(nid)
        g.asked.discard(nid)
        if cand:
            _discard(g.cands_dc, dc, nid)
            if stage_for:
                _discard(g.staged, stage_for, nid)
        if free is not None:
            item = (free, nid)
            _remove_sorted(g.free_all, item)
            _remove_sorted(g.free_dc[dc], item)
            if not g.free_dc[dc]:
                del g.free_dc[dc]
            if machine:
                _remove_sorted(g.free_machine[machine], item)
                if not g.free_machine[machine]:
                    del g.free_machine[machine]
        if g.size == 0:
            del self.groups[key]

    # ------------------------------------------------------------------ queries

    def group(self, key: Key) -> Optional[Group]:
        self.flush()
        return self.groups.get(key)

    def draining(self) -> set[str]:
        self.flush()
        return self._draining

    def suspected(self) -> set[str]:
        self.flush()
        return self._suspected

    def awaiting(self) -> set[str]:
        self.flush()
        return self._awaiting


def audit(index: Index, nodes) -> None:
    """Assert that ``index`` says what a fresh index built from ``nodes`` says (tests call it
    after every step of a simulation: the index must never drift from the table)."""
    index.flush()
    fresh = Index(index.free_max)
    for n in nodes.values():
        fresh._record(n.id, _entry(n, fresh.free_max))
        assert n.indexed == _entry(n, fresh.free_max), f"{n.id}: stale index entry"
    assert fresh.state_counts == index.state_counts
    assert (fresh._draining, fresh._suspected, fresh._awaiting) == (index._draining, index._suspected, index._awaiting)
    assert fresh.groups.keys() == index.groups.keys(), "groups differ"
    for key, g in fresh.groups.items():
        h = index.groups[key]
        for field in Group.__slots__:
            assert getattr(g, field) == getattr(h, field), f"group {key}: {field} differs"


def _dec(counter: collections.Counter, key) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


def _discard(d: dict[str, set[str]], k: str, nid: str) -> None:
    s = d.get(k)
    if s is not None:
        s.discard(nid)
        if not s:
            del d[k]
