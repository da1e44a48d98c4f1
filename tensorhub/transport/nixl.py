"""The NIXL data path: registered regions, one-sided reads, progress counters.

A *holder* registers its tensors once (:meth:`Region.register`) and exposes an
:class:`Endpoint`. Next to the tensors each region owns a registered host **control block**,
an int64 tensor ``[version, progress_units, checksum_0, ..., checksum_{U-1}]``. A reader never
calls into the holder's Python: it READs the holder's control block to learn which version is
there and how many units are final, then READs those units straight into its own registered
tensors (:func:`pull`). While receiving, the reader advances its *own* control block, so a third
process can read from it at the same time (pipeline replication: ``holder -> r1 -> r2``).

Ordering rule for writers of a control block: write a unit's bytes, then its checksum, then the
progress counter. Readers only read units below the progress they saw.

A posted READ is released only once NIXL reports it terminal (``DONE`` or ``ERR``). Releasing a
handle still in progress is NIXL's only abort (``nixlAgent::releaseXferReq`` asks the backend to
release the request), and for UCX it does not stop the READ: ``ucp_request_cancel`` cancels only
tag receives, and ``ucp_request_free`` frees a request when it completes, so the bytes may land
after the release, with no handle left to tell when. A read that does not become terminal is
therefore kept, never released: by its region (:meth:`Region.settle`), or by
:data:`_kept_alive` with the memory it writes into.

The process's NIXL agent and the rules for calling into it (one per process, every transfer call
under its ``xfer_lock``, let go while a pull sleeps) live in :mod:`tensorhub.transport.agent`.
Updating a control block (``set_progress`` etc.) is a plain memory write and may happen from any
thread.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any, Optional

import msgspec
import torch

from tensorhub.config import Config
from tensorhub.errors import LayoutMismatch, SourceStalled, TransferError
from tensorhub.layout import Layout, dtype_name
from tensorhub.transport import shm
from tensorhub.transport.agent import (POLL_FIRST_S, POLL_MAX_S, Agent, XferState, await_terminal, get_agent,
                                       is_terminal, sleep_unlocked)
from tensorhub.transport.shm import ShmInfo

logger = logging.getLogger(__name__)

__all__ = [
    "Endpoint",
    "MemRegion",
    "Region",
    "Source",
    "decode_endpoint",
    "encode_endpoint",
    "open_source",
]

_HEADER = 2  # control block: [version, progress, checksums...]



_NO_VERSION = -1
_CONTROL_FINE_S = 5e-3

_kept_alive: list[Any] = []
"""Regions and sources closed while a READ into their memory was still in flight: kept, still
registered, so that the late bytes land in memory nobody else uses (logged when it happens)."""


def _to_i64(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


def _to_u64(s: int) -> int:
    return s + (1 << 64) if s < 0 else s


# --------------------------------------------------------------------------- wire types


class MemRegion(msgspec.Struct, frozen=True):
    """One registered memory range: address, length, ``"DRAM"`` or ``"VRAM"``, device id."""

    addr: int
    nbytes: int
    mem_type: str = "DRAM"
    dev_id: int = 0


class Endpoint(msgspec.Struct, frozen=True):
    """Everything a remote reader needs to read a :class:`Region`: the holder's NIXL agent name
    and metadata, one :class:`MemRegion` per tensor (layout order; zero-byte tensors have
    ``addr == 0``), the control block, and the layout's fingerprint/unit signature/unit count."""

    agent_name: str
    agent_metadata: bytes
    tensors: tuple[MemRegion, ...]
    control: MemRegion
    fingerprint: str
    unit_signature: str
    unit_count: int
    shm: Optional[ShmInfo] = None
    """Set when the region lives in shared memory: a reader on the same host maps it instead
    (:mod:`tensorhub.transport.shm`)."""


def encode_endpoint(ep: Endpoint) -> bytes:
    """msgpack bytes of ``ep`` (for any channel: a Ray call, the reference server, ...)."""
    return msgspec.msgpack.encode(ep)


def decode_endpoint(data: bytes) -> Endpoint:
    """Inverse of :func:`encode_endpoint`; raises ``msgspec.ValidationError`` on garbage."""
    return msgspec.msgpack.decode(data, type=Endpoint)



