"""The requests of a read: ``Replicate``, ``SourceFailed``, ``Progress``, ``ReplicateDone``,
``ReplicateAbort`` and ``Swap``, as the reference core applies them.

A part of :class:`tensorhub.core.reference.ReferenceCore`: :class:`ReadRequests` gets the core's
shared :class:`~tensorhub.core.table.Table` and the parts it acts through passed in (the readers'
queues :class:`~tensorhub.core.reading.Reading`, the rounds of sharded replicas
:class:`~tensorhub.core.rounds.Rounds`, commits :class:`~tensorhub.core.versions.Versions`,
retention :class:`~tensorhub.core.retention.Retention`) and the core's ``drain`` (an update
unpublishes first) and ``describe`` (names a node in errors). The core checks the request's
client and its state's legality first (``tensorhub.core.state.LEGAL``); a handler validates
before it mutates, so an error changes nothing.

Rules (docs/design.md, section 1): a ``Replicate`` resolves its spec in its replica's round
and queues the reader (an ``update()`` of a holder drains its old version first, the read
waiting as ``pending_read``); the same request again (its reply was lost) gets the read's outcome
again (:meth:`ReadRequests.retried`), and one of a later round ends a read its handle gave up
(:meth:`ReadRequests.superseded`); a reader that reports its source failed waits for another and
resumes from its progress; a ``ReplicateDone`` makes the reader a holder, unless its round moved
to another version meanwhile (``VersionLost``: finishing would split the replica); a ``Swap``
hands a complete staging copy's memory to its handle.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from tensorhub.core import messages as m
from tensorhub.core.reading import Reading
from tensorhub.core.retention import Retention
from tensorhub.core.rounds import Rounds
from tensorhub.core.state import Node, NodeState
from tensorhub.core.table import Table
from tensorhub.core.versions import Versions
from tensorhub.errors import InvalidState, ServerRecovering, VersionLost, code_of

log = logging.getLogger("tensorhub.core.reference")


class ReadRequests:
    """The read requests' handlers (see the module docstring): ``on_<Request>(req, now)`` returns
    the reply; a part of the reference core."""

    def __init__(self, table: Table, *, reading: Reading, rounds: Rounds, versions: Versions,
                 retention: Retention, drain: Callable[[Node], None], describe: Callable[[Node], str]) -> None:
        self.table = table
        self._reading = reading
        self._rounds = rounds
        self._versions = versions
        self._retention = retention
        self._drain = drain
        self._describe = describe

    def superseded(self, req: m.Replicate) -> bool:
        """Whether ``req`` asks for a later round than the read its node is still doing (or
        waits to start after an update's drain). A handle runs one operation at a time and
        ends every read it asked for on the server (rules 1 and 3 of
        :mod:`tensorhub.core.handle`), so that read was given up: only its ``ReplicateAbort``
        (sent without waiting for a reply) never arrived. Kept, the read would go on for
        nobody, and its source could never drain."""
        node = self.table.nodes.get(req.client_id)
        if node is None or node.host or req.seq <= 0 or req.seq <= node.round_seq:
            return False
        return node.state in (NodeState.WAITING, NodeState.READING) or (node.state is NodeState.DRAINING and node.pending_read is not None)

    def retried(self, node: Node) -> Optional[m.Reply]:
        """A ``Replicate`` with the seq of the read this node is already doing is the same
        request again: its reply was lost (a cut link, a slow server) and the client sent it
        anew after a reconnect, while the first one had arrived. It gets that read's outcome
        again instead of ``InvalidState``, which would leave the node reading for nobody (and
        its datacenter skipping to a seed that never lands). None: not such a retry."""
        if node.state is NodeState.READING:
            return self._reading.assignment(node)
        if node.state is NodeState.WAITING:
            return m.Waiting(version=node.version)
        if node.pending_read is not None:
            if node.state is NodeState.OFFLOADING:
                return m.OffloadOrder(version=node.version)
            if node.state is NodeState.DRAINING:
                return m.Waiting(version=node.pending_read[0])
        return None

    def on_Replicate(self, req: m.Replicate, now: float) -> m.Reply:
        node = self.table.nodes[req.client_id]
        if node.state is NodeState.PUBLISHED and not req.update:
            raise InvalidState(f"{self._describe(node)}: unpublish() first, or use update()")
        node.in_flight = -1
        version = self._rounds.resolve(node, req)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("model=%s reader=%s (%s, %s %s) asks %r: version %d%s", node.model, node.id, node.datacenter,
                      node.state.name, node.version, req.spec, version,
                      f" (skipping {node.in_flight} in flight)" if node.in_flight >= 0 else "")
        node.round_seq = req.seq
        if node.state is NodeState.PUBLISHED and node.version == version:
            return m.NoChange(version=version, in_flight=node.in_flight)
        resume = req.resume_units if req.resume_version == version else 0
        if node.state is NodeState.PUBLISHED:
            node.pending_read = (version, resume)
            self._drain(node)
        else:
            self._reading.enqueue(node, version, resume)
        return m.Waiting(version=version)

    def on_SourceFailed(self, req: m.SourceFailed, now: float) -> m.Reply:
        node = self.table.nodes[req.client_id]
        node.progress = max(0, min(req.units_done, node.units))
        self.table.index.mark(node)
        node.failed_gone = req.source_id not in self.table.nodes
        if node.state is NodeState.WAITING:
            if node.awaiting_source == req.source_id:
                # Announced after a restart as reading from this source, which it has since found
                # failed: do not restore that edge when the source announces; schedule anew.
                node.awaiting_source = None
                self.table.index.mark(node)
                node.suspects.add(req.source_id)
                self.table.touched.add(node.key)
            return m.Waiting(version=node.version)
        if req.source_id not in (node.reshard_from or (node.source,)):
            return self._reading.assignment(node)  # already moved on; repeat the current one
        log.info("model=%s version=%d reader=%s reports source %s failed at unit %d",
                 node.model, node.version, node.id, req.source_id, node.progress)
        node.suspects.add(req.source_id)
        src = self.table.nodes.get(req.source_id)
        if src is not None and not src.host and src.suspected_at is None:
            src.suspected_at = now
            self.table.index.mark(src)
        if src is not None and req.unreachable:
            src.unreachable = True
        self._reading.detach(node)
        self._reading.wait(node)
        return m.Waiting(version=node.version)

    def read_failed(self, client_id: str) -> Optional[m.Failed]:
        """How the server failed ``client_id``'s last read (a later Progress, SourceFailed or
        ReplicateDone of it is answered with that failure); None: it did not."""
        node = self.table.nodes.get(client_id)
        return node.failure if node is not None and node.state is NodeState.IDLE else None

    def on_Progress(self, req: m.Progress, now: float) -> m.Reply:
        node = self.table.nodes[req.client_id]
        node.progress = max(node.progress, min(req.units_done, node.units))
        self.table.index.mark(node)
        return m.Ok()

    def on_ReplicateDone(self, req: m.ReplicateDone, now: float) -> m.Reply:
        node = self.table.nodes[req.client_id]
        if node.version != req.version:
            raise InvalidState(f"{self._describe(node)}: done reported for version {req.version}")
        txn = self._rounds.of_read(node)
        if txn is not None and txn[1] == node.version and self._rounds.unsettled(node, txn[0]):
            # This read completes once every sibling has re-announced (if one brings a confirmed
            # completion at another version, this read then ends VersionLost).
            raise ServerRecovering(f"{self._describe(node)}: round {node.round_seq} of replica {node.replica_id} "
                                   f"waits for its siblings to re-announce; retry")
        if txn is not None and txn[1] != node.version:
            # The round moved to another version while this shard was still reading (its version
            # was lost and a sibling's retry re-resolved the round; a server restart can hide
            # that the read had been failed): finishing it would split the replica.
            err = VersionLost(f"{self._describe(node)}: round {node.round_seq} of replica {node.replica_id} "
                              f"moved to version {txn[1]} during this read of {req.version}")
            self._reading.fail(node, err)
            return m.ErrorReply(code=code_of(err), message=str(err))
        self.complete(node)
        return m.Ok()

    def complete(self, node: Node) -> None:
        """The reader has every unit (verified by itself); it is a holder now. Also legal while
        WAITING: its source may have died just as the last unit arrived."""
        # A holder first, its class's commit next, then detach: the drain of the source may end
        # here, and its retention check must count this reader as a holder already (one of
        # another layout class counts once that class retains the version).
        self.table.set_version(node, node.version, NodeState.PUBLISHED, node.units)
        self._versions.maybe_commit(node)
        sources = node.reshard_from or ((node.source,) if node.source else ())
        self._reading.detach(node)
        node.suspects.clear()
        node.awaiting_source = None
        self.table.index.mark(node)
        self._retention.ask_host_copy(node)
        if not node.retains:  # an engine that keeps no copies: its source may be the only keeper
            for sid in sources:
                src = self.table.nodes.get(sid)
                if src is not None:
                    self._retention.ask_sole_keeper(src)

    def on_Swap(self, req: m.Swap, now: float) -> m.Reply:
        """The handle takes over its complete staging copy's memory (see :class:`m.Swap`)."""
        x, y = self.table.nodes[req.client_id], self.table.nodes.get(req.stage_id)
        why = ""
        if (req.endpoint and x.endpoint == req.endpoint and x.state is NodeState.PUBLISHED and x.version == req.version
                and y is not None and y.stage_for == x.id):
            return m.Ok()  # this swap again (its answer was lost): made already
        if x.state is not NodeState.IDLE:
            raise InvalidState(f"Swap is not allowed while {self._describe(x)}")
        if y is None or y.host or y.stage_for != x.id:
            why = f"{req.stage_id} is not this handle's staging copy"
        elif x.num_shards > 1:
            why = "sharded replicas read in rounds: they copy"
        elif y.state is not NodeState.PUBLISHED or y.version != req.version:
            why = f"the staging copy is {y.state.value} at version {y.version}, not complete at {req.version}"
        elif y.readers:
            why = f"the staging copy has {len(y.readers)} reader(s)"
        else:
            v = self._versions.resolve(x, req.spec)
            if v != req.version:
                why = f"{req.spec!r} is version {v} now"
        if why:
            raise InvalidState(f"{self._describe(x)}: swap refused: {why}")
        x.endpoint, y.endpoint = y.endpoint, x.endpoint
        if y.copy_asked >= 0:  # its retention copy would now come from nowhere: ask the handle
            y.copy_asked = -1
        self.table.set_version(y, -1, NodeState.IDLE, 0)
        self.table.set_version(x, req.version, NodeState.PUBLISHED, x.units)
        self._versions.maybe_commit(x)
        self._retention.ask_host_copy(x)
        return m.Ok()

    def on_ReplicateAbort(self, req: m.ReplicateAbort, now: float) -> m.Reply:
        """The handle gave up its read. An ``update()`` that gives up while its old version is
        still draining (no byte of the new one written: the read is only ``pending_read``) takes
        the update back: the node publishes its old version again, as the handle's tensors still
        hold it (the handle then re-publishes it, rule 3 of :mod:`tensorhub.core.handle`).
        Refusing the abort instead would leave the server reading for nobody once the drain
        ends, and the source it reads from could never drain."""
        node = self.table.nodes[req.client_id]
        if node.state is NodeState.DRAINING:
            if node.pending_read is None:
                raise InvalidState(f"{self._describe(node)}: unpublishing, no read to abort")
            node.pending_read = None
            self._retention.end_proof_wait(node)
            node.state = NodeState.PUBLISHED
            self.table.index.mark(node)
            self.table.touched.add(node.key)
            return m.Ok()
        self._reading.stop(node)
        return m.Ok()
