"""Resharded reads at the reference core (issue 24 stage 3b, docs/placements.md): layout classes
and reshard assignments. Pure core, driven as tests/core/test_core.py drives it.

The model of tests/core/test_placements_server.py: ``q`` [8, 4], ``k`` [4, 4], ``norm`` [4].
The trainer (replica ``t``) holds it as 2 shards cut by rows. Rollouts hold it another way:

- ``cols(rank)``: 2 shards cut by columns (q, k) with ``norm`` whole (a TP=2 engine's
  row-parallel layers): other local shapes, so another layout class;
- ``whole``: 1 shard holding everything (TP=1): another shard count, another class.

A rollout replica of another class reads each of its shards by a *resharded read*: an
``Assignment`` whose ``reshard`` names every shard of a trainer replica (with their placements)
and whose reader is counted by the trainer shards it needs.
"""

from __future__ import annotations

import pytest

from tensorhub import placement as P
from tensorhub.core import messages as m
from tensorhub.core.cells import PER_HOLDER_MAX, grid_key
from tensorhub.core.placements import CLASS_SEP
from tensorhub.core.reshard import plan_reshard
from tensorhub.core.state import NodeState
from tests.core.test_placements_server import K, NORM, Q, SCHEMA, World, layout_of, refused, rows


def cols(rank: int, n: int = 2) -> P.Placement:
    return P.Placement.build([P.split(Q, 1, rank, n), P.split(K, 1, rank, n), P.whole(NORM)], SCHEMA)


WHOLE = P.whole_placement(SCHEMA)


class RW(World):
    def rollout(self, replica, placements, **kw):
        n = len(placements)
        out = []
        for s, p in enumerate(placements):
            cid = f"{replica}/{s}"
            reply = self.send(m.Register(cid, "pol", replica, s, n, layout_of(p), cid.encode(), placement=p, **kw))
            assert isinstance(reply, m.Registered), reply
            out.append(cid)
        return out

    def published_trainer(self, replica="t", version=1):
        ids = self.trainer(replica)
        for cid in ids:
            assert self.send(m.Publish(cid, version)) == m.Ok()
        return ids

    def node(self, cid):
        return self.core.nodes[cid]


def reshard_of(a: m.Assignment) -> list[str]:
    assert isinstance(a, m.Assignment) and a.reshard, a
    return [s.client_id for s in a.reshard]


# --------------------------------------------------------------------------- layout classes


def test_replicas_of_other_layouts_open_layout_classes_and_a_replica_stays_in_its_class():
    w = RW()
    w.trainer("t")
    w.rollout("c", [cols(0), cols(1)])
    w.rollout("d", [cols(0), cols(1)])
    w.rollout("w", [WHOLE])
    classes = w.core.table.classes["pol"]
    assert classes == ["pol", f"pol{CLASS_SEP}1", f"pol{CLASS_SEP}2"]
    assert [w.node(c).model for c in ("t/0", "c/0", "d/1", "w/0")] == classes[:2] + classes[1:]
    # A shard of replica c with another placement than its class's shard 1: refused, as before.
    w.register("c2/0", "c2", 0, cols(0), num_shards=2)
    reply = w.register("c2/1", "c2", 1, cols(0), num_shards=2)
    refused(reply, says="differs from shard 1's placement")
    # Without a placement another shard count is refused as before (no class opens).
    reply = w.send(m.Register("x/0", "pol", "x", 0, 3, layout_of(rows(0)), b"x"))
    refused(reply, says="has 2 shards per replica, not 3")
    # Status shows the first class under the model's name with every class's placements, the
    # others named as classes (a Query for the model finds them all).
    views = w.core.status("pol").models
    assert [v.model for v in views] == ["pol", "pol (layout class 1)", "pol (layout class 2)"]
    assert [v.num_shards for v in views] == [2, 2, 1] and views[1].placements == ()
    assert {u.digest for u in views[0].placements} == {
        p.digest() for p in (rows(0), rows(1), cols(0), cols(1), WHOLE)}


def test_a_class_is_forgotten_with_its_last_node_and_its_name_reused():
    w = RW()
    w.trainer("t")
    w.rollout("w", [WHOLE])
    assert w.send(m.Leave("w/0")) == m.Ok()
    assert w.core.table.classes["pol"] == ["pol"]
    w.rollout("w2", [WHOLE])
    assert w.node("w2/0").model == f"pol{CLASS_SEP}1"


# --------------------------------------------------------------------------- resharded reads


