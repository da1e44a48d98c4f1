"""Unit tests of the protocol core: every transition, every typed error, the transaction of
docs/design.md ("A round is a transaction"), scheduling pipelines, cross-datacenter seeding,
retention and leases."""

from __future__ import annotations

import ast
import pathlib

import pytest

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.reference import ReferenceCore
from tensorhub.core.state import NodeState

UNITS = 4
LAYOUT = m.LayoutInfo("fp-a", UNITS, 400, (m.TensorMeta("w", "float32", (100,), 400),))


class World:
    """A core plus shorthands; every reply/effect is kept for assertions."""

    def __init__(self, **cfg) -> None:
        # The exact effects of the protocol without the pushes of no-op updates answered locally
        # (tests/core/test_noop_local.py turns them on) and without the notes of prefetches inside
        # a seeded datacenter (tests/core/test_prefetch_in_dc.py turns them on).
        cfg.setdefault("noop_staleness_s", 0.0)
        cfg.setdefault("prefetch_in_datacenter", False)
        self.core = ReferenceCore(Config(**cfg))
        self.now = 0.0
        self.events: dict[str, list] = {}

    def send(self, req):
        reply, effects = self.core.handle(req, self.now)
        for eff in effects:
            self.events.setdefault(eff.client_id, []).append(eff.event)
        return reply

    def tick(self, dt: float):
        self.now += dt
        for eff in self.core.tick(self.now):
            self.events.setdefault(eff.client_id, []).append(eff.event)

    def pop(self, cid: str):
        evs = self.events.pop(cid, [])
        return evs

    def reg(self, cid, replica=None, shard=0, num_shards=1, dc="a", spot=False, layout=LAYOUT, model="pol"):
        reply = self.send(m.Register(cid, model, replica or cid, shard, num_shards, layout, cid.encode(), dc, spot))
        assert isinstance(reply, m.Registered), reply
        return cid

    def state(self, cid):
        n = self.core.nodes[cid]
        return n.state.value, n.version

    def source_of(self, cid):
        return self.core.nodes[cid].source


def err(reply) -> str:
    assert isinstance(reply, m.ErrorReply), reply
    return reply.code


def test_core_has_no_forbidden_imports():
    forbidden = {"ray", "torch", "nixl", "time", "random", "asyncio", "cupy", "threading"}
    root = pathlib.Path(__file__).resolve().parents[2] / "tensorhub" / "core"
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path.name} imports {name}"


# --------------------------------------------------------------------------- publish / unpublish


def test_publish_then_replicate_reads_from_trainer_then_becomes_holder():
    w = World()
    w.reg("t"); w.reg("r")
    assert w.send(m.Publish("t", 1)) == m.Ok()
    a = w.send(m.Replicate("r", "latest"))
    assert isinstance(a, m.Assignment) and (a.version, a.source_id, a.source_partial, a.start_unit) == (1, "t", False, 0)
    assert w.state("r") == ("reading", 1)
    assert w.send(m.ReplicateDone("r", 1)) == m.Ok()
    assert w.state("r") == ("published", 1)
    assert w.core.available("pol") == [1]


def test_publish_same_version_twice_is_idempotent_other_version_is_invalid_state():
    w = World()
    w.reg("t")
    assert w.send(m.Publish("t", 3)) == m.Ok()
    assert w.send(m.Publish("t", 3)) == m.Ok()
    assert err(w.send(m.Publish("t", 4))) == "InvalidState"
    assert w.state("t") == ("published", 3)


def test_unpublish_without_readers_completes_at_once_and_is_idempotent():
    w = World(versions_retained=1)
    w.reg("t"); w.reg("r")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("r", 1)); w.send(m.ReplicateDone("r", 1))
    assert w.send(m.Unpublish("t")) == m.UnpublishDone(version=1)
    assert w.state("t") == ("idle", -1)
    assert w.send(m.Unpublish("t")) == m.UnpublishDone(version=-1)


def test_unpublish_drains_in_flight_reader_and_hides_holder():
    """trainer -> r1 ; unpublish(trainer) waits for r1; r2 arriving meanwhile is not given the trainer."""
    w = World()
    w.reg("t"); w.reg("r1"); w.reg("r2"); w.reg("r0")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("r0", 1)); w.send(m.ReplicateDone("r0", 1))
    assert w.send(m.Replicate("r1", 1)).source_id in ("t", "r0")
    src = w.source_of("r1")
    assert w.send(m.Unpublish(src)) == m.Waiting(version=1)
    assert w.state(src) == ("draining", 1)
    a2 = w.send(m.Replicate("r2", 1))
    assert a2.source_id != src
    w.send(m.ReplicateDone("r1", 1))
    assert w.pop(src) == [m.UnpublishDone(version=1)]
    assert w.state(src) == ("idle", -1)


def test_retention_offload_when_last_non_spot_holder_unpublishes_and_host_copy_serves():
    w = World()
    w.reg("t"); w.reg("spot", spot=True); w.reg("late")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("spot", 1)); w.send(m.ReplicateDone("spot", 1))
    reply = w.send(m.Unpublish("t"))
    assert reply == m.OffloadOrder(version=1), "spot holders do not count toward retention"
    assert w.state("t") == ("offloading", 1)
    assert w.send(m.Unpublish("t")) == m.OffloadOrder(version=1), "a retry repeats the order"
    assert w.send(m.OffloadDone("t", 1, b"host-ep")) == m.UnpublishDone(version=1)
    hosts = [n for n in w.core.nodes.values() if n.host]
    assert len(hosts) == 1 and hosts[0].version == 1 and hosts[0].owner == "t"
    w.send(m.Leave("spot"))
    a = w.send(m.Replicate("late", 1))
    assert a.source_id == hosts[0].id and a.source_endpoint == b"host-ep"


def test_no_offload_when_a_drained_reader_becomes_holder():
    """trainer -> r ; the trainer unpublishes while r reads: after the drain r holds v, no offload."""
    w = World()
    w.reg("t"); w.reg("r")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("r", 1))
    assert w.send(m.Unpublish("t")) == m.Waiting(version=1)
    w.send(m.ReplicateDone("r", 1))
    assert w.pop("t") == [m.UnpublishDone(version=1)]


def test_versions_past_retention_are_forgotten_and_host_copies_dropped():
    w = World(versions_retained=2)
    w.reg("t"); w.reg("r")
    w.send(m.Publish("t", 1))
    assert w.send(m.Unpublish("t")) == m.OffloadOrder(version=1)
    w.send(m.OffloadDone("t", 1, b"h1"))
    w.send(m.Publish("t", 2)); w.send(m.Unpublish("t"))
    w.send(m.OffloadDone("t", 2, b"h2"))
    assert w.core.available("pol") == [1, 2]
    w.send(m.Publish("t", 3))
    assert w.core.available("pol") == [2, 3]
    assert m.DropHostCopy(version=1) in w.pop("t")
    assert err(w.send(m.Replicate("r", 1))) == "VersionExpired"
    assert err(w.send(m.Publish("t", 0))) in ("InvalidState", "VersionExpired")


# --------------------------------------------------------------------------- version specs


@pytest.mark.parametrize(
    "spec, expected",
    [("latest", 5), ("latest-0", 5), ("latest-1", 4), (4, 4), (5, 5),
     ("latest-2", "VersionNotFound"), (9, "VersionNotFound"), (-1, "BadVersionSpec"),
     ("newest", "BadVersionSpec"), ("latest-x", "BadVersionSpec"), (True, "BadVersionSpec")],
)
def test_version_specs_resolve_against_available_versions(spec, expected):
    w = World(versions_retained=2)
    w.reg("t4"); w.reg("t5"); w.reg("r")
    w.send(m.Publish("t4", 4)); w.send(m.Publish("t5", 5))
    reply = w.send(m.Replicate("r", spec))
    if isinstance(expected, int):
        assert reply.version == expected
    else:
        assert err(reply) == expected
        assert w.state("r") == ("idle", -1)


def test_unknown_model_and_unknown_client_are_typed_errors():
    w = World()
    w.reg("lonely", model="nobody-publishes")
    assert err(w.send(m.Replicate("lonely", "latest"))) == "UnknownModel"
    assert err(w.send(m.Publish("ghost", 1))) == "UnknownClient"
    assert err(w.send(m.Heartbeat("ghost"))) == "UnknownClient"


# --------------------------------------------------------------------------- registration errors


def test_registration_errors_change_nothing():
    w = World()
    w.reg("t", replica="A", shard=0, num_shards=2)
    other = m.LayoutInfo("fp-b", UNITS, 400, (m.TensorMeta("w", "float16", (200,), 400),))
    cases = [
        (m.Register("x", "pol", "B", 0, 2, other, b""), "LayoutMismatch", "float16"),
        (m.Register("x", "pol", "B", 0, 3, LAYOUT, b""), "LayoutMismatch", "2 shards"),
        (m.Register("x", "pol", "B", 2, 2, LAYOUT, b""), "LayoutMismatch", "out of range"),
        (m.Register("x", "pol", "A", 0, 2, LAYOUT, b""), "ShardTaken", "shard 0"),
        (m.Register("t", "pol", "C", 1, 2, LAYOUT, b""), "InvalidState", "already registered"),
    ]
    before = w.core.status()
    for req, code, text in cases:
        reply = w.send(req)
        assert err(reply) == code and text in reply.message, (req, reply)
    assert w.core.status() == before
    assert "x" not in w.core.nodes


@pytest.mark.parametrize(
    "setup, request_, code",
    [
        ("reading", m.Publish("r", 2), "InvalidState"),
        ("reading", m.Replicate("r", 1), "InvalidState"),
        ("reading", m.Unpublish("r"), "InvalidState"),
        ("idle", m.ReplicateDone("r", 1), "InvalidState"),
        ("idle", m.SourceFailed("r", "t", 0), "InvalidState"),
        ("idle", m.OffloadDone("r", 1, b""), "InvalidState"),
        ("published", m.Replicate("r", 1), "InvalidState"),
        ("reading", m.ReplicateDone("r", 7), "InvalidState"),
    ],
)
def test_requests_in_wrong_state_are_rejected_and_change_nothing(setup, request_, code):
    w = World()
    w.reg("t"); w.reg("r")
    w.send(m.Publish("t", 1))
    if setup in ("reading", "published"):
        w.send(m.Replicate("r", 1))
    if setup == "published":
        w.send(m.ReplicateDone("r", 1))
    before = w.core.status()
    assert err(w.send(request_)) == code
    assert w.core.status() == before


# --------------------------------------------------------------------------- transactions


def test_transaction_pins_version_for_all_shards_of_a_replica():
    """docs/design.md, "A round is a transaction": replica 0 shard 0 resolves latest = 12;
    replica 1 then publishes 13; replica 0 shard 1 must still get 12."""
    w = World(versions_retained=4)
    for s in (0, 1):
        w.reg(f"t{s}", replica="trainer", shard=s, num_shards=2)
        w.reg(f"r0s{s}", replica="r0", shard=s, num_shards=2)
        w.reg(f"r1s{s}", replica="r1", shard=s, num_shards=2)
        w.send(m.Publish(f"t{s}", 12))
    a0 = w.send(m.Replicate("r0s0", "latest", seq=1))
    assert a0.version == 12
    # replica 1 publishes 13 (it already holds those bytes, e.g. a second trainer group)
    for s in (0, 1):
        w.send(m.Publish(f"r1s{s}", 13))
    assert w.core.available("pol")[-1] == 13
    a1 = w.send(m.Replicate("r0s1", "latest", seq=1))
    assert a1.version == 12
    # the next round resolves afresh
    w.send(m.ReplicateDone("r0s0", 12)); w.send(m.ReplicateDone("r0s1", 12))
    assert w.send(m.Replicate("r0s0", "latest", seq=2, update=True)).version == 13


