"""The emulated cluster: many Ray hosts on one machine, for tests, benchmarks and demos (needs root).

A shipped tool, not a fixture: ``tensorhub cluster up|status|env|down`` on the command line,
:func:`emulated_cluster` from Python::

    from tensorhub.emucluster import emulated_cluster

    with emulated_cluster(hosts=3, gbit=0.2, datacenters=[2, 1], inter_dc_gbit=0.15,
                          inter_dc_latency_ms=30) as c:
        out = c.run_driver([sys.executable, "bench.py"], timeout_s=300)   # ray.init() inside
        crossed = c.link_bytes()[(0, 1)]

Each host is a network namespace with a rate-limited NIC and a raylet of its own; see
``docs/operations.md`` for the manual. The parts:

- :mod:`~tensorhub.emucluster.cluster`: :class:`EmulatedCluster`, :func:`start_cluster`,
  :func:`teardown` (the lifecycle and its state file);
  :mod:`~tensorhub.emucluster.startup`: starting the Ray head and the raylets (a few at a time,
  transient failures started again);
- :mod:`~tensorhub.emucluster.plan`: :class:`ClusterSpec` and the :class:`NetPlan` computed
  from it (every name and address; pure);
- :mod:`~tensorhub.emucluster.net`: building and removing the namespaces, veths, bridges and
  shaping (root); :mod:`~tensorhub.emucluster.procs`: the processes it starts;
- :mod:`~tensorhub.emucluster.wire`, :mod:`~tensorhub.emucluster.probe`,
  :mod:`~tensorhub.emucluster.raystart`, :mod:`~tensorhub.emucluster.nettest`: stdlib-only
  helpers run as scripts (the delay lines, the node probe, a retried ``ray start``, link probes);
- :mod:`~tensorhub.emucluster.cli`: ``tensorhub cluster``.

Importing this package needs no root and starts nothing (the cluster's modules import only the
standard library, msgspec and :mod:`tensorhub.errors`).
"""

from tensorhub.emucluster.cluster import (
    RETRY_TIMEOUT_FACTOR,
    ClusterError,
    ClusterSpec,
    EmulatedCluster,
    LinkTraffic,
    Traffic,
    emulated_cluster,
    start_cluster,
    teardown,
)
from tensorhub.emucluster.plan import NetPlan, parse_datacenters, plan_of

__all__ = ["ClusterError", "ClusterSpec", "EmulatedCluster", "LinkTraffic", "NetPlan", "RETRY_TIMEOUT_FACTOR",
           "Traffic", "emulated_cluster", "parse_datacenters", "plan_of", "start_cluster", "teardown"]
