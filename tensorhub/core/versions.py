"""Versions: specs parsed and resolved, and :class:`Versions`, the part of the reference core that
commits versions and says which are available.

Rules (docs/design.md, section 1, rule 1): a version is *committed* once every shard of one
replica holds it complete (host copies count for their owner's replica); only committed,
retained versions with a visible holder of every shard are *available* to version specs; the
newest ``versions_retained`` committed versions are kept, older ones forgotten (retention frees
their host copies); a committed version of which some shard has no node left is lost. During
the recovery window after a restart a spec that finds nothing, or finds only host copies of the
newest version, waits (``ServerRecovering``): holders are still re-announcing. An exact version
that is not available but that every replica publishing it cannot complete (a shard without a
client) is ``VersionStalled``, a ``VersionNotFound`` that tells its reader not to wait for good
(:meth:`Versions.stalled`).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Sequence, Union

from tensorhub.core import messages as m
from tensorhub.core.placements import logical, shown
from tensorhub.core.state import COMPLETE, SERVABLE, VISIBLE_SOURCE, Node, NodeState
from tensorhub.core.table import Table
from tensorhub.errors import (BadVersionSpec, ServerRecovering, UnknownModel, VersionExpired, VersionNotFound,
                              VersionStalled)

log = logging.getLogger("tensorhub.core.reference")


def parse_spec(spec: Union[int, str]) -> tuple[str, int]:
    """``7`` -> ("exact", 7); ``"latest"`` -> ("latest", 0); ``"latest-2"`` -> ("latest", 2)."""
    if isinstance(spec, bool):
        raise BadVersionSpec(f"version spec {spec!r} is a bool")
    if isinstance(spec, int):
        if spec < 0:
            raise BadVersionSpec(f"version {spec} is negative")
        return ("exact", spec)
    if isinstance(spec, str):
        s = spec.strip()
        if s == "latest":
            return ("latest", 0)
        if s.startswith("latest-"):
            tail = s[len("latest-"):]
            if tail.isdigit():
                return ("latest", int(tail))
    raise BadVersionSpec(f"version spec {spec!r} is not an int >= 0, 'latest' or 'latest-k'")


def resolve(spec: Union[int, str], model: str, available: Sequence[int], expired_below: int) -> int:
    """Resolve ``spec`` against ``available`` (ascending). ``expired_below``: versions under it
    were forgotten (``VersionExpired``); anything else missing is ``VersionNotFound``."""
    kind, n = parse_spec(spec)
    if kind == "exact":
        if n in available:
            return n
        if n < expired_below:
            raise VersionExpired(f"{model}: version {n} is past retention (oldest kept {expired_below})")
        raise VersionNotFound(f"{model}: version {n} is not available (available: {list(available)})")
    if n >= len(available):
        raise VersionNotFound(f"{model}: {spec!r} asks for the {n}-th newest of {len(available)} available versions")
    return available[-1 - n]


class Versions:
    """Commits and resolution (see the module docstring): a part of the reference core. It reads
    the shared :class:`~tensorhub.core.table.Table`, writes its models' committed versions, and
    acts through the functions it is given: ``seed_remote`` (offload seeding of a model's newest
    version, :meth:`~tensorhub.core.crossdc.CrossDatacenter.seed_remote`), ``smart_skip``
    (:meth:`~tensorhub.core.crossdc.CrossDatacenter.smart_skip`), ``forget`` and
    ``forget_below`` (retention of versions past the retained ones), ``nodes_in`` (a model's
    nodes), ``recovering_until`` (the end of the core's recovery window)."""

    def __init__(self, table: Table, *, seed_remote: Callable[[str], None],
                 smart_skip: Callable[[Node, list[int]], object], forget: Callable[[str, int], None],
                 forget_below: Callable[[str, int], None], nodes_in: Callable[[str], int],
                 recovering_until: Callable[[], float]) -> None:
        self.table = table
        self._seed_remote = seed_remote
        self._smart_skip = smart_skip
        self._forget = forget
        self._forget_below = forget_below
        self._nodes_in = nodes_in
        self._recovering_until = recovering_until

    def available(self, model: str) -> list[int]:
        """Committed, retained versions with a visible complete holder of every shard."""
        mod = self.table.models.get(model)
        if mod is None:
            return []
        out = []
        for v in mod.committed:
            if v < mod.forgotten_below:
                continue
            if all(self._has_visible(model, v, i) for i in range(mod.num_shards)):
                out.append(v)
        return out

    def available_all(self, model: str) -> list[int]:
        """:meth:`available` over every layout class of ``model``'s model (ascending): what a
        version spec resolves against, since a reader of one class reads a version another
        class holds by a resharded read (:mod:`tensorhub.core.placements`)."""
        classes = self.table.classes.get(logical(model)) or [model]
        if len(classes) == 1:
            return self.available(classes[0])
        return sorted(set().union(*(self.available(c) for c in classes)))

    def _has_visible(self, model: str, version: int, shard: int) -> bool:
        """A source now, or one about to publish a host copy (OFFLOADING): a reader resolving
        to such a version waits a moment for the copy instead of failing."""
        g = self.table.group((model, version, shard))
        return any(g.counts[s] for s in SERVABLE)

    def maybe_commit(self, node: Node) -> None:
        """Commit ``node``'s version once every shard of its replica holds it complete and visible.
        Host copies count for their owner's replica: only a committed version is ever offloaded,
        so after a restart they bring its commit back (the replica's GPU copies may have moved on).
        A draining or offloading shard still holds its version whole and counts too: after a
        restart a holder re-announces and at once re-sends the unpublish it had in flight, before
        its siblings announce; left out, the version would never commit again, so its drains
        would end without the offload that keeps it."""
        nodes = self.table.nodes
        mod = self.table.models[node.model]
        v = node.version
        if v in mod.committed:
            return
        owner = nodes.get(node.owner) if node.host else node
        if owner is None:
            return
        replica = owner.replica_id
        covered = set()
        for shard in range(mod.num_shards):  # the holders of v before it commits: a few
            for i in self.table.groups.get((node.model, v, shard), ()):
                n = nodes[i]
                if n.state not in COMPLETE:
                    continue
                n_owner = nodes.get(n.owner) if n.host else n
                if n_owner is not None and n_owner.replica_id == replica:
                    covered.add(n.shard)
        if len(covered) == mod.num_shards:
            self.commit(node.model, v, replica)

    def commit(self, model: str, v: int, by: str) -> None:
        """Replica ``by`` holds every shard of ``v``: ``v`` is committed (unless already
        forgotten), remote datacenters are seeded, versions past retention forgotten."""
        mod = self.table.models[model]
        if v < mod.forgotten_below:
            return
        mod.committed.append(v)
        mod.committed.sort()
        replica = self.table.replica_nodes(model, by)
        if replica:
            mod.origin_dc[v] = replica[0].datacenter
        log.info("model=%s version=%d committed by replica %s", model, v, by)
        self._seed_remote(model)
        keep = self.table.config.versions_retained
        if len(mod.committed) > keep:
            mod.forgotten_below = max(mod.forgotten_below, mod.committed[-keep])
            for old in [c for c in mod.committed if c < mod.forgotten_below]:
                mod.committed.remove(old)
                self._forget(model, old)
            self._forget_below(model, mod.forgotten_below)

    def drop_lost(self, keys: Iterable[tuple[str, int, int]]) -> None:
        """A committed version of which some shard has no node left at all can never be read
        again: it stops counting toward retention, so the newest versions still held stay
        available (a trainer that dies right after publishing does not push out the version
        every rollout holds). ``keys``: the groups a request touched."""
        for model, version in sorted({(k[0], k[1]) for k in keys if k[1] >= 0}):
            mod = self.table.models.get(model)
            if mod is None or version not in mod.committed:
                continue
            if any(not self.table.groups.get((model, version, i)) for i in range(mod.num_shards)):
                mod.committed.remove(version)
                log.info("model=%s version=%d lost: no holder of some shard is left", model, version)

    def resolve(self, node: Node, spec: m.VersionSpec) -> int:
        """The version ``spec`` names for ``node`` now (outside any round of its replica)."""
        table = self.table
        recovering = table.now < self._recovering_until()
        try:
            version = self.resolve_now(node, spec)
        except (VersionNotFound, UnknownModel, VersionExpired) as err:
            if recovering:
                raise ServerRecovering(f"{err} (holders are still re-announcing after a server restart)") from None
            raise
        if (recovering and not isinstance(spec, int)
                and version == max(self.available_all(node.model))
                and not any(table.nodes[i].state in VISIBLE_SOURCE and not table.nodes[i].host
                            for i in table.groups.get((node.model, version, node.shard), ()))):
            # The newest version known is held by host copies alone: those are retained older
            # versions, so the holders of the newer ones have not re-announced yet.
            raise ServerRecovering(f"{node.model}: newest known version {version} is held by host copies only "
                                   f"(holders are still re-announcing after a server restart)")
        return version

    def resolve_now(self, node: Node, spec: m.VersionSpec) -> int:
        """:meth:`resolve` without the recovery window's waits (smart skipping applies)."""
        table = self.table
        mod = table.models[node.model]
        avail = self.available_all(node.model)
        kind, k = parse_spec(spec)
        if kind == "latest" and k == 0 and table.config.smart_skipping and avail:
            skipped = self._smart_skip(node, avail)
            if skipped is not None:
                node.in_flight = skipped[1]
                return skipped[0]
        classes = table.classes.get(logical(node.model)) or [node.model]
        others = sum(self._nodes_in(c) for c in classes) - len(table.replicas.get((node.model, node.replica_id), ()))
        if not avail and not mod.committed and not others:
            raise UnknownModel(f"{logical(node.model)}: no other replica of this model is registered")
        try:
            return resolve(spec, shown(node.model), avail, mod.forgotten_below)
        except VersionNotFound as err:
            stalled = self.stalled(node.model, k) if kind == "exact" and type(err) is VersionNotFound else ""
            if stalled:
                raise VersionStalled(f"{err}; it cannot become available: {stalled}") from None
            raise

    def stalled(self, model: str, version: int) -> str:
        """Why ``version`` of ``model``'s model cannot become available as things stand, or ""
        (it may: nobody publishes it yet, or some replica that publishes it has every shard
        registered). Stalled: every replica (of any layout class) that publishes it from some
        shards lacks a client for another shard (not registered yet, or it left or died before
        publishing): "replica trainer publishes it from shard(s) [0] of 2; shard(s) [1] have no
        client". Cost: the version's groups and its publishers' replicas."""
        table = self.table
        said = []
        for cls in table.classes.get(logical(model)) or [model]:
            mod = table.models.get(cls)
            if mod is None:
                continue
            publishers: dict[str, set[int]] = {}
            for k in range(mod.num_shards):
                for nid in table.groups.get((cls, version, k), ()):
                    n = table.nodes[nid]
                    if not n.host and n.state is NodeState.PUBLISHED:
                        publishers.setdefault(n.replica_id, set()).add(k)
            for replica in sorted(publishers):
                registered = {n.shard for n in table.replica_nodes(cls, replica)}
                absent = sorted(set(range(mod.num_shards)) - registered)
                if not absent:
                    return ""
                said.append(f"replica {replica} publishes it from shard(s) {sorted(publishers[replica])} of "
                            f"{mod.num_shards}; shard(s) {absent} have no client")
        return "; ".join(said)
