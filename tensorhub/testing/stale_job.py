"""Two jobs on one long-running Ray cluster: the second must not be served by the first's corpses.

    RAY_ADDRESS=... python -m tensorhub.testing.stale_job publish --model M [--hosts 0,1,2]
    RAY_ADDRESS=... python -m tensorhub.testing.stale_job read --model M [--host 3]

``publish`` (job A) starts a trainer and two readers (Ray actors, placed on emulated hosts when
``--hosts`` is given), publishes version 1, replicates it into both readers, prints one JSON line
and exits without closing anything: its driver's exit kills its actors, as a finished or
crashed RL job does. The detached reference server lives on and still lists them as holders
until it notices.

``read`` (job B, started at once) opens the same model on a fresh actor and calls
``replicate("latest")``. It must succeed from a live holder or fail with a typed
``VersionNotFound`` / ``VersionLost`` within seconds; a ``TransferError`` after trying corpse
after corpse is the defect this guards against. Prints one JSON line: ``ok``, ``error`` (the
typed error's class), ``seconds``, ``failovers``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

from tensorhub.server.naming import actor_name

CONFIG = dict(unit_bytes=256 << 10, heartbeat_interval_s=0.5, lease_timeout_s=60.0,
              source_stall_timeout_s=5.0)
"""A long lease on purpose: the server must find the dead holders through Ray, not by waiting."""


def _placement(hosts: Optional[list[int]], i: int) -> dict:
    if not hosts:
        return {}
    return {"resources": {f"host-{hosts[i % len(hosts)]}": 0.01}}


def publish(model: str, nbytes: int, hosts: Optional[list[int]], config: dict) -> dict:
    import ray

    from tensorhub.testing import workload
    from tensorhub.testing.replica import ReplicaActor

    spec = workload.small_spec(nbytes)
    names = ["trainer", "reader-0", "reader-1"]
    actors = [ReplicaActor.options(name=f"tensorhub-replica-{model}-{n}", **_placement(hosts, i))
              .remote(model, spec, replica=n, config=config) for i, n in enumerate(names)]
    ray.get([a.ping.remote() for a in actors])
    digest = ray.get(actors[0].publish.remote(1))
    stats = ray.get([a.replicate.remote(1) for a in actors[1:]])
    assert all(s["digest"] == digest for s in stats), "replicated bytes differ"
    return {"job": "publish", "model": model, "version": 1, "digest": digest,
            "sources": [s["sources"] for s in stats]}


def read(model: str, nbytes: int, host: Optional[int], config: dict) -> dict:
    import ray

    from tensorhub.testing import workload
    from tensorhub.testing.replica import ReplicaActor

    spec = workload.small_spec(nbytes)
    placement = _placement([host], 0) if host is not None else {}
    reader = ReplicaActor.options(**placement).remote(model, spec, replica="late-reader", config=config)
    ray.get(reader.ping.remote())
    t0 = time.monotonic()
    out = ray.get(reader.try_call.remote("replicate", "latest"))
    dt = time.monotonic() - t0
    return {"job": "read", "model": model, "ok": out["ok"], "error": out.get("error"),
            "message": out.get("message", ""), "seconds": round(dt, 3), "server": _server_counts(model, config)}


def _server_counts(model: str, config: dict) -> dict:
    """The server's request counts and ``pushed_deaths``: when the read was slow, they tell which
    way of finding the corpses missed (Ray's pushed deaths, the check on a SourceFailed report,
    the lease)."""
    import ray

    from tensorhub.config import Config

    cfg = Config(**config)
    try:
        server = ray.get_actor(actor_name(cfg, model), namespace=cfg.namespace)
        return ray.get(server.counts.remote(), timeout=30)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return {"unavailable": repr(e)[:200]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=("publish", "read"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--bytes", type=int, default=2 << 20)
    ap.add_argument("--hosts", default="", help="comma list of emulated hosts (publish: trainer, readers)")
    ap.add_argument("--host", type=int, default=None, help="emulated host of the late reader")
    ap.add_argument("--namespace", default="tensorhub", help="of the reference server (a fresh one per namespace)")
    ap.add_argument("--liveness-check-s", type=float, default=None,
                    help="server config when this job creates the server (0: only leases and reports)")
    args = ap.parse_args(argv)

    import ray

    config = dict(CONFIG, namespace=args.namespace)
    if args.liveness_check_s is not None:
        config["liveness_check_s"] = args.liveness_check_s
    ray.init(log_to_driver=False)
    hosts = [int(h) for h in args.hosts.split(",") if h] or None
    if args.role == "publish":
        res = publish(args.model, args.bytes, hosts, config)
    else:
        res = read(args.model, args.bytes, args.host, config)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
