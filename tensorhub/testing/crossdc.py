"""Cross-datacenter jobs on an emulated cluster with datacenters (tests and ``benchmarks/crossdc.py``).

    RAY_ADDRESS=... python -m tensorhub.testing.crossdc SCENARIO --cluster NAME [--mib 16] ...

Run as a driver inside an emulated cluster (:meth:`tensorhub.emucluster.EmulatedCluster.
run_driver`): the trainer on datacenter 0's first host, readers on the other datacenters' hosts
(one Ray actor each, on its own host). The driver attaches to the cluster's state file to read
the inter-datacenter links' interface counters (bytes that really crossed) and to take a link
down. Every scenario prints one JSON line; the tests assert on it.

Scenarios:

  seed       one version: every remote reader ``update("latest")`` until it holds it. Bytes
             crossing each link, the readers' sources, their ``prefetched`` flags (every reader
             prefetches: the seeders across, the others behind them, ``prefetch_in_datacenter``).
  seed_delta the same with seeds as deltas: a bf16 version changed as an RL step does crosses
             as a fraction of the shard, and every reader holds it exactly.
  skip       version 1 everywhere; version 2 published: while its seed is in flight, remote
             readers' ``update("latest")`` return 1 with ``skipped_in_flight=2``; afterwards 2 is
             read inside the datacenter.
  seeder_dies  version 2's seeder dies mid-seed (its process: registered tensors and staging
             copy), frozen under a cut link, while another reader of its datacenter reads behind
             it: that reader fails over and finishes (resuming from its own progress), exact
             bytes; the server's table and the bytes crossed when the seeder died.
  link_down  the inter-datacenter link goes down mid-seed: readers keep getting the local version
             or a typed error within ``request_timeout_s``; when it comes back they all get the
             new version.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

import ray

from tensorhub.errors import TensorHubError
from tensorhub.testing import workload
from tensorhub.testing.replica import Replica

MODEL = "crossdc"
CONFIG = dict(unit_bytes=256 << 10, heartbeat_interval_s=0.5, lease_timeout_s=30.0, source_stall_timeout_s=5.0,
              request_timeout_s=30.0, versions_retained=3, same_host=False)


class DcReplica(Replica):
    """A replica that runs an engine's loop: generation steps and ``update("latest")``."""

    def timed_update(self, spec="latest") -> dict:
        """One ``update(spec)``: its stats, how long it blocked (``wall_s``) and how many calls
        it sent the server (``server_calls``: requests and notes fetches from this thread;
        0 when answered locally)."""
        calls0 = self.hub.server_calls()
        t0 = time.perf_counter()
        try:
            st = self.hub.update(spec)
        except TensorHubError as e:
            return {"ok": False, "error": type(e).__name__, "wall_s": time.perf_counter() - t0,
                    "message": str(e)[:300], "server_calls": self.hub.server_calls() - calls0}
        wall = time.perf_counter() - t0  # the engine's stall: not the digest taken for the checks
        calls = self.hub.server_calls() - calls0
        out = self._stats(st)
        out["ok"] = True
        out["wall_s"] = wall
        out["server_calls"] = calls
        return out

    def engine_loop(self, duration_s: float, gen_s: float) -> list[dict]:
        """Generation steps (sleeps) and ``update("latest")`` between them for ``duration_s``:
        per update, when it ended, the version, how long it blocked and what it did."""
        end = time.time() + duration_s
        out = []
        while time.time() < end:
            time.sleep(gen_s)
            r = self.timed_update("latest")
            out.append({k: r.get(k) for k in ("ok", "error", "version", "wall_s", "action", "skipped_in_flight",
                                              "prefetched", "cross_datacenter", "bytes", "done_at", "sources",
                                              "offload_s", "stall_s", "transfer_s", "server_calls")}
                       | {"t": time.time()})
        return out

    def publish_loop(self, first: int, count: int, step_s: float,
                     density: Optional[float] = None) -> list[tuple[int, float, int]]:
        """The trainer: publish ``count`` versions from ``first``, one per ``step_s``; each a
        fresh fill, or with ``density`` the previous one changed as an RL step does. Per version:
        (version, when published, bytes of its delta against the previous version as
        :mod:`tensorhub.transport.delta` encodes it; 0 without ``density``)."""
        from tensorhub.transport import delta

        out = []
        for v in range(first, first + count):
            t0 = time.time()
            prev = [t.clone() for t in self.tensors] if density is not None else None
            self.publish(v, density=density)
            published = time.time()
            nbytes = 0 if prev is None else len(delta.encode(delta.segments(prev), delta.segments(self.tensors)))
            out.append((v, published, nbytes))
            time.sleep(max(0.0, step_s - (time.time() - t0)))
        return out

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def server_node(self) -> str:
        """The node of this handle's reference server actor."""
        from tensorhub.server.find import find_server

        server = find_server(self.hub.config, self.hub.model)
        return ray.get(server.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id()))

    def staged(self) -> Optional[int]:
        stage = self.hub.staging
        return None if stage is None else stage.version

    def stage_reading(self) -> tuple[Optional[int], int, int]:
        """The staging copy's (version being read or held, units in place, units in all)."""
        stage = self.hub.staging
        return (None, 0, 0) if stage is None else stage.reads.progress()


