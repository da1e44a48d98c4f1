"""Process-level liveness (:mod:`tensorhub.handle.pulse`): one server call per process per heartbeat
interval, whatever the number of handles in it; background events ride on its reply."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import msgspec
import pytest

import tensorhub
from tensorhub import errors
from tensorhub.handle import pulse
from tensorhub.core import messages as m
from tensorhub.ports import LocalPort
from tensorhub.testing import inproc, workload


def _unheld(reply: m.PulseReply) -> m.PulseReply:
    """``reply`` without how long it was held (the hold's length is the clock's)."""
    return msgspec.structs.replace(reply, held_s=0.0)


CFG = inproc.CONFIG  # heartbeat_interval_s=0.2


class _Counting(LocalPort):
    def __init__(self, config):
        super().__init__(config)
        self.sent: list[m.Request] = []
        self.note_polls = 0

    def call(self, request, wait_s=0.0):
        self.sent.append(request)
        return super().call(request, wait_s)

    def notes(self, client_id):
        self.note_polls += 1
        return super().notes(client_id)


def test_handles_of_one_process_share_one_pulse_per_interval():
    port = _Counting(CFG.replace(pulse_hold_s=0.0))
    hubs = [inproc.open_hub(port, replica=f"r{i}")[0] for i in range(4)]
    p = pulse._pulses[port.pulse_key()]
    assert set(x.client_id for x in p.members()) == {h.client_id for h in hubs}
    port.sent.clear()
    port.note_polls = 0
    time.sleep(1.1)
    sent = list(port.sent)
    assert {type(r).__name__ for r in sent} == {"Pulse"}, "no per-handle heartbeat or progress call"
    assert 3 <= len(sent) <= 7, len(sent)  # ~1.1 s / 0.2 s
    assert all({b.client_id for b in r.beats} == {h.client_id for h in hubs} for r in sent)
    assert port.note_polls == 0, "events come with the pulse's reply"
    for h in hubs:
        h.close(drop_last_copy=True)
    assert port.pulse_key() not in pulse._pulses, "the pulse ends with its last handle"


def test_a_pulse_carries_read_progress_and_brings_background_events():
    """A reader's beat carries its verified units; an event the server queues for a handle (a
    host copy to drop, here) reaches it through the pulse, with no notes poll."""
    port = _Counting(CFG.replace(host_copy_ahead=False, host_pool_refill_delay_s=60.0))
    cfg = port.config
    t, tt = inproc.open_hub(port, config=cfg, replica="t")
    r, _ = inproc.open_hub(port, config=cfg, replica="r")
    inproc.publish(t, tt, 1)
    half, go = inproc.hold_half_way(r)
    done = threading.Event()
    threading.Thread(target=lambda: (r.replicate(1), done.set()), daemon=True).start()
    assert half.wait(10)
    port.sent.clear()
    time.sleep(0.5)
    beats = [b for req in port.sent if isinstance(req, m.Pulse) for b in req.beats if b.client_id == r.client_id]
    progress = [b.reading_units for b in beats if b.reading_units >= 0]
    assert len(progress) >= 2 and all(u > 0 for u in progress), beats  # ~0.5 s / 0.2 s, unheld
    go.set()
    assert done.wait(10)
    # r holds the only copy of 1 once t moves on: r offloads; when 1 falls out of retention the
    # server tells r to drop its host copy -- through the pulse.
    inproc.publish(t, tt, 2)
    r.update("latest")
    assert list(r.host_copies.by_version) == [1]
    polls = port.note_polls
    inproc.publish(t, tt, 3)
    deadline = time.monotonic() + 5
    while r.host_copies.by_version and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not r.host_copies.by_version and port.note_polls == polls
    r.close(drop_last_copy=True); t.close(drop_last_copy=True)


def test_an_idle_process_pulse_is_held_and_a_new_handle_of_it_joins_at_once():
    """With ``pulse_hold_s`` the server (here the in-process one, with the actor's rules) holds
    an idle process's pulse: four handles cost one call over several intervals, and stay alive
    past their lease while held; a fifth handle registering releases it, so the next pulse,
    at once, carries all five."""
    cfg = CFG.replace(pulse_hold_s=30.0, lease_timeout_s=1.0)
    port = _Counting(cfg)
    hubs = [inproc.open_hub(port, config=cfg, replica=f"r{i}")[0] for i in range(4)]
    time.sleep(0.5)  # the registrations' releases are over: one pulse of all four, held
    port.sent.clear()
    time.sleep(1.5)
    assert [type(r).__name__ for r in port.sent] == [], port.sent
    assert port.holds.attended() and set(port.holds.attended()) == {h.client_id for h in hubs}
    port.tick()
    assert all(h.client_id in port.core.nodes for h in hubs), "held past their 1 s lease: alive"
    fifth = inproc.open_hub(port, config=cfg, replica="r4")[0]
    deadline = time.monotonic() + 2.0
    while len(port.holds.attended()) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert set(port.holds.attended()) == {h.client_id for h in hubs + [fifth]}
    for h in hubs + [fifth]:
        h.close(drop_last_copy=True)
    assert not port.holds.attended()


def test_a_handle_that_stops_pulsing_is_declared_dead_within_the_lease():
    cfg = CFG.replace(lease_timeout_s=1.5)
    port = LocalPort(cfg)
    a, _ = inproc.open_hub(port, config=cfg, replica="a")
    b, _ = inproc.open_hub(port, config=cfg, replica="b")
    pulse.leave(b)  # as if b's process hung: nothing more from it
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:
        port.tick()
        if b.client_id not in port.core.nodes:
            break
        time.sleep(0.05)
    assert b.client_id not in port.core.nodes and time.monotonic() - t0 < cfg.lease_timeout_s + 1.0
    assert a.client_id in port.core.nodes, "the handle that pulses lives on"
    a.close(drop_last_copy=True)


@pytest.mark.ray
@pytest.mark.parametrize("hold_s", [0.0, 30.0])
def test_one_process_with_three_handles_costs_one_call_per_interval_and_dies_whole(ray_cluster, model_name, hold_s):
    """Through Ray: an actor hosting three handles sends one Pulse per interval (no heartbeat,
    progress or notes calls) when the server does not hold pulses, and one per hold when it
    does (``pulse_hold_s``: the idle process's pulse waits at the server, its handles count as
    heard from past their lease); killing the process removes all three from the server's
    table within a second or two (Ray pushes the worker's death; with a held pulse no silence
    could have told), never at the end of the lease."""
    from tensorhub.server.find import find_server
    from tensorhub.config import Config
    from tensorhub.testing.replica import spawn_many

    ray = ray_cluster
    spec = workload.small_spec(1 << 20, big=1, tiny=4)
    cfg = dict(heartbeat_interval_s=0.25, lease_timeout_s=2.0 if hold_s else 20.0, liveness_check_s=0.5,
               pulse_hold_s=hold_s, server_name=f"tensorhub-pulse-{uuid.uuid4().hex[:6]}")
    (a,) = spawn_many(model_name, spec, ["a"], config=cfg)

    def two_more(self):
        hubs = []
        for name in ("a2", "a3"):
            h = tensorhub.open(self.hub.model, replica=name, config=Config(**cfg))
            h.register(workload.allocate(spec))
            hubs.append(h)
        self._more = hubs
        return os.getpid()

    pid = ray.get(a.__ray_call__.remote(two_more))
    server = find_server(Config(**cfg), model_name)

    def holders() -> list:
        st = m.decode_reply(ray.get(server.status.remote(model_name)))
        return [h for mv in st.models for h in mv.holders]

    assert len(holders()) == 3
    time.sleep(0.6)  # the registrations' releases are over: the pulse carries all three
    c0 = ray.get(server.counts.remote())
    time.sleep(3.0)
    c1 = ray.get(server.counts.remote())
    pulses = c1.get("Pulse", 0) - c0.get("Pulse", 0)
    if hold_s:
        assert pulses == 0 and c1["held"] == 3, (c0, c1)  # one pulse, held, carrying all three
        assert len(holders()) == 3, "held past their 2 s lease, still alive"
    else:
        assert 8 <= pulses <= 15, (c0, c1)  # 3 s / 0.25 s: one process, one pulse per interval
    for kind in ("Heartbeat", "Progress", "notes"):
        assert c1.get(kind, 0) == c0.get(kind, 0), (kind, c0, c1)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while holders() and time.monotonic() - t0 < 15:
        time.sleep(0.1)
    took = time.monotonic() - t0
    assert not holders(), "a dead process takes all its handles with it"
    assert took < 3.0, f"found by Ray's liveness in {took:.1f} s, not by silence or the lease"
    if hold_s:
        assert ray.get(server.counts.remote())["pushed_deaths"] - c1["pushed_deaths"] == 3


def _reg(cid: str, dc: str = "a", process: m.ProcessId = m.ProcessId(), model: str = "pol") -> m.Register:
    layout = m.LayoutInfo("fp", 4, 4 << 16, (m.TensorMeta("w", "float32", (1 << 16,), 4 << 16),))
    return m.Register(cid, model, cid, 0, 1, layout, cid.encode(), datacenter=dc, process=process)


def test_held_pulses_are_released_by_their_process_and_answered_by_events():
    """The hold rules (:class:`tensorhub.server.requests.PulseHolds`), as every server applies them: a
    held process's handles count as heard from; a handle leaving, a registration from its
    process and a reader's report against one of its handles end the hold at once (the probe
    then needs a fresh pulse), a handle's read does not; a background event answers it with
    that event; a handle the server forgot while held is answered unknown."""
    from tensorhub.core.reference import ReferenceCore
    from tensorhub.server.requests import Mailboxes, PulseHolds, holdable

    core, mail, holds = ReferenceCore(CFG), Mailboxes(), PulseHolds()
    p1, p2 = m.ProcessId(worker_id="w1", pid=11), m.ProcessId(worker_id="w2", pid=12)
    for req in (_reg("t", process=p2), _reg("a", process=p1), _reg("b", process=p1)):
        assert not isinstance(core.handle(req, 0.0)[0], m.ErrorReply)
    pulse_ab = m.Pulse(beats=(m.Beat("a"), m.Beat("b")))
    assert holdable(pulse_ab, m.PulseReply(), 60.0, 30.0) == 30.0
    assert not holdable(pulse_ab, m.PulseReply(notes={"a": [m.SeedAhead(1)]}), 60.0, 30.0)
    assert not holdable(m.Pulse(beats=(m.Beat("a", 3),)), m.PulseReply(), 60.0, 30.0), "a reader's pulse carries progress"
    assert not holdable(pulse_ab, m.PulseReply(), 0.0, 30.0) and not holdable(pulse_ab, m.PulseReply(), 60.0, 0.0)

    h = holds.start(pulse_ab, core, deadline=30.0, now=0.0)
    assert sorted(holds.attended()) == ["a", "b"] and h.process == p1
    core.touch(holds.attended(), 25.0)
    assert core.nodes["a"].last_seen == 25.0 and core.nodes["t"].last_seen == 0.0
    assert holds.releases(m.Heartbeat("t")) == [], "another process's request releases nothing"
    assert holds.releases(m.Replicate("a", "latest", 1)) == [], "a read's progress goes by other pulses"
    assert holds.releases(m.Leave("b")) == [h] and h.over and not holds.attended()

    h = holds.start(pulse_ab, core, deadline=30.0, now=0.0)
    assert holds.releases(_reg("c", process=p1)) == [h], "a new handle of the process: pulse again now"
    h = holds.start(pulse_ab, core, deadline=30.0, now=0.0)
    assert holds.releases(m.SourceFailed("t", "b", 0)) == [h], "the probe: prove the process alive"
    assert holds.releases(m.SourceFailed("t", "b", 0)) == [], "a released hold is over"

    h = holds.start(pulse_ab, core, deadline=30.0, now=0.0)
    assert holds.held(["a"], mail) == [], "no background event for it: still held"
    mail.route([m.Deliver("b", m.SeedAhead(version=4))])
    assert holds.held(["b"], mail) == [h]
    assert holds.answer(h, core, mail, 0.0).notes == {"b": [m.SeedAhead(version=4)]}

    h = holds.start(pulse_ab, core, deadline=30.0, now=0.0)
    core.declare_dead(["a"], 26.0, "test")
    assert holds.answer(h, core, mail, 0.0).unknown == ("a",), "forgotten while held: announce again"
    assert not holds.of and not holds.by_process


@pytest.mark.ray
def test_the_server_answers_a_held_pulse_at_once_with_its_seed_and_on_a_new_handle_of_the_process(ray_cluster, model_name):
    """Raw protocol against the server actor (``pulse_hold_s`` 30 s): an idle reader's pulse in
    another datacenter stays held; the trainer's publish seeds that datacenter and the held
    pulse comes back at once carrying the SeedAhead; held again, a registration from the same
    process brings it back at once (empty) so the new handle joins the next pulse."""
    from tensorhub.server.find import server_handle
    from tensorhub.auth import Keyring
    from tensorhub.config import Config

    ray = ray_cluster
    cfg = Config(pulse_hold_s=30.0, server_name=f"tensorhub-hold-{uuid.uuid4().hex[:6]}")
    server = server_handle(cfg, model_name)
    keys = Keyring()  # the capabilities of this test's raw clients, as a Hub's port keeps them

    def call(req, wait_s=0.0):
        return server.call.remote(m.encode(keys.sign(req)), wait_s)

    def reg(cid, dc, proc):
        return _reg(cid, dc, proc, model=model_name)

    pr = m.ProcessId(worker_id="feed", pid=424242)
    for req in (reg("t", "a", m.ProcessId(pid=1)), reg("r", "b", pr)):
        assert not isinstance(m.decode_reply(ray.get(call(req))), m.ErrorReply)
    try:
        ref = call(m.Pulse(beats=(m.Beat("r"),)), 30.0)
        ready, _ = ray.wait([ref], timeout=1.0)
        assert not ready, "an idle pulse is held"
        t0 = time.monotonic()
        assert isinstance(m.decode_reply(ray.get(call(m.Publish("t", 1)))), m.Ok)
        reply = m.decode_reply(ray.get(ref, timeout=5.0))
        assert time.monotonic() - t0 < 1.0
        assert reply.notes == {"r": [m.SeedAhead(version=1)]}, reply

        ref = call(m.Pulse(beats=(m.Beat("r"),)), 30.0)
        assert not ray.wait([ref], timeout=0.5)[0]
        assert ray.get(server.counts.remote())["held"] == 1
        ray.get(call(reg("r2", "b", pr)))
        reply = m.decode_reply(ray.get(ref, timeout=2.0))
        assert reply.held_s > 0 and _unheld(reply) == m.PulseReply(), reply
    finally:
        ray.kill(server)



def test_a_source_reported_failed_while_its_pulse_is_held_must_pulse_again_or_go():
    """The probe with held pulses (in-process server, the actor's rules): the source's idle
    process has its pulse held (its handles count as heard from past their lease); a reader
    reports the source failed; that releases the hold at once, and a process that does not pulse
    again is removed within ``2.5 * heartbeat_interval_s``, not at the end of a hold or lease."""
    cfg = CFG.replace(pulse_hold_s=30.0, lease_timeout_s=30.0)
    port = LocalPort(cfg)
    proc = m.ProcessId(worker_id="source", pid=7)
    for req in (_reg("s", process=proc), _reg("r", process=m.ProcessId(worker_id="reader", pid=8))):
        assert not isinstance(port.call(req), m.ErrorReply)
    assert port.call(m.Publish("s", 1)) == m.Ok()
    a = port.call(m.Replicate("r", "latest", 1))
    assert isinstance(a, m.Assignment) and a.source_id == "s"
    replies = []
    held = threading.Thread(target=lambda: replies.append(port.call(m.Pulse(beats=(m.Beat("s"),)), 30.0)))
    held.start()
    time.sleep(0.5)
    assert port.holds.attended() == ["s"] and not replies
    t0 = time.monotonic()
    port.call(m.SourceFailed("r", "s", 0))
    held.join(timeout=2.0)
    assert [_unheld(r) for r in replies] == [m.PulseReply()] and time.monotonic() - t0 < 1.0, "released at once"
    while "s" in port.core.nodes and time.monotonic() - t0 < 5.0:  # s never pulses again
        port.tick()
        time.sleep(0.05)
    assert "s" not in port.core.nodes
    assert time.monotonic() - t0 < 2.5 * cfg.heartbeat_interval_s + 0.5


def test_death_watch_hands_on_dead_workers_dead_nodes_and_ended_jobs():
    """What Ray pushes (GCS pubsub messages, here stand-ins) reaches the server's callbacks as
    hex ids: every worker death, only nodes that are DEAD, only jobs that ended."""
    from types import SimpleNamespace as NS

    from tensorhub.server.liveness import DeathWatch

    got = []
    w = DeathWatch(lambda workers, nodes: got.append(("dead", workers, nodes)), lambda jobs: got.append(("jobs", jobs)))
    w._workers([(b"k", NS(worker_id=b"\x01\x02")), (b"k", NS(worker_id=b"\xff"))])
    w._nodes([(b"k", NS(node_id=b"\x0a", state=1)), (b"k", NS(node_id=b"\x0b", state=0))], 1)
    w._jobs([(b"k", NS(job_id=b"\x03\x00", is_dead=True)), (b"k", NS(job_id=b"\x04\x00", is_dead=False))])
    w._nodes([(b"k", NS(node_id=b"\x0c", state=0))], 1)
    assert got == [("dead", {"0102", "ff"}, set()), ("dead", set(), {"0a"}), ("jobs", {"0300"})]


def test_background_events_stay_until_a_beat_acknowledges_them():
    """(was known-open "host_leak_msg_loss", seed 203) a DropHostCopy on a held pulse's reply
    that was lost was gone: the handle kept that host copy past retention. Now a handle's beats
    acknowledge the events it took; until then every pulse brings them again. Numbers grow
    across a server's restarts (``seq_base``), so an old acknowledgement drops nothing new."""
    from tensorhub.config import Config
    from tensorhub.core.reference import ReferenceCore
    from tensorhub.server.requests import Mailboxes, apply_request, holdable

    core, mail = ReferenceCore(Config()), Mailboxes(seq_base=1000)
    lay = m.LayoutInfo("fp", 4, 400)
    for cid in ("a", "old"):
        apply_request(core, mail, m.Register(cid, "pol", cid, 0, 1, lay, cid.encode(), "d", False), 0.0)
    mail.route([m.Deliver("a", m.DropHostCopy(3)), m.Deliver("old", m.DropHostCopy(3))])

    def pulse(cid, acked):
        reply, _ = apply_request(core, mail, m.Pulse(beats=(m.Beat(cid, acked=acked),)), 1.0)
        return reply

    lost = pulse("a", 0)  # its reply is lost on the way
    assert lost.notes == {"a": [m.DropHostCopy(3)]} and lost.acks == {"a": 1001}
    again = pulse("a", 0)
    assert again.notes == lost.notes and not holdable(m.Pulse(beats=(m.Beat("a", acked=0),)), again, 30.0, 30.0)
    assert pulse("a", 1001).notes == {}, "acknowledged: gone"
    assert pulse("old", -1).notes == {"old": [m.DropHostCopy(3)]} and pulse("old", -1).notes == {}, \
        "a beat without acknowledgements takes its events once"
    restarted = Mailboxes(seq_base=2000)
    restarted.route([m.Deliver("a", m.SeedAhead(4))])
    restarted.ack("a", 1001)  # the old server's number
    assert restarted.take_background("a") == ([m.SeedAhead(4)], 2001)


def test_the_progress_stream_loses_no_event_with_its_reply():
    """Through the shipped pulse loop: a reading handle's progress pulse (which does not announce
    again when it fails, unlike the liveness pulse) took a DropHostCopy and its reply was lost;
    the next progress pulse brings it again, and once taken it is acknowledged and gone."""
    from tensorhub.config import Config
    from tensorhub.core.reference import ReferenceCore
    from tensorhub.server.requests import Mailboxes, apply_request

    core, mail = ReferenceCore(Config()), Mailboxes(seq_base=0)
    lay = m.LayoutInfo("fp", 4, 400)
    apply_request(core, mail, m.Register("r", "pol", "r", 0, 1, lay, b"r", "d", False), 0.0)
    mail.route([m.Deliver("r", m.DropHostCopy(2))])

    class Port:
        lose = True

        def call(self, req, wait_s=0.0):
            reply, _ = apply_request(core, mail, req, 1.0)
            if self.lose and reply.notes:
                self.lose = False
                raise errors.ServerUnavailable("reply lost")
            return reply

    class Reader:
        client_id, _port, acked, taken = "r", Port(), 0, []

        def _beat(self):
            return m.Beat("r", 2, acked=self.acked)

        def _after_beat(self, known, notes, acked=-1, may_announce=True, viewed=None):
            self.taken += notes
            self.acked = max(self.acked, acked)

    x = Reader()
    p = pulse.Pulse(("test", uuid.uuid4().hex))
    p._send([(x, x._beat())], 0.0, announce=False)
    assert x.taken == [] and not x._port.lose, "the reply was lost"
    p._send([(x, x._beat())], 0.0, announce=False)
    assert x.taken == [m.DropHostCopy(2)] and x.acked == 1
    p._send([(x, x._beat())], 0.0, announce=False)
    assert x.taken == [m.DropHostCopy(2)] and not mail.background.get("r"), "acknowledged: not again"


class _Member:
    """A pulse member without a handle: records what its pulses brought."""

    def __init__(self, port, interval: float) -> None:
        self.client_id, self._port, self._interval = "m", port, interval
        self.notes: list = []

    def _beat(self):
        return m.Beat(self.client_id)

    def _after_beat(self, known, notes, acked=-1, may_announce=True, viewed=None):
        self.notes += notes

    def _beat_interval(self):
        return self._interval

    def _pulse_hold(self):
        return 0.0


class _Bursty:
    """A server whose first two pulse replies bring an event each (a burst), then none."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def call(self, request, wait_s=0.0):
        self.times.append(time.monotonic())
        notes = {"m": [m.Probe()]} if len(self.times) <= 2 else {}
        return m.PulseReply(notes=notes)

    def pulse_key(self):
        return ("bursty", id(self))


def test_a_pulse_whose_reply_brought_events_is_followed_at_once_not_after_the_interval():
    """Events come in bursts (each publish of a step asks the holders for cell checksums): the
    pulse after one that brought events leaves after 10 ms, not a heartbeat later, which made
    an engine's resharded update take a heartbeat (benchmarks/reshard_updates.py: 1.0 s, then
    0.03 s for 33 MiB). Without events the interval holds."""
    port = _Bursty()
    member = _Member(port, interval=1.0)
    pulse.join(member)
    try:
        deadline = time.monotonic() + 5.0
        while len(port.times) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        pulse.leave(member)
    t = port.times
    assert len(t) >= 4 and len(member.notes) == 2, (t, member.notes)
    assert t[1] - t[0] < 0.3 and t[2] - t[1] < 0.3, "after events: at once"
    assert t[3] - t[2] > 0.8, "no events: the interval"
