"""``tensorhub cluster up|status|down``: the emulated multi-host cluster from a shell (root).

    tensorhub cluster up --hosts 3 --gbit 0.2 --datacenters 2,1 --inter-dc-gbit 0.15 --inter-dc-latency-ms 30
    eval "$(tensorhub cluster env)"        # then a driver's ray.init() joins it
    tensorhub cluster status
    tensorhub cluster down

``up`` returns once every Ray node is alive; the cluster keeps running until ``down`` (or the
next ``up`` under the same ``--name``, which replaces it). A Python program reaches a running
cluster with ``EmulatedCluster.attach(name)``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from tensorhub.emucluster.plan import ClusterError, ClusterSpec, parse_datacenters

DRIVER_ENV_KEYS = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "UCX_TLS", "UCX_NET_DEVICES",
                   "GLOO_SOCKET_IFNAME")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="cluster_command", required=True)
    up = sub.add_parser("up", help="build the network and start Ray on every emulated host")
    up.add_argument("--hosts", type=int, required=True)
    up.add_argument("--gbit", type=float, default=1.0, help="host NIC rate, each direction (Gbit/s)")
    up.add_argument("--latency-ms", type=float, default=0.0, help="one-way delay added between two hosts")
    up.add_argument("--datacenters", default=None, help="hosts per datacenter, e.g. 3,3 (default: one)")
    up.add_argument("--inter-dc-gbit", type=float, default=1.0)
    up.add_argument("--inter-dc-latency-ms", type=float, default=0.0, help="one-way, each direction")
    up.add_argument("--cpus-per-host", type=int, default=2)
    up.add_argument("--head-cpus", type=int, default=1)
    up.add_argument("--object-store-mib", type=int, default=ClusterSpec.object_store_bytes_per_host >> 20,
                    help="Ray object store per node")
    up.add_argument("--subnet", default=ClusterSpec.subnet)
    up.add_argument("--no-ray", action="store_true", help="network only: no Ray head or raylets")
    up.add_argument("--dashboard", action="store_true", help="start the Ray dashboard on the head")
    up.add_argument("--timeout-s", type=float, default=ClusterSpec.start_timeout_s)
    st = sub.add_parser("status", help="hosts, ips, rates, processes and Ray nodes alive")
    st.add_argument("--json", action="store_true")
    sub.add_parser("down", help="kill the cluster's processes and delete its namespaces and links")
    sub.add_parser("env", help="print `export` lines for a driver in the root namespace")
    for q in (up, st, *[sub.choices[n] for n in ("down", "env")]):
        q.add_argument("--name", default=ClusterSpec.name, help="prefix of namespaces, interfaces, state file")
        q.add_argument("--state-dir", default=ClusterSpec.state_dir)


def run(args: argparse.Namespace) -> int:
    from tensorhub.emucluster.cluster import EmulatedCluster, start_cluster, teardown

    try:
        if args.cluster_command == "up":
            spec = ClusterSpec(hosts=args.hosts, gbit=args.gbit, latency_ms=args.latency_ms,
                               datacenters=parse_datacenters(args.datacenters), inter_dc_gbit=args.inter_dc_gbit,
                               inter_dc_latency_ms=args.inter_dc_latency_ms, cpus_per_host=args.cpus_per_host,
                               head_cpus=args.head_cpus, object_store_bytes_per_host=args.object_store_mib << 20,
                               name=args.name, subnet=args.subnet, ray=not args.no_ray,
                               include_dashboard=args.dashboard, start_timeout_s=args.timeout_s,
                               state_dir=args.state_dir)
            c = start_cluster(spec)
            print(f"cluster {c.name!r} up: {c.hosts} hosts, state file {c.state_path}")
            if spec.ray:
                print(f"address {c.address}   (drivers: eval \"$(tensorhub cluster env --name {c.name})\")")
            return 0
        if args.cluster_command == "down":
            done = teardown(args.name, args.state_dir)
            print(f"cluster {args.name!r} " + ("torn down" if done else "was not running"))
            return 0
        c = EmulatedCluster.attach(args.name, args.state_dir)
        if args.cluster_command == "env":
            env = c.driver_env()
            for k in DRIVER_ENV_KEYS:
                print(f"export {k}={shlex.quote(env[k])}")
            return 0
        status = c.status()
        print(json.dumps(status, indent=2) if args.json else format_status(status))
        return 0
    except ClusterError as e:
        print(f"tensorhub cluster {args.cluster_command}: {e}", file=sys.stderr)
        return 1


def format_status(s: dict) -> str:
    spec = s["spec"]
    lines = [f"cluster {s['name']!r} ({s['phase']}), state file {s['state_file']}",
             f"  head {s['head_ip']}  address {s['address'] or '-'}  "
             f"nodes alive {s.get('nodes_alive', '?')}/{s.get('nodes_expected', '-')}"
             + (f"  ({s['nodes_error']})" if "nodes_error" in s else ""),
             f"  hosts: {spec['gbit']} Gbit/s each way, +{spec['latency_ms']} ms between hosts"]
    if spec["datacenters"]:
        lines.append(f"  datacenters {spec['datacenters']}: link {spec['inter_dc_gbit']} Gbit/s, "
                     f"+{spec['inter_dc_latency_ms']} ms each way")
    running = {(p["role"], p["host"]): p for p in s["processes"]}
    for h in s["hosts"]:
        p = running.get(("host", h["host"]))
        proc = "-" if p is None else f"pid {p['pid']} {'running' if p['running'] else 'GONE'}"
        traffic = f"sent {h['sent']} B, received {h['received']} B" if "sent" in h else "netns missing"
        lines.append(f"  host {h['host']} dc {h['dc']} {h['ip']:<15} {h['netns']:<10} raylet {proc:<22} {traffic}")
    for role in ("head", "wire"):
        p = running.get((role, -1))
        if p is not None:
            lines.append(f"  {role} pid {p['pid']} {'running' if p['running'] else 'GONE'}")
    for link, t in s["links"].items():
        lines.append(f"  inter-dc link {link}: a->b {t['a_to_b']} B, b->a {t['b_to_a']} B")
    return "\n".join(lines)
