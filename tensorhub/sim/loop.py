"""The simulation loop: a heap of (time, seq) events, a virtual clock, seeded RNGs, a trace.

Nothing here reads the wall clock. Time jumps to the next event; ties are broken by insertion
order, so a run depends only on the seed. Every subsystem asks for its own RNG
(:meth:`Sim.rng`) so that adding draws in one place does not shift another's stream.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from typing import Any, Callable, Optional


class Sim:
    def __init__(self, seed: int, *, keep_trace: bool = False) -> None:
        self.seed = seed
        self.now = 0.0
        self.events = 0
        self.stopped = False
        self._queue: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0
        self._hash = hashlib.blake2b(digest_size=16)
        self.lines: Optional[list[str]] = [] if keep_trace else None

    def rng(self, name: str) -> random.Random:
        """A generator of its own for subsystem ``name``, derived from the seed only."""
        return random.Random(f"{self.seed}/{name}")

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._queue, (max(when, self.now), self._seq, fn, args))
        self._seq += 1

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def trace(self, text: str) -> None:
        line = f"{self.now:.6f} {text}"
        self._hash.update(line.encode())
        self._hash.update(b"\n")
        if self.lines is not None:
            self.lines.append(line)

    def digest(self) -> str:
        return self._hash.hexdigest()

    def run(self, until: float) -> None:
        """Run events up to virtual time ``until`` or until :attr:`stopped` is set."""
        q = self._queue
        while q and not self.stopped:
            t, _, fn, args = q[0]
            if t > until:
                break
            heapq.heappop(q)
            self.now = t
            self.events += 1
            fn(*args)