def test_version_of_sharded_replica_is_visible_only_when_all_shards_published():
    w = World()
    w.reg("t0", replica="trainer", shard=0, num_shards=2)
    w.reg("t1", replica="trainer", shard=1, num_shards=2)
    w.reg("r", replica="r", shard=0, num_shards=2)
    w.reg("r1", replica="r", shard=1, num_shards=2)
    w.send(m.Publish("t0", 1))
    assert w.core.available("pol") == []
    assert err(w.send(m.Replicate("r", "latest", seq=1))) == "VersionNotFound"
    w.send(m.Publish("t1", 1))
    assert w.core.available("pol") == [1]


def test_a_version_whose_publisher_lost_a_shard_is_stalled_until_the_shard_registers_again():
    """A trainer rank that dies before publishing the version its peers published: readers of
    that version hear ``VersionStalled`` (naming the replica and the shards without a client),
    not a plain ``VersionNotFound``, so they can stop waiting; nothing changes. A rank
    registered again makes it a plain wait again, and its publish makes the version readable."""
    w = World()
    for s in (0, 1):
        w.reg(f"t{s}", replica="trainer", shard=s, num_shards=2)
        w.reg(f"r{s}", replica="r", shard=s, num_shards=2)
    w.reg("u0", replica="u", shard=0, num_shards=2)
    w.reg("u1", replica="u", shard=1, num_shards=2)
    w.send(m.Publish("t0", 1))
    assert err(w.send(m.Replicate("r0", 1, seq=1))) == "VersionNotFound"  # t1 may still publish it
    assert isinstance(w.send(m.Leave("t1")), m.Ok)
    before = w.core.status()
    reply = w.send(m.Replicate("r0", 1, seq=1))
    assert err(reply) == "VersionStalled"
    assert "replica trainer publishes it from shard(s) [0] of 2; shard(s) [1] have no client" in reply.message
    assert w.core.status() == before and w.state("r0") == ("idle", -1)
    assert err(w.send(m.Replicate("r0", "latest", seq=1))) == "VersionNotFound"  # no version yet: not stalled
    assert err(w.send(m.Replicate("r0", 2, seq=1))) == "VersionNotFound"  # nobody publishes 2
    # Another replica of the model with every shard registered publishes version 1 in part: it
    # may complete it, so the version is not stalled.
    w.send(m.Publish("u0", 1))
    assert err(w.send(m.Replicate("r0", 1, seq=1))) == "VersionNotFound"
    w.send(m.Leave("u1"))
    assert "replica u publishes it" in w.send(m.Replicate("r0", 1, seq=1)).message
    w.reg("t1b", replica="trainer", shard=1, num_shards=2)
    assert err(w.send(m.Replicate("r0", 1, seq=1))) == "VersionNotFound"
    w.send(m.Publish("t1b", 1))
    assert w.core.available("pol") == [1]
    assert isinstance(w.send(m.Replicate("r0", 1, seq=1)), m.Assignment)


def test_transaction_spec_mismatch_is_rejected():
    w = World()
    for s in (0, 1):
        w.reg(f"t{s}", replica="trainer", shard=s, num_shards=2)
        w.reg(f"r{s}", replica="r", shard=s, num_shards=2)
        w.send(m.Publish(f"t{s}", 1))
    w.send(m.Replicate("r0", "latest", seq=1))
    assert err(w.send(m.Replicate("r1", 1, seq=1))) == "TransactionMismatch"
    assert w.state("r1") == ("idle", -1)


# --------------------------------------------------------------------------- scheduling


def test_simultaneous_readers_form_a_pipeline():
    """trainer -> r1 -> r2 -> r3 : one reader per source, later readers read earlier, partial ones."""
    w = World()
    w.reg("t")
    for r in ("r1", "r2", "r3"):
        w.reg(r)
    w.send(m.Publish("t", 1))
    chain = [w.send(m.Replicate(r, "latest")) for r in ("r1", "r2", "r3")]
    assert [(a.source_id, a.source_partial) for a in chain] == [("t", False), ("r1", True), ("r2", True)]


def test_least_loaded_prefers_idle_partial_holder_over_busy_trainer():
    """trainer -> r1 -> r2 -> r3 even with readers_per_source_max=2: least loaded goes first."""
    w = World(readers_per_source_max=2)
    w.reg("t")
    for r in ("r1", "r2", "r3"):
        w.reg(r)
    w.send(m.Publish("t", 1))
    got = [w.send(m.Replicate(r, 1)).source_id for r in ("r1", "r2", "r3")]
    assert got == ["t", "r1", "r2"]


def test_readers_per_source_max_caps_concurrent_readers():
    """trainer -> r1, r2 (both start ahead of any partial holder); r3 waits for a free source."""
    w = World(readers_per_source_max=2)
    for c in ("t", "r1", "r2", "r3"):
        w.reg(c)
    w.send(m.Publish("t", 1))
    assert w.send(m.Replicate("r1", 1)).source_id == "t"
    assert w.send(m.Replicate("r2", 1, resume_version=1, resume_units=2)).source_id == "t"
    assert w.send(m.Replicate("r3", 1, resume_version=1, resume_units=3)) == m.Waiting(version=1)
    w.send(m.ReplicateDone("r2", 1))
    ev = w.pop("r3")
    assert ev and ev[-1].source_id in ("t", "r2") and ev[-1].start_unit == 3


def test_least_loaded_complete_holder_first():
    """t (busy with r1), h (idle holder) : r2 -> h, not the partial r1."""
    w = World()
    w.reg("t"); w.reg("h"); w.reg("r1"); w.reg("r2")
    w.send(m.Publish("t", 1)); w.send(m.Publish("h", 1))
    assert w.send(m.Replicate("r1", 1)).source_id == "t"
    assert w.send(m.Replicate("r2", 1)).source_id == "h"


def test_a_readers_own_staging_copy_is_its_source_first_whatever_its_load():
    """r's prefetch staging copy (Register.stage_for=r) already serves x, at the per-source cap,
    and a free trainer exists: r still reads from its staging copy (a copy inside its own
    process), partial or complete. Others treat the staging copy as any holder (capped)."""
    w = World(readers_per_source_max=1)
    w.reg("t"); w.reg("r"); w.reg("x"); w.reg("y")
    assert isinstance(w.send(m.Register("r~stage", "pol", "r~stage", 0, 1, LAYOUT, b"s", "a", False,
                                        stage_for="r")), m.Registered)
    w.send(m.Publish("t", 1))
    assert w.send(m.Replicate("r~stage", 1)).source_id == "t"  # the prefetch
    w.send(m.ReplicateDone("r~stage", 1))
    assert w.send(m.Replicate("x", 1)).source_id == "t"
    assert w.send(m.Replicate("y", 1, resume_version=1, resume_units=1)).source_id == "r~stage"
    a = w.send(m.Replicate("r", 1))
    assert a.source_id == "r~stage" and not a.source_partial
    assert w.core.members.registration_of(w.core.nodes["r~stage"]).stage_for == "r"  # kept across a restart


def test_swap_exchanges_a_handle_and_its_complete_staging_copy_or_refuses_changing_nothing():
    """A double buffer (Swap): the handle publishes its staging copy's version from the staging
    copy's endpoint; the staging copy holds nothing at the handle's old endpoint. Refused while
    the staging copy has a reader, is not the handle's, is not complete at the version, or the
    spec names another version; and while the handle publishes or reads (LEGAL)."""
    w = World(readers_per_source_max=2)
    w.reg("t"); w.reg("r"); w.reg("y")
    w.send(m.Register("r~s", "pol", "r~s", 0, 1, LAYOUT, b"stage", "a", False, stage_for="r"))
    w.send(m.Register("y~s", "pol", "y~s", 0, 1, LAYOUT, b"ystage", "a", False, stage_for="y"))
    w.send(m.Publish("t", 1))
    assert w.send(m.Replicate("r~s", 1)).source_id == "t"
    assert err(w.send(m.Swap("r", "r~s", 1))) == "InvalidState"  # still reading
    w.send(m.ReplicateDone("r~s", 1))
    assert err(w.send(m.Swap("r", "y~s", 1))) == "InvalidState"  # not r's staging copy
    assert err(w.send(m.Swap("r", "r~s", 2))) == "InvalidState"  # not the version it holds
    w.send(m.Unpublish("t"))  # the staging copy is the only source of 1 now
    assert w.send(m.Replicate("y", 1)).source_id == "r~s"
    assert err(w.send(m.Swap("r", "r~s", 1))) == "InvalidState"  # it has a reader
    w.send(m.ReplicateDone("y", 1))
    w.send(m.Publish("t", 2))
    assert err(w.send(m.Swap("r", "r~s", 1, spec="latest"))) == "InvalidState"  # latest is 2 now
    assert (w.state("r"), w.state("r~s")) == (("idle", -1), ("published", 1))
    assert w.core.nodes["r"].endpoint == b"r" and w.core.nodes["r~s"].endpoint == b"stage"
    assert isinstance(w.send(m.Swap("r", "r~s", 1, spec=1)), m.Ok)
    assert (w.state("r"), w.state("r~s")) == (("published", 1), ("idle", -1))
    assert w.core.nodes["r"].endpoint == b"stage" and w.core.nodes["r~s"].endpoint == b"r"
    assert err(w.send(m.Swap("r", "r~s", 1))) == "InvalidState"  # publishes: not legal
    # The same swap again (its answer lost) is known by the endpoint it took over: Ok, no change.
    assert isinstance(w.send(m.Swap("r", "r~s", 1, spec=1, endpoint=b"stage")), m.Ok)
    assert err(w.send(m.Swap("r", "r~s", 1, endpoint=b"r"))) == "InvalidState"
    assert (w.state("r"), w.state("r~s")) == (("published", 1), ("idle", -1))
    w.send(m.Unpublish("y"))
    a = w.send(m.Replicate("y", 1))
    assert (a.source_id, a.source_endpoint) == ("r", b"stage")  # r, at its new endpoint


def test_waiting_readers_are_served_fifo():
    """t busy with r1 (which nobody can follow: all readers resume ahead of it); r2 then r3 wait;
    when t frees, r2 (the earlier) gets it."""
    w = World()
    for c in ("t", "r1", "r2", "r3"):
        w.reg(c)
    w.send(m.Publish("t", 1))
    w.send(m.Replicate("r1", 1))
    assert w.send(m.Replicate("r2", 1, resume_version=1, resume_units=1)) == m.Waiting(version=1)
    assert w.send(m.Replicate("r3", 1, resume_version=1, resume_units=1)) == m.Waiting(version=1)
    w.send(m.ReplicateDone("r1", 1))
    a2 = w.pop("r2")[-1]
    assert a2.start_unit == 1
    a3 = w.pop("r3")[-1]
    assert {a2.source_id, a3.source_id} == {"t", "r1"} or a3.source_id == "r2"


