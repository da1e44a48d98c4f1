"""No-op updates answered locally: the rules of core/views.py (server) and core/handle_view.py
(handle), in process.

    trainer publishes v -> server pushes Newest(v) -> held pulse answered -> handle: update("latest")
    answered without a call while what it knows is at most noop_staleness_s old

and smart skips answered locally (the pushes carry the skip of the handle's datacenter; below).
"""

from __future__ import annotations

import pytest

from tensorhub.config import Config
from tensorhub.core import bounds
from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.core.reference import ReferenceCore
from tensorhub.errors import OutOfBounds
from tensorhub.server.requests import Mailboxes, apply_request

from tests.core.test_core import LAYOUT

CFG = Config(noop_staleness_s=10.0)


def _machine(num_shards: int = 1, version: int = 3, cid: str = "c") -> hm.HandleMachine:
    mc = hm.HandleMachine(cid, request_timeout_s=5.0, reconnects_max=1, failovers_max=1, unit_count=4,
                          noop_staleness_s=10.0)
    mc.register_msg = m.Register(cid, "pol", "r", 0, num_shards, LAYOUT)
    mc.phase, mc.published = hm.Phase.PUBLISHED, version
    mc.region_version, mc.region_progress = version, 4
    return mc


def _viewed(newest, number=1, as_of=0.0, view_s=10.0) -> hm.Viewed:
    return hm.Viewed(newest=newest, number=number, as_of=as_of, view_s=view_s)


def _update(mc, now, spec="latest", update=True):
    return mc.handle(hm.Start(hm.ReplicateOp(spec, update)), now)


def test_a_fresh_view_of_the_published_version_answers_update_latest_without_a_call():
    mc = _machine()
    mc.handle(_viewed(3, as_of=100.0), 100.0)
    cmds = _update(mc, 105.0)
    assert cmds == [hm.Done(hm.Outcome(action="noop", version=3, local=True))]
    assert mc.seq == 1 and mc.state.round == (1, 3), "a local answer counts its round"
    assert mc.op is None


def test_a_view_older_than_the_bound_asks_the_server():
    mc = _machine()
    mc.handle(_viewed(3, as_of=100.0), 100.0)
    cmds = _update(mc, 110.0)  # as_of + noop_staleness_s: no longer strictly before the end
    assert isinstance(cmds[-1], hm.Send) and isinstance(cmds[-1].request, m.Replicate)


def test_the_server_bound_caps_the_handles_own():
    mc = _machine()
    mc.handle(_viewed(3, as_of=100.0, view_s=2.0), 100.0)
    assert isinstance(_update(mc, 102.5)[-1], hm.Send)


def test_a_newer_version_known_another_spec_replicate_or_a_shard_ask_the_server():
    mc = _machine()
    mc.handle(_viewed(4, as_of=100.0), 100.0)
    assert isinstance(_update(mc, 101.0)[-1], hm.Send), "a newer version is known"
    for spec, update in (("latest-1", True), (3, True)):
        mc = _machine()
        mc.handle(_viewed(3, as_of=100.0), 100.0)
        assert isinstance(_update(mc, 101.0, spec, update)[-1], hm.Send), spec
    sharded = _machine(num_shards=2)
    sharded.handle(_viewed(3, as_of=100.0), 100.0)
    assert isinstance(_update(sharded, 101.0)[-1], hm.Send), "a shard's round is the server's to resolve"


def test_an_answer_older_than_one_taken_brings_no_older_news():
    mc = _machine(version=3)
    mc.handle(_viewed(4, number=9, as_of=100.0), 100.0)
    mc.handle(_viewed(3, number=7, as_of=101.0), 101.0)  # crossed on the way: older news
    assert mc.view.newest == 4
    assert isinstance(_update(mc, 101.5)[-1], hm.Send)


def test_viewed_reads_the_last_newest_and_the_hold_of_a_pulse_answer():
    reply = m.PulseReply(notes={"c": [m.Newest(version=2), m.DropHostCopy(version=1), m.Newest(version=3)]},
                         acks={"c": 12}, held_s=4.0, view_s=10.0)
    assert hm.viewed(reply, "c", sent_at=50.0) == hm.Viewed(newest=3, number=12, as_of=54.0, view_s=10.0)
    assert hm.viewed(m.PulseReply(unknown=("c",)), "c", 50.0) is None, "an unknown handle learns nothing"


