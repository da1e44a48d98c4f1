"""The paper's three headline comparisons, at paper scale, in the simulator.

TensorHub's side of every comparison is the shipped protocol: the real :class:`ReferenceCore`
(scheduler, pipeline, transactions, smart skipping, offload seeding) and the real handle machine,
driven by the simulator's clients over its network model (:mod:`tensorhub.sim.network`: FIFO
full-duplex NICs, a shared inter-datacenter link). Each baseline is modelled from what the paper
notes say it does (``../shared/reference/000_*.txt``, sections 5.1-5.6), with that system's own
measured bandwidth:

1. ``standalone``: a mocked 1T model (16 shards of 66 GB) on 1024 GPUs: 48 co-located replicas
   (trainer and rollout time-share GPUs, so they hold the new weights locally) and 16 standalone
   rollout replicas that update at once. TensorHub: the co-located replicas publish (a
   reference), the standalone ones replicate over RDMA (22 GB/s per GPU, the paper's measured
   1:1 rate). Baseline: an NCCL broadcast to the standalone ranks behind the Ray driver's global
   barrier, which stalls all 1024 GPUs for the broadcast: ``shard / 18.8 GB/s`` (NCCL's measured
   rate; a pipelined ring broadcast costs about one transfer whatever the rank count) plus the
   wait for the last rank to arrive (``straggler_s``; 0 by default: no straggler). Closed form, not
   simulated. Metric: total GPU stall of one weight update.
2. ``elastic``: a 260B model (8 shards of 34 GB), one trainer replica, 1 standalone + 3 elastic
   (spot) rollout replicas = 8 + 24 GPUs, all updating at once. TensorHub: the real scheduler
   (pipeline, least loaded). Baseline: UCX point-to-point reads (18.1 GB/s) in the paper's flow
   (its Figure 10): the standalone replica reads from the trainer, the elastic ones then read from
   the standalone replica once it is complete, any number per source. Simulated on the same
   network with :class:`StaticSources` (the core restricted to that static plan). Metric: update
   latency of the slowest GPU (the paper's 4.8x is 7.2 s / 1.5 s of its per-GPU CDF).
3. ``crossdc``: a 9B model (2 shards of 10 GB), the trainer in dc0, 4 rollout replicas (8 GPUs)
   in dc1, several steps: the trainer publishes a version every ``step_s``, every rollout calls
   ``update("latest")`` ``lag_s`` later. One cross-datacenter TCP link of 80 GB / 7.8 s =
   10.3 GB/s (what the paper's UCX baseline got out of the shared 200 Gbit/s VPC NIC); RDMA inside
   dc1; host memory at PCIe 48 GB/s. TensorHub: smart skipping + offload seeding. Baseline: every
   replica reads across from the trainer (per-replica transfer): StaticSources, no skipping, no
   seeding. Metric: total rollout GPU stall per step.

What the simulator does not do by itself, modelled here explicitly:

- Offload seeding: simulated clients ignore ``SeedAhead``. :class:`SeedingClient` does what
  ``Staging.seed_asked`` / ``Hub.prefetch`` do: open a staging handle on the same host (replica
  ``<replica>~prefetch``, ``stage_for`` the handle) and ``update`` it to the version in the
  background. Its memory is host memory: a copy into the GPU goes at ``pcie_GBps``.
- There is no GPU compute model: generation and training take no time beyond ``step_s``; a GPU
  "stalls" exactly while its replica's update (all shards) is in progress, and a co-located
  replica holds its trainer's weights locally (stall 0 in both systems).
- Units are larger than the product's (:data:`UNITS` per shard: 39-258 MB instead of 16 MiB) so
  that a run takes seconds; a pipeline hop therefore lags one larger unit.
- The network: each GPU is a simulated host with its own RDMA NIC share at ``rdma_GBps`` (the
  paper's nodes have 4x400 Gbit/s for 8 GPUs); the staging copy of offload seeding sits in the
  seeder's host memory behind the seeder's NIC (copies into the seeder's GPU go at PCIe speed).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from tensorhub.config import Config
from tensorhub.core.reading import Reading
from tensorhub.core.reference import ReferenceCore
from tensorhub.core.state import NodeState
from tensorhub.sim.client import SimClient
from tensorhub.sim.scenario import Params, World
from tensorhub.sim.seeding import SeedingClient

GB = 1e9
UNITS = 256
"""Units per shard: the product's ``unit_count_target``. The product also caps a unit at
``unit_bytes`` (16 MiB), which at these sizes would be 600-4,000 units per shard; the simulation
keeps 256 (39-258 MB units) so a run takes seconds."""
PAPER_RATIO = {"standalone": 6.7, "elastic": 4.8, "crossdc": 19.0}
"""The paper's headline numbers (notes section 5.6)."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Rates from the paper's notes (section 5.1-5.5)."""

    rdma_GBps: float = 22.0
    """TensorHub 1:1 RDMA, measured (50 GB shard in 2.2 s; 25 GB/s per GPU in theory)."""
    nccl_GBps: float = 18.8
    """NCCL 1:1, measured."""
    ucx_GBps: float = 18.1
    """UCX 1:1, measured."""
    tcp_GBps: float = 80 / 7.8
    """Cross-datacenter TCP over the shared 200 Gbit/s VPC NIC: 80 GB/step in 7.8 s (UCX baseline)."""
    tcp_latency_s: float = 0.005
    pcie_GBps: float = 48.0
    """Host memory <-> GPU."""
    nccl_chunk_bytes: int = 4 << 20
    """Pipelining chunk of a ring broadcast: each extra rank adds one chunk time."""


HW = Hardware()


class StaticSources(ReferenceCore):
    """Baseline scheduler for transfers a driver plans statically (point-to-point UCX reads):
    a reader of replica ``r`` reads only from complete copies held by the replicas
    ``plan[r]`` names, any number of readers per source (the config sets that)."""

    def __init__(self, config: Config, plan: dict[str, set[str]]) -> None:
        super().__init__(config)
        self.reading.__class__ = _StaticReading
        self.reading.plan = plan


class _StaticReading(Reading):
    plan: dict[str, set[str]]

    def downstream(self, node):
        out = super().downstream(node)
        allowed = self.plan.get(node.replica_id)
        for i in self.table.groups.get(node.key, ()):
            n = self.table.nodes[i]
            if n.state is NodeState.READING or (allowed is not None and n.replica_id not in allowed):
                out.add(i)
        return out


# ---------------------------------------------------------------------- building blocks

def _world(*, shard_bytes: float, units: int, nic_GBps: float, hw: Hardware, config: Config,
           core_factory=None, clients_max: int, seed: int) -> World:
    params = Params(workload="whatif", units=units, unit_bytes=int(shard_bytes / units), nic_bw=nic_GBps * GB,
                    host_bw=hw.pcie_GBps * GB, dc_bw=hw.tcp_GBps * GB, dc_latency_s=hw.tcp_latency_s,
                    max_clients=clients_max, active_s=0.0)
    return World(seed, params=params, config=config, core_factory=core_factory, faults=False)


def _config(**kw) -> Config:
    # Protocol defaults (heartbeats, pipeline, retention, skipping, seeding); only the timeouts
    # are opened up so that a slow baseline is measured, not failed.
    return Config(request_timeout_s=1e5, source_stall_timeout_s=1e4, lease_timeout_s=1e5, **kw)


def _replica(w: World, rid: str, shards: int, dc: str, role: str, *, spot: bool = False,
             cls: type = SimClient, **extra) -> list[SimClient]:
    out = []
    for s in range(shards):
        host = w.add_host(dc)
        w.net.hosts[host].local.bw = w.params.host_bw  # a same-host copy is host memory <-> GPU
        cid = f"{rid}/s{s}"
        c = cls(w, cid, replica_id=rid, shard=s, num_shards=shards, host=host, dc=dc, spot=spot, role=role, **extra)
        w.clients[cid] = c
        out.append(c)
    return out


def _all(clients: list[SimClient], start: Callable[[SimClient, Callable[[str, int], None]], None],
         then: Callable[[dict], None]) -> None:
    """Start ``start(c, cb)`` on every client now; ``then({cid: (code, version, seconds)})`` once all ended."""
    w = clients[0].world
    t0 = w.sim.now
    res: dict[str, tuple[str, int, float]] = {}

    def one(c: SimClient) -> Callable[[str, int], None]:
        def cb(code: str, v: int) -> None:
            res[c.cid] = (code, v, w.sim.now - t0)
            if len(res) == len(clients):
                then(res)
        return cb

    for c in clients:
        start(c, one(c))


def _register_all(w: World, clients: list[SimClient], then: Callable[[], None]) -> None:
    _all(clients, lambda c, cb: c.register(cb), lambda _res: then())


def _publish(c: SimClient, v: int, cb) -> None:
    """The trainer's step: unpublish the last version (drains its readers), write, publish."""
    def write_publish(*_a) -> None:
        c.write_version(v)
        c.publish(v, cb)
    if c.published is not None:
        c.unpublish(lambda code, _v: (c.mutate(), write_publish()))
    else:
        write_publish()


