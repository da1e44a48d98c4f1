"""verl's weight update through the TensorHub checkpoint engine vs verl's own CPU backend.

    python benchmarks/verl_backend.py --json [--bytes 256MiB] [--gbit 1.0] [--rollouts 8] [--reps 2]
                                      [--local]

One trainer rank on host 0 and ``--rollouts`` rollout ranks on hosts 1..N of an emulated cluster
(:mod:`tensorhub.emucluster`: one network namespace, raylet and rate-limited NIC per host;
needs root), or with ``--local`` on one local Ray cluster (no links, no byte counters). Every rank
builds its checkpoint engines as verl 0.9 does (``CheckpointEngineConfig``, ``custom_backend_module``
imported, ``CheckpointEngineRegistry.new``). One update of a bf16 transformer-shaped model:

  tensorhub  the manager's order: prepare on all, ``build_topology``, ``init_process_group``,
             trainer ``send_weights`` with every rollout's ``receive_weights`` at once (each
             rollout's server adapter copies what it yields into its own "engine" tensors), then
             ``finalize``. The first update (buffers allocated and registered) is reported apart
             (``first_s``); ``--reps`` further updates are measured.
  naive      verl's ``naive`` backend: the only one of verl's that runs without a GPU here (nccl
             and nixl import cupy, hccl and delta zmq, mooncake and kimi their own packages). It is
             the colocated hand-over (``send_weights`` keeps the generator, ``receive_weights``
             yields from it in the same process) and moves no bytes between processes, so the
             trainer's tensors reach each rollout host through Ray's object store (``ray.put``
             once on the trainer, each rollout ``ray.get``s it), and each rollout runs naive's
             send/receive on them into the same adapter.

Measured per update: ``s`` from the start until every rollout's adapter holds the weights (the
last rollout's finish time), each rollout's bytes verified (digest of its engine tensors against
the trainer's), and the bytes each rollout host's NIC received (and the trainer host sent) during
the update. The last stdout line with ``--json`` is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

from benchmarks.bench_actors import parse_bytes  # noqa: E402 - after the sys.path line

MODEL = "bench-verl"
BACKENDS = ("tensorhub", "naive")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class VerlRank:
    """One rank's process: the trainer (holding the model) or a rollout (holding its inference
    engine's tensors, which the server adapter loads). Engines are built as verl's workers build
    them, one per backend."""

    def __init__(self, spec) -> None:
        import torch

        from tensorhub.testing import workload

        torch.set_num_threads(1)
        self.tensors = workload.allocate(spec)  # trainer: the model; rollout: the engine's weights
        self.by_name = dict(self.tensors)
        self.engines = {}

    def ping(self) -> str:
        import ray

        import tensorhub

        return f"{ray.util.get_node_ip_address()} {tensorhub.__file__}"

    def new(self, checkpoint_engine: dict, is_master=None) -> None:
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs
        from verl.workers.config import CheckpointEngineConfig

        cfg = CheckpointEngineConfig(**checkpoint_engine)
        import_external_libs(cfg.custom_backend_module or None)
        kwargs = dict(cfg.engine_kwargs.get(cfg.backend, {}))
        if is_master is not None:
            kwargs["is_master"] = is_master
        self.engines[cfg.backend] = CheckpointEngineRegistry.new(
            cfg.backend, bucket_size=cfg.update_weights_bucket_megabytes << 20, **kwargs)

    def execute(self, backend: str, method: str, *args, **kwargs):  # execute_checkpoint_engine
        return getattr(self.engines[backend], method)(*args, **kwargs)

    def fill(self, step: int) -> str:
        """Trainer: a training step's new weights; their digest."""
        from tensorhub.testing import workload

        workload.fill_version([t for _, t in self.tensors], step)
        return workload.digest([t for _, t in self.tensors])

    async def send(self, step: int) -> dict:
        gen = ((name, t) for name, t in self.tensors)  # verl: actor.engine.get_per_tensor_param()
        return await self.engines["tensorhub"].send_weights(gen, global_steps=step)

    async def receive(self, step: int) -> dict:
        """CheckpointEngineWorker.update_weights: the server adapter loads what the engine yields."""
        t0 = time.time()
        async for name, t in self.engines["tensorhub"].receive_weights(global_steps=step):
            self.by_name[name].copy_(t)
        done = time.time()
        reads = self.engines["tensorhub"].last_reads
        return {"done_at": done, "t0": t0, "digest": self._digest(),
                "sources": [list(r.sources) for r in reads], "bytes_read": sum(r.bytes for r in reads)}

    def naive_put(self) -> list:
        import ray

        return [ray.put(list(self.tensors))]

    async def naive_receive(self, refs: list) -> dict:
        t0 = time.time()
        pairs = await refs[0]
        engine = self.engines["naive"]
        engine.send_weights((p for p in pairs))  # naive: keeps the generator...
        for name, t in engine.receive_weights():  # ...and yields from it, in this process
            self.by_name[name].copy_(t)
        done = time.time()
        del pairs
        return {"done_at": done, "t0": t0, "digest": self._digest()}

    def _digest(self) -> str:
        from tensorhub.testing import workload

        return workload.digest([t for _, t in self.tensors])


