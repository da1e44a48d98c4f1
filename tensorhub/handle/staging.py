"""A handle's prefetch staging copy and its double-buffer swap (``hub._staging``).

:meth:`Hub.prefetch <tensorhub.handle.hub.Hub.prefetch>` and the server's ``SeedAhead`` receive
a version into a *staging copy*: a second :class:`~tensorhub.handle.hub.Hub` of the same process
(replica ``<replica>~prefetch``), a holder of its own, registered on the first prefetch; so does a
``PrefetchAhead`` (the datacenter's seed has arrived there: read it from there, ahead). The next
``update`` of that version then copies it locally; with a double buffer it takes over the staging
copy's memory instead (``Swap``: the server exchanges the two holders' endpoints).

:class:`Staging` owns all of it: the staging copy, the prefetch job thread (one worker: prefetches
run one after the other), the seed asked last, the double buffer, a swap the server left
unanswered, and one lock over them. It reaches its handle, and the staging copy, only through
:class:`Owner`, which :class:`~tensorhub.handle.hub.Hub` implements.

Rules:

- No prefetch or staging copy starts once ``close()`` has begun (:meth:`Staging.close`); a
  ``LastCopyHeld`` close leaves both open (:meth:`Staging.reopen`).
- An update never waits for a prefetch in flight: it does not swap then (it copies behind it).
- A refused swap changes nothing: the version unpublished for it is published again.
- A swap the server may have made (no answer) is asked again before anything touches either
  set of tensors (:meth:`Staging.settle`).
- Locks (the order: ``tensorhub/handle/__init__.py``): the caller of :meth:`Staging.swap` and
  :meth:`Staging.settle` holds the handle's call lock (``Hub._lock``); ``Staging._lock`` is a
  leaf, held only to read and write this part's own state, nothing taken while it is held.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from typing import Optional, Protocol

import torch

from tensorhub import errors, metrics
from tensorhub.config import Config
from tensorhub.core import background as bg
from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.handle import deltas
from tensorhub.handle.host_copies import HostCopies
from tensorhub.handle.reads import ReadSession, ReadStats
from tensorhub.ports import ServerPort

log = logging.getLogger("tensorhub.client")
"""The handle's log (one name for all its parts, kept for users' log filters)."""

Named = list[tuple[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Standing:
    """What :class:`Staging` reads of a handle (:meth:`Owner._standing`), as it is now."""

    staging_for: str
    """Set on a staging copy: the client id of the handle it stages for ("" otherwise)."""
    registered: bool
    reading: bool
    """A pull may be writing its tensors."""
    complete: bool
    """Its region holds every unit of the layout."""
    endpoint: Optional[bytes]
    """Its region's endpoint as the server has it (None before register)."""
    seq: int
    """Its machine's round."""


class Owner(Protocol):
    """The handle as :class:`Staging` sees it: a :class:`~tensorhub.handle.hub.Hub`. Its staging
    copy is one too, and is reached through the same members.

    Public: ``client_id``, ``model``, ``replica``, ``shard``, ``num_shards``, ``host_copies``,
    ``reads``, ``state``, ``version``, ``register``, ``update``, ``close``. The handle's side
    of this part, and nothing else: ``_lock`` (one user call at a time), :meth:`_standing`,
    :meth:`_prefetch_buffer`, :meth:`_open_copy`, and for the swap :meth:`_unpublish_locked`,
    :meth:`_publish_again` and :meth:`_swapped`."""

    client_id: str
    model: str
    replica: str
    shard: int
    num_shards: int
    host_copies: HostCopies
    reads: ReadSession
    _lock: threading.Lock

    @property
    def state(self) -> hm.Phase: ...

    @property
    def version(self) -> Optional[int]: ...

    def register(self, tensors: Named) -> None: ...

    def update(self, spec: m.VersionSpec = "latest", *, round: Optional[int] = None) -> ReadStats: ...

    def close(self, drop_last_copy: bool = False) -> None: ...

    def _standing(self) -> Standing:
        """Its standing now (read without the machine lock)."""

    def _prefetch_buffer(self, named) -> Named:
        """``named`` as a list of its layout, not sharing its memory (``LayoutMismatch``)."""

    def _open_copy(self) -> "Owner":
        """A new staging copy for it, not registered yet."""

    def _unpublish_locked(self) -> None:
        """Unpublish (the caller holds ``_lock``)."""

    def _publish_again(self, version: int) -> None:
        """After a refused swap: publish ``version`` again from its tensors (best effort)."""

    def _swapped(self, stage: "Owner", version: int) -> None:
        """The server made the swap: its tensors and ``stage``'s change hands."""


