"""The benchmarks' outer half on an emulated cluster: build it, run the script as its driver.

A benchmark's ``main`` builds the cluster (:func:`tensorhub.emucluster.emulated_cluster`,
needs root) and runs itself inside with ``--driver`` (plus ``--quiet`` for ``--json``: no live
progress); the driver prints its summary as the last stdout line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional, Sequence


def run_driver(script: str, argv: Optional[Sequence[str]], json_mode: bool, **cluster) -> Optional[dict]:
    """Run ``script --driver ARGV`` (``ARGV``: this process's arguments without ``--json``)
    inside an emulated cluster built from ``cluster`` (keywords of ``emulated_cluster``); returns
    the driver's JSON summary (also shown on stderr), or None if the driver failed."""
    from tensorhub.emucluster import emulated_cluster

    with emulated_cluster(**cluster) as c:
        argv2 = [sys.executable, script, "--driver", *[a for a in (argv or sys.argv[1:]) if a != "--json"],
                 *(["--quiet"] if json_mode else [])]
        proc = subprocess.run(argv2, env=c.driver_env(), stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        print(f"driver failed (rc={proc.returncode})", file=sys.stderr, flush=True)
        return None
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(summary, indent=1), file=sys.stderr, flush=True)
    return summary


def report(summary: Optional[dict], json_mode: bool, plot=None, plot_path: str = "") -> int:
    """A benchmark's ending: 1 if its driver failed; else draw ``plot(summary, plot_path)`` if a
    path was given, print the JSON line if ``json_mode``, and return 0."""
    if summary is None:
        return 1
    if plot is not None and plot_path:
        plot(summary, plot_path)
        print(f"plot written to {plot_path}", file=sys.stderr, flush=True)
    if json_mode:
        print(json.dumps(summary))
    return 0

