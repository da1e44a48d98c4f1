"""One frozen configuration object for every TensorHub component.

Build it once (``Config()`` or ``Config.from_env()``) and pass it explicitly; nothing deeper
in the code reads the environment. Every field can be overridden by an environment variable
``TENSORHUB_<FIELD>`` (upper case) through :meth:`Config.from_env`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from tensorhub.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Config:
    # --- layout -------------------------------------------------------------------------
    unit_bytes: int = 16 << 20
    """Largest transfer unit; bigger tensors are cut into chunks of at most this size."""
    unit_count_target: int = 256
    """Cut a shard into about this many units (a partial holder serves whole units, so a
    pipeline of N readers lags about N units behind the first); 0 = always ``unit_bytes``."""
    unit_bytes_min: int = 256 << 10
    """Smallest unit the target count may produce (each read costs some microseconds);
    ``unit_bytes`` wins if it is smaller."""
    pack_below_bytes: int = 2 << 20
    """Tensors smaller than this (and than unit_bytes) share units (tiny-tensor compaction)."""
    verify_mutability: bool = False
    """Verify mode: at unpublish, re-checksum every unit and raise MutabilityViolation (naming
    the tensor) if the registered tensors were written while published."""
    checksums: bool = True
    """Compute per-unit checksums at publish and verify them at the reader."""

    # --- protocol -----------------------------------------------------------------------
    versions_retained: int = 2
    """The newest k versions of each model are kept available (offloaded to host if needed)."""
    readers_per_source_max: int = 1
    """At most this many concurrent readers per source (1 = pipeline replication)."""
    heartbeat_interval_s: float = 1.0
    """How often a process's pulse (:mod:`tensorhub.handle.pulse`) reports while one of its handles
    reads (its progress), and the pulse spacing when the server does not hold pulses."""
    pulse_hold_s: float = 30.0
    """An idle process's pulse is held by its server up to this long (a long poll): the server
    answers at once with a background event for one of its handles (a seed, a host copy to make
    or drop), early when one of its handles sends another request or a new handle of the
    process registers, or when a reader reports one of them failed (the process must then pulse
    again within ``2.5 * heartbeat_interval_s``); while held its handles count as heard from for
    their lease (retention asks such a process for proof, ``Probe``, before it counts its copies).
    So an idle fleet costs the server one call per process per ``pulse_hold_s``, and events
    still arrive at once. A dead process is found through Ray (its worker's or node's death is
    pushed to the server), not by the silence of its pulse; a process that hangs without dying
    is found within ``pulse_hold_s + lease_timeout_s`` (on a server that is behind, longer:
    ``lease_stretch_max_s``). 0: no holding, one pulse per
    ``heartbeat_interval_s``."""
    noop_staleness_s: float = 0.0
    """No-op updates answered locally: the server pushes every change of a model's newest
    readable version to the model's handles (``Newest``, on their held pulses), and a handle
    that publishes the newest version it was told of answers ``update("latest")`` as a no-op
    without a call while that knowledge is at most this old -- it counts from the moment the
    server answered the pulse that brought it, so a delayed push or a slow server never makes a
    local answer staler than this. With ``smart_skipping``, the pushes also say whether a newer
    version is still on its way into the handle's datacenter and which version is complete
    there; a handle that publishes that one answers as a smart skip, locally
    (``ReadStats.skipped_in_flight`` set, as from the server), until it is told the seed landed.
    The server holds pulses at most ``noop_staleness_s - 2 *
    heartbeat_interval_s`` (:attr:`pulse_hold_max_s`) so a live handle's knowledge is renewed
    before it runs out. Shards of sharded replicas always ask (their rounds are transactions
    the server resolves; docs/design.md, "No-op updates answered locally"). 0 (the default):
    every update asks the server (pulses held ``pulse_hold_s``). Off by default because a local
    answer may miss a version published less than this long ago: a rollout told out of band
    that the trainer published (the examples do) would not see it."""
    lease_timeout_s: float = 10.0
    """A client silent for this long is declared dead and its whole replica removed."""
    lease_stretch_max_s: float = 60.0
    """How far a server that falls behind stretches every lease: silence counts from what the
    server could have read, so a client whose pulse waits unread in its queue is not declared
    dead (the server measures how far behind it is: :class:`tensorhub.server.requests.Backlog`); and while
    it is behind by more than ``heartbeat_interval_s`` it holds pulses longer (up to twice
    ``pulse_hold_s``). A client that really stopped is still declared dead within
    ``lease_timeout_s + lease_stretch_max_s`` of its last word, however far behind the
    server is (Ray's pushed deaths stay the fast path). 0: leases are never stretched."""
    register_shed_s: float = 2.0
    """Backpressure on new clients: a server behind by more than this (its
    :class:`~tensorhub.server.requests.Backlog`) refuses a ``Register`` with ``ServerBusy`` and a
    ``retry_after_s`` about as long as its backlog (spread 0.5-1.5x so the retries do not
    return together, at most ``lease_timeout_s``); the handle pauses that long and asks again
    until ``request_timeout_s``. A refused registration costs the server a bounds check, not a
    table change, so the clients already registered keep their leases while a crowd joins.
    Announcements (known clients coming back after a restart) are never shed. 0: never shed."""
    host_copies_pooled: int = 1
    """Retention (offload) buffers each non-spot handle keeps ready: allocated, touched and
    registered in the background after ``register`` and refilled after every offload, so an
    offload copies at memory speed instead of paying for fresh memory on a reader's critical
    path; freed host copies return to the pool. The background touches pause while the handle
    reads (a first touch takes a core and the memory bus), unless a copy waits for the buffer.
    Costs this many shard-sized host buffers per handle on top of the host copies it holds. 0:
    allocate on demand (slow first touch)."""
    host_pool_refill_delay_s: float = 5.0
    """After a retention copy takes the pooled buffer, wait this long before preparing another:
    the host copy freed at the next commit usually refills the pool first (no allocation, no
    first touch competing with this process's reads). An offload that finds the pool empty has
    one prepared at once."""
    host_copy_ahead: bool = True
    """When the server asks (the first non-spot reader to finish a retained version; or, when its
    readers are engines registered ``retains=False`` and no replica that keeps copies holds or
    reads the version, the holder they read from once they are done), copy it to a host buffer
    in the background and offer it as the version's retention copy, so that the last holder to
    move off it need not offload on its critical path -- and, when a reader makes it, the copy
    lives outside the trainer's process. Only with ``versions_retained >= 2``; the next call
    waits for a copy in progress (memory speed) or cancels one still waiting for a buffer."""
    smart_skipping: bool = True
    """While a cross-datacenter seed is in flight, "latest" resolves to the newest local version
    (``ReadStats.skipped_in_flight`` names the version still seeding); with
    ``noop_staleness_s``, a no-op skip is answered by the handle without a call."""
    offload_seeding: bool = True
    """When a version is committed, the server asks one replica of each other datacenter to
    receive it into a staging copy in the background (``SeedAhead`` -> ``Hub.prefetch``): the
    one cross-datacenter copy starts at once and no engine blocks on it."""
    prefetch_in_datacenter: bool = True
    """With ``offload_seeding``: as soon as a remote datacenter's seed is partial there (the asked
    seeder's staging copy holds a prefix of every shard), the server tells every other replica
    registered in that datacenter to prefetch the version too (``PrefetchAhead``): their staging
    copies read it behind the seed, inside the datacenter (never across), so every engine's
    ``update()`` there is a local copy, or a swap with a double buffer, instead of a read over
    the datacenter's network. Memory: one shard-sized host staging buffer per handle of a
    remote datacenter (the same bound as :meth:`~tensorhub.Hub.prefetch`; none where the user
    registered a double buffer: the prefetch lands there), allocated at its first prefetch and
    kept until ``close()``; no handle in the trainer's datacenter is asked. On by default since
    offload seeding may ask any of a datacenter's replicas to seed, so each may already hold
    that buffer; False where host memory is short (those updates read the seed over the
    datacenter's network at update time)."""
    seed_wait_s: float = 5.0
    """How long a datacenter's readers wait for the asked seeder to start its copy (they then
    read it there) before the first of them crosses itself."""
    seed_deltas: bool = False
    """Seeds cross as deltas (:mod:`tensorhub.transport.delta`): a handle that publishes keeps
    a host copy of its previous version and, after each ``publish``, encodes the new one against
    it into a registered buffer it offers to the server; a seeder whose staging copy holds that
    base reads the delta instead of the version, rebuilds the version and checks it (any failure:
    the full seed). Off by default: it costs the publisher two host copies of its shard and an
    encode per step (about 1 GB/s on one core), worth it where a slow link carries the seeds."""
    seed_delta_wait_s: float = 2.0
    """How long a seeder waits for a delta its publisher is still encoding (the server says one
    is coming: ``DeltaPending``) before its seed crosses in full."""
    seed_delta_ratio_max: float = 0.25
    """A delta larger than this fraction of its shard is not offered (the full seed crosses);
    also the size of the registered buffer that holds it, on the publisher and the seeder."""

    # --- data path ----------------------------------------------------------------------
    reads_in_flight: int = 8
    """Most unit reads a reader keeps posted at once. The reader posts as few as fill the link
    (usually one or two: many reads over one link finish together, which starves a pipeline);
    see :mod:`tensorhub.transport.pacing`."""
    source_stall_timeout_s: float = 10.0
    """A source whose progress does not advance for this long is reported as failed."""
    failovers_max: int = 6
    """A read gives up (TransferError) after this many failed sources in a row without progress."""
    reconnects_max: int = 3
    """Times one call reconnects / re-announces after the server vanished before it gives up."""
    request_timeout_s: float = 300.0
    """Upper bound on any blocking client call (waiting for a source, a drain, ...)."""

    same_host: bool = True
    """The same-host tier: registered CPU tensors move into shared memory in place at
    ``register`` and readers on the same host copy from them directly, not through NIXL
    (:mod:`tensorhub.transport.shm`)."""
    same_host_threads: int = 4
    """Copy threads of a same-host read (units copied and checksummed at once). More threads than
    cores pay: the copies wait on memory (benchmarks/RESULTS.md, issue 27)."""
    cuda_ipc: bool = True
    """With ``same_host``: registered CUDA tensors are exported by CUDA IPC, so a reader on the
    same host whose process sees the GPU copies GPU to GPU instead of going through NIXL
    (:mod:`tensorhub.transport.cuda_ipc`)."""

    # --- Ray ------------------------------------------------------------------------------
    server_name: str = "tensorhub-server"
    """Name of the reference server actor (with ``server_per_model``: the prefix of every
    model's server actor name). No "/" in it."""
    namespace: str = "tensorhub"
    """Ray namespace of the server actors."""
    server_per_model: bool = True
    """Partitioning: each model is served by its own reference server actor, named
    ``<server_name>/<model, percent-encoded>`` (:func:`tensorhub.server.naming.actor_name`),
    so one model's fleet never queues behind another's and a server restart touches only its
    model. False: one server named ``server_name`` serves every model."""
    server_near_creator: bool = True
    """Create a server actor on the node of the process that creates it (the model's first
    ``open()``). Open the trainer first and the
    server sits in its datacenter. False: wherever Ray's scheduler puts a zero-CPU actor (in
    practice any node: across datacenters, a remote reader's every call may cross two slow
    links)."""
    model_secret: str = dataclasses.field(default="", repr=False)
    """A secret shared by the jobs of one model (through their runtime environment:
    ``TENSORHUB_MODEL_SECRET``). A model's server created with one refuses every ``Register``
    and ``Announce`` that does not prove it (``Unauthorized``) and shows its operator view
    (``tensorhub status``) only to those who hold it; a client holding one refuses a server that
    cannot prove it. "" (default): the model is open to every job of the Ray cluster (each
    client still acts only for itself). Never logged, never in a repr, metrics or status output;
    docs/security.md, "A model secret"."""
    server_tick_s: float = 0.5
    """How often the server actor runs its clock (``ReferenceCore.tick``): lease expiry, the end
    of the recovery window, drains that wait for a deadline. Leases and timeouts are judged to
    within one tick."""
    liveness_check_s: float = 1.0
    """How often the server asks Ray which clients' processes are gone (a job that ended takes its
    holders along); also asked at once when a reader reports a source failed. 0 = never (leases
    still apply)."""
    backend: str = "UCX"
    """NIXL backend for reads."""
    nixl_workers: int = 2
    """UCX workers per agent: reads in flight spread over them (measured: 1 worker ~2 GB/s,
    2 workers ~3.5-5 GB/s on a 2-core VM)."""
    nixl_threads: int = 2
    """UCX backend worker threads per agent (0: progress only when polled)."""
    nixl_progress_delay_us: int = 100
    """Sleep of NIXL's progress thread between rounds. NIXL's Python wrapper uses 0, which spins
    a whole core per process even when idle; 100 us costs ~2% of a core."""

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.unit_bytes >= 4096, "unit_bytes must be >= 4096")
        need(self.unit_bytes_min >= 4096 and self.unit_count_target >= 0,
             "unit_bytes_min must be >= 4096, unit_count_target >= 0")
        need(self.pack_below_bytes >= 0, "pack_below_bytes must be >= 0")
        need(self.versions_retained >= 1, "versions_retained must be >= 1")
        need(self.readers_per_source_max >= 1, "readers_per_source_max must be >= 1")
        need(self.heartbeat_interval_s > 0, "heartbeat_interval_s must be > 0")
        need(
            self.lease_timeout_s > 2 * self.heartbeat_interval_s,
            "lease_timeout_s must be > 2 * heartbeat_interval_s",
        )
        need(self.nixl_workers >= 1 and self.nixl_threads >= 0, "nixl_workers must be >= 1, nixl_threads >= 0")
        need(self.nixl_progress_delay_us >= 0, "nixl_progress_delay_us must be >= 0")
        need(self.reads_in_flight >= 1, "reads_in_flight must be >= 1")
        need(self.same_host_threads >= 1, "same_host_threads must be >= 1")
        need(self.source_stall_timeout_s > 0, "source_stall_timeout_s must be > 0")
        need(self.host_copies_pooled >= 0, "host_copies_pooled must be >= 0")
        need(self.host_pool_refill_delay_s >= 0, "host_pool_refill_delay_s must be >= 0")
        need(self.reconnects_max >= 0, "reconnects_max must be >= 0")
        need(self.failovers_max >= 0, "failovers_max must be >= 0")
        need(self.request_timeout_s > 0, "request_timeout_s must be > 0")
        need(bool(self.server_name) and "/" not in self.server_name,
             "server_name must be non-empty and without '/' (it prefixes '<server_name>/<model>')")
        need(self.server_tick_s > 0, "server_tick_s must be > 0")
        need(self.liveness_check_s >= 0, "liveness_check_s must be >= 0")
        need(self.pulse_hold_s >= 0, "pulse_hold_s must be >= 0")
        need(self.noop_staleness_s >= 0, "noop_staleness_s must be >= 0")
        need(self.lease_stretch_max_s >= 0, "lease_stretch_max_s must be >= 0")
        need(self.register_shed_s >= 0, "register_shed_s must be >= 0")
        need(0 < self.seed_delta_ratio_max <= 1, "seed_delta_ratio_max must be within (0, 1]")
        need(self.seed_delta_wait_s >= 0, "seed_delta_wait_s must be >= 0")
        need(isinstance(self.model_secret, str) and len(self.model_secret) <= 4096,
             "model_secret must be a str of at most 4096 characters")

    @property
    def pulse_hold_max_s(self) -> float:
        """The longest a pulse is held: ``pulse_hold_s``, and with local no-op answers
        (``noop_staleness_s`` > 0) at most ``noop_staleness_s - 2 * heartbeat_interval_s``, so that
        an idle handle hears from its server before what it knows of the versions goes stale."""
        if self.noop_staleness_s <= 0:
            return self.pulse_hold_s
        # Under 2 intervals: no holding (a pulse per interval); local answers then need a bound
        # above one interval to happen at all.
        return min(self.pulse_hold_s, max(0.0, self.noop_staleness_s - 2 * self.heartbeat_interval_s))

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> "Config":
        """Defaults, then ``TENSORHUB_<FIELD>`` variables, then explicit ``overrides``."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f"TENSORHUB_{f.name.upper()}")
            if raw is None:
                continue
            values[f.name] = _parse(f.name, f.type, raw)
        values.update(overrides)
        return cls(**values)


def _parse(name: str, type_name: Any, raw: str) -> Any:
    t = type_name if isinstance(type_name, str) else getattr(type_name, "__name__", str(type_name))
    try:
        if t == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if t == "int":
            return int(raw)
        if t == "float":
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"TENSORHUB_{name.upper()}={raw!r} is not a valid {t}") from None