# ---------------------------------------------------------------------------- the server's side


class Server:
    def __init__(self, cfg: Config = CFG) -> None:
        self.core, self.mail, self.now = ReferenceCore(cfg), Mailboxes(seq_base=0), 0.0

    def call(self, req):
        return apply_request(self.core, self.mail, req, self.now)[0]

    def reg(self, cid, replica=None, shard=0, num_shards=1, dc=""):
        assert isinstance(self.call(m.Register(cid, "pol", replica or cid, shard, num_shards, LAYOUT, cid.encode(), dc)),
                          m.Registered)

    def pulse(self, cid) -> m.PulseReply:
        return self.call(m.Pulse(beats=(m.Beat(cid, acked=0),)))


def _newest(reply: m.PulseReply, cid: str):
    return [e.version for e in reply.notes.get(cid, ()) if isinstance(e, m.Newest)]


def test_a_commit_is_pushed_to_every_handle_of_the_model_and_a_newcomer_is_told():
    s = Server()
    s.reg("t")
    s.reg("r")
    s.now = 40.0  # past the recovery window a fresh server starts with
    assert s.call(m.Publish("t", 1)) == m.Ok()
    assert _newest(s.pulse("r"), "r") == [1] and _newest(s.pulse("t"), "t") == [1]
    s.reg("late")
    assert _newest(s.pulse("late"), "late") == [1]
    assert s.call(m.Publish("t", 1)) == m.Ok()  # nothing changed: nothing pushed
    assert _newest(s.pulse("r"), "r") == [1], "still unacknowledged: the same event, not a second one"


def test_a_withdrawn_newest_is_pushed_too():
    s = Server()
    s.reg("t")
    s.reg("r")
    s.now = 40.0
    s.call(m.Publish("t", 1))
    s.call(m.Pulse(beats=(m.Beat("r", acked=10**9),)))  # r took it
    s.call(m.Leave("t", drop_last_copy=True))
    assert _newest(s.pulse("r"), "r") == [-1]


def test_pulse_answers_serve_local_answers_for_the_servers_bound_and_not_while_it_recovers():
    s = Server()
    s.reg("r")
    s.now = 40.0
    assert s.pulse("r").view_s == CFG.noop_staleness_s
    s.core.recovery.until = 50.0  # as after a restart: holders are still re-announcing
    assert s.pulse("r").view_s == 0.0
    off = Server(Config(noop_staleness_s=0.0))
    off.reg("r")
    off.now = 40.0
    assert off.pulse("r").view_s == 0.0


def test_pulses_are_held_at_most_the_bound_less_two_intervals():
    assert Config(noop_staleness_s=10.0, pulse_hold_s=30.0).pulse_hold_max_s == 8.0
    assert Config(noop_staleness_s=0.0, pulse_hold_s=30.0).pulse_hold_max_s == 30.0
    assert Config(noop_staleness_s=20.0, pulse_hold_s=3.0).pulse_hold_max_s == 3.0


def test_a_bound_under_two_intervals_holds_no_pulse():
    assert Config(noop_staleness_s=1.5, heartbeat_interval_s=1.0).pulse_hold_max_s == 0.0


# ---------------------------------------------------------------------------- smart skips answered locally
#
#     dc a: trainer t publishes 2 ;  dc b: b0 holds 1, b1 seeds 2 across  ->  the server pushes
#     Newest(2, in_flight=2, ready=1) to dc b  ->  b0: update("latest") skips 2, no call  ->
#     b1's seed lands  ->  Newest(2, -1, -1) to dc b  ->  b0 asks, and the server assigns 2


SKIPPING = Config(noop_staleness_s=10.0, versions_retained=3, smart_skipping=True, offload_seeding=False,
                  prefetch_in_datacenter=False)


