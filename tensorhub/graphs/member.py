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
- ``th_graph_fetch(signal)`` (the graph node): read the units of one batch from the assigned
  source straight into the registered tensors (NIXL), return ``(k, checksums of the batch's
  units)`` as the "batch k is in place" signal. The first member's input is the batch index
  ``k`` from the driver; a downstream member's input is its upstream's signal, which says
  exactly which units are final and what they hash to, so it reads them without ever reading
  its upstream's control block (a root source outside the graph that is complete is read once
  per version; only a partial one outside the graph is polled). A failure is returned as a
  negative int (never raised), so graph channels only carry small bounded values.
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
from typing import Optional, Union

from tensorhub.core import messages as m
from tensorhub.errors import InvalidState, TransferError
from tensorhub.graphs.plan import batch_end, default_batches
from tensorhub.transport.reader import KnownProgress

log = logging.getLogger(__name__)


class _ReadState:
    """One read through a graph. The bytes move in a *mover* thread: one pull over the whole
    read that reads every unit the member knows to be final (from the edge signals, or from one
    control read of a complete root source), so the link never waits for the graph's own
    per-batch overhead (about 11 ms per execution on the emulated cluster, a quarter of a unit's
    transfer). ``th_graph_fetch(k)`` only tells the mover what became final upstream and waits
    until batch ``k`` is in place here."""

    def __init__(self, assignment: m.Assignment, t0: float, batches: int) -> None:
        self.assignment, self.t0, self.batches = assignment, t0, batches
        self.batches_done = 0
        self.failed: Optional[str] = None
        self.aborted = False
        self.source = None
        self.known: Optional[KnownProgress] = None
        """The source's units known final (edge signals, or a complete root); None: poll it."""
        self.mover: Optional[threading.Thread] = None
        self.landed = threading.Condition()
        self.start_units = 0
        self.fetch_s = 0.0
        self.watchdog: Optional[threading.Timer] = None

    def start(self, hub, sums: Optional[list]) -> None:
        """Open the source and start the mover (first batch)."""
        self.source = hub.reads.open_source(self.assignment)
        if sums is not None:
            self.known = KnownProgress()
        elif not self.assignment.source_partial:
            complete = hub.reads.source_checksums(self.source, self.assignment.version)
            self.known = KnownProgress(complete) if complete is not None else None
        self.start_units = hub.reads.resume_point(self.assignment.version)
        self.mover = threading.Thread(target=self._move, args=(hub,), daemon=True,
                                      name=f"tensorhub-graph-mover-{hub.client_id}")
        self.mover.start()

    def _move(self, hub) -> None:
        t = time.perf_counter()
        try:
            try:
                self._pull(hub)
            except TransferError as e:
                # Once more from our own progress through a freshly opened source (a connection
                # NIXL dropped shows as NIXL_ERR_NOT_FOUND on a source opened earlier).
                log.info("model=%s version=%d client=%s graph read: %s; reopening the source",
                         hub.model, self.assignment.version, hub.client_id, e)
                self.source = hub.reads.open_source(self.assignment)
                self._pull(hub)
        except Exception as e:  # noqa: BLE001 - reported through fetch's negative int; finish() fails over
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("model=%s version=%d client=%s graph read failed: %s",
                        hub.model, self.assignment.version, hub.client_id, self.failed)
        finally:
            self.fetch_s = time.perf_counter() - t
            self._wake()

    def _pull(self, hub) -> None:
        hub.reads.pull_range(self.assignment, hub.reads.unit_count, source=self.source, source_sums=self.known,
                        should_stop=lambda: self.aborted, on_unit=self._wake)

    def _wake(self, _unit: int = -1) -> None:
        with self.landed:
            self.landed.notify_all()

    def wait_for(self, hub, end: int, timeout_s: float) -> bool:
        """Until units ``[0, end)`` are in place (True), or the read failed, stopped or timed out."""
        deadline = time.monotonic() + timeout_s
        version = self.assignment.version
        with self.landed:
            # Progress counts only for our version: until the mover resets the region, it may
            # still show the previous version complete.
            while hub.reads.resume_point(version) < end:
                if self.failed or self.aborted or not self.mover.is_alive():
                    return hub.reads.resume_point(version) >= end
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.landed.wait(min(left, 0.5))
        return True

    def stop(self) -> None:
        """Stop the mover (if still running) and the watchdog. Idempotent. (The source belongs
        to the hub.)"""
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.mover is not None and self.mover.is_alive():
            self.aborted = True
            self.mover.join()
        self.source = None


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

    def th_graph_begin(self, spec: m.VersionSpec = "latest", update: bool = True,
                       batches: Optional[int] = None) -> dict:
        """Phase 1 of a read. Blocks until the server assigned a source (or found the member
        already current). Returns ``{"client_id", "action": "assigned"|"noop", "version",
        "source_id", "unit_count", "batches"}`` (``batches``: as given, or for None one per unit
        up to ``BATCHES_MAX``). After "assigned" the driver must call ``th_graph_finish``."""
        hub = self.tensorhub_hub()
        with self._th_lock():
            t0 = time.perf_counter()
            batches = default_batches(hub.reads.unit_count, batches)
            self._th_drop_unfinished(hub, "a new graph read began before the last one finished")
            reply = hub.reads.begin(spec, update)
            out = {"client_id": hub.client_id, "unit_count": hub.reads.unit_count, "batches": batches}
            if isinstance(reply, m.NoChange):
                self.__dict__["_th_graph_read"] = None
                return {**out, "action": "noop", "version": reply.version, "source_id": None}
            st = self.__dict__["_th_graph_read"] = _ReadState(reply, t0, batches)
            # The driver may die between begin and finish: then nobody would ever finish this
            # read, and the server would keep a reader that never ends (its source's unpublish
            # would wait for it). Abort it once a finish is overdue.
            st.watchdog = threading.Timer(hub.config.request_timeout_s, self._th_expire, args=(st,))
            st.watchdog.daemon = True
            st.watchdog.start()
            return {**out, "action": "assigned", "version": reply.version, "source_id": reply.source_id}

    def th_graph_fetch(self, signal) -> Union[int, tuple]:
        """Graph node. In: the batch index ``k`` (first member) or the upstream's signal ``(k,
        checksums of batch k's units)``; a negative int is an upstream failure, passed on. Out:
        ``(k, checksums of batch k's units)`` once they are in place here, or a negative int.
        Never raises (an exception would travel through the channels)."""
        if isinstance(signal, int):
            if signal < 0:
                return signal
            k, sums = signal, None
        else:
            k, sums = signal
        st = self._th_state()
        if st is None or st.aborted:
            return -(k + 1)
        hub = self.tensorhub_hub()
        with self._th_lock():
            if st.aborted or st.failed:
                return -(k + 1)
            try:
                units = hub.reads.unit_count
                start, end = batch_end(units, st.batches, k - 1) if k > 0 else 0, batch_end(units, st.batches, k)
                if st.mover is None:
                    st.start(hub, sums)
                if sums is not None:
                    if len(sums) != end - start or st.known is None:
                        raise InvalidState(f"batch {k} signal carries {len(sums)} checksums for units [{start}, {end})")
                    st.known.extend(start, sums)
                if not st.wait_for(hub, end, hub.config.source_stall_timeout_s + 60.0):
                    raise TransferError(st.failed or f"batch {k} not in place (stopped, or timed out)")
                st.batches_done += 1
                return k, hub.reads.checksums()[start:end]
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
            if st.mover is not None:
                st._wake()
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
            st.stop()
            graph_progress = hub.reads.resume_point(st.assignment.version)
            graph_bytes = hub.reads.units_bytes(st.start_units, graph_progress) if st.mover is not None else 0
            rs = hub.reads.finish()
            return {
                "action": rs.action, "client_id": hub.client_id, "version": rs.version,
                "seconds": rs.seconds, "bytes": graph_bytes + rs.bytes, "graph_bytes": graph_bytes,
                "pull_bytes": rs.bytes, "graph_units": graph_progress, "graph_fetch_s": st.fetch_s,
                "batches_done": st.batches_done, "sources": list(rs.sources), "failovers": rs.failovers,
                "failed": st.failed, "done_at": time.time(),
            }

    def _th_expire(self, st: _ReadState) -> None:
        """Watchdog: ``th_graph_finish`` did not come within ``request_timeout_s`` of begin."""
        hub = self.tensorhub_hub()
        with self._th_lock():
            if self._th_state() is st:
                log.warning("model=%s version=%d client=%s: graph read not finished within %.0fs; aborting it",
                            hub.model, st.assignment.version, hub.client_id, hub.config.request_timeout_s)
                self._th_drop_unfinished(hub, "the graph's driver did not finish the read")

    def _th_drop_unfinished(self, hub, why: str) -> None:
        """End a begun, unfinished read on the server too (lock held)."""
        st = self._th_state()
        if st is None:
            return
        self.__dict__["_th_graph_read"] = None
        st.stop()
        hub.reads.abort(why)

    def th_graph_setup(self, buffer_bytes: int) -> int:
        """Called by :class:`~tensorhub.graphs.GraphCache` before a compile: channels this actor
        writes size themselves from *this process's* Ray DAG context, and Ray 2.60 leaves every
        compile's buffers in the object store, so make them small (edges carry one int)."""
        from ray.dag import DAGContext

        DAGContext.get_current().buffer_size_bytes = int(buffer_bytes)
        return int(buffer_bytes)

    def th_graph_model(self) -> str:
        """The hub's model (``replicate_group`` picks the model's coordinator by it)."""
        return self.tensorhub_hub().model

    def th_graph_ping(self) -> str:
        return self.tensorhub_hub().client_id

    def th_graph_progress(self) -> tuple[int, int]:
        """``(version, units in place)`` of the hub's region; lock-free (observability, tests)."""
        version, progress, _units = self.tensorhub_hub().reads.progress()
        return version, progress
