"""The core's indexes (tensorhub/core/index.py) and the scheduler over them: the index never
drifts from the table through thousands of seeded faults, the scheduling rules read through a
pool give the same answers as the rules over a list, and scheduling stays cheap at 10,000
readers."""

from __future__ import annotations

import time

import pytest

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.index import audit
from tensorhub.core.reference import ReferenceCore
from tensorhub.core.scheduler import ListPool, choose_source
from tensorhub.core.state import Node, NodeState
from tensorhub.sim import WORKLOADS, run_scenario

LAYOUT = m.LayoutInfo("fp", 4, 400, (m.TensorMeta("w", "float32", (100,), 400),))


class AuditedCore(ReferenceCore):
    """Checks the whole index against the table after every step."""

    def handle(self, req, now):
        out = super().handle(req, now)
        audit(self.index, self.nodes)
        return out

    def tick(self, now):
        out = super().tick(now)
        audit(self.index, self.nodes)
        return out

    def declare_dead(self, client_ids, now, reason):
        out = super().declare_dead(client_ids, now, reason)
        audit(self.index, self.nodes)
        return out


@pytest.mark.sim
@pytest.mark.parametrize("workload", WORKLOADS)
def test_index_matches_the_table_after_every_step_of_faulty_runs(workload):
    for seed in range(12):
        result = run_scenario(seed, workload, core_factory=AuditedCore)
        assert not result.violations, (seed, workload, result.violations[:3])


# --------------------------------------------------------------------------- the scheduler's rules


def node(nid, state=NodeState.PUBLISHED, *, readers=0, dc="a", machine="", progress=4, order=0, stage_for="", host=False):
    n = Node(id=nid, model="pol", replica_id=nid, shard=0, num_shards=1, datacenter=dc, spot=False,
             layout=LAYOUT, endpoint=b"", order=order, machine=machine, stage_for=stage_for, host=host)
    n.state, n.version, n.progress = state, 1, progress
    n.readers = {f"{nid}-reader{i}" for i in range(readers)}
    return n


def pick(reader, cands, *, max_readers=1, blocked=False, downstream=()):
    src = choose_source(reader, ListPool(cands, max_readers), downstream=set(downstream),
                        readers_per_source_max=max_readers, seeding_blocked=blocked)
    return src.id if src else None


READER = dict(state=NodeState.WAITING, progress=0, machine="h1")


@pytest.mark.parametrize("cands, kw, expected", [
    # trainer -> r : the only source
    ([node("t")], {}, "t"),
    # busy trainer, partial r1 ahead of the reader: trainer -> r1 -> r
    ([node("t", readers=1), node("r1", NodeState.READING, progress=2, order=1)], {}, "r1"),
    # the reader's own staging copy first, whatever its load
    ([node("t"), node("stage", readers=3, stage_for="r", order=1)], {}, "stage"),
    # same datacenter first: the local source is busy, so the reader waits rather than cross
    ([node("t", readers=1), node("far", dc="b", order=1)], {}, None),
    # no local candidate: read across (the datacenter's seeder) ...
    ([node("far", dc="b")], {}, "far"),
    # ... unless an earlier reader of this datacenter already waits to seed
    ([node("far", dc="b")], {"blocked": True}, None),
    # own host first, then least loaded
    ([node("x", order=0), node("y", machine="h1", order=1)], {}, "y"),
    ([node("x", readers=1, order=0), node("y", order=1)], {"max_readers": 2}, "y"),
    # ties: complete before partial, further progress, GPU before host copy, registration order
    ([node("p", NodeState.READING, progress=3, order=0), node("c", order=1)], {}, "c"),
    ([node("p2", NodeState.READING, progress=2, order=0), node("p3", NodeState.READING, progress=3, order=1)], {}, "p3"),
    ([node("h", host=True, order=0), node("g", order=1)], {}, "g"),
    ([node("b", order=2), node("a", order=1)], {}, "a"),
    # downstream of the reader (its own readers' subtree) is no source
    ([node("d", NodeState.READING, progress=3)], {"downstream": ["d"]}, None),
])
def test_choose_source_rules(cands, kw, expected):
    assert pick(node("r", **READER), cands, **kw) == expected