# --------------------------------------------------------------------------- holder side


def _mem_of(t: torch.Tensor) -> tuple[str, int]:
    if t.device.type == "cpu":
        return "DRAM", 0
    if t.device.type == "cuda":
        return "VRAM", int(t.device.index or 0)  # untested: no GPU here
    raise LayoutMismatch(f"unsupported device {t.device}")


class Region:
    """A set of tensors registered with NIXL once, plus their control block.

    Used by holders (they publish: ``set_checksums``, ``set_progress``, ``set_version``) and by
    receivers (:func:`pull` writes into the tensors and advances the control block). The
    registration lives until :meth:`close`; the caller must keep the tensors alive and must not
    reallocate them until then. Not thread-safe except for the ``set_*`` writers.
    """

    def __init__(self, agent: Agent, tensors: list[torch.Tensor], layout: Layout,
                 regs: list[Any], control: torch.Tensor, mems: tuple[MemRegion, ...],
                 mem_type: str):
        self.agent = agent
        self.tensors = tensors
        self.layout = layout
        self.control = control
        self._regs = regs
        self._mems = mems
        self.mem_type = mem_type
        self._local_dlist: Any = None
        self._closed = False
        self.starved_s = 0.0
        """Time pulls into this region spent starved: waiting for a source to have the next unit
        (``ReadStats.stall_s``)."""
        self.shm_info: Optional[ShmInfo] = None
        """Where same-host readers map this region (None: NIXL only)."""
        self._unsettled: dict[int, Any] = {}
        """Reads into this region that a pull left in flight (unit -> handle): see :meth:`settle`."""
        self._unsettled_ranges: dict[int, Any] = {}
        """Range reads (:mod:`tensorhub.transport.ranges`) left in flight: id(handle) -> handle."""
        self._finalizer = weakref.finalize(self, _release_dropped_region, agent, list(regs), control, tensors,
                                           self._unsettled, self._unsettled_ranges)
        self._finalizer.atexit = False
        """A region garbage-collected without :meth:`close` deregisters what it registered
        before its memory goes (see :func:`_release_dropped_source`: a stale registration inside
        later tensors fails reads into them)."""

    @classmethod
    def register(cls, tensors: Sequence[torch.Tensor], layout: Layout, config: Config,
                 agent: Optional[Agent] = None) -> "Region":
        """Register ``tensors`` (layout order; all on one device) with NIXL and allocate the
        control block (version -1, progress 0, checksums 0). CPU tensors are registered as DRAM,
        CUDA tensors as VRAM with their device id (the VRAM path is untested). Raises
        :class:`LayoutMismatch` if the tensors do not match ``layout``, are non-contiguous or span
        devices; :class:`TransferError` if NIXL refuses the registration."""
        agent = agent or get_agent(config)
        tensors = list(tensors)
        metas = layout.metas
        if len(tensors) != len(metas):
            raise LayoutMismatch(f"{len(tensors)} tensors for a layout of {len(metas)}")
        devices = set()
        for m, t in zip(metas, tensors):
            if not isinstance(t, torch.Tensor) or not t.is_contiguous():
                raise LayoutMismatch(f"tensor {m.name!r}: not a contiguous tensor")
            if dtype_name(t.dtype) != m.dtype or tuple(t.shape) != m.shape:
                raise LayoutMismatch(
                    f"tensor {m.name!r}: {t.dtype}{list(t.shape)} does not match {m.dtype}{list(m.shape)}")
            devices.add(t.device)
        if len(devices) != 1:
            raise LayoutMismatch(f"tensors span several devices: {sorted(map(str, devices))}")
        mem_type, dev_id = _mem_of(tensors[0])
        control = torch.zeros(_HEADER + layout.unit_count, dtype=torch.int64)
        control[0] = _NO_VERSION
        shm_info = shm.share(tensors, control, config)  # moves storages: before taking addresses
        mems = tuple(
            MemRegion(t.data_ptr(), m.nbytes, mem_type, dev_id) if m.nbytes else MemRegion(0, 0, mem_type, dev_id)
            for m, t in zip(metas, tensors)
        )
        regs = []
        # Tensors that share storage (views) must be registered once per distinct range.
        ranges = sorted({(r.addr, r.nbytes) for r in mems if r.nbytes})
        try:
            if ranges:
                regs.append(agent.nixl.register_memory(
                    [(a, n, dev_id, "") for a, n in ranges], mem_type))
            regs.append(agent.nixl.register_memory(control))
        except Exception as e:
            for r in regs:
                agent.nixl.deregister_memory(r)
            raise TransferError(f"NIXL registration failed: {e}") from e
        logger.debug("registered %d tensors (%d bytes, %s) on %s",
                     len(tensors), layout.total_bytes, mem_type, agent.name)
        region = cls(agent, tensors, layout, regs, control, mems, mem_type)
        region.shm_info = shm_info
        return region

    # ---- control block -------------------------------------------------------------
    @property
    def version(self) -> int:
        """Version the tensors hold or are receiving; -1 before any."""
        return int(self.control[0])

    @property
    def progress(self) -> int:
        """Number of leading units that are final (a complete region: ``unit_count``)."""
        return int(self.control[1])

    def set_version(self, version: int) -> None:
        """Publish ``version`` in the control block. To start holding a new version write
        ``set_progress(0)`` first (readers then see no final units of the new version)."""
        self.control[0] = int(version)

    def set_progress(self, units: int) -> None:
        """Publish that units ``[0, units)`` are final; write their bytes and checksums first."""
        if not 0 <= units <= self.layout.unit_count:
            raise ValueError(f"progress {units} outside [0, {self.layout.unit_count}]")
        self.control[1] = int(units)

    def set_checksums(self, checksums: Sequence[int], start: int = 0) -> None:
        """Store unsigned 64-bit checksums for units ``start, start+1, ...``."""
        if start + len(checksums) > self.layout.unit_count:
            raise ValueError("more checksums than units")
        if len(checksums):
            self.control[_HEADER + start:_HEADER + start + len(checksums)] = torch.tensor(
                [_to_i64(int(c)) for c in checksums], dtype=torch.int64)

    def checksums(self) -> list[int]:
        """The unsigned checksums currently in the control block."""
        return [_to_u64(int(x)) for x in self.control[_HEADER:].tolist()]

    def publish_complete(self, version: int, checksums: Optional[Sequence[int]] = None) -> None:
        """Convenience for a holder whose tensors are complete: checksums, progress = all, version."""
        self.set_progress(0)
        if checksums is not None:
            self.set_checksums(checksums)
        self.set_version(version)
        self.set_progress(self.layout.unit_count)

    @property
    def mems(self) -> tuple[MemRegion, ...]:
        """The registered memory of each tensor, layout order (what :meth:`endpoint` publishes)."""
        return self._mems

    def endpoint(self) -> Endpoint:
        """The :class:`Endpoint` readers need; cheap, may be called repeatedly."""
        self._check_open()
        return Endpoint(
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata(),
            tensors=self._mems,
            control=MemRegion(self.control.data_ptr(), self.control.numel() * 8, "DRAM", 0),
            fingerprint=self.layout.fingerprint,
            unit_signature=self.layout.unit_signature,
            unit_count=self.layout.unit_count,
            shm=self.shm_info,
        )

    def _local_descs(self) -> Any:
        """Prepared local descriptor list: every piece of every unit, in order (cached)."""
        if self._local_dlist is None:
            self._local_dlist = self.agent.nixl.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _piece_descs(self._mems, self.layout), self.mem_type)
        return self._local_dlist

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("region is closed")

    # ---- reads a pull left in flight ------------------------------------------------
    @property
    def unsettled_units(self) -> list[int]:
        """Units a READ of an earlier pull may still write (that pull raised
        :class:`~tensorhub.errors.ReadsNotTerminal`); empty normally."""
        with self.agent.xfer_lock:
            return sorted(self._unsettled)

    def _keep_unsettled(self, reads: dict[int, Any]) -> None:
        """Take over reads into this region that are not terminal (never released until they are)."""
        assert not self._unsettled.keys() & reads.keys(), "a unit read twice at once"
        self._unsettled.update(reads)

    @property
    def unsettled_ranges(self) -> int:
        """Range reads (:func:`tensorhub.transport.ranges.read_runs`) still in flight into this
        region after the call that posted them raised :class:`~tensorhub.errors.ReadsNotTerminal`;
        0 normally. :meth:`settle` waits for them too."""
        with self.agent.xfer_lock:
            return len(self._unsettled_ranges)

    def keep_range_reads(self, reads: Sequence[Any]) -> None:
        """Take over range reads into this region that are not terminal: they are released only
        once NIXL reports them terminal (:meth:`settle`); until then the region is not closed
        and no pull starts."""
        with self.agent.xfer_lock:
            for h in reads:
                self._unsettled_ranges[id(h)] = h  # the dict keeps h alive: its id stays unique

    def settle(self, timeout_s: float = 0.0) -> bool:
        """Wait up to ``timeout_s`` (0: look once) for the reads an earlier pull left in flight
        (:class:`~tensorhub.errors.ReadsNotTerminal`) to become terminal, releasing each as it
        does. True when none is left: only then may another pull (or anyone) write the region's
        units past its progress, and the failed source be reported. Idempotent; thread-safe
        (takes the agent's ``xfer_lock`` for each look only); cheap when nothing is left."""
        deadline = time.monotonic() + timeout_s
        if self._unsettled:
            await_terminal(self.agent.nixl, self._unsettled, timeout_s, self.agent.xfer_lock)
        if self._unsettled_ranges:
            left = max(0.0, deadline - time.monotonic())
            await_terminal(self.agent.nixl, self._unsettled_ranges, left, self.agent.xfer_lock)
        return not self._unsettled and not self._unsettled_ranges

    def close(self) -> None:
        """Deregister everything. Idempotent. Readers of this region fail afterwards (their
        reads error out); callers must drain readers first (the unpublish contract). If reads
        into this region are still in flight (:meth:`settle` is False), nothing is deregistered:
        the region and its tensors are kept alive for the late bytes (logged)."""
        if self._closed:
            return
        self._finalizer.detach()
        if not self.settle(0.0):
            logger.error("region on %s closed with reads into units %s (and %d range reads) still in flight: "
                         "kept registered", self.agent.name, self.unsettled_units, self.unsettled_ranges)
            self._closed = True
            _kept_alive.append(self)
            return
        self._closed = True
        if self._local_dlist is not None:
            self._local_dlist.release()
            self._local_dlist = None
        for r in self._regs:
            try:
                self.agent.nixl.deregister_memory(r)
            except Exception:  # noqa: BLE001 - closing must not raise
                logger.warning("deregister failed on %s", self.agent.name, exc_info=True)
        self._regs = []


