"""The paper's three headline comparisons in the simulator (tensorhub.sim.whatif_paper), in their
fast versions: each points the paper's way, the baselines reproduce the paper's own baseline
figures where the model allows, and ``tensorhub simulate --whatif`` prints the JSON line."""

from __future__ import annotations

import json

import pytest

from tensorhub.sim import whatif_paper as wp

pytestmark = pytest.mark.sim

ROW_KEYS = {"setting", "tensorhub_stall_s", "baseline_stall_s", "ratio", "paper_ratio"}


def test_standalone_tensorhub_stalls_only_standalone_gpus_and_less_than_an_nccl_broadcast():
    """colo0..5 publish (a reference) -> alone0, alone1 each read one colocated replica;
    NCCL: every GPU waits out one broadcast."""
    r = wp.standalone(**wp.SMALL["standalone"])
    assert r["violations"] == 0
    assert r["tensorhub_trainer_stall_s"] < 0.01 * r["tensorhub_stall_s"]  # publish is a reference
    # Each standalone GPU reads one shard at the RDMA rate from its own source: one transfer.
    one = 66.0 / wp.HW.rdma_GBps
    assert one <= r["tensorhub_mean_standalone_stall_s"] < 1.1 * one
    assert r["baseline_per_gpu_stall_s"] == pytest.approx(66.0 / wp.HW.nccl_GBps, rel=0.01)
    assert r["ratio"] > 3 and r["baseline_stall_s"] > r["tensorhub_stall_s"]


def test_standalone_straggler_only_widens_the_nccl_barrier():
    calm = wp.standalone(**wp.SMALL["standalone"])
    late = wp.standalone(straggler_s=2.0, **wp.SMALL["standalone"])
    assert late["tensorhub_stall_s"] == calm["tensorhub_stall_s"]
    assert late["baseline_per_gpu_stall_s"] == pytest.approx(calm["baseline_per_gpu_stall_s"] + 1.0)


def test_elastic_pipeline_beats_the_ucx_staircase():
    """TensorHub: trainer -> alone0 -> spot0 -> spot1 -> spot2 (per shard, in some order).
    UCX: trainer -> alone0, then spot0..2 all read alone0 once it is complete."""
    r = wp.elastic(**wp.SMALL["elastic"])
    assert r["violations"] == 0
    ucx_one = 34.0 / wp.HW.ucx_GBps
    assert r["baseline_standalone_latency_s"] == pytest.approx(ucx_one, rel=0.05)
    assert r["baseline_stall_s"] == pytest.approx(4 * ucx_one, rel=0.05)  # the last stair
    assert r["tensorhub_stall_s"] < 1.5 * 34.0 / wp.HW.rdma_GBps
    assert r["ratio"] > 2.5 and r["baseline_total_stall_s"] > r["tensorhub_total_stall_s"]


def test_crossdc_one_copy_crosses_and_stall_drops_against_per_replica():
    r = wp.crossdc(**wp.SMALL["crossdc"])
    assert r["violations"] == 0
    crossed = r["inter_dc_GB_per_step"]
    assert crossed["tensorhub"] == pytest.approx(20.0) and crossed["skip_only"] == pytest.approx(20.0)
    assert crossed["per_replica"] == pytest.approx(80.0)  # every replica's two shards
    assert r["offload_seeds"] > 0
    assert r["mean_staleness"]["per_replica"] == 0
    # No GPU waits for the slow link with offload seeding; per replica, every one does.
    assert r["max_gpu_stall_s"]["tensorhub"] < 20.0 / wp.HW.tcp_GBps < r["max_gpu_stall_s"]["per_replica"]
    assert r["ratio"] > 5 and r["skip_only_stall_s"] < r["baseline_stall_s"]


def test_static_sources_baseline_reads_only_its_plan():
    """The baseline scheduler restricted to a plan still delivers the bytes (no violations) and
    never lets a spot replica read the trainer."""
    r = wp.elastic(shards=1, units=8, elastic=2)
    assert r["violations"] == 0
    assert r["baseline_stall_s"] == pytest.approx(3 * 34.0 / wp.HW.ucx_GBps, rel=0.05)


def test_cli_whatif_prints_one_json_line_with_the_three_results(capsys):
    from tensorhub.cli import main

    assert main(["simulate", "--whatif", "paper-small", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["results"]
    assert [r["setting"] for r in rows] == ["standalone", "elastic", "crossdc"]
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert r["paper_ratio"] == wp.PAPER_RATIO[r["setting"]]
        assert r["ratio"] == pytest.approx(r["baseline_stall_s"] / r["tensorhub_stall_s"], rel=0.01)
        assert r["ratio"] > 1
