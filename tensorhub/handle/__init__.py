"""The handle: one shard of one replica of one model, as users program against it.

:class:`Hub` (``hub.py``) is the public API and the driver of the pure
:class:`~tensorhub.core.handle.HandleMachine`. Its parts, each owning its state, lock and
threads, get what they need of the handle through their constructors:

- ``hub.py``: :class:`Hub`, :data:`HubState`: the calls;
- ``memory.py``: :class:`~tensorhub.handle.memory.Memory` (``hub._memory``): the registered
  tensors, their layout, transport region and the checksums of the version they hold;
- ``registration.py``: what a registration is checked against (pure helpers);
- ``driver.py``: :class:`~tensorhub.handle.driver.Driver` (``hub._driver``): the machine, its
  lock, and carrying out its commands (requests, pulls, offloads, the region); it reaches the
  handle only through :class:`~tensorhub.handle.driver.Handle`;
- ``staging.py``: :class:`~tensorhub.handle.staging.Staging` (``hub._staging``): the prefetch
  staging copy, the prefetch job thread, seeds, the double buffer and its swap; it reaches the
  handle (and the staging copy) only through :class:`~tensorhub.handle.staging.Owner`;
- ``background.py``: :class:`~tensorhub.handle.background.Background` (``hub._background``): the
  server's background notes (host copies, seeds, drops), the beat and re-announcing, by the
  core's rules (:mod:`tensorhub.core.background`);
- ``host_copies.py``: :class:`~tensorhub.handle.host_copies.HostCopies` (``hub.host_copies``):
  retention offloads, copies made ahead, the buffer pool and its thread;
- ``sources.py``: :class:`~tensorhub.handle.sources.Sources`: the sources kept open across
  reads and the tier each takes (same-host mapping, else NIXL);
- ``reads.py``: :class:`~tensorhub.handle.reads.ReadSession` (``hub.reads``): a read from its
  start to its :class:`ReadStats` (``call`` for ``replicate``/``update``; ``begin``/``finish``
  for code that moves a read's bytes itself, compiled graphs), tools' view of the region, and the
  pull path the driver uses too (``pull_range``: staging copy, same-host mapping, else NIXL);
- ``deltas.py``: seeds as deltas (``Config.seed_deltas``): :class:`~tensorhub.handle.deltas.Offers`
  (``hub._offers``: a publisher's host copies, encode thread and offered buffer) and
  :class:`~tensorhub.handle.deltas.Seeds` (``hub._staging.seeds``: a seeder's delta read and
  rebuild, in its prefetch thread; the rebuilt version is ``stage._delta_ready`` for the read);
- ``pulse.py``: one liveness loop per process and server, carrying every handle's beat.

No code outside this package uses a private member of :class:`Hub` (``tests/project/test_layers.py``).

Lock order (a thread holding one may take those after it, never one before it):

1. ``Hub._lock``: one user call at a time (``register``, ``publish``, ``replicate``, ...); the
   pulse thread only ever *tries* it (an idle handle's re-announcement, ``MakeHostCopy``);
2. ``Background._notes_lock`` (re-entrant): taking and applying the server's background
   notes, and announcing (a drop fetched before an announcement is applied before it);
3. ``Driver.lock`` (``hub._driver.lock``): the machine (user thread and pulse thread);
4. leaves, nothing is taken while one is held: ``Staging._lock`` (the staging copy, prefetch
   jobs, ``close()`` begun; an update's swap takes it under ``_lock``, a seed under
   ``_notes_lock``), ``HostCopies.lock``, the ``Sources`` lock, ``Offers._lock`` (its thread's
   copy of the published tensors; ``unpublish`` waits on it under ``_lock``) and a ``Pulse``'s
   own lock.

A staging copy is a second :class:`Hub` of the same process whose locks 1-3 rank after its
owner's ``Driver.lock`` and before the leaves: a swap holds the owner's ``_lock``, then the
copy's, and both ``Driver.lock``, the owner's first. The copy never takes a lock of its owner.
"""

from tensorhub.handle.hub import Hub, HubState, NamedTensors, ReadStats

__all__ = ["Hub", "HubState", "NamedTensors", "ReadStats"]
