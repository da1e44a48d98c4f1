"""Cross-datacenter rules on an emulated cluster with three datacenters (marker ``cluster``):
dc0 = the trainer's host, dc1 and dc2 = two reader hosts each, 1 Gbit/s inside a datacenter,
100 Mbit/s with 20 ms between them. Bytes that crossed are read from the inter-datacenter links'
interface counters, not from TensorHub. The jobs are :mod:`tensorhub.testing.crossdc`."""

from __future__ import annotations

import json
import sys

import pytest

from tensorhub.emucluster.net import unavailable_reason

_SKIP = unavailable_reason()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

NAME = "thxdc"
MIB = 16


@pytest.fixture(scope="module")
def dcs():
    from tensorhub.emucluster import emulated_cluster

    # The link-down test cuts the Ray control plane of dc1 too: the head must not declare its
    # nodes dead within seconds (Ray's default node health check), as it would a lost host.
    with pytest.MonkeyPatch.context() as mp, emulated_cluster(hosts=5, datacenters=[1, 2, 2], gbit=1.0, inter_dc_gbit=0.1, inter_dc_latency_ms=20,
                          name=NAME, subnet="10.74.0.0/16",
                          **_tolerant_health_checks(mp)) as c:
        yield c


def _tolerant_health_checks(mp) -> dict:
    mp.setenv("RAY_health_check_period_ms", "1000")
    mp.setenv("RAY_health_check_failure_threshold", "60")
    return {}


def _run(c, scenario, *args, timeout_s=300) -> dict:
    p = c.run_driver([sys.executable, "-m", "tensorhub.testing.crossdc", scenario, "--cluster", NAME,
                      "--mib", str(MIB), *args], timeout_s=timeout_s)
    assert p.returncode == 0, f"{scenario} failed (rc={p.returncode}):\n{p.stderr[-4000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_one_copy_crosses_into_each_datacenter_and_every_readers_update_is_local(dcs):
    """The seeder of each remote datacenter prefetches across, the other reader there behind it
    inside the datacenter (``prefetch_in_datacenter``): one shard crosses per datacenter, and
    every reader's update copies from its own staging copy."""
    out = _run(dcs, "seed")
    shard = out["shard_bytes"]
    for d, crossed in out["crossed"].items():
        assert shard <= crossed < 1.1 * shard, (d, crossed, shard)
    assert out["digests_ok"]
    assert out["server_on_trainer_node"]  # created by the trainer, on its node (server_near_creator)
    reads = out["reads"]
    assert all(r["prefetched"] for r in reads) and len(reads) == 4, reads  # seeders and the others
    assert not any(r["cross"] for r in reads), reads  # nobody's update read across


def test_a_seed_crosses_as_a_delta_and_every_reader_holds_the_exact_version(dcs):
    """seed_deltas: version 3 (version 2 changed at the measured 4.3%) crosses into each
    datacenter as its delta against the seeders' version 2: well under 0.15 of the shard."""
    out = _run(dcs, "seed_delta")
    shard = out["shard_bytes"]
    for d, crossed in out["crossed"].items():
        assert crossed < 0.15 * shard, (d, crossed, shard)
    assert out["digests_ok"]
    assert not any(r["cross"] for r in out["reads"]), out["reads"]


def test_smart_skipping_while_the_seed_crosses_then_the_new_version_is_read_locally(dcs):
    out = _run(dcs, "skip")
    rounds = out["rounds"]
    skipped = [r for rs in rounds for r in rs if r["skipped_in_flight"] == 2]
    assert skipped and all(r["version"] == 1 and r["action"] == "noop" for r in skipped), rounds
    assert max(r["wall_s"] for r in skipped) < 0.5, skipped  # an engine is not held up by the seed
    assert all(r["version"] == 2 and not r["cross_datacenter"] for r in rounds[-1]), rounds[-1]
    assert out["final_digests_ok"]
    assert out["crossed"]["1"] < 1.1 * out["shard_bytes"], out["crossed"]


def test_a_seeder_dying_mid_seed_leaves_its_datacenter_reader_to_finish(dcs):
    """trainer (dc0) ==> seeder's staging copy (dc1) -> sibling (dc1): the seeder is frozen under
    a cut link and killed with part of the shard across; the sibling, reading from the seeder
    when it died, fails over across the link and ends with exact bytes. Every run."""
    out = _run(dcs, "seeder_dies", "--mib", "48")
    print(json.dumps({k: out[k] for k in ("crossed_at_death", "crossed_total", "shard_bytes", "reader")}
                     | {"seed_units": [out["at_death"]["seed"][k] for k in ("units_done", "units")]}))
    shard, seed, sibling = out["shard_bytes"], out["at_death"]["seed"], out["at_death"]["sibling"]
    # the seed was partial when it died: the server's table, and fewer bytes than a shard crossed
    assert seed["state"] == "reading" and seed["version"] == 2 and seed["units_done"] < seed["units"], out
    assert shard // 4 <= out["crossed_at_death"] < shard, out
    assert sibling["state"] == "reading" and sibling["source"] == out["seed_client"], out
    r = out["reader"]
    assert r["ok"] and r["version"] == 2 and out["digest_ok"], out
    assert r["failovers"] >= 1 and r["sources"][0] == out["seed_client"] != r["sources"][-1], out
    assert out["crossed_total"] < out["crossed_at_death"] + 1.1 * shard, out  # at most one more shard crossed


def test_the_inter_datacenter_link_going_down_blocks_no_engine_and_everything_recovers(dcs):
    """dc1's link is cut for 12 s while version 2 is seeding: dc1's engines keep updating;
    every update returns (version 1, skipped, or a typed error) within request_timeout_s plus
    the time of the call it waited behind, and once the link is back they all reach version 2."""
    out = _run(dcs, "link_down", "--down-s", "12", timeout_s=500)
    limit = out["request_timeout_s"] * 2 + 5.0
    for rs in out["records"]:
        for r in rs:
            assert r["wall_s"] < limit, r  # nothing hangs
            assert (r["ok"] and r["version"] in (1, 2)) or r["error"], r
        during = [r for r in rs if out["down_at"] <= r["t"] - r["wall_s"] and r["t"] <= out["up_at"]]
        assert all(r["version"] == 1 or r["error"] for r in during), during
    assert all(r["ok"] and r["version"] == 2 for r in out["final"]), out["final"]
    assert out["final_digests_ok"]
