"""Recovery: a restarted server's re-announcements (``Announce``) and its recovery window.

A part of :class:`tensorhub.core.reference.ReferenceCore` (docs/design.md, section 1, rule 6):
:class:`Recovery` gets the core's shared :class:`~tensorhub.core.table.Table` and what it acts
through passed in, applies ``Announce`` and owns the recovery window (:attr:`Recovery.until`,
which the other parts read through a function) and the announced reads whose source has not
announced yet. Rules:

- A client announces after a server restart (or an eviction): it registers again with what it
  holds (``Holding``). The first announcement of a client the server does not know opens the
  **recovery window**, one lease from the server's start (its first request or tick,
  :meth:`Recovery.started`). Until it ends no drain completes (a reader still copying from a
  holder under the old server has time to announce that edge before the holder may write its
  tensors), a group with no complete holder left does not fail its readers, and a spec that
  finds nothing waits (``ServerRecovering``): holders are still re-announcing.
- An announced completion makes the node a holder (it may commit its version); an announced
  read goes on from its units: from its source again if the source announced that version
  already, else it waits for the source to announce (the edge is restored then); a source that
  announced without that version is no source (the read queues normally).
- A sharded round is known from its shards' announcements (:meth:`Rounds.announced`,
  :mod:`tensorhub.core.rounds`): inside the window an unconfirmed completion waits until every
  sibling has been heard from (``ServerRecovering``, :meth:`Rounds.holds_back`); one at another
  version than a sibling's completion of its round is refused (``VersionLost``; the shard stays
  registered, idle, and a read of that version it was doing ends) unless the old server
  confirmed it (:meth:`Rounds.conflicting_completion`).
- Announced host copies are kept, unless past retention
  (:meth:`~tensorhub.core.retention.Retention.announced_host_copy`).
- Once the window is over (:meth:`Recovery.tick`): completions held back are accepted as they
  come; every read group is looked at once more (``VersionLost`` was held back); a reader whose
  announced source never came back is scheduled anew; and, at every tick from then on, a drain
  with no reader left completes (the window held it back, or it waits for a probe's deadline:
  :meth:`~tensorhub.core.retention.Retention.awaits_proof`).
"""

from __future__ import annotations

from typing import Callable, Optional

import msgspec

from tensorhub.core import messages as m
from tensorhub.core.reading import Reading
from tensorhub.core.rounds import Rounds
from tensorhub.core.state import COMPLETE, Node, NodeState
from tensorhub.core.table import Table
from tensorhub.errors import ServerRecovering, TensorHubError, code_of