def test_a_rollout_of_another_layout_reads_by_reshard_and_its_class_pipelines_from_it():
    w = RW()
    w.published_trainer()
    c = w.rollout("c", [cols(0), cols(1)])
    a0 = w.send(m.Replicate(c[0], "latest", seq=1))
    a1 = w.send(m.Replicate(c[1], "latest", seq=1))
    # Each column shard needs both trainer shards (q and k are cut by rows there).
    for cid, a in ((c[0], a0), (c[1], a1)):
        assert reshard_of(a) == ["t/0", "t/1"] and a.version == 1 and not a.cross_datacenter
        # the holder replica's placements, then the reader class's (the checksum grid's)
        assert [p.digest() for p in a.placements] == [rows(0).digest(), rows(1).digest(),
                                                      *sorted({cols(0).digest(), cols(1).digest()})]
        assert [s.placement for s in a.reshard] == [rows(0).digest(), rows(1).digest()]
        needed = plan_reshard(w.core.placements.get(w.node(cid).placement), [rows(0), rows(1)],
                              spread=w.node(cid).shard).shards
        assert tuple(w.node(cid).reshard_from) == tuple(f"t/{i}" for i in needed)
    assert w.node("t/0").readers == {c[0], c[1]} == w.node("t/1").readers
    # A second replica of the class pipelines from the first, not from the trainer.
    d = w.rollout("d", [cols(0), cols(1)])
    b0 = w.send(m.Replicate(d[0], "latest", seq=1))
    assert isinstance(b0, m.Assignment) and not b0.reshard and b0.source_id == c[0] and b0.source_partial
    # The class commits version 1 once both of c's shards are done; the trainer's readers leave.
    for cid in c:
        assert w.send(m.ReplicateDone(cid, 1)) == m.Ok()
    assert w.node("t/0").readers == set() and w.core.available(f"pol{CLASS_SEP}1") == [1]
    assert w.core.nodes[c[0]].state is NodeState.PUBLISHED and w.node(c[0]).reshard_from == ()


def test_a_one_shard_rollout_reads_from_the_two_shard_trainer_and_resolves_the_trainers_latest():
    w = RW()
    w.published_trainer("t", version=1)
    w.published_trainer("u", version=2)
    (x,) = w.rollout("w", [WHOLE])
    a = w.send(m.Replicate(x, "latest", seq=1))
    assert a.version == 2 and reshard_of(a) == ["u/0", "u/1"] and w.node(x).reshard_from == ("u/0", "u/1")
    assert w.send(m.Progress(x, 1)) == m.Ok()
    assert w.send(m.ReplicateDone(x, 2)) == m.Ok()
    # Now a version exists in both classes: "latest" resolves across them.
    assert w.core.versions.available_all("pol") == [1, 2] == w.core.versions.available_all(w.node(x).model)
    assert w.core.available(w.node(x).model) == [2]


def test_the_trainers_unpublish_drains_until_its_reshard_readers_are_done():
    w = RW()
    t = w.published_trainer()
    (x,) = w.rollout("w", [WHOLE])
    w.send(m.Replicate(x, "latest", seq=1))
    assert not isinstance(w.send(m.Unpublish(t[0])), m.ErrorReply)
    assert w.node(t[0]).state is NodeState.DRAINING
    assert [type(e) for e in w.pop(t[0])] == [m.HashCells]  # asked at the assignment
    assert w.send(m.ReplicateDone(x, 1)) == m.Ok()
    # The drain ends without an offload: the rollout holds version 1 whole, in a layout that can
    # fill the trainer's shard again (a resharded read), so the trainer's copy is not the last.
    assert w.node(t[0]).state is NodeState.IDLE
    assert [type(e) for e in w.pop(t[0])] == [m.UnpublishDone]


def test_a_trainer_offloads_when_no_other_layout_holds_its_shard_whole():
    """The same drain, but the rollout holds only q (it cannot fill the trainer's shard): the
    trainer's last copy of version 1 is copied to host memory first, as without layouts."""
    w = RW()
    t = w.published_trainer()
    (x,) = w.rollout("q", [P.Placement.build([P.whole(Q)], SCHEMA)])
    w.send(m.Replicate(x, "latest", seq=1))
    assert w.send(m.ReplicateDone(x, 1)) == m.Ok()
    assert isinstance(w.send(m.Unpublish(t[0])), m.OffloadOrder)
    assert w.node(t[0]).state is NodeState.OFFLOADING


def test_an_engine_class_behind_the_trainer_reads_the_new_version_without_an_offload():
    """``versions_retained`` 1: the trainer's class has committed version 2, the engine's class
    still retains version 1 (it has not caught up). The model has moved past version 1, so the
    engine's last copy of it is read over without a host copy, as with one layout (before, the
    last engine of a layout class offloaded the old version at every step)."""
    w = RW(versions_retained=1)
    t = w.published_trainer()
    (x,) = w.rollout("w", [WHOLE])
    w.send(m.Replicate(x, "latest", seq=1))
    assert w.send(m.ReplicateDone(x, 1)) == m.Ok()
    for cid in t:
        assert w.send(m.Unpublish(cid)) == m.UnpublishDone(version=1)  # the engine holds it
        assert w.send(m.Publish(cid, 2)) == m.Ok()
    assert w.core.retained("pol") == [2] and w.core.retained(w.node(x).model) == [1]
    a = w.send(m.Replicate(x, "latest", seq=2, update=True))
    assert reshard_of(a) == ["t/0", "t/1"] and a.version == 2
    assert w.node(x).state is NodeState.READING and not w.core.nodes.get(f"{x}#host1")
    # The engine cannot leave meanwhile only because of version 1 either.
    assert w.core.retention.last_copies(w.node(x)) == []


