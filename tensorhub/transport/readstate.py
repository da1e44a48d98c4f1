"""The read loop's rules, apart from the reads themselves: one pull's bookkeeping, pure.

:func:`tensorhub.transport.reader.pull` drives it with NIXL reads, threads and the wall clock;
the simulator (:mod:`tensorhub.sim.transport`) drives the same object with simulated reads and
virtual time, so both follow one set of rules:

1. The source's published state decides what may be read: units below its progress, of our
   version. A source showing an older version has nothing for us yet (it may be assigned a
   moment before it starts receiving); a newer one, or any other once ours was seen, moved on:
   the pull fails.
2. Reads are posted in unit order, as many as the window policy allows
   (:class:`~tensorhub.transport.pacing.Pacer`).
3. The prefix advances in unit order, a unit only once it landed and was verified; the
   caller publishes the new prefix (its own progress counter) only then.
4. Nothing moved (no read landed, no unit verified, the source did not advance) for
   ``stall_timeout_s``: the pull fails, whatever it was waiting for.

Time is passed in (``now``); nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from tensorhub.errors import SourceStalled, TransferError
from tensorhub.transport.pacing import Pacer


class ReadState:
    """Bookkeeping of one pull of units ``[start, end)`` of ``version``. Not thread-safe."""

    def __init__(self, version: int, start: int, end: int, *, window_max: int, stall_timeout_s: float,
                 now: float, source: str = "source", fixed_window: bool = False) -> None:
        self.version = version
        self.end = end
        self.next_post = start
        self.prefix = start
        self.landed: set[int] = set()
        """Units whose read completed, not yet in the verified prefix."""
        self.remote_progress = 0
        self.remote_sums: list[int] = []
        self.seen_version = False
        self.stall_timeout_s = stall_timeout_s
        self.last_advance = now
        """When something last moved: a read landed, a unit was verified, the source advanced."""
        self.source_advanced_at = now
        self.pacer = FixedWindow(window_max) if fixed_window else Pacer(window_max)
        """The window policy: the link-filling :class:`Pacer`, or ``window_max`` reads always
        (memory copies on the same host: one per copy thread)."""
        self.source = source

    # ---- what the source holds (rule 1) ------------------------------------------------
    def source_state(self, version: int, progress: int, sums: Optional[Sequence[int]], now: float) -> None:
        """The source's control block says (``version``, ``progress``, checksums)."""
        if version != self.version:
            if self.seen_version or version > self.version:
                raise TransferError(f"source {self.source} moved on: holds version {version}, expected {self.version}")
            return
        self.seen_version = True
        if progress > self.remote_progress:
            self.remote_progress = progress
            if sums is not None:
                self.remote_sums = list(sums[:progress])
            self.last_advance = self.source_advanced_at = now

    def source_extended(self, start: int, sums: Sequence[int], now: float) -> bool:
        """The source's units ``[start, start + len(sums))`` are final (a push, or a known
        progress); True if that told us something new."""
        end = start + len(sums)
        if not start <= self.remote_progress < end:
            return False
        self.remote_sums[self.remote_progress:] = list(sums[self.remote_progress - start:])
        self.remote_progress = end
        self.seen_version = True
        self.last_advance = self.source_advanced_at = now
        return True

    # ---- posting (rule 2) ---------------------------------------------------------------
    def next_to_post(self) -> Optional[int]:
        """The unit to post now, or None (window full, or nothing known final yet)."""
        if self.next_post < min(self.remote_progress, self.end) and self.pacer.may_post():
            return self.next_post
        return None

    def posted(self, unit: int, nbytes: int, now: float) -> None:
        assert unit == self.next_post
        self.pacer.on_post(unit, nbytes, now)
        self.next_post += 1

    def completed(self, units: Sequence[int], now: float) -> None:
        """Reads of ``units`` completed (their bytes are in place, not yet verified)."""
        if units:
            self.landed.update(units)
            self.last_advance = now
            self.pacer.on_done(units, now)

    def forget_posted(self) -> None:
        """The posted reads were cancelled or lost."""
        self.pacer.forget_inflight()

    @property
    def starved(self) -> bool:
        """Nothing to post until the source advances."""
        return self.remote_progress <= self.next_post < self.end

    # ---- the verified prefix (rule 3) -----------------------------------------------------
    def next_to_verify(self) -> Optional[int]:
        """The unit that extends the prefix once verified, if its read completed."""
        return self.prefix if self.prefix in self.landed else None

    def expected_sum(self, unit: int) -> int:
        return self.remote_sums[unit]

    def verified(self, unit: int, now: float) -> None:
        assert unit == self.prefix and unit in self.landed
        self.landed.discard(unit)
        self.prefix = unit + 1
        self.last_advance = now

    @property
    def finished(self) -> bool:
        return self.prefix >= self.end

    # ---- stalls (rule 4) ----------------------------------------------------------------
    def stall_due(self) -> float:
        """When the pull stalls unless something moves."""
        return self.last_advance + self.stall_timeout_s

    def check_stalled(self, now: float, *, inflight: Sequence[int] = (), verifying: Sequence[int] = ()) -> None:
        """Raise :class:`SourceStalled` if nothing moved for ``stall_timeout_s``."""
        if now < self.stall_due():
            return
        t = self.stall_timeout_s
        if inflight:
            raise SourceStalled(f"no read from {self.source} completed for {t}s (unit {min(inflight)} posted)")
        if verifying:
            raise SourceStalled(f"checksum of unit {min(verifying)} from {self.source} not done for {t}s")
        raise SourceStalled(f"source {self.source} stuck at {self.remote_progress}/{self.end} units for {t}s")


class FixedWindow:
    """``n`` reads kept posted, whatever the link (the same-host tier's copy threads)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.inflight: set[int] = set()

    def may_post(self) -> bool:
        return len(self.inflight) < self.n

    def on_post(self, unit: int, nbytes: int, now: float) -> None:
        self.inflight.add(unit)

    def on_done(self, units: Sequence[int], now: float) -> None:
        self.inflight.difference_update(units)

    def forget_inflight(self) -> None:
        self.inflight.clear()