class Bench:
    def __init__(self, args) -> None:
        import ray

        from tensorhub.testing import workload

        self.args, self.ray = args, ray
        self.spec = workload.transformer_spec(args.bytes, layers=8)
        self.nbytes = workload.spec_bytes(self.spec)
        self.cluster = None
        if not args.local:
            from tensorhub.emucluster import EmulatedCluster

            self.cluster = EmulatedCluster.attach(args.name)
        # versions_retained=1: a rollout moving to v+1 never offloads v, so no host buffer is made
        # ahead either (host_copies_pooled=0): nine processes on one VM, memory is the limit.
        th_config = dict(versions_retained=1, host_copies_pooled=0, lease_timeout_s=60.0, heartbeat_interval_s=1.0,
                         namespace=f"tensorhub-verl-{int(time.time())}")
        self.ce = {
            "tensorhub": {"backend": "tensorhub", "custom_backend_module": "tensorhub.integrations.verl",
                          "update_weights_bucket_megabytes": 512,
                          "engine_kwargs": {"tensorhub": {"model": MODEL, "config": th_config}}},
            "naive": {"backend": "naive", "update_weights_bucket_megabytes": 512, "engine_kwargs": {}},
        }
        Actor = ray.remote(num_cpus=0)(VerlRank)

        def place(h: int) -> dict:
            return {} if args.local else {"resources": {f"host-{h}": 0.01}}

        t = time.perf_counter()
        self.actors = [Actor.options(name=f"verl-{'trainer' if h == 0 else f'rollout-{h - 1}'}-{os.getpid()}",
                                     **place(h)).remote(self.spec)
                       for h in range(args.rollouts + 1)]
        where = ray.get([a.ping.remote() for a in self.actors])
        assert all(_REPO in w for w in where), f"actors import another tensorhub: {where}"
        for backend in args.backends:
            ray.get([a.new.remote(self.ce[backend], is_master=True if i == 0 else None)
                     for i, a in enumerate(self.actors)])
        self.trainer, self.rollouts = self.actors[0], self.actors[1:]
        say(f"{len(self.actors)} ranks on {[w.split()[0] for w in where]} in {time.perf_counter() - t:.1f}s; "
            f"{self.nbytes / 2**20:.1f} MiB in {len(self.spec)} tensors")
        self.step = 0

    def counters(self) -> dict:
        if self.cluster is None:
            return {}
        return {h: self.cluster.nic_bytes(h) for h in range(self.args.rollouts + 1)}

    def settle(self, quiet_bytes: int = 1 << 20, timeout_s: float = 60.0) -> float:
        """Wait until no host's NIC moves more than ``quiet_bytes`` in a second (Ray's object
        manager may still be pushing chunks of a transfer whose ``ray.get`` returned); the wait."""
        if self.cluster is None:
            return 0.0
        t0 = time.monotonic()
        prev = self.counters()
        while time.monotonic() - t0 < timeout_s:
            time.sleep(1.0)
            now = self.counters()
            moved = max(now[h].sent + now[h].received - prev[h].sent - prev[h].received for h in now)
            if moved < quiet_bytes:
                break
            prev = now
        return time.monotonic() - t0

    def traffic(self, before: dict) -> dict:
        if self.cluster is None:
            return {"rollout_host_received_bytes": None, "trainer_host_sent_bytes": None}
        after = self.counters()
        return {"rollout_host_received_bytes": [after[h].received - before[h].received
                                                for h in range(1, self.args.rollouts + 1)],
                "trainer_host_sent_bytes": after[0].sent - before[0].sent}

    def run(self, backend: str) -> dict:
        ray = self.ray
        self.step += 1
        step = self.step
        want = ray.get(self.trainer.fill.remote(step))
        settle_s = self.settle()
        before = self.counters()
        if backend == "tensorhub":
            from verl.checkpoint_engine import CheckpointEngineRegistry
            from verl.utils.import_utils import import_external_libs

            import_external_libs(self.ce[backend]["custom_backend_module"])  # as CheckpointEngineManager
            cls = CheckpointEngineRegistry.get(backend)
            t = time.time()
            everyone = self.actors
            metadata = ray.get([a.execute.remote("tensorhub", "prepare") for a in everyone])
            tk, rk = cls.build_topology(1, len(self.rollouts), metadata)
            ray.get([self.trainer.execute.remote("tensorhub", "init_process_group",
                                                 **{k: v[0] for k, v in tk.items()})]
                    + [a.execute.remote("tensorhub", "init_process_group", **{k: v[i] for k, v in rk.items()})
                       for i, a in enumerate(self.rollouts)])
            connect_s = time.time() - t
            t0 = time.time()
            refs = [self.trainer.send.remote(step)] + [a.receive.remote(step) for a in self.rollouts]
            outs = ray.get(refs)[1:]
            ray.get([a.execute.remote("tensorhub", "finalize") for a in everyone])
            extra = {"connect_s": round(connect_s, 3), "bytes_read": [o["bytes_read"] for o in outs],
                     "chain": " ".join(f"r{i}<{'/'.join(self._name(s) for s in o['sources'][0])}"
                                       for i, o in enumerate(outs))}
        else:
            t0 = time.time()
            refs = ray.get(self.trainer.naive_put.remote())
            outs = ray.get([a.naive_receive.remote(refs) for a in self.rollouts])
            del refs
            extra = {}
        last = max(o["done_at"] for o in outs) - t0
        ok = all(o["digest"] == want for o in outs)
        row = {"backend": backend, "step": step, "s": round(last, 3),
               "mean_s": round(statistics.mean(o["done_at"] - t0 for o in outs), 3), "bytes_ok": ok,
               "settle_s": round(settle_s, 1), **self.traffic(before), **extra}
        say(f"{backend} step {step}: {last:.2f} s (bytes ok: {ok}) {extra.get('chain', '')}")
        return row

    def _name(self, client_id: str) -> str:
        return "T" if "/verl-trainer/" in client_id else client_id.split("/")[1][-4:]