def test_another_layouts_copy_counts_only_while_its_own_class_retains_the_version():
    """``versions_retained`` 2. The trainer's last copy of version 1 drains while an engine
    replica holds version 1 whole, in a class that committed versions 2 and 3 (forgetting 1)
    and then lost 3: the model still retains 1 (with 2), but nothing keeps the engine's copy
    (it may read over it without an offload), so it is no copy for the trainer: the trainer
    offloads. Counting it, each class relied on the other (the simulator's mixed_spot seed
    109, under the rule of that time)."""
    w = RW(versions_retained=2)
    t = w.published_trainer()
    (x,) = w.rollout("w", [WHOLE])
    w.send(m.Replicate(x, "latest", seq=1))
    assert w.send(m.ReplicateDone(x, 1)) == m.Ok()
    (p2,) = w.rollout("p2", [WHOLE])
    assert w.send(m.Publish(p2, 2)) == m.Ok()
    (p3,) = w.rollout("p3", [WHOLE])
    assert w.send(m.Publish(p3, 3)) == m.Ok()
    assert w.send(m.Leave(p3, drop_last_copy=True)) == m.Ok()  # version 3 lost
    whole = w.node(x).model
    assert w.core.retained(whole) == [2] and w.core.retained("pol") == [1]
    assert w.node(x).version == 1 and w.node(x).state is NodeState.PUBLISHED
    assert isinstance(w.send(m.Unpublish(t[0])), m.OffloadOrder)
    assert w.node(t[0]).state is NodeState.OFFLOADING


def test_a_failed_reshard_source_is_swapped_for_the_same_shard_of_another_replica_of_that_class():
    """The per-shard failover swap: only the failed holder shard is replaced, by the same shard
    of another replica of its class (same placement, rule 5); the read keeps the shards that
    were fine."""
    w = RW()
    w.published_trainer("t")
    w.published_trainer("u")
    (x,) = w.rollout("w", [WHOLE])
    first = w.send(m.Replicate(x, "latest", seq=1))
    assert reshard_of(first) == ["t/0", "t/1"]
    reply = w.send(m.SourceFailed(x, "t/1", units_done=0))
    events = [reply] + w.pop(x)
    again = [e for e in events if isinstance(e, m.Assignment)]
    assert again and reshard_of(again[-1]) == ["t/0", "u/1"], events
    assert [s.placement for s in again[-1].reshard] == [s.placement for s in first.reshard]
    assert w.node(x).reshard_from == ("t/0", "u/1")
    assert w.node("t/0").readers == {x} == w.node("u/1").readers
    assert w.node("t/1").readers == set() == w.node("u/0").readers
    # A SourceFailed naming a shard it no longer reads repeats the current assignment.
    assert reshard_of(w.send(m.SourceFailed(x, "t/1", units_done=0))) == ["t/0", "u/1"]
    # The other shard fails too: it moves to u as well; t/1 stays suspected by this reader.
    reply = w.send(m.SourceFailed(x, "t/0", units_done=0))
    again = [e for e in [reply] + w.pop(x) if isinstance(e, m.Assignment)]
    assert again and reshard_of(again[-1]) == ["u/0", "u/1"]
    # The holders of the swapped read are asked for the grid's cell checksums, and the reader
    # may ask for them from exactly the holders it reads.
    grid = grid_key(again[-1].placements)
    for h in ("u/0", "u/1"):
        assert any(isinstance(e, m.HashCells) and e.grid == grid for e in w.pop(h)), h
    found = w.send(m.FindCells(x, version=1, grid=grid, holders=("u/0", "u/1")))
    assert isinstance(found, m.CellsAt) and set(found.missing) == {"u/0", "u/1"}, found


def test_a_replica_whose_other_shard_is_gone_still_serves_the_shard_it_holds():
    """Shards of a reshard's holders come from any replica of the class: t lost its shard 1
    (it left), u lost its shard 0; a reader of the whole model still reads t/0 and u/1."""
    w = RW()
    w.published_trainer("t")
    w.published_trainer("u")
    assert w.send(m.Leave("t/1", drop_last_copy=True)) == m.Ok()
    assert w.send(m.Leave("u/0", drop_last_copy=True)) == m.Ok()
    (x,) = w.rollout("w", [WHOLE])
    a = w.send(m.Replicate(x, "latest", seq=1))
    assert reshard_of(a) == ["t/0", "u/1"], a
    assert w.node("t/0").readers == {x} == w.node("u/1").readers


