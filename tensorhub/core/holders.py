"""Holders: how a node comes to hold a version and how it stops holding it -- publish, the drain,
removal.

A part of :class:`tensorhub.core.reference.ReferenceCore` (docs/design.md, section 1, rules 3 to
5): :class:`Holders` gets the core's shared :class:`~tensorhub.core.table.Table` and what it acts
through passed in, and applies ``Publish``, ``Unpublish`` and ``Leave``. Rules:

- ``Publish`` makes a client a holder of a version (not one past retention: ``VersionExpired``);
  the same version again is answered ``Ok``, another one needs an unpublish first. A host copy
  is published as a node of its own (:meth:`Holders.add_host_copy`).
- **The drain** (rule 3): unpublish hides the holder from new readers (DRAINING) and waits until
  its readers finish (the last one to detach ends it, :meth:`Holders.finish_drain`); then the
  holder is idle and gets ``UnpublishDone``, or, for an ``update()``, its pending read is
  queued. Inside the recovery window after a restart no drain completes (the core's tick
  completes them once it ends): a reader still copying under the old server may not have
  announced that edge yet.
- **Offload first** (rule 4): a drained holder that retention says must keep its copy (the last
  live non-spot copy of a retained version, or its datacenter's newest) is ordered to offload
  to host before it completes (``OffloadOrder``); retention may first wait for a probed proof of
  life of the other copies (:meth:`~tensorhub.core.retention.Retention.awaits_proof`). A host
  copy's drain ends with its owner told to drop it (``DropHostCopy``).
- **Removal** (rule 5): ``Leave``, a lease expiry or a death takes a client out, its host copies
  first; its readers wait for another source and resume from their own progress; a datacenter
  whose seeder (or the reader that had the version there) left has its seed handed to another
  replica, re-checked when the request settles (``Table.reseed``). A dead replica goes as a
  whole (``Evicted`` to each member); its rounds stay, for a bounded time
  (:mod:`tensorhub.core.rounds`). A removed client gets nothing from the request but its
  eviction (``Table.removed``). A client that serves the last live non-spot copy of a retained
  version may not leave while others of its model remain (``LastCopyHeld``), unless it drops it
  (``Leave.drop_last_copy``).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from tensorhub.core import messages as m
from tensorhub.core.reading import Reading
from tensorhub.core.retention import Retention
from tensorhub.core.state import ModelRecord, Node, NodeState
from tensorhub.core.table import Table
from tensorhub.errors import InvalidState, LastCopyHeld, VersionExpired

log = logging.getLogger("tensorhub.core.reference")


class Holders:
    """Publish, the drain and removal (see the module docstring): a part of the reference core.
    It changes nodes of the shared :class:`~tensorhub.core.table.Table` (their state through
    :meth:`Table.set_version`) and acts through what it is given: the readers' queues
    (``reading``, :class:`~tensorhub.core.reading.Reading`) and retention's rules (``retention``,
    :class:`~tensorhub.core.retention.Retention`), passed in whole as to
    :class:`~tensorhub.core.read_requests.ReadRequests`, so that a core given another class of
    either part (a planted bug) reaches these calls too; ``add_host``, ``forget`` and
    ``forget_empty_models`` (:class:`~tensorhub.core.members.Members`: a host copy's node, a node
    and empty models taken out of the table), ``maybe_commit`` (a new holder may commit its
    version), ``set_seed_asked`` (offload seeding's entry of a datacenter,
    :meth:`~tensorhub.core.crossdc.CrossDatacenter.set_seed_asked`), ``recovering_until`` (the
    end of the core's recovery window after a restart) and ``describe`` (names a node in errors)."""

    def __init__(self, table: Table, *, reading: Reading, retention: Retention,
                 add_host: Callable[[Node, int, bytes], Node], forget: Callable[[Node], None],
                 forget_empty_models: Callable[[], None], maybe_commit: Callable[[Node], None],
                 set_seed_asked: Callable[[ModelRecord, str, Optional[tuple[int, str, float]]], None],
                 recovering_until: Callable[[], float], describe: Callable[[Node], str],
                 check_covered: Callable[[Node], None]) -> None:
        self.table = table
        self._check_covered = check_covered
        """Raises if a publish of an uncommitted version by the node would leave its replica's
        placements short of the model's schema (:meth:`tensorhub.core.placements.Placements.check_covered`)."""
        self._reading = reading
        self._retention = retention
        self._add_host, self._forget, self._forget_empty_models = add_host, forget, forget_empty_models
        self._maybe_commit, self._set_seed_asked = maybe_commit, set_seed_asked
        self._recovering_until, self._describe = recovering_until, describe

    # ------------------------------------------------------------------ requests

    def on_Publish(self, req: m.Publish, now: float) -> m.Reply:
        node = self.table.nodes[req.client_id]
        if req.version < 0:
            raise InvalidState(f"version {req.version} is negative")
        if node.state is NodeState.PUBLISHED:
            if node.version == req.version:
                return m.Ok()
            raise InvalidState(f"{self._describe(node)}: unpublish() before publishing version {req.version}")
        mod = self.table.models[node.model]
        if req.version < mod.forgotten_below:
            raise VersionExpired(f"{node.model}: version {req.version} is older than the retained versions")
        if req.version not in mod.committed:
            self._check_covered(node)
        self.table.set_version(node, req.version, NodeState.PUBLISHED, node.units)
        self._maybe_commit(node)
        return m.Ok()

    def on_Unpublish(self, req: m.Unpublish, now: float) -> m.Reply:
        """Starts the drain; a retry of one under way gets its state again (``OffloadOrder``
        while offloading: the order may have been lost)."""
        node = self.table.nodes[req.client_id]
        if node.state is NodeState.IDLE:
            return m.UnpublishDone(version=-1)
        if node.state is NodeState.OFFLOADING:
            return m.OffloadOrder(version=node.version)
        if node.state is NodeState.DRAINING:
            return m.Waiting(version=node.version)
        self.drain(node)
        return m.Waiting(version=node.version)

    def on_Leave(self, req: m.Leave, now: float) -> m.Reply:
        node = self.table.nodes[req.client_id]
        if not req.drop_last_copy:
            held = self._retention.last_copies(node)
            if held:
                raise LastCopyHeld(
                    f"{self._describe(node)} serves the last live non-spot copy of "
                    f"retained version(s) {held} while other clients of the model remain: the handle stays open "
                    f"(close(drop_last_copy=True) drops it)")
        self.remove(req.client_id)
        self._forget_empty_models()
        return m.Ok()

    # ------------------------------------------------------------------ holders

    def add_host_copy(self, owner: Node, version: int, endpoint: bytes) -> None:
        """``owner``'s host copy of ``version`` becomes a node of its own (``<owner>#host<version>``),
        published and served by ``owner``'s process (retention decides when)."""
        if f"{owner.id}#host{version}" in self.table.nodes:
            return
        host = self._add_host(owner, version, endpoint)
        self.table.set_version(host, version, NodeState.PUBLISHED, host.units)
        self._maybe_commit(host)
        log.info("model=%s version=%d shard=%d host copy published by %s", host.model, version, host.shard, owner.id)

    def drain(self, node: Node) -> None:
        """``node`` stops serving new readers and unpublishes once its readers are done."""
        node.state = NodeState.DRAINING
        self.table.index.mark(node)
        self.table.touched.add(node.key)
        if not node.readers:
            self.finish_drain(node)

    def finish_drain(self, node: Node) -> None:
        """No reader of draining ``node`` is left: it completes, unless the recovery window is
        open (the core's tick completes it once the window is over: a reader still copying from
        this holder, a host copy too, under the old server may not have announced yet)."""
        if self.table.now < self._recovering_until():
            return
        self.finish_drain_now(node)

    def finish_drain_now(self, node: Node) -> None:
        """No reader is left. Offload first when this is the last non-spot copy of a retained
        version (checked now, not at unpublish time: the readers just drained are holders now)."""
        if not node.host and self._retention.needs_offload(node):
            if self._retention.awaits_proof(node):
                return  # stays DRAINING until the proof or proof_until (tick)
            node.state = NodeState.OFFLOADING
            self.table.index.mark(node)
            log.info("model=%s version=%d shard=%d %s holds %s: offload first", node.model, node.version,
                     node.shard, node.id, f"the newest copy in {node.datacenter}" if node.stage_for
                     else "the last non-spot copy")
            self.table.deliver(node.id, m.OffloadOrder(version=node.version))
            return
        self._retention.end_proof_wait(node)
        self.complete_unpublish(node)

    def complete_unpublish(self, node: Node) -> None:
        """``node`` holds nothing now: a host copy is forgotten (its owner drops it); a client gets
        ``UnpublishDone``, or its pending read (an ``update()``) is queued."""
        version = node.version
        self.table.set_version(node, -1, NodeState.IDLE, 0)
        if node.host:
            self._forget(node)
            if node.owner in self.table.nodes:
                self.table.deliver(node.owner, m.DropHostCopy(version=version))
            return
        if node.pending_read is not None:
            target, resume = node.pending_read
            node.pending_read = None
            self._reading.enqueue(node, target, resume)
        else:
            self.table.deliver(node.id, m.UnpublishDone(version=version))

    # ------------------------------------------------------------------ removal

    def remove_replica(self, model: str, replica_id: str, reason: str) -> None:
        """Every client of the replica is evicted (``Evicted(reason)``) and removed."""
        members = sorted(self.table.replicas.get((model, replica_id), ()))
        for nid in members:
            node = self.table.nodes.get(nid)
            if node is None:
                continue
            self.table.deliver(nid, m.Evicted(reason=reason))
            self.remove(nid)
        # The replica's rounds stay (for a bounded time, tensorhub/core/rounds.py): its members
        # re-announce (or restart) and go on counting from them; a round whose version is gone
        # is re-resolved by the next shard that asks.
        self._forget_empty_models()

    def remove(self, node_id: str) -> None:
        """``node_id`` (and the host copies it serves) leaves the table; unknown ids are ignored."""
        node = self.table.nodes.get(node_id)
        if node is None:
            return
        for hid in sorted(self.table.hosts_of.get(node_id, ()), key=lambda h: self.table.nodes[h].order):
            self.remove(hid)
        self._reading.detach(node)
        for r in sorted(node.readers):
            self._reading.orphan(r, node_id)
        node.readers.clear()
        self.table.set_version(node, -1, NodeState.IDLE, 0)
        self._forget(node)
        mod = self.table.models.get(node.model)
        if mod is not None and not node.host:
            asked = mod.seed_asked.get(node.datacenter)
            if asked is not None and asked[1] in ("", node.replica_id, node.replica_id.removesuffix("~prefetch")):
                # The seeder (or the reader that had the version there) is gone: another
                # replica of that datacenter takes over the seed.
                self._set_seed_asked(mod, node.datacenter, None)
                self.table.reseed.add((node.model, node.datacenter))
        self.table.removed.add(node_id)
