"""The handle's background rules (:mod:`tensorhub.core.background`), pure, and that both drivers
(the Hub and the simulator's clients) take them from there instead of stating them again."""

from __future__ import annotations

import ast
import pathlib

import pytest

from tensorhub.core import background as bg
from tensorhub.core import messages as m
from tensorhub.core.handle import Phase

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tensorhub"


def test_every_background_event_has_one_owner():
    assert bg.kind_of(m.MakeHostCopy(version=3)) is bg.Kind.HOST_COPY
    assert bg.kind_of(m.SeedAhead(version=3)) is bg.Kind.SEED
    assert bg.kind_of(m.DropHostCopy(version=3)) is bg.Kind.MACHINE


_WANT = dict(between_calls=True, phase=Phase.PUBLISHED, published=4, keeps_copies=True, host_copy_ahead=True,
             versions_retained=2, host_copies_pooled=1)


def test_host_copy_wanted_only_between_calls_for_the_version_it_publishes():
    assert bg.host_copy_wanted(4, **_WANT)
    for change in (dict(between_calls=False), dict(phase=Phase.IDLE), dict(published=5), dict(keeps_copies=False),
                   dict(host_copy_ahead=False), dict(versions_retained=1),
                   dict(host_copies_pooled=0)):
        assert not bg.host_copy_wanted(4, **{**_WANT, **change}), change


_SEED = bg.SeedView(staging=False, registered=True, closed=False, published=2, seeding=-1)


@pytest.mark.parametrize("change, reason", [
    (dict(staging=True), "staging copy"),
    (dict(registered=False), "not registered"),
    (dict(closed=True), "closed"),
    (dict(published=5), "publishes version 5"),
    (dict(stage_version=5), "holds version 5"),
    (dict(seeding=5), "under way"),
    (dict(stage_seq=6), "rounds are past 6"),
])
def test_seed_decision_says_why_it_skips(change, reason):
    assert bg.seed_decision(5, _SEED) is None
    import dataclasses

    why = bg.seed_decision(5, dataclasses.replace(_SEED, **change))
    assert why is not None and reason in why


def test_seed_round_is_the_version_plus_one_whatever_was_skipped():
    assert [bg.seed_round(v) for v in (0, 1, 7)] == [1, 2, 8]
    assert bg.seed_decision(5, bg.SeedView(staging=False, registered=True, closed=False, published=None,
                                           seeding=-1, stage_version=3, stage_seq=5)) is None


def _answer(**kw):
    return bg.after_pulse(may_announce=True, **kw)


def test_after_pulse_reoffers_when_known_and_announces_when_not():
    known = _answer(known=True, acked_before=3, acked=7, reading=True, idle=True, unoffered=True)
    assert (known.acked, known.reoffer, known.announce) == (7, True, False)
    assert _answer(known=True, acked_before=9, acked=7, reading=False, idle=True, unoffered=False).acked == 9
    reader = _answer(known=False, acked_before=0, acked=0, reading=True, idle=False, unoffered=True)
    assert (reader.reoffer, reader.announce) == (False, True)
    busy = _answer(known=False, acked_before=0, acked=0, reading=False, idle=False, unoffered=False)
    assert not busy.announce  # the call in flight announces itself
    assert _answer(known=False, acked_before=0, acked=0, reading=False, idle=True, unoffered=False).announce


def test_after_pulse_on_the_progress_stream_neither_announces_nor_reoffers_an_unknown_handle():
    """The progress stream leaves announcing to the liveness stream (one announcement per
    restart), and offering host copies to a server that does not know the handle is useless."""
    for reading, idle in ((True, False), (False, True)):
        quiet = bg.after_pulse(may_announce=False, known=False, acked_before=2, acked=5, reading=reading,
                               idle=idle, unoffered=True)
        assert (quiet.acked, quiet.reoffer, quiet.announce) == (5, False, False)
    known = bg.after_pulse(may_announce=False, known=True, acked_before=0, acked=0, reading=True, idle=False,
                           unoffered=True)
    assert known.reoffer and not known.announce


def _calls(path: pathlib.Path) -> set[str]:
    """Every ``bg.<name>`` a module uses."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "bg":
            out.add(node.attr)
    return out


def test_both_drivers_take_the_rules_from_the_core():
    """The Hub (with its parts, tensorhub/handle/) and the simulator's clients call the same
    rules (a rule stated twice drifts)."""
    handle = sorted((ROOT / "handle").glob("*.py"))
    hub = set().union(*(_calls(path) for path in handle))
    sim = _calls(ROOT / "sim" / "client.py") | _calls(ROOT / "sim" / "seeding.py")
    rules = {"kind_of", "host_copy_wanted", "seed_decision", "seed_round", "after_pulse"}
    assert rules <= hub, rules - hub
    assert rules <= sim, rules - sim
    for path in (*handle, ROOT / "sim" / "seeding.py"):
        assert "def _seed_round" not in path.read_text() and "def seed_round" not in path.read_text()
