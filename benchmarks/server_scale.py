"""What one reference server costs per client, at 100 to 10,000 clients of one model.

Core part (no Ray): ``ReferenceCore.handle`` driven directly, one model, one trainer holding
version 1, N single-shard readers. Per N, microseconds per operation, averaged over the N
operations of one round (so a cost that grows with the table shows as growth with N), median
of ``--reps`` rounds:

- ``Register``: N readers register one after another (the table grows from 1 to N + 1);
- ``Replicate``: every reader asks for ``"latest"`` (a storm; with the default
  ``readers_per_source_max = 1`` they form the pipeline ``trainer -> r1 -> r2 -> ... -> rN``);
- ``ReplicateDone``: every reader finishes, in pipeline order;
- ``Heartbeat+tick``: one reader's heartbeat followed by one ``tick`` (lease expiry), for
  ``min(N, 2000)`` readers.

Ray part (``--ray``, see ``ray_part``): load-generator processes send raw protocol messages to
a real ``ReferenceServer`` actor standing in for 10,000 clients at the default config.

Last stdout line: one JSON object, ``core_us`` = {op: {N: microseconds}} (and, with ``--ray``,
``steady_busy_fraction_10k`` and ``storm_10k_s``). Human lines go to stderr.

    python benchmarks/server_scale.py --json [--sizes 100,1000,10000] [--ray]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

OPS = ("Register", "Replicate", "ReplicateDone", "Heartbeat+tick")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def core_round(n: int) -> dict[str, float]:
    """One storm of ``n`` readers against a fresh core; microseconds per operation."""
    from tensorhub.config import Config
    from tensorhub.core import messages as m
    from tensorhub.core.reference import ReferenceCore

    layout = m.LayoutInfo("fp", 4, 4 << 20, (m.TensorMeta("w", "float32", (1 << 20,), 4 << 20),))
    core = ReferenceCore(Config())
    clock = [0.0]

    def send(req):
        clock[0] += 1e-6  # virtual time moves on, far below any lease
        reply, _ = core.handle(req, clock[0])
        assert not isinstance(reply, m.ErrorReply), reply
        return reply

    send(m.Register("t", "pol", "t", 0, 1, layout, b"t"))
    send(m.Publish("t", 1))
    ids = [f"r{i}" for i in range(n)]
    out = {}

    t0 = time.perf_counter()
    for cid in ids:
        send(m.Register(cid, "pol", cid, 0, 1, layout, cid.encode(), machine=f"h{hash(cid) % 64}"))
    out["Register"] = (time.perf_counter() - t0) / n * 1e6

    t0 = time.perf_counter()
    for cid in ids:
        send(m.Replicate(cid, "latest", 1))
    out["Replicate"] = (time.perf_counter() - t0) / n * 1e6
    assert all(core.nodes[c].state.value == "reading" for c in ids), "every reader is assigned"

    t0 = time.perf_counter()
    for cid in ids:
        send(m.ReplicateDone(cid, 1))
    out["ReplicateDone"] = (time.perf_counter() - t0) / n * 1e6
    assert all(core.nodes[c].state.value == "published" for c in ids)

    k = min(n, 2000)
    t0 = time.perf_counter()
    for cid in ids[:k]:
        send(m.Heartbeat(cid))
        clock[0] += 1e-6
        core.tick(clock[0])
    out["Heartbeat+tick"] = (time.perf_counter() - t0) / k * 1e6
    return out


def core_part(sizes: list[int], reps: int) -> dict[str, dict[str, float]]:
    """Per N, the median of ``reps`` rounds (after one warm-up round at the smallest N)."""
    table: dict[str, dict[str, float]] = {op: {} for op in OPS}
    core_round(min(sizes))
    for n in sizes:
        t0 = time.perf_counter()
        rounds = [core_round(n) for _ in range(reps)]
        row = {op: statistics.median(r[op] for r in rounds) for op in OPS}
        for op in OPS:
            table[op][str(n)] = round(row[op], 2)
        say(f"core N={n}: " + ", ".join(f"{op} {row[op]:.1f} us" for op in OPS)
            + f"  ({time.perf_counter() - t0:.1f} s)")
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,1000,10000", help="reader counts for the core part")
    ap.add_argument("--reps", type=int, default=3, help="core rounds per N (the median is reported)")
    ap.add_argument("--ray", action="store_true", help="also run the Ray part (10,000 simulated clients)")
    ap.add_argument("--clients", type=int, default=10_000, help="Ray part: simulated clients")
    ap.add_argument("--generators", type=int, default=4, help="Ray part: load-generator processes")
    ap.add_argument("--steady-s", type=float, default=10.0, help="Ray part: steady-state window measured")
    ap.add_argument("--json", action="store_true", help="no extra human output (the JSON line is printed either way)")
    args = ap.parse_args()

    sizes = [int(s) for s in args.sizes.split(",") if s]
    summary: dict = {"name": "server_scale", "core_us": core_part(sizes, args.reps)}
    big, small = str(max(sizes)), str(min(sizes))
    summary["core_ratio_max_over_min"] = {
        op: round(summary["core_us"][op][big] / summary["core_us"][op][small], 2) for op in OPS
    }
    if args.ray:
        summary.update(ray_part(args))
    print(json.dumps(summary), flush=True)
    return 0


def ray_part(args) -> dict:
    raise SystemExit("the Ray part is not built yet")


if __name__ == "__main__":
    sys.exit(main())
