"""What handles know of their model's newest version: the server's side of no-op updates
answered locally.

A part of :class:`tensorhub.core.reference.ReferenceCore` (``core.views``): :class:`Views`
pushes every change of a model's newest readable version to the model's handles; the handle's
side is :mod:`tensorhub.core.handle_view`.

Rules (docs/design.md, "No-op updates answered locally"):

1. **Push.** When a request or tick settles, a model whose newest available version changed
   (a commit, or the newest withdrawn: lost, past retention, no holder of some shard) sends
   ``Newest(version)`` to every handle of the model; a handle that registers or announces gets
   the current one. They are background events: they answer held pulses at once.
2. **Freshness.** A pulse answer carries every event waiting for the handle, so what the handle
   knows after it was current when the server answered; the answer says how long it was held
   (``held_s``) and how long it may be used (``view_s`` = ``noop_staleness_s``). The handle
   answers locally only until ``sent + held_s + view_s`` on its own clock, which is never later
   than the server's answer plus ``noop_staleness_s``.
3. **Recovery.** Inside the recovery window after a restart the server's table is partial: it
   pushes nothing and its pulse answers serve no local answers (``view_s`` 0); when the window
   ends every model's newest is pushed.
4. **Sharded replicas never answer locally** (the handle's rule): their rounds are
   transactions that only the server resolves, so every shard's ``update()`` asks it. A shard
   answering alone could take a round its siblings take at another version -- a push it has
   not received yet, or a version withdrawn after the siblings took it.
"""


from __future__ import annotations

from typing import Callable, Iterable

from tensorhub.core import messages as m
from tensorhub.core.placements import logical
from tensorhub.core.table import Table


class Views:
    """Pushes of each model's newest version and the grants of local answers (see the module
    docstring). Owns what it pushed last per model and the grants, oldest expiry first; reads
    the shared :class:`~tensorhub.core.table.Table`; acts through ``available`` (a model's
    available versions) and ``clients_of`` (a model's clients, host copies excluded)."""

    def __init__(self, table: Table, *, available: Callable[[str], list[int]],
                 clients_of: Callable[[str], list[str]], recovering: Callable[[], bool]) -> None:
        self.table = table
        self.staleness_s = table.config.noop_staleness_s
        self._available = available
        self._clients_of = clients_of
        self._recovering = recovering
        self._settled_all = True
        """False while the recovery window lasts: every model is looked at when it ends."""
        self.pushed: dict[str, int] = {}
        """model -> the newest version last pushed to its handles (-1: none readable)."""

    @property
    def on(self) -> bool:
        return self.staleness_s > 0

    # ------------------------------------------------------------------ pushes (rule 1)

    def settle(self, models: Iterable[str]) -> None:
        """Push ``Newest`` to every handle of each of ``models`` whose newest changed."""
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
        for model in sorted(models):
            if model not in self.table.models:
                self.pushed.pop(model, None)
                continue
            avail = self._available(model)
            newest = avail[-1] if avail else -1
            if self.pushed.get(model) == newest:
                continue  # (a model never pushed is pushed even at -1: a fresh server's handles
                # may still know an old server's newest)
            self.pushed[model] = newest
            for cid in self._clients_of(model):
                self.table.deliver(cid, self._news(cid, newest))

    def joined(self, client_id: str) -> None:
        """A handle registered: it is told the model's newest version now (-1 too: an announcing
        handle may know an older server's)."""
        node = self.table.nodes.get(client_id)
        if not self.on or node is None:
            return
        newest = self.pushed.get(node.model)
        if newest is not None and not self._recovering():
            self.table.deliver(client_id, self._news(client_id, newest))

    def _news(self, client_id: str, newest: int) -> m.Newest:
        return m.Newest(version=newest)

    # ------------------------------------------------------------------ answers (rules 2, 3)

    def answered(self, client_ids: Iterable[str], now: float) -> float:
        """A pulse of ``client_ids`` is answered at ``now``: how long what it brings may serve
        local answers (``PulseReply.view_s``; 0: off, or the recovery window)."""
        if not self.on or self._recovering():
            return 0.0  # partial knowledge: no local answers from it
        return self.staleness_s

    def announced(self, client_id: str) -> None:
        """A handle announced itself after a restart: it is told the current newest (rule 1)."""
        self.joined(client_id)
