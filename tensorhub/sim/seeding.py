"""Offload seeding in the simulator: a rollout that acts on ``SeedAhead`` and ``PrefetchAhead`` as
the real handle does.

:class:`SeedingClient` does what ``Staging.seed_asked`` / ``Hub.prefetch`` do: open a staging
handle on the same host (replica ``<replica>~prefetch``, ``stage_for`` the handle) and
``replicate`` it to the version in the background, one prefetch at a time, the newest asked
next. A ``PrefetchAhead`` (the datacenter's seed has reached it) is the same staging read, never
as a delta (``tensorhub.core.background.seed_across``). The staging handle lives in its owner's
process: a crash takes both (``World.crash``). Used by the fault-injecting scenarios of the
``crossdc`` workload and by the paper what-if (:mod:`tensorhub.sim.whatif_paper`).

A user's ``Hub.prefetch("latest")`` is the same staging read, asked by the user instead of a
``SeedAhead`` (:meth:`SeedingClient.prefetch`): the staging copy counts its own rounds, and
the owner's next ``update()`` is assigned its staging copy first (the scheduler's rule 2),
behind it if it is still arriving.

A double buffer (``World.double_buffer``: half the prefetching standalone seeds) makes that
``update()`` a ``Swap`` where ``Staging.swap`` would: unpublish, ``Swap``, then the two memories
(and their endpoints: readers reach memory by the endpoint the server assigns,
``World.memory_of``) change hands; a refusal publishes the old version again and copies; a swap
without an answer is sent again until it is answered (``Staging._swap_call``), else left unsettled
and settled before the next call.
"""

from __future__ import annotations

from typing import Optional

import msgspec

from tensorhub.core import background as bg
from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.sim.client import DIRTY_VERSION, SimClient


class StagingClient(SimClient):
    """A prefetch staging handle (``Hub._open_copy``): a holder of its own in host memory on
    its owner's host; the owner reads from it first."""

    def __init__(self, world, cid: str, *, stage_for: str, **kw) -> None:
        self.stage_for = stage_for
        super().__init__(world, cid, **kw)
        self.machine.incomplete_wait_s = world.config.lease_timeout_s  # Hub._open_copy

    def registration(self) -> m.Register:
        return msgspec.structs.replace(super().registration(), stage_for=self.stage_for)


