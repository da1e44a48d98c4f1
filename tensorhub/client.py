"""The handle users program against: one shard of one replica of one model.

    hub = tensorhub.open("policy", shard=rank, num_shards=tp, replica="trainer")
    hub.register(model.state_dict())   # the tensors this shard holds (ordered, fixed layout)
    hub.publish(step)                  # trainer: the tensors hold version `step`; I won't write them
    hub.unpublish()                    # returns once no reader reads them any more
    hub.replicate("latest")            # rollout: fetch into the registered tensors; now a holder
    hub.update("latest")               # no-op if current, else unpublish + replicate
    hub.close()

Every method blocks until done and raises a typed :mod:`tensorhub.errors` error. Each has an
asyncio twin with an ``a`` prefix (``await hub.aupdate("latest")``) that runs the blocking call
in a worker thread. One handle is not meant to be used by two threads at once.

The handle talks to the reference server through a :class:`~tensorhub.port.ServerPort` and
moves bytes with the NIXL transport; it imports no actor.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
import threading
import time
import uuid
from typing import Mapping, Optional, Sequence, Union

import torch

from tensorhub import errors, metrics
from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.layout import Layout, checksum_all, checksum_unit
from tensorhub.port import ServerPort
from tensorhub import transport as tx

log = logging.getLogger(__name__)

_SOURCES_KEPT = 4
"""Sources a handle keeps open across reads (its recent holders)."""

NamedTensors = Union[Mapping[str, torch.Tensor], Sequence[tuple[str, torch.Tensor]]]


class HubState(enum.Enum):
    OPEN = "open"  # not registered yet
    IDLE = "idle"  # registered, holds nothing visible
    PUBLISHED = "published"
    CLOSED = "closed"


@dataclasses.dataclass(frozen=True)
class ReadStats:
    """What one replicate/update did."""

    action: str
    """``"replicated"`` (bytes moved) or ``"noop"`` (update: already current)."""
    version: int
    seconds: float = 0.0
    """Wall time of the whole call (queueing, drain of the old version, offload, transfer)."""
    transfer_s: float = 0.0
    """Time from the first assignment to the last byte."""
    bytes: int = 0
    sources: tuple[str, ...] = ()
    """Source client ids in order (more than one after a failover)."""
    partial_source: bool = False
    """The first source was itself still receiving (pipeline replication)."""
    cross_datacenter: bool = False
    failovers: int = 0
    finished_at: float = 0.0
    """Wall-clock time (``time.time()``) when the last byte was in place."""

    @property
    def gbps(self) -> float:
        """Transfer rate (bytes over ``transfer_s``)."""
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


class Hub:
    """One shard handle. Build with :func:`tensorhub.open`."""

    def __init__(self, model: str, port: ServerPort, *, shard: int = 0, num_shards: int = 1,
                 replica: Optional[str] = None, datacenter: Optional[str] = None, spot: bool = False,
                 config: Optional[Config] = None) -> None:
        if not isinstance(model, str) or not model:
            raise errors.ConfigError("model must be a non-empty string")
        if not isinstance(num_shards, int) or num_shards < 1 or not isinstance(shard, int) or not 0 <= shard < num_shards:
            raise errors.ConfigError(f"shard {shard!r} of {num_shards!r} is out of range")
        if num_shards > 1 and not replica:
            raise errors.ConfigError("a sharded replica needs replica=<name shared by its shards>")
        self.model = model
        self.shard = shard
        self.num_shards = num_shards
        self.replica = replica or f"replica-{uuid.uuid4().hex[:8]}"
        self.datacenter = datacenter or "default"
        self.spot = bool(spot)
        self.config = config or Config()
        self.client_id = f"{model}/{self.replica}/{shard}/{uuid.uuid4().hex[:6]}"
        self._port = port
        self._state = HubState.OPEN
        self._layout: Optional[Layout] = None
        self._tensors: list[torch.Tensor] = []
        self._region: Optional[tx.Region] = None
        self._register_msg: Optional[m.Register] = None
        self._published: Optional[int] = None
        self._checksums: list[int] = []
        self._host: dict[int, tuple[tx.Region, list[torch.Tensor]]] = {}
        self._host_pool: list[tuple[tx.Region, list[torch.Tensor]]] = []
        self._sources: "collections.OrderedDict[bytes, tx.Source]" = collections.OrderedDict()
        """Sources kept open across reads, by endpoint (see ``_open_source``)."""
        self._seq = 0
        self._round: tuple[int, int] = (-1, -1)
        """(seq, version) of the last round the server resolved for this handle."""
        self._progress_units = 0
        self._reading = False
        self._current_source = ""
        self._hb_stop = threading.Event()
        self._hb_thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()  # one blocking call at a time
        self._host_lock = threading.Lock()  # host copies are freed from the heartbeat thread

    # ------------------------------------------------------------------ public API

    @property
    def state(self) -> HubState:
        return self._state

    @property
    def version(self) -> Optional[int]:
        """The version this handle currently publishes, or None."""
        return self._published

    def register(self, tensors: NamedTensors) -> None:
        """Declare the tensors this shard holds, in order (a state dict works). Registers their
        memory with the transport once. The layout must match the model's layout for this shard
        index (``LayoutMismatch`` otherwise, nothing registered). Call once per handle."""
        with self._lock:
            self._check_open()
            if self._state is not HubState.OPEN:
                raise errors.InvalidState("register() was already called on this handle")
            layout = Layout.for_config(tensors, self.config)
            items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
            ts = [t for _, t in items]
            region = tx.Region.register(ts, layout, self.config)
            msg = m.Register(
                client_id=self.client_id, model=self.model, replica_id=self.replica, shard=self.shard,
                num_shards=self.num_shards, layout=_layout_info(layout),
                endpoint=tx.encode_endpoint(region.endpoint()), datacenter=self.datacenter, spot=self.spot,
                process=self._port.process(),
            )
            try:
                self._expect(self._port.call(msg), m.Ok)
            except BaseException:
                region.close()
                raise
            self._layout, self._tensors, self._region, self._register_msg = layout, ts, region, msg
            self._state = HubState.IDLE
            self._start_heartbeat()
            log.info("model=%s replica=%s shard=%d registered %d tensors, %d bytes, %d units",
                     self.model, self.replica, self.shard, len(ts), layout.total_bytes, layout.unit_count)

    def publish(self, version: int) -> None:
        """Declare that the registered tensors hold ``version``; from now until ``unpublish()``
        returns the caller must not write them. Idempotent for the same version. Raises
        ``InvalidState`` if another version is published (unpublish first)."""
        with self._lock:
            self._check_registered()
            if not isinstance(version, int) or isinstance(version, bool) or version < 0:
                raise errors.BadVersionSpec(f"publish() needs an int version >= 0, got {version!r}")
            if self._published == version:
                return
            if self._published is not None:
                raise errors.InvalidState(f"version {self._published} is published: unpublish() first")
            need_sums = self.config.checksums or self.config.verify_mutability
            sums = checksum_all(self._tensors, self._layout) if need_sums else []
            self._region.publish_complete(version, sums or None)
            try:
                self._expect(self._call(m.Publish(self.client_id, version)), m.Ok)
            except BaseException:
                self._region.set_progress(0)
                self._region.set_version(-1)
                raise
            self._checksums = sums
            self._published = version
            metrics.record_publish(self.model)
            self._state = HubState.PUBLISHED
            log.info("model=%s replica=%s shard=%d published version %d", self.model, self.replica, self.shard, version)

    def unpublish(self) -> None:
        """Hide this holder from new readers and wait until its in-flight readers finish (and,
        for the last non-spot copy of a retained version, until a host copy is published).
        After it returns the caller may write the tensors. Idempotent."""
        with self._lock:
            self._check_registered()
            if self._published is None:
                return
            reply = self._call(m.Unpublish(self.client_id), wait=True)
            self._finish_unpublish(reply)

    def replicate(self, spec: m.VersionSpec = "latest") -> ReadStats:
        """Fetch version ``spec`` (an int, ``"latest"``, ``"latest-k"``) into the registered
        tensors, then serve it as a holder. Raises ``InvalidState`` while a version is published
        (use ``update()``), ``VersionNotFound`` / ``VersionExpired`` / ``VersionLost``."""
        with self._lock:
            self._check_registered()
            if self._published is not None:
                raise errors.InvalidState(f"version {self._published} is published: unpublish() first, or update()")
            return self._replicate(spec, update=False)

    def update(self, spec: m.VersionSpec = "latest") -> ReadStats:
        """Atomically move to ``spec``: a no-op (``action="noop"``) when this handle already
        publishes that version; otherwise drain and unpublish the current version, then
        replicate the new one. If the version is lost mid-read and ``spec`` is relative,
        retries once with the newest available version."""
        with self._lock:
            self._check_registered()
            try:
                return self._replicate(spec, update=True)
            except errors.VersionLost:
                if isinstance(spec, int):
                    raise
                # Same round: the server keeps every shard of this replica in one transaction
                # (it re-resolves the round only if no sibling already holds its version).
                log.info("model=%s shard=%d update(%r): version lost, retrying", self.model, self.shard, spec)
                return self._replicate(spec, update=True, same_round=True)

    def close(self) -> None:
        """Unpublish (draining readers), leave the server, release registrations. A second
        close raises ``HandleClosed``."""
        with self._lock:
            if self._state is HubState.CLOSED:
                raise errors.HandleClosed("handle already closed")
            try:
                if self._published is not None:
                    self._finish_unpublish(self._call(m.Unpublish(self.client_id), wait=True))
            finally:
                self._state = HubState.CLOSED
                self._hb_stop.set()
                try:
                    if self._register_msg is not None:
                        self._port.call(m.Leave(self.client_id))
                except errors.TensorHubError:
                    pass
                finally:
                    self._release()

    # asyncio twins
    async def aregister(self, tensors: NamedTensors) -> None:
        await asyncio.to_thread(self.register, tensors)

    async def apublish(self, version: int) -> None:
        await asyncio.to_thread(self.publish, version)

    async def aunpublish(self) -> None:
        await asyncio.to_thread(self.unpublish)

    async def areplicate(self, spec: m.VersionSpec = "latest") -> ReadStats:
        return await asyncio.to_thread(self.replicate, spec)

    async def aupdate(self, spec: m.VersionSpec = "latest") -> ReadStats:
        return await asyncio.to_thread(self.update, spec)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> "Hub":
        return self

    def __exit__(self, *exc) -> None:
        if self._state is not HubState.CLOSED:
            self.close()

    # ------------------------------------------------------------------ internals

    def _replicate(self, spec: m.VersionSpec, update: bool, same_round: bool = False) -> ReadStats:
        t0 = time.perf_counter()
        reply = self._begin_read(spec, update, same_round=same_round)
        if isinstance(reply, m.NoChange):
            st = ReadStats(action="noop", version=reply.version, seconds=time.perf_counter() - t0)
        else:
            st = self._read(reply, t0)
        metrics.record_read(self.model, st.action, st.seconds, st.transfer_s, st.bytes, st.failovers)
        return st

    def _begin_read(self, spec: m.VersionSpec, update: bool, same_round: bool = False) -> Union[m.Assignment, m.NoChange]:
        """Phase 1 of a read: resolve, drain the old version if updating, get a source.

        Every user call is one round (``seq``): the shards of a replica count their calls alike,
        so round ``seq`` is one transaction across them. An internal retry stays in its round
        (``same_round``)."""
        if not same_round:
            self._seq += 1
            self._recheck_partial()
        req = m.Replicate(self.client_id, spec, seq=self._seq, update=update,
                          resume_version=self._region.version, resume_units=self._partial_units())
        reply = self._call_until_settled(req)
        if isinstance(reply, (m.NoChange, m.Assignment)):
            self._round = (self._seq, reply.version)
        if isinstance(reply, m.NoChange):
            return reply
        if isinstance(reply, m.OffloadOrder):
            reply = self._call(self._offload(reply.version), wait=True)
            if isinstance(reply, m.UnpublishDone):
                # The server restarted during the offload: we are unpublished now; ask again.
                self._published = None
                self._state = HubState.IDLE
                reply = self._call_until_settled(req)
        if update and self._published is not None:
            # The server drained and unpublished the old version before answering.
            self._published = None
            self._state = HubState.IDLE
        return self._expect(reply, m.Assignment)

    def _call_until_settled(self, req: m.Replicate) -> object:
        """Replicate, retried while the server says "not yet" (sibling shards still
        registering, holders still re-announcing after a restart), up to request_timeout_s."""
        deadline = time.monotonic() + self.config.request_timeout_s
        reply = self._call(req, wait=True)
        while (isinstance(reply, m.ErrorReply) and reply.code in ("ReplicaIncomplete", "ServerRecovering")
               and time.monotonic() < deadline):
            time.sleep(0.1)
            reply = self._call(req, wait=True)
        return reply

    def _open_source(self, a: m.Assignment) -> tx.Source:
        """The source of ``a``, kept open across reads (opening one prepares a descriptor per
        piece of the layout: about 40 ms for a 1 GiB shard of 660 tensors, a sixth of its
        transfer). Owned by the handle: callers never close it; a failed read drops it."""
        key = a.source_endpoint
        with self._host_lock:
            src = self._sources.pop(key, None)
            if src is not None:
                self._sources[key] = src  # most recently used last
                return src
        try:
            src = tx.open_source(key, config=self.config)
        except errors.TransferError as e:
            raise errors.SourceUnreachable(str(e)) from e
        with self._host_lock:
            self._sources[key] = src
            while len(self._sources) > _SOURCES_KEPT:
                self._sources.pop(next(iter(self._sources))).close()
        return src

    def _drop_source(self, a: m.Assignment) -> None:
        """A read from ``a``'s source failed: open it afresh (and load its peer's metadata
        again) if it is assigned again."""
        with self._host_lock:
            src = self._sources.pop(a.source_endpoint, None)
        if src is not None:
            src.agent.reload_remote(src.name)
            src.close()

    def _source_checksums(self, source: tx.Source, version: int) -> Optional[list[int]]:
        """The checksums of a complete source holding ``version`` (one control read), or None if
        it does not (yet) hold all of it."""
        v, progress, sums = source.read_control(self.config.source_stall_timeout_s)
        return sums if v == version and progress == self._layout.unit_count else None

    def _pull_range(self, a: m.Assignment, end_unit: int, *, source: Optional[tx.Source] = None,
                    source_sums=None, should_stop=None, on_unit=None) -> int:
        """Read units [own progress, end_unit) of ``a.version`` from ``a``'s source, without
        failover (a caller that coordinates the pipeline itself, e.g. a compiled graph, falls
        back to :meth:`_read` on error, which resumes from the same progress). ``source``: an
        open source to use (kept open); ``source_sums``: checksums of the source's units known
        final, a list or a growing :class:`~tensorhub.transport.KnownProgress` (then the
        source's control block is not read); ``should_stop``/``on_unit``: as for ``pull``."""
        if source is None:
            source = self._open_source(a)
        try:
            return tx.pull(self._region, source, self._layout, expect_version=a.version, config=self.config,
                           start_unit=self._resume_point(a.version), end_unit=end_unit, source_sums=source_sums,
                           should_stop=should_stop, on_unit=on_unit)
        except (errors.TransferError, errors.ChecksumMismatch) as e:
            self._drop_source(a)  # a source that failed is opened afresh if assigned again
            if (isinstance(e, errors.ChecksumMismatch) or source.reached or source_sums is not None
                    or isinstance(e, errors.SourceUnreachable)):
                raise
            raise errors.SourceUnreachable(str(e)) from e

    def _units_bytes(self, start: int, end: int) -> int:
        return sum(self._layout.unit_nbytes(u) for u in range(start, end))

    def _resume_point(self, version: int) -> int:
        """Units of ``version`` already in place: a read after a failover refetches nothing."""
        return self._region.progress if self._region.version == version else 0

    def _recheck_partial(self) -> None:
        """A partial read left by an earlier call is resumed only as far as it is still intact:
        between calls the handle is idle and the user may have written its tensors. Keeps the
        leading units whose bytes still match the checksums recorded when they landed (none
        without checksums)."""
        region = self._region
        if self._published is not None or region is None or region.version < 0 or region.progress == 0:
            return
        keep = 0
        if self.config.checksums:
            sums = region.checksums()
            units = self._layout.units
            while keep < region.progress and checksum_unit(self._tensors, units[keep]) == sums[keep]:
                keep += 1
        if keep < region.progress:
            log.info("model=%s shard=%d: %d of %d units kept from the earlier partial read of version %d "
                     "(the rest changed since)", self.model, self.shard, keep, region.progress, region.version)
            region.set_progress(keep)

    def _partial_units(self) -> int:
        """Units of the region's version already in place (kept across a failed read)."""
        return 0 if self._published is not None else self._region.progress

    def _read(self, reply: object, t0: float) -> ReadStats:
        a = self._expect(reply, m.Assignment)
        t_assigned = time.perf_counter()
        version = a.version
        first = a
        sources: list[str] = []
        failovers = 0
        stuck, last_progress = 0, -1
        start_units = self._resume_point(version)
        self._reading = True
        try:
            while True:
                sources.append(a.source_id)
                try:
                    self._current_source = a.source_id
                    self._pull_range(a, self._layout.unit_count)
                    finished_at = time.time()
                    break
                except (errors.TransferError, errors.ChecksumMismatch) as err:
                    failovers += 1
                    log.warning("model=%s version=%d shard=%d source %s failed at unit %d: %s",
                                self.model, version, self.shard, a.source_id, self._region.progress, err)
                    # The server first asks Ray whether the source's process is gone; a corpse is
                    # removed and does not count against the budget (failed_source_gone).
                    nxt = self._call(m.SourceFailed(self.client_id, a.source_id, self._region.progress,
                                                    unreachable=isinstance(err, errors.SourceUnreachable)),
                                     wait=True)
                    a = self._expect(nxt, m.Assignment)
                    if a.version != version:
                        raise errors.InvalidState(f"server reassigned version {a.version} during read of {version}")
                    if a.failed_source_gone:
                        continue
                    stuck = stuck + 1 if self._region.progress == last_progress else 1
                    last_progress = self._region.progress
                    if stuck > self.config.failovers_max:
                        self._call(m.ReplicateAbort(self.client_id))
                        raise errors.TransferError(
                            f"{self.model} version {version} shard {self.shard}: {stuck} live sources failed "
                            f"without progress at unit {last_progress}; last error: {err}") from err
                    time.sleep(min(0.05 * 2 ** (stuck - 1), 1.0))
            self._expect(self._call(m.ReplicateDone(self.client_id, version)), m.Ok)
        except BaseException:
            self._reading = False
            raise
        self._reading = False
        if self.config.checksums or self.config.verify_mutability:
            self._checksums = self._region.checksums() if self.config.checksums else checksum_all(self._tensors, self._layout)
        self._published = version
        self._state = HubState.PUBLISHED
        t_end = time.perf_counter()
        dt = t_end - t0
        nbytes = self._units_bytes(start_units, self._layout.unit_count)  # each unit fetched once
        log.info("model=%s version=%d shard=%d replicated %d bytes in %.3fs from %s",
                 self.model, version, self.shard, nbytes, dt, " -> ".join(sources))
        return ReadStats(action="replicated", version=version, seconds=dt, transfer_s=t_end - t_assigned, bytes=nbytes,
                         sources=tuple(sources), partial_source=first.source_partial,
                         cross_datacenter=first.cross_datacenter, failovers=failovers,
                         finished_at=finished_at)

    def _finish_unpublish(self, reply: object) -> None:
        if isinstance(reply, m.OffloadOrder):
            reply = self._call(self._offload(reply.version), wait=True)
        self._expect(reply, m.UnpublishDone)
        version = self._published
        self._region.set_progress(0)
        self._region.set_version(-1)
        self._published = None
        self._state = HubState.IDLE
        if self.config.verify_mutability:
            self._verify_unchanged(version)

    def _verify_unchanged(self, version: Optional[int]) -> None:
        """Verify mode: the bytes must still be what was published (or replicated)."""
        if not self._checksums:
            return
        for u, unit in enumerate(self._layout.units):
            if checksum_unit(self._tensors, unit) != self._checksums[u]:
                names = sorted({self._layout.metas[p.tensor_index].name for p in unit})
                raise errors.MutabilityViolation(
                    f"{self.model} version {version} shard {self.shard}: unit {u} ({', '.join(names)}) "
                    f"was written while published")

    def _offload(self, version: int) -> m.OffloadDone:
        """Copy the published tensors to host memory and register that copy as a holder."""
        with self._host_lock:
            existing = self._host.get(version)
            if existing is not None:
                # Already offloaded this version earlier (it came back to the GPU copy by a
                # later read): the host copy holds the same bytes; keep serving that one.
                return m.OffloadDone(self.client_id, version, tx.encode_endpoint(existing[0].endpoint()))
            pooled = self._host_pool.pop() if self._host_pool else None
        if pooled is None:
            copies = [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in self._tensors]
            region = tx.Region.register(copies, self._layout, self.config)
        else:
            region, copies = pooled
        for dst, src in zip(copies, self._tensors):
            dst.copy_(src)
        region.publish_complete(version, self._region.checksums() if self.config.checksums else None)
        with self._host_lock:
            self._host[version] = (region, copies)
        log.info("model=%s version=%d shard=%d offloaded to host (%d bytes)",
                 self.model, version, self.shard, self._layout.total_bytes)
        return m.OffloadDone(self.client_id, version, tx.encode_endpoint(region.endpoint()))

    def _drop_host_copy(self, version: int) -> None:
        with self._host_lock:
            entry = self._host.pop(version, None)
            if entry is not None and len(self._host_pool) < self.config.host_copies_pooled:
                # Keep the buffer registered for the next offload: fresh host memory is slow to
                # touch and registration is not free.
                entry[0].set_progress(0)
                entry[0].set_version(-1)
                self._host_pool.append(entry)
                entry = None
                pooled = True
            else:
                pooled = False
        if entry is not None:
            entry[0].close()
        if entry is not None or pooled:
            log.info("model=%s version=%d shard=%d host copy freed", self.model, version, self.shard)

    def _call(self, request: m.Request, wait: bool = False) -> object:
        """One request; survives a server restart: on ``ServerUnavailable`` it reconnects (a
        new server is created under the same name), on ``UnknownClient`` it re-announces what
        this handle holds, then retries once per attempt."""
        timeout = self.config.request_timeout_s if wait else 0.0
        attempts = self.config.reconnects_max + 1
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                reply = self._port.call(request, timeout)
            except errors.ServerUnavailable:
                if last:
                    raise
                log.warning("model=%s shard=%d: reference server unavailable, reconnecting", self.model, self.shard)
                time.sleep(min(0.2 * 2 ** attempt, 2.0))
                self._port.reconnect()
                reply = m.ErrorReply(code="UnknownClient", message="reconnected")
            if (isinstance(reply, m.ErrorReply) and reply.code == "UnknownClient" and not last
                    and self._register_msg is not None and not isinstance(request, (m.Register, m.Announce, m.Leave))):
                done = self._announce(request)
                if done is not None:
                    return done
                continue
            break
        if isinstance(reply, m.Waiting) and wait:
            raise errors.RequestTimeout(f"{type(request).__name__} did not finish within {self.config.request_timeout_s}s")
        return reply

    def _holding(self, request: Optional[m.Request] = None) -> m.Holding:
        """What this handle holds, for a (re-)announcement to a fresh server."""
        with self._host_lock:
            hosts = tuple((v, tx.encode_endpoint(r.endpoint())) for v, (r, _) in sorted(self._host.items()))
        txn = self._round_txn(request.version if isinstance(request, m.ReplicateDone) else self._published)
        if isinstance(request, m.ReplicateDone):
            return m.Holding(published=request.version, host_copies=hosts, **txn)
        if isinstance(request, m.OffloadDone):
            # Drained on the old server already; the host copy (in `hosts`) now holds the version.
            return m.Holding(published=None, host_copies=hosts)
        if self._reading and self._region is not None:
            src = "" if isinstance(request, m.SourceFailed) else self._current_source
            return m.Holding(host_copies=hosts, reading_version=self._region.version,
                             reading_source=src, reading_units=self._region.progress,
                             txn_seq=self._seq, txn_version=self._region.version)
        return m.Holding(published=self._published, host_copies=hosts, **txn)

    def _round_txn(self, version: Optional[int]) -> dict:
        """The round that gave this handle ``version``, for a fresh server: a sibling shard that
        asks in that round after the restart gets the same version (not ``latest`` afresh)."""
        seq, got = self._round
        return {"txn_seq": seq, "txn_version": got} if version is not None and got == version and seq > 0 else {}

    def _announce(self, request: Optional[m.Request] = None) -> Optional[object]:
        """Re-announce; returns a reply that makes retrying ``request`` unnecessary, or None."""
        reply = self._port.call(m.Announce(self._register_msg, self._holding(request)))
        if isinstance(reply, m.ErrorReply):
            raise errors.from_code(reply.code, reply.message)
        log.info("model=%s replica=%s shard=%d re-announced to the reference server", self.model, self.replica, self.shard)
        if isinstance(request, m.ReplicateDone):
            return m.Ok()  # announced as a complete holder already
        if isinstance(request, m.OffloadDone):
            return m.UnpublishDone(version=request.version)  # announced as unpublished + host copy
        return None

    def _expect(self, reply: object, kind: type):
        if isinstance(reply, kind):
            return reply
        if isinstance(reply, (m.ErrorReply, m.Failed)):
            raise errors.from_code(reply.code, reply.message)
        if isinstance(reply, m.Evicted):
            raise errors.UnknownClient(f"evicted by the server: {reply.reason}")
        raise errors.TensorHubError(f"unexpected reply {reply!r}, wanted {kind.__name__}")

    def _check_open(self) -> None:
        if self._state is HubState.CLOSED:
            raise errors.HandleClosed("handle is closed")

    def _check_registered(self) -> None:
        self._check_open()
        if self._state is HubState.OPEN:
            raise errors.NotRegistered("register() the tensors first")

    def _start_heartbeat(self) -> None:
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name=f"tensorhub-hb-{self.client_id}", daemon=True)
        self._hb_thread.start()

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(self.config.heartbeat_interval_s):
            try:
                reading = self._reading
                try:
                    reply = self._port.call(m.Progress(self.client_id, self._region.progress) if reading
                                            else m.Heartbeat(self.client_id))
                except errors.ServerUnavailable:
                    self._port.reconnect()
                    reply = m.ErrorReply(code="UnknownClient", message="reconnected")
                if isinstance(reply, m.ErrorReply) and reply.code == "UnknownClient":
                    # A reader announces its edge at once (the holder's drain waits for it); an
                    # idle handle only when no call is in flight (that call re-announces itself).
                    if reading:
                        self._announce()
                    elif self._lock.acquire(blocking=False):
                        try:
                            if self._state not in (HubState.CLOSED, HubState.OPEN):
                                self._announce()
                        finally:
                            self._lock.release()
                for note in self._port.notes(self.client_id):
                    if isinstance(note, m.DropHostCopy):
                        self._drop_host_copy(note.version)
            except Exception:  # noqa: BLE001 - the heartbeat must survive a flaky server
                log.debug("heartbeat failed", exc_info=True)

    def _release(self) -> None:
        with self._host_lock:
            entries = list(self._host.values()) + self._host_pool
            self._host.clear()
            self._host_pool.clear()
            sources = list(self._sources.values())
            self._sources.clear()
        for src in sources:
            src.close()
        for region, _ in entries:
            region.close()
        if self._region is not None:
            self._region.close()
            self._region = None


def _layout_info(layout: Layout) -> m.LayoutInfo:
    return m.LayoutInfo(
        fingerprint=layout.fingerprint + ":" + layout.unit_signature[:16],
        unit_count=layout.unit_count,
        total_bytes=layout.total_bytes,
        tensors=tuple(m.TensorMeta(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in layout.metas),
    )
