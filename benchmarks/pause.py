"""How long ``update()`` blocks a rollout engine: plain, after a completed prefetch, and a local copy.

    python benchmarks/pause.py --json [--gbit 1.0] [--bytes 512MiB] [--reps 3]

Builds an emulated cluster (:mod:`tensorhub.emucluster`: one network namespace, raylet and
rate-limited NIC per host; needs root) with the trainer on host 0 and the rollout on host 1 (its
own host: its bytes cross the emulated link), then runs itself as the driver (``--driver``). Per
repetition, in one run:

  plain       the trainer publishes version v; the rollout's ``update(v)`` fetches it across the
              link. Measured: the seconds the call blocked, timed around it inside the rollout's
              process.
  prefetched  the trainer publishes v+1; the rollout's ``prefetch(v+1)`` completes in the
              background (its engine would keep generating with v meanwhile: ``--gap-s``, also
              left between publish and the plain update); then ``update(v+1)`` is timed the same
              way: it only copies the staging copy into the registered tensors.
  local copy  a one-thread ``copy_`` of the same bytes in the rollout's process (registered
              tensors into a scratch buffer allocated and touched once): the floor, taken right
              before the timed update in the same actor call (the machine's noise hits both).

Every update is checked byte for byte against the trainer's digest. Medians over ``--reps``
(``prefetched_over_local_copy``: the median of the per-repetition ratios).
Human lines go to stderr (a live progress display on a terminal, not with ``--json``); the last
stdout line is one JSON object with ``bytes``, ``plain_update_s``, ``prefetched_update_s``,
``local_copy_s``, the goals' ratios (``prefetched_over_local_copy``: goal <= 1.2;
``plain_over_prefetched``: goal >= 5) and the per-repetition ``runs``.
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

MODEL = "bench-pause"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _rollout_class():
    import ray
    import torch

    from benchmarks.bench_actors import BenchReplica

    class PauseReplica(BenchReplica):
        """The rollout: a replica that can prefetch and time a local copy of its bytes."""

        def prefetch(self, spec) -> dict:
            st = self.hub.prefetch(spec).result()
            return {"version": st.version, "seconds": st.seconds, "bytes": st.bytes}

        def floor_then_update(self, spec) -> dict:
            """A local copy (the floor) and then the update, back to back in one call, so both
            see the same machine (a noisy 2-core VM)."""
            floor = self.local_copy(reps=1)
            out = self.update(spec)
            out["local_copy_s"] = floor
            out["torch_threads"] = torch.get_num_threads()
            return out

        def update(self, spec="latest") -> dict:
            """``update()``, with ``wall_s``: how long the call blocked, measured around it."""
            t0 = time.perf_counter()
            st = self.hub.update(spec)
            wall = time.perf_counter() - t0
            out = self._stats(st)
            out["wall_s"] = wall
            return out

        def local_copy(self, reps: int = 3) -> float:
            """Best of ``reps`` one-thread ``copy_`` of the registered tensors (same bytes as an
            update) into a scratch buffer allocated and touched once."""
            if not hasattr(self, "_scratch"):
                self._scratch = [torch.zeros_like(t) for t in self.tensors]
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                best = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter()
                    for d, s in zip(self._scratch, self.tensors):
                        d.copy_(s)
                    best = min(best, time.perf_counter() - t0)
            finally:
                torch.set_num_threads(threads)
            return best

    return ray.remote(num_cpus=0)(PauseReplica)


def drive(args) -> dict:
    import ray

    from tensorhub import progress
    from tensorhub.testing import workload

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    ray.init(log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))}})
    spec = workload.transformer_spec(args.bytes, layers=4)
    nbytes = workload.spec_bytes(spec)
    cfg = dict(checksums=True, lease_timeout_s=60.0, heartbeat_interval_s=1.0,
               namespace=f"tensorhub-pause-{int(time.time())}", **args.config)
    Actor = _rollout_class()
    trainer = Actor.options(name=f"tensorhub-replica-{MODEL}-trainer", resources={"host-0": 0.01}).remote(
        MODEL, spec, replica="trainer", config=cfg)
    rollout = Actor.options(name=f"tensorhub-replica-{MODEL}-rollout", resources={"host-1": 0.01}).remote(
        MODEL, spec, replica="rollout", config=cfg)
    ray.get([trainer.ping.remote(), rollout.ping.remote()])
    say(f"trainer on host 0, rollout on host 1: {nbytes / 2**20:.1f} MiB, {len(spec)} tensors, "
        f"link {args.gbit} Gbit/s")
    version = 0
    runs = []

    def publish() -> tuple[int, str]:
        nonlocal version
        version += 1
        return version, ray.get(trainer.publish.remote(version))

    # Warm-up (not measured): the first read opens the source, the first prefetch makes and
    # touches the staging copy.
    v, _ = publish()
    ray.get(rollout.update.remote(v))
    v, _ = publish()
    ray.get(rollout.prefetch.remote(v))
    ray.get(rollout.update.remote(v))
    with progress.live(json_mode=args.quiet) as bar:
        task = bar.add_task("repetitions", total=args.reps)
        for rep in range(args.reps):
            bar.update(task, description=f"rep {rep + 1}/{args.reps}: plain update")
            v, digest = publish()
            time.sleep(args.gap_s)
            plain = ray.get(rollout.update.remote(v))
            if plain["digest"] != digest or plain["prefetched"]:
                raise RuntimeError(f"plain update of {v}: bytes differ or read from a staging copy")
            bar.update(task, description=f"rep {rep + 1}/{args.reps}: prefetch")
            v, digest = publish()
            pre = ray.get(rollout.prefetch.remote(v))
            time.sleep(args.gap_s)  # the engine generates with the current version meanwhile
            bar.update(task, description=f"rep {rep + 1}/{args.reps}: update after prefetch")
            fast = ray.get(rollout.floor_then_update.remote(v))
            if fast["digest"] != digest or not fast["prefetched"]:
                raise RuntimeError(f"update of {v} after its prefetch: bytes differ or not from the staging copy")
            local = fast["local_copy_s"]
            run = {"plain_update_s": round(plain["wall_s"], 4), "prefetch_s": round(pre["seconds"], 4),
                   "prefetched_update_s": round(fast["wall_s"], 4), "prefetched_transfer_s": round(fast["transfer_s"], 4),
                   "local_copy_s": round(local, 4), "ratio": round(fast["wall_s"] / local, 3),
                   "torch_threads": fast["torch_threads"], "plain_offload_s": round(plain["offload_s"], 4),
                   "prefetched_offload_s": round(fast["offload_s"], 4)}
            say(f"rep {rep + 1}: plain {run['plain_update_s']:.3f}s, prefetch (background) "
                f"{run['prefetch_s']:.3f}s, update after prefetch {run['prefetched_update_s']:.4f}s, "
                f"local copy_ {run['local_copy_s']:.4f}s")
            runs.append(run)
            bar.advance(task)
    ray.get([rollout.close.remote(), trainer.close.remote()])
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "name": "pause", "link_gbit": args.gbit, "gap_s": args.gap_s, "bytes": nbytes, "tensors": len(spec), "reps": args.reps,
        "plain_update_s": round(med["plain_update_s"], 4),
        "prefetched_update_s": round(med["prefetched_update_s"], 4),
        "local_copy_s": round(med["local_copy_s"], 4),
        "prefetch_s": round(med["prefetch_s"], 4),
        "prefetched_over_local_copy": round(med["ratio"], 3),
        "plain_over_prefetched": round(med["plain_update_s"] / med["prefetched_update_s"], 2),
        "runs": runs,
    }


def _config_overrides(items: list[str], ap: argparse.ArgumentParser) -> dict:
    from benchmarks.fanout import _config_overrides as parse

    return parse(items, ap)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbit", type=float, default=1.0, help="every host's NIC, each direction")
    ap.add_argument("--bytes", type=parse_bytes, default=512 << 20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gap-s", type=float, default=0.5,
                    help="pause between a publish (plain) or a completed prefetch and the timed update: "
                         "the generation step the prefetch overlaps in an RL loop")
    ap.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a tensorhub Config field for both actors (repeatable)")
    ap.add_argument("--json", action="store_true", help="print the JSON summary as the last stdout line")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # inside the cluster
    ap.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # driver: no live progress (--json)
    ap.add_argument("--name", default="thpau", help="emulated cluster name")
    args = ap.parse_args(argv)
    args.config = _config_overrides(args.config, ap)

    if args.driver:
        print(json.dumps(drive(args)), flush=True)
        return 0

    from benchmarks import emulated

    say(f"building an emulated cluster: 2 hosts at {args.gbit} Gbit/s")
    summary = emulated.run_driver(__file__, argv, args.json, hosts=2, gbit=args.gbit, name=args.name)
    return emulated.report(summary, args.json)


if __name__ == "__main__":
    sys.exit(main())
