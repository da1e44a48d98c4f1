"""The handle users program against: one shard of one replica of one model.

    hub = tensorhub.open("policy", shard=rank, num_shards=tp, replica="trainer")
    hub.register(model.state_dict())   # the tensors this shard holds (ordered, fixed layout)
    hub.publish(step)                  # trainer: the tensors hold version `step`; I won't write them
    hub.unpublish()                    # returns once no reader reads them any more
    hub.replicate("latest")            # rollout: fetch into the registered tensors; now a holder
    hub.update("latest")               # no-op if current, else unpublish + replicate
    hub.prefetch("latest")             # rollout: receive the next version in the background...
    hub.update("latest")               # ...then update() only copies it locally
    hub.close()

Every method blocks until done and raises a typed :mod:`tensorhub.errors` error. Each has an
asyncio twin with an ``a`` prefix (``await hub.aupdate("latest")``) that runs the blocking call
in a worker thread. One handle is not meant to be used by two threads at once.

The handle talks to the reference server through a :class:`~tensorhub.ports.ServerPort` and
moves bytes with the NIXL transport; it imports no actor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from typing import Callable, Optional, Sequence

import torch

from tensorhub import errors, metrics
from tensorhub.handle import deltas, pulse
from tensorhub.handle.background import Background
from tensorhub.handle.driver import Driver
from tensorhub.config import Config
from tensorhub.core import bounds
from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.handle.host_copies import Held, HostCopies
from tensorhub.handle.memory import Memory
from tensorhub.handle import registration
from tensorhub.handle.reads import ReadSession, ReadStats
from tensorhub.handle.registration import NamedTensors
from tensorhub.handle.reshard import Resharding
from tensorhub.handle.staging import Staging, Standing
from tensorhub.handle.sources import Sources
from tensorhub.layout import Layout, checksum_all
from tensorhub.logs import configure_from_env
from tensorhub.placement import Placement
from tensorhub.ports import ServerPort
from tensorhub import transport as tx
from tensorhub.transport import shm

log = logging.getLogger("tensorhub.client")
"""The handle's log (its name from before the handle package, kept for users' log filters)."""

HubState = hm.Phase
"""The handle's lifecycle phase (``OPEN`` until register, ``IDLE``, ``PUBLISHED``, ``CLOSED``)."""


