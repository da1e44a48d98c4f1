"""benchmarks/reshard_updates.py, small: an engine of another layout updated step after step reads
each new version over its old one with no host copy (retention across layout classes,
``Retention.kept``), where the rule before offloaded the old version on every rank at every step.
Real handles over an in-process server, NIXL on this host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_engine_behind_the_trainer_updates_without_offloading_its_old_version():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "reshard_updates.py"), "--json", "--steps", "3",
         "--layers", "1", "--hidden", "256"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["versions_retained"] == 1 and res["steps"] == 3
    # Every rank held exactly its slice of each step's version (the trainer negates its weights
    # each step, so a stale byte would show).
    assert res["exact"] is True, res
    # Each rank of the TP=2 engine: no offload now; one per step under the rule before.
    assert res["offloads"] == {"model_wide": 0, "per_class": 2}, res
    assert all(t > 0 for ts in res["update_s_all"].values() for t in ts) and len(res["update_s_all"]["model_wide"]) == 2
