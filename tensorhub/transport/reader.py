"""The reader loop: one-sided reads of a (possibly partial) holder into a registered region.

A pull reads the units its source has made final (the source's control block says how many)
straight into the reader's registered tensors, in unit order, with as few reads in flight as fill
the link (:mod:`tensorhub.transport.pacing`), and advances the reader's own progress counter unit
by unit, so that a third process can follow it (``holder -> r1 -> r2``) one unit behind.

Per completed read, in this order: without checksums, READ the source's control block (seqlock:
a unit counts only if the source still holds our version after its bytes arrived); post the next
read (the link never waits for our bookkeeping); verify the unit's checksum (bytes of another
version fail it, which is why checksums replace the seqlock read); copy the checksum into our
control block; then advance our progress counter. The source's control block is otherwise read
only when the reader runs out of units it knows to be final.

Every wait of the loop (a read in flight, a checksum being computed, a source with nothing new)
ends in :class:`~tensorhub.errors.SourceStalled` once nothing has moved for ``source_stall_timeout_s``. A read is
released only once NIXL reports it terminal; one that is not, when the pull ends, stays with the
region (see :func:`pull` and :mod:`tensorhub.transport.nixl`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from tensorhub.config import Config
from tensorhub.errors import (
    ChecksumMismatch,
    InvalidState,
    LayoutMismatch,
    ReadsNotTerminal,
    TransferError,
)
from tensorhub.layout import Layout, checksum_unit
from tensorhub.transport.follow import Advanced, Follow
from tensorhub.transport.agent import XferState, await_terminal, sleep_unlocked, unlocked
from tensorhub.transport.nixl import (
    _HEADER,
    Region,
    Source,
    _to_i64,
    _to_u64,
    _unit_desc_index,
)
from tensorhub.transport.pacing import POLL_MAX_S, POLL_MIN_S, Pacer
from tensorhub.transport.readstate import ReadState

logger = logging.getLogger(__name__)

__all__ = ["KnownProgress", "pull"]

_FOLLOW_SILENCE_S = 0.02
"""A following reader still polls the source's counter after this long without a push."""

_verifier_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_verifier_lock = threading.Lock()


