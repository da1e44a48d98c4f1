"""The sources a handle reads from, kept open across reads: a part of a handle.

Opening a NIXL source prepares a descriptor per piece of the layout (about 40 ms for a 1 GiB
shard of 660 tensors, a sixth of its transfer), so a handle keeps its recent holders' sources
open (:data:`SOURCES_KEPT`, least recently used out first). Which tier a source takes is chosen
here: the same-host tier (the holder's memory mapped into this process,
:class:`~tensorhub.transport.shm.ShmSource`) where the holder lives on this host and the config
allows it, else NIXL. Owned by the handle: callers never close a source; a failed read drops it
(:meth:`Sources.drop`), and the next assignment of that holder opens it afresh.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Optional

import msgspec

from tensorhub import errors
from tensorhub import transport as tx
from tensorhub.core import messages as m
from tensorhub.transport import shm

log = logging.getLogger("tensorhub.client")

SOURCES_KEPT = 4
"""Sources a handle keeps open across reads (its recent holders), per tier."""


class Sources:
    """A handle's open sources by endpoint (``b"shm:" + endpoint`` for a mapped one). Owns its
    lock, a leaf: nothing else is taken while it is held."""

    def __init__(self, config, model: str, shard: int) -> None:
        self.config, self.model, self.shard = config, model, shard
        self._lock = threading.Lock()
        self._open: "collections.OrderedDict[bytes, object]" = collections.OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def _cached(self, key: bytes):
        with self._lock:
            src = self._open.pop(key, None)
            if src is not None:
                self._open[key] = src  # most recently used last
            return src

    def _keep(self, key: bytes, src) -> None:
        with self._lock:
            self._open[key] = src
            while len(self._open) > SOURCES_KEPT:
                self._open.pop(next(iter(self._open))).close()

    def nixl(self, a: m.Assignment) -> tx.Source:
        """The NIXL source of ``a``, kept open across reads. Raises SourceUnreachable."""
        src = self._cached(a.source_endpoint)
        if src is not None:
            return src
        try:
            src = tx.open_source(a.source_endpoint, config=self.config)
        except errors.TransferError as e:
            raise errors.SourceUnreachable(str(e)) from e
        self._keep(a.source_endpoint, src)
        return src

    def same_host(self, a: m.Assignment) -> Optional[shm.ShmSource]:
        """The source's memory mapped here if it lives on this host (the same-host tier), kept
        with the other open sources; None: read it through NIXL."""
        key = b"shm:" + a.source_endpoint
        src = self._cached(key)
        if src is not None:
            return src
        try:
            info = tx.decode_endpoint(a.source_endpoint).shm
        except msgspec.ValidationError:
            return None
        if not self.config.same_host or not shm.usable(info):
            return None
        try:
            src = shm.ShmSource(info)
        except errors.TransferError as e:
            log.info("model=%s shard=%d: same-host source %s not mappable (%s): NIXL instead",
                     self.model, self.shard, a.source_id, e)
            return None
        self._keep(key, src)
        return src

    def drop(self, a: m.Assignment) -> None:
        """A read from ``a``'s source failed: open it afresh (and load its peer's metadata
        again) if it is assigned again."""
        with self._lock:
            src = self._open.pop(a.source_endpoint, None)
            near = self._open.pop(b"shm:" + a.source_endpoint, None)
        if near is not None:
            near.close()
        if src is not None:
            src.agent.reload_remote(src.name)
            src.close()

    def close(self) -> None:
        """Close every open source (the handle closes)."""
        with self._lock:
            sources = list(self._open.values())
            self._open.clear()
        for src in sources:
            src.close()
