"""Seeds as deltas (``Config.seed_deltas``): a publisher's offers, a seeder's rebuild.

Two parts of a handle, one per side of the slow link (the codec: :mod:`tensorhub.transport.
delta`; the server's matching: :mod:`tensorhub.core.deltas`)::

    trainer (dc a)  publish(v) -> [host copy of v-1, of v] -> encode -> delta buffer (registered)
                    -> OfferDelta(v, base v-1)
    seeder (dc b)   SeedAhead(v), staging copy holds v-1 -> FindDelta(v, v-1) -> read the delta's
                    units across (checked per unit, as any read) -> rebuild v in scratch from
                    v-1 (checked against v's digest) -> the staging copy's read of v copies it
                    locally; any failure: the read crosses as before (the full seed)

:class:`Offers` (a handle that publishes): after each ``publish`` a background thread copies the
published tensors to a host buffer (legal: they may not change while published; ``unpublish``
waits for that copy, which is memory speed, and never for the encode), encodes the version
against the previous one it copied, writes the delta into its registered buffer (hidden first:
the control block's progress goes to 0 and its version to the new one only once the bytes and
checksums are in, so a reader of the previous delta fails its read and falls back) and offers
it. Memory: two host copies of the shard and one buffer of ``seed_delta_ratio_max`` of it.

:class:`Seeds` (a seeder's handle, used by its :class:`~tensorhub.handle.staging.Staging` before
a seed's read): finds the offer, reads it, rebuilds into scratch tensors (one more host copy of
the shard, kept) and hands the staging copy a :class:`Prepared` source; the read that follows
takes it (:meth:`tensorhub.handle.reads.ReadSession.pull_range`) whatever source the server
assigned. Every failure is logged and counted (:attr:`Seeds.fallbacks`), never raised.

Locks: each part owns one leaf lock (``Offers._lock`` guards its buffers, taken by its thread
while it reads the published tensors and by ``unpublish`` to wait for that; ``Seeds`` runs in
the staging copy's one prefetch thread and keeps no lock).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Optional

import torch

from tensorhub import errors
from tensorhub import transport as tx
from tensorhub.core import messages as m
from tensorhub.layout import Layout, checksum_all
from tensorhub.transport import delta, shm
from tensorhub.transport.nixl import Region, complete_control

log = logging.getLogger("tensorhub.client")


def delta_capacity(total_bytes: int, ratio_max: float) -> int:
    """Bytes of the buffer that holds a delta of a shard of ``total_bytes`` (both sides)."""
    return max(1, min(total_bytes, int(total_bytes * ratio_max)))


def delta_layout(capacity: int, config) -> Layout:
    """The layout of a delta buffer: one uint8 tensor of ``capacity`` bytes (both sides)."""
    return Layout.build([("delta", torch.empty(capacity, dtype=torch.uint8))], config.unit_bytes,
                        config.pack_below_bytes)


def _units_for(layout: Layout, nbytes: int) -> int:
    total, k = 0, 0
    while total < nbytes and k < layout.unit_count:
        total += layout.unit_nbytes(k)
        k += 1
    return k


class Offers:
    """A publisher's deltas (see the module docstring). ``tensors``/``layout``: what it holds
    now (a callable each: a swap may exchange them); ``port``: its server port."""

    def __init__(self, *, client_id: str, model: str, shard: int, config, port, held) -> None:
        self.client_id, self.model, self.shard, self.config = client_id, model, shard, config
        self._port = port
        self._held = held
        self._lock = threading.Lock()
        self._stop = threading.Event()
        """unpublish() wants the published tensors back: a copy of them in progress stops."""
        self._live: Optional[int] = None
        """The version the handle publishes now (under ``_lock``): a job copies only that one."""
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._prev: Optional[list[torch.Tensor]] = None
        self._prev_version: Optional[int] = None
        self._cur: Optional[list[torch.Tensor]] = None
        self._region: Optional[Region] = None
        self.offered: list[tuple[int, int, int]] = []
        """(version, base, bytes) of every delta offered, oldest first (the last 64)."""

    def published(self, version: int) -> "concurrent.futures.Future":
        """``version`` was just published: copy, encode and offer it in the background."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"tensorhub-delta-{self.client_id}")
        with self._lock:
            self._live = version
        return self._executor.submit(self._job, version)

    def unpublishing(self) -> None:
        """Before the tensors are given back to the caller: a copy of them in progress stops
        (the next version then gets no delta) and is waited for; the encode is not. A job that
        has not started yet finds the version gone and copies nothing."""
        self._stop.set()
        with self._lock:
            self._live = None
            self._stop.clear()

    def close(self) -> None:
        self._stop.set()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        if self._region is not None:
            self._region.close()
            self._region = None

    def _job(self, version: int) -> None:
        tensors, layout = self._held()
        with self._lock:
            if self._live != version:
                self._prev_version = None  # unpublished before this job started: nothing to copy
                return
            if self._cur is None:
                self._cur = [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in tensors]
            for c, t in zip(self._cur, tensors):
                if self._stop.is_set():
                    self._prev_version = None  # half copied: the next version gets no delta
                    return
                c.copy_(t)
        base, prev = self._prev_version, self._prev
        self._prev, self._cur, self._prev_version = self._cur, prev, version
        try:
            if base is None or base >= version:
                # No older copy: no delta of this one, but the promise of the next one's, so
                # that its seeders wait for it (DeltaPending) instead of crossing in full.
                capacity = delta_capacity(layout.total_bytes, self.config.seed_delta_ratio_max)
                self._port.call(m.OfferDelta(self.client_id, version, -1, b"", 0, capacity))
                return
            self._offer(version, base, prev, layout)
        except (errors.TensorHubError, OSError) as e:
            log.info("model=%s shard=%d: no delta of version %d: %s", self.model, self.shard, version, e)

    def _offer(self, version: int, base: int, prev: list[torch.Tensor], layout: Layout) -> None:
        buf = delta.encode(delta.segments(prev), delta.segments(self._prev))
        capacity = delta_capacity(layout.total_bytes, self.config.seed_delta_ratio_max)
        if len(buf) > capacity:
            log.info("model=%s shard=%d: the delta of version %d is %d bytes, over %d: the full seed crosses",
                     self.model, self.shard, version, len(buf), capacity)
            return
        region = self._buffer(capacity)
        region.set_progress(0)  # readers of the previous delta fail their read from here on
        region.set_version(version)
        region.tensors[0][:len(buf)].copy_(torch.frombuffer(bytearray(buf), dtype=torch.uint8))
        region.publish_complete(version, checksum_all(region.tensors, region.layout))
        reply = self._port.call(m.OfferDelta(self.client_id, version, base, tx.encode_endpoint(region.endpoint()),
                                             len(buf), capacity))
        if isinstance(reply, m.ErrorReply):
            log.info("model=%s shard=%d: delta of version %d not taken: %s", self.model, self.shard, version,
                     reply.message)
            return
        self.offered = (self.offered + [(version, base, len(buf))])[-64:]
        log.info("model=%s shard=%d: offered version %d as a delta of %d bytes against %d (%.4f of the shard)",
                 self.model, self.shard, version, len(buf), base, len(buf) / max(1, layout.total_bytes))

    def _buffer(self, capacity: int) -> Region:
        if self._region is None or self._region.layout.total_bytes != capacity:
            if self._region is not None:
                self._region.close()
            layout = delta_layout(capacity, self.config)
            self._region = Region.register([torch.zeros(capacity, dtype=torch.uint8)], layout, self.config)
        return self._region


