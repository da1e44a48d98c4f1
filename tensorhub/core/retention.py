"""Retention: host copies that keep recent versions available.

A mixin of :class:`tensorhub.core.reference.ReferenceCore` (it reads and changes the core's
table), kept apart because it is one concern (docs/design.md, section 1, rule 4):

- the last live non-spot complete holder of a retained version offloads it to host memory
  before it unpublishes (``_needs_offload``; an ``OffloadOrder``, answered by ``OffloadDone``);
  a seeder's staging copy also keeps its datacenter's newest copy that way
  (:meth:`~tensorhub.core.crossdc.CrossDatacenter.keeps_dc_copy`);
- the first non-spot reader to hold a retained version is asked to copy it ahead, in the
  background (``MakeHostCopy``, answered by ``HostCopy``), so that unpublish has nothing left to copy;
- a host copy is a node of its own (``<owner>#host<version>``), served by its owner's process;
- a version past retention is forgotten: its host copies drain and are freed (``_forget``);
- a client that serves the last live copy of a retained version may not leave (``_last_copies``),
  and "live" means heard from lately (``_heard_lately``): a dead holder whose lease has not run
  out yet does not count;
- a held pulse keeps a client's lease but proves nothing about its process (one that died
  without Ray knowing yet is held the same): a drained holder whose version's other copies are
  vouched for by held pulses only probes them (``Probe`` answers their pulse; the next pulse is
  the proof) and waits up to ``2.5 * heartbeat_interval_s`` before it skips the offload; no
  proof, it offloads (``_awaits_proof``). Offloading in doubt costs a host copy; skipping it
  in error loses the version.
"""

from __future__ import annotations

import heapq
import logging
from typing import Iterator

from tensorhub.core import messages as m
from tensorhub.core.state import COMPLETE, VISIBLE_SOURCE, Node, NodeState
from tensorhub.errors import InvalidState

log = logging.getLogger("tensorhub.core.reference")

_PROBES_MAX = 4
"""Holders a drained holder probes at most for proof of life before it skips an offload."""


