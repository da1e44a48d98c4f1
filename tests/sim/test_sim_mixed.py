"""The ``mixed`` workload (:mod:`tensorhub.sim.mixed`): layout classes and resharded reads under
the simulator's faults, and the planted resharding bugs its checkers must catch.

    trainer (rows, 2 or 4 shards) -> rollouts of other layouts (whole; TP=2; rows of 4 or 2)
                                     by resharded reads; their classes pipeline from them

Each planted bug monkeypatches the shipped core (:class:`tensorhub.core.reading.Reading`) and
runs a pinned seed that reaches it; the same seed runs clean of that kind on the shipped code.
"""

from __future__ import annotations

import msgspec
import pytest

from tensorhub.core import other_layouts
from tensorhub.core.placements import logical
from tensorhub.core.reading import Reading
from tensorhub.core.retention import Retention
from tensorhub.core.state import Node, NodeState
from tensorhub.sim import run_scenario
from tensorhub.sim.scenario import World

pytestmark = pytest.mark.sim


def test_mixed_runs_clean_and_reads_by_reshard():
    """A few seeds of the workload: no violation, and rollouts of other layouts read by
    resharded reads (the trace names the assignments' reshard sources)."""
    resharded = 0
    for seed in range(4):
        res = run_scenario(seed, "mixed", keep_trace=True)
        assert res.ok, res.violations
        resharded += sum("reshard=(ReshardSource(" in line for line in res.lines)
    assert resharded > 0


@pytest.mark.parametrize("seed", [17, 42, 90, 210])
def test_seeds_that_found_defects_run_clean(seed):
    """17: a shard joined another layout's class after a restart (LayoutMismatch for good);
    42: two waiting classes woke each other without end; 90, 210: last_copy counted copies of
    the releaser's own layout only (a replica of another layout holding the version whole is a
    copy: a resharded read brings it back)."""
    res = run_scenario(seed, "mixed")
    assert res.ok, res.violations


@pytest.mark.parametrize("seed", [773, 1706, 3672, 2080, 4092, 9617, 9649])
def test_seeds_where_checkers_misjudged_mixed_layouts_run_clean(seed):
    """Checker gaps the 10,000-seed sweep found (the shipped code was right):
    773 ghost: another layout class's copy that is offloading (its process alive) was not
    counted; 1706 last_copy: a lone shard of a replica that does not hold the version whole, of
    a version its own class does not retain, was judged by the first class's retention;
    3672 last_copy: a whole replica of another layout whose processes hung moments before (the
    server cannot know yet) was not counted once restarted processes took their places;
    2080 restart: a read the old server had already revoked (reader failed, holder evicted)
    before it died; 4092 restart: a read whose holder the new server evicted (a sibling's
    process died); 9617 host_leak: the end checks ran inside a restarted server's recovery
    window, while host copies that fell out of retention there were draining (freed when it
    ends); 9649 restart: a read that spans one restart, which the next server revoked (failed
    its reader after its window) before it died too, was still held protected after the second
    restart."""
    res = run_scenario(seed, "mixed")
    assert res.ok, res.violations


@pytest.mark.parametrize("seed", [5515, 6271, 6896])
def test_a_publish_without_a_reply_keeps_handle_and_server_agreeing(seed):
    """A trainer shard's Publish was applied but its replies were lost (ServerUnavailable): the
    handle hid its bytes and let the user write while the server listed it as a published
    holder; resharded reads kept being assigned to it ("holds 0/9 units of version -1") and its
    next publish was refused. The handle now holds such a version as published until
    unpublish(); the split checker (q) covers failed publishes too (it caught the old machine on
    each of these seeds)."""
    res = run_scenario(seed, "mixed")
    assert res.ok, res.violations


def test_no_local_skip_is_answered_for_a_model_of_several_layout_classes():
    """Seed 701: a handle answered update("latest") locally as a skip its class's rules gave
    (version 4 "in flight" into its datacenter) while another class held 4 there (a resharded
    read brings it): the server's rules never gave that skip. Such models get no skip pushed."""
    res = run_scenario(701, "mixed")
    assert res.ok, res.violations


def test_the_same_mixed_seed_gives_the_same_trace_digest():
    assert run_scenario(5, "mixed").digest == run_scenario(5, "mixed").digest


