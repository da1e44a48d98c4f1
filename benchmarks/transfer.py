"""One holder, one reader, two Ray actors: TensorHub pull vs memcpy, object store and RDT/NIXL.

    python benchmarks/transfer.py --json [--bytes N] [--reps 5]

Human lines go to stderr, with a live progress display when it is a terminal (not with
``--json``); the last stdout line is one JSON object with medians (GB/s), per-path min/max and
ratios measured in the same run (these machines are noisy: compare ratios).
Paths:
  tensorhub     Region + pull between the actors (checksums off; one extra run with checksums on)
  same_host     the same-host tier between the actors: the holder's shared memory mapped by the
                reader, units copied by ``same_host_threads`` threads (checksums off, then on)
  memcpy        warm one-thread torch ``copy_`` of the same tensors inside the reader actor
  object_store  holder ``ray.put`` -> reader ``ray.get`` + ``copy_`` into preallocated tensors
  rdt_nixl      Ray Direct Transport (``tensor_transport="nixl"``), called by the reader,
                received into its preallocated tensors via ``set_target_for_ref`` when possible
  raw_nixl      one NIXL READ of the same bytes with one descriptor list (a descriptor per
                tensor), by bare NIXL agents: no TensorHub code, the transport's own ceiling
  replicate_same_host[_checksums]
                what a user gets: ``hub.replicate(v)`` between two ReplicaActors with the default
                config (reference-server round trips included) but checksums off, then on (the
                default; ``replicate_gbps`` repeats it), timed by the call; both actors run on
                this host, so this is the same-host tier

Every NIXL agent in these actors (RDT's and the raw ones too) gets TensorHub's progress-thread
delay (NIXL's wrapper uses 0 and would spin a core per agent), so no path pays for another's spin.
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

import ray
import torch

from benchmarks.bench_actors import patch_nixl_progress_delay
from tensorhub import progress
from tensorhub.config import Config
from tensorhub.layout import Layout, checksum_all, unit_size_for

log = logging.getLogger("benchmarks.transfer")


def make_shapes(total: int) -> list[tuple[str, int]]:
    """(name, float32 element count): ~2% tiny tensors (4-60 KiB), the rest 12 uneven large ones."""
    shapes, used, i = [], 0, 0
    tiny_budget = total // 50
    while used < tiny_budget:
        n = (1024 + (i * 2311) % 15000)
        shapes.append((f"tiny.{i}", n))
        used += 4 * n
        i += 1
    rest = (total - used) // 4
    weights = [3, 5, 8, 2, 7, 4, 6, 9, 3, 5, 8, 4]
    for j, w in enumerate(weights):
        n = rest * w // sum(weights) if j < len(weights) - 1 else rest - sum(s for _, s in shapes[i:])
        shapes.append((f"layer.{j}.weight", n))
    return shapes


def _tensors(shapes, fill: bool, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _, n in shapes:
        t = torch.empty(n, dtype=torch.float32)
        if fill:
            t.uniform_(-1, 1, generator=g)
        else:
            t.fill_(0)  # touch every page now, not inside a timed region
        out.append(t)
    return out


def _raw_agent(name: str):
    """A bare NIXL agent with the UCX backend (no TensorHub code)."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Holder:
    def __init__(self, shapes, cfg_kwargs):
        torch.set_num_threads(1)
        patch_nixl_progress_delay()
        from tensorhub.transport import Region

        self.cfg = Config.from_env(**cfg_kwargs)
        self.tensors = _tensors(shapes, fill=True)
        self.layout = Layout.for_config(list(zip([n for n, _ in shapes], self.tensors)), self.cfg)
        self.sums = checksum_all(self.tensors, self.layout)
        self.region = Region.register(self.tensors, self.layout, self.cfg)
        self.region.publish_complete(1, self.sums)
        try:
            from ray.experimental import register_nixl_memory
            for t in self.tensors:
                register_nixl_memory(t)
            self.rdt_registered = True
        except Exception as e:  # noqa: BLE001 - baseline falls back to per-call registration
            print(f"holder: RDT pre-registration failed: {e!r}", file=sys.stderr)
            self.rdt_registered = False

    def endpoint(self) -> bytes:
        from tensorhub.transport import encode_endpoint
        return encode_endpoint(self.region.endpoint())

    def checksums(self) -> list[int]:
        return self.sums

    def raw_nixl_setup(self) -> tuple[bytes, bytes]:
        """A bare agent with the tensors registered: (agent metadata, serialized descriptors)."""
        self.raw = _raw_agent(f"raw-holder-{os.getpid()}")
        self.raw_reg = self.raw.register_memory(self.tensors)
        return self.raw.get_agent_metadata(), self.raw.get_serialized_descs(self.raw.get_xfer_descs(self.tensors))

    def raw_nixl_release(self) -> None:
        """Drop the bare agent: its UCX progress thread polls a whole core while it lives."""
        if getattr(self, "raw", None) is not None:
            self.raw.deregister_memory(self.raw_reg)
        self.raw = self.raw_reg = None

    def put(self):
        return [ray.put(self.tensors)]

    @ray.method(tensor_transport="nixl")
    def rdt_tensors(self):
        return self.tensors


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Reader:
    def __init__(self, shapes, cfg_kwargs):
        torch.set_num_threads(1)
        patch_nixl_progress_delay()
        from tensorhub.transport import Region

        self.cfg = Config.from_env(**cfg_kwargs)
        self.shapes = shapes
        self.tensors = _tensors(shapes, fill=False)
        self.layout = Layout.for_config(list(zip([n for n, _ in shapes], self.tensors)), self.cfg)
        self.region = Region.register(self.tensors, self.layout, self.cfg)
        self.source = None
        self.memcpy_src = None
        self.rdt_target_ok = None

    def zero(self) -> None:
        for t in self.tensors:
            t.zero_()

    def verify(self, expected: list[int]) -> bool:
        return checksum_all(self.tensors, self.layout) == expected

    def tensorhub(self, endpoint: bytes, checksums: bool) -> float:
        from tensorhub.transport import open_source, pull

        if self.source is None:
            self.source = open_source(endpoint, config=self.cfg)
        cfg = self.cfg.replace(checksums=checksums)
        t0 = time.perf_counter()
        n = pull(self.region, self.source, self.layout, expect_version=1, config=cfg)
        dt = time.perf_counter() - t0
        assert n == self.layout.total_bytes
        return dt

    def same_host(self, endpoint: bytes, checksums: bool) -> float:
        """The same-host tier: the holder's memory mapped here, units copied by threads."""
        from tensorhub.transport import decode_endpoint, shm

        if getattr(self, "near", None) is None:
            self.near = shm.ShmSource(decode_endpoint(endpoint).shm)
        cfg = self.cfg.replace(checksums=checksums)
        t0 = time.perf_counter()
        n = shm.pull(self.region, self.near, self.layout, expect_version=1, config=cfg)
        dt = time.perf_counter() - t0
        assert n == self.layout.total_bytes
        return dt

    def raw_nixl(self, metadata: bytes, descs: bytes) -> float:
        """One READ of every tensor (one descriptor list) by bare NIXL agents."""
        if getattr(self, "raw", None) is None:
            self.raw = _raw_agent(f"raw-reader-{os.getpid()}")
            self.raw_reg = self.raw.register_memory(self.tensors)
            peer = self.raw.add_remote_agent(metadata)
            self.raw_xfer = self.raw.initialize_xfer(
                "READ", self.raw.get_xfer_descs(self.tensors), self.raw.deserialize_descs(descs), peer)
        t0 = time.perf_counter()
        state = self.raw.transfer(self.raw_xfer)
        while state == "PROC":
            state = self.raw.check_xfer_state(self.raw_xfer)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL read failed: {state}")
        return time.perf_counter() - t0

    def raw_nixl_release(self) -> None:
        """Drop the bare agent: its UCX progress thread polls a whole core while it lives."""
        if getattr(self, "raw", None) is not None:
            self.raw.release_xfer_handle(self.raw_xfer)
            self.raw.deregister_memory(self.raw_reg)
        self.raw = self.raw_reg = self.raw_xfer = None

    def memcpy(self) -> float:
        if self.memcpy_src is None:
            self.memcpy_src = [t.clone() for t in self.tensors]
            for s in self.memcpy_src:
                s.add_(1)  # differ from the destination so the check below means something
            for d, s in zip(self.tensors, self.memcpy_src):  # warm both sides
                d.copy_(s)
            assert all(torch.equal(d, s) for d, s in zip(self.tensors, self.memcpy_src))
        t0 = time.perf_counter()
        for d, s in zip(self.tensors, self.memcpy_src):
            d.copy_(s)
        return time.perf_counter() - t0

    def drop_memcpy(self) -> None:
        self.memcpy_src = None

    def object_store(self, holder) -> float:
        t0 = time.perf_counter()
        ref = ray.get(holder.put.remote())[0]
        src = ray.get(ref)
        for d, s in zip(self.tensors, src):
            d.copy_(s)
        dt = time.perf_counter() - t0
        del src, ref
        return dt

    def rdt(self, holder) -> float:
        from ray.experimental import set_target_for_ref

        t0 = time.perf_counter()
        ref = holder.rdt_tensors.remote()
        if self.rdt_target_ok is not False:
            try:
                set_target_for_ref(ref, self.tensors)
                got = ray.get(ref)
                self.rdt_target_ok = True
                if got[0].data_ptr() != self.tensors[0].data_ptr():
                    for d, s in zip(self.tensors, got):
                        d.copy_(s)
                dt = time.perf_counter() - t0
                return dt
            except Exception as e:  # noqa: BLE001
                print(f"reader: set_target_for_ref failed ({e!r}); copying instead", file=sys.stderr)
                self.rdt_target_ok = False
                t0 = time.perf_counter()
                ref = holder.rdt_tensors.remote()
        got = ray.get(ref)
        for d, s in zip(self.tensors, got):
            d.copy_(s)
        return time.perf_counter() - t0


