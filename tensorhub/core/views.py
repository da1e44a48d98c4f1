"""What handles know of their model's newest version: the server's side of no-op updates
answered locally.

A part of :class:`tensorhub.core.reference.ReferenceCore` (``core.views``): :class:`Views`
pushes every change of a model's newest readable version, and of smart skipping's state in each
datacenter, to the model's handles; the handle's side is :mod:`tensorhub.core.handle_view`.

Rules (docs/design.md, "No-op updates answered locally"):

1. **Push.** When a request or tick settles, a model whose newest available version changed
   (a commit, or the newest withdrawn: lost, past retention, no holder of some shard) sends
   ``Newest(version)`` to every handle of the model; a handle that registers or announces gets
   the current one. They are background events: they answer held pulses at once.
2. **Skips pushed too.** Each ``Newest`` of a model of unsharded replicas (rule 5: no other
   answers locally) also carries smart skipping's state in the handle's datacenter (``in_flight``, ``ready``: :meth:`~tensorhub.core.crossdc.CrossDatacenter.skip_news`,
   the rules the server's own ``update("latest")`` resolves by): a newer version ``in_flight``
   is still on its way into that datacenter, so a reader publishing ``ready``, the newest
   version complete there, keeps it. Whenever a datacenter's state changes -- a seed starts, a
   seed lands there (the version in flight is complete there now), the seed's wait ends, its
   newest version changes -- every handle there gets a ``Newest`` with the new state (-1, -1:
   no skip). A datacenter told of a skip is looked at again at every settle, touched or not, so
   the news that ends a skip is never later than the request or tick that ended it. (A seed's
   wait, ``seed_wait_s``, ends with time alone: its end is pushed at the next request or tick,
   at most ``server_tick_s`` later; a ``Replicate`` inside that gap resolves without the skip,
   a local answer may still skip.)
3. **Freshness.** A pulse answer carries every event waiting for the handle, so what the handle
   knows after it was current when the server answered; the answer says how long it was held
   (``held_s``) and how long it may be used (``view_s`` = ``noop_staleness_s``). The handle
   answers locally only until ``sent + held_s + view_s`` on its own clock, which is never later
   than the server's answer plus ``noop_staleness_s``.
4. **Recovery.** Inside the recovery window after a restart the server's table is partial: it
   pushes nothing and its pulse answers serve no local answers (``view_s`` 0); when the window
   ends every model's newest, and its skips, are pushed.
5. **Sharded replicas never answer locally** (the handle's rule): their rounds are
   transactions that only the server resolves, so every shard's ``update()`` asks it. A shard
   answering alone could take a round its siblings take at another version -- a push it has
   not received yet, or a version withdrawn after the siblings took it.
"""


from __future__ import annotations

from typing import Callable, Iterable

from tensorhub.core import messages as m
from tensorhub.core.crossdc import NO_SKIP
from tensorhub.core.placements import logical
from tensorhub.core.table import Table


