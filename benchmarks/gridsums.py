"""Hash rate of cell checksums (issue 24 stage 2c) against today's per-unit checksums.

    python benchmarks/gridsums.py --json [--reps 5] [--shape 8192x16384] [--dtype bfloat16]

One CPU shard of 256 MiB by default (bf16 8192x16384, the whole of one global tensor ``w``),
hashed four ways, each over all its bytes:

  unit     today: :func:`tensorhub.layout.checksum_all` over the shard's transfer units
           (``unit_bytes`` = 16 MiB each, one xxh3 per unit): the ratios' denominator
  rows     :func:`tensorhub.gridsums.cell_checksums` with the grid of the shard and a reader
           row split into 4: 4 cells of whole rows, one hash call each
  cols4    the grid of the shard and a reader column split into 4: 4 strided cells, each
           hashed row by row (8192 streaming updates of cols/4 elements)
  cols16   a column split into 16: 16 strided cells of shorter rows (bf16 8192x16384: 2 KiB,
           the row length of a Llama-70B TP=8 ``o_proj`` slice)

Each repetition runs every mode once, in turn (the machine is shared and noisy: modes see the
same moments); a mode's figure is its best repetition, GB/s = shard bytes / seconds. Ratios are
to ``unit`` from the same run. Human lines go to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

import torch

from tensorhub import placement as P
from tensorhub.config import Config
from tensorhub.core.grid import grid_of
from tensorhub.gridsums import cell_checksums
from tensorhub.layout import Layout, checksum_all


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def modes(t: torch.Tensor, dtype: str) -> dict:
    """mode -> a function hashing the whole shard once (returns the checksums)."""
    cfg = Config()
    layout = Layout.build([("w", t)], cfg.unit_bytes, cfg.pack_below_bytes)
    g = P.GlobalTensor("w", dtype, tuple(t.shape))
    schema = P.Schema.of([g])
    shard = P.whole_placement(schema)
    tensors = {"w": t}
    out = {"unit": (lambda: checksum_all([t], layout), layout.unit_count)}
    for mode, dim, parts in (("rows", 0, 4), ("cols4", 1, 4), ("cols16", 1, 16)):
        grid = grid_of([shard] + [P.Placement.build([P.split(g, dim, r, parts)], schema) for r in range(parts)])
        out[mode] = ((lambda grid=grid: cell_checksums(tensors, shard, grid)), grid.cell_count)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON summary line on stdout")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shape", default="8192x16384", help="ROWSxCOLS of the shard")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    rows, cols = (int(x) for x in args.shape.split("x"))
    t = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(getattr(torch, args.dtype))
    nbytes = t.numel() * t.element_size()
    fns = modes(t, args.dtype)
    best = {m: float("inf") for m in fns}
    for rep in range(args.reps):
        for m, (fn, _) in fns.items():
            t0 = time.perf_counter()
            fn()
            best[m] = min(best[m], time.perf_counter() - t0)
        say(f"rep {rep}: " + ", ".join(f"{m} {nbytes / best[m] / 1e9:.2f} GB/s" for m in fns))
    gbps = {m: round(nbytes / s / 1e9, 2) for m, s in best.items()}
    out = {"bench": "gridsums", "dtype": args.dtype, "shape": [rows, cols], "shard_bytes": nbytes,
           "reps": args.reps, "hashes": {m: n for m, (_, n) in fns.items()},
           "row_bytes": {"rows": cols * t.element_size(), "cols4": cols // 4 * t.element_size(),
                         "cols16": cols // 16 * t.element_size()},
           "gbps": gbps, "ratio": {m: round(best["unit"] / best[m], 3) for m in fns if m != "unit"}}
    say(json.dumps(out))
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
