"""Resharded reads of a transformer-shaped model: a TP=1/2/4 vLLM-style reader from a 2-shard
FSDP-like trainer, against a same-layout read and against gathering the whole model.

    python benchmarks/reshard.py --json [--reps 3] [--layers 9] [--hidden 2048]

A holder process (the trainer) holds a bf16 logical model of about 1 GiB (embedding, per layer
q/k/v/o with GQA, gate/up/down, two norms; final norm and head) as 2 shards split by rows,
registered and published complete with today's unit checksums and its cell checksums
(:mod:`tensorhub.gridsums`, on a grid refined with every placement below). This process reads,
for each reader shard of each TP degree, with :class:`~tensorhub.transport.reshard_read.ReshardRead`
(plan, range reads from each trainer shard straight into the reader's tensors, cells verified,
unit checksums published), over NIXL and over the same-host tier:

  resharded      ReshardRead.run (reads by batches of reader tensors, each batch's cell check and
                 unit checksums on a second thread while the next is read) and publish: all of a
                 reader's work (``--serial``: read shard by shard, then check, then hash units)
  same_layout    what replicate() moves today between equal layouts: the unit reader's ``pull``
                 of trainer shard 0 into a region of the trainer's layout, checksums verified
                 (NIXL: transport.reader.pull; same host: shm.pull)
  gather         what a user does today without resharding: pull both trainer shards whole (the
                 whole model), then cut the reader's slice out of them locally (one copy per
                 local tensor piece)

Figures (each the best of ``--reps``; every mode runs once per repetition, in turn, so modes see
the same moments of a noisy shared machine):

  bytes_ratio          bytes a reader shard received / bytes of its own slice (goal <= 1.02)
  time_ratio           resharded seconds per byte / same_layout seconds per byte (goal <= 1.15
                       over NIXL; reported for the same-host tier too)
  extra_memory_ratio   peak resident memory added during the read / the reader shard's bytes, on
                       the reader and on the holder (goal <= 0.01; the reader's tensors are
                       allocated and touched before)
  gather_baseline      bytes per reader (the whole model) and seconds, per TP

``--emulated`` adds the pipeline across layouts on an emulated cluster (:mod:`tensorhub.emucluster`,
needs root; ``--gbit`` links, 0.1 Gbit/s by default): a TP=1 trainer on host 0 and ``--readers``
(8) vLLM-style TP=2 reader replicas, each on its own host (a Ray actor per rank), all calling
``update`` at once through the reference server (:mod:`tensorhub.testing.reshard_pipeline`; a
smaller Llama-shaped model, ``--emulated-layers/--emulated-hidden``, so a link carries it in
seconds). ``last_over_single``: the last reader's time / one reader's alone (goal <= 1.3); its
details under ``emulated``. ``benchmarks/reshard_server.py`` measures resharded ``replicate()``
through the server in one process. Human lines go to stderr; the last stdout line is one JSON
object.
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
from tensorhub.core.grid import grid_of
from tensorhub.gridsums import cell_checksums
from tensorhub.layout import Layout, checksum_all
from tensorhub.testing import layouts
from tensorhub.transport import Agent, Region, decode_endpoint, open_source, pull, shm
from tensorhub.transport.nixl import encode_endpoint
from tensorhub.transport.reshard_read import ReshardRead

CFG = Config()
VERSION = 1
TRAINER_SHARDS = 2
TPS = (1, 2, 4)


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def schema(layers: int, hidden: int) -> P.Schema:
    """A Llama-shaped bf16 model (:func:`tensorhub.testing.layouts.llama_schema`)."""
    return layouts.llama_schema(layers, hidden)


def trainer(s: P.Schema, rank: int) -> P.Placement:
    """FSDP-like: every tensor split by rows into TRAINER_SHARDS."""
    return layouts.fsdp(s, rank, TRAINER_SHARDS)


def vllm(s: P.Schema, rank: int, tp: int) -> P.Placement:
    """vLLM's tensor parallelism (:func:`tensorhub.testing.layouts.vllm_tp`)."""
    return layouts.vllm_tp(s, rank, tp)


def all_placements(s: P.Schema) -> list[P.Placement]:
    return [trainer(s, r) for r in range(TRAINER_SHARDS)] + [vllm(s, r, tp) for tp in TPS for r in range(tp)]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_mark() -> int:
    """Reset this process's peak resident memory to now (Linux clear_refs 5); returns the
    resident memory now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def memory_peak() -> int:
    """Peak resident memory since the last :func:`memory_mark`."""
    return _status_kib("VmHWM")


def zeros_touched(pl: P.Placement) -> list[torch.Tensor]:
    """The placement's local tensors, allocated and touched once (first touch is slow here)."""
    return [torch.ones(t.shape, dtype=torch.bfloat16) for t in pl.tensors]