def _replica_stalls(res: dict, replicas: list[list[SimClient]]) -> list[float]:
    """Per GPU: its replica's update time (all shards; a model-parallel group runs in step)."""
    out = []
    for rep in replicas:
        t = max(res[c.cid][2] for c in rep)
        out += [t] * len(rep)
    return out


def _check(w: World, res: dict, what: str) -> None:
    bad = {cid: r[0] for cid, r in res.items() if r[0] != "ok"}
    if bad:
        raise RuntimeError(f"{what}: calls failed in the simulation: {bad}")


def _update_round(w: World, replicas: list[list[SimClient]], spec, rnd: int, then: Callable[[dict], None]) -> None:
    clients = [c for rep in replicas for c in rep]
    _all(clients, lambda c, cb: c.replicate(spec, True, cb, round=rnd if c.num_shards > 1 else None), then)


# ---------------------------------------------------------------------- 1. standalone vs NCCL

def standalone(*, colocated: int = 48, standalone: int = 16, shards: int = 16, shard_GB: float = 66.0,
               units: int = UNITS, straggler_s: float = 0.0, hw: Hardware = HW, seed: int = 0) -> dict:
    """One weight update of ``colocated + standalone`` replicas of ``shards`` GPUs each."""
    shard_bytes = shard_GB * GB
    gpus = (colocated + standalone) * shards
    w = _world(shard_bytes=shard_bytes, units=units, nic_GBps=hw.rdma_GBps, hw=hw, config=_config(),
               clients_max=gpus, seed=seed)
    trainers = [_replica(w, f"colo{i}", shards, "dc0", "trainer") for i in range(colocated)]
    rollouts = [_replica(w, f"alone{i}", shards, "dc0", "rollout") for i in range(standalone)]
    out: dict = {}

    def updated(res: dict) -> None:
        _check(w, res, "standalone")
        out["rollout"] = _replica_stalls(res, rollouts)
        w.sim.stopped = True

    def published(res: dict) -> None:
        _check(w, res, "standalone publish")
        out["publish"] = [r[2] for r in res.values()]
        _update_round(w, rollouts, 1, 1, updated)

    flat_trainers = [c for rep in trainers for c in rep]
    _register_all(w, flat_trainers + [c for rep in rollouts for c in rep],
                  lambda: _all(flat_trainers, lambda c, cb: _publish(c, 1, cb), published))
    w.sim.run(1e4)
    assert "rollout" in out, "standalone: the update did not finish"
    th = sum(out["publish"]) + sum(out["rollout"])
    bcast_s = shard_bytes / (hw.nccl_GBps * GB) + (standalone - 1) * hw.nccl_chunk_bytes / (hw.nccl_GBps * GB)
    base = gpus * (bcast_s + straggler_s / 2)
    return _row("standalone", th, base, "total GPU stall of one update (s)", {
        "gpus": gpus, "standalone_gpus": standalone * shards, "shard_GB": shard_GB, "units_per_shard": units,
        "tensorhub_mean_standalone_stall_s": round(sum(out["rollout"]) / len(out["rollout"]), 3),
        "tensorhub_max_standalone_stall_s": round(max(out["rollout"]), 3),
        "tensorhub_trainer_stall_s": round(sum(out["publish"]), 3),
        "ideal_transfer_s": round(shard_bytes / (25 * GB), 3),
        "baseline_per_gpu_stall_s": round(bcast_s + straggler_s / 2, 3), "straggler_s": straggler_s,
        "events": w.sim.events, "violations": len(w.checker.violations),
    })


