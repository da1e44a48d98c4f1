"""Replicate rounds of sharded replicas: the round table, indexed by replica and bounded in time,
and :class:`Rounds`, the part of the reference core that keeps rounds transactions.

``(model, replica, seq) -> (spec, version, shards that took it)``: the first shard of a replica
to replicate in round ``seq`` resolves the spec, its siblings in that round get the same
version (:meth:`Rounds.resolve`). The table is a mapping with that key, as before,
plus two things the core needs so that no request scans it:

- **By replica** (:meth:`RoundTable.of`): a replica's rounds without walking every replica's
  (a ``Register`` asks for its replica's newest round, a new round drops its replica's older
  ones). Each operation costs O(the replica's rounds), one or two.
- **Departed replicas are forgotten.** While a replica has no registered client its rounds stay,
  so that members that come back (evicted and re-announcing, or restarted while a sibling
  re-announces) count on from them -- but not forever: they are dropped once the replica has
  been gone for :data:`DEPARTED_ROUNDS_LEASES` leases (``prune``, called by the core's tick),
  or at once when more than :data:`DEPARTED_ROUNDS_MAX` departed replicas are kept (oldest
  departure first). A replica that registers a client again before that keeps its rounds.

What a shard of a forgotten replica gets: ``Registered(round_seq=0)``, as a new replica -- its
first replicate starts round 1. Its siblings, restarted as well, do the same, so the replica
stays in step. A sibling that was alive all along (evicted for longer than the bound) brings
its round back in its ``Announce`` (``txn_seq``), which restores the entry; a fresh shard that
registered before that announcement counts from 0 (the best effort of :meth:`Rounds.rounds_done`: only
the caller knows for sure, ``replicate(..., round=)``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Optional

from tensorhub.core import messages as m
from tensorhub.core.state import COMPLETE, NodeState
from tensorhub.errors import ReplicaIncomplete, ServerRecovering, TransactionMismatch, VersionLost

log = logging.getLogger("tensorhub.core.reference")

Key = tuple[str, str, int]
Txn = tuple[object, int, set[int]]

DEPARTED_ROUNDS_LEASES = 10
"""A departed replica's rounds are kept this many ``lease_timeout_s`` after its last client left."""
DEPARTED_ROUNDS_MAX = 4096
"""At most this many departed replicas keep their rounds (the oldest departure goes first)."""

_NONE: Mapping[int, Txn] = {}


class RoundTable(MutableMapping):
    """``(model, replica, seq) -> Txn``, indexed by replica (see the module docstring)."""

    def __init__(self, kept_s: float, kept_max: int = DEPARTED_ROUNDS_MAX) -> None:
        assert kept_s >= 0 and kept_max >= 0
        self.kept_s = kept_s
        self.kept_max = kept_max
        self._by: dict[tuple[str, str], dict[int, Txn]] = {}
        self._len = 0
        self._departed: dict[tuple[str, str], float] = {}
        """Replicas with rounds and no client, by departure time (insertion order: ascending,
        since the core's ``now`` never decreases)."""

    # ------------------------------------------------------------------ the mapping

    def __getitem__(self, key: Key) -> Txn:
        return self._by[key[:2]][key[2]]

    def __setitem__(self, key: Key, txn: Txn) -> None:
        rounds = self._by.setdefault(key[:2], {})
        if key[2] not in rounds:
            self._len += 1
        rounds[key[2]] = txn

    def __delitem__(self, key: Key) -> None:
        rounds = self._by[key[:2]]
        del rounds[key[2]]
        self._len -= 1
        if not rounds:
            del self._by[key[:2]]
            self._departed.pop(key[:2], None)

    def __iter__(self) -> Iterator[Key]:
        for (model, replica), rounds in list(self._by.items()):
            for seq in list(rounds):
                yield (model, replica, seq)

    def __len__(self) -> int:
        return self._len

    # ------------------------------------------------------------------ by replica

    def of(self, model: str, replica: str) -> Mapping[int, Txn]:
        """The replica's rounds, ``seq -> Txn`` (read only; empty when it has none)."""
        return self._by.get((model, replica), _NONE)

    def drop_before(self, model: str, replica: str, seq: int) -> None:
        """Older rounds of the replica are finished once round ``seq`` starts."""
        for old in [s for s in self.of(model, replica) if s < seq]:
            del self[(model, replica, old)]

    # ------------------------------------------------------------------ departed replicas

    def departed(self, model: str, replica: str, now: float) -> None:
        """The replica's last client left at ``now``: its rounds are forgotten within the bound."""
        if (model, replica) not in self._by:
            return
        self._departed.pop((model, replica), None)
        self._departed[(model, replica)] = now
        while len(self._departed) > self.kept_max:
            self._forget(next(iter(self._departed)))

    def returned(self, model: str, replica: str) -> None:
        """A client of the replica registered again: its rounds stay."""
        self._departed.pop((model, replica), None)

    def prune(self, now: float) -> None:
        """Forget the rounds of replicas departed more than ``kept_s`` before ``now``. Cost: the
        replicas forgotten (the oldest departure first; stops at the first one kept)."""
        while self._departed:
            replica, at = next(iter(self._departed.items()))
            if now - at <= self.kept_s:
                return
            self._forget(replica)

    def departed_count(self) -> int:
        """Departed replicas whose rounds are still kept."""
        return len(self._departed)

    def _forget(self, replica: tuple[str, str]) -> None:
        del self._departed[replica]
        self._len -= len(self._by.pop(replica, _NONE))


