"""The pipeline across layouts on an emulated cluster (marker ``cluster``; issue 24): a TP=1 trainer
on host 0, two vLLM-style TP=2 reader replicas on hosts 1 and 2 (a Ray actor per rank), 0.1
Gbit/s links. The job is :mod:`tensorhub.testing.reshard_pipeline` (``benchmarks/reshard.py
--emulated`` runs it with 8 readers)."""

from __future__ import annotations

import json
import sys

import pytest

from tensorhub.emucluster.net import unavailable_reason

_SKIP = unavailable_reason()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

NAME = "thrsp"


@pytest.fixture(scope="module")
def cluster():
    from tensorhub.emucluster import emulated_cluster

    with emulated_cluster(hosts=3, gbit=0.1, name=NAME, subnet="10.79.0.0/16") as c:
        yield c


def test_a_reader_of_another_layout_reshards_and_the_next_pipelines_behind_it(cluster):
    """Both replicas update at once: one reshards from the trainer (byte ranges from its one
    shard, checked cell by cell) while the other reads from it as it goes. Every rank ends with
    exactly its slice; a rank receives its slice's bytes only; and the pair takes far less than
    two reads end to end (a relay, the second reader waiting for the first, takes about 2x)."""
    p = cluster.run_driver([sys.executable, "-m", "tensorhub.testing.reshard_pipeline", "--cluster", NAME,
                            "--readers", "2", "--layers", "4", "--hidden", "512", "--vocab", "2048"],
                           timeout_s=400)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    print(json.dumps(out))
    assert out["exact"] and out["bytes_ratio"] <= 1.02, out
    # One replica's ranks reshard from the trainer; the other's read from that replica.
    assert out["chains"] in ([["T"], ["r0"]], [["r1"], ["T"]]), out
    assert out["last_over_single"] < 1.6, out
