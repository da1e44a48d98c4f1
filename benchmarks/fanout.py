"""Fan-out of one version to N readers on their own hosts, on an emulated multi-host cluster.

    python benchmarks/fanout.py --json [--gbit 0.1] [--bytes 64MiB] [--ns 1,2,4,8] [--reps 2]
                                [--paths pull,graph,none,rdt,broadcast] [--plot benchmarks/fanout.png]

Builds an emulated cluster (:mod:`tensorhub.emucluster`: one network namespace, raylet and
rate-limited NIC per host; needs root) with the trainer on host 0 and reader i on host i, then
runs itself as the driver (``--driver``). For each N, the first N readers take part; before every
measured run the trainer publishes a fresh version. Paths:

  pull       concurrent ``update("latest")`` on every reader: the server chains them
             (trainer -> r0 -> r1 -> ...) and each reads its upstream as it receives.
  graph      ``tensorhub.graphs.replicate_group(path="graph")``: the same chain as a Ray Compiled
             Graph (compiled once per N before the measured runs; ``compile_s`` reports it).
  none       every reader reads the trainer's registered tensors directly (no pipeline).
  rdt        Ray Direct Transport with NIXL: every reader fetches the trainer's tensors.
  broadcast  ``torch.distributed`` gloo broadcast from the trainer (process group set up
             beforehand, like a persistent NCCL group; one call per tensor).
  pull_live_graph
             ``pull`` while the same group's compiled graph is cached (compiled, idle): what a
             live graph's busy-waiting channel readers cost the bytes that move beside it.

Every run also reports ``cpu_busy``: the machine's non-idle share of CPU time during it
(``/proc/stat``; the emulated hosts share this machine's cores).

Every path verifies bytes (digest of every reader's tensors against the trainer's). ``last_s``:
from the start of the round until the last reader holds the version; ``mean_s``: the mean over
readers. Human lines go to stderr, with a live progress display when it is a terminal (not with
``--json``); the last stdout line is one JSON object with ``link_gbit``,
``bytes``, ``single_s`` (pull at N=1), ``single_line_rate_ratio`` (line-rate time over
``single_s``) and ``results`` (``{n, path, last_s, mean_s, cpu_busy, bytes_ok, runs}``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

from benchmarks.bench_actors import parse_bytes  # noqa: E402 - after the sys.path line

PATHS = ("pull", "graph", "none", "rdt", "broadcast", "pull_live_graph")
GRAPH_PATHS = ("graph", "pull_live_graph")
"""The paths that keep a compiled graph cached: measured last for each N, compiled before their
timed runs and torn down after them."""
MODEL = "bench-fanout"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU of this machine so far (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


# --------------------------------------------------------------------------- the driver


class Bench:
    def __init__(self, args) -> None:
        import ray

        from tensorhub.graphs import GraphCache
        from tensorhub.testing import workload

        from benchmarks.bench_actors import BenchReplica

        self.args = args
        self.ray = ray
        self.spec = workload.transformer_spec(args.bytes, layers=4)
        self.nbytes = workload.spec_bytes(self.spec)
        # versions_retained=1: a reader moving to v+1 never has to offload v (that host copy
        # would be timed too); one reader per source: the pipeline.
        self.cfg = dict(checksums=True, versions_retained=1, lease_timeout_s=60.0, heartbeat_interval_s=1.0,
                        namespace=f"tensorhub-fanout-{int(time.time())}", **args.config)
        Actor = ray.remote(num_cpus=0, enable_tensor_transport=True)(BenchReplica)
        n_max = max(args.ns)
        t = time.perf_counter()
        self.actors = [
            Actor.options(name=f"tensorhub-replica-{MODEL}-{'trainer' if h == 0 else f'r{h - 1}'}",
                          resources={f"host-{h}": 0.01}).remote(
                MODEL, self.spec, replica="trainer" if h == 0 else f"r{h - 1}", config=self.cfg)
            for h in range(n_max + 1)
        ]
        ray.get([a.ping.remote() for a in self.actors])
        self.trainer, self.readers = self.actors[0], self.actors[1:]
        ips = ray.get([a.node_ip.remote() for a in self.actors])
        say(f"{len(self.actors)} actors on hosts {ips} in {time.perf_counter() - t:.1f}s; "
            f"{self.nbytes / 2**20:.1f} MiB, {len(self.spec)} tensors")
        self.trainer_ip = ips[0]
        self.cache = GraphCache()  # keeps depth + 2 executions in flight by itself
        self.version = 0
        self.gloo_n = None

    def publish(self) -> str:
        self.version += 1
        return self.ray.get(self.trainer.publish.remote(self.version))

    def run(self, path: str, n: int) -> dict:
        ray = self.ray
        group = self.readers[:n]
        digest = self.publish()
        v = self.version
        extra = {}
        if path == "broadcast" and self.gloo_n != n:
            port = random.randint(20000, 40000)
            ray.get([a.gloo_init.remote(i, n + 1, self.trainer_ip, port)
                     for i, a in enumerate([self.trainer, *group])])
            self.gloo_n = n
        if path == "rdt":
            ray.get([a.rdt_register.remote() for a in [self.trainer, *group]])
        cpu0 = cpu_times()
        t0 = time.time()
        if path in ("pull", "pull_live_graph"):
            outs = ray.get([r.update.remote(v) for r in group])
            done, digests = [o["done_at"] for o in outs], [o["digest"] for o in outs]
            names = {o["client_id"]: f"r{i}" for i, o in enumerate(outs)}
            extra = {"chain": " ".join(
                f"r{i}<{'/'.join(names.get(s, 'T') for s in o['sources'])}@{o['done_at'] - t0:.2f}"
                for i, o in enumerate(outs))} if n > 1 else {}
        elif path == "graph":
            from tensorhub.graphs import replicate_group

            res = replicate_group(group, v, path="graph", cache=self.cache, where="local", batches=self.args.batches)
            if res.path != "graph":
                raise RuntimeError(f"graph path fell back: {res.error}")
            done = [s["done_at"] for s in res.per_member]
            digests = ray.get([r.digest.remote() for r in group])
            extra = {"compiled": res.compiled, "compile_s": round(res.compile_s, 3)}
        elif path == "none":
            ep = ray.get(self.trainer.endpoint.remote())
            outs = ray.get([r.direct_pull.remote(ep, v) for r in group])
            done, digests = [o[0] for o in outs], [o[1] for o in outs]
        elif path == "rdt":
            outs = ray.get([r.rdt_fetch.remote(self.trainer) for r in group])
            done, digests = [o[0] for o in outs], [o[1] for o in outs]
        elif path == "broadcast":
            outs = ray.get([a.gloo_broadcast.remote() for a in [self.trainer, *group]])[1:]
            done, digests = [o[0] for o in outs], [o[1] for o in outs]
        else:
            raise ValueError(path)
        cpu1 = cpu_times()
        extra["cpu_busy"] = round((cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]), 3)
        ok = digests == [digest] * n
        last, mean = max(done) - t0, statistics.mean(d - t0 for d in done)
        say(f"n={n} {path:9s} last {last:7.3f}s mean {mean:7.3f}s bytes {'ok' if ok else 'DIFFER'} {extra or ''}")
        if not ok:
            raise RuntimeError(f"{path} n={n}: received bytes differ from the trainer's")
        extra.pop("chain", None)
        return {"last_s": last, "mean_s": mean, "bytes_ok": ok, **extra}

    def close(self) -> None:
        self.cache.clear()
        if self.gloo_n is not None:
            self.ray.get([a.gloo_close.remote() for a in self.actors])


def drive(args) -> dict:
    import ray

    from tensorhub import progress

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    ray.init(log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))}})
    bench = Bench(args)
    results = []

    def reps_of(path: str) -> int:
        return args.reps if path == "pull" or path in GRAPH_PATHS else args.baseline_reps

    rounds = len(args.ns) * sum(reps_of(p) + (p in GRAPH_PATHS) for p in args.paths)
    try:
        with progress.live(json_mode=args.quiet) as bar:
            task = bar.add_task("rounds", total=rounds)

            def step(path: str, n: int, what: str) -> dict:
                bar.update(task, description=f"n={n} {what}")
                try:
                    return bench.run(path, n)
                finally:
                    bar.advance(task)

            for n in args.ns:
                # The graph last, and torn down after: a live compiled graph's readers busy-wait on
                # their channels (Ray), which would slow every path measured while it is cached.
                for path in sorted(args.paths, key=lambda p: p in GRAPH_PATHS):
                    reps = reps_of(path)
                    if path in GRAPH_PATHS:
                        try:
                            step("graph", n, "graph (compiling)")  # compiles this topology (not measured)
                        except RuntimeError as e:  # a fallback here is reported, the measured runs decide
                            say(f"n={n} graph compile run: {e}")
                    runs = [step(path, n, f"{path} {i + 1}/{reps}") for i in range(reps)]
                    if path in GRAPH_PATHS:
                        bench.cache.clear()
                    lasts = [r["last_s"] for r in runs]
                    best = min(range(len(runs)), key=lambda i: lasts[i])
                    results.append({"n": n, "path": path, "last_s": round(statistics.median(lasts), 4),
                                    "mean_s": round(statistics.median(r["mean_s"] for r in runs), 4),
                                    "cpu_busy": round(statistics.median(r["cpu_busy"] for r in runs), 3),
                                    "bytes_ok": all(r["bytes_ok"] for r in runs),
                                    "runs": [round(x, 4) for x in lasts], "best_s": round(lasts[best], 4)})
    finally:
        bench.close()
    by = {(r["n"], r["path"]): r for r in results}
    single = by[(1, "pull")]["last_s"] if (1, "pull") in by else None
    line_s = bench.nbytes * 8 / (args.gbit * 1e9)
    out = {
        "name": "fanout", "link_gbit": args.gbit, "bytes": bench.nbytes, "tensors": len(bench.spec),
        "single_s": single, "line_rate_s": round(line_s, 4),
        "single_line_rate_ratio": round(line_s / single, 4) if single else None,
        "results": results,
    }
    n_max = max(args.ns)
    for path in args.paths:
        r = by.get((n_max, path))
        if r and single:
            out[f"{path}_n{n_max}_over_single"] = round(r["last_s"] / single, 3)
    if (n_max, "graph") in by and (n_max, "pull") in by:
        out[f"graph_over_pull_n{n_max}"] = round(by[(n_max, "graph")]["last_s"] / by[(n_max, "pull")]["last_s"], 3)
    return out


# --------------------------------------------------------------------------- the plot


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    paths = sorted({r["path"] for r in summary["results"]}, key=PATHS.index)
    for p in paths:
        rows = sorted((r for r in summary["results"] if r["path"] == p), key=lambda r: r["n"])
        ax.plot([r["n"] for r in rows], [r["last_s"] for r in rows], marker="o", label=p)
    if summary.get("single_s"):
        ax.axhline(1.25 * summary["single_s"], color="grey", ls=":", lw=1, label="1.25 x single")
    ax.set_xlabel("readers N (each on its own host)")
    ax.set_ylabel("time until the last reader holds the version (s)")
    ax.set_title(f"fan-out of {summary['bytes'] / 2**20:.0f} MiB over {summary['link_gbit'] * 1000:.0f} Mbit/s links")
    ax.set_xticks(sorted({r["n"] for r in summary["results"]}))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- main


def _config_overrides(items: list[str], ap: argparse.ArgumentParser) -> dict:
    import dataclasses

    from tensorhub.config import Config, _parse

    fields = {f.name: f for f in dataclasses.fields(Config)}
    out = {}
    for item in items:
        name, _, raw = item.partition("=")
        if name not in fields:
            ap.error(f"--config {item!r}: no Config field {name!r}")
        out[name] = _parse(name, fields[name].type, raw)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbit", type=float, default=0.1, help="every host's NIC, each direction")
    ap.add_argument("--bytes", type=parse_bytes, default=64 << 20)
    ap.add_argument("--ns", default="1,2,4,8")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--reps", type=int, default=2, help="measured runs of pull and graph per N")
    ap.add_argument("--baseline-reps", type=int, default=1, help="measured runs of none/rdt/broadcast per N")
    ap.add_argument("--batches", type=int, default=None, help="graph path: batches per read (default: the library's)")
    ap.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a tensorhub Config field for every actor (repeatable)")
    ap.add_argument("--plot", default="", help="write a PNG of last-reader time against N here")
    ap.add_argument("--json", action="store_true", help="print the JSON summary as the last stdout line")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # inside the cluster
    ap.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # driver: no live progress (--json)
    ap.add_argument("--name", default="thfan", help="emulated cluster name")
    args = ap.parse_args(argv)
    args.ns = [int(x) for x in args.ns.split(",")]
    args.config = _config_overrides(args.config, ap)
    args.paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in args.paths if p not in PATHS]
    if bad:
        ap.error(f"unknown paths {bad}; choose from {PATHS}")

    if args.driver:
        print(json.dumps(drive(args)), flush=True)
        return 0

    from benchmarks import emulated

    hosts = max(args.ns) + 1
    say(f"building an emulated cluster: {hosts} hosts at {args.gbit} Gbit/s")
    summary = emulated.run_driver(__file__, argv, args.json, hosts=hosts, gbit=args.gbit, name=args.name)
    return emulated.report(summary, args.json, plot, args.plot)


if __name__ == "__main__":
    sys.exit(main())