def test_a_reshard_reader_whose_trainer_leaves_fails_version_lost_when_no_class_holds_the_version():
    w = RW()
    t = w.published_trainer()
    (x,) = w.rollout("w", [WHOLE])
    w.send(m.Replicate(x, "latest", seq=1))
    assert w.send(m.Leave(t[1], drop_last_copy=True)) == m.Ok()
    failed = [e for e in w.pop(x) if isinstance(e, m.Failed)]
    assert failed and failed[0].code == "VersionLost", w.events
    assert w.node(x).state is NodeState.IDLE and w.node("t/0").readers == set()


def test_readers_wait_for_room_on_the_trainer_and_start_when_it_frees():
    w = RW(readers_per_source_max=1)
    w.published_trainer()
    (x,) = w.rollout("w", [WHOLE])
    (y,) = w.rollout("w2", [WHOLE])
    assert reshard_of(w.send(m.Replicate(x, "latest", seq=1)))
    # y's class is x's (one shard, the whole model): it pipelines from x once x has room; x is
    # full (1 reader max) after y, so a third whole reader waits.
    ay = w.send(m.Replicate(y, "latest", seq=1))
    assert isinstance(ay, m.Assignment) and ay.source_id == x and not ay.reshard
    c = w.rollout("c", [cols(0), cols(1)])
    assert w.send(m.Replicate(c[0], "latest", seq=1)) == m.Waiting(version=1)  # the trainer is full
    assert w.send(m.ReplicateDone(x, 1)) == m.Ok()  # x leaves the trainer: c[0] starts
    assert reshard_of([e for e in w.pop(c[0]) if isinstance(e, m.Assignment)][-1]) == ["t/0", "t/1"]


def test_the_shards_of_a_resharding_replica_go_before_the_queue_and_the_class_pipelines_behind_them():
    """Shards ask in any order: c/1 takes the trainer first, d/0 queues on shard 0 (the trainer
    is c's), then c/0 asks. c/0 joins its replica's resharded read ahead of d/0 (the trainer
    counts c once), and d/0 pipelines from c/0. Before the fix, c/0 queued behind d/0, which
    waited for the whole of c's read: the class's pipeline became a relay."""
    w = RW(readers_per_source_max=1)
    w.published_trainer()
    c = w.rollout("c", [cols(0), cols(1)])
    d = w.rollout("d", [cols(0), cols(1)])
    assert reshard_of(w.send(m.Replicate(c[1], "latest", seq=1)))
    assert w.send(m.Replicate(d[0], "latest", seq=1)) == m.Waiting(version=1)
    assert reshard_of(w.send(m.Replicate(c[0], "latest", seq=1))) == ["t/0", "t/1"]
    ad0 = [e for e in w.pop(d[0]) if isinstance(e, m.Assignment)]
    assert ad0 and ad0[-1].source_id == c[0] and ad0[-1].source_partial and not ad0[-1].reshard
    ad1 = w.send(m.Replicate(d[1], "latest", seq=1))
    assert isinstance(ad1, m.Assignment) and ad1.source_id == c[1] and not ad1.reshard


def test_a_rollout_whose_layout_no_holder_can_fill_fails_typed():
    """A placement naming a global tensor no trainer shard holds (``extra``): the trainer's
    replica cannot fill it, so the read fails (VersionLost names the group) and nothing leaks."""
    w = RW()
    w.published_trainer()
    extra = P.GlobalTensor("extra", "float32", (2,))
    p = P.Placement.build([P.whole(Q), P.whole(K), P.whole(NORM), P.whole(extra)], P.Schema.of([Q, K, NORM, extra]))
    (x,) = w.rollout("w", [p])
    reply = w.send(m.Replicate(x, 1, seq=1))
    events = [reply] + w.pop(x)
    assert any(isinstance(e, m.Failed) and e.code == "VersionLost" for e in events), events
    assert w.node("t/0").readers == set() == w.node("t/1").readers


@pytest.mark.parametrize("kill", ["reader", "pipelined"])
def test_a_stopped_reshard_reader_hands_its_pipelined_readers_a_reshard_of_their_own(kill):
    w = RW()
    w.published_trainer()
    (x,) = w.rollout("w", [WHOLE])
    (y,) = w.rollout("w2", [WHOLE])
    w.send(m.Replicate(x, "latest", seq=1))
    assert w.send(m.Replicate(y, "latest", seq=1)).source_id == x
    if kill == "reader":
        w.send(m.Leave(x))
        again = [e for e in w.pop(y) if isinstance(e, m.Assignment)]
        assert again and reshard_of(again[-1]) == ["t/0", "t/1"]
        assert w.node("t/0").readers == {y}
    else:
        assert w.send(m.ReplicateAbort(y)) == m.Ok()
        assert w.node(x).readers == set() and w.node("t/0").readers == {x}


