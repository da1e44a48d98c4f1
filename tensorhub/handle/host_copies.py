"""Host copies of a handle's shard: retention offloads, copies made ahead, the buffer pool.

A part of a handle (:class:`tensorhub.handle.hub.Hub` holds one as ``host_copies``): host memory
that holds a version for the server's retention rules. It owns its lock and threads and gets
what it needs of the handle passed in; whether a copy is wanted is the core's rule
(:func:`tensorhub.core.background.host_copy_wanted`), applied by the handle.

- **Offload** (:meth:`HostCopies.offload`, on ``OffloadOrder``): the last non-spot holder of a retained version
  (or a seeder's staging copy holding its datacenter's newest copy) copies its tensors to a host
  buffer and registers it before it unpublishes; the server publishes that host copy.
- **Made ahead** (:meth:`HostCopies.start_copy`, on ``MakeHostCopy``): the first non-spot reader of a
  retained version copies it in a background thread, so the later unpublish has nothing to copy.
- **Pool** (:meth:`HostCopies.start_pool`): ``host_copies_pooled`` registered, touched buffers
  kept ready (first touch of fresh memory is slow), refilled by freed copies before fresh ones.
  The pool thread touches a fresh buffer only while its handle is not reading (``reading``),
  unless a copy waits for that buffer: a first touch runs at 0.3-1 GB/s on a VM, takes a core
  and the memory bus, and made a same-host ``replicate()`` of 1 GiB take 0.7-8 s instead of
  0.2 s when it overlapped one (issue 27).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, NamedTuple, Optional

import torch

from tensorhub import errors
from tensorhub import transport as tx
from tensorhub.core import messages as m
from tensorhub.transport import storages

log = logging.getLogger("tensorhub.client")


TOUCH_BYTES = 16 << 20
"""The pool thread touches a fresh buffer in pieces of this size, checking between them whether
its handle reads (a piece takes 15-50 ms here)."""

_NO_RETRY = threading.Event()
_NO_RETRY.set()
"""A stop already set: one offer, no pause and retry (the next answered pulse retries)."""


def copy_to_host(copies: list[torch.Tensor], held: list[torch.Tensor]) -> None:
    """Copy the published tensors ``held`` into the host buffer ``copies``; returns once every
    byte is there. CUDA tensors are copied on a stream of the copy's own (DMA from device into
    pinned memory), so a copy made in the background overlaps the process's GPU work instead of
    queueing on its default stream, where it would wait for the trainer's queued kernels and
    hold back the ones queued after it. It waits for nothing: ``publish`` synchronized the
    devices, and the tensors do not change while published (the mutability contract). Not run
    on a GPU here (no GPU on the machines this was built on)."""
    cuda = [t for t in held if t.is_cuda]
    if not cuda:
        for dst, src in zip(copies, held):
            dst.copy_(src)
        return
    stream = torch.cuda.Stream(device=cuda[0].device)
    with torch.cuda.stream(stream):
        for dst, src in zip(copies, held):
            dst.copy_(src, non_blocking=dst.is_pinned())
    stream.synchronize()


class Held(NamedTuple):
    """What a handle holds now: its registered tensors, their layout and its region (a swap
    exchanges tensors and region, so a part asks each time)."""

    tensors: list
    layout: object
    region: object


class HostCopies:
    """Host copies of one handle and their buffer pool (see the module docstring).

    Owns ``lock`` (guards ``by_version``, ``pool`` and ``unoffered``), the pool thread and the
    background copy thread (``copying``). What it needs of its handle is passed in: who it is,
    its config and server port, what it holds now (``held``), how to take the server's notes
    (``take_notes``), how to record a copy's endpoint in the handle's machine (``record``,
    ``endpoint_of``: the machine's lock is theirs) and whether the handle is reading now
    (``reading``: the pool's background touches wait for it). It calls them holding none of its own locks,
    and takes no lock of the handle's itself."""

    def __init__(self, *, model: str, shard: int, client_id: str, keeps_copies: bool, config, port,
                 held: Callable[[], Held], take_notes: Callable[[], None],
                 record: Callable[[int, bytes], None], endpoint_of: Callable[[int], Optional[bytes]],
                 reading: Callable[[], bool] = lambda: False) -> None:
        self.model, self.shard, self.client_id, self.config = model, shard, client_id, config
        self.keeps_copies = keeps_copies
        """False for a spot or ``retains=False`` handle: the server never asks it for a copy."""
        self._port = port
        self._held = held
        self._take_notes = take_notes
        self._record = record
        self._endpoint_of = endpoint_of
        self._reading = reading
        self.lock = threading.Lock()
        """Guards ``by_version``, ``pool`` and ``unoffered`` (taken from the pulse thread too)."""
        self.by_version: dict[int, tuple[tx.Region, list[torch.Tensor]]] = {}
        """The host copies this handle serves, by version."""
        self.pool: list[tuple[tx.Region, list[torch.Tensor]]] = []
        """Registered, touched buffers ready for the next copy."""
        self.unoffered: set[int] = set()
        """Host copies whose HostCopy offer got no answer (offered again after a pulse)."""
        self.pool_wake = threading.Event()
        self._urgent = threading.Event()
        """An offload is waiting for a pooled buffer: the pool thread prepares one at once."""
        self.pool_thread: Optional[threading.Thread] = None
        self._pool_busy = False
        self._waiters = 0
        """Copies waiting for a pooled buffer now (:meth:`_pooled_buffer`): the pool thread's
        touches do not pause for a read while one waits."""
        self._stopped = threading.Event()
        self.copying: Optional[tuple[threading.Thread, threading.Event, threading.Event]] = None
        """The background copy of the version just published, and its cancel flag."""
        self.allocated = 0
        """Retention buffers allocated (touched and registered), in the background or -- when
        none was ready -- on an offload's critical path (``inline``)."""
        self.inline = 0

    def tensors_of(self, version: int) -> Optional[list[torch.Tensor]]:
        """The tensors of this handle's host copy of ``version`` (None: it keeps none)."""
        with self.lock:
            entry = self.by_version.get(version)
        return None if entry is None else entry[1]

    def held_bytes(self) -> int:
        """Bytes of host memory this handle's retention holds: its host copies and pooled buffers."""
        with self.lock:
            return sum(t.nbytes for _, ts in [*self.by_version.values(), *self.pool] for t in ts)

    def held_versions(self, versions) -> set[int]:
        """Which of ``versions`` this handle still holds a host copy of."""
        with self.lock:
            return {v for v in versions if v in self.by_version}

    def stop(self) -> None:
        """The handle closes: the pool thread ends (joined, unless it is the caller)."""
        self._stopped.set()
        self._urgent.set()
        self.pool_wake.set()
        t = self.pool_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=60.0)

    def release(self) -> list:
        """Every copy and pooled buffer, taken out to be closed by the caller."""
        with self.lock:
            entries = list(self.by_version.values()) + self.pool
            self.by_version.clear()
            self.pool.clear()
        return entries

    def offload(self, version: int) -> bytes:
        """Copy the published tensors to host memory, register that copy; returns its endpoint.
        The buffer comes from the pool the background thread keeps filled (allocated, touched and
        registered off the critical path); only when none is ready is one made here."""
        with self.lock:
            existing = self.by_version.get(version)
            if existing is not None:
                return tx.encode_endpoint(existing[0].endpoint())
            pooled = self.pool.pop() if self.pool else None
        self.pool_wake.set()  # refill behind this offload
        if pooled is None:  # the pool thread may be touching one: that finishes first
            pooled = self._pooled_buffer(threading.Event())
        if pooled is None:
            region, copies = self.new_buffer(touch=False)
            self.inline += 1
            log.info("model=%s version=%d shard=%d: no retention buffer was ready; allocating one "
                     "on the offload's path", self.model, version, self.shard)
        else:
            region, copies = pooled
        copy_to_host(copies, self._held().tensors)
        region.publish_complete(version, self._held().region.checksums() if self.config.checksums else None)
        with self.lock:
            self.by_version[version] = (region, copies)
        log.info("model=%s version=%d shard=%d offloaded to host (%d bytes)",
                 self.model, version, self.shard, self._held().layout.total_bytes)
        return tx.encode_endpoint(region.endpoint())

    def start_copy(self, version: int) -> None:
        """Start the background copy :func:`~tensorhub.core.background.host_copy_wanted` asked
        for, unless one is under way or the version is in host memory already."""
        if self.copying is not None and self.copying[0].is_alive():
            return
        with self.lock:
            if version in self.by_version:
                return
        cancel, copied = threading.Event(), threading.Event()
        t = threading.Thread(target=self._copy, args=(version, cancel, copied), daemon=True,
                             name=f"tensorhub-hostcopy-{self.client_id}")
        self.copying = (t, cancel, copied)
        t.start()

    def stop_copy(self, cancel_it: bool = True) -> None:
        """Before the published tensors may change: wait until the background copy no longer
        reads them. A copy still waiting for a ready buffer is cancelled (``cancel_it``); one that
        is copying (memory speed, into a touched buffer) finishes first."""
        if self.copying is not None:
            t, cancel, copied = self.copying
            if cancel_it:
                cancel.set()
            while t.is_alive() and not copied.wait(0.05):
                pass
            cancel.set()  # copied: what is left is offering it again, which stops now
            t.join()
            self.copying = None

    def _copy(self, version: int, cancel: threading.Event, copied: threading.Event) -> None:
        t0 = time.perf_counter()
        try:
            # Publishing this version may have pushed an older one out of retention: free its
            # host copy first, so this copy reuses that buffer (fresh memory is slow to touch).
            self._take_notes()
        except errors.TensorHubError:
            pass
        entry = self._pooled_buffer(cancel, refill=False)
        if entry is None:  # cancelled before a buffer was ready: the last holder will offload
            return
        region, copies = entry
        try:
            copy_to_host(copies, self._held().tensors)  # a touched buffer; unpublish() waits for this part
            region.publish_complete(version, self._held().region.checksums() if self.config.checksums else None)
            endpoint = tx.encode_endpoint(region.endpoint())
        except Exception:  # noqa: BLE001 - the last holder's offload still keeps the version
            log.warning("model=%s version=%d shard=%d: background host copy failed", self.model, version,
                        self.shard, exc_info=True)
            self._recycle(entry)
            return
        finally:
            copied.set()  # the tensors are not read any more
        with self.lock:
            self.by_version[version] = entry
        self._record(version, endpoint)
        if not self._offer(version, endpoint, cancel):
            return
        log.info("model=%s version=%d shard=%d host copy made in the background in %.3fs",
                 self.model, version, self.shard, time.perf_counter() - t0)

    def _offer(self, version: int, endpoint: bytes, stop: threading.Event) -> bool:
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
                with self.lock:
                    self.unoffered.add(version)  # offered again after a pulse the server answers
                why = "no answer"
            except Exception:  # noqa: BLE001 - refused (e.g. the server restarted): announced later
                why = "refused"
            log.info("model=%s version=%d shard=%d: host copy not offered (%s); the next announcement "
                     "carries it", self.model, version, self.shard, why, exc_info=True)
            return False
        return False

    def reoffer(self) -> None:
        """After a pulse the server answered: offer once more each host copy whose offer got no
        answer (it would stay unlisted, so never dropped, past retention). Pulse thread."""
        with self.lock:
            pending = sorted(v for v in self.unoffered if v in self.by_version)
            self.unoffered.clear()
        for version in pending:
            endpoint = self._endpoint_of(version)
            if endpoint is not None:
                self._offer(version, endpoint, _NO_RETRY)

    def _take_pooled(self, refill: bool = True) -> Optional[tuple[tx.Region, list[torch.Tensor]]]:
        """A pooled buffer taken out (``refill``: the pool thread woken to refill in its own
        time), or None. Called under the lock."""
        if not self.pool:
            return None
        entry = self.pool.pop()
        if refill:
            self.pool_wake.set()
        return entry

    def _pooled_buffer(self, cancel: threading.Event,
                       refill: bool = True) -> Optional[tuple[tx.Region, list[torch.Tensor]]]:
        """A ready retention buffer; while the pool thread is preparing one, wait for it (a
        second fresh buffer would only compete with it for first touches), unless cancelled.
        ``refill`` False (a copy made ahead): taking the pooled buffer does not wake the pool
        thread at all. The next commit frees a retained copy into the pool, and no offload waits
        meanwhile (the copy made ahead is the version's retention copy); a refill after
        ``host_pool_refill_delay_s`` would, with steps longer than that delay, touch a fresh buffer
        every version and close the freed copy (and keep one more buffer than needed). The price:
        an offload the handle must make before that commit (it became the last holder of another
        retained version, e.g. the reader that copied ahead died) finds no ready buffer and waits
        for a fresh one to be touched, on its path.

        A buffer taken from the pool at once is not urgent: the pool refills after
        ``host_pool_refill_delay_s``, usually from the host copy the next commit frees. Waking the
        pool thread urgently then made it touch a fresh buffer at once and the freed copy find the
        pool full and be closed: a fresh 1 GiB buffer and a close every version (issue 27)."""
        with self.lock:
            entry = self._take_pooled(refill)
            if entry is not None:
                return entry
            self._waiters += 1
        try:
            self._urgent.set()
            self.pool_wake.set()
            t0 = time.monotonic()
            while True:
                with self.lock:
                    entry = self._take_pooled(refill)
                if entry is not None:
                    return entry
                t = self.pool_thread
                idle = not self._pool_busy and time.monotonic() - t0 > 0.05  # it is not making one
                if t is None or not t.is_alive() or idle or cancel.wait(0.01):
                    return None
        finally:
            with self.lock:
                self._waiters -= 1

    def _recycle(self, entry: tuple[tx.Region, list[torch.Tensor]]) -> None:
        """A host buffer no longer needed: kept registered in the pool if it has room, else freed."""
        with self.lock:
            if len(self.pool) < self.config.host_copies_pooled and not self._stopped.is_set():
                entry[0].set_progress(0)
                entry[0].set_version(-1)
                self.pool.append(entry)
                return
        entry[0].close()

    def host_like(self, touch: bool, background: bool = False) -> list[torch.Tensor]:
        """Host tensors shaped like the registered ones (pinned for CUDA ones); ``touch``: write
        every page now (first touch of fresh memory is slow: 0.3-1 GB/s on a VM). ``background``
        (the pool thread): between pieces of :data:`TOUCH_BYTES`, wait while the handle reads and
        no copy waits for a buffer."""
        held = self._held().tensors
        pin = any(t.is_cuda for t in held) and torch.cuda.is_available()
        copies = None
        if self.config.same_host and not pin:
            try:  # made in shared memory: registering moves nothing (the same-host tier serves it)
                copies = storages.shared_empty(held)
            except (OSError, RuntimeError):
                copies = None  # /dev/shm full: private memory, moved at registration if it can be
        if copies is None:
            copies = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in held]
        if touch:
            for c in copies:
                flat = c.view(-1).view(torch.uint8) if c.numel() else c
                for at in range(0, flat.numel(), TOUCH_BYTES):
                    if background:
                        self._wait_not_reading()
                    flat[at:at + TOUCH_BYTES].zero_()
        return copies

    def _wait_not_reading(self) -> None:
        """The pool thread: wait while the handle reads, unless a copy waits for a buffer
        (``_waiters``: an offload inside that very read may be the one waiting) or the handle
        closes."""
        while self._reading() and not self._waiters and not self._stopped.is_set():
            self._stopped.wait(0.005)

    def new_buffer(self, touch: bool, background: bool = False) -> tuple[tx.Region, list[torch.Tensor]]:
        """Host tensors shaped like the registered ones, registered with the transport.
        ``touch``: write every page now (first touch of fresh memory is slow: 0.3-1 GB/s on a VM),
        so that the offload that uses the buffer later copies at memory speed; ``background``:
        as :meth:`host_like`'s."""
        copies = self.host_like(touch, background)
        region = tx.Region.register(copies, self._held().layout, self.config)
        self.allocated += 1
        return region, copies

    def start_pool(self) -> None:
        """Keep ``host_copies_pooled`` retention buffers ready (not for spot handles: the server
        never asks them to offload). The first is made here, inside ``register``, so that even the
        first version's retention copy runs at memory speed; the rest in the background."""
        if not self.keeps_copies or self.config.host_copies_pooled <= 0:
            return
        try:
            entry = self.new_buffer(touch=True)
        except Exception:  # noqa: BLE001 - an offload allocates inline instead
            log.warning("model=%s shard=%d: could not prepare a retention buffer", self.model, self.shard,
                        exc_info=True)
        else:
            with self.lock:
                self.pool.append(entry)
        self.pool_wake.set()
        self.pool_thread = threading.Thread(target=self._pool_loop, name=f"tensorhub-pool-{self.client_id}",
                                             daemon=True)
        self.pool_thread.start()

    def _pool_loop(self) -> None:
        while True:
            self.pool_wake.wait()
            self.pool_wake.clear()
            if not self._urgent.is_set():
                # A retention copy just took the pooled buffer. The host copy that the next commit
                # frees usually refills the pool first: wait for that instead of allocating and
                # touching a fresh buffer (which competes with this process's reads for the CPU and
                # the memory bus, and is freed again at the next drop), unless an offload needs one.
                self._urgent.wait(self.config.host_pool_refill_delay_s)
            while not self._stopped.is_set():
                with self.lock:
                    if len(self.pool) >= self.config.host_copies_pooled:
                        break
                self._pool_busy = True
                self._urgent.clear()
                try:
                    entry = self.new_buffer(touch=True, background=True)
                except Exception:  # noqa: BLE001 - an offload allocates inline instead
                    log.warning("model=%s shard=%d: could not prepare a retention buffer", self.model,
                                self.shard, exc_info=True)
                    break
                finally:
                    self._pool_busy = False
                with self.lock:
                    keep = not self._stopped.is_set() and len(self.pool) < self.config.host_copies_pooled
                    if keep:
                        self.pool.append(entry)
                if not keep:
                    entry[0].close()
            if self._stopped.is_set():
                return

    def drop(self, version: int) -> None:
        with self.lock:
            entry = self.by_version.pop(version, None)
        if entry is not None:
            self._recycle(entry)  # back to the pool (fresh memory is slow to touch) or freed
            log.info("model=%s version=%d shard=%d host copy freed", self.model, version, self.shard)
