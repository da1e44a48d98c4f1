"""Attach TensorHub to actors that already exist in another Ray app.

    python examples/attach_existing_actor.py [--json] [--path auto|graph|pull] [--address ADDR]

``Scorer`` stands for an actor class of some other Ray application: it has its own model and
its own methods. It gains TensorHub with two lines in ``__init__`` (open a handle, register
the model's state dict) and one method that calls ``update("latest")``.

``Generator`` also inherits :class:`tensorhub.graphs.GraphMember` and exposes its handle as
``self.tensorhub_handle``; a driver then refreshes a whole group of them with one
``tensorhub.graphs.replicate_group(...)`` call (a compiled-graph pipeline or the pull path).

The "trainer" here is the driver process itself: any process can publish.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

import ray
import torch
import torch.nn as nn

import tensorhub
from tensorhub.graphs import GraphMember, replicate_group


def build_model() -> nn.Module:
    """The app's own model (any module whose state dict has a fixed layout)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))


@ray.remote(num_cpus=0)
class Scorer:
    """An actor from another Ray app: scores feature vectors with its own model."""

    def __init__(self, model_name: str) -> None:
        self.model = build_model().eval()
        self.calls = 0
        self.hub = tensorhub.open(model_name, replica=f"scorer-{uuid.uuid4().hex[:4]}")  # + TensorHub
        self.hub.register(self.model.state_dict())                                      # + TensorHub

    @torch.no_grad()
    def score(self, x: torch.Tensor) -> torch.Tensor:  # the app's own method, unchanged
        self.calls += 1
        return self.model(x)

    def refresh_weights(self) -> int:  # + TensorHub: pull the newest published weights in place
        return self.hub.update("latest").version

    def stop(self) -> None:
        self.hub.close(drop_last_copy=True)


@ray.remote(num_cpus=0)
class Generator(GraphMember):
    """Another app actor, refreshed as a group by the driver (compiled graph or pull path)."""

    def __init__(self, model_name: str, rank: int) -> None:
        self.model = build_model().eval()
        self.tensorhub_handle = tensorhub.open(model_name, replica=f"generator-{rank}")
        self.tensorhub_handle.register(self.model.state_dict())

    @torch.no_grad()
    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).argmax(dim=-1)

    def stop(self) -> None:
        self.tensorhub_handle.close(drop_last_copy=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generators", type=int, default=2)
    p.add_argument("--path", default="auto", choices=["auto", "graph", "pull"], help="replicate_group path")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local cluster)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = p.parse_args(argv)
    ray.init(address=args.address, log_to_driver=False)
    name = f"attach-demo-{uuid.uuid4().hex[:6]}"
    t0 = time.perf_counter()

    # The trainer: the driver publishes its model's weights.
    model = build_model()
    hub = tensorhub.open(name, replica="trainer")
    hub.register(model.state_dict())
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(0.5)  # the "trained" weights differ from what every actor built
    hub.publish(1)

    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    scorer = Scorer.remote(name)
    gens = [Generator.remote(name, r) for r in range(args.generators)]
    checks = {}
    try:
        checks["scorer_differs_before_update"] = not torch.equal(ray.get(scorer.score.remote(x)), model(x).detach())
        checks["scorer_version"] = ray.get(scorer.refresh_weights.remote())
        checks["scorer_matches_trainer"] = torch.equal(ray.get(scorer.score.remote(x)), model(x).detach())

        res = replicate_group(gens, "latest", path=args.path)
        checks["group_path"], checks["group_version"] = res.path, res.version
        want = model(x).detach().argmax(dim=-1)
        checks["generators_match_trainer"] = all(torch.equal(g, want) for g in ray.get([g.generate.remote(x) for g in gens]))

        hub.unpublish()  # a training step: wait for readers, then write
        with torch.no_grad():
            for prm in model.parameters():
                prm.mul_(0.9)
        hub.publish(2)
        checks["scorer_version_2"] = ray.get(scorer.refresh_weights.remote())
        checks["scorer_matches_trainer_2"] = torch.equal(ray.get(scorer.score.remote(x)), model(x).detach())
        res2 = replicate_group(gens, "latest", path=args.path)
        want = model(x).detach().argmax(dim=-1)
        checks["group_version_2"] = res2.version
        checks["generators_match_trainer_2"] = all(torch.equal(g, want) for g in ray.get([g.generate.remote(x) for g in gens]))
        ray.get([a.stop.remote() for a in [scorer, *gens]])
        hub.close(drop_last_copy=True)
    finally:
        for a in [scorer, *gens]:
            ray.kill(a)
    checks["seconds"] = round(time.perf_counter() - t0, 2)
    ok = all(checks[k] for k in checks if k.startswith(("scorer_matches", "generators_match", "scorer_differs")))
    checks["ok"] = ok
    print(json.dumps(checks) if args.json else "\n".join(f"{k}: {v}" for k, v in checks.items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
