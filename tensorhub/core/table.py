"""The reference table: the state the reference core and its parts share.

:class:`Table` holds the nodes, the models, the index and the registries every part of the core
reads (:class:`tensorhub.core.reference.ReferenceCore`, which owns the table, and its parts,
which get it passed in), plus what one request or tick collects while it runs: its clock, the
groups it touched (pumped when it settles), the events it delivers, the clients it removed and
the datacenters whose offload seeding it re-checks when it settles. Queries, and one
transition: a node's version and state change through :meth:`Table.set_version`, which keeps the
groups, the index and the touched set; every other rule acts through a function of the core or
of a part.
"""

from __future__ import annotations

from typing import Optional

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.index import Group, Index
from tensorhub.core.state import ModelRecord, Node, NodeState

Key = tuple[str, int, int]
"""(model, version, shard): one group of nodes."""
_NO_GROUP = Group()
"""Stands for a group with no node (never written)."""


class Table:
    """The reference core's shared state (see the module docstring). Not thread-safe: the core's
    one driver reaches it through the core."""

    def __init__(self, config: Optional[Config] = None) -> None:
        self.config = config or Config()
        self.nodes: dict[str, Node] = {}
        self.models: dict[str, ModelRecord] = {}
        self.groups: dict[Key, set[str]] = {}
        self.index = Index(self.config.readers_per_source_max)
        """Waiting queues, free sources and counts per group (:mod:`tensorhub.core.index`)."""
        self.classes: dict[str, list[str]] = {}
        """model -> its layout classes' internal model names (:mod:`tensorhub.core.placements`),
        in creation order; the first is usually ``model`` itself."""
        self.replicas: dict[tuple[str, str], set[str]] = {}
        """(model, replica) -> its clients (host copies excluded)."""
        self.hosts_of: dict[str, set[str]] = {}
        """client -> the host copies it serves."""
        self.now = 0.0
        """The clock of the request or tick being applied."""
        self.touched: set[Key] = set()
        """Groups whose queues are looked at again when the request settles."""
        self.effects: list[m.Deliver] = []
        """Events the request or tick delivers."""
        self.removed: set[str] = set()
        """Clients removed during the request or tick: only their ``Evicted`` reaches them."""
        self.reseed: set[tuple[str, str]] = set()
        """(model, datacenter) whose offload seeding is re-checked when the request settles."""

    def begin(self, now: float) -> None:
        """A request or tick starts: its clock; nothing touched, delivered or removed yet."""
        self.effects = []
        self.touched = set()
        self.removed = set()
        self.reseed = set()
        self.now = now

    def group(self, key: Key) -> Group:
        """The index's group of ``key`` (an empty one, never written, if it has no node)."""
        return self.index.group(key) or _NO_GROUP

    def replica_nodes(self, model: str, replica_id: str) -> list[Node]:
        return [self.nodes[i] for i in self.replicas.get((model, replica_id), ())]

    def retained(self, model: str) -> list[int]:
        """Committed versions of ``model`` not yet forgotten (retention), oldest first."""
        mod = self.models.get(model)
        return [] if mod is None else [v for v in mod.committed if v >= mod.forgotten_below]

    def set_version(self, node: Node, version: int, state: NodeState, progress: int) -> None:
        """``node`` holds or receives ``version`` (-1: nothing) in ``state`` with ``progress``
        units: it moves between groups, and the groups it left and joined are touched."""
        if node.version >= 0:
            group = self.groups.get(node.key)
            if group is not None:
                group.discard(node.id)
                if not group:
                    del self.groups[node.key]
            self.touched.add(node.key)
        node.version, node.state, node.progress = version, state, progress
        self.index.mark(node)
        if version >= 0:
            self.groups.setdefault(node.key, set()).add(node.id)
            self.touched.add(node.key)

    def deliver(self, client_id: str, event: m.Event) -> None:
        self.effects.append(m.Deliver(client_id=client_id, event=event))

    def take_effects(self) -> list[m.Deliver]:
        """The events delivered so far, handed over once (the list starts empty again)."""
        effects, self.effects = self.effects, []
        return effects
