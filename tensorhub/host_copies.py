"""Host copies of a handle's shard: retention offloads, copies made ahead, the buffer pool.

A mixin of :class:`tensorhub.client.Hub` (it uses the handle's locks, state machine, tensors
and server port), kept apart because it is one concern: host memory that holds a version for
the server's retention rules.

- **Offload** (``_offload``, on ``OffloadOrder``): the last non-spot holder of a retained version
  (or a seeder's staging copy holding its datacenter's newest copy) copies its tensors to a host
  buffer and registers it before it unpublishes; the server publishes that host copy.
- **Made ahead** (``_host_copy_asked``, on ``MakeHostCopy``): the first non-spot reader of a
  retained version copies it in a background thread, so the later unpublish has nothing to copy.
- **Pool** (``_start_pool``, ``_pool_loop``): ``host_copies_pooled`` registered, touched buffers
  kept ready (first touch of fresh memory is slow), refilled by freed copies before fresh ones.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import torch

from tensorhub import errors
from tensorhub import transport as tx
from tensorhub.core import background as bg
from tensorhub.core import handle as hm
from tensorhub.core import messages as m

log = logging.getLogger("tensorhub.client")

HubState = hm.Phase


_NO_RETRY = threading.Event()
_NO_RETRY.set()
"""A stop already set: one offer, no pause and retry (the next answered pulse retries)."""


class HostCopies:
    """Host copies and their buffer pool (see the module docstring)."""

    def _offload(self, version: int) -> bytes:
        """Copy the published tensors to host memory, register that copy; returns its endpoint.
        The buffer comes from the pool the background thread keeps filled (allocated, touched and
        registered off the critical path); only when none is ready is one made here."""
        with self._host_lock:
            existing = self._host.get(version)
            if existing is not None:
                return tx.encode_endpoint(existing[0].endpoint())
            pooled = self._host_pool.pop() if self._host_pool else None
        self._pool_wake.set()  # refill behind this offload
        if pooled is None:  # the pool thread may be touching one: that finishes first
            pooled = self._pooled_buffer(threading.Event())
        if pooled is None:
            region, copies = self._new_host_buffer(touch=False)
            self.host_buffers_inline += 1
            log.info("model=%s version=%d shard=%d: no retention buffer was ready; allocating one "
                     "on the offload's path", self.model, version, self.shard)
        else:
            region, copies = pooled
        for dst, src in zip(copies, self._tensors):
            dst.copy_(src)
        region.publish_complete(version, self._region.checksums() if self.config.checksums else None)
        with self._host_lock:
            self._host[version] = (region, copies)
        log.info("model=%s version=%d shard=%d offloaded to host (%d bytes)",
                 self.model, version, self.shard, self._layout.total_bytes)
        return tx.encode_endpoint(region.endpoint())

    # ---- retention made ahead: a holder's background host copy (MakeHostCopy) ----------------

    def _host_copy_asked(self, version: int, in_call: bool) -> None:
        """The server asks this holder to copy ``version`` to host memory ahead (MakeHostCopy).
        Only between calls (a call in progress may change the tensors) and only while the handle
        still publishes that version; otherwise the request is dropped (the last holder will
        offload instead)."""
        between_calls = in_call or self._lock.acquire(blocking=False)
        try:
            if bg.host_copy_wanted(version, between_calls=between_calls, phase=self._machine.phase,
                                   published=self._machine.published, spot=self.spot,
                                   host_copy_ahead=self.config.host_copy_ahead,
                                   versions_retained=self.config.versions_retained,
                                   pooled=self._pool_thread is not None):
                self._start_host_copy(version)
        finally:
            if between_calls and not in_call:
                self._lock.release()

    def _start_host_copy(self, version: int) -> None:
        """Start the background copy :func:`~tensorhub.core.background.host_copy_wanted` asked
        for, unless one is under way or the version is in host memory already."""
        if self._eager is not None and self._eager[0].is_alive():
            return
        with self._host_lock:
            if version in self._host:
                return
        cancel, copied = threading.Event(), threading.Event()
        t = threading.Thread(target=self._host_copy, args=(version, cancel, copied), daemon=True,
                             name=f"tensorhub-hostcopy-{self.client_id}")
        self._eager = (t, cancel, copied)
        t.start()

    def _stop_host_copy(self, cancel_it: bool = True) -> None:
        """Before the published tensors may change: wait until the background copy no longer
        reads them. A copy still waiting for a ready buffer is cancelled (``cancel_it``); one that
        is copying (memory speed, into a touched buffer) finishes first."""
        if self._eager is not None:
            t, cancel, copied = self._eager
            if cancel_it:
                cancel.set()
            while t.is_alive() and not copied.wait(0.05):
                pass
            cancel.set()  # copied: what is left is offering it again, which stops now
            t.join()
            self._eager = None

    def _host_copy(self, version: int, cancel: threading.Event, copied: threading.Event) -> None:
        t0 = time.perf_counter()
        try:
            # Publishing this version may have pushed an older one out of retention: free its
            # host copy first, so this copy reuses that buffer (fresh memory is slow to touch).
            self._take_notes()
        except errors.TensorHubError:
            pass
        entry = self._pooled_buffer(cancel)
        if entry is None:  # cancelled before a buffer was ready: the last holder will offload
            return
        region, copies = entry
        try:
            for dst, src in zip(copies, self._tensors):
                dst.copy_(src)  # a touched buffer: memory speed; unpublish() waits for this part
            if any(t.is_cuda for t in self._tensors):
                torch.cuda.current_stream().synchronize()
            region.publish_complete(version, self._region.checksums() if self.config.checksums else None)
            endpoint = tx.encode_endpoint(region.endpoint())
        except Exception:  # noqa: BLE001 - the last holder's offload still keeps the version
            log.warning("model=%s version=%d shard=%d: background host copy failed", self.model, version,
                        self.shard, exc_info=True)
            self._recycle(entry)
            return
        finally:
            copied.set()  # the tensors are not read any more
        with self._host_lock:
            self._host[version] = entry
        with self._mlock:
            self._machine.host_copies[version] = endpoint
        if not self._offer_host_copy(version, endpoint, cancel):
            return
        log.info("model=%s version=%d shard=%d host copy made in the background in %.3fs",
                 self.model, version, self.shard, time.perf_counter() - t0)

    def _offer_host_copy(self, version: int, endpoint: bytes, stop: threading.Event) -> bool:
        """Offers the host copy to the server (``HostCopy``), again with a growing pause while
        the server does not answer (``reconnects_max`` times; the offer is idempotent: a copy
        the server lists already is kept), until ``stop``. The copy stays whatever the answer,
        until the server drops it: a server that restarted learns of it from the
        re-announcement (which may already have carried it), and freeing it here could pull it
        from under a reader. Returns whether the server took the offer."""
        for attempt in range(self.config.reconnects_max + 1):
            try:
                reply = self._port.call(m.HostCopy(self.client_id, version, endpoint))
                if isinstance(reply, m.ErrorReply):
                    raise errors.from_code(reply.code, reply.message)
                return True
            except errors.ServerUnavailable:
                if attempt < self.config.reconnects_max and not stop.wait(min(0.2 * 2 ** attempt, 2.0)):
                    continue
                with self._host_lock:
                    self._unoffered.add(version)  # offered again after a pulse the server answers
                why = "no answer"
            except Exception:  # noqa: BLE001 - refused (e.g. the server restarted): announced later
                why = "refused"
            log.info("model=%s version=%d shard=%d: host copy not offered (%s); the next announcement "
                     "carries it", self.model, version, self.shard, why, exc_info=True)
            return False
        return False

    def _reoffer_host_copies(self) -> None:
        """After a pulse the server answered: offer once more each host copy whose offer got no
        answer (it would stay unlisted, so never dropped, past retention). Pulse thread."""
        with self._host_lock:
            pending = sorted(v for v in self._unoffered if v in self._host)
            self._unoffered.clear()
        for version in pending:
            with self._mlock:
                endpoint = self._machine.host_copies.get(version)
            if endpoint is not None:
                self._offer_host_copy(version, endpoint, _NO_RETRY)

    def _pooled_buffer(self, cancel: threading.Event) -> Optional[tuple[tx.Region, list[torch.Tensor]]]:
        """A ready retention buffer; while the pool thread is preparing one, wait for it (a
        second fresh buffer would only compete with it for first touches), unless cancelled."""
        self._pool_urgent.set()
        self._pool_wake.set()
        t0 = time.monotonic()
        while True:
            with self._host_lock:
                if self._host_pool:
                    entry = self._host_pool.pop()
                    self._pool_wake.set()
                    return entry
            t = self._pool_thread
            idle = not self._pool_busy and time.monotonic() - t0 > 0.05  # it is not making one
            if t is None or not t.is_alive() or idle or cancel.wait(0.01):
                return None

    def _recycle(self, entry: tuple[tx.Region, list[torch.Tensor]]) -> None:
        """A host buffer no longer needed: kept registered in the pool if it has room, else freed."""
        with self._host_lock:
            if len(self._host_pool) < self.config.host_copies_pooled and not self._hb_stop.is_set():
                entry[0].set_progress(0)
                entry[0].set_version(-1)
                self._host_pool.append(entry)
                return
        entry[0].close()

    def _host_like(self, touch: bool) -> list[torch.Tensor]:
        """Host tensors shaped like the registered ones (pinned for CUDA ones); ``touch``: write
        every page now (first touch of fresh memory is slow: 0.3-1 GB/s on a VM)."""
        pin = any(t.is_cuda for t in self._tensors) and torch.cuda.is_available()
        copies = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in self._tensors]
        if touch:
            for c in copies:
                c.zero_()
        return copies

    def _new_host_buffer(self, touch: bool) -> tuple[tx.Region, list[torch.Tensor]]:
        """Host tensors shaped like the registered ones, registered with the transport.
        ``touch``: write every page now (first touch of fresh memory is slow: 0.3-1 GB/s on a VM),
        so that the offload that uses the buffer later copies at memory speed."""
        copies = self._host_like(touch)
        region = tx.Region.register(copies, self._layout, self.config)
        self.host_buffers_allocated += 1
        return region, copies

    def _start_pool(self) -> None:
        """Keep ``host_copies_pooled`` retention buffers ready (not for spot handles: the server
        never asks them to offload). The first is made here, inside ``register``, so that even the
        first version's retention copy runs at memory speed; the rest in the background."""
        if self.spot or self.config.host_copies_pooled <= 0:
            return
        try:
            entry = self._new_host_buffer(touch=True)
        except Exception:  # noqa: BLE001 - an offload allocates inline instead
            log.warning("model=%s shard=%d: could not prepare a retention buffer", self.model, self.shard,
                        exc_info=True)
        else:
            with self._host_lock:
                self._host_pool.append(entry)
        self._pool_wake.set()
        self._pool_thread = threading.Thread(target=self._pool_loop, name=f"tensorhub-pool-{self.client_id}",
                                             daemon=True)
        self._pool_thread.start()

    def _pool_loop(self) -> None:
        while True:
            self._pool_wake.wait()
            self._pool_wake.clear()
            if not self._pool_urgent.is_set():
                # A retention copy just took the pooled buffer. The host copy that the next commit
                # frees usually refills the pool first: wait for that instead of allocating and
                # touching a fresh buffer (which competes with this process's reads for the CPU and
                # the memory bus, and is freed again at the next drop), unless an offload needs one.
                self._pool_urgent.wait(self.config.host_pool_refill_delay_s)
            while not self._hb_stop.is_set():
                with self._host_lock:
                    if len(self._host_pool) >= self.config.host_copies_pooled:
                        break
                self._pool_busy = True
                self._pool_urgent.clear()
                try:
                    entry = self._new_host_buffer(touch=True)
                except Exception:  # noqa: BLE001 - an offload allocates inline instead
                    log.warning("model=%s shard=%d: could not prepare a retention buffer", self.model,
                                self.shard, exc_info=True)
                    break
                finally:
                    self._pool_busy = False
                with self._host_lock:
                    keep = not self._hb_stop.is_set() and len(self._host_pool) < self.config.host_copies_pooled
                    if keep:
                        self._host_pool.append(entry)
                if not keep:
                    entry[0].close()
            if self._hb_stop.is_set():
                return

    def _drop_host_copy(self, version: int) -> None:
        with self._host_lock:
            entry = self._host.pop(version, None)
        if entry is not None:
            self._recycle(entry)  # back to the pool (fresh memory is slow to touch) or freed
            log.info("model=%s version=%d shard=%d host copy freed", self.model, version, self.shard)
