"""A trainer and inference engines that hold the model differently, with no conversion code.

    python examples/reshard.py [--address local] [--steps 3]

The trainer holds a small Llama-shaped layer as 2 FSDP-like shards (every tensor cut by rows);
one engine holds it as vLLM does with TP=2 (``qkv_proj`` fused from q, k and v and cut by
output rows; ``o_proj`` cut by input columns), another with TP=1. Each rank is a Ray actor
with one TensorHub handle that registers its own tensors with its *placement*
(:mod:`tensorhub.placement`). Every step the trainer publishes; each engine rank calls
``update("latest")`` and receives exactly its slice, straight into its tensors, checked cell by
cell; the TP=1 engine, one of another layout again, reads from the trainer too (or from the
TP=2 engine's layout class: the server chooses). The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

import ray
import torch

import tensorhub
from tensorhub import placement as P

H, KV = 256, 64  # hidden size; k and v have a quarter of q's rows (GQA)
SCHEMA = P.Schema.of([P.GlobalTensor(n, "float32", s) for n, s in
                      [("q", (H, H)), ("k", (KV, H)), ("v", (KV, H)), ("o", (H, H)), ("norm", (H,))]])
G = SCHEMA.by_name()


def trainer_placement(rank: int) -> P.Placement:          # FSDP-like: rows
    return P.Placement.build([P.split(t, 0, rank, 2) for t in SCHEMA.tensors], SCHEMA)


def vllm_placement(rank: int, tp: int) -> P.Placement:    # vLLM's tensor parallelism
    return P.Placement.build([
        P.fused("qkv_proj", [(G["q"], 0, rank, tp), (G["k"], 0, rank, tp), (G["v"], 0, rank, tp)]),
        P.split(G["o"], 1, rank, tp, name="o_proj"),
        P.whole(G["norm"]),
    ], SCHEMA)


def model_at(step: int) -> dict[str, torch.Tensor]:
    """The whole model at a step (what every rank's slice is checked against)."""
    gen = torch.Generator().manual_seed(step)
    return {t.name: torch.randn(t.shape, generator=gen) for t in SCHEMA.tensors}


def slice_of(p: P.Placement, full: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """What a rank of placement ``p`` should hold: its local tensors cut from the whole model."""
    out = []
    for t in p.tensors:
        parts = [full[pc.tensor][tuple(slice(a, z) for a, z in zip(pc.box.start, pc.box.stop))] for pc in t.pieces]
        out.append(torch.cat(parts) if len(parts) > 1 else parts[0].clone())
    return out


@ray.remote(num_cpus=0)
class Rank:
    """One rank: its tensors, its placement, its handle."""

    def __init__(self, model: str, replica: str, rank: int, ranks: int, placement: P.Placement, key: str) -> None:
        self.placement = placement
        self.tensors = [torch.zeros(t.shape) for t in placement.tensors]
        self.hub = tensorhub.open(model, replica=replica, shard=rank, num_shards=ranks)
        # key: the name of this replica's layout; every replica of it gives the same one
        self.hub.register(list(zip(placement.names, self.tensors)), placement=placement, layout_key=key)

    def publish(self, step: int) -> None:                # the trainer: write, then publish
        self.hub.unpublish()
        for t, want in zip(self.tensors, slice_of(self.placement, model_at(step))):
            t.copy_(want)
        self.hub.publish(step)

    def update(self, step: int) -> dict:                 # an engine: receive the newest
        st = self.hub.update("latest", round=step)
        ok = all(torch.equal(t, w) for t, w in zip(self.tensors, slice_of(self.placement, model_at(st.version))))
        return {"version": st.version, "ok": ok, "bytes": st.bytes, "from": st.sources[0].split("/")[1]}

    def close(self) -> None:
        self.hub.close(drop_last_copy=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default="local", help="Ray address ('local': a new local cluster)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    ray.init(address=None if args.address == "local" else args.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": _REPO}})
    model = "reshard-example"
    trainer = [Rank.remote(model, "trainer", r, 2, trainer_placement(r), "fsdp2") for r in range(2)]
    tp2 = [Rank.remote(model, "engine-tp2", r, 2, vllm_placement(r, 2), "vllm-tp2") for r in range(2)]
    tp1 = [Rank.remote(model, "engine-tp1", 0, 1, vllm_placement(0, 1), "vllm-tp1")]
    steps = []
    for step in range(1, args.steps + 1):
        ray.get([t.publish.remote(step) for t in trainer])
        outs = ray.get([e.update.remote(step) for e in tp2 + tp1])
        steps.append(outs)
        print(f"step {step}: " + ", ".join(f"{n} {o['bytes']} B from {o['from']}{'' if o['ok'] else ' WRONG'}"
                                           for n, o in zip(["tp2/0", "tp2/1", "tp1"], outs)), file=sys.stderr)
    model_bytes = sum(t.nbytes for t in SCHEMA.tensors)
    last = steps[-1]
    summary = {
        "steps": args.steps,
        "all_exact": all(o["ok"] and o["version"] == i + 1 for i, outs in enumerate(steps) for o in outs),
        "model_bytes": model_bytes,
        "tp2_rank_bytes": [o["bytes"] for o in last[:2]],
        "tp1_bytes": last[2]["bytes"],
    }
    ray.get([a.close.remote() for a in tp1 + tp2 + trainer])
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