class SeedingClient(SimClient):
    """A rollout shard that acts on ``SeedAhead`` as ``Staging.seed_asked`` does: prefetch the
    version into its staging copy in the background (one prefetch at a time, newest wins)."""

    def __init__(self, world, cid: str, *, staging_own_nic: bool = False, **kw) -> None:
        self.staging_own_nic = staging_own_nic
        """Put the staging copy on a host of its own (a NIC of its own, not the seeder's)."""
        self.stage: Optional[StagingClient] = None
        self.seeding = -1
        self.told: list[int] = []
        """Versions a ``PrefetchAhead`` asked for (the datacenter's seed had reached it)."""
        self.waiting: Optional[int] = None
        """A ``PrefetchAhead`` that waits for this handle's next read call to take the staged
        version (``Staging._waiting``, :func:`tensorhub.core.background.prefetch_waits`)."""
        self.seed_next: Optional[tuple[int, bool]] = None
        """(version, across) of the seed asked while the staging copy was busy: the next one."""
        self.seeds: list[tuple[int, float, float, str]] = []
        """(version, asked at, done at, code) of every prefetch."""
        self.user_prefetches = 0
        self.stages_opened = 0
        self.double_buffer = world.double_buffer
        """The user registered a double buffer (``Hub.register(double_buffer=)``): the staging
        copy is that second set, and an update swaps to it when it can (:meth:`_swap`)."""
        self.swaps: list[tuple[int, str]] = []
        """(version, outcome) of every swap tried: "ok", the code that refused it, "unsettled"
        (no answer), "settled" (made, learnt by asking again)."""
        self.unsettled: Optional[m.Swap] = None
        """A swap the server did not answer (``Staging.unsettled_swap``): settled before the next call."""
        super().__init__(world, cid, **kw)

    def _notes(self, notes: list) -> None:
        for note in notes:
            if bg.kind_of(note) is bg.Kind.SEED:
                if not bg.seed_across(note):
                    self.told.append(note.version)
                self._seed_asked(note.version, bg.seed_across(note))
        super()._notes([n for n in notes if bg.kind_of(n) is not bg.Kind.SEED])

    def _seed_asked(self, version: int, across: bool = True) -> None:
        if self.unsettled is not None:
            return  # Staging._prefetch_now settles the swap first; here the seed is skipped
        if not self.alive:
            return
        st = self.stage
        view = bg.SeedView(
            staging=False, registered=self.machine.phase is not hm.Phase.OPEN,
            closed=self.machine.phase is hm.Phase.CLOSED, published=self.published, seeding=self.seeding,
            stage_version=st.published if st is not None else None,
            stage_seq=st.machine.seq if st is not None else 0)
        if bg.seed_decision(version, view) is not None:
            return
        if not across and bg.prefetch_waits(view):
            self.waiting = max(version, -1 if self.waiting is None else self.waiting)
            return
        self.seeding = version
        if st is not None and st.op is not None:
            self.seed_next = (version, across)  # Hub: prefetches run one after the other
            return
        self._prefetch(version, across)

    def _prefetch(self, version, across: bool = True) -> None:
        """Read ``version`` (or ``"latest"``) into the staging copy, opened on first use;
        ``across``: a seed over the slow link (a delta may stand in for it)."""
        w, asked = self.world, self.world.sim.now
        if self.stage is None:
            # A client id of its own (the Hub's are unique): a restarted process's staging copy
            # must not be taken for its dead predecessor's, which the server may still list.
            cid = self.cid.replace("/", "~prefetch/", 1) + (f"-{self.stages_opened}" if self.stages_opened else "")
            self.stages_opened += 1
            # Host memory of the seeder's process: behind the seeder's NIC, unless the what-if
            # gives host memory a NIC of its own (one of a node's other RDMA NICs).
            host = w.add_host(self.dc) if self.staging_own_nic else self.host
            self.stage = StagingClient(w, cid, stage_for=self.cid, replica_id=f"{self.replica_id}~prefetch",
                                       shard=self.shard, num_shards=self.num_shards, host=host, dc=self.dc,
                                       spot=self.spot, role="staging")
            w.clients[cid] = self.stage
            self.stage.register(lambda code, _v: self._stage_registered(code, version, asked, across))
        else:
            self._stage_read(version, asked, across)

    def _stage_registered(self, code: str, version, asked: float, across: bool = True) -> None:
        if code == "ok":
            self._stage_read(version, asked, across)
        elif self.stage is not None and self.stage.op is None:
            # Hub._open_copy: a staging handle whose register() raised is dropped (the next
            # prefetch opens another); the server lets a registration it got expire.
            self.stage.retire()
            self.stage = None

    def prefetch(self) -> bool:
        """The user's ``Hub.prefetch("latest")``, called only once the previous one is done (a
        user that waits on its future); False if the handle cannot prefetch now."""
        st = self.stage
        if not self.alive or not self.registered or (st is not None and st.op is not None) or self.unsettled:
            return False  # unsettled: Hub.prefetch settles first; here the user's prefetch is skipped
        self.user_prefetches += 1
        self._prefetch("latest")
        return True

    def _stage_read(self, spec, asked: float, across: bool = True) -> None:
        def done(code: str, v: int) -> None:
            self.stage.delta_ready = None
            version = v if spec == "latest" else spec
            self.seeds.append((version, asked, self.world.sim.now, code))
            nxt, self.seed_next = self.seed_next, None
            if nxt is not None and nxt[0] > version:
                self._prefetch(*nxt)
        def read() -> None:
            if self.stage is not None and self.stage.alive and self.stage.op is None:
                self.stage.replicate(spec, True, done, round=bg.seed_round(spec) if isinstance(spec, int) else None)

        deltas = self.world.deltas
        if deltas is not None and isinstance(spec, int) and across:
            deltas.prepare(self.stage, spec, read)  # Staging._prefetch_now: Seeds.prepare first
        else:
            read()

    # ------------------------------------------------------------------ a double buffer's swap

    def replicate(self, spec, update: bool, cb, round=None) -> None:
        """``Hub.update`` with a double buffer swaps to a complete prefetch when it can
        (``Staging.swap``); otherwise, and for every other call, it copies. However it ends, a
        prefetch that waited for it is asked again (``Staging.after_read``) before ``cb``."""
        cb = self._after_read(cb)
        if update and round is None and self.double_buffer and self.unsettled is None and self._swappable(spec):
            self._swap(spec, cb)
        else:
            super().replicate(spec, update, cb, round)

    def _begin(self, kind: str, cb, op: hm.Op) -> None:
        """``Hub._run``: a swap left unanswered is settled before the call (:meth:`_settle`)."""
        if self.unsettled is None:
            super()._begin(kind, cb, op)
            return
        self._open_op(kind, cb)
        self._settle(lambda settled: self._feed(hm.Start(op)) if settled else self._finish("ServerUnavailable"))

    def _after_read(self, cb):
        """``cb`` preceded by ``Staging.after_read``: the prefetch that waited is asked again."""
        def done(code, version) -> None:
            waiting, self.waiting = self.waiting, None
            if waiting is not None:
                self._seed_asked(waiting, across=False)
            if cb is not None:
                cb(code, version)
        return done

    def _swappable(self, spec) -> bool:
        """``Staging.swap``'s own checks, before it asks the server: an unsharded handle, a
        staging copy that is complete, not prefetching, at another version than this handle's
        (``spec``'s, if it names one), and no read of this handle's in progress."""
        st = self.stage
        if st is None or self.num_shards > 1 or not self.alive or st.op is not None:
            return False
        v = st.published
        return (v is not None and st.region_version == v and st.region_progress == self.units
                and self.published != v and not self.machine.reading and (not isinstance(spec, int) or spec == v))

    def _swap(self, spec, cb) -> None:
        """The user's ``update()`` as one operation: background copies stopped, the current
        version unpublished (drained), then ``Swap``; the server's ``Ok`` exchanges the two
        memories, its refusal publishes the old version again and the update copies instead."""
        w, st = self.world, self.stage
        self._open_op("replicate", cb)
        st.copy_gen += 1
        old, version = self.published, st.published
        req = m.Swap(client_id=self.cid, stage_id=st.cid, version=version, spec=spec, endpoint=st.endpoint)
        if old is None:
            self._swap_call(req, w.sim.now + w.config.request_timeout_s, lambda r: self._swap_answered(r, spec, old))
            return

        def unpublished(code: str) -> None:
            if code == "ok":
                self._swap_call(req, w.sim.now + w.config.request_timeout_s,
                                lambda r: self._swap_answered(r, spec, old))
            else:
                self._finish(code)  # Hub: the unpublish's error leaves update()
        self.step_done = unpublished
        self._feed(hm.Start(hm.UnpublishOp()))

    def _swap_call(self, req: m.Swap, deadline: float, answer, pause: float = hm.RETRY_PAUSE_S) -> None:
        """``Staging._swap_call``: the same swap again while the server does not answer (it may have
        made it: it answers Ok again then), until ``deadline``; ``answer(None)``: still no answer,
        the swap is left unsettled (:attr:`unsettled`)."""
        w = self.world

        def replied(reply) -> None:
            if not self.alive:
                return
            if isinstance(reply, m.ErrorReply) and reply.code in ("ServerUnavailable", "RequestTimeout"):
                if w.sim.now + pause >= deadline:
                    self.unsettled = req
                    answer(None)
                else:
                    w.checker.observer.path("swap_retry")
                    w.sim.after(pause, self._swap_call, req, deadline, answer, min(2 * pause, 1.0))
                return
            self.unsettled = None
            answer(reply)
        w.server.call(self, req, False, None, on_reply=replied)

    def _swap_answered(self, reply, spec, old) -> None:
        if reply is None:
            self.swaps.append((self.unsettled.version, "unsettled"))
            self._finish("ServerUnavailable")  # Hub: raised; the next call settles it first
            return
        version = self.stage.published
        if isinstance(reply, m.ErrorReply):
            self.swaps.append((version, reply.code))
            self._copy_instead(spec, old)
            return
        self.swaps.append((version, "ok"))
        self._take_swap(version, old)
        self.world.checker.on_replicated(self, version)
        self._finish("ok", version, prefetched=True)

    def _settle(self, then) -> None:
        """``Staging.settle``: the unanswered swap asked again; made, the memories change
        hands now. ``then(True)``: settled (either way), ``then(False)``: still no answer."""
        req, w = self.unsettled, self.world

        def answered(reply) -> None:
            if reply is None:
                then(False)
                return
            if not isinstance(reply, m.ErrorReply):
                self.swaps.append((req.version, "settled"))
                self._take_swap(req.version, None)
            then(True)
        self._swap_call(req, w.sim.now + w.config.request_timeout_s, answered)

    def _take_swap(self, version: int, old) -> None:
        """``Hub._swapped`` (``Driver.swapped``): the two tensor sets (and their control blocks and endpoints) change
        hands; the staging copy holds nothing now. The memory each client names changes: the
        checkers see it as writes."""
        w, st = self.world, self.stage
        self.mem, st.mem = st.mem, self.mem
        self.mem_wtime, st.mem_wtime = st.mem_wtime, self.mem_wtime
        self.endpoint, st.endpoint = st.endpoint, self.endpoint
        self.region_version, self.region_progress = version, self.units
        st.region_version, st.region_progress = -1, 0
        self.machine.swapped_in(version, self.registration())
        st.machine.swapped_out(st.registration())
        w.checker.on_write(self.cid, None, version)
        w.checker.on_write(st.cid, None, old if old is not None else DIRTY_VERSION)

    def _copy_instead(self, spec, old) -> None:
        """A refused swap (``Hub._publish_again``): the old version is published again from the
        tensors that still hold it (whatever that answers), then the update copies."""
        def copy(_code: str = "ok") -> None:
            if self.alive:
                self._feed(hm.Start(hm.ReplicateOp(spec, True, None)))
        if old is None:
            copy()
            return
        self.step_done = copy
        self._feed(hm.Start(hm.PublishOp(old)))
