"""Members: who is registered with the reference core, and in what order it last heard from them.

A part of :class:`tensorhub.core.reference.ReferenceCore`: :class:`Members` adds nodes to and
takes them out of the shared :class:`~tensorhub.core.table.Table` (clients and host copies) and
owns the registries that spare every request a scan of it:

- (model, replica, shard) -> the client holding that shard (a second client for a taken shard
  is refused, ``ShardTaken``);
- per model, its nodes and its host copies (a model with no node left is forgotten);
- the clients in the order they were last heard from, oldest first (``seen``): ``now`` never
  decreases, so moving a client to the end on each request keeps the order sorted, and lease
  expiry (:meth:`Members.lease_expired`) and the liveness questions the server asks
  (:meth:`Members.overdue`) walk it from its oldest end and stop at the first current one;
- the registration order (``Node.order``: ties in scheduling, and :attr:`Members.registrations`
  for caches of the clients' processes).

Registration is validated before anything changes (:meth:`Members.check`): shard in range, a
layout with units, the model's shard count and each shard's layout fingerprint, and a placement's
rules (:mod:`tensorhub.core.placements`).
"""

from __future__ import annotations

import collections
from typing import Callable

from tensorhub.core import messages as m
from tensorhub.core.placements import Placements, logical
from tensorhub.core.state import ModelRecord, Node
from tensorhub.core.table import Table
from tensorhub.errors import LayoutMismatch, ShardTaken