class Recovery:
    """Re-announcements and the recovery window (see the module docstring): a part of the
    reference core. It owns the window (:attr:`until`) and the announced readers waiting for
    their source, changes nodes of the shared :class:`~tensorhub.core.table.Table`, and acts
    through what it is given: the rounds (``rounds``, :class:`~tensorhub.core.rounds.Rounds`)
    and the readers' queues (``reading``, :class:`~tensorhub.core.reading.Reading`), passed in
    whole as to :class:`~tensorhub.core.read_requests.ReadRequests`; ``check``, ``add`` and
    ``seen`` (:class:`~tensorhub.core.members.Members`: a registration validated, a node added,
    a client heard from), ``maybe_commit`` (a new holder may commit its version), ``complete``
    (a reader becomes a holder, :meth:`~tensorhub.core.read_requests.ReadRequests.complete`),
    ``announced_host_copy`` (retention's rule for an announced host copy) and ``finish_drain``
    (:meth:`~tensorhub.core.holders.Holders.finish_drain`)."""

    def __init__(self, table: Table, *, rounds: Rounds, reading: Reading,
                 check: Callable[[m.Register], None], add: Callable[[m.Register, float], Node],
                 seen: Callable[[Node, float], None], maybe_commit: Callable[[Node], None],
                 complete: Callable[[Node], None], announced_host_copy: Callable[[Node, int, bytes], None],
                 finish_drain: Callable[[Node], None]) -> None:
        self.table = table
        self._rounds, self._reading = rounds, reading
        self._check, self._add, self._seen = check, add, seen
        self._maybe_commit, self._complete = maybe_commit, complete
        self._announced_host_copy, self._finish_drain = announced_host_copy, finish_drain
        self.until = float("-inf")
        """The end of the recovery window (``-inf``: no client announced itself yet)."""
        self._born: Optional[float] = None
        self._window_closed = True
        self._pending_edges: dict[str, set[str]] = {}
        """After a restart: announced readers whose source has not announced itself yet."""

    def started(self, now: float) -> None:
        """A request or tick at ``now``: the first one is the server's start (the window counts
        from it)."""
        if self._born is None:
            self._born = now

    def on_Announce(self, req: m.Announce, now: float) -> m.Reply:
        """A client re-registers after a server restart (or an eviction) with what it holds.
        The first announcement opens a recovery window of one lease: drains do not complete
        before it ends, so a reader that is still copying from a holder under the old server
        has time to announce that edge before the holder may write its tensors."""
        reg, hold = req.register, req.holding
        fresh = reg.client_id not in self.table.nodes
        cls = self._check(reg) if fresh else self.table.nodes[reg.client_id].model
        # The rounds and the table know the layout class (an internal model name), the client
        # its model: the same for a model of one layout class.
        added, reg = reg, msgspec.structs.replace(reg, model=cls)
        if fresh:
            self.until = max(self.until, self._born + self.table.config.lease_timeout_s)
            self._window_closed = False
        if self._rounds.holds_back(reg, hold, now):
            if fresh:
                self._rounds.hold_back(reg)
            else:
                self._seen(self.table.nodes[reg.client_id], now)
            raise ServerRecovering(
                f"{added.model} replica {reg.replica_id}: shard {reg.shard}'s unconfirmed completion of version "
                f"{hold.published} waits for its siblings to re-announce; retry")
        self._rounds.release(reg.client_id)
        if fresh:
            self._add(added, now, cls)
        node = self.table.nodes[reg.client_id]
        self._seen(node, now)
        node.heard_at = now
        refused = self._rounds.conflicting_completion(node, hold)
        completes = refused is None and hold.published is not None
        self._restore(node, hold, refused, completes)
        self._source_back(node)
        for version, endpoint in hold.host_copies:
            self._announced_host_copy(node, version, endpoint)
        if completes and node.version == hold.published and node.state in COMPLETE:
            node.unconfirmed = None if hold.confirmed or hold.txn_seq < 0 else (hold.txn_seq, hold.published)
        if refused is not None:
            return m.ErrorReply(code=code_of(refused), message=str(refused))
        self._rounds.announced(node, hold)
        return m.Ok()

    def _restore(self, node: Node, hold: m.Holding, refused: Optional[TensorHubError], completes: bool) -> None:
        """``node`` (registered) takes up what it announced: a completion (``completes``: not
        ``refused``), or a read in progress."""
        table = self.table
        if completes and node.state is NodeState.IDLE:
            table.set_version(node, hold.published, NodeState.PUBLISHED, node.units)
            self._maybe_commit(node)
        elif completes and node.state in (NodeState.WAITING, NodeState.READING) and node.version == hold.published:
            self._complete(node)  # an earlier announcement saw the read still in progress
        elif refused is not None:
            # Kept registered, holding nothing of this round (an earlier announcement's read of
            # that version ends here too).
            if node.state in (NodeState.WAITING, NodeState.READING) and node.version == hold.published:
                self._reading.stop(node)
                node.failure = m.Failed(code=code_of(refused), message=str(refused), version=hold.published)
        elif hold.reading_version >= 0 and node.state is NodeState.IDLE:
            node.round_seq = hold.txn_seq
            table.set_version(node, hold.reading_version, NodeState.WAITING, max(0, min(hold.reading_units, node.units)))
            self._reading.stamp(node)
            src = table.nodes.get(hold.reading_source)
            if (src is not None and src.version == hold.reading_version and src.state is not NodeState.IDLE
                    and src.model == node.model):
                # (A source of another layout class served a resharded read: that read is
                # assigned anew, with every holder shard it needs.)
                self._reading.attach(node, src)
            elif hold.reading_source and hold.reading_source not in table.nodes:
                # Its source has not announced yet: wait for it (it may bring the edge back). One
                # that announced already without this version is no source: queue normally.
                node.awaiting_source = hold.reading_source
                table.index.mark(node)
                self._pending_edges.setdefault(hold.reading_source, set()).add(node.id)

    def _source_back(self, node: Node) -> None:
        """``node`` announced itself: announced readers waiting for it as their source read from
        it again if it holds their version (else they queue normally)."""
        for rid in sorted(self._pending_edges.pop(node.id, ())):
            reader = self.table.nodes.get(rid)
            if reader is not None and reader.state is NodeState.WAITING and reader.awaiting_source == node.id:
                reader.awaiting_source = None
                self.table.index.mark(reader)
                if reader.version == node.version and reader.model == node.model:
                    self._reading.attach(reader, node)

    def tick(self, now: float) -> None:
        """Once the window is over (see the module docstring); nothing before."""
        if now < self.until:
            return
        table = self.table
        self._rounds.release()  # accepted as they are from now on
        if not self._window_closed:
            # VersionLost was held back during the window: re-check every read group once.
            self._window_closed = True
            table.touched.update(n.key for n in table.nodes.values() if n.state in (NodeState.WAITING, NodeState.READING))
        pending = table.index.awaiting() | table.index.draining()
        for node in sorted((table.nodes[i] for i in pending), key=lambda n: n.order):
            if node.awaiting_source is not None:
                node.awaiting_source = None  # its source never came back: schedule it anew
                table.index.mark(node)
                self._pending_edges.clear()
                table.touched.add(node.key)
            if node.state is NodeState.DRAINING and not node.readers:
                self._finish_drain(node)