def test_after_a_restart_an_announced_reshard_read_is_assigned_anew_as_a_reshard():
    """A fresh server hears the trainer (published 1) and a whole-model rollout that was reading
    version 1 by a reshard (its handle names one trainer shard as its source): the read is not
    restored as a plain edge to that shard (whole units of another layout), but queued and given
    a resharded read from both trainer shards, from its units done."""
    w = RW()
    for s in (0, 1):
        reg = m.Register(f"t/{s}", "pol", "t", s, 2, layout_of(rows(s)), f"t/{s}".encode(), placement=rows(s))
        assert w.send(m.Announce(reg, m.Holding(published=1, confirmed=True))) == m.Ok()
    reg = m.Register("w/0", "pol", "w", 0, 1, layout_of(WHOLE), b"w/0", placement=WHOLE)
    reply = w.send(m.Announce(reg, m.Holding(reading_version=1, reading_source="t/0", reading_units=1, txn_seq=1)))
    assert reply == m.Ok()
    a = [e for e in w.pop("w/0") if isinstance(e, m.Assignment)]
    assert a and reshard_of(a[-1]) == ["t/0", "t/1"] and a[-1].start_unit == 1
    assert w.node("w/0").reshard_from == ("t/0", "t/1")


# --------------------------------------------------------------------------- cell checksums


def sums(*cells):
    return tuple(m.CellSum(t, c, x) for t, c, x in cells)


def test_the_holders_of_a_reshard_are_asked_once_for_cell_checksums_and_the_reader_finds_them():
    w = RW(readers_per_source_max=2)
    t = w.published_trainer()
    (x,) = w.rollout("w", [WHOLE])
    (y,) = w.rollout("w2", [WHOLE])  # x's class: pipelines from x
    c = w.rollout("c", [cols(0), cols(1)])
    w.send(m.Replicate(x, "latest", seq=1))
    grid = grid_key([rows(0), rows(1), WHOLE])
    for h in t:
        (note,) = w.pop(h)
        assert note == m.HashCells(version=1, grid=grid, placements=tuple(
            sorted([rows(0), rows(1), WHOLE], key=lambda p: p.digest())))
    w.send(m.Replicate(y, "latest", seq=1))
    w.send(m.Replicate(c[0], "latest", seq=1))
    w.send(m.Replicate(c[1], "latest", seq=1))
    # y pipelines from x (no new question); c's grid is another, one for the whole class (both
    # of c's shards check against it): each trainer shard asked once more.
    cgrid = grid_key([rows(0), rows(1), cols(0), cols(1)])
    assert [n.grid for n in w.pop(t[0])] == [cgrid]
    # Before the holders answer: missing; the answers are kept and merged.
    assert w.send(m.FindCells(x, 1, grid, tuple(t))) == m.CellsAt(missing=tuple(t))
    assert w.send(m.CellSums(t[0], 1, grid, sums(("q", 0, 7), ("k", 0, 8)))) == m.Ok()
    assert w.send(m.FindCells(x, 1, grid, tuple(t))) == m.CellsAt(cells=sums(("q", 0, 7), ("k", 0, 8)),
                                                                   missing=(t[1],))
    assert w.send(m.CellSums(t[1], 1, grid, sums(("q", 1, 9)))) == m.Ok()
    assert w.send(m.FindCells(x, 1, grid, tuple(t))).cells == sums(("q", 0, 7), ("k", 0, 8), ("q", 1, 9))


def test_a_holder_is_asked_at_its_publish_for_the_grid_of_each_other_layout_class():
    """Rule 0 of tensorhub/core/cells.py: the rollout classes exist when the trainer publishes,
    so each trainer shard hashes their grids at once (before any reader asks); a reader then
    finds the checksums without a new question."""
    w = RW(readers_per_source_max=2)
    c = w.rollout("c", [cols(0), cols(1)])
    (x,) = w.rollout("w", [WHOLE])
    t = w.published_trainer()
    grids = {grid_key([rows(0), rows(1), cols(0), cols(1)]), grid_key([rows(0), rows(1), WHOLE])}
    for h in t:
        assert {n.grid for n in w.pop(h) if isinstance(n, m.HashCells)} == grids
    a = w.send(m.Replicate(c[0], "latest", seq=1))
    assert reshard_of(w.send(m.Replicate(x, "latest", seq=1)))
    for h in t:
        assert not [n for n in w.pop(h) if isinstance(n, m.HashCells)]  # asked already
    # the assignment names the placements of its grid: the holder replica's, then the class's
    assert reshard_of(a) and grid_key(a.placements) == grid_key([rows(0), rows(1), cols(0), cols(1)])


def test_cell_checksums_not_asked_or_of_another_version_are_refused_and_nothing_is_kept():
    w = RW()
    t = w.published_trainer()
    (x,) = w.rollout("w", [WHOLE])
    (z,) = w.rollout("z", [WHOLE])
    grid = grid_key([rows(0), rows(1), WHOLE])
    # Not asked yet (no reshard): refused.
    refused(w.send(m.CellSums(t[0], 1, grid, sums(("q", 0, 1)))), "InvalidState", "were not asked")
    w.send(m.Replicate(x, "latest", seq=1))
    refused(w.send(m.CellSums(t[0], 1, "another grid", sums(("q", 0, 1)))), "InvalidState", "were not asked")
    refused(w.send(m.CellSums(t[0], 2, grid, sums(("q", 0, 1)))), "InvalidState", "were not asked")
    # A reader asks only of the holders it reads from, only while reading.
    refused(w.send(m.FindCells(x, 1, grid, ("w2-none",))), "InvalidState", "it reads version 1 from")
    refused(w.send(m.FindCells(z, 1, grid, tuple(t))), "InvalidState")
    assert w.core.cells.kept[t[0]] == {(1, grid): None}


