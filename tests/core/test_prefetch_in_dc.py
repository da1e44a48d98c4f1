"""Every reader of a remote datacenter prefetches from its datacenter's seed (``PrefetchAhead``,
``Config.prefetch_in_datacenter``), in process against the reference core:

    trainer (dc a) -> b0~prefetch (dc b, the seed, across) -> b1~prefetch -> b2~prefetch (inside dc b)
                                                                   |
                                                 b1.update("latest"): a local copy of b1~prefetch
"""

from __future__ import annotations

import pytest

from tensorhub.config import Config
from tensorhub.core import background as bg
from tensorhub.core import messages as m
from tensorhub.errors import ConfigError

from tests.core.test_core import LAYOUT, World


def _told(w, cid):
    return [e.version for e in w.pop(cid) if isinstance(e, m.PrefetchAhead)]


def _stage(w, owner, dc, shard=0, num_shards=1, replica=None):
    """``owner``'s staging copy (``Hub._open_copy``: replica ``<replica>~prefetch``)."""
    cid = f"{owner}~s"
    rid = f"{replica or owner}~prefetch"
    reply = w.send(m.Register(cid, "pol", rid, shard, num_shards, LAYOUT, cid.encode(), dc, False, stage_for=owner))
    assert isinstance(reply, m.Registered), reply
    return cid


def _fleet(**cfg):
    w = World(**{"prefetch_in_datacenter": True, **cfg})
    w.reg("t", dc="a"); w.reg("a1", dc="a")
    for c in ("b0", "b1", "b2"):
        w.reg(c, dc="b")
    w.reg("c0", dc="c"); w.reg("c1", dc="c")
    return w


def test_the_datacenters_other_readers_are_told_once_the_seed_is_partial_there_and_read_behind_it():
    w = _fleet()
    w.send(m.Publish("t", 1))
    assert [e for e in w.pop("b0") if isinstance(e, m.SeedAhead)] == [m.SeedAhead(version=1)]
    assert all(_told(w, c) == [] for c in ("a1", "b1", "b2", "c0", "c1")), "nothing is in dc b or c yet"
    _stage(w, "b0", "b")
    assert w.send(m.Replicate("b0~s", 1)).cross_datacenter  # the seed: partial in dc b from now on
    assert [_told(w, c) for c in ("a1", "b0", "b1", "b2", "c1")] == [[], [], [1], [1], []]
    assert _told(w, "b0~s") == []  # staging copies and the seeder itself are never told
    _stage(w, "b1", "b"); _stage(w, "b2", "b")
    a1, a2 = w.send(m.Replicate("b1~s", 1)), w.send(m.Replicate("b2~s", 1))
    assert (a1.source_id, a1.cross_datacenter, a1.source_partial) == ("b0~s", False, True)
    assert (a2.source_id, a2.cross_datacenter) == ("b1~s", False)  # the pipeline, inside dc b
    w.tick(1.0)
    w.send(m.Replicate("b0~s", 1))  # any later request: told once per version
    assert _told(w, "b1") == _told(w, "b2") == []
    for c in ("b0~s", "b1~s", "b2~s"):
        w.send(m.ReplicateDone(c, 1))
    a = w.send(m.Replicate("b1", "latest", update=True))
    assert (a.version, a.source_id, a.cross_datacenter) == (1, "b1~s", False), "its own staging copy: local"


def test_each_version_is_told_again_and_a_seeder_reading_in_its_own_update_counts_as_the_seed():
    """A seeder that does not prefetch (it ignores SeedAhead) and reads in its own update is the
    datacenter's partial holder as much as a staging copy: the others prefetch behind it."""
    w = _fleet(versions_retained=1)  # no offload of version 1 on the way to 2
    w.send(m.Publish("t", 1))
    assert w.send(m.Replicate("b0", 1)).cross_datacenter
    assert [_told(w, c) for c in ("b1", "b2")] == [[1], [1]]
    w.send(m.ReplicateDone("b0", 1))
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 2))
    seeder = next(c for c in ("b0", "b1", "b2") if 2 in [e.version for e in w.events.get(c, [])
                                                        if isinstance(e, m.SeedAhead)])
    assert _told(w, "b1") == _told(w, "b2") == []
    assert w.send(m.Replicate(seeder, 2, update=True)).cross_datacenter
    assert sorted(c for c in ("b0", "b1", "b2") if _told(w, c) == [2]) == sorted({"b0", "b1", "b2"} - {seeder})


@pytest.mark.parametrize("cfg", [dict(prefetch_in_datacenter=False), dict(offload_seeding=False)])
def test_nobody_is_told_when_off(cfg):
    w = _fleet(**cfg)
    w.send(m.Publish("t", 1))
    w.send(m.Replicate("b0", 1))
    assert [_told(w, c) for c in ("b1", "b2", "c1")] == [[], [], []]


def test_a_sharded_seed_is_told_only_once_every_shard_is_partial_in_the_datacenter():
    """Told when one shard of the seed is there, the other shard's prefetch would cross: the
    note waits for both."""
    w = World(prefetch_in_datacenter=True)
    for s in (0, 1):
        w.reg(f"t{s}", replica="t", shard=s, num_shards=2, dc="a")
        for rid in ("x", "y"):
            w.reg(f"{rid}{s}", replica=rid, shard=s, num_shards=2, dc="b")
    w.send(m.Publish("t0", 1)); w.send(m.Publish("t1", 1))
    assert [e.version for e in w.pop("x0") if isinstance(e, m.SeedAhead)] == [1]
    _stage(w, "x0", "b", 0, 2, replica="x"); _stage(w, "x1", "b", 1, 2, replica="x")
    w.send(m.Replicate("x0~s", 1, seq=bg.seed_round(1)))
    assert _told(w, "y0") == _told(w, "y1") == []
    w.send(m.Replicate("x1~s", 1, seq=bg.seed_round(1)))
    assert _told(w, "y0") == _told(w, "y1") == [1]


def test_seed_across_tells_a_seed_from_a_prefetch_inside_the_datacenter():
    assert bg.seed_across(m.SeedAhead(version=2)) is True
    assert bg.seed_across(m.PrefetchAhead(version=2)) is False
    assert bg.kind_of(m.PrefetchAhead(version=2)) is bg.Kind.SEED


def test_prefetch_in_datacenter_takes_a_typed_value_from_the_environment():
    assert Config.from_env({"TENSORHUB_PREFETCH_IN_DATACENTER": "off"}).prefetch_in_datacenter is False
    with pytest.raises(ConfigError):
        Config.from_env({"TENSORHUB_PREFETCH_IN_DATACENTER": "sometimes"})


def _view(published, stage_version):
    return bg.SeedView(staging=False, registered=True, closed=False, published=published, seeding=-1,
                       stage_version=stage_version)


@pytest.mark.parametrize("published, staged, waits", [
    (None, None, False),  # no staging copy yet: start
    (3, None, False),     # a staging copy that holds nothing (after a swap): start
    (3, 3, False),        # the engine took the staged version: start
    (3, 4, True),         # not taken yet: replacing it sends the next update over the network
    (None, 4, True),      # not even a first version taken
    (5, 4, False),        # the engine is past the staged version
])
def test_a_prefetch_inside_the_datacenter_waits_while_the_staged_version_is_not_taken(published, staged, waits):
    assert bg.prefetch_waits(_view(published, staged)) is waits
