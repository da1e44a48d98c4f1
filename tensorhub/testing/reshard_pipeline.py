"""The pipeline across layouts on an emulated cluster (the cluster test and ``benchmarks/reshard.py
--emulated``).

    RAY_ADDRESS=... python -m tensorhub.testing.reshard_pipeline --cluster NAME --readers 8 [--tp 2]
        [--layers 8 --hidden 512 --vocab 4096] [--reps 1]

Run as a driver inside an emulated cluster (:meth:`tensorhub.emucluster.EmulatedCluster.
run_driver`) of ``readers + 1`` hosts: the trainer on host 0 holds a Llama-shaped bf16 model
(:mod:`tensorhub.testing.layouts`) whole (TP=1, one shard); reader replica i on host i + 1 holds
it as vLLM does with TP = ``tp`` (fused ``qkv_proj`` and ``gate_up_proj``, row-parallel
``o_proj`` and ``down_proj``): ``tp`` Ray actors, one handle each, on that host. Every rank
calls ``update(v)`` at once. The first reader replica reshards from the trainer (the server's
resharded read: byte ranges straight into its tensors, checked cell by cell) and advertises
what it has checked as it goes; the other replicas, of its layout, pipeline from it and from
each other unit by unit. Every rank checks that it holds exactly its slice of version ``v``.

Per repetition: a new version, then ``update`` on the first reader replica alone
(``single_s``), then a new version and ``update`` on all of them at once (``last_s``: from the
calls to the last rank's last byte). The last stdout line is one JSON object:
``model_bytes``, ``link_gbit``, ``readers``, ``tp``, ``single_s``, ``last_s`` (bests over the
repetitions), ``last_over_single`` (goal of issue 24: at most 1.3), ``exact`` (every rank held
exactly its slice every time), ``bytes_ratio`` (bytes a rank received / bytes of its slice,
the worst), ``chains`` (per replica: the replicas its ranks read from, as ``T`` for the
trainer and ``r<i>``), ``done_s`` (per replica: when its last rank finished, from the call)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import ray
import torch

import tensorhub
from tensorhub import placement as P
from tensorhub.testing import layouts

MODEL = "reshard-pipeline"
# versions_retained=1: a reader moving to v+1 never offloads v to host memory (that copy would
# be timed too); checksums on (the resharded read checks cells).
CONFIG = dict(checksums=True, versions_retained=1, lease_timeout_s=60.0, heartbeat_interval_s=1.0)


class Rank:
    """One rank of a replica: its tensors in its placement, one handle."""

    def __init__(self, schema: P.Schema, placement: P.Placement, replica: str, rank: int, ranks: int,
                 config: dict, layout_key: str = "") -> None:
        self.schema, self.placement = schema, placement
        self.tensors = [torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in placement.tensors]
        for t in self.tensors:  # first touch is slow on this VM: not inside a timed read
            t.fill_(1)
        self.hub = tensorhub.open(MODEL, replica=replica, shard=rank, num_shards=ranks,
                                  config=tensorhub.Config(**config))
        self.hub.register(list(zip(placement.names, self.tensors)), placement=placement, layout_key=layout_key)

    def client_id(self) -> str:
        return self.hub.client_id

    def publish(self, version: int) -> int:
        """The trainer: drain, write version ``version``, publish. Returns the bytes published."""
        self.hub.unpublish()
        for t, want in zip(self.tensors, layouts.slice_of(self.placement, layouts.model_at(self.schema, version))):
            t.copy_(want)
        self.hub.publish(version)
        return sum(t.nbytes for t in self.tensors)

    def update(self, version: int) -> dict:
        """An engine rank: ``update(version)``; its stats and when it ended (``time.time()``)."""
        st = self.hub.update(version)
        done_at = time.time()
        return {"version": st.version, "bytes": st.bytes, "sources": list(st.sources), "done_at": done_at,
                "finished_at": st.finished_at, "failovers": st.failovers,
                "slice_bytes": sum(t.nbytes for t in self.tensors)}

    def exact(self, version: int) -> bool:
        """Whether this rank holds exactly its slice of ``version`` (after the timed part)."""
        want = layouts.slice_of(self.placement, layouts.model_at(self.schema, version))
        return all(torch.equal(t, w) for t, w in zip(self.tensors, want))

    def close(self) -> None:
        self.hub.close(drop_last_copy=True)


RankActor = ray.remote(num_cpus=0)(Rank)


def run(args) -> dict:
    from tensorhub.emucluster import EmulatedCluster

    cluster = EmulatedCluster.attach(args.cluster)
    if cluster.spec.hosts < args.readers + 1:
        raise SystemExit(f"the cluster has {cluster.spec.hosts} hosts; {args.readers + 1} are needed")
    schema = layouts.llama_schema(args.layers, args.hidden, vocab=args.vocab)
    model_bytes = sum(t.nbytes for t in schema.tensors)
    cfg = dict(CONFIG, namespace=f"th-reshard-pipeline-{int(time.time() * 1000) % 10**8}")
    t0 = time.perf_counter()
    trainer = RankActor.options(**cluster.on(0)).remote(schema, layouts.fsdp(schema, 0, 1), "trainer", 0, 1, cfg)
    ray.get(trainer.client_id.remote())  # the trainer opens first: the server sits on its host
    readers = [[RankActor.options(**cluster.on(i + 1)).remote(schema, layouts.vllm_tp(schema, k, args.tp),
                                                              f"r{i}", k, args.tp, cfg, f"vllm-tp{args.tp}")
                for k in range(args.tp)] for i in range(args.readers)]
    ids = {ray.get(trainer.client_id.remote()): "T"}
    for i, ranks in enumerate(readers):
        for a in ranks:
            ids[ray.get(a.client_id.remote())] = f"r{i}"
    print(f"{len(ids)} ranks on {args.readers + 1} hosts in {time.perf_counter() - t0:.1f}s; model "
          f"{model_bytes / 2**20:.1f} MiB, {len(schema.tensors)} tensors, TP={args.tp}", file=sys.stderr, flush=True)
    version = 0
    singles, lasts, exact, ratio, chains, done_s, failovers = [], [], True, 1.0, [], [], []

    def round_of(group: list[list]) -> tuple[float, list[list[dict]]]:
        nonlocal version, exact, ratio
        version += 1
        ray.get(trainer.publish.remote(version))
        t = time.time()
        refs = [[a.update.remote(version) for a in ranks] for ranks in group]
        outs = [ray.get(rs) for rs in refs]
        last = max(o["done_at"] for os_ in outs for o in os_) - t
        exact = exact and all(ray.get([a.exact.remote(version) for ranks in group for a in ranks]))
        exact = exact and all(o["version"] == version for os_ in outs for o in os_)
        ratio = max(ratio, *(o["bytes"] / o["slice_bytes"] for os_ in outs for o in os_))
        return last, [[dict(o, done_s=o["done_at"] - t) for o in os_] for os_ in outs]

    for rep in range(args.reps):
        single, _ = round_of(readers[:1])
        last, outs = round_of(readers)
        singles.append(single)
        lasts.append(last)
        chains = [sorted({ids.get(s, "?") for o in os_ for s in o["sources"]}) for os_ in outs]
        failovers = [sum(o["failovers"] for o in os_) for os_ in outs]
        done_s = [round(max(o["done_s"] for o in os_), 3) for os_ in outs]
        print(f"rep {rep}: single {single:.2f}s, {args.readers} readers: last {last:.2f}s "
              f"({last / single:.2f}x); chains {chains}; done {done_s}; failovers {failovers}; "
              f"sources {[[[ids.get(s, '?') for s in o['sources']] for o in os_] for os_ in outs]}",
              file=sys.stderr, flush=True)
    ray.get([a.close.remote() for ranks in readers for a in ranks])
    ray.get(trainer.close.remote())
    single, last = min(singles), min(lasts)
    return {"bench": "reshard_pipeline", "model_bytes": model_bytes, "link_gbit": cluster.spec.gbit,
            "readers": args.readers, "tp": args.tp, "reps": args.reps,
            "single_s": round(single, 3), "last_s": round(last, 3),
            "last_over_single": round(last / single, 3), "goal_last_over_single": 1.3,
            "line_rate_s": round(model_bytes * 8 / (cluster.spec.gbit * 1e9), 3),
            "exact": exact, "bytes_ratio": round(ratio, 4), "chains": chains, "done_s": done_s, "failovers": failovers,
            "singles_s": [round(x, 3) for x in singles], "lasts_s": [round(x, 3) for x in lasts]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", required=True, help="the emulated cluster's name (its state file)")
    ap.add_argument("--readers", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args(argv)
    ray.init(log_to_driver=False)
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
