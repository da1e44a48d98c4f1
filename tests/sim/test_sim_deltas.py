"""Seeds as deltas in the fault-injecting simulator (tensorhub/sim/deltas.py): the crossdc
workload with ``seed_deltas``, every fault as usual.

    trainer (dc0) publish v -> OfferDelta(v, base v-1) ; seeder's staging copy (dc1, holds v-1)
    -> FindDelta -> the delta's bytes over the slow link -> rebuilt v -> read locally

A delta against a missing base (the staging copy skipped a version, or holds none) or a wrong
one (the publisher's copy of the base went bad) falls back to the full seed, and no checker sees
a wrong byte; with the base check planted out, the checkers do.
"""

from __future__ import annotations

import pytest

from tensorhub.sim.scenario import World, run_scenario

SEEDS = range(40)


def _run(**kw):
    worlds = []
    for seed in SEEDS:
        w = World(seed, "crossdc", seed_deltas=True, **kw)
        w.run()
        worlds.append(w)
    return worlds


@pytest.mark.sim
def test_seeds_cross_as_deltas_and_fall_back_where_the_base_is_missing_with_every_invariant_held():
    worlds = _run()
    assert [(seed, w.checker.violations[:2]) for seed, w in zip(SEEDS, worlds) if w.checker.violations] == []
    applied = sum(w.deltas.applied for w in worlds)
    missing = sum(w.deltas.fallbacks.get("VersionNotFound", 0) for w in worlds)
    assert applied >= 60 and missing >= 10, (applied, missing)


@pytest.mark.sim
def test_deltas_against_a_wrong_base_fall_back_to_the_full_seed_and_no_wrong_byte_lands():
    worlds = _run(delta_wrong_base=0.5)
    assert [w.checker.violations[:2] for w in worlds if w.checker.violations] == []
    assert sum(w.deltas.fallbacks.get("DeltaWrongBase", 0) for w in worlds) >= 10
    assert sum(w.deltas.applied for w in worlds) >= 30


@pytest.mark.sim
def test_the_checkers_catch_a_delta_applied_to_the_wrong_base_when_the_check_is_planted_out():
    worlds = _run(delta_wrong_base=0.5, delta_check_base=False)
    torn = [v for w in worlds for v in w.checker.violations if v[0] == "torn" and "delta-garbage" in v[2]]
    assert len(torn) >= 5, len(torn)


@pytest.mark.sim
def test_a_seed_with_deltas_replays_to_the_same_trace():
    a = run_scenario(3, "crossdc", seed_deltas=True, delta_wrong_base=0.3)
    b = run_scenario(3, "crossdc", seed_deltas=True, delta_wrong_base=0.3)
    assert a.digest == b.digest and a.digest != run_scenario(3, "crossdc").digest