# ---------------------------------------------------------------------- 2. elastic vs UCX

def _elastic_run(*, shards: int, shard_bytes: float, units: int, standalone: int, elastic: int,
                 nic_GBps: float, hw: Hardware, baseline: bool, seed: int) -> tuple[list[float], World]:
    names = ["trainer"] + [f"alone{i}" for i in range(standalone)] + [f"spot{i}" for i in range(elastic)]
    plan = {n: ({"trainer"} if n.startswith("alone") else {f"alone{i}" for i in range(standalone)})
            for n in names[1:]}
    cfg = _config(readers_per_source_max=1 << 20) if baseline else _config()
    w = _world(shard_bytes=shard_bytes, units=units, nic_GBps=nic_GBps, hw=hw, config=cfg,
               core_factory=(lambda c: StaticSources(c, plan)) if baseline else None,
               clients_max=(1 + standalone + elastic) * shards, seed=seed)
    trainer = _replica(w, "trainer", shards, "dc0", "trainer")
    rollouts = ([_replica(w, f"alone{i}", shards, "dc0", "rollout") for i in range(standalone)]
                + [_replica(w, f"spot{i}", shards, "dc0", "rollout", spot=True) for i in range(elastic)])
    out: dict = {}

    def updated(res: dict) -> None:
        _check(w, res, "elastic")
        out["rollout"] = _replica_stalls(res, rollouts)
        w.sim.stopped = True

    _register_all(w, trainer + [c for rep in rollouts for c in rep],
                  lambda: _all(trainer, lambda c, cb: _publish(c, 1, cb),
                               lambda _r: _update_round(w, rollouts, 1, 1, updated)))
    w.sim.run(1e4)
    assert "rollout" in out, "elastic: the update did not finish"
    return out["rollout"], w


