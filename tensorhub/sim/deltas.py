"""Seeds as deltas in the simulator (``Config.seed_deltas``; :mod:`tensorhub.handle.deltas`).

What the real handles do, on the simulated clock and network, with unit tags for bytes:

- a client that publishes (``Offers``) snapshots its memory after each publish; after an encode
  delay it sends ``OfferDelta`` of the version against its previous snapshot (its first version:
  the promise, base -1). The delta is kept here by its endpoint: (base tags, new tags, bytes).
- a seeder (``Seeds.prepare``), before its staging copy reads version v, asks ``FindDelta`` for
  the version its staging copy holds (again while ``DeltaPending``, up to ``seed_delta_wait_s``),
  moves the delta's bytes over the network from the offerer's host, and rebuilds: a unit whose
  base tag matches takes the new tag, any other becomes garbage (what applying a delta to the
  wrong base yields). The real handle's digest check refuses a rebuild with any garbage unit
  (``DeltaWrongBase``): the read then crosses in full. A rebuilt version is the staging copy's
  prepared source: its read copies the units at local speed, unchecked (the real ``LocalSource``
  carries the rebuilt copy's own checksums), so a check that let garbage through would land
  wrong bytes for the checkers to find.

Knobs (``World``): ``seed_deltas`` (off: nothing here runs and traces are as before),
``delta_wrong_base`` (the share of offers whose publisher's base copy went bad),
``delta_check_base`` (False only to plant the bug: the rebuild is used unchecked).
"""

from __future__ import annotations

from typing import Callable

from tensorhub.core import messages as m

DELTA_RATIO = 0.03
"""A delta's bytes over its shard's (the measured 1.3-6.3%: ``benchmarks/RESULTS.md``)."""
ENCODE_BPS = 10e9
"""Encode speed of a publisher (bytes of its shard per second). The shipped encoder runs about
1 GB/s on one core; the simulated shards are GiBs with steps of seconds, where one core would
offer every delta after its version was superseded (the seeder then takes the full seed, which
the simulator checks too): this models an encoder spread over a host's cores."""
GARBAGE = ("delta-garbage",)


class SimDeltas:
    """The offers of one world, and what the deltas did (``applied``, ``fallbacks``)."""

    def __init__(self, world, *, wrong_base: float = 0.0, check_base: bool = True) -> None:
        self.world = world
        self.wrong_base = wrong_base
        self.check_base = check_base
        self.rng = world.sim.rng("deltas")
        self.snapshots: dict[str, tuple[int, list]] = {}
        """Publisher cid -> (version, its memory when it published it)."""
        self.offers: dict[bytes, tuple[list, list, int]] = {}
        """Endpoint -> (base tags, new tags, bytes)."""
        self.applied = 0
        self.fallbacks: dict[str, int] = {}

    # ------------------------------------------------------------------ the publisher

    def published(self, client, version: int) -> None:
        """``client`` published ``version``: snapshot, then offer after the encode delay."""
        prev = self.snapshots.get(client.cid)
        self.snapshots[client.cid] = (version, list(client.mem))
        nbytes = client.units * client.unit_bytes
        # The promise (no older copy) needs no encode: offered at once.
        delay = 0.0 if prev is None or prev[0] >= version else nbytes / ENCODE_BPS
        self.world.sim.after(delay, self._offer, client, version, prev)

    def _offer(self, client, version: int, prev) -> None:
        if not client.alive or client.published != version:
            return  # unpublished meanwhile (Offers.unpublishing): nothing is offered
        shard_bytes = client.units * client.unit_bytes
        capacity = max(1, shard_bytes // 4)
        if prev is None or prev[0] >= version:
            req = m.OfferDelta(client.cid, version, -1, b"", 0, capacity)
        else:
            base = list(prev[1])
            if self.rng.random() < self.wrong_base:
                base[0] = GARBAGE  # the publisher's host copy of the base went bad
            endpoint = f"delta:{client.cid}:{version}".encode()
            nbytes = max(1, int(DELTA_RATIO * shard_bytes))
            self.offers[endpoint] = (base, list(self.snapshots[client.cid][1]), nbytes)
            req = m.OfferDelta(client.cid, version, prev[0], endpoint, nbytes, capacity)
        self.world.server.call(client, req, False, None, on_reply=lambda _r: None)

    # ------------------------------------------------------------------ the seeder

    def prepare(self, stage, version: int, then: Callable[[], None]) -> None:
        """Before ``stage`` reads ``version``: rebuild it from a delta if one is offered for
        the version ``stage`` holds (``stage.delta_ready``), then ``then()`` (the read)."""
        base = stage.published
        if base is None or base >= version or stage.region_progress != stage.units:
            then()
            return
        deadline = self.world.sim.now + self.world.config.seed_delta_wait_s
        self._find(stage, version, base, deadline, 0.01, then)

    def _find(self, stage, version: int, base: int, deadline: float, pause: float, then) -> None:
        w = self.world

        def answered(reply) -> None:
            if not stage.alive:
                return
            if isinstance(reply, m.DeltaAt):
                self._fetch(stage, version, reply, then)
            elif (isinstance(reply, m.ErrorReply) and reply.code == "DeltaPending"
                  and w.sim.now + pause <= deadline):
                w.sim.after(pause, self._find, stage, version, base, deadline, min(2 * pause, 0.1), then)
            else:
                self._fall_back(reply.code if isinstance(reply, m.ErrorReply) else "reply", then)

        w.server.call(stage, m.FindDelta(stage.cid, version, base), False, None, on_reply=answered)

    def _fetch(self, stage, version: int, at: m.DeltaAt, then) -> None:
        w = self.world
        offer = self.offers.get(at.endpoint)
        src = w.clients.get(at.source_id)
        if offer is None or src is None or not src.alive:
            self._fall_back("SourceUnreachable", then)
            return
        end = w.net.reserve(src.host, stage.host, offer[2])
        w.sim.at(end, self._rebuild, stage, version, offer, then)

    def _rebuild(self, stage, version: int, offer, then) -> None:
        if not stage.alive:
            return
        base, new, _ = offer
        out = [n if have == b else GARBAGE for have, b, n in zip(stage.mem, base, new)]
        if self.check_base and GARBAGE in out:
            self._fall_back("DeltaWrongBase", then)
            return
        self.applied += 1
        stage.delta_ready = (version, out)
        then()

    def _fall_back(self, why: str, then) -> None:
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        then()
