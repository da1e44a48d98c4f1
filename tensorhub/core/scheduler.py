"""Source selection: a pure policy over candidate holders.

Given a reader and the nodes holding or receiving the same (model, version, shard), pick the
source, or none (the reader waits). Rules, in order:

1. A candidate is complete and visible (PUBLISHED / OFFLOADING), or a partial holder
   (READING) that is not downstream of the reader and at least as far as the reader; a node some
   reader could not reach at all is no candidate until it talks to the server again.
2. The reader's own prefetch staging copy (``Node.stage_for``) before anything else, whatever
   its load: it lives in the reader's process, the copy is local and crosses no link.
3. Same datacenter first: when any candidate, busy or not, lives in the reader's datacenter,
   only those are used, and the reader waits if all are busy. Only when the datacenter has
   none does the reader read across (it becomes that datacenter's *seeder*), and then only if
   no earlier reader of that datacenter is already waiting to seed.
4. At most ``readers_per_source_max`` readers per source.
5. A free candidate on the reader's own host first (memory copies, no network), then any.
6. Least loaded first; ties: complete before partial, further progress, GPU before host copy,
   then registration order.
"""

from __future__ import annotations

from typing import Iterable, Optional

from tensorhub.core.state import S, VISIBLE_SOURCE, Node


def eligible(reader: Node, cand: Node, downstream: set[str]) -> bool:
    if cand.id == reader.id or cand.id in downstream or cand.unreachable:
        return False
    if cand.state in VISIBLE_SOURCE:
        return True
    return cand.state is S.READING and cand.progress >= reader.progress


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
    candidates: Iterable[Node],
    *,
    downstream: set[str],
    readers_per_source_max: int,
    seeding_blocked: bool,
) -> Optional[Node]:
    """The source for ``reader`` or None. ``seeding_blocked``: an earlier reader of the same
    datacenter is waiting to seed, so this one must not open a second cross-datacenter copy."""
    usable = [c for c in candidates if eligible(reader, c, downstream)]
    fresh = [c for c in usable if c.id not in reader.suspects]
    if fresh:
        usable = fresh
    own = [c for c in usable if c.stage_for and c.stage_for == reader.id]
    if own:
        return min(own, key=rank)
    local = [c for c in usable if c.datacenter == reader.datacenter]
    if local:
        pool = local
    else:
        if seeding_blocked:
            return None
        pool = usable
    free = [c for c in pool if len(c.readers) < readers_per_source_max]
    if not free:
        return None
    near = [c for c in free if reader.machine and c.machine == reader.machine]
    return min(near or free, key=rank)
