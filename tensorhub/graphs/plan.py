"""Transfer plan -> graph shape: a pure function of the assignments a group of readers got.

The core assigns each reader of one version a source. For N readers that ask together (and
``readers_per_source_max = 1``) that is a chain rooted at a complete holder::

    trainer -> r0 -> r1 -> r2

With more readers per source it is a tree, and with several complete holders a forest. Only
the *readers* become graph nodes: a root holder (the trainer, a host copy, a reader that already
finished) is outside the graph; a node whose source is outside is fed by the graph's input (the
batch index). A node whose source is another member takes its upstream's output as its argument,
so it runs batch k only after its upstream has batch k in place.

No Ray, torch or time here: this is planned as data and tested with tables.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence


class PlanError(ValueError):
    """The assignments do not form a forest over the members (a cycle, or a duplicate member)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Who feeds whom among the members of a group (indices into the members as given)."""

    upstream: tuple[Optional[int], ...]
    """``upstream[i]``: index of the member that feeds member ``i``, or None (a holder outside)."""
    order: tuple[int, ...]
    """Member indices, every upstream before its downstream (the order nodes are bound in)."""

    @property
    def leaves(self) -> tuple[int, ...]:
        """Members nobody in the group reads from (their outputs are the graph's outputs)."""
        fed = {u for u in self.upstream if u is not None}
        return tuple(i for i in self.order if i not in fed)

    @property
    def depth(self) -> int:
        """Longest chain of members (1 = every member reads from a holder outside)."""
        best = 0
        for i in range(len(self.upstream)):
            d, j = 0, i
            while j is not None:
                d, j = d + 1, self.upstream[j]
            best = max(best, d)
        return best

    def key(self, member_keys: Sequence[str]) -> tuple:
        """Topology key: the same ordered members wired the same way give the same key, whatever
        the version or the root holder (the root is outside the graph)."""
        assert len(member_keys) == len(self.upstream)
        return tuple(member_keys), self.upstream

    def draw(self, names: Sequence[str], root: str = "holder") -> str:
        """``holder -> r0 -> r1`` style drawing, one line per chain from a root (for logs)."""
        lines = []
        for leaf in self.leaves:
            path, j = [], leaf
            while j is not None:
                path.append(names[j])
                j = self.upstream[j]
            lines.append(" -> ".join([root] + path[::-1]))
        return "; ".join(lines)


def build_plan(assignments: Sequence[tuple[str, str]]) -> Plan:
    """From ``(client_id, source_id)`` per member (in the members' order) build the plan.

    Raises :class:`PlanError` on a duplicate client id or a cycle (the core never assigns a
    reader to its own downstream, so a cycle means the inputs were mixed up)."""
    index: dict[str, int] = {}
    for i, (cid, _) in enumerate(assignments):
        if cid in index:
            raise PlanError(f"client {cid!r} appears twice")
        index[cid] = i
    upstream = tuple(index.get(src) for _, src in assignments)
    order: list[int] = []
    placed: set[int] = set()
    state: dict[int, int] = {}  # 1 = on the current path, 2 = placed

    for start in range(len(upstream)):
        path, j = [], start
        while j is not None and j not in placed:
            if state.get(j) == 1:
                raise PlanError(f"assignments form a cycle through {assignments[j][0]!r}")
            state[j] = 1
            path.append(j)
            j = upstream[j]
        for k in reversed(path):
            state[k] = 2
            placed.add(k)
            order.append(k)
    return Plan(upstream=upstream, order=tuple(order))


BATCHES_MAX = 32
"""Most batches (graph executions) per read when the caller does not say: one per unit below.
Fewer batches mean more lag per hop (a member forwards a batch once it holds all of it), more
mean more executions, each of which costs tens of ms through Ray's channels: on the emulated
cluster (8 hosts in a chain, 64 MiB at 100 Mbit/s) 256 batches took 27-32 s, 32 took 10 s."""
UNITS_PER_BATCH_MAX = 4096
"""A graph edge carries one checksum per unit of its batch: bounded so it fits the channel."""


def default_batches(unit_count: int, batches: Optional[int] = None) -> int:
    """``batches`` if given, else one batch per unit up to :data:`BATCHES_MAX`; never so few
    that a batch holds more than :data:`UNITS_PER_BATCH_MAX` units. Raises ``ValueError`` for
    ``batches < 1``."""
    if batches is not None and batches < 1:
        raise ValueError("batches must be >= 1")
    b = batches if batches is not None else min(max(unit_count, 1), BATCHES_MAX)
    return max(b, -(-unit_count // UNITS_PER_BATCH_MAX))


def batch_end(unit_count: int, batches: int, k: int) -> int:
    """End (exclusive) of batch ``k`` of ``batches`` over ``unit_count`` units: batches split the
    units as evenly as possible, so one compiled graph (input = batch index) serves any version
    whatever its unit count; batches past the units are empty."""
    if batches < 1:
        raise ValueError("batches must be >= 1")
    k = min(max(k, 0), batches - 1)
    return -(-unit_count * (k + 1) // batches)
