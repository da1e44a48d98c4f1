"""What a handle knows of its model's newest readable version, and when it may answer from it.

A part of :class:`tensorhub.core.handle.HandleMachine` (``machine.view``); the server's side is
:mod:`tensorhub.core.views`. Rules:

1. **News in order.** A pulse answer brings the server's ``Newest`` events with the number of its
   newest event (``PulseReply.acks``). The view takes the last ``Newest`` of an answer -- its
   version and its skip (``in_flight``, ``ready``) together, never one without the other -- only
   if that number is above every one it took before: an answer that arrives after a newer one (a
   liveness pulse and a progress pulse cross) brings older news, never taken. So the view never
   goes back to a version, or a skip, older than one it was told of since. A ``Newest`` out of
   bounds (:func:`tensorhub.core.bounds.check_newest`) is no news.
2. **Freshness.** Every answer for this handle (``Viewed``) says what it knows was current when
   the server answered, which was at least ``held_s`` after the pulse was sent (``as_of`` =
   sending + ``held_s``, the handle's clock). The view may serve until ``as_of + min(view_s,
   noop_staleness_s)`` (``view_s``: the server's bound; 0 from a server that grants nothing),
   the latest such time over all answers.
3. **A local answer.** ``update("latest")`` is answered without a call (``Outcome.local``) when the
   handle publishes exactly the newest version it knows and the view is fresh (strictly before its
   end); the call still counts its round.
4. **A local smart skip.** ``update("latest")`` is also answered without a call, as the server's
   smart skip would answer it (``Outcome`` ``noop``, ``in_flight`` = the skipped version: the
   Hub's ``ReadStats.skipped_in_flight``), when the view is fresh and its last news says a skip
   (``in_flight >= 0``) whose ``ready`` -- the newest version complete in the handle's
   datacenter -- is exactly the version the handle publishes, and no version newer than
   ``in_flight`` is known. So it never answers a version older than one it was told is readable
   in its datacenter. News without a skip (the seed landed in the datacenter, nothing seeds
   there any more) ends it at once: the next ``update("latest")`` asks the server, which assigns
   the read; so does a stale view.
5. Anything else -- another spec, ``replicate()``, a stale view, a newer version known and no
   skip of it -- asks the server as before.
6. **Sharded replicas ask.** A shard of a sharded replica never answers locally: its round is a
   transaction only the server resolves (a shard answering alone could take a round its
   siblings take at another version: a push it has not received yet, or a version withdrawn
   after they took it).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tensorhub.core import messages as m
from tensorhub.core.bounds import check_newest
from tensorhub.core.handle_io import Outcome
from tensorhub.errors import OutOfBounds


@dataclasses.dataclass(frozen=True)
class Viewed:
    """A pulse answer for this handle (it knows the handle) arrived: ``newest`` is the version
    of its last ``Newest`` event (None: it brought none), ``in_flight`` and ``ready`` that
    event's skip (-1, -1: none), ``number`` its newest event's number (``PulseReply.acks``; -1:
    none), ``as_of`` the pulse's sending plus ``held_s``, ``view_s`` the answer's ``view_s``."""

    newest: Optional[int]
    number: int
    as_of: float
    view_s: float
    in_flight: int = -1
    ready: int = -1


def viewed(reply: m.PulseReply, client_id: str, sent_at: float) -> Optional[Viewed]:
    """The :class:`Viewed` event of ``client_id``'s share of ``reply`` to a pulse sent at
    ``sent_at`` (None: the server does not know the handle, so the answer says nothing of it)."""
    if client_id in reply.unknown:
        return None
    news = [e for e in reply.notes.get(client_id, ()) if isinstance(e, m.Newest)]
    last = news[-1] if news else None
    if last is not None:
        try:
            check_newest(last)
        except OutOfBounds:
            last = None  # rule 1: no news
    return Viewed(newest=last.version if last else None, number=reply.acks.get(client_id, -1),
                  as_of=sent_at + reply.held_s, view_s=reply.view_s,
                  in_flight=last.in_flight if last else -1, ready=last.ready if last else -1)


class View:
    """The newest version this handle knows, the skip in its datacenter, and until when it may
    answer from them (see the module docstring). Not thread-safe: the machine's driver feeds it
    under the machine's lock."""

    def __init__(self, staleness_s: float) -> None:
        assert staleness_s >= 0
        self.staleness_s = staleness_s
        self.newest = -1
        """The newest readable version the server told of (-1: none, or not told)."""
        self.in_flight = -1
        """The version the server said is still on its way into this handle's datacenter, with
        :attr:`newest` (-1: no skip; rule 4)."""
        self.ready = -1
        """With :attr:`in_flight`: the newest version complete in this handle's datacenter."""
        self.number = -1
        """The number of the answer's newest event that :attr:`newest` came with (rule 1)."""
        self.fresh_until = float("-inf")
        """Local answers until then (the handle's clock; rule 2)."""

    def viewed(self, ev: Viewed) -> None:
        if ev.newest is not None and ev.number > self.number:
            self.newest, self.in_flight, self.ready, self.number = ev.newest, ev.in_flight, ev.ready, ev.number
        bound = min(self.staleness_s, ev.view_s)
        if bound > 0:
            self.fresh_until = max(self.fresh_until, ev.as_of + bound)

    def answer(self, spec: m.VersionSpec, published: Optional[int], now: float, sharded: bool) -> Optional[Outcome]:
        """Rules 3-6: how ``update(spec)`` of a handle publishing ``published`` ends without a
        call (a local ``noop``), or None: it asks the server. Never for a shard of a sharded
        replica (``sharded``)."""
        if sharded or spec != "latest" or published is None or not now < self.fresh_until:
            return None
        if 0 <= self.ready == published < self.in_flight and self.newest <= self.in_flight:
            return Outcome(action="noop", version=published, in_flight=self.in_flight, local=True)
        if published == self.newest:
            return Outcome(action="noop", version=published, local=True)
        return None
