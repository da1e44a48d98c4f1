"""``GraphMember``: the mixin that lets any Ray actor take part in a compiled-graph pipeline.

Add it to your actor class and give it the actor's hub (an opened, registered
:class:`tensorhub.Hub`) as ``self.tensorhub_handle`` (an attribute or a property), or override
:meth:`GraphMember.tensorhub_hub`::

    @ray.remote
    class Rollout(GraphMember):
        def __init__(self):
            self.weights = build_model().state_dict()
            self.tensorhub_handle = tensorhub.open("policy", replica="rollout-3")
            self.tensorhub_handle.register(self.weights)

    tensorhub.graphs.replicate_group([rollout0, rollout1, rollout2], "latest")

The driver (:func:`tensorhub.graphs.replicate_group`) calls these methods; users do not:

- ``th_graph_begin(spec, update, batches)``: ask the server for a source (phase 1 of a read).
- ``th_graph_fetch(k)`` (the graph node): read the units of batch ``k`` from the assigned source
  straight into the registered tensors (NIXL), return ``k`` as the "batch k is in place" signal.
  Its upstream returned ``k`` first, so the source already has those units: no polling. A failure
  is returned as a negative int (never raised), so graph channels only ever carry one small int.
- ``th_graph_finish()``: read whatever is still missing, with failover, from the member's own
  progress, and tell the server the read is done. This is also the fallback: after a failed or
  aborted graph it resumes the read on the pull path; no unit is fetched twice.
- ``th_graph_abort()``: make the remaining fetches of this read no-ops (called before fallback).

The graph thread (Ray's ``_ray_system`` concurrency group) and plain calls may run at the same
time on one actor, so every method that touches the hub holds one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from tensorhub.core import messages as m
from tensorhub.graphs.plan import batch_end

log = logging.getLogger(__name__)


class _ReadState:
    __slots__ = ("assignment", "t0", "batches", "bytes", "fetch_s", "failed", "aborted", "batches_done")

    def __init__(self, assignment: m.Assignment, t0: float, batches: int) -> None:
        self.assignment, self.t0, self.batches = assignment, t0, batches
        self.bytes, self.fetch_s, self.batches_done = 0, 0.0, 0
        self.failed: Optional[str] = None
        self.aborted = False


class GraphMember:
    """Mixin: graph-callable ``th_graph_*`` methods over the actor's hub (see module doc)."""

    def tensorhub_hub(self):
        """The actor's :class:`tensorhub.Hub` (default: ``self.tensorhub_handle``)."""
        hub = getattr(self, "tensorhub_handle", None)
        if hub is None:
            raise AttributeError(f"{type(self).__name__} uses GraphMember but has no tensorhub_handle")
        return hub

    def _th_lock(self) -> threading.Lock:
        lock = self.__dict__.get("_th_graph_lock")
        if lock is None:
            lock = self.__dict__.setdefault("_th_graph_lock", threading.Lock())
        return lock

    def _th_state(self) -> Optional[_ReadState]:
        return self.__dict__.get("_th_graph_read")

    def th_graph_begin(self, spec: m.VersionSpec = "latest", update: bool = True, batches: int = 8) -> dict:
        """Phase 1 of a read. Blocks until the server assigned a source (or found the member
        already current). Returns ``{"client_id", "action": "assigned"|"noop", "version",
        "source_id", "unit_count"}``. After "assigned" the driver must call ``th_graph_finish``."""
        hub = self.tensorhub_hub()
        with self._th_lock():
            t0 = time.perf_counter()
            reply = hub._begin_read(spec, update)
            out = {"client_id": hub.client_id, "unit_count": hub._layout.unit_count}
            if isinstance(reply, m.NoChange):
                self.__dict__["_th_graph_read"] = None
                return {**out, "action": "noop", "version": reply.version, "source_id": None}
            self.__dict__["_th_graph_read"] = _ReadState(reply, t0, batches)
            hub._reading = True  # heartbeats report progress while the graph reads
            return {**out, "action": "assigned", "version": reply.version, "source_id": reply.source_id}

    def th_graph_fetch(self, k: int) -> int:
        """Graph node: batch ``k`` in place -> ``k``; ``k < 0`` (upstream failed) or a failure
        here -> a negative int. Never raises (an exception would travel through the channels)."""
        if k < 0:
            return k
        st = self._th_state()
        if st is None or st.aborted:
            return -(k + 1)
        hub = self.tensorhub_hub()
        with self._th_lock():
            if st.aborted or st.failed:
                return -(k + 1)
            try:
                end = batch_end(hub._layout.unit_count, st.batches, k)
                before = hub._resume_point(st.assignment.version)
                if before < end:
                    t = time.perf_counter()
                    try:
                        hub._pull_range(st.assignment, end)
                    finally:
                        # Count what landed, also when the pull failed part way.
                        st.bytes += hub._units_bytes(before, hub._resume_point(st.assignment.version))
                        st.fetch_s += time.perf_counter() - t
                st.batches_done += 1
                return k
            except Exception as e:  # noqa: BLE001 - reported as a value; finish() fails over
                st.failed = f"{type(e).__name__}: {e}"
                log.warning("model=%s version=%d client=%s graph fetch of batch %d failed: %s",
                            hub.model, st.assignment.version, hub.client_id, k, st.failed)
                return -(k + 1)

    def th_graph_abort(self) -> bool:
        """Make the remaining fetches of this read no-ops (does not wait for a running one)."""
        st = self._th_state()
        if st is not None:
            st.aborted = True
        return st is not None

    def th_graph_finish(self) -> dict:
        """Read what is still missing (with failover, from own progress) and report the read
        done; the member is then a holder. Returns stats (``bytes`` = graph + pull bytes,
        ``graph_bytes``, ``failed`` = the graph fetch error if any). Blocks; raises like
        ``Hub.replicate``. Idempotent: with no read in progress returns ``{"action": "none"}``."""
        hub = self.tensorhub_hub()
        with self._th_lock():
            st = self._th_state()
            if st is None:
                return {"action": "none", "client_id": hub.client_id, "version": hub.version}
            self.__dict__["_th_graph_read"] = None
            graph_progress = hub._region.progress
            try:
                rs = hub._read(st.assignment, st.t0)
            finally:
                hub._reading = False
            return {
                "action": rs.action, "client_id": hub.client_id, "version": rs.version,
                "seconds": rs.seconds, "bytes": st.bytes + rs.bytes, "graph_bytes": st.bytes,
                "pull_bytes": rs.bytes, "graph_units": graph_progress, "graph_fetch_s": st.fetch_s,
                "batches_done": st.batches_done, "sources": list(rs.sources), "failovers": rs.failovers,
                "failed": st.failed, "done_at": time.time(),
            }

    def th_graph_setup(self, buffer_bytes: int) -> int:
        """Called by :class:`~tensorhub.graphs.GraphCache` before a compile: channels this actor
        writes size themselves from *this process's* Ray DAG context, and Ray 2.60 leaves every
        compile's buffers in the object store, so make them small (edges carry one int)."""
        from ray.dag import DAGContext

        DAGContext.get_current().buffer_size_bytes = int(buffer_bytes)
        return int(buffer_bytes)

    def th_graph_ping(self) -> str:
        return self.tensorhub_hub().client_id

    def th_graph_progress(self) -> tuple[int, int]:
        """``(version, units in place)`` of the hub's region; lock-free (observability, tests)."""
        region = self.tensorhub_hub()._region
        return region.version, region.progress