def _piece_descs(mems: Sequence[MemRegion], layout: Layout) -> list[tuple[int, int, int]]:
    out = []
    for unit in layout.units:
        for p in unit:
            m = mems[p.tensor_index]
            out.append((m.addr + p.offset, p.nbytes, m.dev_id))
    return out


def _unit_desc_index(layout: Layout) -> list[list[int]]:
    idx, i = [], 0
    for unit in layout.units:
        idx.append(list(range(i, i + len(unit))))
        i += len(unit)
    return idx


# --------------------------------------------------------------------------- reader side


class Source:
    """A remote region seen from this process: peer added, remote descriptors prepared, and a
    local registered scratch block to READ the remote control block into. Build with
    :func:`open_source`; release with :meth:`close` (idempotent)."""

    def __init__(self, agent: Agent, endpoint: Endpoint):
        self.agent = agent
        self.endpoint = endpoint
        agent.ensure_remote(endpoint.agent_name, endpoint.agent_metadata)
        self._scratch = torch.zeros(endpoint.control.nbytes // 8, dtype=torch.int64)
        self._scratch_reg = agent.nixl.register_memory(self._scratch)
        try:
            local = agent.nixl.get_xfer_descs(self._scratch)
            remote = agent.nixl.get_xfer_descs(
                [(endpoint.control.addr, endpoint.control.nbytes, 0)], "DRAM")
            self._ctl_handle = agent.nixl.initialize_xfer("READ", local, remote, endpoint.agent_name)
        except Exception as e:
            agent.nixl.deregister_memory(self._scratch_reg)
            raise TransferError(f"cannot prepare reads from {endpoint.agent_name}: {e}") from e
        self._remote_dlist: Any = None
        self._closed = False
        self._in_flight = [False]  # shared with the finalizer below
        self._ctl_in_flight = False
        """A control read timed out: it may still land in the scratch block, so the handle is
        neither posted again nor released until NIXL reports it terminal."""
        self.reached = False
        """A control read from this source succeeded once (the peer was reachable)."""
        self.control_reads = 0
        """Control-block reads posted so far (observability, tests)."""
        self._finalizer = weakref.finalize(self, _release_dropped_source, agent, self._scratch, self._scratch_reg,
                                           self._ctl_handle, self._in_flight, endpoint.agent_name)
        self._finalizer.atexit = False

    @property
    def _ctl_in_flight(self) -> bool:
        return self._in_flight[0]

    @_ctl_in_flight.setter
    def _ctl_in_flight(self, value: bool) -> None:
        self._in_flight[0] = value

    @property
    def name(self) -> str:
        return self.endpoint.agent_name

    def read_control(self, timeout_s: float = 10.0) -> tuple[int, int, list[int]]:
        """One-sided READ of the remote control block: ``(version, progress, checksums)``
        (checksums unsigned). Blocks at most ``timeout_s``; raises :class:`SourceStalled` past
        it and :class:`TransferError` if the read fails (remote gone, deregistered)."""
        with self.agent.xfer_lock:
            raw = self._read_control_raw(timeout_s)
        return int(raw[0]), int(raw[1]), [_to_u64(int(x)) for x in raw[_HEADER:].tolist()]

    def _read_control_raw(self, timeout_s: float) -> torch.Tensor:
        if self._closed:
            raise TransferError("source is closed")
        nx = self.agent.nixl
        if self._ctl_in_flight and not self._ctl_settled():
            raise SourceStalled(f"an earlier control read from {self.name} is still in flight")
        self.control_reads += 1
        try:
            state = nx.transfer(self._ctl_handle)
            t0 = time.monotonic()
            deadline = t0 + timeout_s
            while state == XferState.PROC:
                now = time.monotonic()
                if now > deadline:
                    self._ctl_in_flight = True
                    raise SourceStalled(f"control read from {self.name} took over {timeout_s}s")
                # A round trip is 0.1-1 ms over a link: poll finely for the first few ms (an
                # exponential backoff noticed a 1.3 ms answer at 2.5 ms, on every starved poll
                # of a pipeline), then back off.
                sleep_unlocked(self.agent.xfer_lock, POLL_FIRST_S if now - t0 < _CONTROL_FINE_S else POLL_MAX_S)
                state = nx.check_xfer_state(self._ctl_handle)
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"control read from {self.name} failed: {e}") from e
        if state != XferState.DONE:
            raise TransferError(f"control read from {self.name} failed ({state})")
        self.reached = True
        return self._scratch

    def _ctl_settled(self) -> bool:
        """Whether the control read that timed out is terminal now (then it may be posted again)."""
        with self.agent.xfer_lock:
            if is_terminal(self.agent.nixl, self._ctl_handle):
                self._ctl_in_flight = False
        return not self._ctl_in_flight

    def _remote_descs(self, layout: Layout) -> Any:
        if self._remote_dlist is None:
            ep = self.endpoint
            mem_types = {m.mem_type for m in ep.tensors if m.nbytes}
            if len(mem_types) > 1:
                raise LayoutMismatch(f"source {self.name} spans memory types {sorted(mem_types)}")
            self._remote_dlist = self.agent.nixl.prep_xfer_dlist(
                ep.agent_name, _piece_descs(ep.tensors, layout), mem_types.pop() if mem_types else "DRAM")
        return self._remote_dlist

    def close(self) -> None:
        """Release handles and the scratch registration. Idempotent; the peer stays added. A
        control read still in flight keeps its handle and the scratch block alive (logged)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        if self._ctl_in_flight and not self._ctl_settled():
            logger.error("source %s closed with a control read in flight: scratch kept registered", self.name)
            _kept_alive.append(self)
            return
        for h in (self._ctl_handle, self._remote_dlist):
            if h is not None:
                try:
                    h.release()
                except Exception:  # noqa: BLE001
                    logger.debug("release failed", exc_info=True)
        self._remote_dlist = None
        try:
            self.agent.nixl.deregister_memory(self._scratch_reg)
        except Exception:  # noqa: BLE001
            logger.debug("deregister scratch failed", exc_info=True)


def _release_dropped_source(agent: Agent, scratch: torch.Tensor, scratch_reg: Any, ctl_handle: Any,
                            in_flight: list, name: str) -> None:
    """A :class:`Source` garbage-collected without :meth:`~Source.close`: release its control
    handle and deregister its scratch block while the block is still alive (this function holds
    it). A registration left behind outlives its memory, which later tensors reuse; NIXL keeps
    every local range sorted by address and finds a transfer's range by looking one entry back,
    so a stale range inside a newer registered tensor makes reads into that tensor past it fail
    with NIXL_ERR_NOT_FOUND. A control read that may still land keeps everything (as close does)."""
    if in_flight[0]:
        # Not asked whether it settled: that takes the agent's transfer lock, which the thread
        # this finalizer runs on (a garbage collection anywhere) may hold already.
        logger.error("source %s dropped with a control read in flight: scratch kept registered", name)
        _kept_alive.append((scratch, scratch_reg, ctl_handle))
        return
    logger.warning("source %s dropped without close(): releasing its scratch block", name)
    try:
        ctl_handle.release()
    except Exception:  # noqa: BLE001 - a finalizer must not raise
        logger.debug("release failed", exc_info=True)
    try:
        agent.nixl.deregister_memory(scratch_reg)
    except Exception:  # noqa: BLE001
        logger.debug("deregister scratch failed", exc_info=True)


def _release_dropped_region(agent: Agent, regs: list, control: torch.Tensor, tensors: list,
                            unsettled: dict, unsettled_ranges: dict) -> None:
    """A :class:`Region` garbage-collected without :meth:`~Region.close`: deregister its tensors
    and control block while they are still alive (this function holds them). Reads into it that
    may still land keep everything (as close does); its local descriptor list is NIXL's to free."""
    if unsettled or unsettled_ranges:
        logger.error("region on %s dropped with reads still in flight: kept registered", agent.name)
        _kept_alive.append((regs, control, tensors))
        return
    logger.warning("region on %s dropped without close(): deregistering it", agent.name)
    for r in regs:
        try:
            agent.nixl.deregister_memory(r)
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            logger.debug("deregister failed", exc_info=True)


