"""How many reads a puller keeps posted, and how long it sleeps between polls.

A pipeline through a partial holder only works if that holder's progress counter advances
unit by unit. Over a bandwidth-limited link UCX shares the link between every posted read, so
with many reads posted they all finish together at the end and the counter jumps from 0 to
all: the next reader in the chain waits for the whole transfer (measured on a 200 Mbit/s
emulated link: 8 units posted at once all completed at 2.81 s; posted one at a time, one every
0.35 s at the same total rate). So the reader keeps as few bytes in flight as fill the link:

- ``window``: one read, plus one more per unit of the bandwidth-delay product (``rate * (rtt +
  reaction) / unit``, the fraction of a unit the link idles between two reads when only one is
  posted) beyond 10%, never more than ``reads_in_flight``. On the emulated 100 Mbit/s link with
  512 KiB units that is one read (the link idles 0.7%); on the local shared-memory path (8 MiB
  units at 7 GB/s, 0.2 ms to notice and re-post) two; across a 30 ms link two. Posting the next
  read early instead, to hide the round trip, was tried: on TCP the two reads then share the
  link and both finish late. With 3% instead of 10%, a burst after an idle moment (the token
  bucket of a rate-limited link refills) read as a faster link and flipped readers to two reads;
- sleeps: the loop sleeps until shortly before the oldest read is predicted to finish, then
  polls, instead of spinning all along (eight readers on two cores cannot afford to spin).

``rate`` is the larger of two estimates: bytes delivered over the time reads were posted, and
bytes over the time they took to arrive once requested (each read's time less the round trip, or
less the wait behind the read before it). The first alone is self-limiting on a long link: with
two reads posted where three are needed the link idles, the measured rate drops by as much, and
the window stays at two (measured across a 20 ms one-way, 100 Mbit/s emulated link: a seed ran
at 6 MB/s of 12.5). Both sums decay by completion, so the estimate follows a changing link;
``rtt`` is the smallest latency seen of a small control read with nothing else in flight (not
the first one, which pays for connecting). The class is
pure: time is passed in, so the policy is tested with tables.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Optional

POLL_MIN_S = 50e-6
"""Shortest sleep between polls (a read is due, or nothing is known yet)."""
POLL_MAX_S = 2e-3
"""Longest sleep between polls while starved (waiting for the source's progress)."""
SLEEP_MAX_S = 5e-3
"""Longest sleep while a read is in flight (a wrong prediction costs at most this)."""
REACT_S = 150e-6
"""The poll loop's own delay in noticing a completion and posting the next read."""
IDLE_OK = 0.1
"""Fraction of a unit's transfer time the link may idle between reads before a second read
is kept in flight."""
_EWMA = 0.3
_DECAY = 0.8
_TIME_MIN_S = 1e-6
"""Least accumulated time a rate is computed from (seconds)."""


@dataclasses.dataclass
class _Posted:
    unit: int
    nbytes: int
    posted_at: float


class Pacer:
    """Window and sleep policy of one pull (see module doc). Not thread-safe."""

    def __init__(self, window_max: int) -> None:
        if window_max < 1:
            raise ValueError("window_max must be >= 1")
        self.window_max = window_max
        self.rate_Bps: Optional[float] = None
        self.rtt_s: Optional[float] = None
        self.unit_bytes_avg: Optional[float] = None
        self._inflight: list[_Posted] = []
        self._last_done: float = -math.inf
        self._busy_mark: float = -math.inf
        self._bytes_acc = 0.0
        self._busy_acc = 0.0
        self._serve_bytes_acc = 0.0
        self._serve_s_acc = 0.0
        self.serve_Bps: Optional[float] = None
        """The link's own rate: bytes over the time they took to arrive once the request had
        reached the source (a read's time less the round trip, or less the wait behind the read
        before it). Unlike ``rate_Bps`` it does not shrink when too few reads are posted to hide
        the round trip, so the window sized from it can grow to fill a long link."""

    # ---- observations ---------------------------------------------------------------
    def on_rtt(self, seconds: float) -> None:
        """A small read's round trip with nothing else in flight."""
        if seconds > 0 and (self.rtt_s is None or seconds < self.rtt_s):
            self.rtt_s = seconds

    def on_post(self, unit: int, nbytes: int, now: float) -> None:
        if not self._inflight:
            self._busy_mark = now  # the link was idle (or waiting for us) until now
        self._inflight.append(_Posted(unit, nbytes, now))

    def on_done(self, units: Sequence[int], now: float) -> None:
        """Reads of ``units`` were seen complete at ``now`` (completions may come in any order,
        several per poll)."""
        gone = set(units)
        done = [p for p in self._inflight if p.unit in gone]
        if not done:
            return
        self._inflight = [p for p in self._inflight if p.unit not in gone]
        busy_from = min(max(p.posted_at, self._last_done) for p in done)
        if self.rtt_s is not None:
            # Each read's bytes arrive after its request's round trip, and after the bytes of
            # the read before it: what is left is the link's time for its bytes. Reads seen done
            # in one poll make one sample (the first carries them all; a ratio of sums).
            prev = self._last_done
            for p in done:
                self._serve_s_acc += max(0.0, now - max(prev, p.posted_at + self.rtt_s))
                self._serve_bytes_acc += p.nbytes
                prev = now
        self._last_done = max(self._last_done, now)
        for p in done:
            avg = self.unit_bytes_avg
            self.unit_bytes_avg = p.nbytes if avg is None else avg + _EWMA * (p.nbytes - avg)
        # Rate = decayed bytes over decayed busy time (a ratio of sums, not a mean of ratios:
        # two interleaved reads seen done one poll apart must not read as a 100 us transfer).
        self._bytes_acc = _DECAY * self._bytes_acc + sum(p.nbytes for p in done)
        self._busy_acc = _DECAY * self._busy_acc + max(0.0, now - max(busy_from, self._busy_mark))
        self._busy_mark = now
        # A rate needs some measured time: reads seen done with (almost) none of it would make
        # the ratio of sums explode (a decayed sum reaching a denormal gave an infinite rate
        # and an OverflowError in window(): a CI run's spot-wave test).
        if self._busy_acc > _TIME_MIN_S and self._bytes_acc > 0:
            self.rate_Bps = self._bytes_acc / self._busy_acc
        if self._serve_s_acc > _TIME_MIN_S:
            self.serve_Bps = self._serve_bytes_acc / self._serve_s_acc
            self._serve_bytes_acc *= _DECAY
            self._serve_s_acc *= _DECAY

    def forget_inflight(self) -> None:
        self._inflight.clear()

    # ---- decisions ------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def window(self) -> int:
        """Reads to keep posted: one, plus one per started ``unit`` of the bandwidth-delay
        product beyond ``IDLE_OK`` (see module doc), capped at ``window_max``."""
        if self.rate_Bps is None or self.rtt_s is None or not self.unit_bytes_avg:
            return 1
        rate = max(self.rate_Bps, self.serve_Bps or 0.0)
        idle = rate * (self.rtt_s + REACT_S) / self.unit_bytes_avg
        if not math.isfinite(idle):
            return self.window_max
        return max(1, min(self.window_max, 1 + math.ceil(max(0.0, idle - IDLE_OK))))

    def head_due(self) -> Optional[float]:
        """Predicted completion time of the oldest posted read (None: no estimate yet)."""
        if not self._inflight or self.rate_Bps is None:
            return None
        p = self._inflight[0]
        return max(p.posted_at, self._last_done) + p.nbytes / self.rate_Bps

    def may_post(self) -> bool:
        """Whether one more read may be posted now."""
        return len(self._inflight) < self.window()

    def unit_s(self) -> Optional[float]:
        """Predicted transfer time of one (average) unit, once measured."""
        if self.rate_Bps is None or not self.unit_bytes_avg:
            return None
        return self.unit_bytes_avg / self.rate_Bps

    def starved_s(self, now: float, source_advanced_at: float, backoff_s: float) -> float:
        """Sleep while waiting for a partial source's next unit. The source receives over a
        link like ours, so its next unit is due about one unit time after its progress last
        moved: sleep until 9/10 of that, then poll at 1/40 of it; ``backoff_s`` (the caller's
        exponential backoff) until a unit time is known."""
        unit = self.unit_s()
        if unit is None:
            return backoff_s
        wake = source_advanced_at + 0.9 * unit
        if now < wake:
            return min(SLEEP_MAX_S, wake - now)
        return min(SLEEP_MAX_S, max(POLL_MIN_S, unit / 40))

    def sleep_s(self, now: float, starved_delay_s: float) -> float:
        """How long to sleep before polling again. ``starved_delay_s``: the caller's backoff
        while nothing is in flight (waiting for the source)."""
        if not self._inflight:
            return starved_delay_s
        due = self.head_due()
        if due is None:
            return POLL_MIN_S
        # Sleep until 9/10 into the predicted duration, then poll at 1/40 of it: sleeping past
        # a completion delays the next read (and a rate measured from late completions would
        # make the next sleep longer still), polling too often burns the CPU eight readers on
        # two cores share with the network stack.
        p = self._inflight[0]
        start = max(p.posted_at, self._last_done)
        duration = due - start
        wake = start + 0.9 * duration
        if now < wake:
            return min(SLEEP_MAX_S, wake - now)
        return min(SLEEP_MAX_S, max(POLL_MIN_S, duration / 40))
