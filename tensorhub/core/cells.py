"""The reference core's part for the cell checksums of resharded reads (issue 24, item 4).

A reader of another layout class (:mod:`tensorhub.core.placements`) reads byte ranges that are
neither its holders' transfer units nor its own, so it checks them cell by cell
(:mod:`tensorhub.core.grid`, :mod:`tensorhub.gridsums`) against checksums its *holders* computed.
The grid of a resharded read is that of the holder class's placements and the reader's layout
class's (all its shards': ``grid_of``, every box of each is a union of cells), so the ranks of
one engine share one grid and a holder hashes once per (version, reader layout class), not once
per rank. Which grids a holder must hash over depends on who reads it, so the server matches
them up:

0. When a holder with a placement publishes (:meth:`Cells.ahead`), it is asked at once for the
   grid of each other layout class of its model that has shards registered (at most
   :data:`PER_HOLDER_MAX`): it hashes while the readers are still being told of the version, so
   their checks do not wait for it (measured: a HashCells asked at the assignment reached a
   holder whose process also reads, hence pulses unheld, 0.14-0.34 s later).
1. When a reader is given a resharded read (:meth:`Cells.ask`), each holder shard it needs that
   has neither sent nor been asked for the checksums of that (version, grid) gets
   :class:`~tensorhub.core.messages.HashCells` (a background note, with the placements); the
   reader reads the bytes meanwhile.
2. The holder hashes its cells in place and answers :class:`~tensorhub.core.messages.CellSums`.
   Accepted only if the server asked that client for that (version, grid) and the client holds
   that version whole now (published, draining or offloading: its bytes cannot change until its
   readers are done); anything else is ``InvalidState`` and nothing is kept.
3. The reader asks :class:`~tensorhub.core.messages.FindCells` once its bytes are in place and
   gets :class:`~tensorhub.core.messages.CellsAt`: the checksums of the holders that sent theirs,
   ``missing`` (asked, not answered yet: ask again) and ``gone`` (no longer hold the version
   whole, or never asked: read that shard elsewhere). A reader may ask only of the holders it is
   reading from (``Node.reshard_from``), else ``InvalidState``.

A host copy (``<owner>#host<v>``, a node with its owner's placement) is a holder too: at its
making it takes the checksums its owner sent of that version (:meth:`Cells.inherit`: the same
bytes); a grid it lacks is asked of its owner's process, which serves it (``HashCells`` with
``host``, answered by ``CellSums`` with ``host``).

What it keeps is bounded: per holder client, the (version, grid) pairs it was asked or answered,
at most :data:`PER_HOLDER_MAX` (the oldest dropped), forgotten once the holder moves to another
version or leaves (a host copy: when it is dropped; ``forget`` is called with every removed node).
"""

from __future__ import annotations

import hashlib
from typing import Iterable

from tensorhub.core import messages as m
from tensorhub.core.placements import logical
from tensorhub.core.state import COMPLETE, Node
from tensorhub.core.table import Table
from tensorhub.errors import InvalidState
from tensorhub.placement import Placement

PER_HOLDER_MAX = 4
"""(version, grid) entries kept per holder: a few reader layouts of its current version."""


def grid_key(placements: Iterable[Placement]) -> str:
    """The key of the grid of ``placements`` (order and repeats do not matter): both sides of
    a resharded read compute it from the placements they know."""
    digests = sorted({p.digest() for p in placements})
    return hashlib.blake2b(",".join(digests).encode(), digest_size=16).hexdigest()


