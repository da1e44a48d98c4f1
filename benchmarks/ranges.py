"""Range reads of a column slice: NIXL strided (rows batched vs one multi-descriptor request)
against a contiguous read of the same bytes, and the same-host tier's strided copy.

    python benchmarks/ranges.py --json [--reps 5] [--cases fp32:8192x8192,bf16:8192x4096]

A holder process registers one 2-D tensor (whole, published complete; in shared memory, so the
same-host tier can map it). This process reads, with :mod:`tensorhub.transport.ranges`, for each
case and each slice (column half, column quarter):

  contiguous   the row slice with the same bytes (one contiguous run, cut into requests of
               ``unit_bytes``): the transport's own rate for these bytes
  rows         the column slice, rows batched into requests of ``unit_bytes`` (16 MiB)
  rows_1m      the same, requests of 1 MiB
  multi        the column slice as one request of ``rows`` descriptors
  shm_contig   same-host tier (the holder's memory mapped here), the row slice: one ``copy_``
  shm_strided  same-host tier, the column slice: one ``copy_`` between strided views

Each repetition runs every mode once, in turn (the machine is shared and noisy: modes see the
same moments); a mode's figure is its best repetition, GB/s = bytes of the slice / seconds. Ratios
are to the contiguous read (NIXL modes) or the same-host contiguous copy (shm), from the same run.
Human lines go to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

import torch

from tensorhub import placement as P
from tensorhub.config import Config
from tensorhub.core.reshard import plan_reshard
from tensorhub.layout import Layout
from tensorhub.transport import Agent, Region, decode_endpoint, open_source, shm
from tensorhub.transport.ranges import HolderTensors, copy_runs, read_runs

CFG = Config()
NIXL_MODES = {"contiguous": ("rows", None), "rows": ("rows", None), "rows_1m": ("rows", 1 << 20),
              "multi": ("multi", None)}


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def holder_main(dtype: str, rows: int, cols: int) -> None:
    """The holder process: register the tensor, print its endpoint (hex), wait for stdin to close."""
    t = torch.randn(rows, cols).to(getattr(torch, dtype))
    layout = Layout.build([("w", t)], CFG.unit_bytes, CFG.pack_below_bytes)
    region = Region.register([t], layout, CFG, agent=Agent(CFG, name=f"bench-ranges-holder-{os.getpid()}"))
    region.publish_complete(1)
    from tensorhub.transport.nixl import encode_endpoint
    print("ENDPOINT", encode_endpoint(region.endpoint()).hex(), flush=True)
    sys.stdin.read()
    region.close()


def _reader_case(agent, ep, dtype: str, rows: int, cols: int, part: int, reps: int) -> dict:
    g = P.GlobalTensor("w", dtype, (rows, cols))
    schema = P.Schema.of([g])
    holders = [P.whole_placement(schema)]
    col = P.Placement.build([P.split(g, 1, part - 1, part)], schema)  # the last column part
    row = P.Placement.build([P.split(g, 0, part - 1, part)], schema)  # the same bytes, contiguous
    plans = {"col": plan_reshard(col, holders), "row": plan_reshard(row, holders)}
    assert len(plans["row"].runs) == 1 and plans["row"].runs[0].count == 1
    assert len(plans["col"].runs) == 1 and plans["col"].runs[0].count == rows
    dt = getattr(torch, dtype)
    dst = {k: torch.zeros(pl.tensors[0].shape, dtype=dt) for k, pl in (("col", col), ("row", row))}
    regions = {k: Region.register([t], Layout.build([("w", t)], CFG.unit_bytes, CFG.pack_below_bytes),
                                  CFG.replace(same_host=False), agent=agent) for k, t in dst.items()}
    holder = HolderTensors(("w",), tuple(m.nbytes for m in ep.tensors))
    src = open_source(ep, agent=agent)
    near = shm.ShmSource(ep.shm)
    nbytes = plans["col"].runs[0].nbytes
    best = {m: float("inf") for m in [*NIXL_MODES, "shm_contig", "shm_strided"]}
    try:
        for _ in range(reps):
            for mode, (strided, req) in NIXL_MODES.items():
                k = "row" if mode == "contiguous" else "col"
                t0 = time.perf_counter()
                n = read_runs(regions[k], src, plans[k].runs, holder, expect_version=1, config=CFG,
                              strided=strided, request_bytes=req)
                best[mode] = min(best[mode], time.perf_counter() - t0)
                assert n == nbytes
            for mode, k in (("shm_contig", "row"), ("shm_strided", "col")):
                t0 = time.perf_counter()
                copy_runs(regions[k], near, plans[k].runs, holder, expect_version=1)
                best[mode] = min(best[mode], time.perf_counter() - t0)
        truth = near.piece(0, 0, holder.nbytes[0]).view(dt).view(rows, cols)
        assert torch.equal(dst["col"].view(torch.uint8), truth[:, (part - 1) * cols // part:].contiguous().view(torch.uint8))
    finally:
        near.close()
        src.close()
        for r in regions.values():
            r.close()
    gbps = {m: nbytes / s / 1e9 for m, s in best.items()}
    out = {"dtype": dtype, "shape": [rows, cols], "slice": f"1/{part} columns", "bytes": nbytes,
           "row_bytes": plans["col"].runs[0].run_bytes, "rows": rows,
           "GBps": {m: round(v, 3) for m, v in gbps.items()},
           "ratio_to_contiguous": {m: round(gbps[m] / gbps["contiguous"], 3) for m in ("rows", "rows_1m", "multi")},
           "shm_strided_over_contig": round(gbps["shm_strided"] / gbps["shm_contig"], 3)}
    say(f"{dtype} {rows}x{cols} 1/{part} cols ({nbytes >> 20} MiB, {out['row_bytes']} B per row): "
        + ", ".join(f"{m} {v:.2f}" for m, v in gbps.items()) + " GB/s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON summary line on stdout")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", default="float32:8192x8192,bfloat16:8192x4096",
                    help="dtype:ROWSxCOLS,... (the holder's tensor)")
    ap.add_argument("--holder", nargs=3, metavar=("DTYPE", "ROWS", "COLS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.holder:
        holder_main(args.holder[0], int(args.holder[1]), int(args.holder[2]))
        return
    agent = Agent(CFG, name=f"bench-ranges-reader-{os.getpid()}")
    cases = []
    for spec in args.cases.split(","):
        dtype, shape = spec.split(":")
        rows, cols = (int(x) for x in shape.split("x"))
        proc = subprocess.Popen([sys.executable, __file__, "--holder", dtype, str(rows), str(cols)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            line = ""
            while not line.startswith("ENDPOINT "):  # NIXL may log to stdout first
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError("the holder process ended before publishing its endpoint")
            ep = decode_endpoint(bytes.fromhex(line.split()[1]))
            for part in (2, 4):
                cases.append(_reader_case(agent, ep, dtype, rows, cols, part, args.reps))
        finally:
            proc.stdin.close()
            proc.wait(30)
    ratios = [c["ratio_to_contiguous"] for c in cases]
    out = {"bench": "ranges", "reps": args.reps, "unit_bytes": CFG.unit_bytes, "cases": cases,
           "min_ratio": {m: min(r[m] for r in ratios) for m in ("rows", "rows_1m", "multi")},
           "load_avg": os.getloadavg()[0]}
    say(json.dumps(out))
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
