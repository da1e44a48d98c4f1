"""Failover benchmark in the manner of the TensorHub paper's Figure 7(c).

A pipeline ``holder -> A -> B``: A replicates from the holder, B starts right after and reads
from A (a partial holder). A is killed (``ray.kill``) at times spread over the transfer. We
report B's completion time against the fault time, next to B's time without a fault, and
whether B's bytes match the holder's. Last stdout line: one JSON object with ``no_fault_s``
and ``results`` = [{fault_at_s, b_total_s, b_bytes_ok, b_sources}]. Human lines go to stderr,
with a live progress display when it is a terminal (not with ``--json``).

    python benchmarks/failover.py --json [--bytes N] [--points K] [--plot benchmarks/failover.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bytes", type=int, default=512 << 20)
    ap.add_argument("--points", type=int, default=6, help="fault times spread over the no-fault transfer")
    ap.add_argument("--reps", type=int, default=2, help="no-fault repetitions")
    ap.add_argument("--json", action="store_true", help="no live progress (the JSON line is printed either way)")
    ap.add_argument("--plot", default="", help="write a PNG of B's time against the fault time here (matplotlib)")
    args = ap.parse_args()

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)  # looked up per call: above a live display, if any

    import ray

    from tensorhub import progress
    from tensorhub.testing import workload
    from tensorhub.testing.replica import spawn_many

    ray.init(namespace="tensorhub-bench-failover", num_cpus=8, include_dashboard=False, log_to_driver=False)
    spec = workload.small_spec(args.bytes, big=8, tiny=64)
    # Small units so the reader follows A closely; short heartbeat so a dead A is noticed fast.
    cfg = dict(unit_bytes=8 << 20, heartbeat_interval_s=0.5, lease_timeout_s=5.0, source_stall_timeout_s=2.0,
               server_name="tensorhub-bench-failover")
    (holder,) = spawn_many("fo", spec, ["holder"], config=cfg)
    digest = ray.get(holder.publish.remote(1))
    version = 1

    def one_run(fault_at: float | None, tag: str) -> dict:
        nonlocal version
        a, b = spawn_many("fo", spec, [f"A-{tag}", f"B-{tag}"], config=cfg)
        version += 1
        ray.get(holder.publish.remote(version, False))  # same bytes, new version: A and B must read it
        ra = a.replicate.remote(version)
        time.sleep(0.05)  # B asks second: the holder is busy with A, so B reads from A
        t0 = time.perf_counter()
        rb = b.replicate.remote(version)
        if fault_at is not None:
            time.sleep(fault_at)
            ray.kill(a, no_restart=True)
        st = ray.get(rb)
        total = time.perf_counter() - t0
        if fault_at is None:
            ray.get(ra)
        res = {"b_total_s": round(total, 3), "b_bytes_ok": st["digest"] == digest,
               "b_sources": len(st["sources"]), "b_first_source_partial": st["partial_source"]}
        for actor in (b,) if fault_at is not None else (a, b):
            ray.get(actor.close.remote())
            ray.kill(actor, no_restart=True)
        return res

    with progress.live(json_mode=args.json) as bar:
        task = bar.add_task("runs", total=args.reps + args.points)
        base = []
        for i in range(args.reps):
            bar.update(task, description=f"no fault, run {i + 1}/{args.reps}")
            base.append(one_run(None, f"base{i}"))
            bar.advance(task)
        no_fault = statistics.median(r["b_total_s"] for r in base)
        say(f"no fault: B took {no_fault:.3f}s ({[r['b_total_s'] for r in base]})")
        results = []
        for i in range(args.points):
            fault_at = round(no_fault * i / max(1, args.points - 1), 3)
            bar.update(task, description=f"A killed at {fault_at:.3f}s")
            r = one_run(fault_at, f"f{i}")
            r["fault_at_s"] = fault_at
            results.append(r)
            bar.advance(task)
            say(f"A killed at {fault_at:.3f}s: B took {r['b_total_s']:.3f}s, bytes ok {r['b_bytes_ok']}, "
                f"{r['b_sources']} source(s)")
    ray.get(holder.close.remote())
    ray.shutdown()
    summary = {
        "name": "failover",
        "bytes": workload.spec_bytes(spec),
        "no_fault_s": no_fault,
        "results": results,
        "worst_b_total_s": max(r["b_total_s"] for r in results),
        "all_bytes_ok": all(r["b_bytes_ok"] for r in results + base),
    }
    if args.plot:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from plots import plot_failover

        plot_failover(summary, args.plot)
        say(f"plot written to {args.plot}")
    print(json.dumps(summary))
    return 0 if summary["all_bytes_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