def test_mixed_is_run_only_when_forced():
    """A seed's random pick never lands on ``mixed``: every other workload's seeds stay as they were."""
    assert {World(s).params.workload for s in range(40)} <= {"colocated", "standalone", "elastic", "crossdc", "sharded"}


# ---------------------------------------------------------------------------- the bugs


def reshard_counts_first_holder_only(mp):
    """A resharded reader is listed among the readers of its first needed holder shard only: the
    others' drains end (and their writers write) while it still reads from them."""
    def bad(self, reader, srcs):
        reader.state = NodeState.READING
        reader.source = srcs[0].id
        reader.reshard_from = tuple(s.id for s in srcs)
        reader.assign_no += 1
        srcs[0].readers.add(reader.id)
        self.table.index.mark(srcs[0])
        self.table.index.mark(reader)
    mp.setattr(Reading, "reshard", bad)


def leave_first_source_only(mp):
    """A resharded reader that stops reading leaves its first source only: the others keep it
    among their readers and their drains wait for it."""
    orig = Reading._leave_sources

    def bad(self, node, gone):
        if len(node.reshard_from) > 1:
            node.reshard_from = node.reshard_from[:1]
        orig(self, node, gone)
    mp.setattr(Reading, "_leave_sources", bad)


def reshard_from_partial_holders(mp):
    """A replica still receiving the version (its shards READING) is taken as a reshard source."""
    def bad(n, reader, level):
        return (n.state in (NodeState.PUBLISHED, NodeState.READING)
                and not n.unreachable and n.suspected_at is None and n.id not in reader.suspects)
    mp.setattr(other_layouts, "serves", bad)


def assignment_lists_needed_shards_only(mp):
    """A resharded read's assignment lists only the holder shards the reader needs, not the
    whole replica (the reader then plans over the wrong shards)."""
    orig = Reading.assignment

    def bad(self, node):
        a = orig(self, node)
        if a.reshard:
            a = msgspec.structs.replace(a, reshard=tuple(s for s in a.reshard if s.client_id in node.reshard_from))
        return a
    mp.setattr(Reading, "assignment", bad)


def listing_ignores_chosen_holders(mp):
    """A resharded read's assignment lists the first holder's replica for every shard, not the
    holders chosen shard by shard: after a per-shard swap (or with a replica missing a shard)
    the reader reads a shard from a holder that does not count it among its readers."""
    def bad(self, src, chosen_ids):
        return sorted(self.table.replica_nodes(src.model, src.replica_id), key=lambda n: n.shard)
    mp.setattr(Reading, "_reshard_listing", bad)


def other_class_counts_while_silent(mp):
    """Retention counts another layout class's whole replica as a copy even when its processes
    have been silent too long to count as alive."""
    mp.setattr(Retention, "held_in_other_layout",
               lambda self, node, attended=False: self._others.holds(node, lambda n: not n.spot))


def any_other_class_counts(mp):
    """Retention counts any node of another layout class at the version as a copy (not whole,
    not alive)."""
    def bad(self, node, attended=False):
        t = self.table
        return any(t.groups.get((cls, node.version, s)) for cls in t.classes.get(logical(node.model), ())
                   if cls != node.model for s in range(t.models[cls].num_shards))
    mp.setattr(Retention, "held_in_other_layout", bad)


# (bug, checker kind, seeds of the mixed workload): the first seed of 0, 1, 2, ... that catches it.
CASES = [
    (reshard_counts_first_holder_only, "mutate", [2]),  # trainer/s1 writes under rwhole-0/s0's read
    (leave_first_source_only, "hang", [2]),  # the trainer's unpublish never finishes
    (reshard_from_partial_holders, "reshard", [2]),  # was 1 (a rows4 replica holding 1/5 units): stepped now
    (assignment_lists_needed_shards_only, "reshard", [1]),  # 2 shards of a 4-shard trainer listed
    (listing_ignores_chosen_holders, "reshard", [64]),  # 16 in 300 seeds
    (other_class_counts_while_silent, "last_copy", [14]),  # 8 in 300 seeds
    (any_other_class_counts, "ghost", [100]),  # 3 in 200 seeds (retention 67, last_copy 9)
]


def _kinds(seeds) -> set[str]:
    return {kind for s in seeds for kind, _, _ in run_scenario(s, "mixed").violations}


