"""Placements at the reference core (issue 24 stage 2b, ``tensorhub/core/placements.py``): a
registration's placement is checked, interned by digest, merged into the model's schema and, at
a replica's publish, checked for coverage. Pure core, driven as tests/core/test_core.py drives
it (``ReferenceCore.handle(request, now)``); one test through the server's request path
(``LocalPort``: the gate's bounds before the core).

The model: ``q`` [8, 4], ``k`` [4, 4], ``norm`` [4], float32. The trainer holds it as 2 shards
cut by rows (FSDP-like); a replica is its two shards:

    trainer shard 0: q[0:4], k[0:2], norm[0:2]      trainer shard 1: q[4:8], k[2:4], norm[2:4]
"""

from __future__ import annotations

import zlib

import pytest

from tensorhub import placement as P
from tensorhub.config import Config
from tensorhub.core import bounds
from tensorhub.core import messages as m
from tensorhub.core.state import NodeState
from tensorhub.ports import LocalPort
from tests.core.test_core import World as CoreWorld

Q = P.GlobalTensor("q", "float32", (8, 4))
K = P.GlobalTensor("k", "float32", (4, 4))
NORM = P.GlobalTensor("norm", "float32", (4,))
SCHEMA = P.Schema.of([Q, K, NORM])
Q16 = P.GlobalTensor("q", "float32", (16, 4))


def rows(rank: int, n: int = 2, schema: P.Schema = SCHEMA) -> P.Placement:
    """What trainer shard ``rank`` of ``n`` holds: every tensor cut by rows."""
    return P.Placement.build([P.split(g, 0, rank, n) for g in schema.tensors], schema)


def layout_of(p: P.Placement) -> m.LayoutInfo:
    metas = tuple(m.TensorMeta(t.name, t.dtype, t.shape, t.nbytes) for t in p.tensors)
    fingerprint = zlib.crc32(repr([(t.name, t.dtype, t.shape) for t in metas]).encode())
    return m.LayoutInfo(f"fp-{fingerprint:08x}", 1, p.nbytes, metas)


def raw(locals_, globals_=(Q, K, NORM)) -> P.Placement:
    """A placement as another process may send it: unchecked, globals sorted by name."""
    return P.Placement(tuple(sorted(globals_, key=lambda g: g.name)), tuple(locals_))


def local(name, shape, *pieces, dtype="float32") -> P.LocalPlacement:
    return P.LocalPlacement(name, dtype, shape, tuple(pieces))


def box(*dims) -> P.Box:
    return P.Box(tuple(a for a, _ in dims), tuple(b for _, b in dims))


class World(CoreWorld):
    """test_core's world (a core, its clock, the events it delivered) with a placed Register."""

    def register(self, cid, replica, shard, placement, num_shards=2, layout=None, model="pol", layout_key=""):
        lay = layout if layout is not None else layout_of(placement) if placement is not None else None
        return self.send(m.Register(cid, model, replica, shard, num_shards, lay, cid.encode(), placement=placement,
                                    layout_key=layout_key))

    def reg(self, cid, replica, shard, placement, **kw):
        reply = self.register(cid, replica, shard, placement, **kw)
        assert isinstance(reply, m.Registered), reply
        return cid

    def trainer(self, replica="t", shards=(0, 1)):
        return [self.reg(f"{replica}/{s}", replica, s, rows(s)) for s in shards]

    def snapshot(self):
        pl = self.core.placements
        return (sorted(self.core.nodes), {d: e.nodes for d, e in pl.interned.items()},
                {k: (dict(v.uses), dict(v.schema), dict(v.shard_digest)) for k, v in pl.models.items()},
                {k: list(v.committed) for k, v in self.core.models.items()})


def refused(reply, code="LayoutMismatch", says=""):
    assert isinstance(reply, m.ErrorReply), reply
    assert reply.code == code, reply
    assert says in reply.message, reply.message
    return reply.message


# --------------------------------------------------------------------------- the default


def test_a_registration_without_a_placement_encodes_and_stores_nothing():
    w = World()
    reg = m.Register("a", "pol", "a", 0, 1, layout_of(rows(0, 1)), b"a")
    assert b"placement" not in m.encode(reg) and "placement" not in repr(reg)  # the simulator's trace too
    assert m.decode_request(m.encode(reg)).placement is None
    assert isinstance(w.send(reg), m.Registered)
    assert w.core.nodes["a"].placement == ""
    assert w.core.placements.interned == {} and w.core.placements.models == {}
    assert w.send(m.Publish("a", 1)) == m.Ok()
    assert w.core.available("pol") == [1]
    view = w.core.status().models[0]
    assert view.placements == () and b"placements" not in m.encode(view)