def test_partial_holder_behind_the_reader_is_not_a_source():
    w = World()
    w.reg("t"); w.reg("r1"); w.reg("r2")
    w.send(m.Publish("t", 1))
    w.send(m.Replicate("r1", 1))  # r1 at progress 0 reading from t
    reply = w.send(m.Replicate("r2", 1, resume_version=1, resume_units=2))
    assert reply == m.Waiting(version=1)
    w.send(m.ReplicateDone("r1", 1))
    ev = w.pop("r2")
    assert ev and ev[-1].source_id in ("t", "r1") and ev[-1].start_unit == 2


# --------------------------------------------------------------------------- cross datacenter


def test_cross_datacenter_one_seeder_then_local_pipeline():
    """dc-a: trainer ; dc-b: b1 seeds across, b2 -> b1, b3 -> b2 (never a second cross copy)."""
    w = World()
    w.reg("t", dc="a")
    for r in ("b1", "b2", "b3"):
        w.reg(r, dc="b")
    w.send(m.Publish("t", 1))
    a1, a2, a3 = (w.send(m.Replicate(r, 1)) for r in ("b1", "b2", "b3"))
    assert (a1.source_id, a1.cross_datacenter) == ("t", True)
    assert (a2.source_id, a2.cross_datacenter) == ("b1", False)
    assert (a3.source_id, a3.cross_datacenter) == ("b2", False)


def test_second_reader_in_datacenter_waits_for_seeder_instead_of_crossing():
    w = World(readers_per_source_max=1)
    w.reg("t", dc="a"); w.reg("t2", dc="a")
    w.reg("b1", dc="b"); w.reg("b2", dc="b")
    w.send(m.Publish("t", 1)); w.send(m.Publish("t2", 1))
    assert w.send(m.Replicate("b1", 1)).source_id in ("t", "t2")
    a2 = w.send(m.Replicate("b2", 1))
    assert a2.source_id == "b1", "a free remote trainer must not tempt a second cross-DC copy"


def test_smart_skipping_resolves_latest_to_local_version_while_seed_in_flight():
    """dc a: trainer publishes 2 ; dc b: b0, b1 hold 1 ; b1 seeds 2 across ; b0 and b2 asking
    "latest" get 1 (complete in dc b) instead of queueing behind the seed."""
    w2 = World(versions_retained=3, smart_skipping=True, offload_seeding=False)
    for cid, dc in (("t", "a"), ("b0", "b"), ("b1", "b"), ("b2", "b")):
        w2.reg(cid, dc=dc)
    w2.send(m.Publish("t", 1))
    for b in ("b0", "b1"):
        w2.send(m.Replicate(b, 1))
    w2.send(m.ReplicateDone("b0", 1)); w2.send(m.ReplicateDone("b1", 1))
    w2.send(m.Unpublish("t")); w2.send(m.Publish("t", 2))
    assert w2.send(m.Replicate("b1", "latest", update=True)).version == 2  # seeder
    assert w2.send(m.Replicate("b0", "latest", update=True)) == m.NoChange(version=1, in_flight=2)
    a = w2.send(m.Replicate("b2", "latest"))
    assert (a.version, a.in_flight) == (1, 2)
    w3 = World(versions_retained=3, smart_skipping=False, offload_seeding=False)
    for cid, dc in (("t", "a"), ("b0", "b"), ("b1", "b")):
        w3.reg(cid, dc=dc)
    w3.send(m.Publish("t", 1)); w3.send(m.Replicate("b0", 1)); w3.send(m.ReplicateDone("b0", 1))
    w3.send(m.Unpublish("t")); w3.send(m.Publish("t", 2))
    w3.send(m.Replicate("b1", "latest"))
    assert w3.send(m.Replicate("b0", "latest", update=True)) == m.OffloadOrder(version=1)
    assert w3.send(m.OffloadDone("b0", 1, b"h")).version == 2


def test_smart_skipping_looks_past_a_newest_version_whose_only_holder_drains():
    """dc a: the trainer ; dc b: b0, b1 hold 1 ; dc c: c0 holds 2. Version 3 is committed and
    b1 seeds it across; the trainer then unpublishes (draining, for its next step): version 3
    has no visible holder for a moment, and "latest" would fall back to 2 -- held only in dc c,
    two slow links away. Skipping still sees 3 on its way: b0 keeps 1 (skipping 3), a reader
    with nothing waits behind the seed of 3 in dc b; neither reads 2 across."""
    w = World(versions_retained=3, smart_skipping=True, offload_seeding=False)
    w.reg("t", dc="a"); w.reg("b0", dc="b"); w.reg("b1", dc="b"); w.reg("b2", dc="b"); w.reg("c0", dc="c")
    w.send(m.Publish("t", 1))
    for b in ("b0", "b1", "c0"):
        w.send(m.Replicate(b, 1)); w.send(m.ReplicateDone(b, 1))
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 2))
    w.send(m.Replicate("c0", 2, update=True)); w.send(m.ReplicateDone("c0", 2))
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 3))
    assert w.send(m.Replicate("b1", "latest", update=True)).version == 3  # the seed of dc b
    assert w.core.nodes["b1"].source == "t"
    w.send(m.Unpublish("t"))
    assert w.state("t") == ("draining", 3) and w.core.available("pol")[-1] == 2
    assert w.send(m.Replicate("b0", "latest", update=True)) == m.NoChange(version=1, in_flight=3)
    w.send(m.Leave("b0", drop_last_copy=True))
    assert w.send(m.Replicate("b2", "latest")).version == 3  # nothing to keep: behind the seed
    assert w.core.nodes["b2"].source == "b1" and not w.core.nodes["b2"].version == 2


def _seeds(w, cid):
    return [e.version for e in w.pop(cid) if isinstance(e, m.SeedAhead)]


def test_offload_seeding_asks_one_idle_non_spot_replica_per_remote_datacenter():
    """dc a: trainer ; dc b: b0 (spot), b1, b2 ; dc c: c0. A commit asks b1 (not spot) and c0 to
    seed, nobody in the trainer's datacenter; once b1's staging copy reads the version, dc b
    counts as reached; a replica that dies before its seed started is replaced (b2)."""
    w = World()
    w.reg("t", dc="a"); w.reg("a1", dc="a")
    w.reg("b0", dc="b", spot=True); w.reg("b1", dc="b"); w.reg("b2", dc="b"); w.reg("c0", dc="c")
    w.send(m.Publish("t", 1))
    assert [_seeds(w, c) for c in ("a1", "b0", "b1", "b2", "c0")] == [[], [], [1], [], [1]]
    w.send(m.Register("b1~s", "pol", "b1~s", 0, 1, LAYOUT, b"s", "b", False, stage_for="b1"))
    assert w.send(m.Replicate("b1~s", 1)).cross_datacenter  # the seed crosses, once
    w.send(m.Leave("c0", drop_last_copy=True))
    w.reg("c1", dc="c"); w.reg("c2", dc="c")
    w.send(m.Leave("b2", drop_last_copy=True))  # not the seeder: nothing new for dc b
    assert _seeds(w, "b0") == _seeds(w, "b1") == [] and _seeds(w, "c1") == [1]  # c0 left: c1 takes over
    # The next version: dc b is asked again (its staging copy holds 1, not 2).
    w.send(m.ReplicateDone("b1~s", 1))
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 2))
    assert _seeds(w, "b1") == [2] and _seeds(w, "c1") == [2]


def test_readers_wait_for_the_asked_seeders_copy_and_cross_themselves_only_after_seed_wait():
    w = World(seed_wait_s=5.0)
    w.reg("t", dc="a"); w.reg("b0", dc="b"); w.reg("b1", dc="b"); w.reg("b2", dc="b")
    w.send(m.Publish("t", 1))
    assert _seeds(w, "b0") == [1]
    assert w.send(m.Replicate("b1", 1)) == m.Waiting(version=1)  # not a second crossing
    w.send(m.Register("b0~s", "pol", "b0~s", 0, 1, LAYOUT, b"s", "b", False, stage_for="b0"))
    assert w.send(m.Replicate("b0~s", 1)).cross_datacenter  # the staging copy seeds...
    ev = w.pop("b1")
    assert ev and ev[-1].source_id == "b0~s" and not ev[-1].cross_datacenter  # ...b1 reads it there
    # Version 2: the asked seeder (b0) never starts; after seed_wait_s the first reader crosses.
    w.send(m.ReplicateDone("b0~s", 1)); w.send(m.ReplicateDone("b1", 1))
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 2))
    assert _seeds(w, "b0") == [2]
    assert w.send(m.Replicate("b2", 2)) == m.Waiting(version=2)
    assert w.send(m.Replicate("b1", "latest", update=True)) == m.NoChange(version=1, in_flight=2)
    w.tick(6.0)
    ev = w.pop("b2")
    assert ev and ev[-1].source_id == "t" and ev[-1].cross_datacenter


def test_skipping_keeps_the_readers_own_version_even_past_retention_while_a_seed_is_pending():
    w = World(versions_retained=1)
    w.reg("t", dc="a"); w.reg("b0", dc="b"); w.reg("b1", dc="b")
    w.send(m.Publish("t", 1))
    w.send(m.Replicate("b0", 1)); w.send(m.ReplicateDone("b0", 1))
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 2))  # version 1 falls out of retention
    assert w.send(m.Replicate("b0", "latest", update=True)) == m.NoChange(version=1, in_flight=2)
    assert w.send(m.Replicate("b1", "latest")) == m.Waiting(version=2)  # nothing of its own to keep


def test_a_skipped_to_version_no_longer_held_locally_is_not_fetched_across():
    """b2's "latest" skipped to version 1 (complete in dc b at b0) while b1 seeds 2; b0 dies
    mid-read: b2 is not sent across for the stale version 1 (a1 holds it in dc a), its read
    ends with VersionLost (a "latest" update retries and resolves anew)."""
    w = World(offload_seeding=False)
    w.reg("t", dc="a"); w.reg("a1", dc="a")
    for c in ("b0", "b1", "b2"):
        w.reg(c, dc="b")
    w.send(m.Publish("t", 1))
    for r in ("a1", "b0"):
        w.send(m.Replicate(r, 1)); w.send(m.ReplicateDone(r, 1))
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 2))
    assert w.send(m.Replicate("b1", "latest")).version == 2  # the seed of dc b
    a = w.send(m.Replicate("b2", "latest"))
    assert (a.version, a.source_id, a.in_flight) == (1, "b0", 2)
    w.send(m.Leave("b0", drop_last_copy=True))
    ev = [e for e in w.pop("b2") if isinstance(e, (m.Assignment, m.Failed))]
    assert ev and isinstance(ev[-1], m.Failed) and ev[-1].code == "VersionLost", ev
    # Without skipping involved, a reader of version 1 still fails over across datacenters.
    w.reg("b3", dc="b")
    assert w.send(m.Replicate("b3", 1)).source_id == "a1"


