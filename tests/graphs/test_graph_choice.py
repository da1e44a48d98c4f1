"""``path="auto"``: the path measured faster for a topology (pure; no Ray)."""

from __future__ import annotations

import pytest

from tensorhub.graphs.choice import PathChooser
from tensorhub.graphs.plan import BATCHES_MAX, UNITS_PER_BATCH_MAX, default_batches

GB = 10**9


@pytest.mark.parametrize("cached, graph_s, pull_s, expect, why", [
    (False, None, None, "pull", "no compiled graph"),
    (False, 1.0, 2.0, "pull", "no compiled graph"),  # measured faster, but not compiled (now)
    (True, None, None, "graph", "graph not measured"),
    (True, None, 2.0, "graph", "graph not measured"),
    (True, 1.0, None, "pull", "pull not measured"),
    (True, 1.0, 2.0, "graph", "measured faster"),
    (True, 3.0, 2.0, "pull", "measured faster"),
])
def test_choice_table(cached, graph_s, pull_s, expect, why):
    c = PathChooser()
    for path, s in (("graph", graph_s), ("pull", pull_s)):
        if s is not None:
            c.record("k", path, s, GB)
    path, reason = c.choose("k", cached)
    assert path == expect and why in reason


def test_the_slower_path_is_re_measured_now_and_then_when_the_two_are_close():
    c = PathChooser(explore_every=5)
    c.record("k", "graph", 1.0, GB)
    c.record("k", "pull", 1.05, GB)
    picks = [c.choose("k", True)[0] for _ in range(10)]
    assert picks.count("pull") == 2 and picks[4] == picks[9] == "pull"


def test_a_path_measured_clearly_slower_is_never_taken_again():
    """Issue 27: ``auto`` never picks the slower path for a topology it has measured (the graph
    at 1.9x the pull path on the emulated cluster): no re-measuring beyond ``explore_within``."""
    c = PathChooser(explore_every=5, explore_within=1.1)
    c.record("k", "graph", 1.9, GB)
    c.record("k", "pull", 1.0, GB)
    assert {c.choose("k", True)[0] for _ in range(100)} == {"pull"}
    with pytest.raises(ValueError):
        PathChooser(explore_within=0.9)


def test_measurements_are_per_byte_and_averaged():
    c = PathChooser()
    c.record("k", "graph", 2.0, 2 * GB)   # 1 s/GB
    c.record("k", "pull", 1.5, GB)        # 1.5 s/GB
    assert c.choose("k", True)[0] == "graph"
    c.record("k", "graph", 4.0, GB)       # graph got slower: average 2.5 s/GB
    assert c.measured("k")["graph"] == pytest.approx(2.5)
    assert c.choose("k", True)[0] == "pull"


def test_nothing_is_recorded_for_a_fallback_or_an_empty_round():
    c = PathChooser()
    c.record("k", "fallback", 1.0, GB)
    c.record("k", "graph", 1.0, 0)
    assert c.measured("k") == {}


def test_topologies_are_bounded_and_forgettable():
    c = PathChooser(topologies_max=2)
    for k in ("a", "b", "c"):
        c.record(k, "pull", 1.0, GB)
    assert c.measured("a") == {} and c.measured("c")
    c.forget("c")
    assert c.measured("c") == {}


@pytest.mark.parametrize("units, given, expect", [
    (16, None, 16),              # one batch per unit
    (1000, None, BATCHES_MAX),   # capped
    (0, None, 1),
    (128, 8, 8),                 # as given
    (UNITS_PER_BATCH_MAX * 3, 1, 3),  # an edge never carries more than the cap of checksums
])
def test_default_batches(units, given, expect):
    assert default_batches(units, given) == expect


def test_default_batches_rejects_zero():
    with pytest.raises(ValueError):
        default_batches(10, 0)
