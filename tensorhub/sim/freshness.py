"""(t) ``fresh``: the checker of no-op updates answered locally
(docs/design.md, "No-op updates answered locally"). It observes; it never steers the system.

What it sees: the server's newest readable version of every model, and smart skipping's state
in every datacenter (what the server's own ``update("latest")`` of a reader publishing the
newest version complete there would skip), after every request, tick and removal (computed from
the core's table, not from what the server pushes: a push the server forgets is caught), the
``Newest`` events each handle takes from its pulse answers, and every ``update("latest")`` a
handle answered without a call. Rules:

- a local answer names the newest version its handle was last told of (by event number): it
  never answers one it was not told of, nor one older than it was told since;
- it names a version that was the model's newest readable version at some moment within
  ``noop_staleness_s`` before the answer (whatever pushes were delayed, lost or never sent);
- a local smart skip (``in_flight`` set) names the skip of the handle's last ``Newest``
  (``ready`` answered, ``in_flight`` skipped), and that skip was the server's in the handle's
  datacenter at some moment within ``noop_staleness_s`` before the answer: a handle that kept
  skipping after the seed landed there, or after the server stopped skipping, is caught.
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
        self.skips: dict[tuple[str, str], list[tuple[float, tuple[int, int]]]] = {}
        """(model layout class, datacenter) -> (time, the server's skip there: ``skip_news``) at
        every change, oldest first."""
        self.told: dict[str, tuple[int, int, int, int]] = {}
        """client -> (event number, version, in_flight, ready) of the newest ``Newest`` it took."""
        self.local_answers = 0
        self.local_skips = 0
        """Local answers that were smart skips (of ``local_answers``)."""

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
        if not (self.world.config.smart_skipping and self.world.config.noop_staleness_s > 0):
            return
        dcs = sorted({c.dc for c in self.world.clients.values()})
        for model in sorted(core.models):
            if logical(model) != self.world.params.model:
                continue
            avail = core.available(model)
            for dc in dcs:
                skip = core.crossdc.skip_news(model, dc, avail)
                hist = self.skips.setdefault((model, dc), [])
                if not hist or hist[-1][1] != skip:
                    hist.append((now, skip))

    def was_newest(self, version: int, since: float) -> bool:
        """Whether ``version`` was the model's newest readable version at some moment from ``since`` on."""
        return _was(self.history.get(self.world.params.model, []), version, since, self.world.sim.now)

    def was_skip(self, dc: str, skip: tuple[int, int], since: float) -> bool:
        """Whether ``skip`` was the server's in ``dc`` (of some layout class of the model) at some
        moment from ``since`` on."""
        now = self.world.sim.now
        return any(_was(hist, skip, since, now) for (_, d), hist in self.skips.items() if d == dc)

    def on_told(self, cid: str, number: int, version: int, in_flight: int = -1, ready: int = -1) -> None:
        """``cid`` took a pulse answer whose newest event is ``number`` and last ``Newest``
        ``version`` (with its skip ``in_flight``, ``ready``)."""
        if number > self.told.get(cid, (-1,))[0]:
            self.told[cid] = (number, version, in_flight, ready)

    def on_local_answer(self, client, version: int, in_flight: int = -1) -> None:
        self.local_answers += 1
        self.world.checker.observer.path("local_skip" if in_flight >= 0 else "local_noop")
        if in_flight >= 0:
            self._local_skip(client, version, in_flight)
            return
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

    def _local_skip(self, client, version: int, in_flight: int) -> None:
        self.local_skips += 1
        told = self.told.get(client.cid)
        if told is None or (told[2], told[3]) != (in_flight, version):
            self.violate("fresh", f"{client.cid} answered update('latest') locally as a skip of {in_flight} to "
                                  f"{version}; the last news it took is {told[1:] if told else 'nothing'} "
                                  f"(version, in_flight, ready)")
            return
        bound = self.world.config.noop_staleness_s
        if self.was_skip(client.dc, (in_flight, version), self.world.sim.now - bound):
            return
        hist = [h[-3:] for (_, d), h in sorted(self.skips.items()) if d == client.dc]
        self.violate("fresh", f"{client.cid} answered update('latest') locally as a skip of {in_flight} to "
                              f"{version}, not the server's skip in {client.dc} at any moment of the last "
                              f"{bound}s (its skips there {hist})")


def _was(hist: list, value, since: float, now: float) -> bool:
    """Whether ``hist`` ((time, value) at every change, oldest first) held ``value`` at some
    moment from ``since`` to ``now``."""
    for i, (t, v) in enumerate(hist):
        until = hist[i + 1][0] if i + 1 < len(hist) else now
        if v == value and t <= now and until >= since:
            return True
    return False
