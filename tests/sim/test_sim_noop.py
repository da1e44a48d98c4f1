"""No-op updates answered locally under the simulator: the ``fresh`` checker
(:mod:`tensorhub.sim.freshness`) stays quiet on the shipped code with delayed pushes, and
catches four planted bugs: a handle that ignores the staleness bound (caught where the
``push_delay`` fault holds a push up longer than what it knew stays fresh), a server that
pushes a model's first newest version only (every later commit untold), a handle that ignores
the news that its datacenter's smart skip ended (the seed landed), and a server that never
tells a datacenter its skip ended."""

from __future__ import annotations

import pytest

from tensorhub.core.handle_view import View
from tensorhub.core.views import Views
from tensorhub.sim import run_scenario

pytestmark = pytest.mark.sim


def ignores_the_bound(mp):
    """A handle answers from what it knows however old it is."""
    orig = View.answer
    mp.setattr(View, "answer", lambda self, spec, published, now, sharded: orig(
        self, spec, published, min(now, self.fresh_until - 1.0), sharded))


def ignores_landed_news(mp):
    """A handle keeps the skip it knows when news says there is none (the seed landed in its
    datacenter, or the server stopped skipping there): it goes on skipping the landed version."""
    orig = View.viewed

    def bad(self, ev):
        skip = (self.in_flight, self.ready)
        orig(self, ev)
        if self.in_flight < 0 <= skip[0]:
            self.in_flight, self.ready = skip
    mp.setattr(View, "viewed", bad)


def never_tells_a_skip_ended(mp):
    """The server tells a datacenter of a skip, and never that it ended (its newest unchanged)."""
    orig = Views._settle_model

    def bad(self, model):
        before, newest, n = dict(self.skips.get(model, {})), self.pushed.get(model), len(self.table.effects)
        orig(self, model)
        ended = {dc for dc in before if dc not in self.skips.get(model, {})}
        if ended and self.pushed.get(model) == newest:
            self.table.effects[n:] = [e for e in self.table.effects[n:] if not (
                type(e.event).__name__ == "Newest" and self.table.nodes[e.client_id].datacenter in ended)]
    mp.setattr(Views, "_settle_model", bad)


def pushes_first_newest_only(mp):
    """The server tells a model's first newest version and no later change."""
    orig = Views.settle

    def bad(self, models):
        before = dict(self.pushed)
        orig(self, models)
        if any(self.pushed.get(mo) != v and v >= 0 for mo, v in before.items()):
            self.table.effects = [e for e in self.table.effects if type(e.event).__name__ != "Newest"]
    mp.setattr(Views, "settle", bad)


@pytest.mark.parametrize("plant, seeds, workload", [
    (ignores_the_bound, (35, 106), None),
    (pushes_first_newest_only, (0, 2), None),
    (ignores_landed_news, (0, 4), "crossdc"),  # caught by the first rule: not the skip it was told
    (never_tells_a_skip_ended, (6, 22), "crossdc"),  # caught by the last: not the server's skip
])
def test_the_fresh_checker_catches_a_planted_bug(monkeypatch, plant, seeds, workload):
    clean = [run_scenario(s, workload) for s in seeds]
    assert not [v for r in clean for v in r.violations if v[0] == "fresh"]
    plant(monkeypatch)
    for seed in seeds:
        assert "fresh" in {k for k, _, _ in run_scenario(seed, workload).violations}, seed


def test_crossdc_seeds_answer_smart_skips_locally_and_stay_fresh():
    """Across datacenters, no-ops that the server would answer with a smart skip are answered
    locally too (``local_skips``), and every one was the server's skip within the bound."""
    from tensorhub.sim.scenario import World

    skips = 0
    for seed in range(12):
        w = World(seed, "crossdc", None, keep_trace=False, faults=True, interrupts=True, shared_processes=False)
        w.run()
        assert not [v for v in w.checker.violations if v[0] == "fresh"], (seed, w.checker.violations)
        skips += w.checker.freshness.local_skips
    assert skips > 0


def test_seeds_with_delayed_pushes_answer_locally_and_stay_fresh():
    delayed = 0
    for seed in range(40):
        r = run_scenario(seed, keep_trace=False)
        assert not [v for v in r.violations if v[0] == "fresh"], (seed, r.violations)
        delayed += r.faults.get("push_delay", 0)
    assert delayed > 0
