"""A handle's side of resharded reads (``hub._reshard``): reading from holders of another
layout, and hashing cells for readers of another layout (issue 24; docs/placements.md).

As a reader (:meth:`Resharding.pull`): an ``Assignment`` with ``reshard`` names every shard of a
holder replica of another layout class and their placements. The handle plans the byte ranges
from its own placement (:class:`~tensorhub.transport.reshard_read.ReshardRead`, ``spread`` = its
shard, as the server planned), reads each needed holder shard's runs straight into its
registered tensors (the same-host tier when the holder lives on this host, else NIXL), asks
the server for the holders' cell checksums (``FindCells``: the holders hash while the bytes
move), checks every cell, and advertises its own units as they are checked: readers of its own
layout pipeline from it as from any partial holder. Rules:

- A holder shard whose read fails, whose cells differ, or that no longer holds the version is
  *the* failed source (:meth:`Resharding.take_failed`, what the handle's ``SourceFailed``
  names): the server plans the read again without it.
- Only checked bytes are advertised: the region says the version with progress 0 when the read
  starts; the reader's tensors are read in batches, each batch's cells checked on a second
  thread while the next is read (:meth:`ReshardRead.run`), and each batch checked clean extends
  the prefix of units advertised with their checksums. A bad batch stops the prefix there.
- Waiting for checksums is bounded by ``source_stall_timeout_s`` (``SourceStalled`` naming the
  holder that did not answer).
- A failover keeps what is in place and checked: the units of the failed pull whose every byte
  came and was checked (:class:`~tensorhub.transport.reshard_read.Kept`) are not read again by
  the next resharded pull of the same read, whatever replica (of whatever layout) it names;
  holder shards that write none of the others are not contacted. A pull from a holder of the
  handle's own layout in between, or a new read, drops them (:meth:`drop_kept`,
  :meth:`begin_read`). :attr:`read_bytes` is what the read's resharded pulls moved, each byte
  counted once per time it crossed.

As a holder (:meth:`Resharding.hash_asked`, the server's ``HashCells``): the cells of the grid
of the placements named, for the tensors this handle publishes at that version, hashed in place
on this part's one worker thread (off the pulse and the user's calls) and sent with
``CellSums``, only if the handle still publishes that version once they are hashed (its
tensors could not change meanwhile: it cannot unpublish while a reader reads from it). Asked
while it publishes another version, or without a placement: ignored. Asked with ``host``: the
same over its host copy of that version, sent only if the copy is still kept once hashed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import msgspec

from tensorhub import errors, gridsums
from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.cells import grid_key
from tensorhub.core.grid import grid_of
from tensorhub.placement import Placement
from tensorhub.ports import ServerPort
from tensorhub.transport.reshard_read import Kept, ReshardRead

log = logging.getLogger("tensorhub.client")
"""The handle's log (one name for all its parts, kept for users' log filters)."""

_FIND_POLL_S = (0.002, 0.05)
_PUBLISH_WAIT_S = 2.0
"""How long a ``HashCells`` may wait for its handle to record the publish it was sent for: the
server asks at the publish, and the note can reach the handle (on its pulse) before the
publish's own reply does."""
"""First and longest pause between ``FindCells`` while holders are still hashing."""