Actor = ray.remote(num_cpus=0)(DcReplica)


class Setup:
    def __init__(self, args, config: Optional[dict] = None, per_dc_names: bool = False) -> None:
        from tensorhub.emucluster import EmulatedCluster

        self.cluster = EmulatedCluster.attach(args.cluster)
        self.spec = workload.small_spec(args.mib << 20, big=4, tiny=8, dtype=getattr(args, "dtype", "float32"))
        self.nbytes = workload.spec_bytes(self.spec)
        dcs = self.cluster.spec.dc_sizes
        self.config = dict(CONFIG, namespace=f"th-crossdc-{args.scenario}-{int(time.time() * 1000) % 10**8}",
                           **(config or {}))
        tag = args.scenario
        self.trainer = Actor.options(name=f"tensorhub-replica-{MODEL}-{tag}-trainer", **self.cluster.on(0)).remote(
            MODEL, self.spec, replica="trainer", datacenter="dc0", config=self.config)
        # The trainer opens the model first: the reference server is created by the first
        # client, on its node (Ray's default for a zero-CPU actor), so it sits in the trainer's
        # datacenter, as docs/concepts.md ("Across datacenters") recommends (a remote datacenter's every call pays
        # one slow round trip, not two).
        ray.get(self.trainer.ping.remote())
        self.readers: dict[int, list] = {}
        for d in range(1, len(dcs)):
            self.readers[d] = [
                Actor.options(name=f"tensorhub-replica-{MODEL}-{tag}-r{k}", **self.cluster.on(k)).remote(
                    MODEL, self.spec, replica=f"r{k}", datacenter=f"dc{k}" if per_dc_names else f"dc{d}",
                    config=self.config)
                for k in self.cluster.hosts_in_dc(d)]
        ray.get([a.ping.remote() for a in self.all])

    @property
    def all(self) -> list:
        return [self.trainer] + [r for rs in self.readers.values() for r in rs]

    @property
    def remote(self) -> list:
        return [r for rs in self.readers.values() for r in rs]

    def crossed(self) -> dict[int, int]:
        """Bytes sent so far from datacenter 0 into each datacenter d (its link's counter)."""
        return {b: t.a_to_b for (_a, b), t in self.cluster.link_bytes().items()}

    def close(self) -> None:
        for a in self.all:
            try:
                ray.get(a.close.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - teardown of a job that may have killed actors
                pass


def _until(fn, timeout_s: float, every_s: float = 0.1):
    deadline = time.time() + timeout_s
    while True:
        v = fn()
        if v or time.time() > deadline:
            return v
        time.sleep(every_s)


def _everyone_at(s: "Setup", version: int, timeout_s: float = 120.0) -> dict[str, dict]:
    """Every remote reader ``update("latest")`` until it holds ``version`` (skips answer the
    local version meanwhile); returns each reader's last ReadStats, by client id."""
    results = {}
    for a in s.remote:
        deadline = time.time() + timeout_s
        while True:
            r = ray.get(a.timed_update.remote("latest"))
            if r.get("ok") and r["version"] == version:
                results[ray.get(a.ping.remote())] = r
                break
            assert time.time() < deadline, r
            time.sleep(0.2)
    return results


def seed(args) -> dict:
    """Version 1 everywhere first (the first version has no local one to skip to); then version
    2 is published and every remote reader updates until it holds it: what crossed, and how."""
    s = Setup(args)
    ray.get(s.trainer.publish.remote(1))
    _everyone_at(s, 1)
    time.sleep(1.0)  # background retention copies of version 1 settle
    before = s.crossed()
    digest = ray.get(s.trainer.publish.remote(2))
    time.sleep(args.gen_s)  # the engines generate with version 1 meanwhile
    results = _everyone_at(s, 2)
    after = s.crossed()
    out = {"scenario": "seed", "shard_bytes": s.nbytes, "dcs": len(s.readers) + 1,
           "crossed": {str(d): after[d] - before[d] for d in after},
           "digests_ok": all(r["digest"] == digest for r in results.values()),
           "server_on_trainer_node": ray.get(s.trainer.server_node.remote()) == ray.get(s.trainer.node.remote()),
           "reads": [{"action": r["action"], "prefetched": r["prefetched"], "cross": r["cross_datacenter"],
                      "wall_s": r["wall_s"], "sources": r["sources"]} for r in results.values()]}
    s.close()
    return out


def seed_delta(args) -> dict:
    """Seeds as deltas (``seed_deltas=True``, a bf16 shard): versions 1 and 2 everywhere (the
    staging copies hold 2), then version 3 -- version 2 changed as an RL step does
    (``workload.evolve_version``, 4.3%) -- is published and every remote reader updates until
    it holds it: what crossed each link, and whether every reader holds exactly version 3."""
    s = Setup(argparse.Namespace(**{**vars(args), "dtype": "bfloat16"}), config={"seed_deltas": True})
    ray.get(s.trainer.publish.remote(1))
    _everyone_at(s, 1)
    ray.get(s.trainer.publish.remote(2, density=0.043))
    _everyone_at(s, 2)
    time.sleep(1.0)  # background retention copies settle
    before = s.crossed()
    digest = ray.get(s.trainer.publish.remote(3, density=0.043))
    time.sleep(args.gen_s)
    results = _everyone_at(s, 3)
    after = s.crossed()
    out = {"scenario": "seed_delta", "shard_bytes": s.nbytes,
           "crossed": {str(d): after[d] - before[d] for d in after},
           "digests_ok": all(r["digest"] == digest for r in results.values()),
           "reads": [{"prefetched": r["prefetched"], "cross": r["cross_datacenter"]} for r in results.values()]}
    s.close()
    return out


def skip(args) -> dict:
    s = Setup(args)
    ray.get(s.trainer.publish.remote(1))
    for a in s.remote:
        _until(lambda: ray.get(a.timed_update.remote("latest")).get("version") == 1, 120, 0.2)
    before = s.crossed()
    digest2 = ray.get(s.trainer.publish.remote(2))
    t_pub = time.time()
    during = []
    first = s.readers[1]
    # While version 2 crosses (seconds on the slow link), the engines keep updating.
    while time.time() - t_pub < 60:
        rs = ray.get([a.timed_update.remote("latest") for a in first])
        during.append(rs)
        if all(r.get("version") == 2 for r in rs):
            break
        time.sleep(0.2)
    after = s.crossed()
    out = {"scenario": "skip", "shard_bytes": s.nbytes, "crossed": {str(d): after[d] - before[d] for d in after},
           "rounds": [[{k: r.get(k) for k in ("ok", "version", "action", "skipped_in_flight", "prefetched",
                                               "cross_datacenter", "wall_s")} for r in rs] for rs in during],
           "final_digests_ok": all(r.get("digest") == digest2 for r in during[-1])}
    s.close()
    return out


def seeder_dies(args) -> dict:
    """dc1's seeder dies mid-seed while its sibling reads behind it; the cut is made the same way
    on any machine:

        trainer (dc0) ==slow link==> seeder's staging copy (dc1) -> sibling (dc1)

    Version 2 is published; once the server's table shows the sibling reading from the seeder's
    staging copy and a quarter of the shard has crossed into dc1 (the link's counter), the link
    is cut: the seed can go no further. The seeder's process is frozen (SIGSTOP) under the cut,
    the server's table and the link's counter taken (what the seed held when it died), and the
    process killed (SIGKILL: registered tensors, staging copy and all). The link comes back: the
    sibling must fail over across it and finish with exact bytes. Fewer bytes than the shard
    crossed before the kill, so the seed was partial, whatever the progress reports said."""
    import os
    import signal

    # The product's source_stall_timeout_s (not the 5 s of CONFIG): the seeder is killed, so the
    # sibling learns of it from NIXL (remote disconnect), not from a stall; and that window is
    # also how long its reads still in flight to the dead seeder get to end before the read
    # gives up (ReadsNotTerminal) instead of failing over -- on a busy machine 5 s fell short.
    # Without the datacenter's prefetches (prefetch_in_datacenter): the sibling's own update reads
    # behind the seed here, not its staging copy (the in-process test of that flow:
    # tests/handle/test_crossdc.py).
    s = Setup(args, config={"smart_skipping": False, "source_stall_timeout_s": 10.0, "prefetch_in_datacenter": False})
    server = _server(s)
    ray.get(s.trainer.publish.remote(1))
    first = s.readers[1]
    for a in first:
        _until(lambda: ray.get(a.timed_update.remote("latest")).get("version") == 1, 120, 0.2)
    time.sleep(1.0)  # background retention copies of version 1 settle
    before = s.crossed()[1]
    digest2 = ray.get(s.trainer.publish.remote(2))
    stage = _until(lambda: _holder(server, version=2, datacenter="dc1", state="reading", staging=True), 60, 0.02)
    assert stage is not None, f"no seeder started: {_holders(server)}"
    by_replica = {f"r{k}": a for k, a in zip(s.cluster.hosts_in_dc(1), first)}
    seeder_name = stage["replica"].removesuffix("~prefetch")
    seeder = by_replica[seeder_name]
    sibling_name, sibling = next((n, a) for n, a in by_replica.items() if n != seeder_name)
    pid = ray.get(seeder.pid.remote())
    pending = sibling.timed_update.remote(2)  # reads behind the seed, in its datacenter
    behind = _until(lambda: _holder(server, version=2, replica=sibling_name, state="reading",
                                    source=stage["client_id"]), 60, 0.02)
    assert behind is not None, f"the sibling never read from the seeder's staging copy: {_holders(server)}"
    _until(lambda: s.crossed()[1] - before >= s.nbytes // 4, 120, 0.01)
    with s.cluster.link_cut(1):
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.5)  # what the delay wire still held lands; nothing more can cross
        crossed_at_death = s.crossed()[1] - before
        at_death = {"seed": _holder(server, client_id=stage["client_id"]),
                    "sibling": _holder(server, version=2, replica=sibling_name)}
        os.kill(pid, signal.SIGKILL)  # the seeder's process dies, staging copy and all
        time.sleep(1.0)  # its sockets close under the cut: the sibling's reads from it fail
    r = ray.get(pending, timeout=300)
    out = {"scenario": "seeder_dies", "shard_bytes": s.nbytes, "crossed_at_death": crossed_at_death,
           "at_death": at_death, "seed_client": stage["client_id"],
           "reader": {k: r.get(k) for k in ("ok", "error", "version", "sources", "failovers", "wall_s", "message")},
           "digest_ok": r.get("digest") == digest2, "crossed_total": s.crossed()[1] - before}
    s.close()
    return out


def _server(s: Setup):
    from tensorhub.server.find import find_server
    from tensorhub.config import Config

    return find_server(Config(**s.config), MODEL)


def _holders(server) -> list[dict]:
    """The server's table of the model: every holder and reader (``tensorhub status`` rows)."""
    from tensorhub.status import snapshot

    return [h for mv in snapshot(server, MODEL)["models"] for h in mv["holders"]]


def _holder(server, *, staging: Optional[bool] = None, **fields) -> Optional[dict]:
    """The first row of the server's table with these field values (``staging``: the replica
    is, or is not, a prefetch staging copy), or None."""
    for h in _holders(server):
        if staging is not None and h["replica"].endswith("~prefetch") != staging:
            continue
        if all(h.get(k) == v for k, v in fields.items()):
            return h
    return None


def link_down(args) -> dict:
    """The inter-datacenter link goes down mid-seed, for ``--down-s`` seconds. dc1's engines
    run their own loops meanwhile (the driver cannot reach them across the cut link either) and
    report afterwards: each update's outcome and how long it blocked."""
    s = Setup(args, config={"request_timeout_s": args.request_timeout_s, "source_stall_timeout_s": 3.0})
    ray.get(s.trainer.publish.remote(1))
    first = s.readers[1]
    _everyone_at(s, 1)
    loops = [a.engine_loop.remote(args.down_s + args.recover_s + 2.0, 0.5) for a in first]
    time.sleep(1.0)
    digest2 = ray.get(s.trainer.publish.remote(2))
    time.sleep(1.0)  # the seed is under way
    down_at = time.time()
    with s.cluster.link_cut(1):
        time.sleep(args.down_s)
    up_at = time.time()
    records = ray.get(loops, timeout=args.down_s + args.recover_s + 4 * args.request_timeout_s + 60)
    final = [ray.get(a.timed_update.remote("latest")) for a in first]
    keep = ("ok", "error", "message", "version", "action", "skipped_in_flight", "wall_s", "t")
    out = {"scenario": "link_down", "down_s": args.down_s, "request_timeout_s": args.request_timeout_s,
           "down_at": down_at, "up_at": up_at,
           "records": [[{k: r.get(k) for k in keep} for r in rs] for rs in records],
           "final": [{k: r.get(k) for k in ("ok", "error", "version")} for r in final],
           "final_digests_ok": all(r.get("digest") == digest2 for r in final)}
    s.close()
    return out


SCENARIOS = {"seed": seed, "seed_delta": seed_delta, "skip": skip, "seeder_dies": seeder_dies, "link_down": link_down}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--cluster", required=True, help="the emulated cluster's name (its state file)")
    ap.add_argument("--mib", type=int, default=16, help="shard size")
    ap.add_argument("--down-s", type=float, default=15.0)
    ap.add_argument("--recover-s", type=float, default=30.0, help="link_down: engine loops go on this long after")
    ap.add_argument("--request-timeout-s", type=float, default=10.0, help="link_down: the handles' request_timeout_s")
    ap.add_argument("--gen-s", type=float, default=3.0, help="seed: a generation step between publish and update")
    args = ap.parse_args(argv)
    ray.init(log_to_driver=False)
    print(json.dumps(SCENARIOS[args.scenario](args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
