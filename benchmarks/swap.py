"""``update()`` after a completed prefetch: copied from the staging copy vs swapped (double buffer).

    python benchmarks/swap.py --json [--bytes 256MiB] [--versions 6]

In one process, against an in-process reference server (LocalPort: no Ray, so the numbers are
the handle's own work, not round trips): a trainer and two rollouts, ``copy`` (a plain
``register``) and ``swap`` (``register(..., double_buffer=spare)``). For each version both
rollouts prefetch it, then update to it; the times are the update calls. Every update is checked
byte for byte against the trainer. The last stdout line is one JSON object: ``bytes``,
``copy_update_s`` and ``swap_update_s`` (medians over versions 2.., the first warms up),
``copy_over_swap`` and the per-version ``runs``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

from benchmarks.bench_actors import parse_bytes  # noqa: E402 - after the sys.path line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=parse_bytes, default=256 << 20)
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--json", action="store_true", help="print only the JSON line on stdout")
    args = ap.parse_args()

    import tensorhub
    from tensorhub.ports import LocalPort
    from tensorhub.testing import inproc, workload

    spec = workload.small_spec(args.bytes, big=8, tiny=32)
    cfg = inproc.CONFIG.replace(unit_bytes=4 << 20)
    port = LocalPort(cfg)

    def open_(replica: str, double: bool):
        named = workload.allocate(spec)
        hub = tensorhub.open("bench-swap", port=port, config=cfg, replica=replica)
        hub.register(named, double_buffer=workload.allocate(spec) if double else None)
        return hub, [t for _, t in named]

    trainer, tt = open_("trainer", False)
    copy, _ = open_("copy", False)
    swap, _ = open_("swap", True)
    runs = []
    for v in range(1, args.versions + 1):
        inproc.publish(trainer, tt, v)
        copy.prefetch(v).result()
        swap.prefetch(v).result()
        sc, ss = copy.update(v), swap.update(v)
        want = workload.digest(tt)
        if not (sc.prefetched and ss.swapped and workload.digest([t for _, t in copy.tensors]) == want
                and workload.digest([t for _, t in swap.tensors]) == want):
            raise SystemExit(f"version {v}: not prefetched/swapped, or bytes differ")
        runs.append({"version": v, "copy_update_s": round(sc.seconds, 5), "swap_update_s": round(ss.seconds, 5)})
        if not args.json:
            print(f"version {v}: copy {sc.seconds * 1e3:.2f} ms, swap {ss.seconds * 1e3:.2f} ms", file=sys.stderr)
    for h in (copy, swap, trainer):
        h.close(drop_last_copy=True)
    steady = runs[1:] or runs
    c = statistics.median(r["copy_update_s"] for r in steady)
    s = statistics.median(r["swap_update_s"] for r in steady)
    print(json.dumps({"name": "swap", "bytes": sum(t.numel() * t.element_size() for t in tt),
                      "copy_update_s": round(c, 5), "swap_update_s": round(s, 5),
                      "copy_over_swap": round(c / s, 1) if s > 0 else None, "runs": runs}))


if __name__ == "__main__":
    main()