# --------------------------------------------------------------------------- interning


def test_equal_placements_are_interned_once_and_counted_by_their_clients():
    """Three replicas of the 2-shard trainer: two distinct placements, each used by 3 nodes, one
    copy each (every node's placement is the same object); a repeated registration is answered
    as the first."""
    w = World()
    for r in ("t", "u", "v"):
        w.trainer(r)
    pl = w.core.placements
    assert {d: e.nodes for d, e in pl.interned.items()} == {rows(0).digest(): 3, rows(1).digest(): 3}
    assert all(pl.get(w.core.nodes[f"{r}/1"].placement) is pl.interned[rows(1).digest()].placement for r in "tuv")
    assert w.core.status().models[0].placements == tuple(
        sorted((m.PlacementUse(rows(s).digest(), 3) for s in (0, 1)), key=lambda u: u.digest))
    assert isinstance(w.register("u/1", "u", 1, rows(1)), m.Registered)  # the same again: idempotent
    assert pl.interned[rows(1).digest()].nodes == 3
    assert refused(w.register("u/1", "u", 1, None, layout=layout_of(rows(1))), "InvalidState")


def test_the_interned_table_does_not_grow_with_departed_clients():
    w = World()
    sizes = []
    for wave in range(50):
        names = w.trainer(f"r{wave}")
        sizes.append(len(w.core.placements.interned))
        for cid in names:
            assert w.send(m.Leave(cid)) == m.Ok()
    assert set(sizes) == {2}
    assert w.core.placements.interned == {} and w.core.placements.models == {} and w.core.nodes == {}


# --------------------------------------------------------------------------- bad registrations

_QL = local("q", (4, 4), P.Piece("q", box((0, 4), (0, 4)), 0))
_KL = local("k", (2, 4), P.Piece("k", box((0, 2), (0, 4)), 0))
_NL = local("norm", (2,), P.Piece("norm", box((0, 2)), 0))


def _shard0(q=_QL, k=_KL, n=_NL, globals_=(Q, K, NORM)):
    return raw([q, k, n], globals_)


BAD = [
    ("a box outside its global tensor", "s/0", "s", 0,
     _shard0(q=local("q", (4, 4), P.Piece("q", box((6, 10), (0, 4)), 0))), None, "outside global tensor 'q'"),
    ("a local shape not the sum of its pieces", "s/0", "s", 0,
     _shard0(q=local("q", (5, 4), P.Piece("q", box((0, 4), (0, 4)), 0))), layout_of(rows(0)), "pieces hold 4 rows"),
    ("a dtype conversion", "s/0", "s", 0,
     _shard0(q=local("q", (4, 4), P.Piece("q", box((0, 4), (0, 4)), 0), dtype="float16")), layout_of(rows(0)),
     "a dtype conversion is not a reshard"),
    ("two pieces overlapping", "s/0", "s", 0,
     raw([local("q", (4, 4), P.Piece("q", box((0, 4), (0, 4)), 0)), local("k", (2, 4), P.Piece("q", box((2, 4), (0, 4)), 0)),
          _NL]), layout_of(rows(0)), "overlap"),
    ("global tensors not sorted (a hand-made encoding)", "s/0", "s", 0,
     P.Placement((Q, NORM, K), (_QL, _KL, _NL)), None, "sorted by name"),
    ("a piece naming no global tensor of the placement", "s/0", "s", 0,
     _shard0(globals_=(Q, NORM)), layout_of(rows(0)), "global tensor 'k' is not in the placement's schema"),
    ("a local tensor the layout names otherwise", "s/0", "s", 0,
     _shard0(q=local("qq", (4, 4), P.Piece("q", box((0, 4), (0, 4)), 0))), layout_of(rows(0)),
     "tensor #0 is q float32[4, 4] in the layout, qq float32[4, 4] in the placement"),
    ("fewer local tensors than the layout", "s/0", "s", 0, raw([_QL, _KL], (Q, K)), layout_of(rows(0)),
     "the placement has 2 local tensors, the layout 3"),
    ("a global tensor's shape disagreeing with the model's (same local shapes)", "s/1", "s", 1,
     P.Placement.build([P.split(Q16, 0, 3, 4), P.split(K, 0, 1, 2), P.split(NORM, 0, 1, 2)], [Q16, K, NORM]),
     layout_of(rows(1)), "global tensor 'q': shape [16, 4] here, [8, 4] elsewhere"),
    ("another placement of a shard in its replica's layout class", "half/1", "half", 1, rows(0), None,
     "differs from shard 1's placement"),
    ("a placed shard in a replica without placements", "plain/1", "plain", 1, rows(1), None,
     "has a placement, its replica's other shards do not"),
    ("a shard without a placement in a placed replica", "half/1", "half", 1, None, layout_of(rows(1)),
     "has no placement, its replica's other shards do"),
]