def _stats(nbytes: int, secs: list[float]) -> dict:
    gbps = [nbytes / s / 1e9 for s in secs]
    return {"median": statistics.median(gbps), "min": min(gbps), "max": max(gbps),
            "runs": [round(g, 3) for g in gbps]}


def _replicate(shapes, nbytes: int, reps: int, say, tick=lambda: None, name: str = "replicate",
               **config) -> dict:
    """``hub.replicate(v)`` between two ReplicaActors on this host (the same-host tier), the
    default config but ``config``, timed by the call; ``tick()`` after each of the ``reps + 1``
    calls."""
    from tensorhub.testing.replica import ReplicaActor

    spec = [(n, "float32", (k,)) for n, k in shapes]
    ns = f"tensorhub-bench-transfer-{os.getpid()}-{name}"
    cfg = dict(namespace=ns, **config)
    trainer, reader = [ReplicaActor.options(name=f"tensorhub-replica-transfer-{name}-{n}").remote(
        f"bench-transfer-{name}", spec, replica=n, config=cfg) for n in ("trainer", "reader")]
    ray.get([trainer.ping.remote(), reader.ping.remote()])
    secs = []
    for v in range(1, reps + 2):  # the first run warms up (connects, first touch)
        ray.get(reader.unpublish.remote())
        digest = ray.get(trainer.publish.remote(v))
        st = ray.get(reader.replicate.remote(v))
        tick()
        if st["digest"] != digest:
            raise SystemExit("replicate: received bytes differ from the trainer's")
        if v > 1:
            secs.append(st["seconds"])
    ray.get([reader.close.remote(), trainer.close.remote()])
    for a in (reader, trainer):  # nothing of them left running beside the later stages
        ray.kill(a)
    out = _stats(nbytes, secs)
    say(f"{name:>22}: median {out['median']:.2f} GB/s (min {out['min']:.2f}, max {out['max']:.2f}) "
        "bytes verified (digest)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1 << 30)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--unit-bytes", type=int, default=Config.unit_bytes)
    ap.add_argument("--reads-in-flight", type=int, default=Config.reads_in_flight)
    ap.add_argument("--skip", default="", help="comma list of paths to skip: same_host,object_store,rdt_nixl,raw_nixl,replicate")
    ap.add_argument("--json", action="store_true", help="print the JSON summary line on stdout (no live progress)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def say(msg):
        print(msg, file=sys.stderr, flush=True)

    shapes = make_shapes(args.bytes)
    nbytes = 4 * sum(n for _, n in shapes)
    cfg_kwargs = dict(unit_bytes=args.unit_bytes, reads_in_flight=args.reads_in_flight)
    skip = set(filter(None, args.skip.split(",")))
    pythonpath = os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))
    ray.init(include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
             object_store_memory=max(2 * nbytes + (256 << 20), 1 << 30))
    paths = ["memcpy", "tensorhub", "tensorhub_checksums", "same_host", "same_host_checksums", "object_store",
             "rdt_nixl", "raw_nixl", "replicate_same_host", "replicate_same_host_checksums", "memcpy_end"]
    planned = [p for p in paths if p.removesuffix("_checksums").removesuffix("_same_host") not in skip]
    bar = progress.live(json_mode=args.json)
    task = bar.add_task("transfers", total=len(planned) * (args.reps + 1))  # a warm-up call per path
    bar.start()
    try:
        holder = Holder.remote(shapes, cfg_kwargs)
        reader = Reader.remote(shapes, cfg_kwargs)
        expected = ray.get(holder.checksums.remote())
        endpoint = ray.get(holder.endpoint.remote())
        unit = unit_size_for(nbytes, args.unit_bytes, Config.unit_bytes_min, Config.unit_count_target)
        say(f"{len(shapes)} tensors, {nbytes / 2**30:.2f} GiB, units of {unit >> 10} KiB (at most "
            f"{args.unit_bytes >> 20} MiB), at most {args.reads_in_flight} reads in flight")
        results: dict[str, dict] = {}

        def timed(fn):
            out = ray.get(fn())
            bar.advance(task)
            return out

        def run(name, fn, reps, verify=True):
            bar.update(task, description=name)
            ray.get(reader.zero.remote())
            secs = [timed(fn)]  # warm-up, also the one verified run
            ok = ray.get(reader.verify.remote(expected)) if verify else True
            if not ok:
                raise SystemExit(f"{name}: received bytes differ from the holder's")
            secs = [timed(fn) for _ in range(reps)]
            results[name] = _stats(nbytes, secs)
            r = results[name]
            say(f"{name:>22}: median {r['median']:.2f} GB/s (min {r['min']:.2f}, max {r['max']:.2f}) "
                + ("bytes verified" if verify else "(verified in-actor)"))

        run("memcpy", lambda: reader.memcpy.remote(), args.reps, verify=False)
        ray.get(reader.drop_memcpy.remote())
        run("tensorhub", lambda: reader.tensorhub.remote(endpoint, False), args.reps)
        run("tensorhub_checksums", lambda: reader.tensorhub.remote(endpoint, True), args.reps)
        if "same_host" not in skip:
            run("same_host", lambda: reader.same_host.remote(endpoint, False), args.reps)
            run("same_host_checksums", lambda: reader.same_host.remote(endpoint, True), args.reps)
        # replicate() before the baselines: a bare NIXL agent (raw_nixl) keeps its UCX progress
        # thread polling a whole core for as long as it lives (1.0 CPU-s/s idle, measured), one in
        # each actor: a checksummed replicate() measured after that stage ran at 7.97 GB/s against
        # 9.77 without it. The bare agents are also dropped after their stage.
        if "replicate" not in skip:
            for name, sums in (("replicate_same_host", False), ("replicate_same_host_checksums", True)):
                bar.update(task, description=name)
                results[name] = _replicate(shapes, nbytes, args.reps, say, tick=lambda: bar.advance(task), name=name,
                                           checksums=sums)
        if "object_store" not in skip:
            run("object_store", lambda: reader.object_store.remote(holder), args.reps)
        if "rdt_nixl" not in skip:
            run("rdt_nixl", lambda: reader.rdt.remote(holder), args.reps)
        if "raw_nixl" not in skip:
            md, descs = ray.get(holder.raw_nixl_setup.remote())
            run("raw_nixl", lambda: reader.raw_nixl.remote(md, descs), args.reps)
            ray.get([reader.raw_nixl_release.remote(), holder.raw_nixl_release.remote()])
        # memcpy again at the end: the machine drifts; report the better of the two medians
        run("memcpy_end", lambda: reader.memcpy.remote(), args.reps, verify=False)
        ray.get(reader.drop_memcpy.remote())
    finally:
        bar.stop()
        ray.shutdown()

    def med(k):
        return results[k]["median"] if k in results else None

    memcpy = max(med("memcpy"), med("memcpy_end"))
    th = med("tensorhub")
    out = {
        "name": "transfer",
        "bytes": nbytes,
        "tensors": len(shapes),
        "unit_bytes": args.unit_bytes,
        "unit_bytes_used": unit_size_for(nbytes, args.unit_bytes, Config.unit_bytes_min, Config.unit_count_target),
        "reads_in_flight": args.reads_in_flight,
        "reps": args.reps,
        "tensorhub_gbps": th,
        "tensorhub_checksums_gbps": med("tensorhub_checksums"),
        "memcpy_gbps": memcpy,
        "object_store_gbps": med("object_store"),
        "rdt_nixl_gbps": med("rdt_nixl"),
        "raw_nixl_gbps": med("raw_nixl"),
        "replicate_gbps": med("replicate_same_host_checksums"),
        "replicate_same_host_gbps": med("replicate_same_host"),
        "replicate_same_host_checksums_gbps": med("replicate_same_host_checksums"),
        "same_host_gbps": med("same_host"),
        "same_host_checksums_gbps": med("same_host_checksums"),
        "same_host_vs_memcpy": med("same_host") / memcpy if med("same_host") else None,
        "replicate_vs_memcpy": med("replicate_same_host_checksums") / memcpy if med("replicate_same_host_checksums") else None,
        "replicate_same_host_vs_memcpy": med("replicate_same_host") / memcpy if med("replicate_same_host") else None,
        "replicate_same_host_checksums_vs_memcpy": (med("replicate_same_host_checksums") / memcpy
                                                    if med("replicate_same_host_checksums") else None),
        "replicate_vs_raw_nixl": (med("replicate_same_host_checksums") / med("raw_nixl")
                                  if med("raw_nixl") and med("replicate_same_host_checksums") else None),
        "tensorhub_vs_memcpy": th / memcpy,
        "tensorhub_vs_object_store": th / med("object_store") if med("object_store") else None,
        "tensorhub_vs_rdt": th / med("rdt_nixl") if med("rdt_nixl") else None,
    }
    for k, r in results.items():
        out[f"{k}_min_gbps"] = r["min"]
        out[f"{k}_max_gbps"] = r["max"]
        out[f"{k}_runs_gbps"] = r["runs"]
    say(json.dumps(out, indent=None))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