def layout_of(pl: P.Placement, tensors) -> Layout:
    return Layout.build(list(zip(pl.names, tensors)), CFG.unit_bytes, CFG.pack_below_bytes)


# --------------------------------------------------------------------------- the holder process


def holder_main(layers: int, hidden: int) -> None:
    """Register the trainer's shards, publish them, print their endpoints and cell checksums;
    then answer ``mark`` and ``peak`` lines (:func:`memory_mark`, :func:`memory_peak`) until stdin
    closes."""
    s = schema(layers, hidden)
    grid = grid_of(all_placements(s))
    agent = Agent(CFG, name=f"bench-reshard-trainer-{os.getpid()}")
    gen = torch.Generator().manual_seed(0)
    out = {"endpoints": [], "sums": [], "publish_s": {}}
    regions = []
    for r in range(TRAINER_SHARDS):
        pl = trainer(s, r)
        ts = [torch.randn(t.shape, generator=gen).to(torch.bfloat16) for t in pl.tensors]
        lay = layout_of(pl, ts)
        t0 = time.perf_counter()
        sums = checksum_all(ts, lay)
        t1 = time.perf_counter()
        cells = cell_checksums(dict(zip(pl.names, ts)), pl, grid)
        t2 = time.perf_counter()
        out["publish_s"].setdefault("unit_checksums", []).append(round(t1 - t0, 4))
        out["publish_s"].setdefault("cell_checksums", []).append(round(t2 - t1, 4))
        region = Region.register(ts, lay, CFG, agent=agent)
        region.publish_complete(VERSION, sums)
        regions.append(region)
        out["endpoints"].append(encode_endpoint(region.endpoint()).hex())
        out["sums"] += [[k[0], k[1], v] for k, v in cells.items()]
    out["cells"] = grid.cell_count
    print("HOLDER " + json.dumps(out), flush=True)
    for line in sys.stdin:
        if line.strip() == "mark":
            print(f"MEM {memory_mark()}", flush=True)
        elif line.strip() == "peak":
            print(f"MEM {memory_peak()}", flush=True)
    for region in regions:
        region.close()


