"""No-op updates answered locally under the simulator: the ``fresh`` checker
(:mod:`tensorhub.sim.freshness`) stays quiet on the shipped code with delayed pushes, and
catches two planted bugs: a handle that ignores the staleness bound (caught where the
``push_delay`` fault holds a push up longer than what it knew stays fresh), and a server that
pushes a model's first newest version only (every later commit untold)."""

from __future__ import annotations

import pytest

from tensorhub.core.handle_view import View
from tensorhub.core.views import Views
from tensorhub.sim import run_scenario

pytestmark = pytest.mark.sim


def ignores_the_bound(mp):
    """A handle answers from what it knows however old it is."""
    mp.setattr(View, "answers", lambda self, spec, published, now, sharded: (
        not sharded and spec == "latest" and published is not None and published == self.newest))


def pushes_first_newest_only(mp):
    """The server tells a model's first newest version and no later change."""
    orig = Views.settle

    def bad(self, models):
        before = dict(self.pushed)
        orig(self, models)
        if any(self.pushed.get(mo) != v and v >= 0 for mo, v in before.items()):
            self.table.effects = [e for e in self.table.effects if type(e.event).__name__ != "Newest"]
    mp.setattr(Views, "settle", bad)


@pytest.mark.parametrize("plant, seeds", [(ignores_the_bound, (35, 106)), (pushes_first_newest_only, (0, 2))])
def test_the_fresh_checker_catches_a_planted_bug(monkeypatch, plant, seeds):
    clean = [run_scenario(s) for s in seeds]
    assert not [v for r in clean for v in r.violations if v[0] == "fresh"]
    plant(monkeypatch)
    for seed in seeds:
        assert "fresh" in {k for k, _, _ in run_scenario(seed).violations}, seed


def test_seeds_with_delayed_pushes_answer_locally_and_stay_fresh():
    delayed = 0
    for seed in range(40):
        r = run_scenario(seed, keep_trace=False)
        assert not [v for v in r.violations if v[0] == "fresh"], (seed, r.violations)
        delayed += r.faults.get("push_delay", 0)
    assert delayed > 0
