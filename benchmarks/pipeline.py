"""One holder, N readers: compiled-graph pipeline vs pull-path pipeline vs no pipeline.

    python benchmarks/pipeline.py --json [--bytes 256MiB] [--ns 1,2,4,8] [--batches 8] [--plot benchmarks/pipeline.png]

For each N (readers = the first N of 8 ReplicaActors; one trainer publishes a fresh version
before every measured run):

  graph  ``tensorhub.graphs.replicate_group(path="graph")`` with the graph for this topology
         already compiled (the run before it compiled it; that run's compile time is reported).
  pull   plain concurrent ``update("latest")`` on every reader: the core chains them
         (trainer -> r0 -> r1 ...) and each reads its partial upstream by polling its counter.
  none   no pipeline: every reader reads straight from the trainer's registered tensors through
         the transport (``tx.pull`` from the trainer's endpoint, all N at once), bypassing the
         scheduler (so ``readers_per_source_max`` does not serialise them). The server is not
         told; the readers are unpublished first and their regions reset afterwards.

``total_s``: from asking until the last reader has the version. ``stall_s_mean``: per reader,
from asking (the driver's start of the round) until that reader has the version, averaged.
Human lines go to stderr, with a live progress display when it is a terminal (not with
``--json``); the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

import ray

from benchmarks.bench_actors import BenchReplica, parse_bytes
from tensorhub import progress
from tensorhub.graphs import GraphCache, replicate_group
from tensorhub.testing import workload

log = logging.getLogger("benchmarks.pipeline")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=parse_bytes, default=256 << 20)
    ap.add_argument("--ns", default="1,2,4,8")
    ap.add_argument("--unit-bytes", type=parse_bytes, default=8 << 20)
    ap.add_argument("--batches", type=int, default=None, help="graph batches per read (default: one per unit)")
    ap.add_argument("--max-inflight", type=int, default=4)
    ap.add_argument("--json", action="store_true", help="no live progress (the JSON line is printed either way)")
    ap.add_argument("--plot", default="", help="write a PNG of last-reader time against N here (matplotlib)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    ns = [int(x) for x in args.ns.split(",")]
    ray.init(num_cpus=32, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": _REPO}},
             namespace=f"tensorhub-bench-pipeline-{int(time.time())}")
    model = "bench-pipeline"
    spec = workload.transformer_spec(args.bytes, layers=8)
    cfg = dict(unit_bytes=args.unit_bytes, checksums=True, lease_timeout_s=60.0, heartbeat_interval_s=1.0)
    Actor = ray.remote(num_cpus=0)(BenchReplica)
    names = ["trainer"] + [f"r{i}" for i in range(max(ns))]
    t = time.perf_counter()
    actors = [Actor.options(name=f"tensorhub-replica-{model}-{n}").remote(model, spec, config=cfg) for n in names]
    ray.get([a.ping.remote() for a in actors])
    trainer, readers = actors[0], actors[1:]
    print(f"spawned {len(actors)} actors in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    cache = GraphCache(max_inflight=args.max_inflight)
    version = [0]

    def publish() -> tuple[int, str]:
        version[0] += 1
        return version[0], ray.get(trainer.publish.remote(version[0]))

    def run(path: str, group) -> dict:
        v, d = publish()
        t_ask = time.time()
        t0 = time.perf_counter()
        extra = {}
        if path == "none":
            ep = ray.get(trainer.endpoint.remote())
            outs = ray.get([r.direct_pull.remote(ep, v) for r in group])
            done = [o[0] for o in outs]
            digests = [o[1] for o in outs]
        elif path == "pull":
            outs = ray.get([r.update.remote("latest") for r in group])
            done = [o["done_at"] for o in outs]
            digests = [o["digest"] for o in outs]
        else:
            res = replicate_group(group, "latest", path="graph", batches=args.batches, cache=cache)
            if res.path != "graph":
                raise RuntimeError(f"graph path failed: {res.error}")
            done = [s["done_at"] for s in res.per_member]
            digests = ray.get([r.digest.remote() for r in group])
            extra = {"compiled": res.compiled, "compile_s": res.compile_s}
        total = time.perf_counter() - t0
        if digests != [d] * len(group):
            raise RuntimeError(f"{path} n={len(group)}: bytes differ")
        stalls = [x - t_ask for x in done]
        out = {"n": len(group), "path": path, "total_s": round(total, 4),
               "stall_s_mean": round(statistics.mean(stalls), 4), **extra}
        print(f"n={len(group)} {path:5s} total {total:.3f}s stall mean {out['stall_s_mean']:.3f}s {extra}",
              file=sys.stderr)
        return out

    results, compile_s, cached_s = [], {}, {}
    with progress.live(json_mode=args.json) as bar:
        task = bar.add_task("runs", total=4 * len(ns))

        def step(path: str, group, what: str) -> dict:
            bar.update(task, description=f"n={len(group)} {what}")
            out = run(path, group)
            bar.advance(task)
            return out

        for n in ns:
            group = readers[:n]
            results.append(step("none", group, "none"))
            results.append(step("pull", group, "pull"))
            first = step("graph", group, "graph (compiling)")  # compiles on first sight of this topology
            compile_s[n] = round(first["compile_s"], 4)
            g = step("graph", group, "graph (cached)")  # the cached graph: what every later version costs
            cached_s[n] = g["total_s"]
            results.append({k: g[k] for k in ("n", "path", "total_s", "stall_s_mean")})
            for r in results[-3:]:
                r.pop("compiled", None), r.pop("compile_s", None)
    cache.clear()
    ray.get([a.close.remote() for a in actors])
    by = {(r["n"], r["path"]): r["total_s"] for r in results}
    winners = {n: min(("graph", "pull", "none"), key=lambda p: by[(n, p)]) for n in ns}
    summary = {
        "name": "pipeline", "bytes": args.bytes, "unit_bytes": args.unit_bytes, "batches": args.batches,
        "max_inflight": args.max_inflight, "results": results,
        "compile_s": compile_s[max(ns)], "compile_s_by_n": compile_s,
        "cached_graph_s": cached_s[max(ns)], "cached_graph_s_by_n": cached_s,
        "winner_by_n": winners,
        "graph_over_pull": {n: round(by[(n, "graph")] / by[(n, "pull")], 3) for n in ns},
        "none_over_pull": {n: round(by[(n, "none")] / by[(n, "pull")], 3) for n in ns},
    }
    if args.plot:
        from benchmarks.plots import plot_pipeline

        plot_pipeline(summary, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