@dataclasses.dataclass
class Prepared:
    """A version rebuilt from a delta, for the staging copy's next read of it."""

    version: int
    source: shm.LocalSource
    delta_bytes: int


class _Rebuilt:
    """What :class:`~tensorhub.transport.shm.LocalSource` reads of a region: tensors and a
    control block (complete)."""

    def __init__(self, tensors: list[torch.Tensor], control: torch.Tensor) -> None:
        self.tensors = tensors
        self.control = control
        self._closed = False


class Seeds:
    """A seeder's side (see the module docstring), used from its staging copy's prefetch
    thread only. ``config``, ``port``: the handle's."""

    def __init__(self, *, config, port) -> None:
        self.config = config
        self._port = port
        self._region: Optional[Region] = None
        self._source: Optional[tuple[bytes, tx.Source]] = None
        self._scratch: Optional[list[torch.Tensor]] = None
        self.applied: list[tuple[int, int, int]] = []
        """(version, base, delta bytes) of every seed rebuilt from a delta (the last 64)."""
        self.fallbacks: list[tuple[int, str]] = []
        """(version, why) of every seed that crossed in full although a delta was looked for."""

    def prepare(self, stage, version: int) -> Optional[Prepared]:
        """The staging copy ``stage`` (a Hub) is about to read ``version``: rebuild it from a
        delta against the version it holds if one is offered. None: read it as usual."""
        base = stage.version
        standing = stage._standing()
        if base is None or base >= version or not standing.complete:
            return None
        tensors, layout = stage._memory.tensors, stage._memory.layout
        if any(t.device.type != "cpu" for t in tensors):
            return None
        try:
            reply = self._find(stage.client_id, version, base)
            if reply.capacity != delta_capacity(layout.total_bytes, self.config.seed_delta_ratio_max):
                raise errors.DeltaRejected(f"a delta buffer of {reply.capacity} bytes, not the one of this shard")
            buf = self._read(reply, version)
            if self._scratch is None:
                self._scratch = [torch.empty_like(t) for t in tensors]
            out, sums = delta.rebuild(buf, tensors, layout, scratch=self._scratch)
        except errors.TensorHubError as e:
            why = f"{type(e).__name__}: {e}"
            self.fallbacks = (self.fallbacks + [(version, why)])[-64:]
            log.info("model=%s shard=%d: version %d crosses in full (no delta against %d: %s)", stage.model,
                     stage.shard, version, base, why)
            return None
        self.applied = (self.applied + [(version, base, reply.nbytes)])[-64:]
        log.info("model=%s shard=%d: version %d rebuilt from a %d-byte delta against %d", stage.model, stage.shard,
                 version, reply.nbytes, base)
        src = shm.LocalSource(_Rebuilt(out, complete_control(layout, version, sums)), f"delta:{reply.source_id}")
        return Prepared(version, src, reply.nbytes)

    def _find(self, client_id: str, version: int, base: int) -> m.DeltaAt:
        """The offer, asked again while the server says it is coming (``DeltaPending``), for
        up to ``seed_delta_wait_s``."""
        deadline = time.monotonic() + self.config.seed_delta_wait_s
        pause = 0.01
        while True:
            reply = self._port.call(m.FindDelta(client_id, version, base))
            if not isinstance(reply, m.ErrorReply):
                return reply
            err = errors.from_code(reply.code, reply.message)
            if not isinstance(err, errors.DeltaPending) or time.monotonic() + pause > deadline:
                raise err
            time.sleep(pause)
            pause = min(2 * pause, 0.1)

    def _read(self, at: m.DeltaAt, version: int) -> memoryview:
        """The delta's first ``at.nbytes`` bytes, read across and checked unit by unit."""
        layout = delta_layout(at.capacity, self.config)
        if self._region is None or self._region.layout.total_bytes != at.capacity:
            if self._region is not None:
                self._region.close()
            self._region = Region.register([torch.zeros(at.capacity, dtype=torch.uint8)], layout, self.config)
        if self._source is None or self._source[0] != at.endpoint:
            if self._source is not None:
                self._source[1].close()
            try:
                self._source = (at.endpoint, tx.open_source(at.endpoint, config=self.config))
            except errors.TransferError as e:
                raise errors.SourceUnreachable(str(e)) from e
        try:
            tx.pull(self._region, self._source[1], layout, expect_version=version, config=self.config,
                    end_unit=_units_for(layout, at.nbytes))
        except (errors.TransferError, errors.ChecksumMismatch) as e:
            self._source[1].close()
            self._source = None
            raise errors.DeltaRejected(f"the delta's read failed: {e}") from e
        return memoryview(self._region.tensors[0][:at.nbytes].numpy())

    def close(self) -> None:
        if self._source is not None:
            self._source[1].close()
            self._source = None
        if self._region is not None:
            self._region.close()
            self._region = None
        self._scratch = None
