"""Source selection: a pure policy over candidate holders.

Given a reader and the nodes holding or receiving the same (model, version, shard), pick the
source, or none (the reader waits). Rules, in order:

1. A candidate is complete and visible (PUBLISHED; not OFFLOADING), or a partial holder
   (READING) that is not downstream of the reader and at least as far as the reader; a node some
   reader could not reach at all is no candidate until it talks to the server again. Sources
   the reader reported failed (``Node.suspects``) only when no other candidate is left.
2. The reader's own prefetch staging copy (``Node.stage_for``) before anything else, whatever
   its load: it lives in the reader's process, the copy is local and crosses no link. While it
   is still arriving, a free complete holder in the reader's datacenter goes first.
3. Same datacenter first: when any candidate, busy or not, lives in the reader's datacenter,
   only those are used, and the reader waits if all are busy. Only when the datacenter has
   none does the reader read across (it becomes that datacenter's *seeder*), and then only if
   no earlier reader of that datacenter is already waiting to seed; from the version's origin
   datacenter (where the replica that committed it lives) when a source there is free.
4. At most ``readers_per_source_max`` readers per source.
5. A free candidate on the reader's own host first (memory copies, no network), then any.
6. Least loaded first; ties: complete before partial, further progress, GPU before host copy,
   then registration order.
"""

from __future__ import annotations

from typing import Iterable, Optional, Protocol

from tensorhub.core.state import NodeState, VISIBLE_SOURCE, Node


class Pool(Protocol):
    """The candidate holders of one (model, version, shard) as the scheduler reads them: nodes
    that are PUBLISHED or READING (``eligible`` narrows further per reader). ``free`` yields
    the candidates with fewer than ``readers_per_source_max`` readers in ``rank`` order, best
    first, so a choice stops at the first usable one instead of ranking the whole group."""

    def everyone(self) -> Iterable[Node]: ...

    def in_datacenter(self, dc: str) -> Iterable[Node]: ...

    def staged_for(self, reader_id: str) -> Iterable[Node]: ...

    def free(self, dc: Optional[str], machine: str) -> Iterable[Node]:
        """Free candidates, best first; only in ``dc`` unless None, only on ``machine`` unless ""."""
        ...

    def readers_in(self, cand: Node, dc: str) -> int:
        """How many of ``cand``'s readers are in datacenter ``dc``."""
        ...


def eligible(reader: Node, cand: Node, downstream: set[str]) -> bool:
    if cand.id == reader.id or cand.id in downstream or cand.unreachable:
        return False
    if cand.state in VISIBLE_SOURCE:
        return True
    return cand.state is NodeState.READING and cand.progress >= reader.progress


def rank(cand: Node) -> tuple:
    return (
        len(cand.readers),
        0 if cand.state in VISIBLE_SOURCE else 1,
        -cand.progress,
        1 if cand.host else 0,
        cand.order,
    )


def choose_source(
    reader: Node,
    pool: Pool,
    *,
    downstream: set[str],
    readers_per_source_max: int,
    seeding_blocked: bool,
    origin_dc: Optional[str] = None,
) -> Optional[Node]:
    """The source for ``reader`` or None. ``seeding_blocked``: an earlier reader of the same
    datacenter is waiting to seed, so this one must not open a second cross-datacenter copy.
    Cost: the candidates looked at before the answer (the first usable one, typically)."""
    def ok(c: Node) -> bool:
        return eligible(reader, c, downstream)

    suspects = reader.suspects
    if suspects and not any(ok(c) and c.id not in suspects for c in pool.everyone()):
        suspects = set()  # rule 1: suspects only when nothing else is eligible

    def usable(c: Node) -> bool:
        return ok(c) and c.id not in suspects

    def first_free(dc: Optional[str], machine: str, complete: bool = False) -> Optional[Node]:  # rules 4, 6
        for c in pool.free(dc, machine):
            if (len(c.readers) < readers_per_source_max and usable(c) and (dc is None or c.datacenter == dc)
                    and (not complete or c.state is NodeState.PUBLISHED)):
                return c
        return None

    own = [c for c in pool.staged_for(reader.id) if usable(c)]  # rule 2
    if own:
        best = min(own, key=rank)
        if best.state is NodeState.READING:
            # Still arriving (across datacenters, perhaps): a free complete holder in the
            # datacenter is faster than waiting behind it.
            return first_free(reader.datacenter, "", complete=True) or best
        return best
    dc: Optional[str] = reader.datacenter  # rule 3
    if not any(usable(c) for c in pool.in_datacenter(reader.datacenter)):
        if seeding_blocked:
            return None
        if origin_dc is not None and origin_dc != reader.datacenter:
            # Across datacenters, from where the version was made first (the trainer's
            # datacenter), not from another remote datacenter's copy (two slow links).
            src = first_free(origin_dc, "")
            if src is not None:
                return src
            # Every datacenter has its own slot(s) on a complete origin source, besides the
            # origin's own pipeline: the slow links are separate bottlenecks, and this
            # datacenter's one copy should start now, not after another datacenter's.
            for c in sorted((c for c in pool.in_datacenter(origin_dc) if usable(c) and c.state in VISIBLE_SOURCE),
                            key=rank):
                if pool.readers_in(c, reader.datacenter) < readers_per_source_max:
                    return c
            if any(usable(c) for c in pool.in_datacenter(origin_dc)):
                # The origin's sources are busy: wait for one. Another remote datacenter's copy
                # (busy or not) is two slow links away and ties both up for the whole read.
                return None
        dc = None

    near = first_free(dc, reader.machine) if reader.machine else None  # rule 5
    return near or first_free(dc, "")


class ListPool:
    """A :class:`Pool` over a plain list (tests, small tables): every query scans it."""

    def __init__(self, candidates: Iterable[Node], readers_per_source_max: int) -> None:
        self.nodes = [c for c in candidates if c.state is NodeState.PUBLISHED or c.state is NodeState.READING]
        self.max = readers_per_source_max

    def everyone(self) -> Iterable[Node]:
        return self.nodes

    def in_datacenter(self, dc: str) -> Iterable[Node]:
        return [c for c in self.nodes if c.datacenter == dc]

    def staged_for(self, reader_id: str) -> Iterable[Node]:
        return [c for c in self.nodes if c.stage_for and c.stage_for == reader_id]

    def free(self, dc: Optional[str], machine: str) -> Iterable[Node]:
        return sorted((c for c in self.nodes if len(c.readers) < self.max
                       and (dc is None or c.datacenter == dc) and (not machine or c.machine == machine)), key=rank)

    def readers_in(self, cand: Node, dc: str) -> int:
        """Readers given as bare ids count as in the candidate's own datacenter."""
        return len(cand.readers) if cand.datacenter == dc else 0
