"""Retention: host copies that keep recent versions available.

A part of :class:`tensorhub.core.reference.ReferenceCore`, kept apart because it is one concern
(docs/design.md, section 1, rule 4): :class:`Retention` gets the core's shared
:class:`~tensorhub.core.table.Table` and the functions of the core it acts through passed in.

- "non-spot" below means a holder that keeps copies (``Node.keeps_copies``): neither spot nor
  registered with ``retains=False`` (a rollout engine whose memory is for serving: the trainer
  keeps the retained versions);
- the last live non-spot complete holder of a retained version offloads it to host memory
  before it unpublishes (``needs_offload``; an ``OffloadOrder``, answered by ``OffloadDone``);
  a seeder's staging copy also keeps its datacenter's newest copy that way
  (:meth:`~tensorhub.core.crossdc.CrossDatacenter.keeps_dc_copy`);
- the first non-spot reader to hold a retained version is asked to copy it ahead, in the
  background (``MakeHostCopy``, answered by ``HostCopy``), so that unpublish has nothing left to copy;
  when no replica that keeps copies holds or reads the version (the rollout engines registered
  ``retains=False``), nobody will: the holder they read from (the trainer) is asked once its
  readers are done (``ask_sole_keeper``), so its next unpublish, on the trainer's critical
  path, copies nothing;
- a host copy is a node of its own (``<owner>#host<version>``), served by its owner's process;
- a version past retention is forgotten: its host copies drain and are freed (``forget``);
- a client that serves the last live copy of a retained version may not leave (``last_copies``),
  and "live" means heard from lately (``heard_lately``): a dead holder whose lease has not run
  out yet does not count;
- a held pulse keeps a client's lease but proves nothing about its process (one that died
  without Ray knowing yet is held the same): a drained holder whose version's other copies are
  vouched for by held pulses only probes them (``Probe`` answers their pulse; the next pulse is
  the proof) and waits up to ``2.5 * heartbeat_interval_s`` before it skips the offload; no
  proof, it offloads (``awaits_proof``). Offloading in doubt costs a host copy; skipping it
  in error loses the version;
- across layout classes (:mod:`tensorhub.core.placements`) a version is retained when its class
  retains it and it is one of the newest ``versions_retained`` the classes retain together
  (``kept``): an engine class that has not committed the trainer's newest version yet does not
  offload the one before, which the model has moved past (its readers reshard the newer one);
- across layout classes a holder's version also counts as
  held elsewhere when a replica of another class of its model holds it whole (every shard
  complete, non-spot, heard from lately), that class retains the version too (its retention
  keeps that copy), and it could fill this holder's placement by a resharded read
  (``held_in_other_layout``): a trainer whose rollouts hold the version in their own layout
  does not copy it to host memory at every step.
"""

from __future__ import annotations

import heapq
import logging
from typing import Callable, Iterator

from tensorhub.core import messages as m
from tensorhub.core.other_layouts import OtherLayouts
from tensorhub.core.placements import logical
from tensorhub.core.state import COMPLETE, VISIBLE_SOURCE, Node, NodeState
from tensorhub.core.table import Table
from tensorhub.errors import InvalidState

log = logging.getLogger("tensorhub.core.reference")

_PROBES_MAX = 4
"""Holders a drained holder probes at most for proof of life before it skips an offload."""


