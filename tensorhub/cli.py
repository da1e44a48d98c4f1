"""The ``tensorhub`` command: ``demo`` (the main job), ``simulate``, ``chaos``, ``cluster`` and ``status``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorhub", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    from tensorhub import chaos, demo, status
    from tensorhub.sim import cli as sim_cli
    from tensorhub.emucluster import cli as cluster_cli

    demo.add_arguments(sub.add_parser("demo", help="trainer + rollouts on a local Ray cluster (the main job)"))
    sim_cli.add_arguments(sub.add_parser("simulate", help="run seeded deterministic simulations of the protocol"))
    chaos.add_arguments(sub.add_parser("chaos", help="randomized fault rounds on a local Ray cluster"))
    cluster_cli.add_arguments(sub.add_parser("cluster", help="an emulated multi-host Ray cluster on this machine (root)"))
    status.add_arguments(sub.add_parser("status", help="models, holders, transfers and waiting readers of a running cluster"))

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.command == "simulate":
        return sim_cli.run(args)
    if args.command == "demo":
        return demo.run(args)
    if args.command == "chaos":
        return chaos.run(args)
    if args.command == "cluster":
        return cluster_cli.run(args)
    if args.command == "status":
        return status.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