def _verifier() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide checksum thread (one: units are verified in order anyway)."""
    global _verifier_pool
    with _verifier_lock:
        if _verifier_pool is None:
            _verifier_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensorhub-verify")
        return _verifier_pool


class KnownProgress:
    """A source's progress learnt by other means than its control block (a compiled graph's edge
    signals): checksums of its final units, in order, appended by one thread while a
    :func:`pull` in another reads them. Thread-safe; append-only."""

    def __init__(self, sums: Sequence[int] = ()) -> None:
        self._lock = threading.Lock()
        self._sums: list[int] = [int(c) for c in sums]

    def __len__(self) -> int:
        return len(self._sums)

    def extend(self, start: int, sums: Sequence[int]) -> None:
        """Units ``[start, start + len(sums))`` are final with these (unsigned) checksums.
        Raises :class:`InvalidState` unless ``start`` is where the known units end."""
        with self._lock:
            if start != len(self._sums):
                raise InvalidState(f"known progress ends at unit {len(self._sums)}, told about {start}+")
            self._sums.extend(int(c) for c in sums)

    def since(self, n: int) -> list[int]:
        """Checksums of the known units from unit ``n`` on."""
        with self._lock:
            return self._sums[n:]


def pull(region: Region, source: Source, layout: Layout, *, expect_version: int,
         config: Config, start_unit: int = 0, end_unit: Optional[int] = None,
         on_unit: Optional[Callable[[int], None]] = None,
         should_stop: Optional[Callable[[], bool]] = None,
         source_sums: Optional[Union[Sequence[int], KnownProgress]] = None) -> int:
    """Read units ``[start_unit, end_unit)`` (``end_unit`` defaults to all) of version
    ``expect_version`` from ``source`` straight into ``region``'s registered tensors. Blocks until
    done, stopped or failed.

    - Keeps a small, link-sized window of unit reads posted (at most ``config.reads_in_flight``);
      only reads units below the source's published progress and polls the source's control
      block for more, so the source may itself still be receiving.
    - ``source_sums``: the source is already known to hold units ``[0, len(source_sums))`` final,
      with these (unsigned) checksums; then the source's control block is not read at all. A
      sequence is all there will be (``end_unit`` must not exceed its length); a
      :class:`KnownProgress` may grow while the pull runs (a compiled graph's edge signals),
      and the pull waits for it as for a partial source.
    - After each unit completes, in unit order, verifies its checksum (``config.checksums``),
      copies the checksum into the region's control block and advances ``region.progress`` to the
      completed prefix, so another reader can follow this one. ``on_unit(u)`` is called then.
    - ``start_unit == 0`` resets the region to (``expect_version``, progress 0). ``start_unit > 0``
      resumes: the region must already hold ``expect_version`` with ``progress >= start_unit``
      (else :class:`InvalidState`); progress is set to ``start_unit``.
    - ``should_stop()`` (polled between completions) makes pull wait for posted reads (as below)
      and return early; the region's progress is the completed prefix.

    Raises :class:`TransferError` (NIXL error, remote gone, or the source's version is not
    ``expect_version``: the source moved on), :class:`~tensorhub.errors.SourceStalled` (nothing moved for
    ``config.source_stall_timeout_s`` while units were still needed: no read completed, no
    checksum finished, the source's progress did not grow), :class:`ChecksumMismatch` naming the
    unit (only when ``config.checksums``), or :class:`LayoutMismatch`. On every error
    ``region.progress`` is the completed prefix, so ``pull(..., start_unit=region.progress)`` from
    another source resumes without refetching.

    When pull returns or raises any of those, every read it posted is terminal (done or failed)
    and released: no byte of this pull lands afterwards. Reads still in flight when it ends are
    waited for, at most ``config.source_stall_timeout_s``; they are never released (NIXL's only
    abort, releasing the handle, does not stop a posted UCX READ). If some are still in flight
    then, pull raises :class:`ReadsNotTerminal` instead (the original error, if any, is its
    ``__cause__``) and the region keeps those reads. After it, the caller:

    - must not report the source failed or drained, nor let it be reused for another version:
      its holder could rewrite bytes a late READ still copies;
    - must not write, read as final, or re-read units at or past ``region.progress`` (units below
      it are complete and verified); another ``pull`` into the region raises
      :class:`ReadsNotTerminal` at once;
    - waits for ``region.settle(timeout_s)`` to return True (every such read terminal and
      released; each later ``pull`` also looks once), and only then reports the source failed
      and resumes from ``region.progress`` as after any other error.

    Returns the number of bytes read.
    """
    ep = source.endpoint
    if region.layout.unit_signature != layout.unit_signature:
        region.layout.check_same(layout)
    if ep.unit_signature != layout.unit_signature:
        raise LayoutMismatch(
            f"source {source.name} has a different layout (fingerprint {ep.fingerprint[:12]} vs "
            f"{layout.fingerprint[:12]}, or different unit settings)")
    if region.agent is not source.agent:
        raise TransferError("region and source must use the same agent")
    if not region.settle(0.0):
        raise ReadsNotTerminal(
            f"reads of an earlier pull into units {region.unsettled_units} are still in flight "
            "(Region.settle)")
    n_units = layout.unit_count if end_unit is None else max(0, min(end_unit, layout.unit_count))
    if source_sums is not None and not isinstance(source_sums, KnownProgress) and n_units > len(source_sums):
        raise InvalidState(f"end unit {n_units} is past the {len(source_sums)} units the source is known to hold")
    if start_unit == 0:
        region.set_progress(0)
        region.set_version(expect_version)
    else:
        if region.version != expect_version or not 0 < start_unit <= region.progress:
            raise InvalidState(
                f"cannot resume at unit {start_unit}: region holds version {region.version} "
                f"with progress {region.progress}, want version {expect_version}")
        region.set_progress(start_unit)
    if start_unit >= n_units:
        return 0
    with region.agent.xfer_lock:
        puller = _Puller(region, source, layout, expect_version, config, start_unit, n_units,
                         on_unit, should_stop)
        if source_sums is not None:
            puller.know(source_sums if isinstance(source_sums, KnownProgress) else KnownProgress(source_sums))
        return puller.run()


class _Puller:
    """State of one pull; exists so the loop fits on a screen."""

    def __init__(self, region: Region, source: Source, layout: Layout, version: int, config: Config,
                 start: int, end_unit: int, on_unit: Optional[Callable[[int], None]],
                 should_stop: Optional[Callable[[], bool]]):
        self.region, self.source, self.layout = region, source, layout
        self.version, self.config, self.on_unit, self.should_stop = version, config, on_unit, should_stop
        self.nx = region.agent.nixl
        self.n_units = end_unit
        self.st = ReadState(version, start, end_unit, window_max=config.reads_in_flight,
                            stall_timeout_s=config.source_stall_timeout_s, now=time.monotonic(),
                            source=source.name)
        """The read loop's rules (what may be posted, the verified prefix, stalls)."""
        self.inflight: dict[int, Any] = {}
        self.bytes_read = 0
        self.known: Optional[KnownProgress] = None
        self.control_reads = 0
        self.control_read_at = time.monotonic()
        self.inbox = region.agent.inbox
        self.following = False
        """We asked the source to push its progress (it is partial)."""
        self.followers: dict[str, int] = {}
        """Readers following *this* region: agent name -> units already told."""
        self.verifying: dict[int, concurrent.futures.Future] = {}
        """Landed units whose checksum the verifier thread is computing."""
        self.pacer = self.st.pacer
        self.unit_descs = _unit_desc_index(layout)
        self.local = region._local_descs()
        self.remote = source._remote_descs(layout)

    def know(self, known: KnownProgress) -> None:
        """The source's progress and checksums are given (signal-driven pull): never poll."""
        self.known = known
        self.st.seen_version = True
        self._take_known()

    def _take_known(self) -> None:
        st = self.st
        new = self.known.since(st.remote_progress)
        if new:
            st.source_extended(st.remote_progress, [_to_i64(c) for c in new], time.monotonic())

    def run(self) -> int:
        """The pull (see :func:`pull`); every posted read is terminal when it returns or raises,
        else it raises :class:`ReadsNotTerminal`."""
        t0 = time.monotonic()
        try:
            n = self._loop()
        except BaseException as e:
            self._drain(e)
            raise
        self._drain(None)
        if logger.isEnabledFor(logging.DEBUG) and isinstance(self.pacer, Pacer):
            p, dt = self.pacer, time.monotonic() - t0
            logger.debug("pull of version %d from %s: %d bytes in %.3fs (%.1f MB/s), window %d, rate %.1f MB/s, "
                         "link rate %.1f MB/s, round trip %.1f ms", self.version, self.source.name, n, dt,
                         n / dt / 1e6 if dt > 0 else 0.0, p.window(), (p.rate_Bps or 0) / 1e6,
                         (p.serve_Bps or 0) / 1e6, (p.rtt_s or 0) * 1e3)
        return n

    def _loop(self) -> int:
        self._refresh_control()
        self._refresh_control()  # the first read paid for connecting: this one times the link
        self._follow_if_partial()
        starved_delay = POLL_MIN_S
        st = self.st
        while not st.finished:
            if self.should_stop is not None and self.should_stop():
                logger.info("pull from %s stopped at unit %d", self.source.name, st.prefix)
                break
            self._serve_followers()
            self._post_more()
            if self.verifying:
                self._advance_prefix()
                if not self.inflight and self.verifying and st.next_post >= min(st.end, st.remote_progress):
                    # Nothing to read until the next checksum is done: wait for it (bounded too).
                    self._raise_if_stalled()
                    with unlocked(self.region.agent.xfer_lock):
                        concurrent.futures.wait([self.verifying[min(self.verifying)]], timeout=POLL_MAX_S)
                    continue
            if self._reap():
                if not self.config.checksums:
                    # Seqlock: a unit counts only if the source still holds our version
                    # after its bytes arrived. Checksums make this round trip unnecessary
                    # (bytes of another version fail them), and skipping it matters: on a
                    # link it queues behind the next read's bytes, a whole unit late.
                    self._refresh_control()
                self._post_more()  # refill before the checksums
                self._advance_prefix()
                starved_delay = POLL_MIN_S
                continue
            if not self.inflight and st.starved:
                # Starved for units: take the source's pushes, or look at its counter again.
                before = st.remote_progress
                self._take_pushes()
                if st.remote_progress == before and self._control_due():
                    self._refresh_control()
                if st.remote_progress > before:
                    starved_delay = POLL_MIN_S
                    continue
            self._raise_if_stalled()  # every path that waits passes here or above
            now = time.monotonic()
            lock = self.region.agent.xfer_lock
            if self.inflight:
                sleep_unlocked(lock, self.pacer.sleep_s(now, starved_delay))
            else:
                slept = time.monotonic()
                sleep_unlocked(lock, self.pacer.starved_s(now, st.source_advanced_at, starved_delay))
                self.region.starved_s += time.monotonic() - slept
            if not self.inflight:
                starved_delay = min(starved_delay * 2, POLL_MAX_S)
        return self.bytes_read

    def _raise_if_stalled(self) -> None:
        """Raise :class:`~tensorhub.errors.SourceStalled` if nothing moved for ``source_stall_timeout_s``."""
        self.st.check_stalled(time.monotonic(), inflight=list(self.inflight), verifying=list(self.verifying))

    def _refresh_control(self) -> None:
        if self.known is not None:
            return
        clean = not self.inflight and self.control_reads > 0
        t = time.perf_counter()
        raw = self.source._read_control_raw(self.config.source_stall_timeout_s)
        self.control_reads += 1
        self.control_read_at = time.monotonic()
        if clean:
            self.pacer.on_rtt(time.perf_counter() - t)
        v, p = int(raw[0]), int(raw[1])
        # An older version has nothing for us yet (the stall timeout bounds the wait); a newer
        # one means the source moved on for good (ReadState, rule 1).
        st = self.st
        if v == self.version and p > st.remote_progress:
            st.source_state(v, p, raw[_HEADER:_HEADER + p].tolist(), time.monotonic())
        else:
            st.source_state(v, p, None, time.monotonic())

    # ---- progress pushes (tensorhub.transport.follow) ----------------------------------
    def _follow_if_partial(self) -> None:
        """Ask a partial source to push its progress to us (a hint: polling still works)."""
        if self.known is not None or self.st.remote_progress >= self.n_units or self.source.name == self.region.agent.name:
            return
        agent = self.region.agent
        self.following = self.inbox.send(
            self.source.name, Follow(agent.name, agent.metadata(), self.version, self.st.remote_progress))

    def _take_pushes(self) -> None:
        if self.known is not None:
            self._take_known()
            return
        if not self.following:
            return
        self.inbox.poll()
        for a in self.inbox.take_advanced(self.source.name):
            if a.version == self.version:  # else another version; a gap or nothing new: ignored
                self.st.source_extended(a.start, a.sums, time.monotonic())

    def _control_due(self) -> bool:
        """Poll the source's counter: always when not followed by pushes, else only when no push
        came for a while (the source may have finished before it saw our Follow)."""
        if self.known is not None:
            return False
        if not self.following:
            return True
        unit = self.pacer.unit_s() or 0.0
        return time.monotonic() - max(self.control_read_at, self.st.source_advanced_at) > max(_FOLLOW_SILENCE_S, 4 * unit)

    def _serve_followers(self) -> None:
        """Readers that follow this region: add them (they asked for this version), tell them."""
        self.inbox.poll()
        for f in self.inbox.take_follows(self.version):
            try:
                self.region.agent.ensure_remote(f.reader, f.metadata)
            except TransferError:
                logger.info("cannot push progress to follower %s", f.reader, exc_info=True)
                continue
            self.followers[f.reader] = max(0, min(f.from_unit, self.st.prefix))
        if self.followers:
            self._tell_followers()

    def _tell_followers(self) -> None:
        ctl = self.region.control
        prefix = self.st.prefix
        for name, told in list(self.followers.items()):
            if told >= prefix:
                continue
            msg = Advanced(self.version, told, ctl[_HEADER + told:_HEADER + prefix].tolist())
            if self.inbox.send(name, msg):
                self.followers[name] = prefix
            else:
                del self.followers[name]

    def _post_more(self) -> None:
        st = self.st
        while (u := st.next_to_post()) is not None:
            idx = self.unit_descs[u]
            try:
                h = self.nx.make_prepped_xfer("READ", self.local, idx, self.remote, idx)
                state = self.nx.transfer(h)
            except Exception as e:
                raise TransferError(f"posting unit {u} from {self.source.name} failed: {e}") from e
            self.inflight[u] = h
            st.posted(u, self.layout.unit_nbytes(u), time.monotonic())
            if state == XferState.ERR:
                raise TransferError(f"read of unit {u} from {self.source.name} failed")

    def _reap(self) -> bool:
        landed = []
        for u in list(self.inflight):
            h = self.inflight[u]
            try:
                state = self.nx.check_xfer_state(h)
            except Exception as e:
                raise TransferError(f"read of unit {u} from {self.source.name} failed: {e}") from e
            if state == XferState.PROC:
                continue
            if state != XferState.DONE:
                raise TransferError(f"read of unit {u} from {self.source.name} failed ({state})")
            del self.inflight[u]
            h.release()
            landed.append(u)
            if self.config.checksums:
                # Hash in the verifier thread (xxhash drops the GIL) while this one keeps the
                # reads going: inline, hashing a 1 GiB shard cost a sixth of its transfer.
                self.verifying[u] = _verifier().submit(checksum_unit, self.region.tensors, self.layout.units[u])
        self.st.completed(landed, time.monotonic())
        return bool(landed)

    def _advance_prefix(self) -> None:
        region, st = self.region, self.st
        while (u := st.next_to_verify()) is not None:
            expected = st.expected_sum(u)
            if self.config.checksums:
                fut = self.verifying[u]
                if not fut.done():
                    break  # in order: later units wait for this one
                del self.verifying[u]
                got = fut.result()
                if _to_i64(got) != expected:
                    raise ChecksumMismatch(
                        f"unit {u} from {self.source.name}: checksum {got:#018x}, "
                        f"source published {_to_u64(expected):#018x}")
            region.control[_HEADER + u] = expected
            self.bytes_read += self.layout.unit_nbytes(u)
            st.verified(u, time.monotonic())
            region.set_progress(st.prefix)  # after the checksum: followers rely on the order
            if self.on_unit is not None:
                self.on_unit(u)
        if self.followers:
            self._tell_followers()

    def _drain(self, failure: Optional[BaseException]) -> None:
        """Wait for every posted read to be terminal, releasing each then. Free when none is
        posted (a pull that read everything). A read still in flight after
        ``source_stall_timeout_s`` is not released (that would not stop it: see
        :mod:`tensorhub.transport.nixl`): the region keeps it, and :class:`ReadsNotTerminal`
        is raised from ``failure``."""
        self.st.forget_posted()
        if not self.inflight:
            return
        timeout = self.config.source_stall_timeout_s
        lock = self.region.agent.xfer_lock
        # Let go of the agent between looks, as the loop's sleeps do: another pull of this
        # process (or a registration) must not wait out this pull's stall timeout.
        with unlocked(lock):
            await_terminal(self.nx, self.inflight, timeout, lock)
        if not self.inflight:
            return
        units = sorted(self.inflight)
        self.region._keep_unsettled(self.inflight)
        self.inflight = {}
        why = f"failed ({type(failure).__name__}: {failure})" if failure is not None else "stopped"
        msg = (f"reads of units {units} from {self.source.name} still in flight {timeout}s after the "
               f"pull {why}: they may still write those units (Region.settle)")
        logger.error(msg)
        raise ReadsNotTerminal(msg) from failure