def elastic(*, shards: int = 8, shard_GB: float = 34.0, units: int = UNITS, standalone: int = 1, elastic: int = 3,
            hw: Hardware = HW, seed: int = 0) -> dict:
    kw = dict(shards=shards, shard_bytes=shard_GB * GB, units=units, standalone=standalone, elastic=elastic,
              hw=hw, seed=seed)
    th, wt = _elastic_run(nic_GBps=hw.rdma_GBps, baseline=False, **kw)
    ucx, wb = _elastic_run(nic_GBps=hw.ucx_GBps, baseline=True, **kw)
    alone = standalone * shards
    return _row("elastic", max(th), max(ucx), "update latency of the slowest rollout GPU (s)", {
        "gpus": f"{alone}+{elastic * shards}", "shard_GB": shard_GB, "units_per_shard": units,
        "tensorhub_total_stall_s": round(sum(th), 3), "baseline_total_stall_s": round(sum(ucx), 3),
        "baseline_standalone_latency_s": round(max(ucx[:alone]), 3),
        "tensorhub_latency_spread_s": [round(min(th), 3), round(max(th), 3)],
        "events": wt.sim.events + wb.sim.events, "violations": len(wt.checker.violations) + len(wb.checker.violations),
    })


# ---------------------------------------------------------------------- 3. cross-datacenter vs per-replica

WARMUP_STEPS = 2
"""Not counted: step 1 gives every replica its first copy; at step 2 the skipping paths still
hold the newest local version (step 1's), so their first local read of a seeded version is at
step 3, as in every later step."""


def _vpc_nic_path(w: World, crossed: list) -> None:
    """A cross-datacenter transfer reserves the inter-datacenter link only: in the paper's nodes
    TCP goes out through the 200 Gbit/s VPC NIC, which the link stands for, not through the RDMA
    NICs a host's ``tx``/``rx`` model (the simulator's network reserves both, so a slow TCP flow
    would hold an RDMA NIC for its whole length). Counts the bytes that cross in ``crossed[0]``."""
    net, local = w.net, w.net.reserve

    def reserve(src: str, dst: str, nbytes: int) -> float:
        s, r = net.hosts[src], net.hosts[dst]
        if s.dc == r.dc:
            return local(src, dst, nbytes)
        link, latency_s = net.links[(s.dc, r.dc)]
        done = max(w.sim.now, link.free_at) + nbytes / (link.bw / link.factor)
        link.free_at = done
        net.bytes_moved += nbytes
        crossed[0] += nbytes
        return done + latency_s
    net.reserve = reserve