class Retention:
    """Host copies and retention (see the module docstring): a part of the reference core. It
    reads the shared :class:`~tensorhub.core.table.Table`, owns the probes of held-pulse holders
    (:attr:`probing`), and changes nodes through the functions of the core it is given:
    ``add_host_copy`` (a host copy becomes a node), ``drain``, ``finish_drain``,
    ``complete_unpublish``; ``describe`` names a node in errors, ``keeps_dc_copy`` is offload
    seeding's rule (:meth:`~tensorhub.core.crossdc.CrossDatacenter.keeps_dc_copy`),
    ``recovering_until`` the end of the core's recovery window after a restart, ``clients_in`` a
    model's clients (host copies excluded)."""

    def __init__(self, table: Table, *, add_host_copy: Callable[[Node, int, bytes], None],
                 drain: Callable[[Node], None], finish_drain: Callable[[Node], None],
                 complete_unpublish: Callable[[Node], None], describe: Callable[[Node], str],
                 keeps_dc_copy: Callable[[Node], bool], recovering_until: Callable[[], float],
                 clients_in: Callable[[str], int], others: OtherLayouts) -> None:
        self.table = table
        self.probing: dict[str, set[str]] = {}
        """Client -> drained holders waiting for its process's proof of life (``Probe``)."""
        self._add_host_copy, self._drain, self._finish_drain = add_host_copy, drain, finish_drain
        self._complete_unpublish, self._describe, self._keeps_dc_copy = complete_unpublish, describe, keeps_dc_copy
        self._recovering_until, self._clients_in = recovering_until, clients_in
        self._others = others
        """Which replicas of other layout classes can fill a holder (read only)."""

    def ask_sole_keeper(self, node: Node) -> None:
        """``node`` (a holder, typically the trainer that published) has no readers left and none
        waiting at its version and shard, and no copy of that version was asked for or made: if
        no other replica of the model (any layout class) that keeps copies holds or reads the
        version, none will make the retention copy as things stand (rollout engines opened with
        ``retains=False``), so ``node`` is asked to copy its version ahead now
        (:meth:`ask_host_copy`), while its process trains, rather than offload the same bytes at
        its next unpublish, on its critical path. Not at publish: the copy would compete with
        the readers for the holder's memory bus and link. A replica that keeps copies and reads
        the version is asked instead when it finishes (the copy then lives outside the
        publisher's process: one death does not take the newest version and its retention copy
        together). Called when one of ``node``'s readers registered with ``retains=False``
        finishes (a spot reader finishing does not ask: spot fleets offload at unpublish, as they
        did); cost: the version's nodes, until a copy is asked for."""
        if (not node.keeps_copies or node.host or node.stage_for or node.state is not NodeState.PUBLISHED
                or node.readers):
            return
        g = self.table.group(node.key)
        if g.waiting or g.asked or g.hosts:
            return
        nodes, groups = self.table.nodes, self.table.groups
        for cls in set(self.table.classes.get(logical(node.model), ())) | {node.model}:
            mod = self.table.models.get(cls)
            for k in range(mod.num_shards if mod is not None else 0):
                for i in groups.get((cls, node.version, k), ()):
                    o = nodes[i]
                    if o.keeps_copies and not o.host and o.replica_id != node.replica_id:
                        return
        self.ask_host_copy(node)

    def ask_host_copy(self, node: Node) -> None:
        """The first non-spot reader to hold a retained version (or its publisher, see
        :meth:`ask_sole_keeper`) copies it to host memory in the background (MakeHostCopy), unless
        a copy exists or another holder was asked already."""
        if self.table.config.versions_retained < 2 or not node.keeps_copies or node.host:
            return
        if not self.kept(node.model, node.version):
            return
        g = self.table.index.group(node.key)
        if g is not None and (g.hosts or g.asked - {node.id}):
            return
        node.copy_asked = node.version
        self.table.index.mark(node)
        self.table.deliver(node.id, m.MakeHostCopy(version=node.version))

    def on_offload_done(self, req: m.OffloadDone) -> m.Reply:
        node = self.table.nodes[req.client_id]
        if node.version != req.version:
            raise InvalidState(f"{self._describe(node)}: offload reported for version {req.version}")
        # A copy listed already was announced after this report's first try was lost: it is this one.
        if self._own_host_copy(node, req.version) or self.needs_offload(node):
            self._add_host_copy(node, req.version, req.endpoint)
            if node.stage_for:
                self._drop_older_dc_copies(self.table.nodes[f"{node.id}#host{req.version}"])
        else:  # another non-spot holder appeared meanwhile: the copy is not needed
            self.table.deliver(node.id, m.DropHostCopy(version=req.version))
        if node.readers:
            # A reader re-announced (after a restart) as still copying from this holder while it
            # offloaded: the holder may not write until that read ends, so it drains again (its
            # host copy, if kept, is published now: the drain ends without a second offload).
            node.state = NodeState.DRAINING
            self.table.index.mark(node)
            self.table.touched.add(node.key)
            return m.Waiting(version=req.version)
        self._complete_unpublish(node)
        return m.Waiting(version=req.version)

    def on_host_copy(self, req: m.HostCopy) -> m.Reply:
        node = self.table.nodes[req.client_id]
        if self._own_host_copy(node, req.version):
            return m.Ok()  # listed already (announced, or this report came twice): keep it
        wanted = (node.keeps_copies and not node.host and node.version == req.version and node.state in COMPLETE
                  and self.kept(node.model, req.version) and not self.table.group(node.key).hosts)
        node.copy_asked = -1
        self.table.index.mark(node)
        if wanted:
            self._add_host_copy(node, req.version, req.endpoint)
        else:
            self.table.deliver(node.id, m.DropHostCopy(version=req.version))
        return m.Ok()

    def _own_host_copy(self, owner: Node, version: int) -> bool:
        """Whether the server lists ``owner``'s host copy of ``version`` already. A handle keeps
        one host copy per version, so a report of one (``OffloadDone``, ``HostCopy``) that finds
        it listed reports that same copy: dropping it as redundant would free the copy the
        server goes on serving (a retried ``OffloadDone`` after the handle re-announced it)."""
        return f"{owner.id}#host{version}" in self.table.nodes

    def announced_host_copy(self, owner: Node, version: int, endpoint: bytes) -> None:
        """A host copy ``owner`` announced after a restart: kept, unless its version is past
        retention already (its ``DropHostCopy`` was lost with the old server): then dropped, at
        the end of the recovery window if the announcement came inside it (until then it drains,
        hidden from new readers, so a reader copying from it under the old server can announce).
        One the server lists already (an announcement while it is up: the handle's liveness
        pulse got no answer) is that same copy, maybe draining under a reader: left as it is."""
        if self._own_host_copy(owner, version):
            return
        if version < self.table.models[owner.model].forgotten_below and self.table.now < self._recovering_until():
            # Listed, hidden from new readers and freed when the recovery window ends: a reader
            # still copying from it under the old server may not have announced that edge yet.
            self._add_host_copy(owner, version, endpoint)
            self._drain(self.table.nodes[f"{owner.id}#host{version}"])
            return
        if version < self.table.models[owner.model].forgotten_below:
            log.info("model=%s version=%d: host copy announced by %s is past retention: dropped",
                     owner.model, version, owner.id)
            self.table.deliver(owner.id, m.DropHostCopy(version=version))
            return
        self._add_host_copy(owner, version, endpoint)

    def _drop_older_dc_copies(self, host: Node) -> None:
        """A newer datacenter copy (``host``) was kept: its owner's host copies of older versions
        go, unless one is the last live non-spot copy of its version anywhere (retention)."""
        for hid in sorted(self.table.hosts_of.get(host.owner, ())):
            old = self.table.nodes[hid]
            if old.id == host.id or old.version >= host.version or old.state is not NodeState.PUBLISHED:
                continue
            if self.other_live_copy(old):
                log.info("model=%s version=%d shard=%d host copy %s: a newer one is kept in %s",
                         old.model, old.version, old.shard, old.id, old.datacenter)
                self._drain(old)

    def forget_below(self, model: str, floor: int) -> None:
        """Retention's floor rose to ``floor``: host copies of versions under it that were never
        committed (announced after a restart, one shard of a replica only) go too; committed ones
        go through :meth:`forget`. One look at the model's groups, once per commit that moves it."""
        committed = self.table.models[model].committed
        for v in sorted({k[1] for k in self.table.groups if k[0] == model and 0 <= k[1] < floor}):
            if v not in committed:
                self.forget(model, v)

    def forget(self, model: str, version: int) -> None:
        """A version fell out of retention: its host copies drain and are freed."""
        log.info("model=%s version=%d is past retention", model, version)
        self.table.models[model].origin_dc.pop(version, None)
        for i in range(self.table.models[model].num_shards):
            for nid in sorted(self.table.groups.get((model, version, i), ())):
                host = self.table.nodes[nid]
                if host.host and host.state is NodeState.PUBLISHED:
                    self._drain(host)

    def needs_offload(self, node: Node) -> bool:
        """``node`` holds a retained version with no other visible non-spot copy whose process
        proved lately that it is alive (or a datacenter copy to keep)."""
        if not node.keeps_copies or node.host or not self.kept(node.model, node.version):
            return False
        if self._keeps_dc_copy(node):
            return True
        return not (any(self.heard_lately(o) for o in self._other_copies(node)) or self.held_in_other_layout(node))

    def kept(self, model: str, version: int) -> bool:
        """Retention keeps ``version`` of layout class ``model``: its class retains it, and it is
        one of the newest ``versions_retained`` versions the model's classes retain together.
        One layout class: its own retention. Several: a class that has not committed the
        trainer's newest version yet still retains the one before, but the model has moved on
        (its readers reach the newer one by resharded reads); keeping the older one would cost
        an engine class a host copy at every step that a one-layout model does not pay."""
        retained = self.table.retained(model)
        if version not in retained:
            return False
        classes = self.table.classes.get(logical(model), ())
        if len(classes) < 2:
            return True
        across = set(retained).union(*(self.table.retained(c) for c in classes))
        return version in sorted(across)[-self.table.config.versions_retained:]

    def held_in_other_layout(self, node: Node, attended: bool = False) -> bool:
        """A replica of another layout class of ``node``'s model holds ``node``'s version whole
        (every shard complete, non-spot, heard from lately; ``attended``: a held pulse counts),
        its own class retains that version (else nothing keeps that copy: it may be read over
        without an offload, each class counting on the other), and it could fill ``node``'s
        placement by a resharded read."""
        return self._others.holds(node, lambda n: (n.keeps_copies and n.version in self.table.retained(n.model)
                                                   and self.heard_lately(n, attended)))

    def _other_copies(self, node: Node) -> Iterator[Node]:
        """The visible non-spot copies of ``node``'s version and shard other than ``node`` (in
        no particular order)."""
        for i in self.table.groups.get(node.key, ()):
            o = self.table.nodes[i]
            if o.id != node.id and o.state in VISIBLE_SOURCE and o.keeps_copies:
                yield o

    def awaits_proof(self, node: Node) -> bool:
        """Drained ``node`` needs an offload, but other copies of its version are vouched for by
        held pulses only: probe their processes (once; the first ``_PROBES_MAX`` by id: one proof
        is enough, and a fleet of idle holders is not woken at every unpublish) and wait until
        ``proof_until``, so that an idle, living fleet does not cost an offload per unpublish.
        True: keep waiting (``tick``, or the proving request, :meth:`proved`, looks again);
        False: offload now (no doubted copy, or no proof in time). A datacenter copy to keep
        offloads at once."""
        doubted = heapq.nsmallest(_PROBES_MAX, {o.owner if o.host else o.id for o in self._other_copies(node)
                                                if self.attended_only(o)})
        if not doubted or self._keeps_dc_copy(node):
            self.end_proof_wait(node)
            return False
        if node.proof_until is None:
            node.proof_until = self.table.now + 2.5 * self.table.config.heartbeat_interval_s
            for gone in [c for c in self.probing if c not in self.table.nodes]:
                del self.probing[gone]  # removed without a word since it was probed
            for cid in doubted:
                self.probing.setdefault(cid, set()).add(node.id)
                self.table.deliver(cid, m.Probe())
            log.info("model=%s version=%d shard=%d %s: other copies are held by %s, whose pulses are held: "
                     "probing before the offload is skipped", node.model, node.version, node.shard, node.id, doubted)
            return True
        if self.table.now < node.proof_until:
            return True
        log.info("model=%s version=%d shard=%d %s: no proof from %s: offload", node.model, node.version,
                 node.shard, node.id, doubted)
        self.end_proof_wait(node)
        return False

    def end_proof_wait(self, node: Node) -> None:
        if node.proof_until is None:
            return
        node.proof_until = None
        for cid in [c for c, waiting in self.probing.items() if node.id in waiting]:
            self.probing[cid].discard(node.id)
            if not self.probing[cid]:
                del self.probing[cid]

    def proved(self, client_id: str) -> None:
        """``client_id``'s process sent a request of its own: the drains that probed it look again."""
        for nid in sorted(self.probing.pop(client_id, ())):
            node = self.table.nodes.get(nid)
            if node is not None and node.proof_until is not None and node.state is NodeState.DRAINING and not node.readers:
                self._finish_drain(node)

    def last_copies(self, node: Node) -> list[int]:
        """Retained versions of which ``node`` (or a host copy it serves) is the last live non-spot
        copy, while clients other than ``node`` remain in its model (else nobody could read them)."""
        if self._clients_in(node.model) <= 1:
            return []  # node is the model's only client
        mine = [node] + [self.table.nodes[h] for h in self.table.hosts_of.get(node.id, ())]
        held = set()
        for n in mine:
            if not n.keeps_copies or not self.kept(n.model, n.version) or n.state not in COMPLETE:
                continue
            # A held pulse counts here: a leave cannot wait for a probe, and refusing it whenever
            # the other holders are idle would keep every close() open.
            if not (self.other_live_copy(n, owner=node.id, attended=True)
                    or (n is node and self.held_in_other_layout(n, attended=True))):
                held.add(n.version)
        return sorted(held)

    def other_live_copy(self, node: Node, owner: str = "", attended: bool = False) -> bool:
        """Another live non-spot complete copy of ``node``'s version and shard exists (not
        ``node``, nor a host copy served by ``owner``); ``attended``: a held pulse counts as alive
        (see :meth:`heard_lately`)."""
        for oid in self.table.groups.get(node.key, ()):
            o = self.table.nodes[oid]
            if (oid != node.id and o.state in COMPLETE and o.keeps_copies and (not owner or o.owner != owner)
                    and self.heard_lately(o, attended)):
                return True
        return False

    def heard_lately(self, node: Node, attended: bool = False) -> bool:
        """Whether ``node`` (a host copy: its owner) counts as a live copy for retention: its
        process sent a request of its own within ``2.5 * heartbeat_interval_s`` (``attended``:
        or its pulse is held), not reported failed, not unreachable. A holder that died recently
        is still in the table until its lease runs out, and a held pulse keeps that lease for a
        process that died without Ray knowing yet; counting either would let the last live copy
        go (the version is lost when the ghost expires). A false "silent" costs one extra host
        copy, which is dropped as excess later."""
        owner = self.table.nodes.get(node.owner) if node.host else node
        if owner is None or owner.unreachable or owner.suspected_at is not None:
            return False
        return self.table.now - (owner.last_seen if attended else owner.heard_at) <= 2.5 * self.table.config.heartbeat_interval_s

    def attended_only(self, node: Node) -> bool:
        """``node``'s process is vouched for by a held pulse only (no request of its own lately)."""
        return self.heard_lately(node, attended=True) and not self.heard_lately(node)
