"""The core's offers of seeds as deltas (tensorhub/core/deltas.py), as tables:

    trainer (dc a, publishes v, holds v-1 on the side) --OfferDelta--> server
    seeder's staging copy (dc b, holds v-1) --FindDelta(v, base v-1)--> DeltaAt | VersionNotFound
"""

from __future__ import annotations

import pytest

from tensorhub.core import bounds
from tensorhub.core import messages as m
from tensorhub.errors import OutOfBounds

from tests.core.test_core import LAYOUT, World, err


def _offer(cid="t", version=2, base=1, nbytes=40, capacity=100, endpoint=b"t-delta"):
    return m.OfferDelta(cid, version, base, endpoint, nbytes, capacity)


def _world():
    w = World(versions_retained=1)  # no retention copies: the offers are the point here
    w.reg("t", dc="a")
    w.reg("s", dc="b")
    w.send(m.Publish("t", 1))
    w.send(m.Replicate("s", 1)); w.send(m.ReplicateDone("s", 1))  # the seeder holds the base
    w.send(m.Unpublish("t"))
    assert w.send(m.Publish("t", 2)) == m.Ok()
    return w


def test_a_seeder_finds_the_newest_offer_of_its_shard_for_its_base():
    w = _world()
    assert w.send(_offer()) == m.Ok()
    assert w.send(m.FindDelta("s", 2, 1)) == m.DeltaAt(source_id="t", endpoint=b"t-delta", nbytes=40, capacity=100)


@pytest.mark.parametrize("version, base, code", [(2, 0, "VersionNotFound"),  # another base: full seed
                                                 (3, 2, "VersionNotFound"),  # nothing offered of 3
                                                 (1, 0, "VersionNotFound")])
def test_no_offer_for_that_version_and_base_is_version_not_found(version, base, code):
    w = _world()
    w.send(_offer())
    assert err(w.send(m.FindDelta("s", version, base))) == code


def test_an_offer_replaces_the_one_before_and_one_is_kept_per_shard():
    w = _world()
    w.send(_offer(version=2, base=1))
    w.send(_offer(version=2, base=0, endpoint=b"other"))
    assert err(w.send(m.FindDelta("s", 2, 1))) == "VersionNotFound"
    assert w.send(m.FindDelta("s", 2, 0)).endpoint == b"other"
    assert len(w.core.deltas.offers) == 1


@pytest.mark.parametrize("req, code", [
    (_offer(version=1, base=0), "InvalidState"),  # t publishes 2, not 1
    (_offer(version=2, base=2), "OutOfBounds"),  # a base no older than the version
    (_offer(capacity=LAYOUT.total_bytes + 1), "OutOfBounds"),  # a buffer larger than the shard
    (m.OfferDelta("s", 2, 1, b"x", 1, 10), "InvalidState"),  # s publishes nothing
])
def test_an_offer_is_taken_only_from_the_publisher_of_that_version(req, code):
    w = _world()
    assert err(w.send(req)) == code
    assert w.core.deltas.offers == {}


def test_an_offer_of_a_client_that_left_is_not_answered():
    w = _world()
    w.reg("r", dc="a")
    w.send(m.Replicate("r", 2)); w.send(m.ReplicateDone("r", 2))
    w.send(_offer())
    assert w.send(m.Leave("t")) == m.Ok()
    assert err(w.send(m.FindDelta("s", 2, 1))) == "VersionNotFound"
    assert w.core.deltas.offers == {}


def test_a_publishers_first_version_promises_the_next_ones_delta():
    """t's first version has no delta (no older copy): its offer of base -1 is a promise, so a
    seeder of the next version waits for that delta instead of crossing in full."""
    w = _world()
    assert w.send(_offer(version=2, base=-1, nbytes=0, endpoint=b"")) == m.Ok()
    assert err(w.send(m.FindDelta("s", 2, 1))) == "VersionNotFound"  # nothing of 2 itself
    w.send(m.Replicate("s", 2, update=True)); w.send(m.ReplicateDone("s", 2))
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 3))
    assert err(w.send(m.FindDelta("s", 3, 2))) == "DeltaPending"
    assert err(w.send(_offer(version=3, base=-1, nbytes=5))) == "OutOfBounds"  # a promise carries no bytes


@pytest.mark.parametrize("req", [_offer(nbytes=0), _offer(nbytes=101), _offer(capacity=0), _offer(base=-2),
                                 m.FindDelta("s", -1, 0)])
def test_offers_and_finds_out_of_bounds_are_refused_at_the_gate(req):
    with pytest.raises(OutOfBounds):
        bounds.check_request(req, models=("pol",))


def test_a_delta_still_being_encoded_is_pending_not_missing():
    """t offered 2's delta and now publishes 3: a seeder asking for 3 is told to ask again."""
    w = _world()
    w.send(_offer())
    w.send(m.Replicate("s", 2, update=True)); w.send(m.ReplicateDone("s", 2))
    w.send(m.Unpublish("t"))
    assert w.send(m.Publish("t", 3)) == m.Ok()
    assert err(w.send(m.FindDelta("s", 3, 2))) == "DeltaPending"
    assert err(w.send(m.FindDelta("s", 4, 3))) == "VersionNotFound"
    assert w.send(_offer(version=3, base=2)) == m.Ok()
    assert w.send(m.FindDelta("s", 3, 2)).nbytes == 40