def test_a_holder_that_leaves_or_moves_on_is_gone_for_the_reader():
    w = RW()
    t = w.published_trainer()
    w.published_trainer("u")
    (x,) = w.rollout("w", [WHOLE])
    w.send(m.Replicate(x, "latest", seq=1))
    grid = grid_key([rows(0), rows(1), WHOLE])
    assert w.send(m.CellSums(t[0], 1, grid, sums(("q", 0, 1)))) == m.Ok()
    # t/1 leaves while x reads from it: x's shard 1 is swapped onto u's; t/0 stays, and what
    # it sent is still found.
    assert w.send(m.Leave(t[1], drop_last_copy=True)) == m.Ok()
    assert w.core.cells.kept.get(t[1]) is None
    assert w.node(x).reshard_from == ("t/0", "u/1")
    refused(w.send(m.FindCells(x, 1, grid, tuple(t))), "InvalidState")  # t/1: no longer its holder
    assert w.send(m.FindCells(x, 1, grid, ("t/0", "u/1"))) == m.CellsAt(cells=sums(("q", 0, 1)), missing=("u/1",))


def test_what_the_server_keeps_of_cell_checksums_is_bounded_per_holder():
    w = RW(readers_per_source_max=PER_HOLDER_MAX + 3)
    t = w.published_trainer()
    for i in range(PER_HOLDER_MAX + 2):
        part = P.concat("q", [(Q, P.Box((0, 0), (i + 1, 4)))])  # rows [0, i+1) of q: another grid each
        ids = w.rollout(f"r{i}", [P.Placement.build([part], SCHEMA)])
        w.send(m.Replicate(ids[0], "latest", seq=1))
    assert len(w.core.cells.kept[t[0]]) == PER_HOLDER_MAX


@pytest.mark.parametrize("rollout", ["whole", "q only"])
def test_a_trainer_may_leave_when_another_layout_holds_its_version_whole(rollout):
    w = RW()
    t = w.published_trainer()
    p = WHOLE if rollout == "whole" else P.Placement.build([P.whole(Q)], SCHEMA)
    (x,) = w.rollout("r", [p])
    w.send(m.Replicate(x, "latest", seq=1))
    assert w.send(m.ReplicateDone(x, 1)) == m.Ok()
    reply = w.send(m.Leave(t[0]))
    if rollout == "whole":
        assert reply == m.Ok()
    else:
        refused(reply, "LastCopyHeld")


def test_interleaved_shards_of_two_layouts_do_not_share_a_class():
    """Found by the simulator (``simulate --workload mixed --seed 17``): after a server restart
    the trainer's shard 0 announced, then a TP=2 rollout's shard 1, then the trainer's shard 1.
    The rollout's shard 1 joined the trainer's class (its shard 1 was not known there yet), and
    both replicas were refused for good (``LayoutMismatch`` on every announcement, the reads hung).
    A shard whose layout the class does not know yet joins it only as a shard of one of its
    replicas; another replica's opens (or finds) a class of its own."""
    w = RW()
    w.reg("t/0", "t", 0, rows(0))
    w.reg("c/1", "c", 1, cols(1), num_shards=2)
    w.reg("t/1", "t", 1, rows(1))
    w.reg("c/0", "c", 0, cols(0), num_shards=2)
    assert w.node("t/0").model == w.node("t/1").model == "pol"
    assert w.node("c/0").model == w.node("c/1").model == f"pol{CLASS_SEP}1"