class Retention:
    """Host copies and retention (see the module docstring)."""

    def _ask_host_copy(self, node: Node) -> None:
        """The first non-spot reader to hold a retained version copies it to host memory in the
        background (MakeHostCopy), unless a copy exists or another holder was asked already."""
        if self.config.versions_retained < 2 or node.spot or node.host:
            return
        if node.version not in self.retained(node.model):
            return
        g = self.index.group(node.key)
        if g is not None and (g.hosts or g.asked - {node.id}):
            return
        node.copy_asked = node.version
        self.index.mark(node)
        self.table.deliver(node.id, m.MakeHostCopy(version=node.version))

    def _on_OffloadDone(self, req: m.OffloadDone, now: float) -> m.Reply:
        node = self.nodes[req.client_id]
        if node.version != req.version:
            raise InvalidState(f"{self._describe(node)}: offload reported for version {req.version}")
        # A copy listed already was announced after this report's first try was lost: it is this one.
        if self._own_host_copy(node, req.version) or self._needs_offload(node):
            self._add_host_copy(node, req.version, req.endpoint)
            if node.stage_for:
                self.crossdc.drop_older_dc_copies(self.nodes[f"{node.id}#host{req.version}"])
        else:  # another non-spot holder appeared meanwhile: the copy is not needed
            self.table.deliver(node.id, m.DropHostCopy(version=req.version))
        if node.readers:
            # A reader re-announced (after a restart) as still copying from this holder while it
            # offloaded: the holder may not write until that read ends, so it drains again (its
            # host copy, if kept, is published now: the drain ends without a second offload).
            node.state = NodeState.DRAINING
            self.index.mark(node)
            self.table.touched.add(node.key)
            return m.Waiting(version=req.version)
        self._complete_unpublish(node)
        return m.Waiting(version=req.version)

    def _on_HostCopy(self, req: m.HostCopy, now: float) -> m.Reply:
        node = self.nodes[req.client_id]
        if self._own_host_copy(node, req.version):
            return m.Ok()  # listed already (announced, or this report came twice): keep it
        wanted = (not node.spot and not node.host and node.version == req.version and node.state in COMPLETE
                  and req.version in self.retained(node.model)
                  and not self.table.group(node.key).hosts)
        node.copy_asked = -1
        self.index.mark(node)
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
        return f"{owner.id}#host{version}" in self.nodes

    def _add_host_copy(self, owner: Node, version: int, endpoint: bytes) -> None:
        hid = f"{owner.id}#host{version}"
        if hid in self.nodes:
            return
        self._order += 1
        host = Node(
            id=hid, model=owner.model, replica_id=f"{owner.replica_id}#host", shard=owner.shard,
            num_shards=owner.num_shards, datacenter=owner.datacenter, spot=False,
            layout=owner.layout, endpoint=endpoint, order=self._order, host=True, owner=owner.id,
            machine=owner.machine,
        )
        self.nodes[hid] = host
        self._model_nodes[host.model] += 1
        self._model_hosts[host.model] += 1
        self.table.hosts_of.setdefault(owner.id, set()).add(hid)
        self._set_version(host, version, NodeState.PUBLISHED, host.units)
        self._maybe_commit(host)
        log.info("model=%s version=%d shard=%d host copy published by %s", host.model, version, host.shard, owner.id)

    def _announced_host_copy(self, owner: Node, version: int, endpoint: bytes) -> None:
        """A host copy ``owner`` announced after a restart: kept, unless its version is past
        retention already (its ``DropHostCopy`` was lost with the old server): then dropped, at
        the end of the recovery window if the announcement came inside it (until then it drains,
        hidden from new readers, so a reader copying from it under the old server can announce).
        One the server lists already (an announcement while it is up: the handle's liveness
        pulse got no answer) is that same copy, maybe draining under a reader: left as it is."""
        if self._own_host_copy(owner, version):
            return
        if version < self.models[owner.model].forgotten_below and self.table.now < self._recovering_until:
            # Listed, hidden from new readers and freed when the recovery window ends: a reader
            # still copying from it under the old server may not have announced that edge yet.
            self._add_host_copy(owner, version, endpoint)
            self._drain(self.nodes[f"{owner.id}#host{version}"])
            return
        if version < self.models[owner.model].forgotten_below:
            log.info("model=%s version=%d: host copy announced by %s is past retention: dropped",
                     owner.model, version, owner.id)
            self.table.deliver(owner.id, m.DropHostCopy(version=version))
            return
        self._add_host_copy(owner, version, endpoint)

    def _forget_below(self, model: str, floor: int) -> None:
        """Retention's floor rose to ``floor``: host copies of versions under it that were never
        committed (announced after a restart, one shard of a replica only) go too; committed ones
        go through :meth:`_forget`. One look at the model's groups, once per commit that moves it."""
        committed = self.models[model].committed
        for v in sorted({k[1] for k in self.groups if k[0] == model and 0 <= k[1] < floor}):
            if v not in committed:
                self._forget(model, v)

    def _forget(self, model: str, version: int) -> None:
        """A version fell out of retention: its host copies drain and are freed."""
        log.info("model=%s version=%d is past retention", model, version)
        self.models[model].origin_dc.pop(version, None)
        for i in range(self.models[model].num_shards):
            for nid in sorted(self.groups.get((model, version, i), ())):
                host = self.nodes[nid]
                if host.host and host.state is NodeState.PUBLISHED:
                    self._drain(host)

    def _needs_offload(self, node: Node) -> bool:
        """``node`` holds a retained version with no other visible non-spot copy whose process
        proved lately that it is alive (or a datacenter copy to keep)."""
        if node.spot or node.host or node.version not in self.retained(node.model):
            return False
        if self.crossdc.keeps_dc_copy(node):
            return True
        return not any(self._heard_lately(o) for o in self._other_copies(node))

    def _other_copies(self, node: Node) -> Iterator[Node]:
        """The visible non-spot copies of ``node``'s version and shard other than ``node`` (in
        no particular order)."""
        for i in self.groups.get(node.key, ()):
            o = self.nodes[i]
            if o.id != node.id and o.state in VISIBLE_SOURCE and not o.spot:
                yield o

    def _awaits_proof(self, node: Node) -> bool:
        """Drained ``node`` needs an offload, but other copies of its version are vouched for by
        held pulses only: probe their processes (once; the first ``_PROBES_MAX`` by id: one proof
        is enough, and a fleet of idle holders is not woken at every unpublish) and wait until
        ``proof_until``, so that an idle, living fleet does not cost an offload per unpublish.
        True: keep waiting (``tick``, or the proving request, :meth:`_proved`, looks again);
        False: offload now (no doubted copy, or no proof in time). A datacenter copy to keep
        offloads at once."""
        doubted = heapq.nsmallest(_PROBES_MAX, {o.owner if o.host else o.id for o in self._other_copies(node)
                                                if self._attended_only(o)})
        if not doubted or self.crossdc.keeps_dc_copy(node):
            self._end_proof_wait(node)
            return False
        if node.proof_until is None:
            node.proof_until = self.table.now + 2.5 * self.config.heartbeat_interval_s
            for gone in [c for c in self._probing if c not in self.nodes]:
                del self._probing[gone]  # removed without a word since it was probed
            for cid in doubted:
                self._probing.setdefault(cid, set()).add(node.id)
                self.table.deliver(cid, m.Probe())
            log.info("model=%s version=%d shard=%d %s: other copies are held by %s, whose pulses are held: "
                     "probing before the offload is skipped", node.model, node.version, node.shard, node.id, doubted)
            return True
        if self.table.now < node.proof_until:
            return True
        log.info("model=%s version=%d shard=%d %s: no proof from %s: offload", node.model, node.version,
                 node.shard, node.id, doubted)
        self._end_proof_wait(node)
        return False

    def _end_proof_wait(self, node: Node) -> None:
        if node.proof_until is None:
            return
        node.proof_until = None
        for cid in [c for c, waiting in self._probing.items() if node.id in waiting]:
            self._probing[cid].discard(node.id)
            if not self._probing[cid]:
                del self._probing[cid]

    def _proved(self, client_id: str) -> None:
        """``client_id``'s process sent a request of its own: the drains that probed it look again."""
        for nid in sorted(self._probing.pop(client_id, ())):
            node = self.nodes.get(nid)
            if node is not None and node.proof_until is not None and node.state is NodeState.DRAINING and not node.readers:
                self._finish_drain(node)

    def _last_copies(self, node: Node) -> list[int]:
        """Retained versions of which ``node`` (or a host copy it serves) is the last live non-spot
        copy, while clients other than ``node`` remain in its model (else nobody could read them)."""
        if self._model_nodes[node.model] - self._model_hosts[node.model] <= 1:
            return []  # node is the model's only client
        retained = self.retained(node.model)
        mine = [node] + [self.nodes[h] for h in self.table.hosts_of.get(node.id, ())]
        held = set()
        for n in mine:
            if n.spot or n.version not in retained or n.state not in COMPLETE:
                continue
            # A held pulse counts here: a leave cannot wait for a probe, and refusing it whenever
            # the other holders are idle would keep every close() open.
            if not self._other_live_copy(n, owner=node.id, attended=True):
                held.add(n.version)
        return sorted(held)

    def _other_live_copy(self, node: Node, owner: str = "", attended: bool = False) -> bool:
        """Another live non-spot complete copy of ``node``'s version and shard exists (not
        ``node``, nor a host copy served by ``owner``); ``attended``: a held pulse counts as alive
        (see :meth:`_heard_lately`)."""
        for oid in self.groups.get(node.key, ()):
            o = self.nodes[oid]
            if (oid != node.id and o.state in COMPLETE and not o.spot and (not owner or o.owner != owner)
                    and self._heard_lately(o, attended)):
                return True
        return False

    def _heard_lately(self, node: Node, attended: bool = False) -> bool:
        """Whether ``node`` (a host copy: its owner) counts as a live copy for retention: its
        process sent a request of its own within ``2.5 * heartbeat_interval_s`` (``attended``:
        or its pulse is held), not reported failed, not unreachable. A holder that died recently
        is still in the table until its lease runs out, and a held pulse keeps that lease for a
        process that died without Ray knowing yet; counting either would let the last live copy
        go (the version is lost when the ghost expires). A false "silent" costs one extra host
        copy, which is dropped as excess later."""
        owner = self.nodes.get(node.owner) if node.host else node
        if owner is None or owner.unreachable or owner.suspected_at is not None:
            return False
        return self.table.now - (owner.last_seen if attended else owner.heard_at) <= 2.5 * self.config.heartbeat_interval_s

    def _attended_only(self, node: Node) -> bool:
        """``node``'s process is vouched for by a held pulse only (no request of its own lately)."""
        return self._heard_lately(node, attended=True) and not self._heard_lately(node)
