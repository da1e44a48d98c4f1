"""``ray start`` that waits up to WAIT_S, not Ray's fixed 30 s, for its node to register.

    python raystart.py WAIT_S start --address ... --block ...

The emulated cluster starts a node again with this after its plain ``ray start`` timed out
("The current node timed out during startup ... GCS has become overloaded"): on a busy machine
the GCS answers the node's registration after more than the 30 s ``ray._private.node.Node``
waits (Ray 2.60 hard-codes it). It runs Ray's own CLI, with ``ray._private.services.get_node``
(what that wait polls; a RuntimeError means "not registered yet") polled on until WAIT_S passed
since its first call or the node's raylet died. Everything else is plain ``ray start``. Not
lengthened: the raylet's own wait for its dashboard agent's port files (about 15 s; on a very
busy machine the raylet aborts with "Timed out waiting for file .../metrics_agent_port_*", and
``ray start`` then times out too). Imports Ray, never tensorhub.
"""

from __future__ import annotations

import sys
import time

POLL_S = 0.5


class RayletExited(Exception):
    """The node's raylet died before it registered: waiting on would wait for nothing. Not a
    RuntimeError, so it ends Ray's own wait loop (which retries those) at once."""


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: raystart.py WAIT_S RAY_ARGS...", file=sys.stderr)
        return 2
    wait_s = float(argv[0])
    import ray._private.node as node_mod
    import ray._private.services as services
    from ray._private.ray_constants import PROCESS_TYPE_RAYLET

    real_get_node, real_start = services.get_node, node_mod.Node.start_ray_processes
    nodes: list = []
    deadline: list[float] = []

    def start_ray_processes(self, *args, **kwargs):
        nodes.append(self)  # the node whose raylet the wait below is about
        return real_start(self, *args, **kwargs)

    def get_node(gcs_address, node_id):
        if not deadline:
            deadline.append(time.monotonic() + wait_s)
        while True:
            try:
                return real_get_node(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() >= deadline[0]:
                    raise
                if nodes and any(kind == PROCESS_TYPE_RAYLET for kind, _ in nodes[-1].dead_processes()):
                    raise RayletExited("the raylet exited before it registered with the GCS") from None
                time.sleep(POLL_S)

    node_mod.Node.start_ray_processes = start_ray_processes
    services.get_node = get_node
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", *argv[1:]]
    return ray_main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
