"""A simulated shard handle that follows the client side of the protocol.

Memory is a list of per-unit content tags ``(version, shard, unit)``; the trainer writes
them, a reader copies the source's tag at the END of each unit transfer (the read spans an
interval, so a write to the source during it is visible as a torn unit). A reader verifies
each unit (the checksum model) and treats a bad unit as a failed source.

Control requests go out one at a time (a FIFO queue); heartbeats and progress reports are
fire-and-forget. ``UnknownClient`` (the server restarted) starts recovery: ``Announce`` what
is held, then re-drive the operation in progress (an in-flight read is re-issued with
``resume_version``/``resume_units``). ``Evicted`` drops all server-side state; the workload
re-registers.

Every user operation (register, publish, unpublish, replicate, leave) is an :class:`Op` that
ends exactly once with ``"ok"`` or an error code; the checkers time them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tensorhub.core import messages as m

DIRTY = ("dirty",)
FREED = ("freed",)
TORN = ("torn",)
DIRTY_VERSION = -2
FREED_VERSION = -3

Callback = Callable[[str, int], None]


def version_tags(version: int, shard: int, units: int) -> list:
    return [(version, shard, k) for k in range(units)]


class Op:
    __slots__ = ("kind", "cid", "start", "cb", "version", "spec", "seq", "update")

    def __init__(self, kind: str, cid: str, start: float, cb: Optional[Callback], **kw: Any) -> None:
        self.kind, self.cid, self.start, self.cb = kind, cid, start, cb
        self.version = kw.get("version", -1)
        self.spec = kw.get("spec", "latest")
        self.seq = kw.get("seq", 0)
        self.update = kw.get("update", False)


class ReadState:
    """One replicate round of this shard, from request to ReplicateDone."""

    def __init__(self, spec, seq: int, update: bool) -> None:
        self.spec, self.seq, self.update = spec, seq, update
        self.version = -1
        self.started = False  # memory is being overwritten with ``version``
        self.assign_no = 0
        self.source: Optional[str] = None
        self.partial = False
        self.progress = 0  # contiguous verified units of ``version``
        self.have: set[int] = set()
        self.inflight: dict[int, Any] = {}
        self.failing = False
        self.dead_pending = False
        self.done_sent = False
        self.stall_token = 0
        self.reported = 0


class SimClient:
    def __init__(self, world, cid: str, *, replica_id: str, shard: int, num_shards: int,
                 host: str, dc: str, spot: bool, role: str) -> None:
        self.world = world
        self.cid = cid
        self.replica_id, self.shard, self.num_shards = replica_id, shard, num_shards
        self.host, self.dc, self.spot, self.role = host, dc, spot, role
        p = world.params
        self.units = p.units
        self.unit_bytes = p.unit_bytes
        self.mem: list = [None] * self.units
        self.mem_wtime: list[float] = [0.0] * self.units
        self.published: Optional[int] = None
        self.host_copies: dict[int, list] = {}
        self.alive = True
        self.retired = False
        self.registered = False
        self.recovering = False
        self.recover_at = 0.0
        self.session = 0
        self.queue: list = []
        self.outstanding = None
        self.sent_at = 0.0
        self.op: Optional[Op] = None
        self.reading: Optional[ReadState] = None
        self.offload_token = 0
        self.waiters: dict[str, bool] = {}
        self.last_txn = (-1, -1)
        self.driver = None
        self.index = 0
        world.sim.after(world.rng_client.random() * world.config.heartbeat_interval_s, self._heartbeat)

    # ------------------------------------------------------------------ identity

    def registration(self) -> m.Register:
        w = self.world
        return m.Register(
            client_id=self.cid, model=w.params.model, replica_id=self.replica_id, shard=self.shard,
            num_shards=self.num_shards, layout=w.layout(self.shard), endpoint=self.cid.encode(),
            datacenter=self.dc, spot=self.spot,
        )

    def serves(self) -> list[str]:
        return [self.cid] + [f"{self.cid}#host{v}" for v in sorted(self.host_copies)]

    def served_units(self, version: int) -> int:
        """The progress counter a reader sees for ``version`` (0: this memory does not hold it)."""
        if not self.alive:
            return 0
        if self.published == version:
            return self.units
        rs = self.reading
        if rs is not None and rs.started and rs.version == version:
            return rs.progress
        return 0

    # ------------------------------------------------------------------ user operations

    def register(self, cb: Callback) -> None:
        self._begin(Op("register", self.cid, self.world.sim.now, cb))
        self._request(self.registration())

    def publish(self, version: int, cb: Callback) -> None:
        self._begin(Op("publish", self.cid, self.world.sim.now, cb, version=version))
        self._request(m.Publish(client_id=self.cid, version=version))

    def unpublish(self, cb: Callback) -> None:
        self._begin(Op("unpublish", self.cid, self.world.sim.now, cb))
        self._request(m.Unpublish(client_id=self.cid))

    def replicate(self, spec, seq: int, update: bool, cb: Callback) -> None:
        self._begin(Op("replicate", self.cid, self.world.sim.now, cb, spec=spec, seq=seq, update=update))
        self.reading = ReadState(spec, seq, update)
        self._request(m.Replicate(client_id=self.cid, spec=spec, seq=seq, update=update))

    def leave(self, cb: Callback) -> None:
        self._begin(Op("leave", self.cid, self.world.sim.now, cb))
        self._request(m.Leave(client_id=self.cid))

    # trainer-side memory writes (the training step)
    def mutate(self) -> None:
        """Start overwriting the registered tensors (allowed only after UnpublishDone)."""
        self.world.checker.on_write(self.cid, None, DIRTY_VERSION)
        self.mem = [DIRTY] * self.units
        self.mem_wtime = [self.world.sim.now] * self.units

    def write_version(self, version: int) -> None:
        self.world.checker.on_write(self.cid, None, version)
        self.mem = version_tags(version, self.shard, self.units)
        self.mem_wtime = [self.world.sim.now] * self.units
        self.world.checker.trainer_wrote(self.shard, version)

    def retire(self) -> None:
        """The process exits after a clean leave: its memory is freed."""
        self.world.checker.on_write(self.cid, None, FREED_VERSION)
        for v in sorted(self.host_copies):
            self._free_host(v)
        self.alive = False
        self.retired = True
        self.mem = [FREED] * self.units

    # ------------------------------------------------------------------ op bookkeeping

    def _begin(self, op: Op) -> None:
        assert self.op is None, f"{self.cid}: {op.kind} while {self.op.kind} is in progress"
        assert self.alive
        self.op = op
        self.world.checker.op_start(op)

    def _finish(self, code: str, version: int = -1) -> None:
        op = self.op
        if op is None:
            return
        self.op = None
        self.world.checker.op_end(op, code)
        if op.cb is not None:
            self.world.sim.after(0.0, op.cb, code, version)

    def abandon(self) -> None:
        """The process died: its operation ends with it (no reply will come)."""
        if self.op is not None:
            self.world.checker.op_abandon(self.op)
            self.op = None

    # ------------------------------------------------------------------ sending

    def _request(self, req) -> None:
        self.queue.append(req)
        self._pump()

    def _pump(self) -> None:
        if self.outstanding is None and self.queue and self.alive:
            req = self.queue.pop(0)
            self.outstanding = req
            self.sent_at = self.world.sim.now
            self.world.server.send(self, req, self.session, True)

    def _fire(self, req) -> None:
        self.world.server.send(self, req, self.session, True)

    def _heartbeat(self) -> None:
        if not self.alive:
            return
        w = self.world
        if self.registered and not self.recovering:
            self._fire(m.Heartbeat(client_id=self.cid))
        timeout = 3 * w.config.heartbeat_interval_s + 1.0
        if self.outstanding is not None and w.sim.now - self.sent_at > timeout:
            # The request or its reply was lost (the server crashed): start over.
            if self.registered or self.recovering:
                self.recovering = False
                self._recover()
            else:
                req, self.outstanding = self.outstanding, None
                self.queue.insert(0, req)
                self._pump()
        w.sim.after(w.config.heartbeat_interval_s, self._heartbeat)

    # ------------------------------------------------------------------ replies

    def on_reply(self, req, reply, session: int) -> None:
        if not self.alive or session != self.session:
            return
        if req is self.outstanding:
            self.outstanding = None
        if (isinstance(reply, m.ErrorReply) and reply.code == "UnknownClient"
                and not isinstance(req, (m.Register, m.Announce))):
            self._recover()
            return
        kind = type(req).__name__
        if kind in ("Heartbeat", "Progress"):
            pass
        elif kind == "Register":
            if isinstance(reply, m.Ok):
                self.registered = True
                self._finish("ok")
            else:
                self._finish(reply.code)
        elif kind == "Announce":
            self._announced(reply)
        elif kind == "Publish":
            if isinstance(reply, m.Ok):
                self.published = req.version
                self._finish("ok", req.version)
            else:
                self._finish(reply.code)
        elif kind == "ReplicateDone":
            if isinstance(reply, m.Ok):
                self._replicated()
            elif self.reading is not None:
                # The server moved us back to WAITING (our source died as we finished):
                # report done again with the next assignment, or fail with the version.
                self.reading.done_sent = False
        elif kind == "Leave":
            self.registered = False
            self._finish("ok" if isinstance(reply, m.Ok) else reply.code)
        elif kind == "SourceFailed" and isinstance(reply, m.ErrorReply):
            pass  # a Failed or Evicted event says what happened
        else:  # Replicate, Unpublish, OffloadDone, SourceFailed
            if isinstance(reply, m.ErrorReply):
                if kind == "Replicate":
                    self.reading = None
                self._finish(reply.code)
            elif isinstance(reply, m.NoChange):
                self._nochange(reply.version)
            elif isinstance(reply, m.Waiting):
                rs = self.reading
                if kind == "Replicate" and rs is not None and not rs.started and reply.version >= 0:
                    rs.version = reply.version
            elif not isinstance(reply, m.Ok):
                self.on_event(reply)
        self._pump()

    def on_event(self, ev) -> None:
        if not self.alive:
            return
        if isinstance(ev, m.Assignment):
            self._on_assignment(ev)
        elif isinstance(ev, m.UnpublishDone):
            if self.op is not None and self.op.kind == "unpublish":
                self.published = None
                self._finish("ok", ev.version)
        elif isinstance(ev, m.OffloadOrder):
            if self.published == ev.version:
                self._start_offload(ev.version)
        elif isinstance(ev, m.DropHostCopy):
            if ev.version in self.host_copies:
                self._free_host(ev.version)
        elif isinstance(ev, m.Failed):
            if self.op is not None and self.op.kind == "replicate" and self.reading is not None:
                self._cancel_reads(self.reading)
                self.reading = None
                self._finish(ev.code)
        elif isinstance(ev, m.Evicted):
            self._evicted()

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        if not self.registered or self.recovering:
            return
        self.world.stats_recoveries += 1
        self.session += 1
        self.outstanding = None
        self.queue = []
        self.recovering = True
        self.offload_token += 1
        rs = self.reading
        published = self.published
        txn = self.last_txn
        if rs is not None:
            self._cancel_reads(rs)
            rs.failing = False
            rs.dead_pending = False
            rs.done_sent = False
            rs.assign_no = 0  # a fresh server numbers assignments from scratch
            if rs.started and rs.progress >= self.units:
                published = rs.version
            if rs.version >= 0:
                txn = (rs.seq, rs.version)
        holding = m.Holding(
            published=published,
            host_copies=tuple((v, f"host:{self.cid}:{v}".encode()) for v in sorted(self.host_copies)),
            txn_seq=txn[0] if txn[1] >= 0 else -1, txn_version=txn[1] if txn[1] >= 0 else -1,
        )
        self.outstanding = m.Announce(register=self.registration(), holding=holding)
        self.sent_at = self.world.sim.now
        self.world.server.send(self, self.outstanding, self.session, True)

    def _announced(self, reply) -> None:
        self.recovering = False
        if isinstance(reply, m.ErrorReply):
            self.registered = False
            self.reading = None
            self._finish(reply.code)
            return
        op, rs = self.op, self.reading
        self.queue = []  # anything queued meanwhile belongs to ``op`` and is re-driven below
        if op is None:
            return
        if op.kind == "register":
            self._finish("ok")
        elif op.kind == "publish":
            self._request(m.Publish(client_id=self.cid, version=op.version))
        elif op.kind == "unpublish":
            self._request(m.Unpublish(client_id=self.cid))
        elif op.kind == "leave":
            self._request(m.Leave(client_id=self.cid))
        elif op.kind == "replicate" and rs is not None:
            if rs.started and rs.progress >= self.units:
                self._replicated()  # announced as a complete holder
            elif rs.started:
                self._request(m.Replicate(
                    client_id=self.cid, spec=rs.version, seq=rs.seq, update=False,
                    resume_version=rs.version, resume_units=rs.progress,
                ))
            else:
                self._request(m.Replicate(client_id=self.cid, spec=rs.spec, seq=rs.seq, update=rs.update))

    def _evicted(self) -> None:
        self.world.checker.note_loss("evicted")
        if self.driver is not None:
            self.driver.broken = True
        self.session += 1
        self.outstanding = None
        self.queue = []
        self.recovering = False
        self.registered = False
        self.published = None
        self.offload_token += 1
        for v in sorted(self.host_copies):
            self._free_host(v)
        if self.reading is not None:
            self._cancel_reads(self.reading)
            self.reading = None
        self._finish("Evicted")

    # ------------------------------------------------------------------ unpublish / offload

    def _start_offload(self, version: int) -> None:
        self.offload_token += 1
        dur = self.units * self.unit_bytes / self.world.params.host_bw
        self.world.sim.after(dur, self._offloaded, version, self.offload_token)

    def _offloaded(self, version: int, token: int) -> None:
        if not self.alive or token != self.offload_token or self.published != version:
            return
        self.host_copies[version] = list(self.mem)
        self._request(m.OffloadDone(client_id=self.cid, version=version,
                                    endpoint=f"host:{self.cid}:{version}".encode()))

    def _free_host(self, version: int) -> None:
        self.world.checker.on_write(f"{self.cid}#host{version}", None, FREED_VERSION)
        del self.host_copies[version]

    # ------------------------------------------------------------------ reading

    def _on_assignment(self, a: m.Assignment) -> None:
        rs = self.reading
        if rs is None or a.assign_no <= rs.assign_no:
            return
        if rs.started and rs.version != a.version:
            rs.progress, rs.have = 0, set()
        rs.version = a.version
        rs.assign_no = a.assign_no
        if not rs.started:
            rs.started = True
            self.published = None  # from here on the memory holds the new version's units
        self._cancel_reads(rs)
        rs.source, rs.partial = a.source_id, a.source_partial
        rs.failing = rs.dead_pending = False
        rs.stall_token += 1
        if rs.progress >= self.units:
            self._complete(rs)
        else:
            self._issue(rs)

    def _cancel_reads(self, rs: ReadState) -> float:
        """Stop using the posted reads (they stay physically in flight until they end)."""
        end = self.world.sim.now
        for rd in rs.inflight.values():
            rd.dead = True
            end = max(end, rd.end)
        rs.inflight = {}
        return end

    def _next_unit(self, rs: ReadState) -> int:
        k = rs.progress
        while k < self.units and (k in rs.have or k in rs.inflight):
            k += 1
        return k

    def _issue(self, rs: ReadState) -> None:
        w = self.world
        if rs.failing or rs.source is None or rs.progress >= self.units:
            return
        src = w.source_client(rs.source)
        if src is None or not src.alive or (rs.source != src.cid and rs.source not in src.serves()):
            if not rs.dead_pending:  # the read will fail after the transport's detection delay
                rs.dead_pending = True
                w.sim.after(w.params.detect_delay_s, self._dead_detected, rs, rs.assign_no)
            return
        limit = src.served_units(rs.version) if (rs.partial and rs.source == src.cid) else self.units
        while len(rs.inflight) < w.config.reads_in_flight:
            k = self._next_unit(rs)
            if k >= self.units:
                break
            if k >= limit:
                src.waiters[self.cid] = True
                rs.stall_token += 1
                w.sim.after(w.config.source_stall_timeout_s, self._stall_check, rs, rs.stall_token)
                break
            nbytes = self.unit_bytes
            end = w.net.reserve(src.host, self.host, nbytes)
            if rs.source != src.cid:  # a host-memory copy: slower than GPU memory
                end += nbytes / w.params.host_bw
            rd = w.net.post(self.cid, rs.source, rs.version, k, end, w.server.epoch, rs.assign_no)
            rs.inflight[k] = rd
            w.sim.at(end, self._read_end, rd)

    def _read_end(self, rd) -> None:
        w = self.world
        w.net.unregister(rd)
        if rd.dead or not self.alive:
            return
        rs = self.reading
        if rs is None or rs.inflight.get(rd.unit) is not rd:
            return
        del rs.inflight[rd.unit]
        tag = w.read_tag(rd)
        self._write_unit(rd.unit, tag, rs.version)
        if tag != (rs.version, self.shard, rd.unit):
            w.stats_bad_units += 1
            self._source_failed(rs)  # the checksum does not match: a bad source
            return
        rs.have.add(rd.unit)
        while rs.progress in rs.have:
            rs.progress += 1
        rs.stall_token += 1
        self._notify_waiters()
        step = max(1, self.units // 4)
        if rs.progress >= self.units:
            self._complete(rs)
            return
        if rs.progress - rs.reported >= step:
            rs.reported = rs.progress
            self._fire(m.Progress(client_id=self.cid, units_done=rs.progress))
        self._issue(rs)

    def _write_unit(self, unit: int, tag, version: int) -> None:
        self.world.checker.on_write(self.cid, unit, version)
        self.mem[unit] = tag
        self.mem_wtime[unit] = self.world.sim.now

    def _notify_waiters(self) -> None:
        if not self.waiters:
            return
        w = self.world
        for cid in sorted(self.waiters):
            reader = w.clients.get(cid)
            if reader is not None:
                w.sim.after(w.params.poll_s, reader.poke, self.cid)
        self.waiters = {}

    def poke(self, source_cid: str) -> None:
        """The source's progress counter moved (or the source died)."""
        rs = self.reading
        if not self.alive or rs is None or rs.failing:
            return
        if rs.source == source_cid or (rs.source or "").startswith(source_cid + "#"):
            rs.stall_token += 1
            self._issue(rs)

    def _stall_check(self, rs: ReadState, token: int) -> None:
        if self.alive and rs is self.reading and token == rs.stall_token and not rs.failing:
            self.world.stats_stalls += 1
            self._source_failed(rs)

    def _dead_detected(self, rs: ReadState, assign_no: int) -> None:
        if self.alive and rs is self.reading and rs.assign_no == assign_no and not rs.failing:
            self._source_failed(rs)

    def source_died(self) -> None:
        """Called by the world when our source crashed: posted reads from it are lost."""
        rs = self.reading
        if rs is None or rs.failing:
            return
        for rd in rs.inflight.values():
            rd.dead = True
        rs.inflight = {}
        if not rs.dead_pending:
            rs.dead_pending = True
            self.world.sim.after(self.world.params.detect_delay_s, self._dead_detected, rs, rs.assign_no)

    def _source_failed(self, rs: ReadState) -> None:
        if rs.failing:
            return
        rs.failing = True
        end = self._cancel_reads(rs)
        src = self.world.source_client(rs.source) if rs.source else None
        if src is not None:
            src.waiters.pop(self.cid, None)
        # Report only once our posted reads have ended: the source must not be handed back
        # (and written) while we still read from it.
        self.world.sim.at(end, self._send_source_failed, rs, rs.assign_no, self.session)

    def _send_source_failed(self, rs: ReadState, assign_no: int, session: int) -> None:
        if (self.alive and session == self.session and rs is self.reading and rs.failing
                and rs.assign_no == assign_no and not self.recovering):
            src = self.world.source_client(rs.source) if rs.source else None
            self._request(m.SourceFailed(client_id=self.cid, source_id=rs.source, units_done=rs.progress,
                                         unreachable=src is not None and not src.alive))

    def _complete(self, rs: ReadState) -> None:
        if not rs.done_sent:
            rs.done_sent = True
            self._request(m.ReplicateDone(client_id=self.cid, version=rs.version))

    def _replicated(self) -> None:
        rs = self.reading
        self.reading = None
        self.published = rs.version
        self.last_txn = (rs.seq, rs.version)
        self.world.checker.on_replicated(self, rs.version)
        self._finish("ok", rs.version)

    def _nochange(self, version: int) -> None:
        rs = self.reading
        self.reading = None
        if rs is not None:
            self.last_txn = (rs.seq, version)
        self.world.checker.on_replicated(self, version)
        self._finish("ok", version)