def _skip_world() -> Server:
    s = Server(SKIPPING)
    for cid, dc in (("t", "a"), ("b0", "b"), ("b1", "b")):
        s.reg(cid, dc=dc)
    s.now = 40.0  # past the recovery window a fresh server starts with
    s.call(m.Publish("t", 1))
    for b in ("b0", "b1"):
        s.call(m.Replicate(b, 1)); s.call(m.ReplicateDone(b, 1))
    s.call(m.Unpublish("t")); s.call(m.Publish("t", 2))
    assert s.call(m.Replicate("b1", "latest", update=True, seq=1)).version == 2  # the seed of dc b, in flight
    return s


def _last_newest(reply: m.PulseReply, cid: str) -> m.Newest:
    return [e for e in reply.notes[cid] if isinstance(e, m.Newest)][-1]


def _told(mc, s: Server, cid: str) -> None:
    mc.handle(hm.viewed(s.pulse(cid), cid, sent_at=s.now), s.now)


def test_a_seed_in_flight_is_pushed_to_its_datacenter_and_a_noop_is_answered_locally_as_the_servers_skip():
    s = _skip_world()
    assert _last_newest(s.pulse("b0"), "b0") == m.Newest(version=2, in_flight=2, ready=1)
    assert _last_newest(s.pulse("t"), "t") == m.Newest(version=2), "dc a seeds nothing: no skip there"
    mc = _machine(version=1, cid="b0")
    _told(mc, s, "b0")
    cmds = _update(mc, s.now + 1.0)
    assert cmds == [hm.Done(hm.Outcome(action="noop", version=1, in_flight=2, local=True))], "no call"
    assert mc.state.round == (1, 1)
    assert s.call(m.Replicate("b0", "latest", update=True, seq=1)) == m.NoChange(version=1, in_flight=2), \
        "the server answers the same"


def test_the_seed_landing_is_pushed_and_the_next_noop_asks_the_server_which_assigns_the_read():
    s = _skip_world()
    mc = _machine(version=1, cid="b0")
    _told(mc, s, "b0")
    assert s.call(m.ReplicateDone("b1", 2)) == m.Ok()  # the seed landed in dc b
    assert _last_newest(s.pulse("b0"), "b0") == m.Newest(version=2)
    _told(mc, s, "b0")
    cmds = _update(mc, s.now + 1.0)
    assert isinstance(cmds[-1], hm.Send) and isinstance(cmds[-1].request, m.Replicate)
    # b0 holds the last non-spot copy of 1: it offloads it, then reads 2 (inside dc b now).
    assert s.call(m.Replicate("b0", "latest", update=True, seq=1)) == m.OffloadOrder(version=1)
    assert s.core.nodes["b0"].pending_read == (2, 0)


def _skip(in_flight=2, ready=1, newest=2, number=1, as_of=100.0, view_s=10.0) -> hm.Viewed:
    return hm.Viewed(newest=newest, number=number, as_of=as_of, view_s=view_s, in_flight=in_flight, ready=ready)


def test_a_local_skip_is_answered_only_while_fresh():
    mc = _machine(version=1)
    mc.handle(_skip(as_of=100.0), 100.0)
    assert _update(mc, 109.9) == [hm.Done(hm.Outcome(action="noop", version=1, in_flight=2, local=True))]
    mc = _machine(version=1)
    mc.handle(_skip(as_of=100.0), 100.0)
    assert isinstance(_update(mc, 110.0)[-1], hm.Send), "stale: ask"
    mc = _machine(version=1)
    mc.handle(_skip(as_of=100.0, view_s=0.0), 100.0)
    assert isinstance(_update(mc, 100.5)[-1], hm.Send), "a server that grants nothing"


