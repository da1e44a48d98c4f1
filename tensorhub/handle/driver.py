"""The driver of a handle's pure :class:`~tensorhub.core.handle.HandleMachine` (``hub._driver``).

The machine decides (rounds, retries, failover, re-announce, aborts); :class:`Driver` feeds it
events and carries out its commands: server requests through the port, pulls through the read
path (:class:`~tensorhub.handle.reads.ReadSession`), host-copy offloads and drops, the region's
advertised version and progress, sleeps and reconnects. It owns the machine, the machine's lock
and what one read measures on the way (when its first source came, its offload time, the units
it did not fetch, when its last byte landed). It reaches its handle only through
:class:`Handle`, which :class:`~tensorhub.handle.hub.Hub` implements.

Rules:

- Every event reaches the machine under :attr:`Driver.lock` (user thread and pulse thread);
  nothing else is taken while it is held (the order: ``tensorhub/handle/__init__.py``).
- One operation at a time, driven in the caller's thread (the handle's call lock held).
- Any exception of the driver itself (KeyboardInterrupt, a bug) is fed to the machine, which
  ends the operation (aborting a read on the server), and re-raised.
- Verify mode: the version an update leaves is checked once drained, before its first pull.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Protocol

import msgspec

from tensorhub import errors
from tensorhub.config import Config
from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.handle.background import Background
from tensorhub.handle.host_copies import HostCopies
from tensorhub.handle.memory import Memory
from tensorhub.handle.reads import ReadSession
from tensorhub.layout import checksum_unit
from tensorhub.ports import ServerPort

log = logging.getLogger("tensorhub.client")
"""The handle's log (one name for all its parts, kept for users' log filters)."""


class Handle(Protocol):
    """The handle as :class:`Driver` sees it: a :class:`~tensorhub.handle.hub.Hub`.

    Public: ``client_id``, ``model``, ``shard``, ``host_copies``, ``reads``. Its registered
    memory ``_memory`` (:class:`~tensorhub.handle.memory.Memory`: region, layout and tensors,
    read live: a swap exchanges them, ``close`` drops the region). And ``_background`` (it sends
    the machine's announcements) and :meth:`_verify_unchanged`."""

    client_id: str
    model: str
    shard: int
    host_copies: HostCopies
    reads: ReadSession
    _memory: Memory
    _background: Background

    def _verify_unchanged(self, version: Optional[int]) -> None:
        """Verify mode: raise ``MutabilityViolation`` if its bytes are not what was published."""


class Driver:
    """Feeds one handle's machine and carries out its commands.

    ``handle``: the handle (:class:`Handle`); ``port``: its server port; ``config``: its
    config. Owns :attr:`machine`, :attr:`lock` and the current read's measurements; makes no
    thread. Not thread-safe beyond :meth:`feed`: one operation at a time."""

    def __init__(self, handle: Handle, *, port: ServerPort, config: Config) -> None:
        self._handle = handle
        self._port = port
        self._config = config
        self.machine = hm.HandleMachine(handle.client_id, request_timeout_s=config.request_timeout_s,
                                        reconnects_max=config.reconnects_max, failovers_max=config.failovers_max,
                                        noop_staleness_s=config.noop_staleness_s)
        self.lock = threading.Lock()
        """The machine: user thread and pulse thread."""
        self.t_assigned = 0.0
        """When the current read got its first source (``perf_counter``; 0: not yet)."""
        self.offload_s = 0.0
        """Time the current call spent copying its old version to host memory."""
        self.pull_from = 0
        """Units of the last read already in place at its first pull (not fetched by it)."""
        self.plain_from: Optional[int] = None
        """Units of the current read in place at its first pull from a holder of its own layout
        (None: none yet; a resharded pull counts the bytes it moves itself)."""
        self.finished_at = 0.0
        """Wall-clock time (``time.time()``) the last pull's last byte landed."""
        self.progress: Optional[Callable[[int, int], None]] = None
        """The current read's ``progress(units_done, units_total)`` callback, or None."""
        self.verify_left: Optional[int] = None
        """Verify mode, during an update: the version it leaves, checked before its first pull."""
        self.reading = False
        """A read call is under way (between :meth:`begin_read` and :meth:`end_read`): background
        work of the handle that competes with it for the CPU waits (the retention pool's touches)."""

    def begin_read(self, verify_left: Optional[int], progress: Optional[Callable[[int, int], None]] = None) -> None:
        """A read starts: nothing measured yet; ``verify_left`` and ``progress`` as the attributes."""
        self.t_assigned = self.offload_s = 0.0
        self.plain_from = None
        self.progress = progress
        self.verify_left = verify_left
        self.reading = True

    def end_read(self) -> None:
        """The read's call returns: no callback, nothing left to verify, not reading."""
        self.progress = None
        self.verify_left = None
        self.reading = False

    # ------------------------------------------------------------------ the machine's state

    def record_host_copy(self, version: int, endpoint: bytes) -> None:
        """A host copy of ``version`` at ``endpoint`` is this handle's now (re-announced after a
        server restart)."""
        with self.lock:
            self.machine.host_copies[version] = endpoint

    def host_copy_endpoint(self, version: int) -> Optional[bytes]:
        """The endpoint of this handle's host copy of ``version``, or None."""
        with self.lock:
            return self.machine.host_copies.get(version)

    def swapped(self, stage: "Driver", mine: Memory, theirs: Memory, version: int) -> None:
        """The server made a double buffer's swap with ``stage`` (the staging copy's driver):
        the two memories change hands, and the endpoints as the server exchanged them (the same
        bytes); this machine publishes ``version``, the staging copy's holds nothing. Takes both
        machine locks, this one first."""
        with self.lock, stage.lock:
            mine.exchange(theirs)
            reg, stage_reg = self.machine.register_msg, stage.machine.register_msg
            self.machine.swapped_in(version, msgspec.structs.replace(reg, endpoint=stage_reg.endpoint))
            stage.machine.swapped_out(msgspec.structs.replace(stage_reg, endpoint=reg.endpoint))

    # ------------------------------------------------------------------ the machine

    def feed(self, event: hm.Event) -> list:
        """``event`` to the machine (under :attr:`lock`); returns its commands."""
        with self.lock:
            return self.machine.handle(event, time.monotonic())

    def drive(self, cmds: list, *, pause_at_pull: bool = False):
        """Carry out the machine's commands until the operation ends: returns its
        :class:`~tensorhub.core.handle.Outcome`, raises its typed error. ``pause_at_pull``:
        return the first :class:`~tensorhub.core.handle.Pull` instead of running it (resume
        with ``drive([pull])``). Any exception of the driver itself (KeyboardInterrupt, a
        bug) is fed to the machine, which ends the operation (aborting a read on the server),
        and re-raised."""
        while True:
            awaiting = None
            for cmd in cmds:
                match cmd:
                    case hm.Done(outcome):
                        return outcome
                    case hm.Fail(code, message):
                        raise errors.from_code(code, message)
                    case hm.SetRegion():
                        self.set_region(cmd)
                    case hm.DropHost(version):
                        self._handle.host_copies.drop(version)
                    case hm.Send(request, fire=True):
                        self._fire(request)
                    case _:
                        awaiting = cmd
            assert awaiting is not None, f"{self._handle.client_id}: the machine stopped without an outcome"
            if isinstance(awaiting, hm.Pull) and self.verify_left is not None:
                # Verify mode: the server drained the version this update leaves; its bytes must
                # still be what was published, checked before the first byte of the new one lands.
                left, self.verify_left = self.verify_left, None
                try:
                    self._handle._verify_unchanged(left)
                except BaseException as exc:
                    self.finish_interrupted(exc)
                    raise
            if pause_at_pull and isinstance(awaiting, hm.Pull):
                return awaiting
            try:
                event = self._execute(awaiting)
            except BaseException as exc:
                self.finish_interrupted(exc)
                raise
            cmds = self.feed(event)

    def finish_interrupted(self, exc: BaseException) -> None:
        """The machine's clean-up after the driver's own exception: aborts, region, and an
        update's old version published again (best effort: a failure here is logged, the
        original exception is what the caller sees)."""
        cmds = self.feed(hm.Interrupted(f"{type(exc).__name__}: {exc}"))
        while cmds:
            awaiting = None
            for cmd in cmds:
                match cmd:
                    case hm.Send(request, fire=True):
                        self._fire(request)
                    case hm.SetRegion():
                        self.set_region(cmd)
                    case hm.DropHost(version):
                        self._handle.host_copies.drop(version)
                    case hm.Send():
                        awaiting = cmd
            if awaiting is None:
                return
            try:
                reply = self._port.call(awaiting.request)
            except errors.TensorHubError as e:
                reply = m.ErrorReply(code=type(e).__name__, message=str(e))
            cmds = self.feed(hm.Replied(reply))

    def set_region(self, cmd: hm.SetRegion) -> None:
        """Carry out a ``SetRegion``: what the handle's region advertises (nothing before register)."""
        h = self._handle
        region = h._memory.region
        if region is None:
            return
        if cmd.version < 0:
            region.set_progress(0)
            region.set_version(-1)
        elif h._memory.layout is not None and cmd.progress >= h._memory.layout.unit_count:
            region.publish_complete(cmd.version, list(cmd.checksums) if cmd.checksums else None)
        else:
            region.set_version(cmd.version)
            region.set_progress(cmd.progress)

    # ------------------------------------------------------------------ the commands

    def _fire(self, request: m.Request) -> None:
        try:
            self._port.call(request)
        except errors.TensorHubError:
            log.info("model=%s shard=%d: %s not delivered", self._handle.model, self._handle.shard,
                     type(request).__name__)

    def _execute(self, cmd) -> hm.Event:
        match cmd:
            case hm.Send(request, wait):
                try:
                    if isinstance(request, m.Announce):
                        return hm.Replied(self._handle._background.send_announce(request))
                    return hm.Replied(self._port.call(request, self._config.request_timeout_s if wait else 0.0))
                except errors.ServerUnavailable as e:
                    log.warning("model=%s shard=%d: reference server unavailable", self._handle.model,
                                self._handle.shard)
                    return hm.Unavailable(str(e))
            case hm.Reconnect(delay_s):
                time.sleep(delay_s)
                self._port.reconnect()
                return hm.TimerFired()
            case hm.Sleep(delay_s):
                time.sleep(delay_s)
                return hm.TimerFired()
            case hm.Recheck(version, units):
                return hm.Rechecked(self._recheck(version, units))
            case hm.Pull(assignment, _):
                return self._pull(assignment)
            case hm.Offload(version):
                t0 = time.perf_counter()
                endpoint = self._handle.host_copies.offload(version)
                self.offload_s += time.perf_counter() - t0
                return hm.Offloaded(version, endpoint)
        raise AssertionError(f"unknown command {cmd!r}")

    def _pull(self, a: m.Assignment) -> hm.Pulled:
        """One source, no failover (the machine decides that): every posted read is terminal
        when this returns, unless ``not_terminal`` says otherwise."""
        h = self._handle
        if not self.t_assigned:
            self.t_assigned = time.perf_counter()
            self.pull_from = h.reads.resume_point(a.version)  # units this call did not fetch
        if not a.reshard and self.plain_from is None:
            self.plain_from = h.reads.resume_point(a.version)
        if not h._memory.region.settle(self._config.source_stall_timeout_s):
            # An earlier pull left reads that NIXL never reported ended: none of this region's
            # units past its progress can be trusted yet.
            return hm.Pulled(h._memory.region.progress, "reads of an earlier pull are still in flight", not_terminal=True)
        try:
            h.reads.pull_range(a, h._memory.layout.unit_count, on_unit=self._unit_landed if self.progress else None)
        except errors.ReadsNotTerminal as err:
            log.error("model=%s version=%d shard=%d: %s", h.model, a.version, h.shard, err)
            return hm.Pulled(h._memory.region.progress, str(err), not_terminal=True)
        except (errors.TransferError, errors.ChecksumMismatch) as err:
            failed = h.reads.failed_source(a)
            log.warning("model=%s version=%d shard=%d source %s failed at unit %d: %s",
                        h.model, a.version, h.shard, failed, h._memory.region.progress, err)
            return hm.Pulled(h._memory.region.progress, str(err) or type(err).__name__,
                             unreachable=isinstance(err, errors.SourceUnreachable), failed_source=failed)
        self.finished_at = time.time()
        return hm.Pulled(h._memory.region.progress)

    def _unit_landed(self, _unit: int) -> None:
        cb = self.progress
        if cb is not None:
            cb(self._handle._memory.region.progress, self._handle._memory.layout.unit_count)

    def _recheck(self, version: int, units: int) -> int:
        """A partial read left by an earlier call is resumed only as far as it is still intact:
        between calls the handle is idle and the user may have written its tensors. Keeps the
        leading units whose bytes still match the checksums recorded when they landed (none
        without checksums)."""
        h = self._handle
        region = h._memory.region
        keep = 0
        if self._config.checksums:
            # The control block's header may say "nothing" (hidden after the failed call); its
            # checksum slots still hold what the units had when they landed.
            sums = region.checksums()
            layout_units = h._memory.layout.units
            while keep < units and checksum_unit(h._memory.tensors, layout_units[keep]) == sums[keep]:
                keep += 1
        if keep < units:
            log.info("model=%s shard=%d: %d of %d units kept from the earlier partial read of version %d "
                     "(the rest changed since)", h.model, h.shard, keep, units, version)
        return keep