@pytest.mark.parametrize("what,cid,replica,shard,placement,layout,says", BAD, ids=[b[0] for b in BAD])
def test_a_bad_registration_is_refused_typed_and_changes_nothing(what, cid, replica, shard, placement, layout, says):
    """Each bad registration, sent as another process sends it (encoded, decoded at the server:
    ``Placement.check`` runs there), meets a model with the trainer registered, a replica
    without placements (``plain``) and a placed one with shard 0 only (``half``)."""
    w = World()
    w.trainer("t")
    w.reg("plain/0", "plain", 0, None, layout=layout_of(rows(0)))
    w.reg("half/0", "half", 0, rows(0))
    before = w.snapshot()
    lay = layout if layout is not None else layout_of(placement)
    req = m.decode_request(m.encode(m.Register(cid, "pol", replica, shard, 2, lay, b"x", placement=placement)))
    message = refused(w.send(req), says=says)
    assert f"pol replica {replica} shard {shard}" in message
    assert w.snapshot() == before
    assert cid not in w.core.nodes


# --------------------------------------------------------------------------- the schema


def test_the_schema_is_the_union_of_the_placements_and_shrinks_as_they_go():
    """Shard 0 names q and norm, shard 1 q and k: the schema is all three. Once the last
    shard-1 node leaves, k is no longer the model's: a shard 1 with another k (of the same local
    shape: the shard's layout stays the model's) is accepted."""
    w = World()
    s0 = P.Placement.build([P.split(Q, 0, 0, 2), P.whole(NORM)], SCHEMA)
    s1 = P.Placement.build([P.split(Q, 0, 1, 2), P.whole(K)], SCHEMA)
    w.reg("a/0", "a", 0, s0)
    w.reg("a/1", "a", 1, s1)
    assert w.core.placements.models["pol"].schema == {"q": Q, "norm": NORM, "k": K}
    k8 = P.GlobalTensor("k", "float32", (8, 4))  # held as rows 0:4: the same local shape as k
    s1_k8 = P.Placement.build([P.split(Q, 0, 1, 2), P.split(k8, 0, 0, 2)], [Q, k8])
    assert layout_of(s1_k8) == layout_of(s1)
    refused(w.register("b/1", "b", 1, s1_k8), says="global tensor 'k': shape [8, 4] here, [4, 4] elsewhere")
    assert w.send(m.Leave("a/1")) == m.Ok()
    assert w.core.placements.models["pol"].schema == {"q": Q, "norm": NORM}
    w.reg("b/1", "b", 1, s1_k8)
    assert w.core.placements.models["pol"].schema == {"q": Q, "norm": NORM, "k": k8}


def test_a_global_tensor_of_another_dtype_on_another_shard_is_refused():
    """Shard 0 names norm float32; the first shard 1 (no layout known for it yet) names it
    float16: refused naming the tensor, the registering client not added, the schema as it was."""
    w = World()
    w.reg("a/0", "a", 0, P.Placement.build([P.split(Q, 0, 0, 2), P.whole(NORM)], SCHEMA))
    before = w.snapshot()
    n16 = P.GlobalTensor("norm", "float16", (4,))
    s1 = P.Placement.build([P.split(Q, 0, 1, 2), P.whole(n16)], [Q, n16])
    message = refused(w.register("a/1", "a", 1, s1), says="global tensor 'norm': dtype float16 here, float32 elsewhere")
    assert message.startswith("pol replica a shard 1: ")
    assert w.snapshot() == before and "a/1" not in w.core.nodes


# --------------------------------------------------------------------------- coverage at publish


def test_a_replica_whose_shards_leave_a_tensor_uncovered_is_refused_at_publish():
    """Shard 1 holds what shard 0 holds (q[0:4], k[0:2], norm[0:2] twice): q[4:8], k[2:4] and
    norm[2:4] are nobody's. Shard 0 publishes before shard 1 registers (not checked yet: its
    siblings are unknown); shard 1's publish, the one that would commit, is refused naming the
    missing ranges, and the version is not committed. Once all shards are registered, every
    publish of an uncommitted version is checked."""
    w = World()
    twin = P.Placement.build([P.split(g, 0, 0, 2) for g in SCHEMA.tensors], SCHEMA)
    twin_1 = P.Placement(twin.globals, twin.tensors)  # shard 1's placement: the same boxes
    w.reg("x/0", "x", 0, twin)
    assert w.send(m.Publish("x/0", 1)) == m.Ok()
    w.reg("x/1", "x", 1, twin_1)
    before = w.snapshot()
    message = refused(w.send(m.Publish("x/1", 1)), says="pol replica x: the replica's shards leave global tensors uncovered")
    assert "q [4:8, 0:4]" in message and "k [2:4, 0:4]" in message and "norm [2:4]" in message
    assert w.snapshot() == before and w.core.available("pol") == []
    assert w.core.nodes["x/1"].state is NodeState.IDLE
    assert w.send(m.Unpublish("x/0")) == m.UnpublishDone(version=1)
    refused(w.send(m.Publish("x/0", 2)), says="uncovered")


