"""A handle's side of the server's background work (``hub._background``).

The server sends each handle *notes*: host copies to make ahead or past retention
(``MakeHostCopy``), versions to seed into its datacenter (``SeedAhead``) or to prefetch there
(``PrefetchAhead``), host copies to drop
and demotions. They come with the pulse's reply (:mod:`tensorhub.handle.pulse`), or are fetched
after a call (:meth:`Background.take_notes`). :class:`Background` carries them out, builds the
handle's beat, and announces the handle again to a server that forgot it. Which note means what,
and what to do after a pulse, are the core's rules (:mod:`tensorhub.core.background`).

Rules:

- Notes are taken and applied, and announcements made, under ``Background._notes_lock``
  (re-entrant): a drop fetched before an announcement is applied before it (the announcement
  then leaves the copy out).
- A host copy is started only between calls (the call lock is free, or the caller holds it),
  and an idle handle is announced only with the call lock taken: a call in flight announces
  itself. The pulse thread only ever *tries* the call lock.
- Nothing is done once the handle's threads are stopped (``stopped``).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

import msgspec

from tensorhub import errors
from tensorhub import transport as tx
from tensorhub.config import Config
from tensorhub.core import background as bg
from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.handle.host_copies import HostCopies
from tensorhub.ports import ServerPort

log = logging.getLogger("tensorhub.client")
"""The handle's log (one name for all its parts, kept for users' log filters)."""


class Background:
    """The server's notes for one handle, its beat and its re-announcement.

    What it needs of its handle is passed in: who it is (``client_id``, ``model``, ``replica``,
    ``shard``, ``spot``), its ``config`` and server ``port``; its ``machine`` and the machine's
    lock ``mlock`` (read under it: reading or not, phase, version, the announcement); its call
    lock ``call_lock`` (only tried, or held by the caller: ``in_call``); ``stopped``, set once
    its threads stop; ``region()``, its transport region now (None before register); ``feed``,
    which feeds an event to the machine and returns its commands; ``set_region``, which carries
    out a ``SetRegion``; ``host_copies``; ``seed_asked``, which starts a seed or a prefetch inside
    the datacenter (the staging part; :func:`tensorhub.core.background.seed_across` says which);
    ``cells_asked``, which hashes cells for a reader of another layout (the resharding part).
    Owns ``_notes_lock`` and the newest note acknowledged; makes no thread."""

    def __init__(self, *, client_id: str, model: str, replica: str, shard: int, keeps_copies: bool, config: Config,
                 port: ServerPort, machine: hm.HandleMachine, mlock: threading.Lock, call_lock: threading.Lock,
                 stopped: threading.Event, region: Callable[[], Optional[tx.Region]],
                 feed: Callable[[hm.Event], list], set_region: Callable[[hm.SetRegion], None],
                 host_copies: HostCopies, seed_asked: Callable[[int, bool], None],
                 cells_asked: Callable[[m.HashCells], None]) -> None:
        self.client_id, self.model, self.replica, self.shard = client_id, model, replica, shard
        self.keeps_copies = keeps_copies
        self._config = config
        self._port = port
        self._machine = machine
        self._mlock = mlock
        self._call_lock = call_lock
        self._stopped = stopped
        self._region = region
        self._feed = feed
        self._set_region = set_region
        self._host_copies = host_copies
        self._seed_asked = seed_asked
        self._cells_asked = cells_asked
        self._notes_lock = threading.RLock()
        """Taking and applying background notes vs. announcing: a drop fetched before an
        announcement is applied before it (the announcement then leaves the copy out)."""
        self._notes_acked = 0
        """The newest background event taken from a pulse (the next beat acknowledges it)."""

    # ------------------------------------------------------------------ the pulse

    def beat(self) -> Optional[m.Beat]:
        """This interval's heartbeat: read progress while reading (the pulse sends it)."""
        if self._stopped.is_set():
            return None
        with self._mlock:
            reading = self._machine.reading
        region = self._region()
        if region is None:
            return None
        return m.Beat(self.client_id, region.progress if reading else -1, acked=self._notes_acked)

    def after_beat(self, known: bool, notes: list, acked: int = -1, may_announce: bool = True,
                   viewed: Optional[hm.Viewed] = None) -> None:
        """The pulse's answer for this handle: announce again if the server does not know it,
        then apply the background events it brought (numbered up to ``acked``: the next beat
        acknowledges them; one that comes again, its reply having been lost, is done already)
        and what it says of the model's newest version (``viewed``, before the next beat)."""
        if self._stopped.is_set():
            return
        with self._notes_lock:
            # Events the server sent before it forgot this handle come first (a host copy it
            # dropped must not be announced again).
            self._apply(notes, in_call=False)
            if viewed is not None:
                self._feed(viewed)
            with self._mlock:
                reading = self._machine.reading
            # No call in flight (that call re-announces itself): the user lock is free.
            free = not known and may_announce and not reading and self._call_lock.acquire(blocking=False)
            try:
                answer = bg.after_pulse(known=known, may_announce=may_announce, acked_before=self._notes_acked,
                                        acked=acked, reading=reading,
                                        idle=free and bg.registered_phase(self._machine.phase),
                                        unoffered=bool(self._host_copies.unoffered))
                self._notes_acked = answer.acked
                if answer.reoffer:
                    self._host_copies.reoffer()
                if answer.announce:
                    self.announce_now()
            finally:
                if free:
                    self._call_lock.release()

    # ------------------------------------------------------------------ notes

    def take_notes(self, in_call: bool = False) -> None:
        """Background events (host copies to make ahead or past retention, evictions) waiting at
        the server, fetched now (the pulse brings them otherwise). ``in_call``: the caller holds
        the call lock (a user call that just finished)."""
        with self._notes_lock:
            self._apply(self._port.notes(self.client_id), in_call)

    def _apply(self, notes: list, in_call: bool) -> None:
        """Carry out background events; the caller holds ``_notes_lock``."""
        for note in notes:
            kind = bg.kind_of(note)
            if kind is bg.Kind.HOST_COPY:
                self._host_copy_asked(note.version, in_call)
                continue
            if kind is bg.Kind.SEED:
                self._seed_asked(note.version, bg.seed_across(note))
                continue
            if kind is bg.Kind.CELLS:
                self._cells_asked(note)
                continue
            for cmd in self._feed(hm.Noted(note)):
                if isinstance(cmd, hm.DropHost):
                    self._host_copies.drop(cmd.version)
                elif isinstance(cmd, hm.SetRegion):
                    self._set_region(cmd)  # Demoted: advertise nothing

    def _host_copy_asked(self, version: int, in_call: bool) -> None:
        """The server asks this holder to copy ``version`` to host memory ahead (MakeHostCopy).
        Only between calls (a call in progress may change the tensors) and only while the handle
        still publishes that version; otherwise the request is dropped (the last holder will
        offload instead)."""
        between_calls = in_call or self._call_lock.acquire(blocking=False)
        try:
            cfg = self._config
            if bg.host_copy_wanted(version, between_calls=between_calls, phase=self._machine.phase,
                                   published=self._machine.published, keeps_copies=self.keeps_copies,
                                   host_copy_ahead=cfg.host_copy_ahead, versions_retained=cfg.versions_retained,
                                   host_copies_pooled=cfg.host_copies_pooled):
                self._host_copies.start_copy(version)
        finally:
            if between_calls and not in_call:
                self._call_lock.release()

    # ------------------------------------------------------------------ announcing

    def send_announce(self, req: m.Announce) -> object:
        """Send ``req`` (the machine's), without host copies freed since it was built; under
        ``_notes_lock``. Returns the reply; raises as the port does."""
        with self._notes_lock:
            return self._port.call(self._current_hosts(req))

    def announce_now(self) -> None:
        """Announce the handle again, between calls (the server forgot it)."""
        with self._notes_lock:
            with self._mlock:
                req = self._machine.announce_request(reading_units=self._region().progress)
            reply = self._port.call(self._current_hosts(req))
        if isinstance(reply, m.ErrorReply):
            raise errors.from_code(reply.code, reply.message)
        log.info("model=%s replica=%s shard=%d re-announced to the reference server", self.model, self.replica,
                 self.shard)

    def _current_hosts(self, req: m.Announce) -> m.Announce:
        """``req`` without host copies freed since it was built."""
        held = self._host_copies.held_versions(v for v, _ in req.holding.host_copies)
        keep = tuple((v, e) for v, e in req.holding.host_copies if v in held)
        if keep == req.holding.host_copies:
            return req
        return msgspec.structs.replace(req, holding=msgspec.structs.replace(req.holding, host_copies=keep))
