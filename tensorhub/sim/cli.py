"""``tensorhub simulate``: run seeded scenarios, check invariants, print a summary.

    tensorhub simulate --seeds 500 [--start 0] [--workload NAME] [--json]
    tensorhub simulate --seed 1234 --verbose-trace      # replay one seed, print its trace
    tensorhub simulate --whatif paper [--json]          # the paper's three headline comparisons

With ``--json`` the last stdout line is one JSON object: ``runs``, ``faults`` (injections per
kind), ``violations`` (count; must be 0), ``violation_kinds``, ``requests`` (``completed`` and
``failed`` per error code), ``known_open`` (violations of open defects of the shipped code, by
kind: :data:`tensorhub.sim.known.KNOWN_OPEN`; they do not fail the run), ``paths`` (across how
many seeds each rare path was taken: :data:`tensorhub.sim.observer.PATHS`), ``seconds`` (wall
time), ``seconds_per_seed`` (mean, max), ``digest`` (of all trace digests).
A failing seed prints the command that replays it on stderr. Exit code 1 on any violation.

``--whatif paper`` runs :mod:`tensorhub.sim.whatif_paper` instead (``paper-small``: its fast
version): a table on stdout (stderr with ``--json``), and with ``--json`` a last line
``{"whatif", "seed", "results": [{setting, tensorhub_stall_s, baseline_stall_s, ratio,
paper_ratio, metric, ...}], "seconds"}``. Exit code 1 if an invariant checker saw a violation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from tensorhub.sim.faults import FAULT_KINDS
from tensorhub.sim.observer import PATHS
from tensorhub.sim.scenario import FORCED_ONLY, WORKLOADS, run_scenario


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=100, help="number of seeded scenarios to run")
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--seed", type=int, default=None, help="replay exactly this seed")
    parser.add_argument("--workload", choices=WORKLOADS + FORCED_ONLY, default=None, help="force one workload")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    parser.add_argument("--verbose-trace", action="store_true", help="print every trace line (stderr)")
    parser.add_argument("--whatif", choices=("paper", "paper-small"), default=None,
                        help="run the paper's three headline comparisons at paper scale (or small)")
    parser.add_argument("--shared-processes", action="store_true",
                        help="the shards of each replica share one process (one pulse, one fate)")
    parser.add_argument("--no-interrupts", action="store_true",
                        help="never inject the interrupt fault (a user stops a replicate mid-read)")


def _replay_cmd(seed: int, workload) -> str:
    w = f" --workload {workload}" if workload else ""
    return f"PYTHONPATH=. python -m tensorhub.cli simulate --seed {seed}{w} --verbose-trace"


def run_whatif(args: argparse.Namespace) -> int:
    from tensorhub.sim.whatif_paper import run_paper

    seed = args.seed if args.seed is not None else 0
    out = run_paper(small=args.whatif == "paper-small", seed=seed)
    table = sys.stderr if args.json else sys.stdout
    print(f"{'setting':<11} {'tensorhub_s':>12} {'baseline_s':>11} {'ratio':>6} {'paper':>6}  metric", file=table)
    for r in out["results"]:
        print(f"{r['setting']:<11} {r['tensorhub_stall_s']:>12.3f} {r['baseline_stall_s']:>11.3f} "
              f"{r['ratio']:>6.2f} {r['paper_ratio']:>6.1f}  {r['metric']}", file=table)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 1 if any(r["violations"] for r in out["results"]) else 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "whatif", None):
        return run_whatif(args)
    seeds = [args.seed] if args.seed is not None else list(range(args.start, args.start + args.seeds))
    t0 = time.monotonic()
    faults = {k: 0 for k in FAULT_KINDS}
    failed: dict[str, int] = {}
    kinds: dict[str, int] = {}
    completed = violations = 0
    known: dict[str, int] = {}
    paths = {p: 0 for p in PATHS}
    per_seed_s: list[float] = []
    digest = hashlib.blake2b(digest_size=16)
    for seed in seeds:
        t_seed = time.monotonic()
        res = run_scenario(seed, args.workload, keep_trace=args.verbose_trace, interrupts=not args.no_interrupts,
                           shared_processes=args.shared_processes)
        per_seed_s.append(time.monotonic() - t_seed)
        digest.update(res.digest.encode())
        for p, n in (res.paths or {}).items():
            if n:
                paths[p] = paths.get(p, 0) + 1
        for kind, t, msg in res.known_open:
            known[kind] = known.get(kind, 0) + 1
            if args.seed is not None:
                print(f"seed {seed} ({res.workload}) t={t:.3f}s KNOWN {kind}: {msg}", file=sys.stderr)
        if res.lines is not None:
            for line in res.lines:
                print(line, file=sys.stderr)
        for k, n in res.faults.items():
            faults[k] = faults.get(k, 0) + n
        for k, n in res.failed.items():
            failed[k] = failed.get(k, 0) + n
        completed += res.completed
        if res.violations:
            violations += len(res.violations)
            for kind, t, msg in res.violations:
                kinds[kind] = kinds.get(kind, 0) + 1
                print(f"seed {seed} ({res.workload}) t={t:.3f}s VIOLATION {kind}: {msg}", file=sys.stderr)
            print(f"replay: {_replay_cmd(seed, args.workload)}", file=sys.stderr)
        if args.seed is not None and not args.json:
            print(f"seed {seed} workload={res.workload} digest={res.digest} events={res.events} "
                  f"sim_seconds={res.sim_seconds:.1f} faults={res.faults} violations={len(res.violations)}")
    summary = {
        "runs": len(seeds),
        "faults": faults,
        "violations": violations,
        "violation_kinds": kinds,
        "requests": {"completed": completed, "failed": dict(sorted(failed.items()))},
        "known_open": known,
        "paths": paths,
        "seconds": round(time.monotonic() - t0, 3),
        "seconds_per_seed": {"mean": round(sum(per_seed_s) / max(1, len(per_seed_s)), 4),
                             "max": round(max(per_seed_s, default=0.0), 4)},
        "digest": digest.hexdigest(),
    }
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(f"{summary['runs']} runs, {violations} violations, faults {faults}, "
              f"requests ok={completed} failed={summary['requests']['failed']}, {summary['seconds']}s")
    return 1 if violations else 0