class Rounds:
    """Replicate rounds of sharded replicas as transactions: a part of the reference core
    (docs/design.md, section 1, rules 2 and 6). It owns the round table (:attr:`txns`) and the
    completions held back in the recovery window after a restart (:attr:`held_back`), reads the
    shared :class:`~tensorhub.core.table.Table`, and acts through the functions of the core it
    is given: ``resolve`` (a version spec for one node, outside any round), ``available`` (a
    model's available versions), ``stop_reading`` (a demoted completion stops), ``describe``
    (names a node in errors), ``recovering_until`` (the end of the recovery window).

    Rules: the first shard of a replica to replicate in round ``seq`` resolves the spec; its
    siblings in that round get the same version (:meth:`resolve`). After a restart a round is
    known from its shards' announcements (:meth:`announced`); a completion announced at another
    version than a sibling's is refused unless the old server confirmed it
    (:meth:`conflicting_completion`), and within the recovery window an unconfirmed completion,
    or a read in a round known only from announcements, waits until every sibling has been heard
    from (:meth:`holds_back`, :meth:`unsettled`)."""

    def __init__(self, table, *, resolve, available, stop_reading, describe, recovering_until) -> None:
        self.table = table
        self.txns = RoundTable(DEPARTED_ROUNDS_LEASES * table.config.lease_timeout_s)
        """(model, replica, seq) -> (spec, version, shards that took it); by replica, and a
        departed replica's are forgotten within a bound."""
        self.held_back: dict[str, tuple[str, str, int]] = {}
        """Client -> (model, replica, shard) of an unconfirmed sharded completion held back in the
        recovery window (:meth:`holds_back`); it counts as heard from for its siblings."""
        self._resolve = resolve
        self._available = available
        self._stop_reading = stop_reading
        self._describe = describe
        self._recovering_until = recovering_until

    def rounds_done(self, model: str, replica_id: str, shard: int) -> int:
        """The rounds of this shard's replica that a (restarted) process of this shard counts as
        behind it: its first replicate joins the newest round while a sibling is still reading in
        it, else starts the next one. A best effort: only the caller knows for sure which round a
        restarted process is in (``replicate(..., round=)``)."""
        rounds = self.txns.of(model, replica_id)
        if not rounds:
            return 0
        newest = max(rounds)
        version = rounds[newest][1]
        inside = any(n.shard != shard and n.state in (NodeState.WAITING, NodeState.READING) and n.version == version
                     for n in self.table.replica_nodes(model, replica_id))
        return newest - 1 if inside else newest

    def resolve(self, node, req) -> int:
        """The version of ``node``'s ``Replicate`` in its round (``req.seq``): the first shard
        resolves, its siblings get the same version. A retry after the round's version was lost
        re-resolves the round unless a sibling still holds or receives that version."""
        if node.num_shards == 1:
            return self._resolve(node, req.spec)
        key = (node.model, node.replica_id, req.seq)
        txn = self.txns.get(key)
        if txn is None:
            present = len(self.table.replicas.get((node.model, node.replica_id), ()))
            if present < node.num_shards:
                # After a restart a sibling may not have re-announced the version it got in this
                # round yet; resolving now could split the transaction.
                raise ReplicaIncomplete(f"{node.model} replica {node.replica_id}: only {present} of "
                                        f"{node.num_shards} shards are registered; retry")
            version = self._resolve(node, req.spec)
            self.txns[key] = (req.spec, version, {node.shard})
            # Older rounds of this replica are finished once a newer one starts.
            self.txns.drop_before(node.model, node.replica_id, req.seq)
            return version
        spec, version, consumed = txn
        if self.unsettled(node, spec):
            # Reading on now could split the transaction.
            raise ServerRecovering(f"{node.model} replica {node.replica_id} round {req.seq}: siblings of shard "
                                   f"{node.shard} are still re-announcing; retry")
        if spec != "announced" and spec != req.spec:
            raise TransactionMismatch(
                f"{node.model} replica {node.replica_id} round {req.seq}: shard {node.shard} asked {req.spec!r}, "
                f"another shard asked {spec!r}"
            )
        if (not isinstance(req.spec, int) and node.shard in consumed
                and not self._version_held(node, version)
                and not self._consumer_unaccounted(node, consumed)):
            # A retry in this round after its version was lost: re-resolve the round, unless a
            # sibling already holds (or receives) that version -- then the retry fails with
            # VersionLost and the next round realigns the replica.
            version = self._resolve(node, req.spec)
            consumed = {node.shard}
            self.txns[key] = (spec, version, consumed)
            return version
        consumed.add(node.shard)
        return version

    def of_read(self, node) -> Optional[Txn]:
        """The round ``node``'s read belongs to (None: not a sharded replica, or not known)."""
        return self.txns.get((node.model, node.replica_id, node.round_seq)) if node.num_shards > 1 else None

    def announced(self, node, hold) -> None:
        """``node`` announced ``hold`` after a restart: the round it names is known from it. A
        shard that completed its round binds it; siblings that announced another version were
        still reading one the round had moved away from (it was lost and the round re-resolved
        before the restart): their read fails, their retry joins."""
        if hold.txn_seq < 0 or node.num_shards <= 1:
            return
        key = (node.model, node.replica_id, hold.txn_seq)
        txn = self.txns.get(key)
        completed = hold.published is not None and hold.published == hold.txn_version
        if txn is None or (completed and txn[1] != hold.txn_version and not self._round_completed(node, txn)):
            txn = self.txns[key] = ("announced", hold.txn_version, set())
        if txn[1] == hold.txn_version:
            txn[2].add(node.shard)

    def holds_back(self, reg, hold, now: float) -> bool:
        """Whether an unconfirmed completion of a sharded round waits (``ServerRecovering``):
        inside the recovery window, until every sibling shard of its replica has been heard
        from. A confirmed sibling completion of another version announced after it would demote
        it, but by then the caller's ``replicate()`` had already returned; held back, it meets
        that sibling first and is refused instead (:meth:`conflicting_completion`)."""
        if (hold.confirmed or hold.published is None or hold.txn_seq < 0 or reg.num_shards <= 1
                or hold.published != hold.txn_version or now >= self._recovering_until()):
            return False
        return bool(self.unheard_shards(reg.model, reg.replica_id, reg.num_shards) - {reg.shard})

    def hold_back(self, reg) -> None:
        """``reg``'s completion waits (:meth:`holds_back` said so); meanwhile its shard counts as
        heard from for its siblings."""
        self.held_back[reg.client_id] = (reg.model, reg.replica_id, reg.shard)

    def release(self, client_id: Optional[str] = None) -> None:
        """``client_id``'s completion is held back no more (None: none is, the window is over)."""
        if client_id is None:
            self.held_back.clear()
        else:
            self.held_back.pop(client_id, None)

    def unsettled(self, node, spec: object) -> bool:
        """Inside the recovery window, ``node``'s round is known only from announcements
        (``spec == "announced"``) and a sibling has not re-announced yet: it may bring the old
        server's confirmed completion of the round at another version, which binds the round."""
        return (spec == "announced" and self.table.now < self._recovering_until()
                and bool(self.unheard_shards(node.model, node.replica_id, node.num_shards) - {node.shard}))

    def unheard_shards(self, model: str, replica_id: str, num_shards: int) -> set[int]:
        """Shards of a replica that neither registered/announced nor wait held back."""
        heard = {n.shard for n in self.table.replica_nodes(model, replica_id)}
        heard.update(shard for mod, rid, shard in self.held_back.values() if (mod, rid) == (model, replica_id))
        return set(range(num_shards)) - heard

    def conflicting_completion(self, node, hold) -> Optional[VersionLost]:
        """An announced completion of round ``hold.txn_seq`` at a version other than the one a
        sibling shard already completed in that round (each shard's ``ReplicateDone`` met the
        restart, one of them after the old server had failed its read and moved the round):
        an unconfirmed one is refused (returned); a confirmed one demotes siblings whose
        completions were all unconfirmed (they lose to it) and is accepted."""
        if (hold.published is None or hold.txn_seq < 0 or node.num_shards <= 1
                or hold.published != hold.txn_version):
            return None
        txn = self.txns.get((node.model, node.replica_id, hold.txn_seq))
        if txn is None or txn[1] == hold.published:
            return None
        _, version, consumed = txn
        rivals = [n for n in self.table.replica_nodes(node.model, node.replica_id)
                  if n.id != node.id and n.shard in consumed and n.version == version and n.state in COMPLETE]
        if not rivals:
            return None
        where = (f"{self._describe(node)}: round {hold.txn_seq} of replica {node.replica_id} completed version "
                 f"{version} on shard {min(n.shard for n in rivals)}")
        if not hold.confirmed:
            return VersionLost(f"{where}; this unconfirmed completion of version {hold.published} is refused")
        if all(n.unconfirmed == (hold.txn_seq, version) for n in rivals):
            for n in sorted(rivals, key=lambda n: n.order):
                log.info("model=%s version=%d %s: unconfirmed completion demoted", n.model, n.version, n.id)
                self._stop_reading(n)  # its readers (if any) are reassigned
                n.unconfirmed = None
                self.table.deliver(n.id, m.Demoted(version=version, reason=(
                    f"round {hold.txn_seq} of replica {node.replica_id}: shard {node.shard}'s confirmed "
                    f"completion of version {hold.published} wins over this unconfirmed one")))
        return None

    def _round_completed(self, node, txn: Txn) -> bool:
        """Whether a sibling shard of ``node`` that took ``txn``'s version holds all of it."""
        _, version, consumed = txn
        return any(n.id != node.id and n.shard in consumed and n.version == version and n.state in COMPLETE
                   for n in self.table.replica_nodes(node.model, node.replica_id))

    def _consumer_unaccounted(self, node, consumed: set[int]) -> bool:
        """A sibling shard that took this round's version is not registered right now (evicted,
        or not re-announced yet): it may still hold the version, so the round must not move."""
        present = {n.shard for n in self.table.replica_nodes(node.model, node.replica_id)}
        return any(sh != node.shard and sh not in present for sh in consumed)

    def _version_held(self, node, version: int) -> bool:
        """Whether ``version`` is still a committed, available version, or a sibling shard of
        ``node``'s replica holds or receives it (or will, once its drain or offload ends)."""
        if version in self._available(node.model):
            return True
        return any(n.shard != node.shard and ((n.version == version and n.state is not NodeState.IDLE)
                                              or (n.pending_read is not None and n.pending_read[0] == version))
                   for n in self.table.replica_nodes(node.model, node.replica_id))