def drive(args) -> dict:
    import ray

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))}
    if args.local:
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    else:
        ray.init(log_to_driver=False, runtime_env={"env_vars": env})
    bench = Bench(args)
    rows = []
    first = None
    if "tensorhub" in args.backends:
        first = bench.run("tensorhub")  # allocates and registers the buffers
    for _ in range(args.reps):
        for backend in args.backends:
            rows.append(bench.run(backend))
    out = {"name": "verl_backend", "cluster": "local" if args.local else "emulated",
           "link_gbit": None if args.local else args.gbit, "rollouts": args.rollouts, "bytes": bench.nbytes,
           "tensors": len(bench.spec), "line_rate_s": None if args.local else round(bench.nbytes * 8 / (args.gbit * 1e9), 3),
           "first_update": first, "runs": rows}
    for backend in args.backends:
        mine = [r for r in rows if r["backend"] == backend]
        out[f"{backend}_s"] = statistics.median(r["s"] for r in mine)
        if mine[-1]["rollout_host_received_bytes"] is not None:
            out[f"{backend}_rollout_received_bytes_max"] = max(max(r["rollout_host_received_bytes"]) for r in mine)
            out[f"{backend}_trainer_sent_bytes"] = statistics.median(r["trainer_host_sent_bytes"] for r in mine)
    if set(BACKENDS) <= set(args.backends):
        out["naive_over_tensorhub"] = round(out["naive_s"] / out["tensorhub_s"], 2)
    out["bytes_ok"] = all(r["bytes_ok"] for r in rows + ([first] if first else []))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=parse_bytes, default=256 << 20)
    ap.add_argument("--gbit", type=float, default=1.0, help="every host's NIC, each direction")
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2, help="measured updates per backend")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--local", action="store_true", help="a local Ray cluster instead of the emulated one")
    ap.add_argument("--json", action="store_true", help="print the JSON summary as the last stdout line")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # inside the cluster
    ap.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="thvrl", help="emulated cluster name")
    args = ap.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    if any(b not in BACKENDS for b in args.backends) or args.rollouts < 1 or args.reps < 1:
        ap.error(f"--backends from {BACKENDS}, --rollouts >= 1, --reps >= 1")

    if args.driver or args.local:
        summary = drive(args)
        # the driver's (and --json's) last stdout line is the summary; --local without --json: readable
        print(json.dumps(summary) if args.json or args.driver else json.dumps(summary, indent=1), flush=True)
        return 0 if summary["bytes_ok"] else 1

    from benchmarks import emulated

    say(f"building an emulated cluster: {args.rollouts + 1} hosts at {args.gbit} Gbit/s")
    summary = emulated.run_driver(__file__, argv, args.json, hosts=args.rollouts + 1, gbit=args.gbit,
                                  name=args.name, subnet="10.72.0.0/16")
    return emulated.report(summary, args.json) or (0 if summary["bytes_ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