class Hub:
    """One shard handle. Build with :func:`tensorhub.open`.

    A thin shell over :class:`tensorhub.core.handle.HandleMachine`: the machine decides (rounds,
    retries, failover, re-announce, aborts); its driver (:mod:`tensorhub.handle.driver`) carries
    out its commands with the server port, the transport and threads, and feeds back what
    happened."""

    def __init__(self, model: str, port: ServerPort, *, shard: int = 0, num_shards: int = 1,
                 replica: Optional[str] = None, datacenter: Optional[str] = None, spot: bool = False,
                 retains: bool = True, config: Optional[Config] = None) -> None:
        configure_from_env()
        registration.check_identity(model, shard, num_shards, replica, datacenter)
        self.model = model
        self.shard = shard
        self.num_shards = num_shards
        self.replica = replica or f"replica-{uuid.uuid4().hex[:8]}"
        self.datacenter = datacenter or "default"
        self.spot = bool(spot)
        self.retains = bool(retains)
        """False: never keeps a retention copy (``tensorhub.open(retains=...)``)."""
        self.config = config or Config()
        self.client_id = f"{model}/{self.replica}/{shard}/{uuid.uuid4().hex[:6]}"
        self._port = port
        self._driver = Driver(self, port=port, config=self.config)
        """The machine, its lock and its driver (a part, :mod:`tensorhub.handle.driver`)."""
        self._memory = Memory(self.config)
        """The registered tensors, their layout, region and checksums (a part,
        :mod:`tensorhub.handle.memory`)."""
        self._sources = Sources(self.config, model, shard)
        """Sources kept open across reads (a part with its own lock)."""
        self._hb_stop = threading.Event()
        self._lock = threading.Lock()  # one blocking call at a time
        self._stage_for = ""
        """Set on a prefetch staging handle: the client id of the handle it stages for."""
        self._staging = Staging(self, port=port, config=self.config)
        """The prefetch staging copy, its job thread and the double buffer's swap (a part with
        its own lock and thread, :mod:`tensorhub.handle.staging`)."""
        self.host_copies = HostCopies(
            model=model, shard=shard, client_id=self.client_id, keeps_copies=self.retains and not self.spot,
            config=self.config, port=port,
            held=lambda: Held(self._memory.tensors, self._memory.layout, self._memory.region),
            take_notes=lambda: self._background.take_notes(),  # the part made next, which needs this one
            record=self._driver.record_host_copy, endpoint_of=self._driver.host_copy_endpoint,
            reading=lambda: self._driver.reading)
        """This handle's host copies and their buffer pool (a part with its own lock and threads)."""
        self._reshard = Resharding(
            client_id=self.client_id, shard=shard, config=self.config, port=port,
            placement=lambda: self._machine.register_msg.placement if self._machine.register_msg else None,
            published=lambda: self._machine.published,
            held=lambda: (self._memory.tensors, self._memory.region), sources=self._sources,
            host_copy=self.host_copies.tensors_of)
        """Resharded reads from holders of another layout, and hashing cells for readers of
        another layout (a part with its own thread, :mod:`tensorhub.handle.reshard`)."""
        self._background = Background(
            client_id=self.client_id, model=model, replica=self.replica, shard=shard,
            keeps_copies=self.retains and not self.spot, config=self.config, port=port, machine=self._driver.machine, mlock=self._driver.lock,
            call_lock=self._lock, stopped=self._hb_stop, region=lambda: self._memory.region, feed=self._driver.feed,
            set_region=self._driver.set_region,
            host_copies=self.host_copies, seed_asked=self._staging.seed_asked,
            cells_asked=self._reshard.hash_asked)
        """The server's notes, the beat and re-announcing (a part with its own lock,
        :mod:`tensorhub.handle.background`)."""
        self._offers = (deltas.Offers(client_id=self.client_id, model=model, shard=shard, config=self.config,
                                      port=port, held=lambda: (self._memory.tensors, self._memory.layout))
                        if self.config.seed_deltas else None)
        """Deltas of the versions this handle publishes, offered for seeds (``Config.seed_deltas``;
        a part with its own lock and thread, :mod:`tensorhub.handle.deltas`)."""
        self._delta_ready: Optional[deltas.Prepared] = None
        """On a staging copy: the version its next read takes from a delta (set by its owner's
        staging part around that read, :meth:`Staging._prefetch_now`)."""
        self.reads = ReadSession(self)
        """The read path as a named API (:mod:`tensorhub.handle.reads`), for code that moves a
        read's bytes itself (a compiled graph's member) and for tools."""

    # ------------------------------------------------------------------ public API

    @property
    def host_buffers_allocated(self) -> int:
        """Retention buffers this handle allocated (touched and registered), in the background or
        -- when none was ready -- on an offload's critical path (``host_buffers_inline``)."""
        return self.host_copies.allocated

    @property
    def host_buffers_inline(self) -> int:
        return self.host_copies.inline

    def server_calls(self) -> Optional[int]:
        """How many calls this handle's server port has sent from the calling thread so far
        (requests and notes fetches; :class:`tensorhub.ports.CallCount`): the difference around
        a call is the round trips it cost -- 0 for an ``update("latest")`` answered locally
        (``Config.noop_staleness_s``). The handle's own threads (pulses, prefetches) count on
        theirs. None: its port does not count (a test's stand-in). Never blocks."""
        counted = getattr(self._port, "counted", None)
        return counted.here() if counted is not None else None

    @property
    def staging(self) -> Optional["Hub"]:
        """The prefetch staging handle (a second holder in this process, made by the first
        :meth:`prefetch` or seed), or None."""
        return self._staging.copy

    @property
    def state(self) -> HubState:
        return self._machine.phase

    @property
    def version(self) -> Optional[int]:
        """The version this handle currently publishes, or None."""
        return self._machine.published

    @property
    def _published(self) -> Optional[int]:
        return self._machine.published

    @property
    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The registered tensors that hold :attr:`version`, as ``(name, tensor)`` in layout
        order. With a double buffer they alternate between the two sets after each swapped
        update (``ReadStats.swapped``): hand these to the engine after such an update."""
        return self._memory.named()

    def register(self, tensors: NamedTensors, *, double_buffer: Optional[NamedTensors] = None,
                 placement: Optional[Placement] = None, layout_key: str = "") -> None:
        """Declare the tensors this shard holds, in order (a state dict works). Registers their
        memory with the transport once. The layout must match the model's layout for this shard
        index (``LayoutMismatch`` otherwise, nothing registered). Call once per handle.

        ``double_buffer``: a second set of tensors with the same layout (e.g. spare GPU memory).
        Prefetches (:meth:`prefetch`) then land there, and an :meth:`update` to the prefetched
        version swaps the two sets instead of copying: no byte moves, :attr:`tensors` names the
        set that holds the new version, and the next prefetch overwrites the other set (the engine
        must have moved to the new one). Unsharded handles only (sharded replicas copy, in rounds);
        an update that cannot swap (the prefetch is incomplete or not the version asked, others
        read the staging copy) copies as without a double buffer.

        ``tensors`` and ``double_buffer`` may be any iterable of ``(name, tensor)`` pairs (a
        generator such as ``model.named_parameters()`` included): each is read once. Every client
        of a model must run with the same ``checksums`` setting (a holder without them publishes
        none for its readers to verify): ``ConfigError`` otherwise, nothing registered.

        ``placement``: which part of which global tensor each of ``tensors`` holds
        (:mod:`tensorhub.placement`, docs/placements.md), e.g. a vLLM rank's fused ``qkv_proj``.
        The server checks it (well formed, the tensors' names, dtypes and shapes, one schema per
        model; ``LayoutMismatch`` naming the tensor, nothing registered) and refuses a publish
        whose replica's shards leave part of a global tensor uncovered. Replicas of one layout copy
        whole shards between each other; a replica of another layout (its own layout class)
        receives exactly its slices by resharded reads, checked cell by cell, and the holders
        hash the cells such readers ask for (docs/placements.md). Default: none, as before.

        ``layout_key`` (with a placement): a name for this replica's whole layout, the same in
        every replica of that layout and only there (e.g. ``"vllm-tp2"``). The server keeps the
        replicas that give one key in one layout class however their shards' registrations
        interleave; without a key it finds the class by fit, and replicas whose shards register
        interleaved may form two classes of one layout (each then reads from the other layout's
        holders). A shard whose layout or placement does not fit its key's class:
        ``LayoutMismatch``, nothing registered.

        A server too far behind sheds new clients (``Config.register_shed_s``): ``register``
        then pauses as the server asks and tries again, until ``request_timeout_s``
        (``ServerBusy`` then, nothing registered)."""
        with self._lock:
            if self._machine.phase is not HubState.OPEN:
                self._run(hm.RegisterOp(None))  # raises HandleClosed / InvalidState
            items = registration.named_list(tensors)
            layout = Layout.for_config(items, self.config)
            info = registration.layout_info(layout, self.config.checksums)
            bounds.check_layout(info)
            if placement is not None:
                placement = registration.check_placement(placement, info)
            registration.check_layout_key(layout_key, placement)
            spare = None
            if double_buffer is not None:
                spare = registration.apart(double_buffer, layout, self.config, [t for _, t in items], "double_buffer")
            ts = [t for _, t in items]
            region = tx.Region.register(ts, layout, self.config)
            try:
                msg = m.Register(
                    client_id=self.client_id, model=self.model, replica_id=self.replica, shard=self.shard,
                    num_shards=self.num_shards, layout=info,
                    endpoint=tx.encode_endpoint(region.endpoint()), datacenter=self.datacenter, spot=self.spot,
                    retains=self.retains, process=self._port.process(), machine=shm.host_key(), stage_for=self._stage_for,
                    placement=placement, layout_key=layout_key,
                )
            except BaseException:
                region.close()  # nothing registered: the transport registration goes too
                raise
            self._memory.attach(layout, ts, region)
            self._machine.unit_count = layout.unit_count
            try:
                bounds.check_endpoint("endpoint", msg.endpoint)
                self._run(hm.RegisterOp(msg))
            except BaseException as exc:
                self._memory.detach()
                region.close()
                if isinstance(exc, errors.LayoutMismatch):
                    registration.explain_mismatch(self._port, self.model, self.shard, self.config.checksums,
                                                  msg.layout, exc)
                raise
            self._staging.double = spare
            self._start_heartbeat()
            self.host_copies.start_pool()
            log.info("model=%s replica=%s shard=%d registered %d tensors, %d bytes, %d units",
                     self.model, self.replica, self.shard, len(ts), layout.total_bytes, layout.unit_count)

    def publish(self, version: int) -> None:
        """Declare that the registered tensors hold ``version``; from now until ``unpublish()``
        returns the caller must not write them. Idempotent for the same version. Raises
        ``InvalidState`` if another version is published (unpublish first). If it raises
        ``ServerUnavailable`` (no reply: the server may have applied it), the handle holds the
        version as published all the same: ``unpublish()`` before writing the tensors.

        CUDA tensors: the current stream is synchronized first, so that readers never see bytes
        of kernels still queued (with checksums off nothing else would catch them)."""
        with self._lock:
            if not isinstance(version, int) or isinstance(version, bool) or version < 0:
                raise errors.BadVersionSpec(f"publish() needs an int version >= 0, got {version!r}")
            bounds.check_version("version", version)
            if self._machine.phase in (HubState.IDLE, HubState.PUBLISHED) and self._machine.published is None:
                _sync_devices(self._memory.tensors)
                need_sums = self.config.checksums or self.config.verify_mutability
                sums = checksum_all(self._memory.tensors, self._memory.layout) if need_sums else []
            else:
                sums = []
            was = self._machine.published
            try:
                self._run(hm.PublishOp(version, tuple(sums) if self.config.checksums else ()))
            finally:
                # Also when it raised ServerUnavailable: then the handle holds the version as
                # published (the server may have applied it) until unpublish().
                if self._machine.published == version and sums:
                    self._memory.checksums = sums
                if self._offers is not None and was != version and self._machine.published == version:
                    self._offers.published(version)
            metrics.record_publish(self.model)
            log.info("model=%s replica=%s shard=%d published version %d", self.model, self.replica, self.shard, version)

    def unpublish(self) -> None:
        """Hide this holder from new readers and wait until its in-flight readers finish (and,
        for the last non-spot copy of a retained version, until a host copy is published).
        After it returns the caller may write the tensors. Idempotent."""
        with self._lock:
            self._unpublish_locked()

    def _unpublish_locked(self) -> None:
        if self._offers is not None:
            self._offers.unpublishing()
        self.host_copies.stop_copy()
        out = self._run(hm.UnpublishOp())
        if out.was_published is not None and self.config.verify_mutability:
            self._verify_unchanged(out.was_published)

    def replicate(self, spec: m.VersionSpec = "latest", *, round: Optional[int] = None,
                  progress: Optional[Callable[[int, int], None]] = None) -> ReadStats:
        """Fetch version ``spec`` (an int, ``"latest"``, ``"latest-k"``) into the registered
        tensors, then serve it as a holder. Raises ``InvalidState`` while a version is published
        (use ``update()``), ``VersionNotFound`` / ``VersionExpired`` / ``VersionLost``.

        ``round`` (sharded replicas): the call's round number, the same on every shard of the
        replica (e.g. the rollout iteration); the shards' calls of one round get one version. By
        default the handle counts its calls, which is exact while the shards call in lock step;
        pass ``round`` when shard processes may restart on their own (a restarted process cannot
        know which round its siblings are in).

        ``progress(units_done, units_total)``: called in this thread as units land (verified),
        for a long read; it must be quick and must not call this handle."""
        try:
            with self._lock:
                return self.reads.call(spec, update=False, round_no=_check_round(round), progress=progress)
        finally:
            self._staging.after_read()  # a prefetch that waited for this call to take its version

    def update(self, spec: m.VersionSpec = "latest", *, round: Optional[int] = None,
               progress: Optional[Callable[[int, int], None]] = None) -> ReadStats:
        """Atomically move to ``spec``: a no-op (``action="noop"``) when this handle already
        publishes that version; otherwise drain and unpublish the current version, then
        replicate the new one. If the version is lost mid-read and ``spec`` is relative,
        retries once in the same round (the shards of a replica stay in one transaction).
        ``round``, ``progress``: as for :meth:`replicate`.

        All or nothing: an update that fails before a byte of the new version is written keeps
        the current version published. With a double buffer it swaps when it can (see
        :meth:`register`); it never waits for a prefetch in flight (it copies behind it).
        Verify mode (``verify_mutability``): the version it leaves is checked once drained,
        before the new one is written (``MutabilityViolation``; the handle is idle then)."""
        try:
            with self._lock:
                if self._staging.double is not None and round is None:
                    st = self._staging.swap(spec)
                    if st is not None:
                        return st
                return self.reads.call(spec, update=True, round_no=_check_round(round), progress=progress)
        finally:
            self._staging.after_read()  # a prefetch that waited for this call to take its version

    def close(self, drop_last_copy: bool = False) -> None:
        """Unpublish (draining readers), leave the server, release registrations. A second
        close raises ``HandleClosed``.

        If this handle serves the last live non-spot copy of a retained version while other
        clients of the model remain, the server refuses: ``LastCopyHeld`` is raised and the
        handle stays open (unpublished, serving its host copy) -- close again once another holder
        has the version, or pass ``drop_last_copy=True`` to drop it. Any other failure still
        closes the handle (and raises).

        A prefetch staging copy (:meth:`prefetch`) is closed first, after its prefetch in
        flight ends; it follows the same last-copy rule (its ``LastCopyHeld`` leaves both open).
        Any other failure of the staging copy's close still closes the handle, then is raised.
        No prefetch starts once close() has begun (a seed asked meanwhile is dropped).

        Verify mode (``verify_mutability``): the version this call unpublished is checked like
        :meth:`unpublish` checks it, once the handle is closed (``MutabilityViolation``)."""
        stage_error = self._staging.close_first(drop_last_copy)
        with self._lock:
            self.host_copies.stop_copy()
            was = self._machine.published
            try:
                self._run(hm.CloseOp(drop_last_copy=drop_last_copy))
            except errors.LastCopyHeld:
                self._staging.reopen()  # the handle stays open (it serves its host copy)
                raise
            except errors.HandleClosed:
                raise
            except BaseException:
                with self._driver.lock:
                    self._machine.phase = HubState.CLOSED
                try:
                    self._port.call(m.Leave(self.client_id, drop_last_copy=True))
                except errors.TensorHubError:
                    pass
                self._stop_threads()
                self._release()
                raise
            self._stop_threads()
            self._release()
            if stage_error is not None:
                raise stage_error
            if was is not None and self.config.verify_mutability:
                self._verify_unchanged(was)

    def prefetch(self, spec: m.VersionSpec = "latest", *, round: Optional[int] = None,
                 buffer: Optional[NamedTensors] = None) -> "concurrent.futures.Future[ReadStats]":
        """Start receiving ``spec`` into this handle's staging copy in the background and return
        at once; the registered tensors keep their version and keep serving it. The next
        :meth:`update` (or :meth:`replicate`) of that version then copies it locally instead of
        fetching it (``ReadStats.prefetched``); called while the prefetch is still arriving, it
        copies behind it (pipelined).

        The staging copy is a holder of its own (replica ``<replica>~prefetch``, registered once,
        on the first prefetch): others may read from it, partial or complete, and it follows
        every holder rule (drain, retention, failover). ``buffer``: tensors with this handle's
        layout to stage into (e.g. a spare device buffer), used by the first prefetch only;
        default: host memory allocated (and touched) once, in the background. ``round``: as for
        :meth:`replicate` (sharded replicas prefetch in rounds of their own).

        Returns a future of the staging copy's :class:`ReadStats`, done once the staging copy is
        complete (and any retention copy the server asked of it is made); a failed prefetch sets its
        exception and costs nothing else (the next :meth:`update` reads as if there had been
        none). Prefetches run one after the other. Raises ``InvalidState`` before
        :meth:`register`, ``LayoutMismatch`` for a ``buffer`` of another layout, and
        ``HandleClosed``; nothing changes then. A ``buffer`` that shares memory with the registered
        tensors is a ``LayoutMismatch`` too."""
        return self._staging.prefetch(spec, _check_round(round), buffer)

    async def aprefetch(self, spec: m.VersionSpec = "latest", *, round: Optional[int] = None,
                        buffer: Optional[NamedTensors] = None) -> ReadStats:
        """:meth:`prefetch`, awaited until the staging copy is complete (its ReadStats)."""
        return await asyncio.wrap_future(self.prefetch(spec, round=round, buffer=buffer))

    # ---- the staging part's side (tensorhub.handle.staging.Owner)

    def _standing(self) -> Standing:
        """What the staging part reads of this handle (read without the machine lock, as before it)."""
        reg = self._machine.register_msg
        return Standing(staging_for=self._stage_for, registered=self._memory.layout is not None,
                        reading=self._machine.reading, complete=self._memory.complete,
                        endpoint=reg.endpoint if reg is not None else None, seq=self._machine.seq)

    def _prefetch_buffer(self, named: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        """A prefetch's ``buffer=`` as a list, if it has this handle's layout and does not share
        memory with the registered tensors (``LayoutMismatch`` otherwise)."""
        return registration.apart(named, self._memory.layout, self.config, self._memory.tensors,
                                  "prefetch buffer")

    def _open_copy(self) -> "Hub":
        """A prefetch staging handle for this one, not registered yet: same model, shard,
        datacenter, spot and retains flags and config, replica ``<replica>~prefetch``; a read of it waits
        one lease for its siblings (``HandleMachine.incomplete_wait_s``)."""
        stage = Hub(self.model, self._port, shard=self.shard, num_shards=self.num_shards,
                    replica=f"{self.replica}~prefetch", datacenter=self.datacenter, spot=self.spot,
                    retains=self.retains, config=self.config)
        stage._stage_for = self.client_id
        stage._machine.incomplete_wait_s = self.config.lease_timeout_s
        return stage

    def _swapped(self, stage: "Hub", v: int) -> None:
        """The server made the swap: the two tensor sets (and their control blocks) change hands."""
        self._driver.swapped(stage._driver, self._memory, stage._memory, v)
        self._memory.hold_checksums()

    def _publish_again(self, version: int) -> None:
        """A refused swap: publish ``version`` again from the tensors, which still hold it (it
        was unpublished only for the swap, and verified unchanged in verify mode). If the server
        cannot be told, the handle stays unpublished and the update copies from there."""
        try:
            self._run(hm.PublishOp(version, tuple(self._memory.checksums) if self.config.checksums else ()))
        except errors.TensorHubError as e:
            log.warning("model=%s replica=%s shard=%d: version %d not published again after a refused swap: %s",
                        self.model, self.replica, self.shard, version, e)

    # asyncio twins
    async def aregister(self, tensors: NamedTensors, *, double_buffer: Optional[NamedTensors] = None,
                        placement: Optional[Placement] = None, layout_key: str = "") -> None:
        await asyncio.to_thread(lambda: self.register(tensors, double_buffer=double_buffer, placement=placement,
                                                      layout_key=layout_key))

    async def apublish(self, version: int) -> None:
        await asyncio.to_thread(self.publish, version)

    async def aunpublish(self) -> None:
        await asyncio.to_thread(self.unpublish)

    async def areplicate(self, spec: m.VersionSpec = "latest", *, round: Optional[int] = None,
                         progress: Optional[Callable[[int, int], None]] = None) -> ReadStats:
        return await asyncio.to_thread(lambda: self.replicate(spec, round=round, progress=progress))

    async def aupdate(self, spec: m.VersionSpec = "latest", *, round: Optional[int] = None,
                      progress: Optional[Callable[[int, int], None]] = None) -> ReadStats:
        return await asyncio.to_thread(lambda: self.update(spec, round=round, progress=progress))

    async def aclose(self, drop_last_copy: bool = False) -> None:
        await asyncio.to_thread(self.close, drop_last_copy)

    def __enter__(self) -> "Hub":
        return self

    def __exit__(self, *exc) -> None:
        if self._machine.phase is not HubState.CLOSED:
            self.close()

    # ------------------------------------------------------------------ the driver's side

    @property
    def _machine(self) -> hm.HandleMachine:
        """The machine (the driver's, :class:`~tensorhub.handle.driver.Driver`)."""
        return self._driver.machine

    def _run(self, op: hm.Op) -> hm.Outcome:
        """Carry out one operation (the caller holds ``_lock``); an unanswered swap is settled
        first (:meth:`Staging.settle <tensorhub.handle.staging.Staging.settle>`)."""
        if self._staging.unsettled_swap is not None:
            self._staging.settle()
        return self._driver.drive(self._driver.feed(hm.Start(op)))

    def _verify_unchanged(self, version: Optional[int]) -> None:
        """Verify mode: the bytes must still be what was published (or replicated)."""
        self._memory.verify_unchanged(self.model, self.shard, version)

    def _stop_threads(self) -> None:
        self._hb_stop.set()
        pulse.leave(self)
        self.host_copies.stop()
        self._reshard.stop()


    def _start_heartbeat(self) -> None:
        """Join this process's liveness loop for the server (:mod:`tensorhub.handle.pulse`): one call
        carries every handle's heartbeat (held by the server while idle) and brings back its
        background events; a second pulse carries read progress while a handle reads."""
        pulse.join(self)

    # A pulse's member (tensorhub.handle.pulse.Member): the beat and its answer are the
    # background part's.
    def _beat_interval(self) -> float:
        return self.config.heartbeat_interval_s

    def _pulse_hold(self) -> float:
        return self.config.pulse_hold_max_s

    def _beat(self) -> Optional[m.Beat]:
        return self._background.beat()

    def _after_beat(self, known: bool, notes: list, acked: int = -1, may_announce: bool = True,
                    viewed: Optional[hm.Viewed] = None) -> None:
        self._background.after_beat(known, notes, acked, may_announce, viewed)

    def _release(self) -> None:
        if self._offers is not None:
            self._offers.close()
        entries = self.host_copies.release()
        self._sources.close()
        for region, _ in entries:
            region.close()
        self._memory.release()


def _check_round(round_no: Optional[int]) -> Optional[int]:
    if round_no is not None and (not isinstance(round_no, int) or isinstance(round_no, bool) or round_no < 1):
        raise errors.BadVersionSpec(f"round must be an int >= 1, got {round_no!r}")
    return round_no


def _sync_devices(tensors: Sequence[torch.Tensor]) -> None:
    """Wait for queued kernels on every CUDA device the tensors live on (publish: the bytes a
    reader may fetch must be final)."""
    for dev in sorted({t.device.index or 0 for t in tensors if t.is_cuda}):
        torch.cuda.synchronize(dev)
