"""Moved: the emulated cluster is :mod:`tensorhub.emucluster` (a shipped tool, not a fixture).

This name stays for one release so that ``from tensorhub.testing.cluster import
emulated_cluster`` keeps working; new code imports :mod:`tensorhub.emucluster`.
"""

from tensorhub.emucluster import (  # noqa: F401 - re-exported for old imports
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

__all__ = ["ClusterError", "ClusterSpec", "EmulatedCluster", "LinkTraffic", "RETRY_TIMEOUT_FACTOR", "Traffic",
           "emulated_cluster", "start_cluster", "teardown"]
