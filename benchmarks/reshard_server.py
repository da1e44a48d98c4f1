"""Resharded reads through the reference server, end to end: ``replicate()`` of vLLM-style TP=1/2/4
reader replicas from a 2-shard row-split trainer, against ``replicate()`` of a replica of the
trainer's own layout (the same bytes in all: one copy of the model).

    python benchmarks/reshard_server.py --json [--reps 3] [--layers 4] [--hidden 2048] [--same-host]

Everything runs in this process against an in-process server (``LocalPort``): the trainer's
handles, each reader replica's handles (one thread per shard, as a sharded engine's ranks call
``replicate`` at once) and the holders' cell hashing (the server's ``HashCells``, hashed on each
trainer handle's worker thread while the readers' bytes move). Each repetition publishes a new
version (as an RL step does), so every resharded read meets holders that hash its grid afresh:
the steady state of a training run, not a warm cache. The readers register before each publish,
as engines of a running job are: the holders hash their grids as they publish. Bytes go over NIXL (UCX cross-memory
attach on one host) unless ``--same-host`` (the same-host tier).

Figures, each the best of ``--reps`` (modes run in turn within a repetition):

  seconds            wall time of the replica's replicate (all its shards), per mode
  time_ratio         resharded seconds / same-layout seconds (goal of issue 24: 1.15)
  bytes_ratio        bytes the reader replica received / bytes of the model (1.0: each rank its slice)

The model is the Llama-shaped bf16 schema of ``benchmarks/reshard.py`` (its ``vllm`` placements:
fused qkv/gate_up, row-parallel o/down, vocabulary-parallel embedding and head). Human lines go
to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

import torch

import tensorhub
from tensorhub.config import Config
from tensorhub.ports import LocalPort

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reshard import TRAINER_SHARDS, schema, trainer, vllm  # noqa: E402

TPS = (1, 2, 4)


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def open_replica(port, cfg, name, placements, random=False, tensors=None):
    """A replica of ``placements`` registered: ``tensors`` (one list per shard) if given, else
    random bytes for a holder and ones (touched) for a reader."""
    hubs = []
    for k, p in enumerate(placements):
        hub = tensorhub.open("policy", port=port, config=cfg, replica=name, shard=k, num_shards=len(placements))
        local = tensors[k] if tensors is not None else [
            (torch.randn(t.shape) if random else torch.ones(t.shape)).to(torch.bfloat16) for t in p.tensors]
        hub.register(list(zip(p.names, local)), placement=p)
        hubs.append(hub)
    return hubs


def replicate_all(hubs, call: str = "replicate") -> float:
    """Every shard replicates (or ``call``: ``"update"``) at once; the wall time until the last
    is done."""
    errs: list[BaseException] = []

    def one(h):
        try:
            getattr(h, call)("latest")
        except BaseException as e:  # noqa: BLE001 - raised below
            errs.append(e)
    threads = [threading.Thread(target=one, args=(h,)) for h in hubs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errs:
        raise errs[0]
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--same-host", action="store_true")
    args = ap.parse_args()
    s = schema(args.layers, args.hidden)
    model_bytes = sum(t.nbytes for t in s.tensors)
    cfg = dataclasses.replace(Config(), same_host=args.same_host, source_stall_timeout_s=60.0)
    port = LocalPort(cfg)
    say(f"model {model_bytes / 2**20:.0f} MiB, trainer {TRAINER_SHARDS} shards, readers TP={TPS}, "
        f"{'same-host tier' if args.same_host else 'NIXL'}")
    train = open_replica(port, cfg, "trainer", [trainer(s, r) for r in range(TRAINER_SHARDS)], random=True)
    best: dict[str, float] = {}
    received: dict[str, int] = {}
    version = 0
    for rep in range(args.reps):
        version += 1
        modes = [("same_layout", [trainer(s, r) for r in range(TRAINER_SHARDS)])]
        modes += [(f"tp{tp}", [vllm(s, r, tp) for r in range(tp)]) for tp in TPS]
        # The engines are registered when the trainer publishes, as in a training run (the
        # holders then hash their grids ahead: tensorhub/core/cells.py rule 0).
        replicas = {name: open_replica(port, cfg, f"{name}-{rep}", placements) for name, placements in modes}
        for h in train:
            h.unpublish()
            h.publish(version)
        for name, _ in modes:
            hubs = replicas[name]
            try:
                dt = replicate_all(hubs)
                received[name] = sum(h.reads.layout.total_bytes for h in hubs)
            finally:
                for h in hubs:
                    h.close(drop_last_copy=True)
            best[name] = min(best.get(name, dt), dt)
            say(f"rep {rep} {name}: {dt:.3f} s ({received[name] / dt / 1e9:.2f} GB/s)")
    for h in train:
        h.close(drop_last_copy=True)
    base = best["same_layout"]
    out = {
        "model_bytes": model_bytes, "tier": "same_host" if args.same_host else "nixl", "reps": args.reps,
        "seconds": {k: round(v, 4) for k, v in best.items()},
        "time_ratio": {f"tp{tp}": round(best[f"tp{tp}"] / base, 3) for tp in TPS},
        "bytes_ratio": {f"tp{tp}": round(received[f"tp{tp}"] / model_bytes, 4) for tp in TPS},
        "goal_time_ratio": 1.15,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