class Views:
    """Pushes of each model's newest version and skips, and the grants of local answers (see
    the module docstring). Owns what it pushed last per model and per datacenter; reads the
    shared :class:`~tensorhub.core.table.Table`; acts through ``available`` (a model's available
    versions), ``clients_of`` (a model's clients, host copies excluded), ``skip_news`` (smart
    skipping's state in a datacenter, :meth:`~tensorhub.core.crossdc.CrossDatacenter.skip_news`)
    and ``skip_datacenters`` (the datacenters where a model may skip)."""

    def __init__(self, table: Table, *, available: Callable[[str], list[int]],
                 clients_of: Callable[[str], list[str]], recovering: Callable[[], bool],
                 skip_news: Callable[[str, str, list[int]], tuple[int, int]],
                 skip_datacenters: Callable[[str], set[str]]) -> None:
        self.table = table
        self.staleness_s = table.config.noop_staleness_s
        self._available = available
        self._clients_of = clients_of
        self._recovering = recovering
        self._skip_news = skip_news
        self._skip_datacenters = skip_datacenters
        self._settled_all = True
        """False while the recovery window lasts: every model is looked at when it ends."""
        self.pushed: dict[str, int] = {}
        """model -> the newest version last pushed to its handles (-1: none readable)."""
        self.skips: dict[str, dict[str, tuple[int, int]]] = {}
        """model -> datacenter -> the skip ``(in_flight, ready)`` last pushed to its handles
        there (absent: :data:`~tensorhub.core.crossdc.NO_SKIP`)."""

    @property
    def on(self) -> bool:
        return self.staleness_s > 0

    # ------------------------------------------------------------------ pushes (rules 1, 2)

    def forget(self, model: str) -> None:
        """``model`` (a layout class moved into another) is gone: what was pushed for it too."""
        self.pushed.pop(model, None)
        self.skips.pop(model, None)

    def settle(self, models: Iterable[str]) -> None:
        """Push ``Newest`` to every handle of each of ``models`` whose newest changed, and to the
        handles of every datacenter whose skip changed; every model told of a skip is looked at."""
        if not self.on:
            return
        if self._recovering():
            self._settled_all = False  # holders are still re-announcing: what is known is partial
            return
        if not self._settled_all:
            self._settled_all = True
            models = list(models) + list(self.table.models) + list(self.pushed)
        # A commit in one layout class is news to every class of the model (they resolve alike).
        models = {c for mo in models for c in (self.table.classes.get(logical(mo)) or [mo])} | set(models)
        for model in sorted(models | set(self.skips)):
            if model not in self.table.models:
                self.pushed.pop(model, None)
                self.skips.pop(model, None)
                continue
            self._settle_model(model)

    def _settle_model(self, model: str) -> None:
        avail = self._available(model)
        newest = avail[-1] if avail else -1
        skips = {}
        # Only replicas of one shard answer locally (rule 5): a sharded model's skips are not
        # pushed, nor looked at on every settle.
        for dc in sorted(self._skip_datacenters(model) if self.table.models[model].num_shards == 1 else ()):
            news = self._skip_news(model, dc, avail)
            if news != NO_SKIP:
                assert 0 <= news[1] < news[0] and newest <= news[0], (model, dc, newest, news)
                skips[dc] = news
        told = self.skips.get(model, {})
        changed = {dc for dc in skips.keys() | told.keys() if skips.get(dc) != told.get(dc)}
        if self.pushed.get(model) == newest and not changed:
            return  # (a model never pushed is pushed even at -1: a fresh server's handles may
            # still know an old server's newest)
        everyone = self.pushed.get(model) != newest
        self.pushed[model] = newest
        if skips:
            self.skips[model] = skips
        else:
            self.skips.pop(model, None)
        for cid in self._clients_of(model):
            dc = self.table.nodes[cid].datacenter
            if everyone or dc in changed:
                self.table.deliver(cid, self._news(newest, skips.get(dc, NO_SKIP)))

    def joined(self, client_id: str) -> None:
        """A handle registered: it is told the model's newest version now (-1 too: an announcing
        handle may know an older server's) and the skip of its datacenter."""
        node = self.table.nodes.get(client_id)
        if not self.on or node is None:
            return
        newest = self.pushed.get(node.model)
        if newest is not None and not self._recovering():
            skip = self.skips.get(node.model, {}).get(node.datacenter, NO_SKIP)
            self.table.deliver(client_id, self._news(newest, skip))

    @staticmethod
    def _news(newest: int, skip: tuple[int, int]) -> m.Newest:
        in_flight, ready = skip
        return m.Newest(version=newest, in_flight=in_flight, ready=ready)

    # ------------------------------------------------------------------ answers (rules 3, 4)

    def answered(self, client_ids: Iterable[str], now: float) -> float:
        """A pulse of ``client_ids`` is answered at ``now``: how long what it brings may serve
        local answers (``PulseReply.view_s``; 0: off, or the recovery window)."""
        if not self.on or self._recovering():
            return 0.0  # partial knowledge: no local answers from it
        return self.staleness_s

    def announced(self, client_id: str) -> None:
        """A handle announced itself after a restart: it is told the current newest (rule 1)."""
        self.joined(client_id)
