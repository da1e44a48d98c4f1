"""Benchmark-scale what-if runs: how long does one version take to reach N readers?

``run_whatif`` publishes one version on a trainer and lets ``num_readers`` rollouts replicate it
at once, with no faults, and reports the virtual time until the last reader holds it.
``pipeline=True`` is the protocol as designed (<= 1 reader per source, partial holders serve
the prefix they have: trainer -> r1 -> r2 -> ...). ``pipeline=False`` is the baseline: any number
of readers per source and no partial sources, so every reader pulls from a complete holder.
"""

from __future__ import annotations

import math
from typing import Optional

from tensorhub.config import Config
from tensorhub.core.reading import Reading
from tensorhub.core.reference import ReferenceCore
from tensorhub.core.state import NodeState
from tensorhub.sim.scenario import Params, World


class _NoPartialReading(Reading):
    def downstream(self, node):
        out = super().downstream(node)
        t = self.table
        out.update(i for i in t.groups.get(node.key, ()) if t.nodes[i].state is NodeState.READING)
        return out


class NoPartialSources(ReferenceCore):
    """The baseline scheduler: partial holders never serve (every reader counts them as
    downstream, which makes them ineligible)."""

    def __init__(self, config: Optional[Config] = None) -> None:
        super().__init__(config)
        self.reading.__class__ = _NoPartialReading


def run_whatif(num_readers: int, shard_bytes: int, *, unit_bytes: int = 1 << 30, nic_GBps: float = 50.0,
               pipeline: bool = True, reads_in_flight: int = 4, seed: int = 0,
               limit_s: Optional[float] = None) -> dict:
    """Virtual seconds until ``num_readers`` readers hold a ``shard_bytes`` shard, and the time
    one transfer of that shard takes over one NIC (the lower bound for any reader)."""
    units = max(1, math.ceil(shard_bytes / unit_bytes))
    nic_bw = nic_GBps * 1e9
    one_transfer_s = units * unit_bytes / nic_bw
    params = Params(workload="whatif", units=units, unit_bytes=unit_bytes, nic_bw=nic_bw,
                    max_clients=num_readers + 1, active_s=0.0)
    config = Config(heartbeat_interval_s=10.0, lease_timeout_s=1e6, server_tick_s=10.0,
                    source_stall_timeout_s=1e6, request_timeout_s=1e6,
                    readers_per_source_max=1 if pipeline else 1 << 30, reads_in_flight=reads_in_flight)
    w = World(seed, params=params, config=config, core_factory=None if pipeline else NoPartialSources, faults=False)
    trainer = w.add_client("trainer/s0", replica_id="trainer", shard=0, num_shards=1, host=w.add_host("dc0"),
                           dc="dc0", spot=False, role="trainer")
    readers = [w.add_client(f"r{i}/s0", replica_id=f"r{i}", shard=0, num_shards=1, host=w.add_host("dc0"),
                            dc="dc0", spot=False, role="rollout") for i in range(num_readers)]
    state = {"start": None, "done": 0, "last": 0.0, "errors": 0}

    def reader_done(code: str, _v: int) -> None:
        state["done"] += 1
        state["errors"] += code != "ok"
        state["last"] = w.sim.now
        if state["done"] == num_readers:
            w.sim.stopped = True

    def go() -> None:
        state["start"] = w.sim.now
        for r in readers:
            r.replicate(1, False, reader_done)

    def registered(code: str, _v: int) -> None:
        if all(c.registered for c in [trainer] + readers):
            trainer.write_version(1)
            trainer.publish(1, lambda code, _v: go())

    for c in [trainer] + readers:
        c.register(registered)
    w.sim.run(limit_s if limit_s is not None else 100 * one_transfer_s * max(1, num_readers) + 100)
    return {
        "readers": num_readers, "shard_bytes": units * unit_bytes, "units": units, "pipeline": pipeline,
        "seconds": state["last"] - (state["start"] or 0.0), "one_transfer_s": one_transfer_s,
        "finished": state["done"], "errors": state["errors"], "violations": len(w.checker.violations),
    }
