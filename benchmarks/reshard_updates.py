"""Updates of an engine of another layout, step after step: what retention across layout classes
costs the engine (issue 24; ``Retention.kept``).

    python benchmarks/reshard_updates.py --json [--steps 6] [--layers 4] [--hidden 2048] [--retained 1]

An RL loop in one process against an in-process server (``LocalPort``): a 2-shard row-split
trainer publishes a new version every step; a vLLM-style TP=2 engine (fused qkv/gate_up, the
placements of ``benchmarks/reshard.py``) calls ``update("latest")`` on both ranks at once. The
engine's layout class commits each version only once its own read is done, so while it reads
version v+1 it still retains v. Two rules, run in turn within every step (two engines, each its
own replica):

  model_wide   the shipped rule: the model keeps the newest ``versions_retained`` versions its
               classes retain together; with the trainer at v+1 and ``--retained 1`` the
               engine's v is past retention and is read over without a host copy
  per_class    the rule before (``Retention.kept`` patched to the engine class's own
               retention): the engine's last copy of v is copied to host memory first

Figures, medians over the steps after the first (the engine's first read has nothing to drain):

  update_s        wall time of the engine's update (both ranks)
  offloads        offload orders the server gave the engine's ranks (per step): a copy of the
                  rank's old weights to host memory before its update may read over them
  ratio           per_class update_s / model_wide update_s
  exact           every rank held exactly its slice of the trainer's version after every update
                  (checked outside the timed part; the trainer negates its weights each step, so
                  a stale or torn byte shows)

Human lines go to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

from tensorhub.config import Config  # noqa: E402
from tensorhub.core.retention import Retention  # noqa: E402
from tensorhub.ports import LocalPort  # noqa: E402
from tensorhub.testing import layouts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reshard import TRAINER_SHARDS, schema, trainer, vllm  # noqa: E402
from reshard_server import open_replica, replicate_all  # noqa: E402

RULES = ("model_wide", "per_class")


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--retained", type=int, default=1, help="versions_retained")
    args = ap.parse_args()
    s = schema(args.layers, args.hidden)
    model_bytes = sum(t.nbytes for t in s.tensors)
    cfg = dataclasses.replace(Config(), versions_retained=args.retained, source_stall_timeout_s=60.0)
    say(f"model {model_bytes / 2**20:.0f} MiB, trainer {TRAINER_SHARDS} shards, engine TP=2, "
        f"versions_retained={args.retained}, {args.steps} steps")
    shipped, needs_offload = Retention.kept, Retention.needs_offload
    own_class_only = lambda self, model, version: version in self.table.retained(model)  # noqa: E731
    offloads: set = set()

    def counted(self, node):
        yes = needs_offload(self, node)
        if yes and node.replica_id == "engine":
            offloads.add((node.id, node.version))
        return yes
    full = layouts.model_at(s, 1)  # the model; step k publishes (-1) ** (k - 1) * full (exact in bf16)
    exact = True
    times: dict[str, list[float]] = {r: [] for r in RULES}
    copies: dict[str, list[int]] = {r: [] for r in RULES}
    Retention.needs_offload = counted
    try:
        for rule in RULES:  # each with a server of its own: one engine, the only copy of its class
            Retention.kept = shipped if rule == "model_wide" else own_class_only
            port = LocalPort(cfg)
            held = [layouts.slice_of(trainer(s, r), full) for r in range(TRAINER_SHARDS)]
            train = open_replica(port, cfg, "trainer", [trainer(s, r) for r in range(TRAINER_SHARDS)], tensors=held)
            engine_pl = [vllm(s, r, 2) for r in range(2)]
            ranks = [[torch.ones(t.shape, dtype=torch.bfloat16) for t in p.tensors] for p in engine_pl]
            engine = open_replica(port, cfg, "engine", engine_pl, tensors=ranks)
            offloads.clear()
            try:
                for step in range(1, args.steps + 1):
                    for h, tensors in zip(train, held):
                        if step > 1:
                            h.unpublish()
                            for t in tensors:
                                t.neg_()
                        h.publish(step)
                    before = len(offloads)
                    dt = replicate_all(engine, "update")
                    n = len(offloads) - before
                    sign = 1 if step % 2 else -1
                    ok = all(torch.equal(t, sign * w) for p, got in zip(engine_pl, ranks)
                             for t, w in zip(got, layouts.slice_of(p, full)))
                    exact = exact and ok
                    say(f"{rule} step {step}: {dt:.3f} s, offload orders to the engine's ranks {n}, exact {ok}")
                    if step > 1:
                        times[rule].append(dt)
                        copies[rule].append(n)
            finally:
                for h in [*train, *engine]:
                    h.close(drop_last_copy=True)
    finally:
        Retention.kept, Retention.needs_offload = shipped, needs_offload
    med = {r: statistics.median(times[r]) for r in RULES}
    out = {
        "model_bytes": model_bytes, "versions_retained": args.retained, "steps": args.steps,
        "update_s": {r: round(med[r], 4) for r in RULES},
        "update_s_all": {r: [round(x, 4) for x in times[r]] for r in RULES},
        "offloads": {r: statistics.median(copies[r]) for r in RULES},
        "ratio": round(med["per_class"] / med["model_wide"], 3),
        "exact": exact,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