def test_replicas_that_name_their_layout_share_one_class_however_their_shards_interleave():
    """Two TP=2 engines whose ranks register interleaved (engine c's rank 0, then engine d's
    rank 1, ...): found by fit, d opens a second class of the same placements (c's class has not
    seen shard 1 when d's arrives), which then waits for the trainer instead of pipelining from c
    (the emulated pipeline of issue 24, seen in the server's log). With a layout key both join
    one class; a key's class refuses a shard that does not fit it, naming the key, and nothing
    changes; another key opens its own class."""
    order = [("c", 0), ("d", 1), ("d", 0), ("c", 1)]
    w = RW()
    w.trainer("t")
    for r, s in order[:3]:
        w.reg(f"{r}/{s}", r, s, cols(s), num_shards=2)
    assert {w.node(f"{r}/{s}").model for r, s in order[:3]} == {f"pol{CLASS_SEP}1", f"pol{CLASS_SEP}2"}
    # (without a key, the later class joins the earlier once it has seen the shards: below)

    w = RW()
    w.trainer("t")
    for r, s in order:
        w.reg(f"{r}/{s}", r, s, cols(s), num_shards=2, layout_key="tp2")
    assert {w.node(f"{r}/{s}").model for r, s in order} == {f"pol{CLASS_SEP}1"}
    assert w.core.table.classes["pol"] == ["pol", f"pol{CLASS_SEP}1"]
    before = w.snapshot()
    refused(w.register("e/1", "e", 1, cols(0), num_shards=2, layout_key="tp2"),
            says="differs from shard 1's placement")
    refused(w.register("e/0", "e", 0, cols(0), num_shards=4, layout_key="tp2"),
            says="(layout key 'tp2') has 2 shards per replica, not 4")
    assert w.snapshot() == before
    w.reg("f/1", "f", 1, cols(1), num_shards=2, layout_key="other")
    assert w.node("f/1").model == f"pol{CLASS_SEP}2"
    # A keyed replica fits a class found without a key; the class then carries the key.
    w.reg("g/0", "g", 0, rows(0), layout_key="rows2")
    assert w.node("g/0").model == "pol" and w.core.table.models["pol"].layout_key == "rows2"
    # The key is part of the registration a repeated Register is answered with.
    assert w.core.members.registration_of(w.node("d/1")).layout_key == "tp2"


def test_classes_of_one_layout_opened_by_interleaved_ranks_become_one_before_they_read():
    """Without a layout key, engine d's rank 1 registers before engine c's: c's class has not
    seen shard 1, so d opens a second class of the same placements. Once c's rank 1 registers
    (c's class has seen every shard d holds) and d has read nothing, d's class joins c's: one
    class, whose replicas copy whole shards between each other (d pipelines from c) and reshard
    from the trainer once. A class that began reading before that stays apart (it has rounds
    and versions of its own), and replicas of another placement never join."""
    order = [("c", 0), ("d", 1), ("d", 0), ("c", 1)]
    w = RW()
    t = w.published_trainer("t")
    for r, s in order:
        w.reg(f"{r}/{s}", r, s, cols(s), num_shards=2)
    assert {w.node(f"{r}/{s}").model for r, s in order} == {f"pol{CLASS_SEP}1"}
    assert w.core.table.classes["pol"] == ["pol", f"pol{CLASS_SEP}1"]
    assert f"pol{CLASS_SEP}2" not in w.core.table.models
    assert sorted(mv.model for mv in w.core.status().models) == ["pol", "pol (layout class 1)"]
    assert w.core.placements.models["pol"].shard_nodes[(f"pol{CLASS_SEP}1", 1)] == 2
    # c reshards from the trainer; d, of c's class, reads c's units as they come
    a = w.send(m.Replicate("c/0", "latest", seq=1))
    assert isinstance(a, m.Assignment) and a.source_id == t[0] and a.reshard
    w.send(m.Replicate("c/1", "latest", seq=1))
    b = w.send(m.Replicate("d/0", "latest", seq=1))
    assert isinstance(b, m.Assignment) and b.source_id == "c/0" and not b.reshard, b
    # A new class of another placement (rows, 4 shards) never joins.
    w.reg("e/0", "e", 0, cols(0, 4), num_shards=4)
    assert w.node("e/0").model == f"pol{CLASS_SEP}2"

    # d reads before c's rank 1 registers: d's class has begun, so it stays apart
    w = RW()
    w.published_trainer("t")
    for r, s in order[:3]:
        w.reg(f"{r}/{s}", r, s, cols(s), num_shards=2)
    assert isinstance(w.send(m.Replicate("d/0", "latest", seq=1)), m.Assignment)
    w.reg("c/1", "c", 1, cols(1), num_shards=2)
    assert w.node("d/0").model == w.node("d/1").model == f"pol{CLASS_SEP}2"
    assert w.node("c/1").model == f"pol{CLASS_SEP}1"


def test_a_layout_key_is_bounded_and_needs_a_placement():
    """The server's bounds (run before the core, tensorhub/auth.py) refuse a key without a
    placement and one past the name bounds."""
    from tensorhub.core import bounds
    from tensorhub.errors import OutOfBounds

    def reg(p, key):
        return m.Register("x/0", "pol", "x", 0, 2, layout_of(p), b"x", placement=p, layout_key=key)

    bounds.check_request(reg(cols(0), "tp2"))
    with pytest.raises(OutOfBounds, match="needs a placement"):
        bounds.check_request(m.Register("x/0", "pol", "x", 0, 2, layout_of(rows(0)), b"x", layout_key="tp2"))
    with pytest.raises(OutOfBounds, match="layout key"):
        bounds.check_request(reg(cols(0), "k" * 10_000))