@pytest.mark.parametrize("plant, kind, seeds", CASES, ids=[c[0].__name__ for c in CASES])
def test_planted_resharding_bug_is_caught_on_its_seed(monkeypatch, plant, kind, seeds):
    assert kind not in _kinds(seeds), "the shipped code must run clean of this kind on these seeds"
    with monkeypatch.context() as mp:
        plant(mp)
        assert kind in _kinds(seeds)


# ---------------------------------------------------------------------------- mixed_spot


def spot_or_dead_copies_of_another_class_count(mp):
    """Retention counts a replica of another layout class that holds the version whole as a copy
    even when it is spot or not heard from lately (the filter of ``held_in_other_layout`` dropped)."""
    mp.setattr(Retention, "held_in_other_layout",
               lambda self, node, attended=False: self._others.holds(node, lambda n: True))


def test_spot_copies_of_another_layout_are_no_copies_for_retention(monkeypatch):
    """``mixed_spot`` (``mixed`` plus a spot replica of each rollout layout and spot preemptions)
    catches a plant that ``mixed`` missed in 200 seeds (it has no spot replicas): on this code the
    plant gave violations on 72 of 300 seeds, the first of them seed 2 (last_copy); since
    resharded reads choose their holders shard by shard, seed 9 is the first (and 11, 13); the
    shipped code runs it clean."""
    assert run_scenario(9, "mixed_spot").ok
    with monkeypatch.context() as mp:
        spot_or_dead_copies_of_another_class_count(mp)
        assert "last_copy" in {kind for kind, _, _ in run_scenario(9, "mixed_spot").violations}


def test_mixed_spot_seeds_of_the_first_sweeps_run_clean():
    """What the first mixed_spot sweeps found (stop 43), each run clean now:

    - seed 109 (last_copy): after two server restarts the rows2 class still retained version 1
      while the whole class had moved to version 2. A rows2 shard read over its copy of 1
      counting the whole replica's copy, which its class no longer kept. Another class's copy
      now counts only while that class retains the version (tests/core/test_reshard_server.py);
      and the model had moved past version 1 (version 2 committed), which retention across
      classes now says too (``Retention.kept``);
    - seed 1544 (last_copy): a non-spot replica let go of version 2, which its own class (the
      trainer's) had moved past, while the tp2 class, behind, held version 2 on a spot replica
      only. The model had moved past it: no loss by the rule above;
    - seeds 489 and 860 (hang): a preempted rank of a 2-rank spot engine left its sibling
      waiting ``request_timeout_s`` (300 s) for it to register again. The workload now ends a
      spot engine's other ranks with it, as a real engine's collectives would;
    - mixed seed 111 (hang), found on the way: a restarted rank whose registration failed while
      the server was down gave up for the round, its sibling waiting for it in the round's
      replicate until its request timeout. A starting rank now keeps trying to register;
    - seed 4730 (hang): a duplicated Replicate whose first copy found no version started a read
      its handle never followed (tests/core/test_core.py; the plant below);
    - seed 5092 (split): a completion without an answer left the handle hiding a version the
      server served (tests/core/test_handle_machine.py);
    - seed 569 (hang; stop 44, a stepped seed): an update's OffloadDone arrived twice; the copy
      the server answered second was refused (the node was reading the new version by then),
      that answer reached the handle first, and it ended the call without aborting the read the
      first copy had started: the trainer's unpublish waited for that reader for good
      (tests/core/test_core.py)."""
    for seed in (109, 1544, 489, 860, 4730, 5092, 569):
        res = run_scenario(seed, "mixed_spot")
        assert res.ok, (seed, res.violations)
    res = run_scenario(111, "mixed")
    assert res.ok, res.violations



def the_model_keeps_only_its_newest_version(mp):
    """Retention across classes keeps only the model's newest version whatever
    ``versions_retained`` says (``Retention.kept`` too lax)."""
    def kept(self, model, version):
        classes = self.table.classes.get(logical(model), ()) or [model]
        across = set().union(*(self.table.retained(c) for c in classes))
        return version in self.table.retained(model) and version == max(across)
    mp.setattr(Retention, "kept", kept)


def test_a_too_lax_retention_across_classes_is_caught(monkeypatch):
    """Retention across layout classes (``Retention.kept``) planted too lax: on this code the plant
    gave violations on 105 of 300 mixed seeds (retention, ghost), the first of them seed 8."""
    assert run_scenario(8, "mixed").ok
    with monkeypatch.context() as mp:
        the_model_keeps_only_its_newest_version(mp)
        assert "retention" in {kind for kind, _, _ in run_scenario(8, "mixed").violations}


