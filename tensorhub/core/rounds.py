"""The round table: replicate rounds of sharded replicas, indexed by replica, bounded in time.

``(model, replica, seq) -> (spec, version, shards that took it)``: the first shard of a replica
to replicate in round ``seq`` resolves the spec, its siblings in that round get the same
version (``ReferenceCore._resolve_in_txn``). The table is a mapping with that key, as before,
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
registered before that announcement counts from 0 (the best effort of ``_rounds_done``: only
the caller knows for sure, ``replicate(..., round=)``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping

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