def test_two_classes_waiting_for_room_at_one_version_do_not_wake_each_other_forever():
    """Found by the simulator (``simulate --workload mixed --seed 42``): readers of two layout
    classes waited at one version for room on the trainer; each class's pump woke the other's
    waiting group, which woke it back: the server's step never ended. A class that waits (no
    complete holder of its own) wakes no other class; one that changes (a holder completes or
    leaves, room frees) does, so the waiters still start when the trainer frees.

        trainer t (full: x reshards) ->  x;   c (2 cols) and d (4 rows) wait
    """
    import signal

    def stuck(*_):
        raise AssertionError("the core's step did not end")

    old = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(10)
    try:
        w = RW(readers_per_source_max=1)
        w.published_trainer()
        (x,) = w.rollout("w", [WHOLE])
        assert reshard_of(w.send(m.Replicate(x, "latest", seq=1)))
        c = w.rollout("c", [cols(0), cols(1)])
        assert w.send(m.Replicate(c[0], "latest", seq=1)) == m.Waiting(version=1)
        d = w.rollout("d", [rows(s, 4) for s in range(4)])
        assert w.send(m.Replicate(d[0], "latest", seq=1)) == m.Waiting(version=1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert w.send(m.ReplicateDone(x, 1)) == m.Ok()  # room on the trainer: one of them starts
    started = [e for cid in (c[0], d[0]) for e in w.pop(cid) if isinstance(e, m.Assignment)]
    assert started and reshard_of(started[0])


def test_host_copies_are_reshard_sources_with_their_owners_checksums():
    """A version kept only in the trainer's host copies (the engines keep none: ``retains=False``)
    is read by a new engine of another layout from those host copies, by a resharded read over
    their owners' placements; the cell checksums the owners sent while they held the version
    are the host copies' too; a grid they lack is hashed by each owner's process on request.""" 
    w = RW(versions_retained=2)
    t = w.published_trainer("t", 1)
    e = w.rollout("e", [WHOLE], retains=False)
    assert reshard_of(w.send(m.Replicate(e[0], 1))) == t
    grids = set()
    for cid in t:  # each trainer shard is asked for its cells of version 1 over the engines' grid
        (ask,) = [x for x in w.pop(cid) if isinstance(x, m.HashCells)]
        grids.add(ask.grid)
        assert w.send(m.CellSums(cid, 1, ask.grid, (m.CellSum("q", 0, 7),))) == m.Ok()
    (grid,) = grids
    assert w.send(m.ReplicateDone(e[0], 1)) == m.Ok()
    for cid in t:  # its resharded reader is done and keeps no copy: each shard may copy ahead
        assert [x for x in w.pop(cid) if isinstance(x, m.MakeHostCopy)] == [m.MakeHostCopy(1)]
    for cid in t:  # (neither offered its copy: the unpublish offloads)
        assert w.send(m.Unpublish(cid)) == m.OffloadOrder(version=1), "the engine's copy does not count"
        assert w.send(m.OffloadDone(cid, 1, b"h" + cid.encode())) == m.UnpublishDone(version=1)
        assert w.send(m.Publish(cid, 2)) == m.Ok()
    w.send(m.Replicate(e[0], 2, update=True)); w.send(m.ReplicateDone(e[0], 2))
    n = w.rollout("n", [WHOLE], retains=False)
    a = w.send(m.Replicate(n[0], 1))
    hosts = [f"{cid}#host1" for cid in t]
    assert reshard_of(a) == hosts and a.source_endpoint == b"ht/0"
    assert [s.placement for s in a.reshard] == [w.node(cid).placement for cid in t]
    assert all(w.node(h).placement == w.node(cid).placement for h, cid in zip(hosts, t))
    found = w.send(m.FindCells(n[0], 1, grid, tuple(hosts)))
    assert isinstance(found, m.CellsAt) and not found.gone and not found.missing and len(found.cells) == 2
    # A grid the owners did not send (a reader class of another placement): asked of each
    # owner's process with ``host``, answered with ``host``, kept for the host copy.
    assert w.send(m.ReplicateDone(n[0], 1)) == m.Ok()
    w.send(m.Replicate(n[0], 2, update=True))  # n moves on: version 1 is in the host copies only
    w.send(m.ReplicateDone(n[0], 2))
    c = w.rollout("c", [cols(0), cols(1)])
    assert reshard_of(w.send(m.Replicate(c[0], 1))) == hosts
    for cid, h in zip(t, hosts):
        (ask,) = [x for x in w.pop(cid) if isinstance(x, m.HashCells) and x.version == 1]
        assert ask.host and ask.grid != grid
        assert w.core.cells.kept[h][(1, ask.grid)] is None
        assert w.send(m.CellSums(cid, 1, ask.grid, (m.CellSum("q", 0, 9),), host=True)) == m.Ok()
        assert w.core.cells.kept[h][(1, ask.grid)] == (m.CellSum("q", 0, 9),)
    reply = w.send(m.CellSums(t[0], 2, ask.grid, (), host=True))
    assert isinstance(reply, m.ErrorReply) and reply.code == "InvalidState" and "host copy" in reply.message
