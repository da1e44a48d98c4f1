"""What a handle knows of its model's newest readable version, and when it may answer from it.

A part of :class:`tensorhub.core.handle.HandleMachine` (``machine.view``); the server's side is
:mod:`tensorhub.core.views`. Rules:

1. **News in order.** A pulse answer brings the server's ``Newest`` events with the number of its
   newest event (``PulseReply.acks``). The view takes the last ``Newest`` of an answer only if
   that number is above every one it took before: an answer that arrives after a newer one (a
   liveness pulse and a progress pulse cross) brings older news, never taken. So the view never
   goes back to a version older than one it was told of since.
2. **Freshness.** Every answer for this handle (``Viewed``) says what it knows was current when
   the server answered, which was at least ``held_s`` after the pulse was sent (``as_of`` =
   sending + ``held_s``, the handle's clock). The view may serve until ``as_of + min(view_s,
   noop_staleness_s)`` (``view_s``: the server's bound; 0 from a server that grants nothing),
   the latest such time over all answers.
3. **A local answer.** ``update("latest")`` is answered without a call (``Outcome.local``) when the
   handle publishes exactly the newest version it knows and the view is fresh (strictly before its
   end); the call still counts its round. Anything else -- another spec, ``replicate()``, a stale
   view, a newer version known -- asks the server as before.
4. **Sharded replicas ask.** A shard of a sharded replica never answers locally: its round is a
   transaction only the server resolves (a shard answering alone could take a round its
   siblings take at another version: a push it has not received yet, or a version withdrawn
   after they took it).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tensorhub.core import messages as m


@dataclasses.dataclass(frozen=True)
class Viewed:
    """A pulse answer for this handle (it knows the handle) arrived: ``newest`` is the version
    of its last ``Newest`` event (None: it brought none), ``number`` its newest event's number
    (``PulseReply.acks``; -1: none), ``as_of`` the pulse's sending plus ``held_s``, ``view_s``
    the answer's ``view_s``."""

    newest: Optional[int]
    number: int
    as_of: float
    view_s: float


def viewed(reply: m.PulseReply, client_id: str, sent_at: float) -> Optional[Viewed]:
    """The :class:`Viewed` event of ``client_id``'s share of ``reply`` to a pulse sent at
    ``sent_at`` (None: the server does not know the handle, so the answer says nothing of it)."""
    if client_id in reply.unknown:
        return None
    news = [e.version for e in reply.notes.get(client_id, ()) if isinstance(e, m.Newest)]
    return Viewed(newest=news[-1] if news else None, number=reply.acks.get(client_id, -1),
                  as_of=sent_at + reply.held_s, view_s=reply.view_s)


class View:
    """The newest version this handle knows and until when it may answer from it (see the
    module docstring). Not thread-safe: the machine's driver feeds it under the machine's lock."""

    def __init__(self, staleness_s: float) -> None:
        assert staleness_s >= 0
        self.staleness_s = staleness_s
        self.newest = -1
        """The newest readable version the server told of (-1: none, or not told)."""
        self.number = -1
        """The number of the answer's newest event that :attr:`newest` came with (rule 1)."""
        self.fresh_until = float("-inf")
        """Local answers until then (the handle's clock; rule 2)."""

    def viewed(self, ev: Viewed) -> None:
        if ev.newest is not None and ev.number > self.number:
            self.newest, self.number = ev.newest, ev.number
        bound = min(self.staleness_s, ev.view_s)
        if bound > 0:
            self.fresh_until = max(self.fresh_until, ev.as_of + bound)

    def answers(self, spec: m.VersionSpec, published: Optional[int], now: float, sharded: bool) -> bool:
        """Rule 3: whether ``update(spec)`` of a handle publishing ``published`` is a no-op known
        here; never for a shard of a sharded replica (``sharded``, rule 4)."""
        return (not sharded and spec == "latest" and published is not None and published == self.newest
                and now < self.fresh_until)
