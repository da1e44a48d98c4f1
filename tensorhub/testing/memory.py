"""The private memory a process adds during an operation, for tests and benchmarks run inside
vLLM workers (``llm.collective_rpc(mark)`` ... ``llm.collective_rpc(peak)``).

Resident memory (``VmRSS`` / ``VmHWM``) is the wrong measure of what an update allocates: it also
counts the pages of other processes' shared memory this process maps, and a same-host read maps
the holder's whole region (``MAP_SHARED``, kept with the source), so the first read from each
holder "adds" that region's size although the holder owns those pages. Private (anonymous)
memory is what an operation allocates; Linux keeps no peak of it, so :func:`mark` samples
``RssAnon`` every millisecond on a thread until :func:`peak`. An allocation that lives less than
a millisecond can be missed; the tensors an update allocates live longer (first touch alone is
slower than that per MB here). Not counted either: shared memory this process creates itself
(a handle's buffer, its pooled retention buffer and host copies live in ``/dev/shm`` files):
list those apart (``/proc/self/maps``) when they matter.
"""

from __future__ import annotations

import threading


def status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (0 when absent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _Sampler:
    def __init__(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        self.rss, self.anon = status("VmRSS"), status("RssAnon")
        self.anon_peak = self.anon
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tensorhub-memory-sampler")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.anon_peak = max(self.anon_peak, status("RssAnon"))

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, status("RssAnon"))
        return {"rss": status("VmHWM") - self.rss, "anon": self.anon_peak - self.anon}


def mark(worker=None) -> dict[str, int]:
    """Start measuring in this process (``worker``: what ``collective_rpc`` passes; unused). Returns
    the resident and private memory now."""
    global _current
    if _current is not None:
        _current.stop()
    _current = _Sampler()
    return {"rss": _current.rss, "anon": _current.anon}


def peak(worker=None) -> dict[str, int]:
    """What this process added since :func:`mark`, at most: ``anon`` (private memory, sampled)
    and ``rss`` (resident, with mapped shared memory, from ``VmHWM``)."""
    global _current
    if _current is None:
        raise RuntimeError("peak() without mark()")
    out, _current = _current.stop(), None
    return out


_current: _Sampler | None = None
