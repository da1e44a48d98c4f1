"""The handle: one shard of one replica of one model, as users program against it.

:class:`Hub` (``hub.py``) is the public API and the driver of the pure
:class:`~tensorhub.core.handle.HandleMachine`; it applies the core's background rules
(:mod:`tensorhub.core.background`). Its parts, each owning its state, lock and threads:

- ``hub.py``: :class:`Hub`, :class:`ReadStats`, :data:`HubState`: the calls, the machine and its
  driver, reads, sources, the prefetch staging copy and the double-buffer swap;
- ``host_copies.py``: :class:`~tensorhub.handle.host_copies.HostCopies` (``hub.host_copies``):
  retention offloads, copies made ahead, the buffer pool and its thread;
- ``sources.py``: :class:`~tensorhub.handle.sources.Sources`: the sources kept open across
  reads and the tier each takes (same-host mapping, else NIXL);
- ``reads.py``: :class:`~tensorhub.handle.reads.ReadSession` (``hub.reads``): the read path as
  a named API for code that moves a read's bytes itself (compiled graphs) and for tools;
- ``pulse.py``: one liveness loop per process and server, carrying every handle's beat.

No code outside this package uses a private member of :class:`Hub` (``tests/test_layers.py``).

Lock order (a thread holding one may take those after it, never one before it):

1. ``Hub._lock``: one user call at a time (``register``, ``publish``, ``replicate``, ...); the
   pulse thread only ever *tries* it (an idle handle's re-announcement, ``MakeHostCopy``);
2. ``Hub._stage_lock``: the staging copy, prefetch jobs, ``close()`` begun;
3. ``Hub._notes_lock`` (re-entrant): taking and applying the server's background notes, and
   announcing (a drop fetched before an announcement is applied before it);
4. ``Hub._mlock``: the machine (user thread and pulse thread);
5. ``HostCopies.lock``, the ``Sources`` lock and a ``Pulse``'s own lock: leaves; nothing is
   taken while one is held.

A staging copy is a second :class:`Hub` of the same process: its locks are taken only after its
owner's ``_stage_lock`` has been released, never while the owner holds ``_mlock``.
"""

from tensorhub.handle.hub import Hub, HubState, NamedTensors, ReadStats

__all__ = ["Hub", "HubState", "NamedTensors", "ReadStats"]