def test_a_replicate_answered_again_starts_nothing_or_a_reader_waits_for_good(monkeypatch):
    """The plant: the server forgets its final answers to Replicate (a duplicate is taken
    afresh). Seed 4730 (mixed_spot) hung with it until host copies became resharded reads'
    sources (stop 47), which changed that seed's schedule; a search of 21,000 seeds found none
    that reached the interleaving again. The ``late_dup`` fault (stop 48: a Replicate delivered
    a second time, up to seconds later, after other clients' requests but before its own client's
    next one) brings it back: seed 39 (crossdc) runs clean, and hangs under the plant (a staging
    copy's duplicate started a read nobody followed; without ``late_dup`` it runs clean under the
    plant too). The exact core test is run under the plant as well."""
    from tensorhub.core.reference import ReferenceCore
    from tensorhub.sim.network import Network
    from tests.core import test_core

    assert run_scenario(4730, "mixed_spot").ok
    clean = run_scenario(39)
    assert clean.workload == "crossdc" and clean.ok and clean.paths.get("msg_late_dup"), clean.violations
    with monkeypatch.context() as mp:
        mp.setattr(ReferenceCore, "_note_answered", lambda self, req, reply: None)
        planted = run_scenario(39)
        assert "hang" in {kind for kind, _, _ in planted.violations}, planted.violations
        with pytest.raises(AssertionError):
            test_core.test_a_replicate_answered_for_good_gets_the_same_answer_again_and_starts_no_read()
        mp.setattr(Network, "late_duplicate", lambda self: None)
        assert run_scenario(39).ok, "the late duplicate is what reaches the interleaving"


# ---------------------------------------------------------------------------- mixed_engines


def engines_copies_count(mp):
    """Retention counts the copies of engines registered with ``retains=False`` (the filter of
    ``Node.keeps_copies`` dropped): the trainer skips its offload relying on them."""
    mp.setattr(Node, "keeps_copies", property(lambda self: not self.spot))


def test_copies_of_engines_that_retain_nothing_are_no_copies_for_retention(monkeypatch):
    """``mixed_engines``: the rollouts of layouts other than the trainer's register with
    ``retains=False`` (vLLM engines' default), so the trainer keeps every retained version. A plant
    that counts their copies is caught on the first seed (seeds 0, 1, 2, 4, 5 of the first six);
    the shipped code runs them clean. Seed 989 found a checker error: it counted a crashed
    trainer shard the server had been told of as still holding its version."""
    assert all(run_scenario(s, "mixed_engines").ok for s in (0, 989))
    with monkeypatch.context() as mp:
        engines_copies_count(mp)
        assert "last_copy" in {kind for kind, _, _ in run_scenario(0, "mixed_engines").violations}


def merges_any_class_of_its_shard_count(mp):
    """A later layout class joins the first earlier one of its shard count, whatever its layouts
    and placements (the checks of ``Placements.earlier_fit`` dropped)."""
    from tensorhub.core.placements import Placements

    def bad(self, cls):
        t = self.table
        mod = t.models.get(cls)
        if mod is None or mod.layout_key:
            return None
        for other in t.classes.get(logical(cls), ()):
            if other == cls:
                return None
            if t.models[other].num_shards == mod.num_shards:
                return other
        return None
    mp.setattr(Placements, "earlier_fit", bad)


def test_classes_found_by_fit_merge_when_their_ranks_interleaved(monkeypatch):
    """``mixed_unkeyed``: no replica names its layout, so every class is found by fit, and
    replicas of one layout whose ranks register interleaved open two classes, merged by the
    server once the earlier has seen the later's shards (seed 264: one merge; the shipped code
    runs it clean). A plant that merges classes of other placements is caught (seed 14)."""
    from tensorhub.core.members import Members

    merges = []
    with monkeypatch.context() as mp:
        orig = Members.move_class
        mp.setattr(Members, "move_class", lambda self, src, dst: merges.append((src, dst)) or orig(self, src, dst))
        assert run_scenario(264, "mixed_unkeyed").ok
    assert merges, "seed 264 no longer merges classes: pick another seed"
    assert run_scenario(14, "mixed_unkeyed").ok
    with monkeypatch.context() as mp:
        merges_any_class_of_its_shard_count(mp)
        assert not run_scenario(14, "mixed_unkeyed").ok
