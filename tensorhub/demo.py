"""``tensorhub demo``: one trainer, several rollouts, several versions, on a local Ray cluster.

The trainer actor publishes a transformer-shaped model (a few hundred tensors) every step;
rollout actors call ``update("latest")`` between simulated generation steps. Per version the
demo prints who read from whom, how long it took and whether the bytes match the trainer's.
With ``--json`` the last stdout line is one JSON summary object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rollouts", type=int, default=4, help="rollout actors (default 4)")
    p.add_argument("--versions", type=int, default=4, help="versions the trainer publishes (default 4)")
    p.add_argument("--size-mb", type=int, default=512, help="model size in MiB (default 512)")
    p.add_argument("--layers", type=int, default=24, help="transformer layers (default 24)")
    p.add_argument("--gen-s", type=float, default=0.2, help="simulated generation time per step")
    p.add_argument("--address", default=None, help="Ray address (default: start an embedded local cluster)")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")


def run(args: argparse.Namespace) -> int:
    import ray

    from tensorhub import progress
    from tensorhub.config import Config
    from tensorhub.testing import workload
    from tensorhub.testing.replica import spawn_many

    if args.rollouts < 1 or args.versions < 1 or args.size_mb < 1:
        print("--rollouts, --versions and --size-mb must be >= 1", file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout
    t_start = time.perf_counter()
    ray.init(address=args.address, namespace="tensorhub-demo", num_cpus=None if args.address else 8,
             include_dashboard=False, log_to_driver=False)
    spec = workload.transformer_spec(args.size_mb << 20, layers=args.layers)
    nbytes = workload.spec_bytes(spec)
    cfg = Config.from_env()
    model = "demo-policy"
    names = ["trainer"] + [f"rollout-{i}" for i in range(args.rollouts)]
    print(f"model {model}: {len(spec)} tensors, {nbytes / 2**20:.0f} MiB; starting {len(names)} actors ...", file=out)
    actors = spawn_many(model, spec, names, config=dataclasses.asdict(cfg))
    trainer, rollouts = actors[0], actors[1:]
    ids = dict(zip(ray.get([a.ping.remote() for a in actors]), names))

    moved = partial_reads = failures = 0
    per_version = []
    bar = progress.live(out, json_mode=args.json)
    for v in range(1, args.versions + 1):
        expected = ray.get(trainer.publish.remote(v))
        t0 = time.perf_counter()
        stats = _gather([r.update.remote("latest") for r in rollouts], names[1:], v, bar)
        wall = time.perf_counter() - t0
        print(f"\nversion {v}: {len(rollouts)} rollouts updated in {wall:.2f}s", file=out)
        print(f"  {'rollout':<12} {'read from':<24} {'call s':>7} {'xfer s':>7} {'GB/s':>6}  checksum", file=out)
        rows = []
        for name, st in zip(names[1:], stats):
            ok = st["digest"] == expected and st["version"] == v
            failures += 0 if ok else 1
            moved += st["bytes"]
            partial_reads += int(st["partial_source"])
            src = " -> ".join(ids.get(s, s.split("#")[0] + " (host)") for s in st["sources"]) or "-"
            tag = " (partial)" if st["partial_source"] else ""
            print(f"  {name:<12} {src + tag:<24} {st['seconds']:>7.3f} {st['transfer_s']:>7.3f} {st['gbps']:>6.2f}  "
                  f"{'ok' if ok else 'MISMATCH'}", file=out)
            rows.append({"rollout": name, "sources": [ids.get(s, s) for s in st["sources"]], "partial": st["partial_source"],
                         "seconds": round(st["seconds"], 4), "transfer_s": round(st["transfer_s"], 4), "gbps": round(st["gbps"], 3), "checksum_ok": ok,
                         "offload_s": round(st["offload_s"], 4), "host_buffers_inline": st["host_buffers_inline"]})
        per_version.append({"version": v, "seconds": round(wall, 4), "reads": rows})
        time.sleep(args.gen_s)  # rollouts generate with version v while the trainer trains v+1

    ray.get([a.close.remote() for a in actors])
    ray.shutdown()
    summary = {
        "versions": args.versions,
        "replicas": args.rollouts,
        "model_bytes": nbytes,
        "tensors": len(spec),
        "bytes_moved": moved,
        "reads_from_partial_holders": partial_reads,
        "checksum_failures": failures,
        "seconds": round(time.perf_counter() - t_start, 2),
        "per_version_s": [pv["seconds"] for pv in per_version],
        "steady_max_over_median": _max_over_median([pv["seconds"] for pv in per_version[1:]]),
        "per_version": per_version,
    }
    print(f"\n{moved / 1e9:.2f} GB moved, {partial_reads} reads from partial holders, "
          f"{failures} checksum failures", file=out)
    if args.json:
        print(json.dumps(summary))
    return 1 if failures else 0


def _gather(refs, names, version, bar):
    """Wait for every rollout's update, advancing ``bar`` (:func:`tensorhub.progress.live`) as
    each one lands. Returns the results in the order of ``refs``."""
    import ray

    done = {}
    with bar:
        task = bar.add_task(f"version {version}: rollouts updated", total=len(refs))
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            done[ready[0]] = ray.get(ready[0])
            bar.update(task, advance=1, description=f"version {version}: {names[refs.index(ready[0])]} updated")
        bar.remove_task(task)  # the next version's display starts with its own line only
    return [done[r] for r in refs]


def _max_over_median(xs: list[float]) -> float | None:
    """The slowest of ``xs`` over their median (versions 2 on: how uneven the steady state is)."""
    if not xs:
        return None
    med = statistics.median(xs)
    return round(max(xs) / med, 3) if med > 0 else None