def _crossdc_run(*, mode: str, shards: int, shard_bytes: float, units: int, replicas: int, steps: int,
                 step_s: float, lag_s: float, hw: Hardware, seed: int, staging_own_nic: bool = False) -> dict:
    """``mode``: ``tensorhub`` (skipping + offload seeding), ``skip_only``, ``per_replica``."""
    baseline = mode == "per_replica"
    names = [f"r{i}" for i in range(replicas)]
    if baseline:
        cfg = _config(readers_per_source_max=1 << 20, smart_skipping=False, offload_seeding=False)
        factory = lambda c: StaticSources(c, {n: {"trainer"} for n in names})  # noqa: E731
    else:
        cfg = _config(offload_seeding=mode == "tensorhub")
        factory = None
    w = _world(shard_bytes=shard_bytes, units=units, nic_GBps=hw.rdma_GBps, hw=hw, config=cfg,
               core_factory=factory, clients_max=(1 + 2 * replicas) * shards, seed=seed)
    w.dcs = ["dc0", "dc1"]
    w.net.add_dc_link("dc0", "dc1", w.params.dc_bw, w.params.dc_latency_s)
    crossed = [0]
    _vpc_nic_path(w, crossed)

    trainer = _replica(w, "trainer", shards, "dc0", "trainer")
    rollouts = [_replica(w, n, shards, "dc1", "rollout", cls=SeedingClient, staging_own_nic=staging_own_nic)
                for n in names]
    stalls: list[float] = []
    stale: list[int] = []
    per_step: list[float] = []
    crossed_at: list[int] = []

    def step(k: int) -> None:
        crossed_at.append(crossed[0])
        if k > steps + WARMUP_STEPS:
            w.sim.stopped = True
            return
        w.sim.at(w.sim.now + step_s, step, k + 1)
        _all(trainer, lambda c, cb: _publish(c, k, cb), lambda res: _check(w, res, "crossdc publish"))
        w.sim.after(lag_s, _update_round, w, rollouts, "latest", k, lambda res, k=k: updated(k, res))

    def updated(k: int, res: dict) -> None:
        _check(w, res, f"crossdc {mode}")
        if k <= WARMUP_STEPS:
            return
        s = _replica_stalls(res, rollouts)
        stalls.extend(s)
        per_step.append(sum(s))
        stale.extend(k - v for _code, v, _t in res.values())

    _register_all(w, trainer + [c for rep in rollouts for c in rep], lambda: step(1))
    w.sim.run(1e5)
    seeds = [s for rep in rollouts for c in rep for s in c.seeds]
    n = len(per_step)
    assert n == steps, f"crossdc {mode}: {n} of {steps} steps finished"
    return {
        "stall_per_step_s": sum(per_step) / n,
        "gpu_stalls_s": stalls,
        "mean_staleness": sum(stale) / len(stale),
        "inter_dc_GB_per_step": (crossed_at[-1] - crossed_at[WARMUP_STEPS]) / steps / GB,
        "seeds": len(seeds),
        "events": w.sim.events, "violations": len(w.checker.violations),
    }


def crossdc(*, shards: int = 2, shard_GB: float = 10.0, units: int = UNITS, replicas: int = 4, steps: int = 4,
            step_s: float = 30.0, lag_s: float = 0.5, hw: Hardware = HW, seed: int = 0) -> dict:
    kw = dict(shards=shards, shard_bytes=shard_GB * GB, units=units, replicas=replicas, steps=steps,
              step_s=step_s, lag_s=lag_s, hw=hw, seed=seed)
    runs = {mode: _crossdc_run(mode=mode, **kw) for mode in ("tensorhub", "skip_only", "per_replica")}
    th, skip, base = runs["tensorhub"], runs["skip_only"], runs["per_replica"]
    r = lambda x: round(x, 3)  # noqa: E731
    return _row("crossdc", th["stall_per_step_s"], base["stall_per_step_s"], "total rollout GPU stall per step (s)", {
        "gpus": f"trainer in dc0 + {replicas * shards} in dc1", "shard_GB": shard_GB, "units_per_shard": units,
        "steps": steps, "step_s": step_s, "lag_s": lag_s,
        "skip_only_stall_s": r(skip["stall_per_step_s"]),
        "max_gpu_stall_s": {k: r(max(v["gpu_stalls_s"])) for k, v in runs.items()},
        "mean_staleness": {k: r(v["mean_staleness"]) for k, v in runs.items()},
        "inter_dc_GB_per_step": {k: r(v["inter_dc_GB_per_step"]) for k, v in runs.items()},
        "offload_seeds": th["seeds"],
        "events": sum(v["events"] for v in runs.values()), "violations": sum(v["violations"] for v in runs.values()),
    })


# ---------------------------------------------------------------------- all three

def _row(setting: str, th: float, base: float, metric: str, extra: dict) -> dict:
    return {"setting": setting, "tensorhub_stall_s": round(th, 3), "baseline_stall_s": round(base, 3),
            "ratio": round(base / th, 2) if th > 0 else float("inf"), "paper_ratio": PAPER_RATIO[setting],
            "metric": metric, **extra}


SMALL = {
    "standalone": dict(colocated=6, standalone=2, shards=4, units=16),
    "elastic": dict(shards=2, units=16),
    "crossdc": dict(units=16, steps=2),
}
"""A fast version of each setting (tests): fewer GPUs and units, same rates and sizes."""


def run_paper(small: bool = False, seed: int = 0) -> dict:
    """All three settings; ``small``: the fast version. Returns ``{"results": [...], ...}``."""
    t0 = time.monotonic()
    results = []
    for name, fn in (("standalone", standalone), ("elastic", elastic), ("crossdc", crossdc)):
        t = time.monotonic()
        row = fn(seed=seed, **(SMALL[name] if small else {}))
        row["wall_s"] = round(time.monotonic() - t, 2)
        results.append(row)
    return {"whatif": "paper-small" if small else "paper", "seed": seed, "results": results,
            "seconds": round(time.monotonic() - t0, 2)}
