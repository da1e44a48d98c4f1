"""The reference core's part for seeds that cross as deltas (``Config.seed_deltas``).

A publisher offers the delta of the version it publishes against an older one
(:class:`~tensorhub.core.messages.OfferDelta`: where the bytes are, how many); a seeder whose
staging copy holds that base asks for it (:class:`~tensorhub.core.messages.FindDelta`) before it
reads the version, reads the delta instead and falls back to the full read on any failure
(:mod:`tensorhub.transport.delta`, ``tensorhub/handle/deltas.py``). The server only
matches the two: it never looks at the bytes, and an offer it answers may be stale by then (the
publisher moved on, its buffer says another version): the seeder's read finds that out and takes
the full seed.

Rules:

- One offer per (model, shard), the newest: an offer replaces the one before it, so what the
  server keeps is bounded by the shards it serves.
- An offer is accepted only from a client that publishes ``version`` now (``LEGAL``: published;
  here: that version) and for a delta no larger than its shard.
- An offer of base -1 offers nothing but the promise of deltas of the versions after it (a
  publisher's first version): it makes the next version's delta ``DeltaPending``.
- An offer whose client is gone is not answered, and dropped when asked for.
- Asked for a version its publisher publishes but has not offered yet (an offer of an older
  version stands): ``DeltaPending`` -- it is being encoded, ask again -- not ``VersionNotFound``.
"""

from __future__ import annotations


from tensorhub.core import messages as m
from tensorhub.core.state import Node
from tensorhub.core.table import Table
from tensorhub.errors import DeltaPending, InvalidState, OutOfBounds, VersionNotFound


class Deltas:
    """The offers of deltas (see the module docstring): owns them; reads the shared table's
    nodes to check who offers and whether it is still registered."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.offers: dict[tuple[str, int], m.OfferDelta] = {}
        """(model, shard) -> the newest offer (its request, from ``node``: the gate checked who)."""

    def on_offer(self, node: Node, req: m.OfferDelta) -> m.Reply:
        if node.version != req.version:
            raise InvalidState(f"{node.id} offers a delta of version {req.version} and publishes {node.version}")
        if req.base >= req.version or (req.base == -1) != (req.nbytes == 0):
            raise OutOfBounds(f"a delta of version {req.version} against base {req.base}: the base must be older")
        if req.capacity > node.layout.total_bytes:
            raise OutOfBounds(f"a delta buffer of {req.capacity} bytes for a shard of {node.layout.total_bytes}")
        self.offers[(node.model, node.shard)] = req
        return m.Ok()

    def on_find(self, node: Node, req: m.FindDelta) -> m.Reply:
        key = (node.model, node.shard)
        offer = self.offers.get(key)
        if offer is not None and offer.client_id not in self.table.nodes:
            del self.offers[key]  # its publisher left: its buffer went with it
            offer = None
        publisher = self.table.nodes[offer.client_id] if offer is not None else None
        if publisher is not None and offer.version < req.version and publisher.version == req.version:
            raise DeltaPending(f"the delta of version {req.version} is not offered yet (its publisher offered "
                               f"{offer.version}'s)")
        if offer is None or (offer.version, offer.base) != (req.version, req.base):
            raise VersionNotFound(f"no delta of version {req.version} against {req.base} offered for shard "
                                  f"{node.shard}")
        return m.DeltaAt(source_id=offer.client_id, endpoint=offer.endpoint, nbytes=offer.nbytes,
                         capacity=offer.capacity)