def test_an_asked_seeder_still_crossing_an_older_version_keeps_its_datacenters_claim():
    w = World(seed_wait_s=5.0)
    w.reg("t", dc="a"); w.reg("u", dc="a"); w.reg("b0", dc="b"); w.reg("b1", dc="b")
    w.send(m.Publish("t", 1))
    assert _seeds(w, "b0") == [1]
    w.send(m.Register("b0~s", "pol", "b0~prefetch", 0, 1, LAYOUT, b"s", "b", False, stage_for="b0"))
    assert w.send(m.Replicate("b0~s", 1)).source_id == "t"  # crossing, slowly
    w.send(m.Publish("u", 2))
    assert _seeds(w, "b0") == [2]
    assert w.send(m.Replicate("b1", 2)) == m.Waiting(version=2)
    w.tick(6.0)  # past seed_wait_s, but b0's staging copy is still crossing version 1
    assert not [e for e in w.pop("b1") if isinstance(e, m.Assignment)]
    w.send(m.ReplicateDone("b0~s", 1))
    w.tick(1.0)  # the seeder is idle and did not take version 2 up: b1 may cross now
    ev = [e for e in w.pop("b1") if isinstance(e, m.Assignment)]
    assert ev and ev[-1].version == 2 and ev[-1].cross_datacenter


def test_offload_seeding_prefers_an_idle_replica_asks_every_shard_and_can_be_off():
    w = World()
    w.reg("t0", replica="t", shard=0, num_shards=2, dc="a"); w.reg("t1", replica="t", shard=1, num_shards=2, dc="a")
    for rid in ("x", "y"):
        for s in (0, 1):
            w.reg(f"{rid}{s}", replica=rid, shard=s, num_shards=2, dc="b")
    w.reg("z0", replica="z", shard=0, num_shards=2, dc="b")  # incomplete replica: never asked
    w.send(m.Publish("t0", 1)); w.send(m.Publish("t1", 1))
    assert [_seeds(w, c) for c in ("x0", "x1", "y0", "y1", "z0")] == [[1], [1], [], [], []]
    # version 2 (published by another trainer replica u): x is busy reading 1, so y is asked
    w.send(m.Replicate("x0", 1, seq=1)); w.send(m.Replicate("x1", 1, seq=1))
    w.reg("u0", replica="u", shard=0, num_shards=2, dc="a"); w.reg("u1", replica="u", shard=1, num_shards=2, dc="a")
    w.send(m.Publish("u0", 2)); w.send(m.Publish("u1", 2))
    assert [_seeds(w, c) for c in ("x0", "x1", "y0", "y1")] == [[], [], [2], [2]]
    off = World(offload_seeding=False)
    off.reg("t", dc="a"); off.reg("b", dc="b")
    off.send(m.Publish("t", 1))
    assert _seeds(off, "b") == []


# --------------------------------------------------------------------------- update


def test_update_is_noop_when_current_and_otherwise_unpublishes_then_reads():
    w = World(versions_retained=1)
    w.reg("t"); w.reg("r")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("r", 1)); w.send(m.ReplicateDone("r", 1))
    assert w.send(m.Replicate("r", "latest", update=True)) == m.NoChange(version=1)
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 2))
    a = w.send(m.Replicate("r", "latest", update=True))
    assert isinstance(a, m.Assignment) and a.version == 2 and w.state("r") == ("reading", 2)


def test_update_drains_readers_of_the_old_version_first():
    """r -> x (x reads v1 from r) ; r.update(latest=2) waits for x, then reads 2."""
    w = World(versions_retained=1)
    w.reg("t"); w.reg("r"); w.reg("x"); w.reg("y")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("r", 1)); w.send(m.ReplicateDone("r", 1))
    w.send(m.Replicate("y", 1, resume_version=1, resume_units=1))  # keeps t busy
    w.send(m.Replicate("x", 1, resume_version=1, resume_units=1))
    assert (w.source_of("y"), w.source_of("x")) == ("t", "r")
    w.send(m.ReplicateDone("y", 1))
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 2))
    assert w.send(m.Replicate("r", "latest", update=True)) == m.Waiting(version=2)
    assert w.state("r") == ("draining", 1)
    w.send(m.ReplicateDone("x", 1))
    ev = w.pop("r")
    assert len(ev) == 1 and isinstance(ev[0], m.Assignment) and ev[0].version == 2


# --------------------------------------------------------------------------- faults


def test_source_failure_reassigns_and_resumes_from_reader_progress():
    """t -> r1 -> r2 ; r1 dies: r2 resumes from t at its own progress."""
    w = World()
    w.reg("t"); w.reg("r1"); w.reg("r2")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("r1", 1)); w.send(m.Replicate("r2", 1))
    # t is busy with r1 and r1 is suspect for r2: r2 waits, and gets t when r1 finishes.
    assert w.send(m.SourceFailed("r2", "r1", 2)) == m.Waiting(version=1)
    assert w.state("r2") == ("waiting", 1)
    w.send(m.Progress("r1", 4)); w.send(m.ReplicateDone("r1", 1))
    a = w.pop("r2")[-1]
    assert (a.start_unit, a.assign_no) == (2, 2) and a.source_id in ("t", "r1")


def _update_after_offload() -> tuple["World", m.Assignment]:
    """r is the last non-spot holder of version 1 (retained, k=2) and updates to version 2:
    offloaded first (OffloadOrder, OffloadDone), then reading from t."""
    w = World(versions_retained=2)
    w.reg("t"); w.reg("r")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("r", 1)); w.send(m.ReplicateDone("r", 1))
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 2))
    assert w.send(m.Replicate("r", "latest", update=True)) == m.OffloadOrder(version=1)
    a = w.send(m.OffloadDone("r", 1, b"host"))
    assert isinstance(a, m.Assignment) and a.version == 2
    return w, a


def test_update_with_retained_old_version_offloads_then_reads():
    """r is the last non-spot holder of version 1 (retained, k=2): update() offloads it first."""
    w, _ = _update_after_offload()
    assert w.core.available("pol") == [1, 2]


def test_an_update_offload_done_sent_again_gets_the_reads_answer_not_invalid_state():
    """An update's OffloadDone whose reply was lost (or that arrived twice) and is sent again
    after the server applied it: the node is reading the new version by then. Answered
    InvalidState, the handle ended the call without aborting a read it never saw start, and the
    server kept it as a reader of its source for good: the source's unpublish never finished
    (simulator, mixed_spot seed 569). The resend gets the read's current answer instead."""
    w, a = _update_after_offload()
    assert w.send(m.OffloadDone("r", 1, b"host")) == a  # the same read, answered again
    w.send(m.Unpublish("t"))  # the source drains for its one reader
    w.send(m.ReplicateDone("r", 2))
    assert w.state("r") == ("published", 2) and w.pop("t")[-1] == m.UnpublishDone(version=2)
    # Outside a read, a report of an offload the server never ordered is still refused.
    assert w.send(m.OffloadDone("r", 1, b"host")).code == "InvalidState"


def test_source_failed_for_stale_source_repeats_current_assignment():
    w = World()
    w.reg("t"); w.reg("r")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("r", 1))
    a = w.send(m.SourceFailed("r", "someone-else", 1))
    assert a.source_id == "t" and a.start_unit == 1


def test_lease_expiry_removes_whole_replica_and_reassigns_readers():
    w = World(heartbeat_interval_s=1.0, lease_timeout_s=3.0)
    w.reg("t"); w.reg("h")
    w.reg("s0", replica="S", shard=0, num_shards=1)
    w.send(m.Publish("t", 1)); w.send(m.Publish("h", 1))
    w.reg("r")
    w.send(m.Replicate("r", 1))
    src = w.source_of("r")
    other = "h" if src == "t" else "t"
    for _ in range(5):
        w.tick(1.0)
        for cid in ("r", other, "s0"):
            w.send(m.Heartbeat(cid))
    assert src not in w.core.nodes
    ev = w.pop("r")
    assert ev and ev[-1].source_id == other
    assert err(w.send(m.Heartbeat(src))) == "UnknownClient"


def test_dead_shard_evicts_its_siblings():
    w = World(lease_timeout_s=3.0)
    w.reg("a0", replica="A", shard=0, num_shards=2)
    w.reg("a1", replica="A", shard=1, num_shards=2)
    w.now = 2.0
    w.send(m.Heartbeat("a1"))
    w.tick(2.0)
    assert "a0" not in w.core.nodes and "a1" not in w.core.nodes
    assert m.Evicted(reason="lease expired") in w.pop("a1")


def test_last_holder_dies_readers_get_version_lost():
    w = World(lease_timeout_s=3.0)
    w.reg("t"); w.reg("r1"); w.reg("r2")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("r1", 1)); w.send(m.Replicate("r2", 1))
    w.now = 2.5
    w.send(m.Heartbeat("r1")); w.send(m.Heartbeat("r2"))
    w.tick(1.0)
    assert "t" not in w.core.nodes
    for r in ("r1", "r2"):
        ev = w.pop(r)
        assert ev and isinstance(ev[-1], m.Failed) and ev[-1].code == "VersionLost"
        assert w.state(r) == ("idle", -1)


def test_leave_of_source_reassigns_reader():
    w = World()
    w.reg("t"); w.reg("h"); w.reg("r")
    w.send(m.Publish("t", 1)); w.send(m.Publish("h", 1))
    src = w.send(m.Replicate("r", 1)).source_id
    w.send(m.Leave(src))
    ev = w.pop("r")
    assert ev[-1].source_id != src and ev[-1].assign_no == 2


def test_fresh_core_rebuilds_table_from_announcements():
    w = World()
    for cid in ("t", "r"):
        w.reg(cid)
    w.send(m.Publish("t", 5)); w.send(m.Replicate("r", 5)); w.send(m.ReplicateDone("r", 5))
    fresh = World()
    reg_t = m.Register("t", "pol", "t", 0, 1, LAYOUT, b"t")
    assert err(fresh.send(m.Publish("t", 5))) == "UnknownClient"
    assert fresh.send(m.Announce(reg_t, m.Holding(published=5))) == m.Ok()
    fresh.reg("n")
    assert fresh.send(m.Replicate("n", "latest")).version == 5


def test_restart_recovery_window_keeps_drain_until_reader_announces_its_edge():
    """Old server: t -> r (r mid-read). Fresh server: t announces and unpublishes at once; the
    drain must not complete before r announces that it reads from t (or the window ends)."""
    w = World(lease_timeout_s=5.0)
    reg_t = m.Register("t", "pol", "t", 0, 1, LAYOUT, b"t")
    reg_r = m.Register("r", "pol", "r", 0, 1, LAYOUT, b"r")
    assert w.send(m.Announce(reg_t, m.Holding(published=1))) == m.Ok()
    assert w.send(m.Unpublish("t")) == m.Waiting(version=1), "drain deferred in the recovery window"
    w.now = 1.0
    assert w.send(m.Announce(reg_r, m.Holding(reading_version=1, reading_source="t", reading_units=2))) == m.Ok()
    assert w.source_of("r") == "t" and w.state("r") == ("reading", 1)
    w.now = 5.5
    w.send(m.Heartbeat("t")); w.send(m.Heartbeat("r"))
    w.tick(0.5)  # window over, but r still reads from t: still draining
    assert w.state("t") == ("draining", 1)
    w.send(m.ReplicateDone("r", 1))
    assert w.pop("t")[-1] == m.UnpublishDone(version=1)