def test_skip_news_out_of_order_never_makes_the_handle_answer_an_older_version():
    """The newer answer (number 9) says 2 is complete in the datacenter now (3 in flight); the
    older one (number 7), arriving after it, still says 1: not taken, so a handle at 1 asks."""
    mc = _machine(version=1)
    mc.handle(_skip(in_flight=3, ready=2, newest=3, number=9, as_of=100.0), 100.0)
    mc.handle(_skip(in_flight=2, ready=1, newest=2, number=7, as_of=101.0), 101.0)
    assert (mc.view.newest, mc.view.in_flight, mc.view.ready) == (3, 3, 2)
    assert isinstance(_update(mc, 101.5)[-1], hm.Send)
    landed = _machine(version=1)
    landed.handle(_skip(in_flight=-1, ready=-1, newest=2, number=9, as_of=100.0), 100.0)
    landed.handle(_skip(in_flight=2, ready=1, newest=2, number=7, as_of=101.0), 101.0)
    assert isinstance(_update(landed, 101.5)[-1], hm.Send), "the landing is newer news than the skip"


def test_a_skip_is_answered_only_by_a_handle_publishing_its_ready_version_and_never_by_a_shard():
    for published in (0, 2):  # older than the version readable here; the one in flight (newest: rule 3)
        mc = _machine(version=published)
        mc.handle(_skip(in_flight=3, ready=1, newest=3), 100.0)
        assert isinstance(_update(mc, 101.0)[-1], hm.Send), published
    sharded = _machine(num_shards=2, version=1)
    sharded.handle(_skip(), 100.0)
    assert isinstance(_update(sharded, 101.0)[-1], hm.Send), "a shard's round is the server's to resolve"
    other = _machine(version=1)
    other.handle(_skip(), 100.0)
    assert isinstance(_update(other, 101.0, spec="latest-1")[-1], hm.Send)


@pytest.mark.parametrize("news, ok", [
    (m.Newest(version=2), True),
    (m.Newest(version=-1), True),
    (m.Newest(version=2, in_flight=2, ready=1), True),
    (m.Newest(version=1, in_flight=3, ready=0), True),
    (m.Newest(version=3, in_flight=2, ready=1), False),  # a newer version than the one in flight
    (m.Newest(version=2, in_flight=2, ready=2), False),  # ready not older than in flight
    (m.Newest(version=2, in_flight=2, ready=-1), False),  # a skip to nothing
    (m.Newest(version=2, in_flight=-1, ready=1), False),
    (m.Newest(version=2, in_flight=2**53, ready=1), False),
])
def test_newest_news_out_of_bounds_is_no_news(news, ok):
    reply = m.PulseReply(notes={"c": [news]}, acks={"c": 3}, view_s=10.0)
    seen = hm.viewed(reply, "c", sent_at=0.0)
    if ok:
        bounds.check_newest(news)
        assert (seen.newest, seen.in_flight, seen.ready) == (news.version, news.in_flight, news.ready)
    else:
        with pytest.raises(OutOfBounds):
            bounds.check_newest(news)
        assert (seen.newest, seen.in_flight, seen.ready) == (None, -1, -1)
    assert m.decode_reply(m.encode(news)) == news


def test_shards_of_a_sharded_model_are_told_no_skip():
    """dc a: trainer t (2 shards) ; dc b: b0 holds 1, b1 seeds 2. The server would skip for b0
    (its shards ask it), but pushes b0 no skip: a shard never answers locally."""
    s = Server(SKIPPING)
    for rep, dc in (("t", "a"), ("b0", "b"), ("b1", "b")):
        for sh in (0, 1):
            s.reg(f"{rep}{sh}", replica=rep, shard=sh, num_shards=2, dc=dc)
    s.now = 40.0
    for sh in (0, 1):
        s.call(m.Publish(f"t{sh}", 1))
    for rep in ("b0", "b1"):
        for sh in (0, 1):
            s.call(m.Replicate(f"{rep}{sh}", 1, seq=1)); s.call(m.ReplicateDone(f"{rep}{sh}", 1))
    for sh in (0, 1):
        s.call(m.Unpublish(f"t{sh}")); s.call(m.Publish(f"t{sh}", 2))
    for sh in (0, 1):
        assert s.call(m.Replicate(f"b1{sh}", "latest", update=True, seq=2)).version == 2
    assert _last_newest(s.pulse("b00"), "b00") == m.Newest(version=2)
    assert s.call(m.Replicate("b00", "latest", update=True, seq=2)) == m.NoChange(version=1, in_flight=2)
