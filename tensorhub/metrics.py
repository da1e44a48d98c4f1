"""Client-side metrics for the Ray dashboard (``ray.util.metrics``, exported through Ray's
metrics agent to Prometheus/Grafana, where each name gets Ray's ``ray_`` prefix and counters a
``_total`` suffix). Recording is a no-op outside a Ray process, so handles used with an
in-process port (tests) cost nothing.

- ``tensorhub_read_seconds``: wall time of replicate/update calls (queueing, drain, offload,
  transfer).
- ``tensorhub_transfer_seconds``: first source to last byte.
- ``tensorhub_stall_seconds``: time a reader was blocked waiting for bytes (``ReadStats.stall_s``:
  before its first source -- queueing, the drain of the version it left, not its own offload --
  and starved mid-read by a source that had no new unit for it). Never the call's wall time.

``examples/grafana/tensorhub_grafana_dashboard.json`` charts them (docs/operations.md, "Metrics and the dashboard").
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

log = logging.getLogger(__name__)

_lock = threading.Lock()
_metrics: Optional[dict] = None
_disabled = False

_SECONDS = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300]


def _get() -> Optional[dict]:
    global _metrics, _disabled
    if _metrics is not None or _disabled:
        return _metrics
    with _lock:
        if _metrics is not None or _disabled:
            return _metrics
        try:
            import ray
            from ray.util import metrics

            if not ray.is_initialized():
                return None
            _metrics = {
                "bytes": metrics.Counter("tensorhub_bytes_received", "bytes replicated into this process", ("model",)),
                "reads": metrics.Counter("tensorhub_reads", "replicate/update calls by outcome", ("model", "action")),
                "failovers": metrics.Counter("tensorhub_failovers", "sources that failed during a read", ("model",)),
                "transfer_s": metrics.Histogram("tensorhub_transfer_seconds", "time from first source to last byte",
                                                _SECONDS, ("model",)),
                "read_s": metrics.Histogram("tensorhub_read_seconds", "wall time of replicate/update calls",
                                            _SECONDS, ("model",)),
                "stall_s": metrics.Histogram("tensorhub_stall_seconds",
                                             "time a reader was blocked waiting for bytes from its source",
                                             _SECONDS, ("model",)),
                "publishes": metrics.Counter("tensorhub_publishes", "versions published", ("model",)),
            }
        except Exception:  # noqa: BLE001 - metrics must never break the data path
            log.debug("metrics unavailable", exc_info=True)
            _disabled = True
        return _metrics


def record_read(model: str, action: str, seconds: float, transfer_s: float, nbytes: int, failovers: int,
                *, stall_s: Optional[float] = None) -> None:
    """One finished replicate/update. ``seconds``: the call's wall time; ``transfer_s``: first
    source to last byte; ``stall_s``: the part of the transfer the reader spent blocked waiting
    for bytes (None: not measured, nothing recorded)."""
    m = _get()
    if m is None:
        return
    tags = {"model": model}
    try:
        m["reads"].inc(1, tags={"model": model, "action": action})
        m["read_s"].observe(max(seconds, 0.0), tags=tags)
        if stall_s is not None and action == "replicated":
            m["stall_s"].observe(max(stall_s, 0.0), tags=tags)
        if action == "replicated":
            if nbytes > 0:  # Counter.inc refuses 0 (a read that resumed with every unit in place)
                m["bytes"].inc(nbytes, tags=tags)
            m["transfer_s"].observe(max(transfer_s, 0.0), tags=tags)
        if failovers > 0:
            m["failovers"].inc(failovers, tags=tags)
    except Exception:  # noqa: BLE001 - metrics must never break the data path
        log.debug("metrics recording failed", exc_info=True)


def record_publish(model: str) -> None:
    m = _get()
    if m is None:
        return
    try:
        m["publishes"].inc(1, tags={"model": model})
    except Exception:  # noqa: BLE001
        log.debug("metrics recording failed", exc_info=True)