def test_restart_reader_announced_before_its_source_is_attached_when_source_announces():
    w = World(lease_timeout_s=5.0)
    reg_t = m.Register("t", "pol", "t", 0, 1, LAYOUT, b"t")
    reg_r = m.Register("r", "pol", "r", 0, 1, LAYOUT, b"r")
    w.send(m.Announce(reg_r, m.Holding(reading_version=1, reading_source="t", reading_units=1)))
    assert w.state("r") == ("waiting", 1) and not w.pop("r"), "no new source, no VersionLost in the window"
    w.send(m.Announce(reg_t, m.Holding(published=1)))
    assert w.source_of("r") == "t"


def test_follow_up_of_a_failed_read_gets_the_failure():
    """The reader's read failed (VersionLost) while it was busy; its late SourceFailed gets that error."""
    w = World(lease_timeout_s=3.0)
    w.reg("t"); w.reg("r")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("r", 1))
    w.now = 2.5
    w.send(m.Heartbeat("r"))
    w.tick(1.0)
    assert err(w.send(m.SourceFailed("r", "t", 1))) == "VersionLost"
    assert err(w.send(m.Replicate("r", 1))) in ("VersionNotFound", "UnknownModel"), "a new read resolves afresh"


def test_replicate_done_accepted_while_waiting_for_a_new_source():
    w = World()
    w.reg("t"); w.reg("h"); w.reg("r")
    w.send(m.Publish("t", 1)); w.send(m.Publish("h", 1))
    src = w.send(m.Replicate("r", 1)).source_id
    w.send(m.Leave(src))  # reassigned to the other holder...
    assert w.send(m.ReplicateDone("r", 1)) == m.Ok()  # ...but the last unit had already arrived
    assert w.state("r") == ("published", 1)


def test_sharded_round_waits_until_every_shard_registered():
    w = World()
    for s in (0, 1):
        w.reg(f"t{s}", replica="trainer", shard=s, num_shards=2)
        w.send(m.Publish(f"t{s}", 1))
    w.reg("r0", replica="r", shard=0, num_shards=2)
    assert err(w.send(m.Replicate("r0", "latest", seq=1))) == "ReplicaIncomplete"


def test_source_reported_failed_is_expired_unless_it_heartbeats_soon():
    """r reports t failed: t is removed after ~2.5 heartbeat intervals of silence, not a whole lease."""
    w = World(heartbeat_interval_s=1.0, lease_timeout_s=30.0)
    w.reg("t"); w.reg("h"); w.reg("r"); w.reg("x")
    w.send(m.Publish("t", 1)); w.send(m.Publish("h", 1))
    w.send(m.Replicate("x", 1, resume_version=1, resume_units=1))  # occupies one holder
    src = w.send(m.Replicate("r", 1)).source_id
    other = "h" if src == "t" else "t"
    w.send(m.SourceFailed("r", src, 0))
    for _ in range(3):
        w.now += 1.0
        for c in ("r", "x", other):
            w.send(m.Heartbeat(c))
        w.tick(0.0)
    assert src not in w.core.nodes
    # a falsely suspected node that keeps heartbeating stays
    w2 = World(heartbeat_interval_s=1.0, lease_timeout_s=30.0)
    w2.reg("t"); w2.reg("r")
    w2.send(m.Publish("t", 1)); w2.send(m.Replicate("r", 1))
    w2.send(m.SourceFailed("r", "t", 0))
    for _ in range(5):
        w2.now += 1.0
        w2.send(m.Heartbeat("t")); w2.send(m.Heartbeat("r"))
        w2.tick(0.0)
    assert "t" in w2.core.nodes


def test_version_being_offloaded_stays_available_and_reader_waits_for_the_host_copy():
    """The last holder of version 1 is offloading: a reader asking for latest waits, then reads
    the host copy (no VersionNotFound in between)."""
    w = World()
    w.reg("t"); w.reg("r")
    w.send(m.Publish("t", 1))
    assert w.send(m.Unpublish("t")) == m.OffloadOrder(version=1)
    assert w.core.available("pol") == [1]
    assert w.send(m.Replicate("r", "latest")) == m.Waiting(version=1)
    w.send(m.OffloadDone("t", 1, b"host"))
    a = w.pop("r")[-1]
    assert a.version == 1 and a.source_endpoint == b"host"


def test_lost_version_does_not_push_held_versions_out_of_retention():
    """k=2. r holds 1; the trainer publishes 2 and dies before anyone copied it; a new trainer
    publishes 3. Version 1 (held by r) stays available: lost version 2 does not count."""
    w = World(versions_retained=2, lease_timeout_s=3.0)
    w.reg("t"); w.reg("r")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("r", 1)); w.send(m.ReplicateDone("r", 1))
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 2))
    w.send(m.Leave("t", drop_last_copy=True))  # gone: nobody copied 2
    assert w.core.retained("pol") == [1]
    w.reg("t2")
    w.send(m.Publish("t2", 3))
    assert w.core.available("pol") == [1, 3]
    w.reg("x")
    assert w.send(m.Replicate("x", "latest-1")).version == 1


def test_background_event_for_the_requester_is_not_taken_as_its_reply():
    """During t's OffloadDone another holder appeared, so the copy is dropped (DropHostCopy) and
    the unpublish completes: the reply is UnpublishDone, the drop stays a background event."""
    w = World()
    w.reg("t"); w.reg("h")
    w.send(m.Publish("t", 1))
    assert w.send(m.Unpublish("t")) == m.OffloadOrder(version=1)
    w.send(m.Publish("h", 1))
    assert w.send(m.OffloadDone("t", 1, b"x")) == m.UnpublishDone(version=1)
    assert w.pop("t") == [m.DropHostCopy(version=1)]


# --------------------------------------------------------------------------- dead processes (Ray knows)


def test_declared_dead_replica_is_removed_at_once_and_its_readers_move_on():
    """t1 -> r ; Ray says t1's job ended: t1 goes now (no lease wait) and r moves to t2."""
    w = World(lease_timeout_s=30.0)
    w.reg("t1"); w.reg("t2"); w.reg("r")
    w.send(m.Publish("t1", 1)); w.send(m.Publish("t2", 1))
    src = w.send(m.Replicate("r", 1)).source_id
    other = "t2" if src == "t1" else "t1"
    for eff in w.core.declare_dead([src, "nobody"], w.now, "process gone: its job ended"):
        w.events.setdefault(eff.client_id, []).append(eff.event)
    assert src not in w.core.nodes
    assert m.Evicted(reason="process gone: its job ended") in w.pop(src)
    a = w.pop("r")[-1]
    assert a.source_id == other and a.assign_no == 2


def test_reader_reporting_a_source_already_removed_as_dead_is_told_so():
    """The server removed the corpse before handling the report: the reader's next assignment
    says ``failed_source_gone`` so its failover budget is not charged."""
    w = World()
    w.reg("t1"); w.reg("t2"); w.reg("r")
    w.send(m.Publish("t1", 1)); w.send(m.Publish("t2", 1))
    src = w.send(m.Replicate("r", 1)).source_id
    w.core.declare_dead([src], w.now, "gone")
    a = w.send(m.SourceFailed("r", src, 0, unreachable=True))
    assert isinstance(a, m.Assignment) and a.failed_source_gone and a.source_id != src
    # a live source that fails is charged as before (the only source left: tried again)
    b = w.send(m.SourceFailed("r", a.source_id, 0))
    assert isinstance(b, m.Assignment) and not b.failed_source_gone and b.assign_no == a.assign_no + 1


def test_unreachable_source_is_no_candidate_for_anyone_until_it_talks_again():
    w = World()
    w.reg("t1"); w.reg("t2"); w.reg("r1"); w.reg("r2")
    w.send(m.Publish("t1", 1))
    assert w.send(m.Replicate("r1", 1)).source_id == "t1"
    w.send(m.SourceFailed("r1", "t1", 0, unreachable=True))
    # another reader is not sent to the unreachable node either: it waits
    assert w.send(m.Replicate("r2", 1)) == m.Waiting(version=1)
    w.send(m.Publish("t2", 1))
    assert (w.source_of("r1"), w.source_of("r2")) == ("t2", "r1")  # t2 -> r1 -> r2, never t1
    w.send(m.Heartbeat("t1"))  # alive after all (a partition): a candidate again
    w.send(m.SourceFailed("r2", "r1", 0))
    assert w.source_of("r2") == "t1"


def test_registration_keeps_the_process_id():
    w = World()
    pid = m.ProcessId(job_id="02000000", actor_id="abc", worker_id="w", node_id="n", pid=42)
    assert w.send(m.Register("c", "pol", "c", 0, 1, LAYOUT, b"c", process=pid)) == m.Registered()
    assert w.core.processes() == {"c": pid}
    # re-registering the same client with the same parameters is idempotent
    assert w.send(m.Register("c", "pol", "c", 0, 1, LAYOUT, b"c", process=pid)) == m.Registered()


# --------------------------------------------------------------------------- issue 9 (client machine)


def test_reader_that_reports_its_announced_source_failed_is_not_reattached_to_it():
    """Fresh server: r announces it reads from t (not announced yet), then reports t failed; when t
    announces, the old edge must not come back (r would wait for a source it gave up on)."""
    w = World(lease_timeout_s=5.0)
    reg_t = m.Register("t", "pol", "t", 0, 1, LAYOUT, b"t")
    reg_r = m.Register("r", "pol", "r", 0, 1, LAYOUT, b"r")
    w.send(m.Announce(reg_r, m.Holding(reading_version=1, reading_source="t", reading_units=1)))
    assert w.send(m.SourceFailed("r", "t", 1)) == m.Waiting(version=1)
    w.send(m.Announce(reg_t, m.Holding(reading_version=1, reading_units=0)))
    assert w.source_of("r") != "t"


def test_host_copies_bring_a_retained_version_back_after_a_restart():
    """Old server: 1 and 2 retained, 1 only as r's host copy. Fresh server: r announces its host copy
    of 1 while its GPU copy holds 2: both versions are committed and available again."""
    w = World(lease_timeout_s=5.0)
    reg_r = m.Register("r", "pol", "r", 0, 1, LAYOUT, b"r")
    assert w.send(m.Announce(reg_r, m.Holding(published=2, host_copies=((1, b"r-host"),)))) == m.Ok()
    assert w.core.available("pol") == [1, 2]


def test_latest_waits_in_the_recovery_window_while_the_newest_version_has_host_copies_only():
    w = World(lease_timeout_s=5.0)
    reg_r = m.Register("r", "pol", "r", 0, 1, LAYOUT, b"r")
    reg_t = m.Register("t", "pol", "t", 0, 1, LAYOUT, b"t")
    w.send(m.Announce(reg_r, m.Holding(host_copies=((1, b"r-host"),))))
    w.reg("n")
    assert err(w.send(m.Replicate("n", "latest"))) == "ServerRecovering", "t (holding 2) may not be back yet"
    w.send(m.Announce(reg_t, m.Holding(published=2)))
    assert w.send(m.Replicate("n", "latest")).version == 2
    assert w.send(m.Replicate("r", 1)).source_id == "r#host1"