def test_a_covering_replica_publishes_and_commits_and_one_without_placements_as_today():
    w = World()
    w.trainer("t")
    assert w.send(m.Publish("t/0", 1)) == m.Ok()
    assert w.core.available("pol") == []
    assert w.send(m.Publish("t/1", 1)) == m.Ok()
    assert w.core.available("pol") == [1]
    assert "t" in w.core.placements.models["pol"].covered
    w.reg("plain/0", "plain", 0, None, layout=layout_of(rows(0)))
    w.reg("plain/1", "plain", 1, None, layout=layout_of(rows(1)))
    assert w.send(m.Publish("plain/0", 2)) == m.Ok() and w.send(m.Publish("plain/1", 2)) == m.Ok()
    assert w.core.available("pol") == [1, 2]


# --------------------------------------------------------------------------- the server's request path


def test_a_too_big_placement_is_refused_by_bounds_before_the_core_sees_it(monkeypatch):
    """Through ``LocalPort`` (the gate the actor uses): too many pieces of one global tensor, a
    box of too many dims, an encoding over its limit -- ``OutOfBounds``, and the core's placement
    check never runs; nothing is registered."""
    port = LocalPort(Config())
    seen = []
    real = port.core.placements.check
    monkeypatch.setattr(port.core.placements, "check", lambda req, cls: (seen.append(req.client_id), real(req, cls)))
    many = P.Placement.build([P.whole(Q, name=f"q{i}") for i in range(bounds.PIECES_PER_GLOBAL_MAX + 1)], SCHEMA)
    reply = port.call(m.Register("big", "pol", "big", 0, 1, layout_of(many), b"big", placement=many))
    refused(reply, "OutOfBounds", f"more than {bounds.PIECES_PER_GLOBAL_MAX} pieces of global tensor 'q'")
    deep = raw([local("q", (8, 4), P.Piece("q", P.Box((0,) * 17, (1,) * 17), 0))], (Q,))
    reply = port.call(m.Register("deep", "pol", "deep", 0, 1, layout_of(rows(0, 1, P.Schema.of([Q]))), b"d",
                                 placement=deep))
    refused(reply, "OutOfBounds", "at most 16 dims")
    monkeypatch.setattr(bounds, "PLACEMENT_BYTES_MAX", 64)
    one = rows(0, 1)
    refused(port.call(m.Register("wide", "pol", "wide", 0, 1, layout_of(one), b"w", placement=one)),
            "OutOfBounds", "bytes encoded is more than 64")
    assert seen == [] and port.core.nodes == {} and port.core.placements.interned == {}
    monkeypatch.setattr(bounds, "PLACEMENT_BYTES_MAX", 16 << 20)
    assert isinstance(port.call(m.Register("ok", "pol", "ok", 0, 1, layout_of(one), b"o", placement=one)),
                      m.Registered)
    assert seen == ["ok"] and port.core.nodes["ok"].placement == one.digest()


def test_tensorhub_status_shows_each_models_distinct_placements():
    """``tensorhub status`` (its rows and its panel): each distinct placement's digest and the
    clients using it; nothing for a model without placements."""
    from rich.console import Console

    from tensorhub import status

    w = World()
    w.trainer("t")
    w.trainer("u")
    w.reg("x", "x", 0, None, num_shards=1, layout=layout_of(rows(0, 1)), model="plain")
    rows_ = {mv["model"]: mv for mv in status._model_rows(w.core.status())}
    assert rows_["plain"]["placements"] == []
    assert rows_["pol"]["placements"] == sorted(
        ({"digest": rows(s).digest(), "nodes": 2} for s in (0, 1)), key=lambda p: p["digest"])
    console = Console(width=200, record=True)
    console.print(status.render({"models": list(rows_.values())}))
    text = console.export_text()
    assert f"placements {rows_['pol']['placements'][0]['digest'][:12]} x2" in text
    assert text.count("placements") == 1
