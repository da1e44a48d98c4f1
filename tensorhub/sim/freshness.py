"""(t) ``fresh``: the checker of no-op updates answered locally
(docs/design.md, "No-op updates answered locally"). It observes; it never steers the system.

What it sees: the server's newest readable version of every model after every request, tick and
removal (computed from the core's table, not from what the server pushes: a push the server
forgets is caught), the ``Newest`` events each handle takes from its pulse answers, and every
``update("latest")`` a handle answered without a call. Rules:

- a local answer names the newest version its handle was last told of (by event number): it
  never answers one it was not told of, nor one older than it was told since;
- it names a version that was the model's newest readable version at some moment within
  ``noop_staleness_s`` before the answer (whatever pushes were delayed, lost or never sent).
"""

from __future__ import annotations

from typing import Callable

from tensorhub.core.placements import logical


class NoopFreshnessChecker:
    def __init__(self, world, violate: Callable[[str, str], None]) -> None:
        self.world = world
        self.violate = violate
        self.history: dict[str, list[tuple[float, int]]] = {}
        """model -> (time, newest readable version) at every change, oldest first."""
        self.told: dict[str, tuple[int, int]] = {}
        """client -> (event number, version) of the newest ``Newest`` it took."""
        self.local_answers = 0

    def observe(self, core, now: float) -> None:
        """The server's table after a request, tick or removal at ``now``."""
        newest_of: dict[str, int] = {}
        for model in sorted(core.models):
            # A model's layout classes are one model to a reader (specs resolve over all of them).
            avail = core.available(model)
            name = logical(model)
            newest_of[name] = max(newest_of.get(name, -1), avail[-1] if avail else -1)
        for model, newest in newest_of.items():
            hist = self.history.setdefault(model, [])
            if not hist or hist[-1][1] != newest:
                hist.append((now, newest))

    def was_newest(self, version: int, since: float) -> bool:
        """Whether ``version`` was the model's newest readable version at some moment from ``since`` on."""
        now = self.world.sim.now
        hist = self.history.get(self.world.params.model, [])
        for i, (t, newest) in enumerate(hist):
            until = hist[i + 1][0] if i + 1 < len(hist) else now
            if newest == version and t <= now and until >= since:
                return True
        return False

    def on_told(self, cid: str, number: int, version: int) -> None:
        """``cid`` took a pulse answer whose newest event is ``number`` and last ``Newest`` ``version``."""
        if number > self.told.get(cid, (-1, -1))[0]:
            self.told[cid] = (number, version)

    def on_local_answer(self, client, version: int) -> None:
        self.local_answers += 1
        now = self.world.sim.now
        told = self.told.get(client.cid)
        if told is None or told[1] != version:
            self.violate("fresh", f"{client.cid} answered update('latest') locally with version {version}; "
                                  f"the newest it was told of is {told[1] if told else 'nothing'}")
            return
        bound = self.world.config.noop_staleness_s
        hist = self.history.get(self.world.params.model, [])
        if self.was_newest(version, now - bound):
            return
        self.violate("fresh", f"{client.cid} answered update('latest') locally with version {version}, not the "
                              f"newest readable at any moment of the last {bound}s (history {hist[-4:]})")