@pytest.mark.parametrize("others, drop, code", [
    (True, False, "LastCopyHeld"),   # r could still want it
    (True, True, None),              # asked to drop it
    (False, False, None),            # nobody left who could read it
])
def test_leave_of_the_last_copy_of_a_retained_version(others, drop, code):
    w = World()
    w.reg("t")
    if others:
        w.reg("r")
    w.send(m.Publish("t", 1))
    reply = w.send(m.Leave("t", drop_last_copy=drop))
    assert (err(reply) if code else reply) == (code or m.Ok())
    assert ("t" in w.core.nodes) == bool(code), "a refused leave changes nothing"


def test_a_restarted_shard_learns_its_replicas_rounds():
    """Shards 0 and 1 of A finished round 3; shard 1's process restarts: it counts on from 3 (its
    next call, round 4, is its siblings' next round). Had shard 0 still been reading in round 3,
    the new process would join round 3."""
    w = World(lease_timeout_s=5.0)
    for sh in (0, 1):
        w.reg(f"t{sh}", replica="T", shard=sh, num_shards=2)
        w.send(m.Publish(f"t{sh}", 1))
    w.reg("a0", replica="A", shard=0, num_shards=2)
    w.reg("a1", replica="A", shard=1, num_shards=2)
    for cid in ("a0", "a1"):
        assert isinstance(w.send(m.Replicate(cid, "latest", seq=3)), m.Assignment)
        w.send(m.ReplicateDone(cid, 1))
    w.send(m.Leave("a1", drop_last_copy=True))
    assert w.send(m.Register("a1.1", "pol", "A", 1, 2, LAYOUT, b"x")) == m.Registered(round_seq=3)


@pytest.mark.parametrize("completed_first", [False, True])
def test_a_completed_shard_binds_its_round_after_a_restart(completed_first):
    """Simulator seed 8419: round 4 of replica A took version 2; it was lost and shard 1's retry
    re-resolved the round to 3 and completed it, while shards 0 and 2 were still reading the lost
    version. The server restarts and version 4 appears: whatever the order of the announcements,
    the round is version 3 (the completed shard binds it), and the readers' retries join it."""
    w = World(lease_timeout_s=5.0)
    regs = {}
    for sh in range(3):
        w.reg(f"t{sh}", replica="T", shard=sh, num_shards=3)
        w.send(m.Publish(f"t{sh}", 3))
        regs[sh] = m.Register(f"a{sh}", "pol", "A", sh, 3, LAYOUT, f"a{sh}".encode())
    done = m.Announce(regs[1], m.Holding(published=3, txn_seq=4, txn_version=3))
    readers = [m.Announce(regs[sh], m.Holding(reading_version=2, txn_seq=4, txn_version=2)) for sh in (0, 2)]
    if completed_first:  # an unconfirmed completion waits for its siblings (ServerRecovering)
        assert err(w.send(done)) == "ServerRecovering" and "a1" not in w.core.nodes
    for a in readers + [done]:
        assert w.send(a) == m.Ok()
    for _ in range(12):  # the recovery window ends: nobody holds version 2
        for cid in ("t0", "t1", "t2", "a0", "a1", "a2"):
            w.send(m.Heartbeat(cid))
        w.tick(0.5)
    for sh in range(3):  # a newer version appears meanwhile
        w.reg(f"u{sh}", replica="U", shard=sh, num_shards=3)
        w.send(m.Publish(f"u{sh}", 4))
    for sh in (0, 2):  # (A registered in datacenter "default", T in "a": A is also asked to seed)
        assert [e.code for e in w.pop(f"a{sh}") if not isinstance(e, m.SeedAhead)] == ["VersionLost"]
        reply = w.send(m.Replicate(f"a{sh}", "latest", seq=4))
        assert isinstance(reply, m.Assignment) and reply.version == 3, reply


def test_a_publishers_background_host_copy_spares_the_last_reader_its_offload():
    """t copied version 1 to host memory in the background (HostCopy): when r, the last GPU
    holder of retained version 1, updates to 2, nothing is offloaded on its path, and the host
    copy serves version 1."""
    w = World(versions_retained=2)
    w.reg("t"); w.reg("r"); w.reg("late")
    w.send(m.Publish("t", 1)); w.send(m.Replicate("r", 1)); w.send(m.ReplicateDone("r", 1))
    assert w.send(m.HostCopy("t", 1, b"t-host1")) == m.Ok() and w.pop("t") == []
    w.send(m.Unpublish("t")); w.send(m.Publish("t", 2))
    a = w.send(m.Replicate("r", "latest", update=True))
    assert isinstance(a, m.Assignment) and a.version == 2, "no OffloadOrder"
    b = w.send(m.Replicate("late", 1))
    assert b.source_endpoint == b"t-host1"


@pytest.mark.parametrize("case", ["second_copy", "not_published", "past_retention", "spot"])
def test_an_unneeded_background_host_copy_is_given_back(case):
    w = World(versions_retained=2)
    w.reg("t"); w.reg("s", spot=True)
    w.send(m.Publish("t", 1)); w.send(m.Publish("s", 1))
    cid, version = ("s", 1) if case == "spot" else ("t", 1)
    if case == "second_copy":  # another holder's copy keeps version 1 already
        w.reg("t2"); w.send(m.Publish("t2", 1))
        w.send(m.HostCopy("t2", 1, b"first"))
    elif case == "not_published":
        version = 7
    elif case == "past_retention":  # t still publishes 1, but 2 and 3 are the retained two
        for v in (2, 3):
            w.reg(f"u{v}"); w.send(m.Publish(f"u{v}", v))
        assert w.core.retained("pol") == [2, 3]
    assert w.send(m.HostCopy(cid, version, b"extra")) == m.Ok()
    assert w.pop(cid) == [m.DropHostCopy(version=version)]
    assert sum(1 for n in w.core.nodes.values() if n.host) == (1 if case == "second_copy" else 0)


def test_a_free_source_on_the_readers_own_host_is_preferred():
    """Same datacenter, both free: the reader on host B gets the holder on host B (the
    same-host tier copies memory), even though the other registered first."""
    w = World()
    for cid, machine in (("a", "host-A"), ("b", "host-B"), ("r", "host-B"), ("q", "")):
        assert isinstance(w.send(m.Register(cid, "pol", cid, 0, 1, LAYOUT, cid.encode(), "a", False,
                                            machine=machine)), m.Registered)
    w.send(m.Publish("a", 1)); w.send(m.Publish("b", 1))
    assert w.send(m.Replicate("r", 1)).source_id == "b"
    assert w.send(m.Replicate("q", 1)).source_id == "a", "unknown host: the usual order"


def test_the_first_non_spot_reader_of_a_retained_version_is_asked_for_its_host_copy():
    """Not the publisher while a reader keeps copies (its process also holds the newest version:
    one death would take both), not a spot reader, and only one reader per version and shard."""
    w = World(versions_retained=2)
    w.reg("t"); w.reg("s", spot=True); w.reg("a"); w.reg("b")
    w.send(m.Publish("t", 1))
    for cid in ("s", "a", "b"):
        w.send(m.Replicate(cid, 1)); w.send(m.ReplicateDone(cid, 1))
    asked = {cid: [e for e in w.pop(cid) if isinstance(e, m.MakeHostCopy)] for cid in ("t", "s", "a", "b")}
    assert asked == {"t": [], "s": [], "a": [m.MakeHostCopy(1)], "b": []}
    assert w.send(m.HostCopy("a", 1, b"a-host")) == m.Ok() and w.pop("a") == []
    assert w.core.nodes["a#host1"].owner == "a"
    k1 = World(versions_retained=1)
    k1.reg("t"); k1.reg("a")
    k1.send(m.Publish("t", 1)); k1.send(m.Replicate("a", 1)); k1.send(m.ReplicateDone("a", 1))
    assert k1.pop("a") == [], "nothing retained past the newest: no copy ahead"


def test_a_reader_registered_with_retains_false_keeps_no_copy_and_counts_for_none():
    """A rollout engine (``retains=False``): never asked for a host copy, its copy does not spare
    the trainer's offload, and it may leave while holding the only other copy; the trainer's
    host copy then serves a late reader. Its registration says so again after a restart."""
    w = World(versions_retained=2)
    w.reg("t"); w.reg("late")
    reg = m.Register("e", "pol", "e", 0, 1, LAYOUT, b"e", "a", retains=False)
    assert isinstance(w.send(reg), m.Registered)
    w.send(m.Publish("t", 1))
    w.send(m.Replicate("e", 1)); w.send(m.ReplicateDone("e", 1))
    assert [x for x in w.pop("e") if isinstance(x, m.MakeHostCopy)] == [], "an engine is never asked"
    assert w.send(m.Unpublish("t")) == m.OffloadOrder(version=1), "its copy does not count"
    assert w.send(m.OffloadDone("t", 1, b"t-host")) == m.UnpublishDone(version=1)
    assert w.send(m.Leave("e")) == m.Ok(), "an engine never holds the last copy"
    assert w.send(m.Replicate("late", 1)).source_id == "t#host1"
    assert w.core.members.registration_of(w.core.nodes["t"]).retains
    k = World(versions_retained=2)
    k.reg("t")
    assert isinstance(k.send(m.Register("e", "pol", "e", 0, 1, LAYOUT, b"e", "a", retains=False)), m.Registered)
    k.send(m.Publish("t", 1)); k.send(m.Replicate("e", 1)); k.send(m.ReplicateDone("e", 1))
    assert not k.core.members.registration_of(k.core.nodes["e"]).retains
    assert err(k.send(m.Leave("t"))) == "LastCopyHeld", "the engine's copy does not spare the trainer's"


