"""Which path ``replicate_group(path="auto")`` takes for a topology: the one measured faster.

Whether a compiled graph beats the plain pull path depends on the machine (on one host's
memory bus the pull path won at every group size; over rate-limited links they are close), so
the choice is made from what each path measured for the same topology (same members, same
wiring), per byte moved. Rules, in order:

1. no compiled graph cached for the topology: pull (a graph is compiled in the background);
2. the graph was never measured for it: graph (measure it once);
3. pull was never measured for it: pull;
4. every ``explore_every``-th decision, when the two were measured within ``explore_within``
   of each other (links and load change; close measurements may swap): the slower one, once;
5. otherwise the faster one (exponential average of seconds per byte).

So a path measured clearly slower for a topology (beyond ``explore_within``) is never taken
again for it: on the emulated cluster the graph measured 1.9x the pull path at N=8 (RESULTS).

Pure: no Ray, no clock; tested with tables.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Optional

GRAPH, PULL = "graph", "pull"
_EWMA = 0.5


@dataclasses.dataclass
class _Topology:
    s_per_byte: dict[str, float] = dataclasses.field(default_factory=dict)
    decisions: int = 0


class PathChooser:
    """Measured seconds per byte of each path, per topology key (see module doc)."""

    def __init__(self, explore_every: int = 20, topologies_max: int = 64, explore_within: float = 1.1) -> None:
        if explore_every < 2 or topologies_max < 1 or not explore_within >= 1.0:
            raise ValueError("explore_every >= 2, topologies_max >= 1, explore_within >= 1")
        self.explore_every = explore_every
        self.explore_within = explore_within
        self.topologies_max = topologies_max
        self._t: dict[Hashable, _Topology] = {}

    def choose(self, key: Hashable, graph_cached: bool) -> tuple[str, str]:
        """``(path, why)`` for the next group replication of topology ``key``."""
        t = self._t.get(key)
        if not graph_cached:
            return PULL, "no compiled graph for this topology yet"
        if t is None or GRAPH not in t.s_per_byte:
            return GRAPH, "graph not measured yet for this topology"
        if PULL not in t.s_per_byte:
            return PULL, "pull not measured yet for this topology"
        t.decisions += 1
        g, p = t.s_per_byte[GRAPH], t.s_per_byte[PULL]
        best, other = (GRAPH, PULL) if g <= p else (PULL, GRAPH)
        close = max(g, p) <= self.explore_within * min(g, p)
        if close and t.decisions % self.explore_every == 0:
            return other, f"re-measuring {other} (decision {t.decisions})"
        return best, f"{best} measured faster ({min(g, p) * 1e9:.3g} vs {max(g, p) * 1e9:.3g} s/GB)"

    def record(self, key: Hashable, path: str, seconds: float, nbytes: int) -> None:
        """A successful replication of topology ``key`` by ``path`` took ``seconds`` for
        ``nbytes`` moved in all (nothing is recorded for ``nbytes <= 0``)."""
        if path not in (GRAPH, PULL) or nbytes <= 0 or seconds <= 0:
            return
        t = self._t.get(key)
        if t is None:
            if len(self._t) >= self.topologies_max:
                self._t.pop(next(iter(self._t)))
            t = self._t[key] = _Topology()
        x = seconds / nbytes
        old = t.s_per_byte.get(path)
        t.s_per_byte[path] = x if old is None else old + _EWMA * (x - old)

    def measured(self, key: Hashable) -> dict[str, float]:
        """Seconds per GB measured so far for ``key`` by path (observability, tests)."""
        t = self._t.get(key)
        return {} if t is None else {p: v * 1e9 for p, v in t.s_per_byte.items()}

    def forget(self, key: Optional[Hashable] = None) -> None:
        """Drop the measurements of ``key`` (or of every topology)."""
        if key is None:
            self._t.clear()
        else:
            self._t.pop(key, None)
