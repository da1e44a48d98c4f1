"""``tensorhub chaos`` judges each failed operation against its own ground truth (plain unit
tests, no Ray): :func:`classify` is the rule, :class:`Holdings` the replay that feeds it.

A chaos round: ``trainer -> r0 (non-spot), r1 (spot), ...``; the trainer publishes version v,
the rollouts update to it, one fault strikes.
"""

from __future__ import annotations

import pytest

from tensorhub.chaos import Copy, Holdings, Verdict, classify

L, G, U = Copy.LIVE, Copy.GONE, Copy.UNKNOWN
E, X = Verdict.EXPECTED, Verdict.UNEXPECTED


@pytest.mark.parametrize(
    "killed_self, typed, copies, verdict, reason",
    [
        # the actor that ran the operation was killed: whatever Ray raised is explained
        (True, False, {1: L, 2: L}, E, "its actor was killed"),
        (True, True, {2: L}, E, "its actor was killed"),
        # a live non-spot copy of any retained version: the reader should have got one
        (False, True, {1: L, 2: G}, X, "version 1 had a live non-spot holder"),
        (False, True, {1: G, 2: L}, X, "version 2 had a live non-spot holder"),
        (False, False, {1: L, 2: L}, X, "version 2 had a live non-spot holder"),
        (False, True, {1: U, 2: L}, X, "version 2 had a live non-spot holder"),
        # nothing retained is held: a typed error (VersionLost, ...) is the right answer ...
        (False, True, {1: G, 2: G}, E, "no live non-spot holder of any retained version"),
        (False, True, {}, E, "no live non-spot holder of any retained version"),
        # ... a hang or a crash is not
        (False, False, {1: G, 2: G}, X, "not a typed TensorHub error"),
        # a host copy that may have died with one of its candidate owners: not certainly live
        (False, True, {1: U, 2: G}, E, "no certain live non-spot holder (version 1's host copy may have been killed)"),
    ],
)
def test_classify_table(killed_self, typed, copies, verdict, reason):
    assert classify(killed_self=killed_self, typed=typed, copies=copies) == (verdict, reason)


def _hub(*actors: tuple[str, bool]) -> Holdings:
    h = Holdings(versions_retained=2)
    for a, spot in actors:
        h.spawn(a, spot=spot)
    return h


def test_trainer_killed_after_publish_with_no_finished_reader_leaves_only_the_older_host_copy():
    """trainer -> r0, r1(spot): v1 everywhere; v2 published, the rollouts start updating (r0,
    the last non-spot holder of v1, keeps a host copy), the trainer dies before anyone
    finished v2: v2 is gone, v1 lives in r0's host memory, so a failure now is unexpected."""
    h = _hub(("t", False), ("r0", False), ("r1", True))
    h.publish("t", 1)
    h.finish("r0", 1)
    h.finish("r1", 1)
    h.publish("t", 2)
    assert h.copies() == {1: L, 2: L}  # r0 still publishes 1; the trainer dropped it
    h.leave(["r0", "r1"])
    assert h.copies() == {1: L, 2: L}
    h.kill("t")
    assert h.copies() == {1: L, 2: G}
    assert classify(killed_self=False, typed=True, copies=h.copies())[0] is X
    assert h.holders() == {"1": ["host copy in one of r0"], "2": []}


def test_trainer_as_last_non_spot_holder_keeps_a_host_copy_that_dies_with_it():
    """trainer -> r1(spot) only: when the trainer publishes v2 it is the last non-spot holder
    of v1 and keeps a host copy; killing the trainer loses both versions (spot r1 does not count)."""
    h = _hub(("t", False), ("r1", True))
    h.publish("t", 1)
    h.finish("r1", 1)
    h.publish("t", 2)
    assert h.copies() == {1: L, 2: L}
    h.kill("t")
    assert h.copies() == {1: G, 2: G}
    assert classify(killed_self=False, typed=True, copies=h.copies())[0] is E


def test_concurrent_unpublishers_share_one_host_copy_whose_owner_is_unknown():
    """r0 and r2 (both non-spot) leave v1 at once; one of them keeps the copy: killing one makes
    it UNKNOWN, killing both GONE."""
    h = _hub(("t", False), ("r0", False), ("r2", False))
    h.publish("t", 1)
    h.finish("r0", 1)
    h.finish("r2", 1)
    h.publish("t", 2)
    h.leave(["r0", "r2"])
    assert h.copy(1) is L
    h.kill("r0")
    assert h.copy(1) is U
    h.kill("r2")
    assert h.copy(1) is G


def test_host_copies_are_freed_past_retention_and_only_retained_versions_count():
    h = _hub(("t", False), ("r1", True))
    h.publish("t", 1)
    h.publish("t", 2)  # the trainer keeps a host copy of 1
    assert h.copies() == {1: L, 2: L}
    h.publish("t", 3)  # 1 falls out of retention (2 is now a host copy)
    assert h.copies() == {2: L, 3: L}
    assert 1 not in h.host


def test_a_finished_reader_is_a_holder_and_a_spot_one_is_not():
    h = _hub(("t", False), ("r0", False), ("r1", True))
    h.publish("t", 1)
    h.publish("t", 2)
    h.finish("r1", 2)
    h.kill("t")
    assert h.copies() == {1: G, 2: G}  # r1 is spot
    h.finish("r0", 2)
    assert h.copies() == {1: G, 2: L}
    h.kill("r0")
    h.finish("r0", 2)  # a dead actor's late report changes nothing
    assert h.copies() == {1: G, 2: G}
    assert h.alive() == ["r1"]
