"""Rollouts in remote datacenters: TensorHub's seeding, skipping and offload seeding vs per-replica transfers.

    python benchmarks/crossdc.py --json [--dcs 3] [--readers-per-dc 2] [--mib 32] [--versions 5]
                                 [--inter-dc-gbit 0.1] [--density 0.043] [--plot benchmarks/crossdc.png]

Builds an emulated cluster with datacenters (:mod:`tensorhub.emucluster`; needs root): the
trainer alone on datacenter 0, ``--readers-per-dc`` rollouts (one host each) in every other
datacenter; 1 Gbit/s inside a datacenter, one ``--inter-dc-gbit`` link with ``--inter-dc-ms``
one-way latency from datacenter 0 to each other. Then runs itself as the driver. Per path, fresh
actors and a fresh reference server: the trainer publishes ``--versions`` versions, one per
``--step-s``; every rollout loops "generate ``--gen-s``, then ``update("latest")``" meanwhile.
The shard is bf16 (``--dtype``); version 0 is a random fill, and each later version is the one
before it changed as an RL step changes it (``--density`` of the elements by a unit or two in the
last place: :func:`tensorhub.testing.workload.evolve_version`; 0.043 is the measured density at
lr 3e-6, ``benchmarks/RESULTS.md`` "Delta density"). ``--density -1``: a fresh fill per version
(what earlier runs published; no delta compresses it).

Paths (same code, same bytes, different rules):

  tensorhub     one seed per datacenter, started at commit into a staging copy (offload
                seeding), the datacenter's other readers prefetching behind it inside the
                datacenter (``prefetch_in_datacenter``, on by default), smart skipping while it
                crosses, local copies after; the seed crosses as a delta against the seeder's
                previous version where it holds it (``seed_deltas=True``:
                :mod:`tensorhub.handle.deltas`); no-op updates answered locally
                (``noop_staleness_s=NOOP_STALENESS_S``).
  tensorhub_full  the defaults: the same, the seed crossing as the full version, every no-op
                update asking the server.
  no_skipping   the same with ``smart_skipping=False``: an update waits for the seed in flight.
  per_replica   every rollout reads across from the trainer (each is given a datacenter of its
                own, no seeding, no skipping): what per-replica transfers do.

Measured per path: ``stall_s`` (the rollouts' total time blocked in ``update``),
``inter_dc_bytes_per_version`` (bytes that crossed the inter-datacenter links, from their
interface counters, over the versions published), ``delta_ratio`` (that per remote datacenter,
over the shard's bytes: 1.0 is one full copy into each), ``encoded_delta_ratio`` (the median over
the versions published of their delta against the previous version, encoded by the trainer with
:mod:`tensorhub.transport.delta`, over the shard's bytes; null with ``--density -1``),
``mean_staleness`` (per update, how many versions the rollout was behind the newest published
when its update returned), ``server_calls_per_noop`` (calls the rollouts' handles sent the
server per no-op ``update("latest")``, counted on the calling thread:
:meth:`tensorhub.Hub.server_calls`; 0 when every no-op is answered locally; a no-op that smart
skipping answered needs the server and counts), ``local_noops`` (no-ops answered without a call). Human lines go
to stderr (a live progress display on a terminal, not with ``--json``); the last stdout line is
one JSON object: ``dcs``, ``readers_per_dc``, ``shard_bytes``, ``versions``, ``results``
(``{path, stall_s, inter_dc_bytes_per_version, mean_staleness, ...}``) and the goals' ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

PATHS = ("tensorhub", "tensorhub_full", "no_skipping", "per_replica")
NOOP_STALENESS_S = 5.0
"""The ``tensorhub`` path's bound on a local no-op answer (``Config.noop_staleness_s``): the
server pushes each commit at once on the held pulses, held at most 5 - 2 x 0.5 s here."""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _path_config(path: str) -> tuple[dict, bool]:
    if path == "tensorhub":
        return {"seed_deltas": True, "noop_staleness_s": NOOP_STALENESS_S}, False
    if path == "tensorhub_full":
        return {}, False
    if path == "no_skipping":
        return {"smart_skipping": False}, False
    if path == "per_replica":
        return {"smart_skipping": False, "offload_seeding": False, "readers_per_source_max": 64}, True
    raise ValueError(path)


def run_path(args, path: str) -> dict:
    import ray

    from tensorhub.testing import crossdc

    cfg, own_dcs = _path_config(path)
    s = crossdc.Setup(SimpleNamespace(cluster=args.name, mib=args.mib, scenario=f"bench-{path}", dtype=args.dtype),
                      config=cfg, per_dc_names=own_dcs)
    try:
        # Version 0 everywhere first (not measured): connections open, buffers touched.
        ray.get(s.trainer.publish.remote(0))
        crossdc._everyone_at(s, 0, timeout_s=300)
        time.sleep(1.0)
        before = s.crossed()
        duration = args.versions * args.step_s + args.tail_s
        loops = [r.engine_loop.remote(duration, args.gen_s) for r in s.remote]
        density = args.density if args.density >= 0 else None
        published = ray.get(s.trainer.publish_loop.remote(1, args.versions, args.step_s, density))
        records = ray.get(loops)
        after = s.crossed()
    finally:
        s.close()
        for a in s.all:
            ray.kill(a)
    crossed = sum(after[d] - before[d] for d in after)

    def newest_at(t: float) -> int:
        return max([0] + [v for v, tp, _ in published if tp <= t])

    updates = [r for rs in records for r in rs]
    errors = [r for r in updates if not r["ok"]]
    ok = [r for r in updates if r["ok"]]
    staleness = [newest_at(r["t"]) - r["version"] for r in ok]
    noops = [r for r in ok if r["action"] == "noop"]
    last = [rs[-1]["version"] if rs and rs[-1]["ok"] else None for rs in records]
    out = {
        "path": path,
        "stall_s": round(sum(r["wall_s"] for r in updates), 3),
        "stall_per_update_max_s": round(max(r["wall_s"] for r in updates), 3),
        "inter_dc_bytes_per_version": int(crossed / args.versions),
        "delta_ratio": round(crossed / args.versions / (s.nbytes * (args.dcs - 1)), 4),
        "encoded_delta_ratio": (round(statistics.median(n for _, _, n in published) / s.nbytes, 4)
                                if args.density >= 0 else None),
        "mean_staleness": round(statistics.mean(staleness), 3) if staleness else None,
        "server_calls_per_noop": (round(sum(r["server_calls"] for r in noops) / len(noops), 3) if noops else None),
        "local_noops": sum(1 for r in noops if r["server_calls"] == 0), "noops": len(noops),
        "server_calls_per_update": round(sum(r["server_calls"] for r in updates) / len(updates), 3),
        "updates": len(updates), "errors": len(errors),
        "skipped": sum(1 for r in ok if r["skipped_in_flight"] is not None),
        "prefetched": sum(1 for r in ok if r["prefetched"]),
        "cross_reads": sum(1 for r in ok if r["cross_datacenter"] and r["action"] == "replicated"),
        "last_versions": last,
        "publish_span_s": round(published[-1][1] - published[0][1], 2),
        "slowest": [{"reader": i, "t": round(r["t"] - published[0][1], 2), "wall_s": round(r["wall_s"], 2),
                     **{k: r.get(k) for k in ("version", "action", "skipped_in_flight", "prefetched",
                                              "cross_datacenter", "error", "offload_s", "stall_s",
                                              "transfer_s")}, "sources": [x.split("/")[1] for x in r.get("sources") or []]}
                    for i, r in sorted(((i, r) for i, rs in enumerate(records) for r in rs),
                                       key=lambda x: -x[1]["wall_s"])[:6]],
    }
    if args.records:
        with open(args.records, "a") as f:
            for i, rs in enumerate(records):
                for r in rs:
                    f.write(json.dumps({"path": path, "reader": i, "t_rel": round(r["t"] - published[0][1], 3),
                                        **{k: v for k, v in r.items() if k != "t"}}) + "\n")
    say(f"{path:12s} stall {out['stall_s']:7.2f}s (max {out['stall_per_update_max_s']:.2f}s per update), "
        f"{out['inter_dc_bytes_per_version'] / 2**20:6.1f} MiB crossed per version (delta_ratio "
        f"{out['delta_ratio']}, encoded {out['encoded_delta_ratio']}), staleness "
        f"{out['mean_staleness']}, {out['server_calls_per_noop']} server calls per no-op "
        f"({out['local_noops']}/{out['noops']} local), {out['updates']} updates ({out['skipped']} skipped, "
        f"{out['prefetched']} prefetched, {out['cross_reads']} read across, {out['errors']} errors)")
    return out


def drive(args) -> dict:
    import ray

    from tensorhub import progress
    from tensorhub.testing import workload

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    ray.init(log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")])),
        **{k: v for k, v in os.environ.items() if k == "TENSORHUB_LOG"}}})
    shard = workload.spec_bytes(workload.small_spec(args.mib << 20, big=4, tiny=8, dtype=args.dtype))
    results = []
    with progress.live(json_mode=args.quiet) as bar:
        task = bar.add_task("paths", total=len(args.paths))
        for path in args.paths:
            bar.update(task, description=path)
            results.append(run_path(args, path))
            bar.advance(task)
    by = {r["path"]: r for r in results}
    out = {"name": "crossdc", "dcs": args.dcs, "readers_per_dc": args.readers_per_dc, "shard_bytes": shard,
           "versions": args.versions, "inter_dc_gbit": args.inter_dc_gbit, "inter_dc_ms": args.inter_dc_ms,
           "step_s": args.step_s, "gen_s": args.gen_s, "density": args.density, "dtype": args.dtype,
           "results": results}
    if "tensorhub" in by:
        out["tensorhub_bytes_over_one_copy_per_dc"] = by["tensorhub"]["delta_ratio"]
    if "tensorhub_full" in by:
        out["tensorhub_full_bytes_over_one_copy_per_dc"] = by["tensorhub_full"]["delta_ratio"]
    th = by.get("tensorhub", by.get("tensorhub_full"))
    if th is not None:
        if "per_replica" in by and th["stall_s"] > 0:
            out["per_replica_stall_over_tensorhub"] = round(by["per_replica"]["stall_s"] / th["stall_s"], 2)
        if "no_skipping" in by and th["stall_s"] > 0:
            out["no_skipping_stall_over_tensorhub"] = round(by["no_skipping"]["stall_s"] / th["stall_s"], 2)
    return out


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = summary["results"]
    names = [r["path"] for r in res]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, label in ((axes[0], "stall_s", "total stall in update() (s)"),
                           (axes[1], "inter_dc_bytes_per_version", "MiB across datacenters per version"),
                           (axes[2], "mean_staleness", "mean staleness (versions)")):
        vals = [(r[key] or 0) / (2**20 if key == "inter_dc_bytes_per_version" else 1) for r in res]
        ax.bar(names, vals, color=["tab:green", "tab:olive", "tab:orange", "tab:red"][:len(names)])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    if "tensorhub_full" in names or "tensorhub" in names:
        one = summary["shard_bytes"] * (summary["dcs"] - 1) / 2**20
        axes[1].axhline(one, color="k", ls="--", lw=0.8, label="one copy per datacenter")
        axes[1].legend(fontsize=7)
    fig.suptitle(f"{summary['dcs']} datacenters x {summary['readers_per_dc']} rollouts, "
                 f"{summary['shard_bytes'] / 2**20:.0f} MiB, {summary['versions']} versions, "
                 f"{summary['inter_dc_gbit'] * 1000:.0f} Mbit/s + {summary['inter_dc_ms']} ms between datacenters",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dcs", type=int, default=3)
    ap.add_argument("--readers-per-dc", type=int, default=2)
    ap.add_argument("--mib", type=int, default=32, help="shard size (MiB)")
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--step-s", type=float, default=4.0, help="trainer: one version per step")
    ap.add_argument("--gen-s", type=float, default=1.0, help="rollout: a generation step between updates")
    ap.add_argument("--tail-s", type=float, default=10.0, help="rollouts go on this long after the last publish")
    ap.add_argument("--gbit", type=float, default=1.0, help="a host's NIC inside a datacenter")
    ap.add_argument("--inter-dc-gbit", type=float, default=0.1)
    ap.add_argument("--inter-dc-ms", type=float, default=20.0, help="one-way latency between datacenters")
    ap.add_argument("--density", type=float, default=0.043,
                    help="fraction of elements each version changes (-1: a fresh fill per version)")
    ap.add_argument("--dtype", default="bfloat16", help="the shard's dtype")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--records", default="", help="append every update's record here (JSON lines)")
    ap.add_argument("--plot", default="", help="write a PNG of the three measures per path here")
    ap.add_argument("--json", action="store_true", help="print the JSON summary as the last stdout line")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="thxbn", help="emulated cluster name")
    args = ap.parse_args(argv)
    args.paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in args.paths if p not in PATHS]
    if bad:
        ap.error(f"unknown paths {bad}; choose from {PATHS}")
    if args.dcs < 2 or args.readers_per_dc < 1:
        ap.error("--dcs >= 2 and --readers-per-dc >= 1")

    if args.driver:
        print(json.dumps(drive(args)), flush=True)
        return 0

    from benchmarks import emulated

    sizes = [1] + [args.readers_per_dc] * (args.dcs - 1)
    say(f"building an emulated cluster: datacenters {sizes}, {args.gbit} Gbit/s inside, "
        f"{args.inter_dc_gbit} Gbit/s + {args.inter_dc_ms} ms between")
    summary = emulated.run_driver(__file__, argv, args.json, hosts=sum(sizes), datacenters=sizes, gbit=args.gbit,
                                  inter_dc_gbit=args.inter_dc_gbit, inter_dc_latency_ms=args.inter_dc_ms,
                                  name=args.name, subnet="10.75.0.0/16")
    return emulated.report(summary, args.json, plot, args.plot)


if __name__ == "__main__":
    sys.exit(main())
