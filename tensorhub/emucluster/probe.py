"""``python -m tensorhub.emucluster.probe``: lists an emulated cluster's Ray nodes.

Run as a subprocess with the cluster's driver environment (its token): it talks to the GCS
directly and never calls ``ray.init``, so it neither joins the cluster nor disturbs another
cluster the caller is connected to. Polls until ``--expect-nodes`` nodes are alive or
``--timeout-s`` passes. Prints one JSON object ``{"nodes": [...]}`` on the last stdout line;
exit status 0 when enough nodes are alive, 3 on timeout (with what it saw), 2 on bad use.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

POLL_S = 0.25
RPC_TIMEOUT_S = 5


def nodes(address: str) -> list[dict]:
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    infos = GcsClient(address=address).get_all_node_info(timeout=RPC_TIMEOUT_S)
    out = []
    for info in infos.values():
        out.append({
            "node_id": info.node_id.hex(),
            "ip": info.node_manager_address,
            "alive": info.state == GcsNodeInfo.GcsNodeState.ALIVE,
            "is_head": bool(info.is_head_node),
            "resources": dict(info.resources_total),
        })
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tensorhub.emucluster.probe", description=__doc__)
    p.add_argument("--address", required=True)
    p.add_argument("--expect-nodes", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=0.0)
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.timeout_s
    seen: list[dict] = []
    error = None
    while True:
        try:
            seen, error = nodes(args.address), None
        except Exception as e:  # the GCS may not answer yet; report the last error on timeout
            error = repr(e)
        if error is None and sum(n["alive"] for n in seen) >= args.expect_nodes:
            print(json.dumps({"nodes": seen}))
            return 0
        if time.monotonic() >= deadline:
            print(json.dumps({"nodes": seen, "error": error}))
            return 3
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
