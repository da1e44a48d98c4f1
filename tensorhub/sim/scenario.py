"""One seeded scenario end to end: build the world, run it, check it.

``run_scenario(seed)`` is a pure function of its arguments: the seed picks the workload (unless
one is forced), its sizes and timings, the protocol config, and the faults. The result carries
a digest of the trace so that replays can be compared.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.sim import faults as faults_mod
from tensorhub.sim.checkers import Checker
from tensorhub.sim.client import FREED, SimClient
from tensorhub.sim.transport import TORN
from tensorhub.sim.loop import Sim
from tensorhub.sim.network import Network
from tensorhub.core.reference import ReferenceCore
from tensorhub.sim.server import CoreFactory, SimServer
from tensorhub.sim.deltas import SimDeltas
from tensorhub.sim.seeding import SeedingClient
from tensorhub.sim.workloads import RolloutDriver, SpotChurn, TrainerDriver
from tensorhub.sim.mixed import ROLLOUT_LAYOUTS, SHARDS, TRAINER_LAYOUTS, MixedModel

WORKLOADS = ("colocated", "standalone", "elastic", "crossdc", "sharded")
"""The workloads a seed picks from when none is forced."""
FORCED_ONLY = ("mixed", "mixed_spot", "mixed_engines", "mixed_unkeyed")
MIXED = FORCED_ONLY
"""The workloads of several layouts (:mod:`tensorhub.sim.mixed`)."""
"""Workloads run only when forced (``--workload mixed``): adding them to the seeds' pick would
change what every existing seed runs (and its digest). ``mixed_spot`` is ``mixed`` plus spot
replicas of the rollout layouts and spot preemptions (a workload of its own, so that ``mixed``
seeds keep their scenarios); ``mixed_engines`` is ``mixed`` whose rollouts of layouts other than
the trainer's register with ``retains=False``, as vLLM engines do: the trainer keeps every
retained version; ``mixed_unkeyed`` is ``mixed`` whose replicas name no layout key, so every
layout class is found by fit, and replicas of one layout whose ranks register interleaved open
classes that the server merges if they have not begun reading (``ReferenceCore._merge_classes``)."""
GiB = 1 << 30
CHECKSUMS_OFF_SHARE = 0.15
"""Of the seeds, about this share run without checksums (readers check by seqlock instead)."""
USER_PREFETCH_SHARE = 0.3
"""Of the standalone seeds, about this share prefetch into staging copies (``Hub.prefetch``)."""
QUIET_GRACE_BEATS = 3
"""The world ends after this many heartbeat intervals of quiet (the end checks run then)."""
STEPPED_SHARE = 0.5
"""Of the seeds, about this share run their sharded rollouts as verl's rollout adapter does
(``World.stepped``; not across datacenters, whose rollouts ask "latest")."""
STEPPED_WAIT_S = (4.0, 12.0)
"""A stepped rollout waits this long (drawn per seed) for its step's version to be published
(verl's ``wait_timeout_s``), asking again after each ``VersionNotFound``."""


@dataclasses.dataclass(frozen=True)
class Params:
    workload: str
    model: str = "policy"
    units: int = 8
    unit_bytes: int = GiB
    nic_bw: float = 10e9
    dc_bw: float = 2e9
    dc_latency_s: float = 0.02
    host_bw: float = 10e9
    num_shards: int = 1
    detect_delay_s: float = 0.5
    poll_s: float = 0.001
    restart_delay_s: float = 2.0
    shard_skew_s: float = 0.2
    hold_s: tuple = (0.5, 3.0)
    train_s: tuple = (0.5, 2.5)
    generate_s: tuple = (0.2, 2.0)
    active_s: float = 20.0
    max_versions: int = 4
    max_clients: int = 12


def make_params(rng: random.Random, workload: Optional[str]) -> Params:
    wl = workload or WORKLOADS[rng.randrange(len(WORKLOADS))]
    shards = {"sharded": rng.randint(2, 4), "colocated": rng.choice([1, 1, 2])}.get(wl, 1)
    return Params(
        workload=wl,
        units=rng.randint(4, 8) if wl == "crossdc" else rng.randint(4, 16),
        nic_bw=rng.uniform(5e9, 25e9),
        dc_bw=rng.uniform(2e9, 6e9),
        dc_latency_s=rng.uniform(0.005, 0.05),
        num_shards=shards,
        detect_delay_s=rng.uniform(0.2, 1.5),
        restart_delay_s=rng.uniform(1.0, 4.0),
        shard_skew_s=rng.uniform(0.0, 1.5) if shards > 1 else 0.0,
        active_s=rng.uniform(12.0, 30.0),
        max_versions=rng.randint(3, 6),
    )


def make_config(rng: random.Random) -> Config:
    return Config(
        heartbeat_interval_s=1.0,
        lease_timeout_s=rng.choice([4.0, 6.0]),
        server_tick_s=0.5,
        source_stall_timeout_s=rng.uniform(4.0, 8.0),
        versions_retained=rng.choice([1, 2, 2, 3]),
        readers_per_source_max=rng.choice([1, 1, 1, 2]),
        reads_in_flight=rng.choice([1, 2, 4]),
        pulse_hold_s=rng.choice([0.0, 3.0, 20.0]),
        noop_staleness_s=rng.choice([0.0, 3.0, 4.0, 10.0]),
    )


@dataclasses.dataclass
class ScenarioResult:
    seed: int
    workload: str
    digest: str
    violations: list
    faults: dict
    completed: int
    failed: dict
    events: int
    sim_seconds: float
    lines: Optional[list] = None
    process_crashes: int = 0
    """Crashes that took a shared process's handles together (``shared_processes``)."""
    known_open: list = dataclasses.field(default_factory=list)
    """Violations of open defects of the shipped code (``tensorhub.sim.known.KNOWN_OPEN``), kept apart."""
    paths: Optional[dict] = None
    """Rare paths taken in this run, with how often (:data:`tensorhub.sim.observer.PATHS`)."""

    @property
    def ok(self) -> bool:
        return not self.violations


class World:
    """Everything one scenario owns; components reach each other through it."""

    def __init__(self, seed: int, workload: Optional[str] = None, core_factory: Optional[CoreFactory] = None,
                 keep_trace: bool = False, params: Optional[Params] = None, config: Optional[Config] = None,
                 faults: bool = True, interrupts: bool = True, shared_processes: bool = False,
                 seed_deltas: bool = False, delta_wrong_base: float = 0.0, delta_check_base: bool = True) -> None:
        self.sim = Sim(seed, keep_trace=keep_trace)
        self.interrupts = interrupts
        self.shared_processes = shared_processes
        """The shards of a replica run in one process: one pulse for all, one fate."""
        self.stats_process_crashes = 0
        rng = self.sim.rng("scenario")
        self.params = params or make_params(rng, workload)
        self.config = config or make_config(rng)
        self.mixed = None
        """The ``mixed`` workload's layouts (:mod:`tensorhub.sim.mixed`); None in the others."""
        self.layout_keys = self.params.workload != "mixed_unkeyed"
        """Replicas of the keyed layouts (``mixed.KEYED``) name them (``Register.layout_key``)."""
        if self.params.workload in MIXED:
            self.mixed = _mixed_model(self.sim.rng("mixed"))
            if params is None:
                self.params = dataclasses.replace(self.params, num_shards=SHARDS[self.mixed.trainer],
                                                  units=self.mixed.units_max())
        # Variants draw from a stream of their own: the other draws of a seed stay as they were.
        var = self.sim.rng("variants")
        self.default_rounds = var.random() < 0.3
        """Sharded rollouts let their handles count rounds (no ``round=``): the default."""
        if config is None and var.random() < 0.08:
            self.config = dataclasses.replace(self.config, request_timeout_s=var.uniform(3.0, 8.0))
        self.scale_down = var.random() < 0.5
        """Elastic: a non-spot replica leaves too (its close may meet ``LastCopyHeld``)."""
        if params is None and self.params.workload == "crossdc" and var.random() < 0.3:
            self.params = dataclasses.replace(self.params, num_shards=2)  # sharded seeding across datacenters
        self.pinned_retry = var.random() < 0.5
        """After an interrupted round, each shard of a sharded replica asks again for the version it
        was reading while its siblings ask "latest" (a round of mixed specs: TransactionMismatch)."""
        # Drawn last, so that every earlier draw of a seed stays as it was.
        if var.random() < CHECKSUMS_OFF_SHARE and config is None:  # a forced config keeps its own
            self.config = dataclasses.replace(self.config, checksums=False)
        self.user_prefetch = var.random() < USER_PREFETCH_SHARE
        """Standalone rollouts call ``prefetch("latest")`` while they generate (drawn after the
        checksums: those seeds stay as they were)."""
        self.double_buffer = (self.sim.rng("double_buffer").random() < 0.5 and self.user_prefetch
                              and self.params.workload == "standalone")
        """The prefetching standalone rollouts registered a double buffer: their prefetches land in it and an update
        swaps to a complete one (``Staging.swap``) instead of copying."""
        steps = self.sim.rng("stepped")  # its own stream: the other draws of a seed stay as they were
        self.stepped = steps.random() < STEPPED_SHARE
        """Sharded rollouts that name their rounds, once they hold the trainer's step, update to its next
        step, a version not published yet, as verl's rollout adapter does (``receive_weights(global_steps)``):
        a shard answered ``VersionNotFound`` asks again in the SAME named round after a short sleep
        (a new call), until the version comes or :attr:`stepped_wait_s` has passed
        (:meth:`~tensorhub.sim.workloads.RolloutDriver._stepped_target`)."""
        self.stepped_wait_s = steps.uniform(*STEPPED_WAIT_S)
        if seed_deltas:
            self.config = dataclasses.replace(self.config, seed_deltas=True)
        self.deltas: Optional[SimDeltas] = (SimDeltas(self, wrong_base=delta_wrong_base, check_base=delta_check_base)
                                            if seed_deltas else None)
        """Seeds as deltas (:mod:`tensorhub.sim.deltas`); None: off, the traces as before."""
        self.net = Network(self.sim, self.sim.rng("net"))
        live = self.sim.rng("liveness")  # its own stream: the other draws of a seed stay as they were
        self.death_report_s: Optional[float] = live.uniform(0.05, 1.0) if live.random() < 0.5 else None
        """Half the scenarios have a cluster manager that reports a crashed process to the server
        after this delay (Ray's liveness, ``ReferenceCore.declare_dead``); the others rely on
        leases and readers' reports alone."""
        self.rng_client = self.sim.rng("clients")
        self.clients: dict[str, SimClient] = {}
        self.trainers: list[TrainerDriver] = []
        self.rollouts: list[RolloutDriver] = []
        self.dcs: list[str] = ["dc0"]
        self.faults: dict[str, int] = {}
        self.faults_injected = False
        self.restart_armed: Optional[float] = None
        self.restart_after_failed: Optional[tuple[float, float]] = None
        """The armed ``restart_after_failed_read``: (delay_s, down_s)."""
        self.broadcast_crash_armed: Optional[tuple[float, float]] = None
        """The armed ``broadcast_shard_crash``: (delay_s, pick)."""
        self.restart_after_moved: Optional[tuple[float, float]] = None
        """The armed ``restart_after_round_moved``: (delay_s, down_s)."""
        """The ``restart_mid_read`` fault is armed: the server's down time when it fires."""
        self.active_end = self.params.active_s
        self.stats_recoveries = self.stats_stalls = self.stats_bad_units = self.stats_scribbles = 0
        self._layouts: dict[int, m.LayoutInfo] = {}
        self._hosts = 0
        self.checker = Checker(self)
        self.server = SimServer(self, self.checker.observer.factory(core_factory or ReferenceCore))
        self.sim.trace(f"scenario {self.params!r} {self.config!r}")
        if self.params.workload != "whatif":
            build_workload(self, self.sim.rng("workload"))
            plan = faults_mod.plan_faults(self, self.sim.rng("faults")) if faults else []
            self.checker.fault_end_s = faults_mod.fault_end(plan, self)
        self.checker.bound_s = self._op_bound()

    def _op_bound(self) -> float:
        p, c = self.params, self.config
        slowest_bw = min(p.nic_bw, p.dc_bw, p.host_bw) / faults_mod.BOUNDS["slow_link.factor"][1]
        data_s = p.units * p.unit_bytes / slowest_bw
        return 10 * c.lease_timeout_s + 2 * data_s + p.max_clients * p.units * p.unit_bytes / min(p.nic_bw, p.dc_bw)

    # ------------------------------------------------------------------ building

    def layout(self, shard: int) -> m.LayoutInfo:
        lay = self._layouts.get(shard)
        if lay is None:
            p = self.params
            lay = self._layouts[shard] = m.LayoutInfo(
                fingerprint=f"sim-{p.model}-{shard}-{p.units}", unit_count=p.units, total_bytes=p.units * p.unit_bytes)
        return lay

    def add_host(self, dc: str) -> str:
        self._hosts += 1
        name = f"h{self._hosts}"
        self.net.add_host(name, dc, self.params.nic_bw)
        return name

    def add_client(self, cid: str, cls: type = SimClient, **kw) -> SimClient:
        c = cls(self, cid, **kw)
        self.clients[cid] = c
        return c

    def clients_alive(self) -> list[SimClient]:
        return [c for _, c in sorted(self.clients.items()) if c.alive]

    # ------------------------------------------------------------------ physical world

    def source_client(self, source_id: str) -> Optional[SimClient]:
        return self.clients.get(source_id.split("#", 1)[0])

    def memory_of(self, a: m.Assignment) -> str:
        """Whose memory a read of assignment ``a`` reaches: the client whose region the
        assigned endpoint names (a host copy: that copy). The source's own, unless the server
        and the handles disagree on who holds which memory (a double buffer's swap)."""
        if "#host" in a.source_id:
            return a.source_id
        c = self.clients.get(a.source_id)
        if c is not None and c.endpoint == a.source_endpoint:
            return a.source_id
        owner = next((c for c in self.clients.values() if c.endpoint == a.source_endpoint), None)
        return owner.cid if owner is not None else a.source_id

    def read_tag(self, rd):
        """What a unit read copies: the source's tag at the end of the read (TORN if the
        source wrote that unit while the read was in flight)."""
        owner = self.source_client(rd.source)
        if owner is None or not owner.alive:
            return TORN
        if "#host" in rd.source:
            copy = owner.host_copies.get(int(rd.source.rsplit("#host", 1)[1]))
            return FREED if copy is None else copy[rd.unit]
        if owner.mem_wtime[rd.unit] > rd.t0:
            return TORN
        return owner.mem[rd.unit]

    def replace_trainer(self) -> bool:
        """The trainer job restarts under a new replica id on new hosts (a resubmitted job) while
        its predecessor's processes hang: no death report, their leases still run."""
        old = next((d for d in self.trainers if not d.gone), None)
        if old is None or old.idle:
            return False
        for c in list(old.members):
            self.crash(c, restart=False, report=False)
        n = len(self.trainers)
        hosts = [self.add_host("dc0") for _ in range(old.num_shards)]
        new = TrainerDriver(self, f"trainer-{n}", hosts, "dc0", False, self.sim.rng(f"trainer-{n}"),
                            max_versions=old.max_versions, layout=old.layout)
        new.version = old.version  # the job resumes from its checkpoint: versions go on
        self.trainers.append(new)
        self.sim.after(self.params.restart_delay_s, new.start)
        return True

    def crash(self, c: SimClient, restart: bool, report: bool = True) -> None:
        owner = getattr(c, "stage_for", None)
        if owner is not None and owner in self.clients:
            c = self.clients[owner]  # a staging handle lives in its owner's process
        proc = c.process
        if proc is not None and proc.alive and c.alive:
            # The process dies: every handle in it, each reported gone (Ray knows the process).
            proc.alive = False
            self.stats_process_crashes += 1
            self.sim.trace(f"crash process {proc.name}: {[x.cid for x in proc.members if x.alive]}")
            for x in list(proc.members):
                self._crash_one(x, restart, report)
            return
        self._crash_one(c, restart, report)

    def _crash_one(self, c: SimClient, restart: bool, report: bool) -> None:
        if not c.alive:
            return
        self.sim.trace(f"crash {c.cid}")
        self.checker.note_loss("crash")
        self.checker.observer.note_crash(c)
        keys = set(c.serves())
        c.die()
        for k in sorted(keys):
            for rd in self.net.reads_from(k):
                rd.dead = True
                self.net.unregister(rd)
        for x in self.clients_alive():
            if x.reading is not None and any(s in keys for s in x.reading.sources):
                x.source_died()
        if self.death_report_s is not None and report:
            self.sim.after(self.death_report_s, self.server.declare_dead, c.cid)
        stage = getattr(c, "stage", None)
        if stage is not None:
            self._crash_one(stage, False, report)  # its staging handle, same process
        if c.driver is not None:
            c.driver.on_crash(c, restart)

    # ------------------------------------------------------------------ running

    def drivers(self):
        return self.trainers + self.rollouts

    def quiet(self) -> bool:
        return (self.server.up and not any(d.busy for d in self.drivers())
                and all(c.op is None for c in self.clients.values() if c.alive)
                and self._all_announced() and self._recovered())

    def _recovered(self) -> bool:
        """The (current) server's recovery window is over. Inside it no drain completes, so a host
        copy past retention that a holder announced after a restart is listed, draining, until
        the window ends (:meth:`~tensorhub.core.retention.Retention.announced_host_copy`): end
        checks run before then would call a copy on its way out a leak (mixed seed 9617: the
        checks ran 0.57 s before the window closed)."""
        recovery = getattr(self.server.core, "recovery", None)
        return recovery is None or self.sim.now >= recovery.until

    def _all_announced(self) -> bool:
        """Every live registered client is known to the (current) server: after a restart an idle
        holder re-announces on its next pulse, which may come seconds later (a failed pulse waits
        ``detect_delay_s`` plus an interval). Until then the server cannot list what it holds, so
        the end checks wait for it (and a client that never comes back is a ``hang``)."""
        nodes = self.server.core.nodes
        return all(c.cid in nodes for c in self.clients.values() if c.alive and c.registered)

    def _watch(self) -> None:
        if self.sim.now >= max(self.active_end, self.checker.fault_end_s) and self.quiet():
            # Quiet for a grace of a few heartbeats: background notes (DropHostCopy) land.
            if self._quiet_since is None:
                self._quiet_since = self.sim.now
            if self.sim.now - self._quiet_since >= QUIET_GRACE_BEATS * self.config.heartbeat_interval_s:
                self.quiesced = True
                self.sim.stopped = True
                return
        else:
            self._quiet_since = None
        self.sim.after(1.0, self._watch)

    def run(self) -> None:
        self.quiesced = False
        self._quiet_since: Optional[float] = None
        for d in self.trainers:
            d.start()
        for d in self.rollouts:
            d.start()
        self.sim.at(self.active_end, self._watch)
        deadline = (max(self.active_end, self.checker.fault_end_s) + self.checker.bound_s + 5.0
                    + QUIET_GRACE_BEATS * self.config.heartbeat_interval_s)
        self.sim.run(deadline)
        self.checker.final(self.quiesced)


def build_workload(w: World, rng: random.Random) -> None:
    p = w.params
    wl = p.workload
    S = p.num_shards
    if wl == "crossdc":
        w.dcs = [f"dc{i}" for i in range(rng.randint(2, 3))]
        for i, a in enumerate(w.dcs):
            for b in w.dcs[i + 1:]:
                w.net.add_dc_link(a, b, p.dc_bw, p.dc_latency_s)
    trainer_hosts = [w.add_host("dc0") for _ in range(S)]
    w.trainers.append(TrainerDriver(w, "trainer", trainer_hosts, "dc0", False, w.sim.rng("trainer"),
                                    max_versions=p.max_versions, layout=w.mixed.trainer if w.mixed else ""))

    # Across datacenters rollouts act on SeedAhead (offload seeding: a staging copy in their
    # process), as the real handle does.
    # A user prefetch is the same staging read: standalone rollouts of some seeds call it.
    cls = SeedingClient if wl == "crossdc" or (wl == "standalone" and w.user_prefetch) else SimClient

    def rollout(name: str, hosts: list[str], dc: str, spot: bool = False) -> None:
        w.rollouts.append(RolloutDriver(w, name, hosts, dc, spot, w.sim.rng(name), client_cls=cls))

    if wl == "standalone":
        for i in range(rng.randint(3, 9)):
            rollout(f"r{i}", [w.add_host("dc0")], "dc0")
    elif wl == "colocated":
        rollout("r0", trainer_hosts, "dc0")  # shares the trainer's GPUs: a local copy
        for i in range(1, 1 + rng.randint(1, max(1, (p.max_clients - 2 * S) // S))):
            rollout(f"r{i}", [w.add_host("dc0") for _ in range(S)], "dc0")
    elif wl == "elastic":
        for i in range(rng.randint(1, 3)):
            rollout(f"r{i}", [w.add_host("dc0")], "dc0")
        for i in range(rng.randint(2, 5)):
            rollout(f"spot{i}", [w.add_host("dc0")], "dc0", spot=True)
        SpotChurn(w, w.sim.rng("churn"), rng.randint(2, 6))
        if w.scale_down:
            fixed = [d for d in w.rollouts if not d.spot]
            down = w.sim.rng("scale-down")
            d = fixed[down.randrange(len(fixed))]
            w.sim.at(down.uniform(4.0, max(5.0, w.active_end - 2.0)), setattr, d, "leaving", True)
    elif wl == "crossdc":
        for dc in w.dcs:
            for i in range(rng.randint(2, 3)):
                rollout(f"r{dc}-{i}", [w.add_host(dc) for _ in range(S)], dc)
    elif wl in MIXED:
        _build_mixed(w, rng, spot=wl == "mixed_spot", engines_retain=wl != "mixed_engines")
    elif wl == "sharded":
        for i in range(rng.randint(1, max(1, min(3, (p.max_clients - S) // S)))):
            rollout(f"r{i}", [w.add_host("dc0") for _ in range(S)], "dc0")
    else:
        raise ValueError(f"unknown workload {wl!r}; known: {', '.join(WORKLOADS + FORCED_ONLY)}")


def _mixed_model(rng: random.Random) -> MixedModel:
    """A trainer layout and one to three rollout layouts, at least one not the trainer's."""
    trainer = TRAINER_LAYOUTS[rng.randrange(len(TRAINER_LAYOUTS))]
    others = [lay for lay in ROLLOUT_LAYOUTS if lay != trainer]
    rng.shuffle(others)
    rollouts = others[:rng.randint(1, 2)]
    if rng.random() < 0.4:
        rollouts.append(trainer)  # a rollout of the trainer's layout: plain reads in its class
    return MixedModel(trainer, tuple(rollouts))


def _build_mixed(w: World, rng: random.Random, spot: bool = False, engines_retain: bool = True) -> None:
    """``mixed``: rollout replicas of the chosen layouts (one or two each, within ``max_clients``),
    their placements putting them in layout classes apart from the trainer's. ``spot``
    (``mixed_spot``): then one spot replica of each rollout layout, within ``max_clients``
    (``spot_preemption`` faults take them; a spot copy of another layout never counts as a
    copy for retention). ``engines_retain`` False (``mixed_engines``): the rollouts of layouts
    other than the trainer's register with ``retains=False`` (vLLM's engines' default)."""
    p, mm = w.params, w.mixed
    used = p.num_shards

    def add(name: str, lay: str, is_spot: bool) -> bool:
        """One replica of ``lay`` on hosts of its own, if ``max_clients`` has room for it."""
        nonlocal used
        n = SHARDS[lay]
        if used + n > p.max_clients:
            return False
        used += n
        w.rollouts.append(RolloutDriver(w, name, [w.add_host("dc0") for _ in range(n)], "dc0", is_spot,
                                        w.sim.rng(name), layout=lay,
                                        retains=engines_retain or lay == mm.trainer))
        return True

    for lay in mm.rollouts:
        for i in range(rng.randint(1, 2)):
            if not add(f"r{lay}-{i}", lay, False):
                break
    for lay in mm.rollouts if spot else ():
        if not add(f"spot{lay}", lay, True):
            break


def run_scenario(seed: int, workload: Optional[str] = None, *, core_factory: Optional[CoreFactory] = None,
                 keep_trace: bool = False, faults: bool = True, interrupts: bool = True,
                 shared_processes: bool = False, **deltas) -> ScenarioResult:
    """Run one seeded scenario and check every invariant. Deterministic in its arguments.
    ``interrupts``: the ``interrupt`` fault may be planned (a user stops a replicate mid-read).
    ``shared_processes``: the shards of each replica share one process (one pulse, one fate)."""
    w = World(seed, workload, core_factory, keep_trace=keep_trace, faults=faults, interrupts=interrupts,
              shared_processes=shared_processes, **deltas)
    w.run()
    w.sim.trace(f"end violations={len(w.checker.violations)} ops={w.checker.completed} failed={sorted(w.checker.failed.items())}")
    return ScenarioResult(
        seed=seed, workload=w.params.workload, digest=w.sim.digest(), violations=list(w.checker.violations),
        faults=dict(w.faults), completed=w.checker.completed, failed=dict(w.checker.failed),
        events=w.sim.events, sim_seconds=w.sim.now, lines=w.sim.lines, process_crashes=w.stats_process_crashes,
        paths=dict(w.checker.observer.paths), known_open=list(w.checker.known_open),
    )