class Cells:
    """The cell checksums of resharded reads (see the module docstring): owns what holders were
    asked and sent; reads the shared table's nodes."""

    def __init__(self, table: Table, *, placement_of, class_digests) -> None:
        self.table = table
        self._placement_of = placement_of
        """digest -> the interned :class:`~tensorhub.placement.Placement`."""
        self._class_digests = class_digests
        """layout class -> its shards' placements (digests; :meth:`Placements.class_digests`)."""
        self.kept: dict[str, dict[tuple[int, str], tuple[m.CellSum, ...] | None]] = {}
        """holder client -> (version, grid) -> its checksums (None: asked, not answered)."""

    def grid_digests(self, holder: Node, reader_class: str, reader_placement: str = "") -> tuple[str, ...]:
        """The placements (digests, sorted) of the grid a reader of ``reader_class`` checks a
        resharded read from ``holder``'s class against: the holder class's (one per shard, every
        replica's: a read may take its shards from several replicas, and a replica that lost a
        shard must not change the grid) and the reader class's (with ``reader_placement``, the
        reader's own, in case its class lost the record)."""
        shards = self.table.replica_nodes(holder.model, holder.replica_id)
        own = {reader_placement} if reader_placement else set()
        return tuple(sorted({n.placement for n in shards if n.placement} | set(self._class_digests(holder.model))
                            | set(self._class_digests(reader_class)) | own))

    def ahead(self, holder: Node) -> None:
        """``holder`` published with a placement: ask it for the grid of each other layout class
        of its model (rule 0): the first :data:`PER_HOLDER_MAX` classes, in creation order."""
        if not holder.placement or holder.host:
            return
        others = [c for c in self.table.classes.get(logical(holder.model), ()) if c != holder.model]
        for cls in others[:PER_HOLDER_MAX]:
            digests = self.grid_digests(holder, cls)
            if len(digests) > 1:
                self._ask_one(holder, tuple(self._placement_of(d) for d in digests))

    def ask(self, reader: Node, holders: list[Node]) -> None:
        """``reader`` reads its version from ``holders`` (shards of one other class, of one
        replica or several):
        each that has not sent or been asked for that grid gets ``HashCells``."""
        digests = self.grid_digests(holders[0], reader.model, reader.placement)
        placements = tuple(self._placement_of(d) for d in digests)
        for h in holders:
            self._ask_one(h, placements)

    def inherit(self, owner: Node, host: Node, version: int) -> None:
        """``host``, ``owner``'s host copy of ``version``, was just made: the same bytes, so the
        checksums ``owner`` sent for that version (while it holds it) are the host copy's too."""
        if owner.version != version:
            return
        got = {k: v for k, v in self._entries(owner).items() if v is not None}
        if got:
            self.kept[host.id] = got

    def _ask_one(self, h: Node, placements: tuple[Placement, ...]) -> None:
        grid = grid_key(placements)
        entries = self._entries(h)
        if (h.version, grid) in entries:
            return
        if len(entries) >= PER_HOLDER_MAX:
            del entries[next(iter(entries))]
        entries[(h.version, grid)] = None
        # A host copy is hashed by its owner's process, which serves it.
        self.table.deliver(h.owner if h.host else h.id,
                           m.HashCells(version=h.version, grid=grid, placements=placements, host=h.host))

    def on_sums(self, node: Node, req: m.CellSums) -> m.Reply:
        if req.host:
            host = self.table.nodes.get(f"{node.id}#host{req.version}")
            if host is None:
                raise InvalidState(f"{node.id} sends cell checksums of a host copy of version {req.version} "
                                   "it does not serve")
            node = host
        entries = self._entries(node)
        if (req.version, req.grid) not in entries:
            raise InvalidState(f"{node.id}: cell checksums of version {req.version} grid {req.grid[:12]} "
                               "were not asked of it")
        if node.version != req.version or node.state not in COMPLETE:
            raise InvalidState(f"{node.id} sends cell checksums of version {req.version} but is "
                               f"{node.state.value} at version {node.version}")
        entries[(req.version, req.grid)] = req.cells
        return m.Ok()

    def on_find(self, node: Node, req: m.FindCells) -> m.Reply:
        if node.version != req.version or not set(req.holders) <= set(node.reshard_from):
            raise InvalidState(f"{node.id} asks for cell checksums of {list(req.holders)} at version {req.version}; "
                               f"it reads version {node.version} from {list(node.reshard_from)}")
        cells: list[m.CellSum] = []
        missing, gone = [], []
        for hid in req.holders:
            h = self.table.nodes.get(hid)
            got = self._entries(h).get((req.version, req.grid), ()) if h is not None else ()
            if h is None or h.version != req.version or h.state not in COMPLETE or got == ():
                gone.append(hid)
            elif got is None:
                missing.append(hid)
            else:
                cells.extend(got)
        return m.CellsAt(cells=tuple(cells), missing=tuple(missing), gone=tuple(gone))

    def forget(self, node_id: str) -> None:
        """A holder left: what it was asked and sent goes with it."""
        self.kept.pop(node_id, None)

    def _entries(self, node: Node) -> dict[tuple[int, str], tuple[m.CellSum, ...] | None]:
        """``node``'s entries, without those of versions other than the one it holds now."""
        entries = self.kept.get(node.id)
        if entries is None:
            entries = self.kept[node.id] = {}
        stale = [k for k in entries if k[0] != node.version]
        for k in stale:
            del entries[k]
        return entries