class Holder:
    """The holder process, seen from the reader."""

    def __init__(self, layers: int, hidden: int) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--holder", str(layers), str(hidden)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = json.loads(self._line("HOLDER "))
        self.endpoints = [decode_endpoint(bytes.fromhex(e)) for e in info["endpoints"]]
        self.sums = {(t, i): v for t, i, v in info["sums"]}
        self.publish_s = info["publish_s"]
        self.cells = info["cells"]

    def _line(self, prefix: str) -> str:
        while True:  # NIXL may log to stdout first
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the holder process ended early")
            if line.startswith(prefix):
                return line[len(prefix):]

    def memory(self, what: str) -> int:
        """``mark`` or ``peak`` in the holder process."""
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return int(self._line("MEM "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


# --------------------------------------------------------------------------- the reader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON summary line on stdout")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--serial", action="store_true",
                    help="read shard by shard, then check, then hash units (ReshardRead.read/check) instead of run()")
    ap.add_argument("--emulated", action="store_true",
                    help="also run the pipeline across layouts on an emulated cluster (root; see the module doc)")
    ap.add_argument("--readers", type=int, default=8, help="--emulated: TP=2 reader replicas, a host each")
    ap.add_argument("--gbit", type=float, default=0.1, help="--emulated: link rate (Gbit/s)")
    ap.add_argument("--emulated-layers", type=int, default=8)
    ap.add_argument("--emulated-hidden", type=int, default=512)
    ap.add_argument("--emulated-reps", type=int, default=2)
    ap.add_argument("--emulated-only", action="store_true", help="only the emulated part")
    ap.add_argument("--holder", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.holder:
        holder_main(*args.holder)
        return
    if args.emulated_only:
        emu = emulated(args)
        say(json.dumps(emu, indent=1))
        if args.json:
            print(json.dumps({"bench": "reshard", "emulated": emu, "last_over_single": emu and emu["last_over_single"]}))
        return
    s = schema(args.layers, args.hidden)
    model_bytes = sum(t.nbytes for t in s.tensors)
    grid = grid_of(all_placements(s))
    say(f"model {model_bytes / 2**30:.3f} GiB, {len(s.tensors)} tensors, {grid.cell_count} cells")
    holder = Holder(args.layers, args.hidden)
    agent = Agent(CFG, name=f"bench-reshard-reader-{os.getpid()}")
    hp = [trainer(s, r) for r in range(TRAINER_SHARDS)]
    far = {r: open_source(ep, agent=agent) for r, ep in enumerate(holder.endpoints)}
    near = {r: shm.ShmSource(ep.shm) for r, ep in enumerate(holder.endpoints)}
    tiers = {"nixl": far, "same_host": near}
    regions: list[Region] = []

    def region_for(pl: P.Placement) -> Region:
        ts = zeros_touched(pl)
        reg = Region.register(ts, layout_of(pl, ts), CFG.replace(same_host=False), agent=agent)
        regions.append(reg)
        return reg

    try:
        # same layout: trainer shard 0 into a region of its layout, as replicate() reads it
        same = region_for(hp[0])
        same_bytes = same.layout.total_bytes
        readers = {tp: region_for(vllm(s, 0, tp)) for tp in TPS}  # one region per TP, reused by its ranks
        # gather: the whole model (both trainer shards) plus the reader's own tensors
        gathered = [region_for(p) for p in hp]
        best: dict[str, float] = {}
        got: dict[str, int] = {}
        parts: dict[str, tuple] = {}  # resharded: (plan, reads, cell check, unit checksums) of its best rep
        extra: dict[str, list[list[int]]] = {}  # mode -> peak memory added [reader, holder] per call

        def timed(key: str, fn) -> None:
            before_r, before_h = memory_mark(), holder.memory("mark")
            t0 = time.perf_counter()
            n = fn()
            dt = time.perf_counter() - t0
            added = [memory_peak() - before_r, holder.memory("peak") - before_h]
            parts_ = key.split("/")
            mode = "/".join((parts_[0], parts_[2])) if parts_[0] == "resharded" else parts_[0]
            extra.setdefault(mode, []).append(added)
            best[key] = min(best.get(key, float("inf")), dt)
            got[key] = n

        for rep in range(args.reps):
            for tier, srcs in tiers.items():
                if tier == "nixl":
                    timed(f"same_layout/{tier}", lambda: pull(same, srcs[0], same.layout, expect_version=VERSION,
                                                               config=CFG))
                else:
                    timed(f"same_layout/{tier}", lambda: shm.pull(same, srcs[0], same.layout,
                                                                   expect_version=VERSION, config=CFG))
                for tp in TPS:
                    for rank in range(tp):
                        def resharded(tp=tp, rank=rank, srcs=srcs) -> int:
                            t0 = time.perf_counter()
                            rd = ReshardRead(readers[tp], vllm(s, rank, tp), hp, version=VERSION, config=CFG,
                                             spread=rank)
                            t1 = time.perf_counter()
                            if args.serial:
                                for shard in rd.shards:
                                    rd.read(shard, srcs[shard])
                                t2 = time.perf_counter()
                                rd.check(grid, holder.sums)
                            else:
                                rd.run(srcs, grid, holder.sums)
                                t2 = time.perf_counter()
                            t3 = time.perf_counter()
                            rd.publish()
                            t4 = time.perf_counter()
                            key = f"{tier}/tp{tp}/r{rank}"
                            if t4 - t0 < sum(parts.get(key, (float("inf"),))):
                                parts[key] = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
                            return rd.bytes_read
                        timed(f"resharded/{tier}/tp{tp}/r{rank}", resharded)
                    if tier == "nixl":
                        def gather(tp=tp) -> int:
                            n = 0
                            for r, reg in enumerate(gathered):
                                n += pull(reg, far[r], reg.layout, expect_version=VERSION, config=CFG)
                            whole = {}
                            for reg, p in zip(gathered, hp):
                                for lp, t in zip(p.tensors, reg.tensors):
                                    whole.setdefault(lp.pieces[0].tensor, []).append(t)
                            full = {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in whole.items()}
                            pl = vllm(s, 0, tp)
                            for lp, t in zip(pl.tensors, readers[tp].tensors):
                                for pc in lp.pieces:
                                    src = full[pc.tensor][tuple(slice(a, b) for a, b in zip(pc.box.start, pc.box.stop))]
                                    if not lp.shape:
                                        t.copy_(src)
                                    else:
                                        t[pc.row0:pc.row0 + pc.rows].copy_(src.reshape((pc.rows,) + t.shape[1:]))
                            return n
                        timed(f"gather/tp{tp}", gather)
            say(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v:.3f}s" for k, v in sorted(best.items())))
    finally:
        for src in [*far.values(), *near.values()]:
            src.close()
        for reg in regions:
            reg.close()
        holder.close()

    out = {"bench": "reshard", "reps": args.reps, "mode": "serial" if args.serial else "run", "model_bytes": model_bytes, "trainer_shards": TRAINER_SHARDS,
           "cells": holder.cells, "unit_bytes": CFG.unit_bytes, "checksums": CFG.checksums,
           "holder_publish_s": holder.publish_s, "load_avg": os.getloadavg()[0]}
    same_rate = {tier: best[f"same_layout/{tier}"] / same_bytes for tier in tiers}
    per_tp = {}
    worst_bytes = worst_time = 0.0
    for tp in TPS:
        slice_bytes = readers[tp].layout.total_bytes
        row = {"slice_bytes": slice_bytes}
        for tier in tiers:
            secs = [best[f"resharded/{tier}/tp{tp}/r{r}"] for r in range(tp)]
            ratio = max(secs) / slice_bytes / same_rate[tier]
            split = [parts[f"{tier}/tp{tp}/r{r}"] for r in range(tp)]
            row[tier] = {"seconds_per_rank": [round(x, 4) for x in secs], "GBps": round(slice_bytes / max(secs) / 1e9, 3),
                         "time_ratio": round(ratio, 3),
                         "split_s": {k: round(max(p[i] for p in split), 4)
                                     for i, k in enumerate(("plan", "reads" if args.serial else "run", "cell_check",
                                                            "unit_checksums_and_publish"))}}
            if tier == "nixl":
                worst_time = max(worst_time, ratio)
        received = [got[f"resharded/nixl/tp{tp}/r{r}"] for r in range(tp)]
        row["bytes_ratio"] = round(max(received) / slice_bytes, 4)
        worst_bytes = max(worst_bytes, row["bytes_ratio"])
        row["gather_baseline"] = {"bytes_per_reader": got[f"gather/tp{tp}"], "seconds": round(best[f"gather/tp{tp}"], 4),
                                  "over_resharded": round(best[f"gather/tp{tp}"] / max(secs), 2)}
        per_tp[f"tp{tp}"] = row
    out.update({
        "same_layout": {tier: {"seconds": round(best[f"same_layout/{tier}"], 4),
                               "GBps": round(same_bytes / best[f"same_layout/{tier}"] / 1e9, 3)} for tier in tiers},
        "readers": per_tp,
        "bytes_ratio": worst_bytes,
        "time_ratio": round(worst_time, 3),
        "time_ratio_same_host": max(per_tp[f"tp{tp}"]["same_host"]["time_ratio"] for tp in TPS),
        # Peak resident memory a resharded read added / that TP's reader shard bytes, worst TP:
        # "first" counts the first calls (NIXL/UCX set up per remote memory on first use), "steady"
        # the worst call of the last repetition (both tiers). The gather mode's bytes for comparison (its
        # regions of the whole model are allocated before the loop: it adds the assembled copy).
        "extra_memory_ratio": {side: {"first": round(max(max(c[i] for c in extra[f"resharded/tp{tp}"])
                                                         / readers[tp].layout.total_bytes for tp in TPS), 4),
                                      "steady": round(max(max(c[i] for c in extra[f"resharded/tp{tp}"][-2 * tp:])
                                                          / readers[tp].layout.total_bytes for tp in TPS), 4)}
                               for i, side in enumerate(("reader", "holder"))},
        "extra_memory_bytes": {mode: [max(c[i] for c in calls) for i in range(2)] for mode, calls in extra.items()},
        "goals": {"bytes_ratio": 1.02, "time_ratio": 1.15, "extra_memory_ratio": 0.01, "last_over_single": 1.3},
    })
    out["met"] = {"bytes_ratio": out["bytes_ratio"] <= 1.02, "time_ratio": out["time_ratio"] <= 1.15,
                  "extra_memory_ratio": max(v["steady"] for v in out["extra_memory_ratio"].values()) <= 0.01}
    if args.emulated:
        emu = emulated(args)
        out["emulated"] = emu
        out["last_over_single"] = emu and emu["last_over_single"]
        out["met"]["last_over_single"] = bool(emu) and emu["exact"] and emu["last_over_single"] <= 1.3
    say(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out))


def emulated(args) -> dict | None:
    """The pipeline across layouts on an emulated cluster (the module doc): the driver's JSON
    summary, or None if it failed."""
    from tensorhub.emucluster import emulated_cluster

    name = "thrsh"
    with emulated_cluster(hosts=args.readers + 1, gbit=args.gbit, name=name, subnet="10.78.0.0/16") as c:
        p = c.run_driver([sys.executable, "-m", "tensorhub.testing.reshard_pipeline", "--cluster", name,
                          "--readers", str(args.readers), "--tp", "2", "--layers", str(args.emulated_layers),
                          "--hidden", str(args.emulated_hidden), "--reps", str(args.emulated_reps)],
                         timeout_s=1800, cwd=_REPO)
    sys.stderr.write(p.stderr[-3000:])
    if p.returncode != 0:
        say(f"the emulated driver failed (rc={p.returncode})")
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