class Members:
    """Registered clients and host copies (see the module docstring): a part of the reference
    core. It writes the table's ``nodes``, ``models``, ``replicas`` and ``hosts_of`` and tells the
    other parts through the functions it is given: ``replica_changed`` (a replica's membership
    changed: offload seeding's candidate seeders, :class:`~tensorhub.core.crossdc.SeedCandidates`),
    ``replica_back`` and ``replica_gone`` (a replica's first client came back, its last one
    left: the round table keeps a departed replica's rounds for a bounded time)."""

    def __init__(self, table: Table, *, replica_changed: Callable[[str, str, int], None],
                 replica_back: Callable[[str, str], None], replica_gone: Callable[[str, str, float], None],
                 placements: Placements) -> None:
        self.table = table
        self._placements = placements
        """Registered placements (:mod:`tensorhub.core.placements`): checked with a registration,
        kept while their clients stay."""
        self._replica_changed = replica_changed
        self._replica_back = replica_back
        self._replica_gone = replica_gone
        self._order = 0
        self._shards: dict[tuple[str, str, int], str] = {}
        """(model, replica, shard) -> the client holding that shard (host copies excluded)."""
        self._model_nodes: collections.Counter = collections.Counter()
        """model -> nodes (host copies included)."""
        self._model_hosts: collections.Counter = collections.Counter()
        """model -> host copies."""
        self._lease: dict[str, None] = {}
        """Clients (host copies excluded) in the order they were last heard from, oldest first."""
        self._clients: dict[str, dict[str, None]] = {}
        """model -> its clients (host copies excluded), in registration order."""

    @property
    def registrations(self) -> int:
        """Grows with every client (and host copy) added."""
        return self._order

    def nodes_in(self, model: str) -> int:
        """Nodes of ``model``, host copies included."""
        return self._model_nodes[model]

    def clients_in(self, model: str) -> int:
        """Clients of ``model`` (host copies excluded)."""
        return self._model_nodes[model] - self._model_hosts[model]

    def clients_of(self, model: str) -> list[str]:
        """The clients of ``model`` (host copies excluded), in registration order."""
        return list(self._clients.get(model, ()))

    def check(self, req: m.Register) -> str:
        """Raise if ``req`` cannot register (nothing changes either way); else the layout class
        it registers in (an internal model name, :meth:`Placements.class_of`)."""
        if req.num_shards < 1 or not 0 <= req.shard < req.num_shards:
            raise LayoutMismatch(f"shard {req.shard} of {req.num_shards} is out of range")
        if req.layout.unit_count < 1:
            raise LayoutMismatch(f"{req.model}: a layout needs at least one transfer unit")
        cls = self._placements.class_of(req)
        mod = self.table.models.get(cls)
        if mod is not None:
            keyed = f" (layout key {req.layout_key!r})" if req.layout_key and mod.layout_key == req.layout_key else ""
            if mod.num_shards != req.num_shards:
                raise LayoutMismatch(f"{req.model}{keyed} has {mod.num_shards} shards per replica, not {req.num_shards}")
            known = mod.layouts.get(req.shard)
            if known is not None and (known.fingerprint, known.unit_count) != (req.layout.fingerprint, req.layout.unit_count):
                raise LayoutMismatch(f"{req.model}{keyed} shard {req.shard}: {_first_difference(known, req.layout)}")
        holder = self._shards.get((req.model, req.replica_id, req.shard))
        if holder is not None:
            raise ShardTaken(f"{req.model} replica {req.replica_id} shard {req.shard} is held by client {holder}")
        self._placements.check(req, cls)
        return cls

    def add(self, req: m.Register, now: float, cls: str) -> Node:
        """A client registers (checked by :meth:`check` first, which named its layout class
        ``cls``): an IDLE node of that class."""
        table = self.table
        mod = table.models.get(cls)
        if mod is None:
            mod = table.models[cls] = ModelRecord(cls, req.num_shards)
            table.classes.setdefault(req.model, []).append(cls)
        mod.layouts.setdefault(req.shard, req.layout)
        mod.layout_key = mod.layout_key or req.layout_key
        self._order += 1
        node = Node(
            id=req.client_id, model=cls, replica_id=req.replica_id, shard=req.shard,
            num_shards=req.num_shards, datacenter=req.datacenter, spot=req.spot, retains=req.retains,
            layout=req.layout, endpoint=req.endpoint, order=self._order, last_seen=now, heard_at=now,
            process=req.process, machine=req.machine, stage_for=req.stage_for, layout_key=req.layout_key,
        )
        self._placements.add(node, req.placement)
        table.nodes[node.id] = node
        self._shards[(req.model, node.replica_id, node.shard)] = node.id
        table.replicas.setdefault((node.model, node.replica_id), set()).add(node.id)
        self._replica_changed(node.model, node.replica_id, node.num_shards)
        self._replica_back(node.model, node.replica_id)
        self._model_nodes[node.model] += 1
        self._lease[node.id] = None
        self._clients.setdefault(node.model, {})[node.id] = None
        table.index.mark(node)
        return node

    def move_class(self, src: str, dst: str) -> list[Node]:
        """Every client of layout class ``src`` (idle, at no version, with no host copy: the
        caller checked) moves to class ``dst`` (:meth:`Placements.earlier_fit`); ``src`` is
        left without nodes (:meth:`forget_empty_models` forgets it). The moved nodes."""
        table = self.table
        moved = [table.nodes[cid] for cid in self._clients.pop(src, {})]
        replicas = sorted({n.replica_id for n in moved})
        for n in moved:
            table.index.drop(n)
            ids = table.replicas[(src, n.replica_id)]
            ids.discard(n.id)
            if not ids:
                del table.replicas[(src, n.replica_id)]
            n.model = dst
            table.replicas.setdefault((dst, n.replica_id), set()).add(n.id)
            self._clients.setdefault(dst, {})[n.id] = None
            self._placements.moved(n, src)
            table.index.mark(n)
        self._model_nodes[src] -= len(moved)
        self._model_nodes[dst] += len(moved)
        for rid in replicas:
            shards = moved[0].num_shards
            self._replica_changed(src, rid, shards)
            self._replica_changed(dst, rid, shards)
            self._replica_back(dst, rid)
        return moved

    def add_host(self, owner: Node, version: int, endpoint: bytes) -> Node:
        """``owner``'s host copy of ``version`` as a node of its own (``<owner>#host<version>``,
        IDLE: the caller publishes it), with ``owner``'s layout and placement (its bytes are laid
        out as the owner's: readers of other layouts reshard from it as from the owner)."""
        self._order += 1
        host = Node(
            id=f"{owner.id}#host{version}", model=owner.model, replica_id=f"{owner.replica_id}#host",
            shard=owner.shard, num_shards=owner.num_shards, datacenter=owner.datacenter, spot=False,
            layout=owner.layout, endpoint=endpoint, order=self._order, host=True, owner=owner.id,
            machine=owner.machine, placement=owner.placement,
        )
        self.table.nodes[host.id] = host
        self._model_nodes[host.model] += 1
        self._model_hosts[host.model] += 1
        self.table.hosts_of.setdefault(owner.id, set()).add(host.id)
        return host

    def registration_of(self, n: Node) -> m.Register:
        """The ``Register`` that made ``n`` (a repeated one is answered as the first was)."""
        return m.Register(
            client_id=n.id, model=logical(n.model), replica_id=n.replica_id, shard=n.shard,
            num_shards=n.num_shards, layout=n.layout, endpoint=n.endpoint,
            datacenter=n.datacenter, spot=n.spot, retains=n.retains, process=n.process, machine=n.machine,
            stage_for=n.stage_for, placement=self._placements.get(n.placement), layout_key=n.layout_key,
        )

    def forget(self, node: Node) -> None:
        """Take ``node`` (IDLE by now) out of the table and every registry."""
        table = self.table
        del table.nodes[node.id]
        table.index.drop(node)
        self._model_nodes[node.model] -= 1
        if node.host:
            self._model_hosts[node.model] -= 1
            hosts = table.hosts_of.get(node.owner)
            if hosts is not None:
                hosts.discard(node.id)
                if not hosts:
                    del table.hosts_of[node.owner]
            return
        del self._shards[(logical(node.model), node.replica_id, node.shard)]
        self._placements.drop(node)
        replica = table.replicas[(node.model, node.replica_id)]
        replica.discard(node.id)
        if not replica:
            del table.replicas[(node.model, node.replica_id)]
            self._replica_gone(node.model, node.replica_id, table.now)
        self._replica_changed(node.model, node.replica_id, node.num_shards)
        del self._lease[node.id]
        clients = self._clients[node.model]
        del clients[node.id]
        if not clients:
            del self._clients[node.model]

    def forget_empty_models(self) -> None:
        """Models with no node left are forgotten."""
        for name in [k for k in self.table.models if not self._model_nodes[k]]:
            del self.table.models[name]
            classes = self.table.classes[logical(name)]
            classes.remove(name)
            if not classes:
                del self.table.classes[logical(name)]
            self._model_nodes.pop(name, None)
            self._model_hosts.pop(name, None)

    def seen(self, node: Node, now: float) -> None:
        """``node`` was heard from at ``now``: it moves to the end of the lease order."""
        node.last_seen = now
        self._lease.pop(node.id, None)
        self._lease[node.id] = None

    def lease_expired(self, now: float, lease_s: float) -> list[Node]:
        """Clients silent for more than ``lease_s``, oldest first. Cost: those clients."""
        out = []
        for cid in self._lease:  # oldest first: stop at the first one still within its lease
            n = self.table.nodes[cid]
            if now - n.last_seen <= lease_s:
                break
            out.append(n)
        return out

    def overdue(self, now: float, after_s: float, limit: int = 256) -> list[str]:
        """Clients not heard from for ``after_s`` (oldest first, at most ``limit``; host copies
        excluded)."""
        out = []
        for cid in self._lease:
            n = self.table.nodes.get(cid)
            if n is None:
                continue
            if now - n.last_seen < after_s or len(out) >= limit:
                break
            if not n.host:
                out.append(cid)
        return out


def _first_difference(a: m.LayoutInfo, b: m.LayoutInfo) -> str:
    for i, (x, y) in enumerate(zip(a.tensors, b.tensors)):
        if x != y:
            return f"tensor #{i} is {y.name} {y.dtype}{list(y.shape)}, the model has {x.name} {x.dtype}{list(x.shape)}"
    if len(a.tensors) != len(b.tensors):
        return f"{len(b.tensors)} tensors, the model has {len(a.tensors)}"
    if a.unit_count != b.unit_count:
        return f"{b.unit_count} transfer units, the model has {a.unit_count} (unit_bytes differs?)"
    return f"layout fingerprint {b.fingerprint[:12]} differs from the model's {a.fingerprint[:12]}"