def test_a_trainer_whose_readers_keep_no_copies_is_asked_for_its_host_copy_once_they_are_done():
    """Every rollout engine ``retains=False`` (a spot one idle beside them): no reader will make
    the retention copy, so each trainer shard is asked (``MakeHostCopy``) once its own readers are done: not
    at its publish (the copy would compete with their reads), not while one still reads from
    it; an engine reading from another engine does not hold it back. Its offered copy spares
    the unpublish the offload. A replica of the model that keeps copies and reads the version is
    asked instead (the existing rule), but an idle one holds nothing back; a trainer that no
    other replica read is not asked, nor one past retention."""
    def asked(w, cid):
        return [x for x in w.pop(cid) if isinstance(x, m.MakeHostCopy)]

    w = World(versions_retained=2, readers_per_source_max=1)
    for k in (0, 1):
        w.reg(f"t{k}", replica="t", shard=k, num_shards=2)
    for r in ("e", "f"):
        for k in (0, 1):
            reg = m.Register(f"{r}{k}", "pol", r, k, 2, LAYOUT, r.encode(), "a", retains=False)
            assert isinstance(w.send(reg), m.Registered)
    w.reg("s0", replica="s", shard=0, num_shards=2, spot=True)
    for k in (0, 1):
        w.send(m.Publish(f"t{k}", 1))
    for k in (0, 1):
        assert w.send(m.Replicate(f"e{k}", 1)).source_id == f"t{k}"
        assert w.send(m.Replicate(f"f{k}", 1)).source_id == f"e{k}", "pipelined behind e"
    assert asked(w, "t0") == asked(w, "t1") == [], "not at its publish, not while e reads"
    w.send(m.ReplicateDone("e0", 1))
    assert asked(w, "t0") == [m.MakeHostCopy(1)] and asked(w, "t1") == [], "f0 reads from e0"
    w.send(m.ReplicateDone("e1", 1)); w.send(m.ReplicateDone("f0", 1)); w.send(m.ReplicateDone("f1", 1))
    assert asked(w, "t1") == [m.MakeHostCopy(1)] and asked(w, "t0") == [], "each shard once"
    assert all(asked(w, f"{r}{k}") == [] for r in "ef" for k in (0, 1)), "an engine is never asked"
    assert w.send(m.HostCopy("t0", 1, b"t0-host")) == m.Ok()
    assert w.send(m.Unpublish("t0")) == m.UnpublishDone(version=1), "copied ahead: no offload"
    assert w.send(m.Unpublish("t1")) == m.OffloadOrder(version=1), "its copy was not offered yet"
    # A replica that keeps copies and reads the version is asked when it holds it, not the
    # trainer; one that keeps copies but sits idle does not hold the trainer's copy back.
    k = World(versions_retained=2)
    k.reg("t"); k.reg("r"); k.reg("idle")
    assert isinstance(k.send(m.Register("e", "pol", "e", 0, 1, LAYOUT, b"e", "a", retains=False)), m.Registered)
    k.send(m.Publish("t", 1))
    assert k.send(m.Replicate("e", 1)).source_id == "t"
    assert isinstance(k.send(m.Replicate("r", 1)), m.Assignment)
    k.send(m.ReplicateDone("e", 1))
    assert asked(k, "t") == []
    k.send(m.ReplicateDone("r", 1))
    assert asked(k, "r") == [m.MakeHostCopy(1)] and asked(k, "t") == []
    j = World(versions_retained=2)
    j.reg("t"); j.reg("idle")
    assert isinstance(j.send(m.Register("e", "pol", "e", 0, 1, LAYOUT, b"e", "a", retains=False)), m.Registered)
    j.send(m.Publish("t", 1)); j.send(m.Replicate("e", 1)); j.send(m.ReplicateDone("e", 1))
    assert asked(j, "t") == [m.MakeHostCopy(1)] and asked(j, "idle") == []
    one = World(versions_retained=1)
    one.reg("t")
    assert isinstance(one.send(m.Register("e", "pol", "e", 0, 1, LAYOUT, b"e", "a", retains=False)), m.Registered)
    one.send(m.Publish("t", 1)); one.send(m.Replicate("e", 1)); one.send(m.ReplicateDone("e", 1))
    assert asked(one, "t") == [], "nothing retained past the newest: no copy ahead"


def test_a_shard_cannot_finish_a_version_its_round_moved_away_from():
    """Simulator seed 8444: shard 1 was still reading version 2 (failed by the old server, the
    event not seen yet) when a restart came; its sibling's round 4 had moved to version 1. The
    new server must not let shard 1 finish version 2 in round 4: it fails the read, and the
    retry in round 4 joins version 1."""
    w, regs = _split_round_world(old=2)
    assert w.send(m.Announce(regs[0], m.Holding(reading_version=1, txn_seq=4, txn_version=1))) == m.Ok()
    assert w.send(m.Announce(regs[1], m.Holding(reading_version=2, txn_seq=4, txn_version=2))) == m.Ok()
    reply = w.send(m.ReplicateDone("a1", 2))
    assert err(reply) == "VersionLost" and "moved to version 1" in reply.message
    a = w.send(m.Replicate("a1", "latest", seq=4))
    assert isinstance(a, m.Assignment) and a.version == 1


def test_a_shard_cannot_complete_by_announcement_a_version_its_round_moved_away_from():
    """Simulator seed 1496 (workload "sharded"): round 4 of replica A read version 3; a trainer
    shard died, the server failed the reads, and shard 1's retry re-resolved the round to
    version 1 (its host copy). The server restarted before shard 0 took its Failed note; both
    reads finished while it was down, so both ReplicateDones became announcements of a complete
    holding. The fresh server must not let shard 0 complete version 3 in round 4 as well."""
    w, regs = _split_round_world()
    first = m.Announce(regs[1], m.Holding(published=1, txn_seq=4, txn_version=1))
    assert err(w.send(first)) == "ServerRecovering", "held back until shard 0 is heard from"
    assert w.send(m.Announce(regs[0], m.Holding(published=3, txn_seq=4, txn_version=3))) == m.Ok()
    reply = w.send(first)  # both unconfirmed: the server cannot tell which one the old server took
    assert err(reply) == "VersionLost", reply
    assert w.core.nodes["a1"].state is NodeState.IDLE and w.core.nodes["a0"].state is NodeState.PUBLISHED


def _split_round_world(old: int = 3, shards: int = 2):
    """Replica A (``shards`` shards) after a restart; versions 1 (replica U) and ``old``
    (replica T) held."""
    w = World(lease_timeout_s=5.0)
    for v, rep in ((1, "U"), (old, "T")):
        for sh in range(shards):
            w.reg(f"{rep}{sh}", replica=rep, shard=sh, num_shards=shards)
            w.send(m.Publish(f"{rep}{sh}", v))
    regs = [m.Register(f"a{sh}", "pol", "A", sh, shards, LAYOUT, f"a{sh}".encode()) for sh in range(shards)]
    return w, regs


def test_a_round_known_from_announced_reads_waits_for_every_sibling_before_it_settles():
    """Simulator seed 1774 (workload "sharded"): round 6 of replica r1 lost version 2 and shard 2
    completed it at version 1 (confirmed) just before a restart. After it, shard 3 announced its
    unfinished read of 2 in round 6; the fresh server let shard 3 complete 2 and shard 1 read 2
    in round 6 before shard 2 re-announced its confirmed completion at 1: a split round. Within
    the recovery window a round known only from announcements now settles once every sibling
    is heard from: a completion and a new read in it wait (``ServerRecovering``); the confirmed
    completion then binds the round, the held completion ends ``VersionLost`` and the reads
    join version 1."""
    w, regs = _split_round_world(shards=3)
    assert w.send(m.Announce(regs[0], m.Holding(reading_version=3, txn_seq=4, txn_version=3))) == m.Ok()
    assert w.send(m.Announce(regs[2], m.Holding())) == m.Ok()
    held = w.send(m.ReplicateDone("a0", 3))
    assert err(held) == "ServerRecovering" and "siblings" in held.message
    assert w.core.nodes["a0"].state in (NodeState.WAITING, NodeState.READING), "not completed"
    read = w.send(m.Replicate("a2", "latest", seq=4))
    assert err(read) == "ServerRecovering" and "siblings" in read.message
    assert w.core.nodes["a2"].state is NodeState.IDLE, "nothing changed"
    assert w.send(m.Announce(regs[1], m.Holding(published=1, txn_seq=4, txn_version=1, confirmed=True))) == m.Ok()
    lost = w.send(m.ReplicateDone("a0", 3))
    assert err(lost) == "VersionLost" and "moved to version 1" in lost.message
    for cid in ("a0", "a2"):
        a = w.send(m.Replicate(cid, "latest", seq=4))
        assert isinstance(a, m.Assignment) and a.version == 1, (cid, a)
    # After the window (one lease) nothing waits: a round whose siblings never came moves on.
    w2, regs2 = _split_round_world(shards=3)
    assert w2.send(m.Announce(regs2[0], m.Holding(reading_version=3, txn_seq=4, txn_version=3))) == m.Ok()
    w2.tick(5.0)
    assert w2.send(m.ReplicateDone("a0", 3)) == m.Ok()


def test_a_confirmed_completion_announced_after_an_unconfirmed_conflicting_one_demotes_it():
    """Shard 1's ReplicateDone of version 1 (round 4) got Ok before the restart; shard 0's of
    version 3 met it. Shard 0 announces first, after the recovery window (within it, it would
    wait for shard 1): accepted (nothing to compare with yet). Shard 1's confirmed announcement
    then wins: shard 0 is demoted to idle (``Demoted``, its reader reassigned) and the round is
    bound to version 1, which shard 0's retry joins."""
    w, regs = _split_round_world()
    w.now = 6.0  # past the recovery window: nothing is held back, a new sharded reader may register
    assert w.send(m.Announce(regs[0], m.Holding(published=3, txn_seq=4, txn_version=3))) == m.Ok()
    assert w.core.nodes["a0"].state is NodeState.PUBLISHED
    w.reg("r", replica="R", shard=0, num_shards=2)  # reads shard 0 of version 3 from a0 (T0 drains)
    w.reg("r1", replica="R", shard=1, num_shards=2)
    w.send(m.Unpublish("T0"))
    a = w.send(m.Replicate("r", 3, seq=1))
    assert isinstance(a, m.Assignment) and a.source_id == "a0"
    w.pop("a0")
    assert w.send(m.Announce(regs[1], m.Holding(published=1, txn_seq=4, txn_version=1, confirmed=True))) == m.Ok()
    (note,) = w.pop("a0")
    assert isinstance(note, m.Demoted) and note.version == 3 and "confirmed" in note.reason
    assert w.core.nodes["a0"].state is NodeState.IDLE and w.core.nodes["a1"].state is NodeState.PUBLISHED
    r = w.core.nodes["r"]  # the demoted holder's reader lost its source, the only one left
    assert r.state is NodeState.IDLE and r.failure.code == "VersionLost" and "no holder is left" in r.failure.message
    a = w.send(m.Replicate("a0", "latest", seq=4))
    assert isinstance(a, m.Assignment) and a.version == 1


def test_an_unconfirmed_completion_waits_in_the_recovery_window_until_its_siblings_are_heard():
    """Simulator seeds 8622 and 8753: shard 0's ReplicateDone of version 3 met the restart
    (unconfirmed); shard 1's of version 1 in the same round got Ok (confirmed). Shard 0 announced
    first, was accepted, so its replicate() returned ok, and was demoted a moment later. Now it
    waits (``ServerRecovering``, not registered yet) until shard 1 is heard from, and is then
    refused: no call returns a round the server takes back, and nobody is demoted."""
    w, regs = _split_round_world()
    held = m.Announce(regs[0], m.Holding(published=3, txn_seq=4, txn_version=3, host_copies=((2, b"h"),)))
    for _ in range(2):
        reply = w.send(held)
        assert err(reply) == "ServerRecovering" and "siblings" in reply.message
    assert "a0" not in w.core.nodes and "a0#host2" not in w.core.nodes, "nothing changed yet"
    assert w.send(m.Announce(regs[1], m.Holding(published=1, txn_seq=4, txn_version=1, confirmed=True))) == m.Ok()
    assert err(w.send(held)) == "VersionLost"
    assert w.pop("a0") == [] and w.pop("a1") == [], "no Demoted"
    assert w.core.nodes["a0"].state is NodeState.IDLE and w.core.nodes["a1"].state is NodeState.PUBLISHED


