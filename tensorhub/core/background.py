"""A handle's background rules, pure: what it does with what the server sends between calls.

The server's pulse replies and notes carry events no user call asked for: make a host copy of a
retained version ahead (``MakeHostCopy``), seed a version into this datacenter (``SeedAhead``)
or prefetch one that is arriving there (``PrefetchAhead``), drop a host copy (``DropHostCopy``),
eviction, demotion, and "I do not know this handle" (after a server restart or a lost lease).
What to do with each is decided here, once, and both drivers apply the decision:
:class:`tensorhub.Hub` (threads, NIXL, the port) and the simulator's clients
(:mod:`tensorhub.sim.client`, :mod:`tensorhub.sim.seeding`), so the rule the simulator checks is
the rule that ships. The drivers keep only what is theirs to do: start a thread or schedule an
event, copy bytes, send the request.

Order, for one handle's share of a pulse reply (:func:`after_pulse`): its notes first (a host
copy the server dropped before it forgot the handle must not be announced again), then the
acknowledgement, then either offering again the host copies no answer reached (the server knows
the handle) or announcing the handle again (it does not).

Like the rest of ``tensorhub/core`` this module imports no ray, torch, time or threading.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from tensorhub.core import messages as m
from tensorhub.core.handle import Phase


class Kind(enum.Enum):
    """Who carries out a background event."""

    HOST_COPY = "host_copy"
    """``MakeHostCopy``: the driver, if :func:`host_copy_wanted` says so."""
    SEED = "seed"
    """``SeedAhead`` or ``PrefetchAhead``: the driver, if :func:`seed_decision` says so (a
    staging copy reads it; :func:`seed_across` says whether a delta may stand in for it)."""
    CELLS = "cells"
    """``HashCells``: the handle's resharding part hashes the cells a reader of another layout
    checks (:mod:`tensorhub.handle.reshard`)."""
    MACHINE = "machine"
    """Everything else (``DropHostCopy``, ``Evicted``, ``Demoted``, ...): fed to the
    :class:`~tensorhub.core.handle.HandleMachine` as ``Noted``; the driver runs its commands."""


def kind_of(note: object) -> Kind:
    """Who handles ``note`` (one of the server's background events)."""
    if isinstance(note, m.MakeHostCopy):
        return Kind.HOST_COPY
    if isinstance(note, (m.SeedAhead, m.PrefetchAhead)):
        return Kind.SEED
    if isinstance(note, m.HashCells):
        return Kind.CELLS
    return Kind.MACHINE


def seed_across(note: m.SeedAhead | m.PrefetchAhead) -> bool:
    """Whether the staging read ``note`` asks for crosses the slow link: a ``SeedAhead`` does
    (the datacenter's one copy; with ``seed_deltas`` a delta may stand in for it); a
    ``PrefetchAhead`` reads behind that seed inside the datacenter (the full version, never a
    delta). Both are otherwise the same prefetch, decided by :func:`seed_decision`."""
    assert isinstance(note, (m.SeedAhead, m.PrefetchAhead)), note  # kind_of(note) is Kind.SEED
    return isinstance(note, m.SeedAhead)


def seed_round(version: int) -> int:
    """The staging copy's round of a seed of ``version`` (rounds start at 1, versions at 0).

    A seed is round ``version + 1``, not the next count: every shard of a replica is asked the
    same version, but each may skip a seed on its own (a newer one came while it was busy, it
    had the version already), and a count would then put the shards in different rounds for
    good (each later seed of the shard behind failing with ``TransactionMismatch``)."""
    return version + 1


def host_copy_wanted(version: int, *, between_calls: bool, phase: Phase, published: Optional[int],
                     keeps_copies: bool, host_copy_ahead: bool, versions_retained: int,
                     host_copies_pooled: int) -> bool:
    """Whether a holder asked ``MakeHostCopy(version)`` starts its background host copy.

    Only between calls (a call in progress may change the tensors), only while it still
    publishes that version, never on a spot or ``retains=False`` holder (``keeps_copies`` False), only with ``host_copy_ahead`` and room for
    a retained version (``versions_retained`` >= 2) and a buffer pool (``host_copies_pooled``
    > 0: the copy goes to a touched, registered buffer; the handle keeps one exactly then, see
    :meth:`tensorhub.handle.host_copies.HostCopies.start_pool`). Otherwise the request is dropped and
    the last holder offloads at unpublish instead. The driver still skips a copy it is already
    making or already has."""
    return (between_calls and phase is Phase.PUBLISHED and published == version and keeps_copies
            and host_copy_ahead and versions_retained >= 2 and host_copies_pooled > 0)


@dataclasses.dataclass(frozen=True)
class SeedView:
    """What :func:`seed_decision` needs to know of a handle and its staging copy."""

    staging: bool
    """The handle is a staging copy itself (staging copies never seed)."""
    registered: bool
    """The handle has registered its tensors (it has a layout the staging copy takes)."""
    closed: bool
    published: Optional[int]
    """The version the handle publishes, if any."""
    seeding: int
    """The newest version a seed was started for (-1: none)."""
    stage_version: Optional[int] = None
    """The version the staging copy holds, if it exists and holds one."""
    stage_seq: int = 0
    """The staging copy's round counter (0: none yet or no staging copy)."""


def seed_decision(version: int, view: SeedView) -> Optional[str]:
    """``None``: seed ``version`` into the staging copy now (offload seeding, ``SeedAhead``, or
    its datacenter's prefetch, ``PrefetchAhead``: the same rule); else why not. A handle that
    cannot seed (a staging copy, unregistered, closed), already has the version or newer
    (published, staged, a seed started), or whose staging copy's rounds are past this seed's
    round (a user's ``prefetch()`` counted ahead; :func:`seed_round`) skips."""
    if view.staging:
        return "a staging copy does not seed"
    if not view.registered or view.closed:
        return "not registered" if not view.closed else "closed"
    if view.published is not None and view.published >= version:
        return f"it publishes version {view.published}"
    if view.stage_version is not None and view.stage_version >= version:
        return f"its staging copy holds version {view.stage_version}"
    if view.seeding >= version:
        return f"a seed of version {view.seeding} is under way"
    if view.stage_seq >= seed_round(version):
        return f"the staging copy's rounds are past {seed_round(version)}"
    return None


def prefetch_waits(view: SeedView) -> bool:
    """Whether a prefetch inside the datacenter (``PrefetchAhead``, one :func:`seed_decision`
    allows) waits: while the staging copy holds a version newer than the one the handle
    publishes, its engine has not taken that version yet, and replacing it now would send the
    engine's next update over the datacenter's network for it (smart skipping answers that
    version while the newer one is in flight) -- measured: with seeds slower than the trainer's
    step, most updates did. The driver remembers the newest such version and asks again after
    the handle's next read call (``replicate`` or ``update``), which takes the staged version
    (a local copy or a swap); the seed's newer version then follows. A seed (``SeedAhead``)
    never waits: its datacenter's one copy must start crossing (the server keeps the
    datacenter's newest copy first: ``CrossDatacenter.keeps_dc_copy``)."""
    return view.stage_version is not None and (view.published is None or view.stage_version > view.published)


@dataclasses.dataclass(frozen=True)
class PulseAnswer:
    """What one handle does after its share of a pulse reply, its notes applied first."""

    acked: int
    """The newest background event the next beat acknowledges."""
    reoffer: bool
    """Offer again the host copies whose offer got no answer (the server knows the handle)."""
    announce: bool
    """Announce the handle again (the server does not know it)."""


def after_pulse(*, known: bool, may_announce: bool, acked_before: int, acked: int, reading: bool, idle: bool,
                unoffered: bool) -> PulseAnswer:
    """The rule for a handle after a pulse answered (its notes already applied).

    ``known``: the server knows the handle. ``may_announce``: this reply may announce it again
    (the liveness stream's; the progress stream leaves that to the liveness stream, one
    announcement per restart, and does nothing for a handle the server does not know).
    ``reading``: a read is in flight (a reader announces its edge at once: the holder's drain
    waits for it). ``idle``: no user call is in flight and the handle is registered (IDLE or
    PUBLISHED); a handle with a call in flight is announced by that call. ``unoffered``: host
    copies whose offer got no answer are waiting (offered again only to a server that knows the
    handle)."""
    acked = max(acked_before, acked)
    if known:
        return PulseAnswer(acked, reoffer=unoffered, announce=False)
    return PulseAnswer(acked, reoffer=False, announce=may_announce and (reading or idle))


def registered_phase(phase: Phase) -> bool:
    """A phase in which a handle holds registered tensors and no call of its own is half done."""
    return phase in (Phase.IDLE, Phase.PUBLISHED)