def complete_control(layout: Layout, version: int, checksums: Sequence[int]) -> torch.Tensor:
    """A control block (the layout :class:`Region` keeps) of a complete ``version`` with
    ``checksums``: for tensors of this process read as a source without a region of their own
    (a version rebuilt from a delta, :mod:`tensorhub.handle.deltas`)."""
    if len(checksums) != layout.unit_count:
        raise ValueError(f"{len(checksums)} checksums for {layout.unit_count} units")
    control = torch.zeros(_HEADER + layout.unit_count, dtype=torch.int64)
    control[_HEADER:] = torch.tensor([_to_i64(int(c)) for c in checksums], dtype=torch.int64)
    control[0] = int(version)
    control[1] = layout.unit_count
    return control


def open_source(endpoint: Endpoint | bytes, *, config: Optional[Config] = None,
                agent: Optional[Agent] = None) -> Source:
    """A :class:`Source` for a remote region. ``endpoint`` may be encoded bytes. Adds the peer
    to the agent once per name (cached). Pass ``agent`` or ``config`` (for :func:`get_agent`)."""
    if isinstance(endpoint, (bytes, bytearray, memoryview)):
        endpoint = decode_endpoint(bytes(endpoint))
    if agent is None:
        agent = get_agent(config or Config())
    return Source(agent, endpoint)