class Resharding:
    """A handle's resharded reads and cell hashing (see the module docstring). What it needs of
    its handle is passed in: ``client_id``, ``shard``, ``config``, the server ``port``;
    ``placement()`` (the registered placement, None without one); ``published()`` (the version
    the handle publishes now, None if none); ``held()`` -> (its tensors in layout order, its
    region); ``sources``, the handle's open sources (:class:`~tensorhub.handle.sources.Sources`).
    Owns its worker thread (started at the first ``HashCells``, stopped by :meth:`stop`) and the
    failed source of the last pull."""

    def __init__(self, *, client_id: str, shard: int, config: Config, port: ServerPort,
                 placement: Callable[[], Optional[Placement]], published: Callable[[], Optional[int]],
                 held: Callable[[], tuple], sources,
                 host_copy: Callable[[int], Optional[list]] = lambda version: None) -> None:
        self.client_id, self.shard, self._config, self._port = client_id, shard, config, port
        self._placement, self._published, self._held, self._sources = placement, published, held, sources
        self._host_copy = host_copy
        """version -> the tensors of this handle's host copy of it (None: none kept)."""
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._stopped = False
        self._failed: str = ""
        self._kept: Optional[Kept] = None
        """The current read's units in place and checked by a failed resharded pull."""
        self.bytes_read = 0
        """Bytes the last resharded pull moved."""
        self.read_bytes = 0
        """Bytes the current read's resharded pulls moved, failed ones included (0: none)."""

    def begin_read(self) -> None:
        """A read starts (one user call, or a two-phase read): nothing kept, nothing moved."""
        self._kept, self.read_bytes = None, 0

    def drop_kept(self) -> None:
        """A pull of another kind may write the region: nothing kept any more."""
        self._kept = None

    # ------------------------------------------------------------------ reader

    def pull(self, a: m.Assignment, should_stop: Optional[Callable[[], bool]] = None,
             on_unit: Optional[Callable[[int], None]] = None) -> int:
        """Carry out the resharded read ``a`` into the registered region: read, check every
        cell, publish the unit checksums. Returns the bytes moved; raises ``TransferError`` or
        ``ChecksumMismatch`` with :meth:`take_failed` naming the holder at fault.
        ``should_stop`` is not polled: a resharded read runs to its end or its error."""
        self._failed = ""
        own = self._placement()
        _, region = self._held()
        if own is None:
            raise errors.TransferError("a resharded read needs this handle's placement (register(placement=))")
        by_digest = {p.digest(): p for p in a.placements}
        try:
            holders = [by_digest[s.placement] for s in a.reshard]
        except KeyError as e:
            raise errors.TransferError(f"the assignment lacks holder placement {e}") from None
        if [s.shard for s in a.reshard] != list(range(len(a.reshard))):
            raise errors.TransferError("the assignment does not name every holder shard in order")
        kept = self._kept if self._kept is not None and region.version == a.version else None
        rd = ReshardRead(region, own, holders, version=a.version, config=self._config, spread=self.shard, kept=kept)
        if kept:
            log.info("%s: version %d: %d of %d units kept from the failed pull; reading the rest from holder shards %s",
                     self.client_id, a.version, len(kept.units), region.layout.unit_count, list(rd.shards))
        placements = list(by_digest.values()) + [own]
        grid = grid_of(placements)
        key = grid_key(placements)
        ids = tuple(a.reshard[s].client_id for s in rd.shards)
        sources, subs = {}, {}
        for shard in rd.shards:
            holder = a.reshard[shard]
            subs[shard] = msgspec.structs.replace(a, source_id=holder.client_id, source_endpoint=holder.endpoint,
                                                  reshard=(), placements=())
            try:
                sources[shard] = self._sources.same_host(subs[shard]) or self._sources.nixl(subs[shard])
            except errors.TransferError:
                self._failed = holder.client_id
                raise
        # Reads start at once; the holders' checksums are fetched on the hashing thread before
        # the first batch is checked (the holders hash meanwhile); each batch checked clean
        # extends the prefix this region advertises, so readers of its layout follow it: batches
        # of about one unit (whole tensors), so they lag it by about one tensor.
        try:
            moved = rd.run(sources, grid, lambda: self._find_cells(a.version, key, ids), advertise=True,
                           batch_bytes=region.layout.unit_bytes)
        except errors.ChecksumMismatch:
            # Every read ended; the shards whose cells differ are the ones no longer done.
            self._failed_pull(rd)
            bad = [s for s in rd.shards if s not in rd.done]
            self._failed = a.reshard[(bad or rd.shards)[0]].client_id
            raise
        except (errors.TransferError, errors.ReadsNotTerminal):
            self._failed_pull(rd)
            if rd.failed_shard is not None:
                self._sources.drop(subs[rd.failed_shard])
                self._failed = a.reshard[rd.failed_shard].client_id
            raise
        self._kept = None
        self.read_bytes += moved
        rd.publish()
        self.bytes_read = moved
        if on_unit is not None:
            on_unit(region.progress - 1)
        return moved

    def _failed_pull(self, rd: ReshardRead) -> None:
        """A pull failed: keep its units in place and checked for the next, count what it moved."""
        self._kept = rd.kept()
        self.read_bytes += rd.bytes_read
        self.bytes_read = rd.bytes_read

    def take_failed(self) -> str:
        """The holder the last failed pull blames ("" if none), once."""
        failed, self._failed = self._failed, ""
        return failed

    def _find_cells(self, version: int, grid: str, holders: tuple[str, ...]) -> dict:
        """The holders' cell checksums, merged, once all have sent them."""
        deadline = time.monotonic() + self._config.source_stall_timeout_s
        pause = _FIND_POLL_S[0]
        while True:
            reply = self._port.call(m.FindCells(self.client_id, version, grid, holders))
            if isinstance(reply, m.ErrorReply):
                raise errors.TransferError(f"cell checksums of version {version}: {reply.code}: {reply.message}")
            if reply.gone:
                self._failed = reply.gone[0]
                raise errors.TransferError(f"holder {reply.gone[0]} no longer holds version {version}")
            if not reply.missing:
                return {(c.tensor, c.cell): c.checksum for c in reply.cells}
            if time.monotonic() > deadline:
                self._failed = reply.missing[0]
                raise errors.SourceStalled(f"holder {reply.missing[0]} sent no cell checksums of version {version} "
                                           f"in {self._config.source_stall_timeout_s}s")
            time.sleep(pause)
            pause = min(pause * 2, _FIND_POLL_S[1])

    # ------------------------------------------------------------------ holder

    def hash_asked(self, note: m.HashCells) -> None:
        """The server's ``HashCells``: hash on the worker thread and send (see the module docstring)."""
        with self._lock:
            if self._stopped:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tensorhub-cells")
            self._pool.submit(self._hash, note)

    def _publishes(self, version: int) -> bool:
        """Whether the handle publishes ``version``: at once, or within :data:`_PUBLISH_WAIT_S`
        while it has not recorded that publish yet (no version, or an older one, published)."""
        deadline = time.monotonic() + _PUBLISH_WAIT_S
        while True:
            now = self._published()
            if now == version:
                return True
            if (now is not None and now > version) or self._stopped or time.monotonic() > deadline:
                return False
            time.sleep(0.002)

    def _hash(self, note: m.HashCells) -> None:
        """Hash the cells ``note`` asks for and send them. Of the tensors the handle publishes at
        ``note.version``, or with ``host`` of its host copy of that version (laid out as its own
        tensors, the same placement); sent only if those bytes are still what it holds once
        hashed (the handle still publishes the version; the copy is still kept: a dropped one
        may have gone back to the pool and been written)."""
        own = self._placement()
        what = "its host copy of version" if note.host else "version"
        if note.host:
            tensors = self._host_copy(note.version)
            still = lambda: self._host_copy(note.version) is tensors  # noqa: E731
        else:
            # Found by examples/reshard.py in CI: a HashCells dropped because it came before the
            # reply to the publish that asked for it; the readers then waited for cells that never came.
            tensors = self._held()[0] if own is not None and self._publishes(note.version) else None
            still = lambda: self._published() == note.version  # noqa: E731
        if own is None or tensors is None:
            return
        try:
            grid = grid_of(note.placements)
            if grid_key(note.placements) != note.grid or own not in note.placements:
                log.warning("%s: HashCells of %s %d names a grid it is not part of; ignored",
                            self.client_id, what, note.version)
                return
            sums = gridsums.cell_checksums(dict(zip(own.names, tensors)), own, grid)
            if not still():
                return  # it moved on while hashing: the sums may be of other bytes
            cells = tuple(m.CellSum(t, c, x) for (t, c), x in sorted(sums.items()))
            reply = self._port.call(m.CellSums(self.client_id, note.version, note.grid, cells, host=note.host))
            if isinstance(reply, m.ErrorReply):
                log.info("%s: cell checksums of %s %d not taken: %s", self.client_id, what, note.version,
                         reply.message)
        except (errors.TensorHubError, ValueError) as e:
            log.warning("%s: hashing cells of %s %d failed: %s", self.client_id, what, note.version, e)

    def stop(self) -> None:
        """No more hashing; waits for the one in progress."""
        with self._lock:
            self._stopped = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