class Staging:
    """The prefetch staging copy and the double-buffer swap of one handle.

    ``owner``: the handle (:class:`Owner`); ``port``: its server port (swaps go through it);
    ``config``: its config. Makes no thread until the first prefetch."""

    def __init__(self, owner: Owner, *, port: ServerPort, config: Config) -> None:
        self._owner = owner
        self._port = port
        self._config = config
        self._lock = threading.Lock()
        self._copy: Optional[Owner] = None
        """The staging handle (a second holder in this process), made by the first prefetch."""
        self._seeding = -1
        """The newest version a SeedAhead asked this handle to prefetch."""
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._jobs = 0
        """Prefetch jobs running now (under ``_lock``): an update does not wait for one."""
        self._closing = False
        """close() has begun (under ``_lock``): no prefetch or staging copy starts any more."""
        self._waiting: Optional[int] = None
        """The newest version a PrefetchAhead asked for while the staging copy held a version the
        handle had not taken yet (:func:`~tensorhub.core.background.prefetch_waits`): asked again
        after the handle's next read call (:meth:`after_read`). Under ``_lock``."""
        self._unsettled: Optional[m.Swap] = None
        """A swap the server did not answer: it may have made it. Settled before the next call."""
        self.seeds = deltas.Seeds(config=config, port=port) if config.seed_deltas else None
        """Seeds rebuilt from deltas (``Config.seed_deltas``), used by the prefetch thread only."""
        self.double: Optional[Named] = None
        """The second set of tensors registered as a double buffer (set by ``register``):
        prefetches land there and an update swaps the two sets instead of copying."""

    @property
    def copy(self) -> Optional[Owner]:
        """The staging copy, or None."""
        return self._copy

    @property
    def executor(self) -> Optional[concurrent.futures.ThreadPoolExecutor]:
        """The prefetch job thread (one worker), made by the first prefetch; None after close."""
        return self._executor

    @property
    def unsettled_swap(self) -> Optional[m.Swap]:
        """A swap the server did not answer (:meth:`settle` asks it again), or None."""
        return self._unsettled

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, spec: m.VersionSpec, round_no: Optional[int], buffer,
                 seed: Optional[int] = None, across: bool = True) -> "concurrent.futures.Future[ReadStats]":
        """Start a prefetch job (:meth:`Hub.prefetch <tensorhub.handle.hub.Hub.prefetch>`: the
        contract). ``seed``: the version a SeedAhead or PrefetchAhead asked for (skipped if a
        newer seed is asked before this one starts); its round is
        :func:`tensorhub.core.background.seed_round`. ``across``: the seed crosses the slow
        link (a delta may stand in for it); False for a prefetch inside the datacenter."""
        if seed is not None:
            round_no = bg.seed_round(seed)
        owner = self._owner
        standing = owner._standing()
        if standing.staging_for:
            raise errors.InvalidState("a prefetch staging handle does not prefetch")
        with self._lock:
            if owner.state is hm.Phase.CLOSED or self._closing:
                raise errors.HandleClosed(f"{owner.client_id} is closed")
            if not standing.registered:
                raise errors.InvalidState("prefetch() needs register() first")
            if buffer is not None:
                if self.double is not None:
                    raise errors.InvalidState("prefetches land in the registered double buffer: no buffer= here")
                if self._copy is not None or self._executor is not None:
                    raise errors.InvalidState("the staging buffer is set by the first prefetch() only")
                buffer = owner._prefetch_buffer(buffer)
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"tensorhub-prefetch-{owner.client_id}")
                first_buffer = buffer
            else:
                first_buffer = None
            return self._executor.submit(self._job, spec, round_no, first_buffer, seed, across)

    def seed_asked(self, version: int, across: bool = True) -> None:
        """Offload seeding: this replica was chosen to bring ``version`` into its datacenter
        (``SeedAhead``, ``across``), or the seed has reached its datacenter and it takes it from
        there ahead of its update (``PrefetchAhead``, not ``across``: no delta); receive it into
        the staging copy in the background, unless the handle is not in a state to (closed, not
        registered, a staging copy itself) or already has it.

        Whether to seed is :func:`tensorhub.core.background.seed_decision` (the simulator's
        seeders apply the same rule); the seed is the staging copy's round
        :func:`~tensorhub.core.background.seed_round`."""
        owner, stage = self._owner, self._copy
        standing = owner._standing()
        view = bg.SeedView(
            staging=bool(standing.staging_for), registered=standing.registered,
            closed=owner.state is hm.Phase.CLOSED, published=owner.version,
            seeding=self._seeding, stage_version=stage.version if stage is not None else None,
            stage_seq=stage._standing().seq if stage is not None else 0)
        why = bg.seed_decision(version, view)
        if why is not None:
            log.debug("model=%s shard=%d: not seeding version %d: %s", owner.model, owner.shard, version, why)
            return
        if not across and bg.prefetch_waits(view):
            with self._lock:
                self._waiting = max(version, -1 if self._waiting is None else self._waiting)
            log.debug("model=%s shard=%d: prefetch of version %d waits for this handle to take version %s",
                      owner.model, owner.shard, version, view.stage_version)
            return
        self._seeding = version
        try:
            fut = self.prefetch(version, None, None, seed=version, across=across)
        except errors.TensorHubError as e:
            log.info("model=%s shard=%d: not seeding version %d: %s", owner.model, owner.shard, version, e)
            return
        fut.add_done_callback(functools.partial(_log_seed, owner.model, owner.shard, version))

    def after_read(self) -> None:
        """The handle's read call (``replicate``, ``update``) returned, however it ended: a
        prefetch inside the datacenter that waited for it (:func:`~tensorhub.core.background.
        prefetch_waits`) is asked again now (it may wait again, or be skipped). Never blocks
        (the prefetch runs on the job thread)."""
        with self._lock:
            version, self._waiting = self._waiting, None
        if version is not None:
            self.seed_asked(version, across=False)

    def _job(self, spec: m.VersionSpec, round_no: Optional[int], buffer: Optional[Named],
             seed: Optional[int] = None, across: bool = True) -> ReadStats:
        with self._lock:
            self._jobs += 1
        try:
            return self._prefetch_now(spec, round_no, buffer, seed, across)
        finally:
            with self._lock:
                self._jobs -= 1

    def _prefetch_now(self, spec: m.VersionSpec, round_no: Optional[int], buffer: Optional[Named],
                      seed: Optional[int], across: bool = True) -> ReadStats:
        if seed is not None and seed < self._seeding:
            # A seed asked while an older one was crossing: only the newest is worth the link.
            return ReadStats(action="noop", version=seed)
        if self._unsettled is not None:  # the staging tensors may be the handle's now
            with self._owner._lock:
                self.settle()
        stage = self._copy
        if stage is None:
            stage = self._open_copy(buffer if buffer is not None else self.double)
        if seed is not None and across and self.seeds is not None:
            # A delta against the version the staging copy holds, rebuilt before the read that
            # takes it (None: the read crosses in full, as without deltas). A prefetch inside
            # the datacenter reads the full version there.
            stage._delta_ready = self.seeds.prepare(stage, seed)
        try:
            st = stage.update(spec, round=round_no)
        finally:
            stage._delta_ready = None
        with stage._lock:
            # A retention copy the server asked of the staging copy (MakeHostCopy) is part of
            # the prefetch: the update that follows then copies in a quiet process.
            stage.host_copies.stop_copy(cancel_it=False)
        return st

    def _open_copy(self, buffer: Optional[Named]) -> Owner:
        """The staging handle (:meth:`Owner._open_copy`), registered with ``buffer``, default
        host memory. Like any holder it may be asked to copy a retained version to host memory
        ahead (it is often the first in its process to finish a version)."""
        owner = self._owner
        stage = owner._open_copy()
        if buffer is None:  # touched here, in the background, not in the update that reads it
            metas = owner.reads.layout.metas
            buffer = [(meta.name, c) for meta, c in zip(metas, owner.host_copies.host_like(touch=True))]
        stage.register(buffer)
        with self._lock:
            closing = owner.state is hm.Phase.CLOSED or self._closing
            if not closing:
                self._copy = stage
        if closing:
            stage.close(drop_last_copy=True)
            raise errors.HandleClosed(f"{owner.client_id} closed during its first prefetch")
        log.info("model=%s replica=%s shard=%d: prefetch staging copy %s registered",
                 owner.model, owner.replica, owner.shard, stage.client_id)
        return stage

    # ------------------------------------------------------------------ the double buffer's swap

    def swap(self, spec: m.VersionSpec) -> Optional[ReadStats]:
        """update() with a double buffer (the caller holds the handle's ``_lock``): take over the
        complete staging copy's memory (the server exchanges the two holders' endpoints) instead
        of copying it. None: not possible (sharded, no staging copy, a prefetch in flight -- the
        update must not wait for it: it follows it, pipelined, and smart skipping may answer at
        once), the staging copy is incomplete, or ``spec`` names another version. The server
        accepts a swap only from a handle that publishes nothing, so the current version is
        unpublished first; if the server then refuses, it is published again before this
        returns None: a refused swap changes nothing. A swap the server may or may not have made
        (no answer) is asked again until it answers; still unanswered after
        ``request_timeout_s``, ``ServerUnavailable`` is raised and the next call settles it
        first (:meth:`settle`)."""
        owner = self._owner
        if self._unsettled is not None:
            self.settle()
        stage = self._copy
        if stage is None or owner.num_shards > 1:
            return None
        with self._lock:
            if self._jobs:
                return None
        with stage._lock:  # no prefetch may start on the staging copy meanwhile
            v, old = stage.version, owner.version
            theirs = stage._standing()
            if (v is None or not theirs.complete or old == v or owner._standing().reading
                    or (isinstance(spec, int) and spec != v)):
                return None
            t0 = time.perf_counter()
            stage.host_copies.stop_copy(cancel_it=False)
            owner.host_copies.stop_copy()
            if old is not None:
                owner._unpublish_locked()
            req = m.Swap(client_id=owner.client_id, stage_id=stage.client_id, version=v, spec=spec,
                         endpoint=theirs.endpoint)  # as the server has it
            reply = self._swap_call(req)
            if isinstance(reply, m.ErrorReply):
                log.info("model=%s replica=%s shard=%d: no swap, copying instead: %s", owner.model, owner.replica,
                         owner.shard, reply.message)
                if old is not None:
                    owner._publish_again(old)
                return None
            owner._swapped(stage, v)
        dt = time.perf_counter() - t0
        log.info("model=%s replica=%s shard=%d: swapped to prefetched version %d in %.4fs", owner.model,
                 owner.replica, owner.shard, v, dt)
        st = ReadStats(action="replicated", version=v, seconds=dt, sources=(stage.client_id,),
                       holders=(stage.client_id,), prefetched=True, swapped=True, finished_at=time.time())
        metrics.record_read(owner.model, st.action, st.seconds, st.transfer_s, st.bytes, st.failovers, stall_s=0.0)
        return st

    def settle(self) -> None:
        """A swap left unanswered (:meth:`_swap_call`) is asked again before anything touches
        either set of tensors (the caller holds the handle's ``_lock``): made (``Ok``), the sets
        change hands now; refused, it was not made. Raises ``ServerUnavailable`` while there is
        still no answer. Nothing unsettled: nothing to do."""
        owner = self._owner
        req, stage = self._unsettled, self._copy
        if req is None or stage is None:
            self._unsettled = None  # no staging copy left: nothing to settle
            return
        with stage._lock:
            reply = self._swap_call(req)
            if isinstance(reply, m.ErrorReply):
                log.info("model=%s replica=%s shard=%d: the unanswered swap was not made: %s", owner.model,
                         owner.replica, owner.shard, reply.message)
                return
            owner._swapped(stage, req.version)
        log.info("model=%s replica=%s shard=%d: the unanswered swap to version %d was made", owner.model,
                 owner.replica, owner.shard, req.version)

    def _swap_call(self, req: m.Swap) -> object:
        """Send ``req`` until the server answers (the same swap again is answered ``Ok`` where it
        was made: :class:`m.Swap`); a refusal comes back as its ``ErrorReply``. No answer within
        ``request_timeout_s``: the swap is left unsettled and ``ServerUnavailable`` raised."""
        deadline = time.monotonic() + self._config.request_timeout_s
        pause = hm.RETRY_PAUSE_S
        while True:
            try:
                reply = self._port.call(req)
                self._unsettled = None
                return reply
            except (errors.ServerUnavailable, errors.RequestTimeout) as e:
                if time.monotonic() + pause >= deadline:
                    self._unsettled = req
                    raise errors.ServerUnavailable(
                        f"{self._owner.client_id}: no answer to a swap to version {req.version} ({e}); the next "
                        "call asks again before it touches either set of tensors") from e
                time.sleep(pause)
                pause = min(2 * pause, 1.0)
                try:
                    self._port.reconnect()
                except errors.TensorHubError:
                    pass
            except errors.TensorHubError as e:
                self._unsettled = None
                return m.ErrorReply(code=type(e).__name__, message=str(e))

    # ------------------------------------------------------------------ close

    def close_first(self, drop_last_copy: bool) -> Optional[BaseException]:
        """The handle's ``close()`` begins here: a swap left unanswered is settled (which set of
        tensors is whose, before either goes; a server still unreachable is logged), then
        :meth:`close`. Its ``LastCopyHeld`` is raised with both left open (:meth:`reopen`); any
        other failure is returned, for the handle to raise once it has closed itself."""
        owner = self._owner
        if self.unsettled_swap is not None:
            with owner._lock:
                try:
                    self.settle()
                except errors.ServerUnavailable as e:
                    log.warning("model=%s replica=%s shard=%d: closing with a swap unanswered: %s", owner.model,
                                owner.replica, owner.shard, e)
        try:
            self.close(drop_last_copy)
        except errors.LastCopyHeld:
            self.reopen()  # both stay open, as they were
            raise
        except BaseException as exc:  # noqa: BLE001 - the handle closes first, then this is raised
            return exc
        return None

    def close(self, drop_last_copy: bool) -> None:
        """close(), first step: no prefetch starts from now on; the one in flight ends; the
        staging copy closes (``LastCopyHeld``: kept, raised; any other failure closes it and
        is raised)."""
        with self._lock:
            self._closing = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            stage = self._copy
        if self.seeds is not None:
            self.seeds.close()
        try:
            if stage is not None and stage.state is not hm.Phase.CLOSED:
                stage.close(drop_last_copy=drop_last_copy)
        finally:
            with self._lock:
                if self._copy is stage and (stage is None or stage.state is hm.Phase.CLOSED):
                    self._copy = None

    def reopen(self) -> None:
        """The handle's close failed with ``LastCopyHeld``: it stays open, and prefetches may
        start again."""
        with self._lock:
            self._closing = False


def _log_seed(model: str, shard: int, version: int, fut: "concurrent.futures.Future") -> None:
    if fut.cancelled():
        return
    err = fut.exception()
    if err is not None:
        log.info("model=%s shard=%d: seeding version %d failed: %s", model, shard, version, err)
    else:
        log.info("model=%s shard=%d: seeded version %d into this datacenter", model, shard, version)