def test_a_partial_holder_behind_the_reader_is_no_source():
    reader = node("r", **{**READER, "progress": 2})
    assert pick(reader, [node("t", readers=1), node("r1", NodeState.READING, progress=1, order=1)]) is None
    assert pick(reader, [node("t", readers=1), node("r1", NodeState.READING, progress=2, order=1)]) == "r1"


def test_across_datacenters_a_reader_takes_its_datacenters_slot_at_the_origin_or_waits_for_it():
    """The reader in datacenter "c" has no local candidate. The origin "a" (the trainer's) serves
    its own pipeline and, besides, one reader per remote datacenter: busy with a reader of its
    own datacenter, it still serves "c"; busy with a reader from "c" already, the reader waits
    for it rather than take "b"'s free copy (two slow links away); "b"'s copy only when the
    origin has no usable holder at all."""
    reader = node("r", **{**READER, "dc": "c"})

    class Pool(ListPool):
        def readers_in(self, cand, dc):  # reader ids here are "<datacenter>:<n>"
            return sum(1 for r in cand.readers if r.split(":")[0] == dc)

    def pick_origin(cands):
        src = choose_source(reader, Pool(cands, 1), downstream=set(), readers_per_source_max=1,
                            seeding_blocked=False, origin_dc="a")
        return src.id if src else None

    def trainer(*readers):
        t = node("t")
        t.readers = set(readers)
        return t

    assert pick_origin([trainer("a:1"), node("b1", dc="b", order=1)]) == "t"
    assert pick_origin([trainer("a:1", "b:1"), node("b1", dc="b", order=1)]) == "t"
    assert pick_origin([trainer("c:1"), node("b1", dc="b", order=1)]) is None
    assert pick_origin([trainer(), node("b1", dc="b", order=1)]) == "t"
    assert pick_origin([node("b1", dc="b", order=1)]) == "b1"
    partial = node("p", NodeState.READING, progress=4)
    partial.readers = {"a:1"}
    assert pick_origin([partial]) is None, "a partial origin holder serves no extra datacenter"


def test_a_suspected_source_only_when_nothing_else_is_left():
    reader = node("r", **READER)
    reader.suspects = {"t"}
    assert pick(reader, [node("t"), node("u", order=1)]) == "u"
    assert pick(reader, [node("t")]) == "t"


# --------------------------------------------------------------------------- cost


def test_a_storm_of_ten_thousand_readers_is_scheduled_in_seconds():
    """trainer -> r0 -> r1 -> ... -> r9999: every Replicate is assigned at once (a pipeline), every
    ReplicateDone frees one source; before the index this took minutes (O(N^2))."""
    core = ReferenceCore(Config())
    n = 10_000
    t0 = time.perf_counter()
    core.handle(m.Register("t", "pol", "t", 0, 1, LAYOUT), 0.0)
    core.handle(m.Publish("t", 1), 0.0)
    for i in range(n):
        core.handle(m.Register(f"r{i}", "pol", f"r{i}", 0, 1, LAYOUT), 0.0)
    for i in range(n):
        reply, _ = core.handle(m.Replicate(f"r{i}", "latest", 1), 0.0)
        assert isinstance(reply, m.Assignment) and reply.source_id == ("t" if i == 0 else f"r{i - 1}")
    for i in range(n):
        assert isinstance(core.handle(m.ReplicateDone(f"r{i}", 1), 0.0)[0], m.Ok)
    core.tick(1.0)
    assert time.perf_counter() - t0 < 30.0
    assert core.holder_counts() == {("pol", "published"): n + 1}


def test_lease_expiry_looks_only_at_expired_clients():
    core = ReferenceCore(Config(heartbeat_interval_s=1.0, lease_timeout_s=10.0))
    for i in range(3):
        core.handle(m.Register(f"c{i}", "pol", f"c{i}", 0, 1, LAYOUT), float(i))
    core.handle(m.Heartbeat("c0"), 5.0)  # c0 is now the most recently heard from
    evicted = {e.client_id for e in core.tick(11.5) if isinstance(e.event, m.Evicted)}
    assert evicted == {"c1"}  # c1 silent since 1.0; c2 since 2.0 (9.5 s: alive); c0 since 5.0
    assert set(core.nodes) == {"c0", "c2"}