def test_a_held_back_completion_counts_as_heard_and_is_taken_as_it_is_after_the_window():
    """A held-back shard counts as heard from: its sibling's fresh process may register in the
    window (no deadlock, each waiting for the other). After the window (one lease from the
    restart) a held-back completion whose siblings never came is accepted as before; confirmed
    and unsharded completions are never held back."""
    w, regs = _split_round_world()
    held = m.Announce(regs[0], m.Holding(published=3, txn_seq=4, txn_version=3))
    assert err(w.send(held)) == "ServerRecovering"
    assert w.send(regs[1]) == m.Registered(round_seq=0)
    assert w.send(held) == m.Ok() and w.core.nodes["a0"].state is NodeState.PUBLISHED
    w2, regs2 = _split_round_world()
    held2 = m.Announce(regs2[0], m.Holding(published=3, txn_seq=4, txn_version=3))
    assert err(w2.send(held2)) == "ServerRecovering"
    w2.tick(5.0)
    assert w2.core.rounds.held_back == {}, "forgotten when the window ends"
    assert w2.send(held2) == m.Ok() and w2.core.nodes["a0"].state is NodeState.PUBLISHED
    w3, regs3 = _split_round_world()
    assert w3.send(m.Announce(regs3[0], m.Holding(published=3, txn_seq=4, txn_version=3, confirmed=True))) == m.Ok()
    solo = m.Register("s", "pol", "S", 0, 2, LAYOUT, b"s")
    assert w3.send(m.Announce(solo, m.Holding(published=3))) == m.Ok(), "no round: not held back"


def test_an_unconfirmed_completion_announced_after_a_confirmed_conflicting_one_is_refused():
    w, regs = _split_round_world()
    assert w.send(m.Announce(regs[1], m.Holding(published=1, txn_seq=4, txn_version=1, confirmed=True))) == m.Ok()
    reply = w.send(m.Announce(regs[0], m.Holding(published=3, txn_seq=4, txn_version=3,
                                                 host_copies=((2, b"a0-host"),))))
    assert err(reply) == "VersionLost" and "unconfirmed" in reply.message
    node = w.core.nodes["a0"]
    assert node.state is NodeState.IDLE and w.core.nodes["a0#host2"].owner == "a0", "kept registered, its host copy too"
    assert w.pop("a1") == []
    a = w.send(m.Replicate("a0", "latest", seq=4))
    assert isinstance(a, m.Assignment) and a.version == 1


def test_unconfirmed_and_confirmed_completions_bind_rounds_as_before_without_a_conflict():
    """No sibling completed another version: an unconfirmed completion binds its round as a
    confirmed one does, and two confirmed conflicting ones (never both confirmed by one server)
    are both kept, as before."""
    w, regs = _split_round_world()
    first = m.Announce(regs[0], m.Holding(published=3, txn_seq=4, txn_version=3))
    assert err(w.send(first)) == "ServerRecovering"
    assert w.send(m.Announce(regs[1], m.Holding(published=3, txn_seq=4, txn_version=3))) == m.Ok()
    assert w.send(first) == m.Ok()
    assert w.core.nodes["a1"].state is NodeState.PUBLISHED and 3 in w.core.models["pol"].committed
    w2, regs2 = _split_round_world()
    for sh, v in ((0, 3), (1, 1)):
        h = m.Holding(published=v, txn_seq=4, txn_version=v, confirmed=True)
        assert w2.send(m.Announce(regs2[sh], h)) == m.Ok()
    assert w2.pop("a0") == [] and w2.core.nodes["a0"].state is NodeState.PUBLISHED


def test_the_handle_machine_announces_a_completion_the_server_confirmed_as_confirmed():
    """An unanswered ReplicateDone is announced unconfirmed; a published version (Ok from a
    server) confirmed; nothing published, nothing confirmed. The bounds refuse a confirmed
    holding with no version."""
    from tensorhub.core import bounds
    from tensorhub.core import handle as hm
    from tensorhub.errors import OutOfBounds

    reg = m.Register("c", "pol", "A", 0, 2, m.LayoutInfo("fp", 4, 400), b"c")
    mc = hm.HandleMachine("c", request_timeout_s=5.0, reconnects_max=1, failovers_max=1, unit_count=4)
    mc.handle(hm.Start(hm.RegisterOp(reg)), 0.0)
    mc.handle(hm.Replied(m.Registered()), 0.0)
    assert mc.holding().confirmed is False
    mc.handle(hm.Start(hm.ReplicateOp("latest", True)), 0.0)
    a = m.Assignment(version=3, source_id="t", source_endpoint=b"t", source_partial=False, start_unit=0, assign_no=1)
    mc.handle(hm.Replied(a), 0.0)
    assert mc.handle(hm.Pulled(4), 0.0) == [hm.Send(m.ReplicateDone("c", 3))]
    mc.handle(hm.Unavailable("down"), 0.0)
    (cmd,) = mc.handle(hm.TimerFired(), 0.0)
    assert cmd.request.holding == m.Holding(published=3, txn_seq=1, txn_version=3, confirmed=False)
    mc.handle(hm.Replied(m.Ok()), 0.0)
    assert mc.published == 3 and mc.holding() == m.Holding(published=3, txn_seq=1, txn_version=3, confirmed=True)
    with pytest.raises(OutOfBounds):
        bounds.check_request(m.Announce(reg, m.Holding(confirmed=True)))
    bounds.check_request(m.Announce(reg, m.Holding(published=3, confirmed=True)))
    assert m.decode_request(m.encode(m.Announce(reg, m.Holding(published=3, confirmed=True)))).holding.confirmed


def test_overdue_lists_the_clients_not_heard_from_oldest_first_without_a_scan():
    w = World()
    w.reg("a"); w.now = 0.5; w.reg("b"); w.now = 1.0; w.reg("c")
    w.now = 1.2
    w.send(m.Heartbeat("a"))
    assert w.core.overdue(2.0, 1.0) == ["b", "c"]
    assert w.core.overdue(2.0, 1.2) == ["b"]
    assert w.core.overdue(2.0, 0.5, limit=1) == ["b"]
    assert w.core.overdue(1.3, 1.0) == []


def test_query_answers_the_shard_layouts_only_when_asked():
    """A reader that has no tensors yet (verl's rollout) allocates its buffer from the layouts the
    model's first clients registered; a plain status query stays small."""
    w = World()
    other = m.LayoutInfo("fp-b", UNITS, 800, (m.TensorMeta("b", "bfloat16", (20, 20), 800),))
    w.reg("t1", replica="trainer", shard=1, num_shards=2, layout=other)
    (mv,) = w.send(m.Query("pol", layouts=True)).models
    assert (mv.num_shards, mv.layouts) == (2, (m.ShardLayout(1, other),))  # shard 0 not registered yet
    w.reg("t0", replica="trainer", shard=0, num_shards=2)
    (mv,) = w.send(m.Query("pol", layouts=True)).models
    assert mv.layouts == (m.ShardLayout(0, LAYOUT), m.ShardLayout(1, other))
    assert w.send(m.Query("pol")).models[0].layouts == ()
    assert m.decode_reply(m.encode(w.send(m.Query("pol", layouts=True)))).models[0].layouts == mv.layouts


def test_a_replicate_answered_for_good_gets_the_same_answer_again_and_starts_no_read():
    """A Replicate delivered twice (Ray may retry a call; the simulator's msg_dup): the first
    copy found no version (VersionNotFound) and its handle ended the call; a version was
    published before the second copy arrived. Taken afresh, the second started a read nobody
    followed: its source's readers stayed full, and another replica waited for it for good
    (mixed_spot seed 4730). It gets the first answer again, and changes nothing; so does an
    older call arriving late. The same for NoChange. A new call of the same round (its own
    ``call`` number: verl's rollouts call again with the step as the round) is a new request,
    and VersionLost is not final (an update asks once more within the call)."""
    core = ReferenceCore(Config())
    layout = m.LayoutInfo("fp", 4, 4 << 16, (m.TensorMeta("w", "float32", (1 << 16,), 4 << 16),))
    for cid in ("t", "r"):
        assert not isinstance(core.handle(m.Register(cid, "pol", cid, 0, 1, layout, cid.encode()), 0.0)[0], m.ErrorReply)
    first, _ = core.handle(m.Replicate("r", "latest", 3, call=2), 0.0)
    assert isinstance(first, m.ErrorReply) and first.code == "VersionNotFound"
    core.handle(m.Publish("t", 1), 0.5)
    again, effects = core.handle(m.Replicate("r", "latest", 3, call=2), 1.0)
    assert again == first and not effects
    assert core.nodes["r"].state is NodeState.IDLE and core.nodes["t"].readers == set()
    older, _ = core.handle(m.Replicate("r", "latest", 3, call=1), 1.0)  # an older call, arriving late
    assert isinstance(older, m.ErrorReply) and older.code == "InvalidState" and core.nodes["t"].readers == set()
    # The handle's next call reads, in the same round.
    a, _ = core.handle(m.Replicate("r", "latest", 3, call=3), 1.0)
    assert isinstance(a, m.Assignment) and a.source_id == "t"
    core.handle(m.ReplicateDone("r", 1), 2.0)
    noop, _ = core.handle(m.Replicate("r", "latest", 5, update=True, call=4), 2.0)
    assert isinstance(noop, m.NoChange)
    core.handle(m.Unpublish("t"), 2.5)
    core.handle(m.Publish("t", 2), 2.5)
    assert core.handle(m.Replicate("r", "latest", 5, update=True, call=4), 3.0) == (noop, [])
    assert core.nodes["r"].state is NodeState.PUBLISHED and core.nodes["r"].version == 1
    # Unnumbered requests (call 0) are taken as they come.
    w, _ = core.handle(m.Replicate("r", "latest", 6, update=True), 3.0)
    assert isinstance(w, (m.Waiting, m.Assignment, m.OffloadOrder)), w


def test_a_retried_replicate_gets_the_outcome_of_the_read_it_started_not_invalid_state():
    """The link to the server was cut: the client's Replicate arrived, its reply did not, and
    the client sent the same request (same seq) after reconnecting. The retry gets the read's
    outcome again (the assignment, or Waiting) instead of InvalidState, which would have left
    the node reading for nobody. A Replicate of a later seq ends that read first (the handle gave
    it up, its ReplicateAbort lost); one of an earlier seq is still refused."""
    core = ReferenceCore(Config())
    layout = m.LayoutInfo("fp", 4, 4 << 16, (m.TensorMeta("w", "float32", (1 << 16,), 4 << 16),))
    for cid in ("t", "r", "q"):
        assert not isinstance(core.handle(m.Register(cid, "pol", cid, 0, 1, layout, cid.encode()), 0.0)[0], m.ErrorReply)
    core.handle(m.Publish("t", 1), 0.0)
    first, _ = core.handle(m.Replicate("r", "latest", 5), 0.0)
    assert isinstance(first, m.Assignment) and first.source_id == "t"
    again, effects = core.handle(m.Replicate("r", "latest", 5), 1.0)
    assert again == first and not effects
    other, _ = core.handle(m.Replicate("r", "latest", 6), 1.0)
    assert isinstance(other, m.Assignment) and other.assign_no > first.assign_no
    older, _ = core.handle(m.Replicate("r", "latest", 4), 1.0)
    assert isinstance(older, m.ErrorReply) and older.code == "InvalidState"
    q1, _ = core.handle(m.Replicate("q", "latest", 2), 1.0)  # behind r (the pipeline)
    assert isinstance(q1, m.Assignment) and q1.source_id == "r"
    assert core.handle(m.Replicate("q", "latest", 2), 2.0)[0] == q1
    core.handle(m.Register("w", "pol", "w", 0, 1, layout, b"w"), 2.0)
    w1, _ = core.handle(m.Replicate("w", "latest", 1), 2.0)  # t and r busy, q partial at 0 units
    assert core.handle(m.Replicate("w", "latest", 1), 3.0)[0] == w1
