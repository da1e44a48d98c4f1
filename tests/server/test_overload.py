"""Overload must not kill the fleet: a server that falls behind in reading its queue judges
leases against what it could have read (:class:`tensorhub.server.requests.Backlog`), so clients whose
pulses wait unread are not declared dead, while a client that really stopped still goes within
``lease_timeout_s + lease_stretch_max_s`` (issue 22, section 3b)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.reference import ReferenceCore
from tensorhub.core import handle as hm
from tensorhub.ports import LocalPort
from tensorhub.server.requests import Backlog, busy_hold, shed_register

CFG = Config(heartbeat_interval_s=0.2, lease_timeout_s=1.0, server_tick_s=0.05, pulse_hold_s=0.0,
             liveness_check_s=0.0, same_host=False)


def _reg(cid: str) -> m.Register:
    layout = m.LayoutInfo("fp", 4, 4 << 16, (m.TensorMeta("w", "float32", (1 << 16,), 4 << 16),))
    return m.Register(cid, "pol", cid, 0, 1, layout, cid.encode())


# ---------------------------------------------------------------- the rules, as tables

@pytest.mark.parametrize("marks, now, want", [
    ([], 5.0, 0.0),                                     # nothing waits: not behind
    ([("arrive", 1.0)], 5.0, 4.0),                      # one caller waiting since 1.0
    ([("arrive", 1.0), ("arrive", 3.0), ("read", 1)], 5.0, 2.0),  # the oldest was read
    ([("arrive", 1.0), ("read", 1), ("read", 1)], 5.0, 0.0),      # read twice: idempotent
    ([("arrive", -100.0)], 5.0, 10.0),                  # capped at max_s
    ([("read", 7)], 5.0, 0.0),                          # an unknown token changes nothing
])
def test_backlog_is_the_age_of_the_oldest_request_not_yet_read(marks, now, want):
    b = Backlog(max_s=10.0, now=0.0)
    for what, x in marks:
        b.arrived(x) if what == "arrive" else b.read(x)
    assert b.behind_s(now) == pytest.approx(want)


@pytest.mark.parametrize("probes, now, want", [
    ([], 0.4, 0.4),                                     # since the server started
    ([(0.5, True)], 0.6, 0.1),                          # read a probe sent at 0.5
    ([(0.5, True), (1.0, None)], 4.0, 3.5),             # the next one sits unread: a stall
    ([(0.5, True), (1.0, False)], 4.0, 3.5),            # a lost probe teaches nothing
    ([(2.0, True), (1.0, True)], 3.0, 1.0),             # read out of order: the newest counts
    ([], 100.0, 10.0),                                  # capped at max_s
])
def test_a_probed_backlog_is_the_age_of_the_newest_probe_read(probes, now, want):
    b = Backlog(max_s=10.0, now=0.0, probed=True)
    for sent, heard in probes:
        token = b.arrived(sent)
        if heard is not None:
            b.read(token, heard=heard)
    assert b.behind_s(now) == pytest.approx(want)


def test_a_backlog_remembers_a_bounded_number_of_unread_requests():
    b = Backlog(max_s=10.0, now=0.0)
    b.arrived(0.0)
    for _ in range(Backlog.PENDING_MAX):
        b.arrived(1.0)
    assert b.behind_s(2.0) == pytest.approx(1.0), "the oldest beyond the bound is forgotten"


def test_a_backlog_without_stretch_is_never_behind():
    b = Backlog(max_s=0.0, now=0.0)
    b.arrived(-50.0)
    assert b.behind_s(1.0) == 0.0


@pytest.mark.parametrize("hold_s, behind_s, timeout_s, want", [
    (30.0, 0.0, 300.0, 30.0),    # caught up: the configured hold
    (30.0, 1.0, 300.0, 30.0),    # behind by one interval or less: still
    (30.0, 12.0, 300.0, 42.0),   # behind: longer by the backlog
    (30.0, 90.0, 300.0, 60.0),   # at most twice
    (30.0, 90.0, 10.0, 35.0),    # and within the client's patience (half its request timeout)
    (0.0, 90.0, 300.0, 0.0),     # not held stays not held
])
def test_a_busy_server_holds_pulses_longer(hold_s, behind_s, timeout_s, want):
    assert busy_hold(hold_s, behind_s, interval_s=1.0, request_timeout_s=timeout_s) == want


@pytest.mark.parametrize("silent_s, grace_s, alive", [
    (0.9, 0.0, True),
    (1.1, 0.0, False),    # past its lease on a server that is not behind
    (1.1, 0.2, True),     # the server may not have read it yet
    (1.3, 0.2, False),    # past its lease plus the backlog
])
def test_the_core_stretches_leases_by_the_drivers_backlog(silent_s, grace_s, alive):
    core = ReferenceCore(CFG)
    core.handle(_reg("a"), 0.0)
    core.tick(silent_s, grace_s)
    assert ("a" in core.nodes) is alive


def test_lease_stretch_max_s_is_validated():
    from tensorhub.errors import ConfigError

    with pytest.raises(ConfigError):
        Config(lease_stretch_max_s=-1.0)


# ---------------------------------------------------------------- backpressure on new clients

SHED = CFG.replace(register_shed_s=2.0, lease_timeout_s=10.0)


@pytest.mark.parametrize("request_, behind_s, spread, want_after", [
    (_reg("new"), 1.9, 0.5, None),                      # not behind enough: served
    (_reg("new"), 4.0, 0.0, 2.0),                       # behind 4 s: come back in 0.5x ..
    (_reg("new"), 4.0, 0.999, 5.996),                   # .. to 1.5x the backlog
    (_reg("new"), 30.0, 0.5, 10.0),                     # at most a lease
    (_reg("known"), 30.0, 0.5, None),                   # a duplicate id: the core's own error
    (m.Announce(_reg("new"), m.Holding()), 30.0, 0.5, None),         # a known client coming back: never shed
    (m.Heartbeat("known"), 30.0, 0.5, None),            # registered clients are served
])
def test_a_server_behind_sheds_only_new_registrations(request_, behind_s, spread, want_after):
    core = ReferenceCore(SHED)
    core.handle(_reg("known"), 0.0)
    reply = shed_register(request_, core, behind_s, SHED, spread)
    if want_after is None:
        assert reply is None
    else:
        assert reply.code == "ServerBusy" and reply.retry_after_s == pytest.approx(want_after, abs=1e-3)
    assert shed_register(request_, core, behind_s, SHED.replace(register_shed_s=0.0), spread) is None, "0: off"


@pytest.mark.parametrize("after, want_pause", [(0.7, 0.7), (0.0, hm.RETRY_PAUSE_S), (float("nan"), hm.RETRY_PAUSE_S),
                                               (float("inf"), hm.BUSY_PAUSE_MAX_S), (-5.0, hm.RETRY_PAUSE_S)])
def test_a_registering_handle_pauses_as_asked_then_registers_again(after, want_pause):
    """A ServerBusy reply pauses the handle (bounded: a reply cannot park it, nor spin it) and
    sends the same Register again; Registered then ends the call."""
    reg = _reg("c")
    mc = hm.HandleMachine("c", request_timeout_s=120.0, reconnects_max=1, failovers_max=1, unit_count=4)
    assert mc.handle(hm.Start(hm.RegisterOp(reg)), 0.0)[-1] == hm.Send(reg, False)
    busy = m.ErrorReply(code="ServerBusy", message="behind", retry_after_s=after)
    assert mc.handle(hm.Replied(busy), 0.0) == [hm.Sleep(want_pause)]
    assert mc.handle(hm.TimerFired(), want_pause)[-1] == hm.Send(reg, False)
    assert mc.handle(hm.Replied(m.Registered()), want_pause) == [hm.Done(hm.Outcome())]


def test_a_registering_handle_gives_up_busy_at_its_deadline():
    reg = _reg("c")
    mc = hm.HandleMachine("c", request_timeout_s=5.0, reconnects_max=1, failovers_max=1, unit_count=4)
    mc.handle(hm.Start(hm.RegisterOp(reg)), 0.0)
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="ServerBusy", message="behind", retry_after_s=6.0)), 0.0)
    assert [type(c) for c in cmds] == [hm.Fail] and cmds[0].code == "ServerBusy"


# ---------------------------------------------------------------- an in-process server that stalls

class _StallingCore(ReferenceCore):
    """A core whose handling of one chosen request takes ``stall_s`` (a GC pause, a swapped-out
    or starved server): every other caller waits for the port's lock meanwhile."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.stall_on: dict[str, float] = {}

    def handle(self, req, now):
        stall = self.stall_on.pop(getattr(req, "client_id", ""), 0.0)
        if stall:
            time.sleep(stall)
        return super().handle(req, now)


def test_a_server_stalled_past_the_lease_expires_no_client_that_pulsed_but_one_that_stopped():
    """``a`` heartbeats every interval; ``b`` stopped; the server's handling of one request
    (``c``'s) takes three leases. ``a``'s heartbeats wait for the server meanwhile: none of
    them is answered UnknownClient and ``a`` stays. ``b`` is declared dead within a lease
    (and a few ticks) of the server having read its queue again."""
    core = _StallingCore(CFG)
    port = LocalPort(CFG, core=core)
    for cid in ("a", "b", "c"):
        assert not isinstance(port.call(_reg(cid)), m.ErrorReply)
    stop = threading.Event()
    replies: list = []

    def pulse_a() -> None:
        while not stop.wait(CFG.heartbeat_interval_s):
            replies.append(port.call(m.Heartbeat("a")))

    beats = threading.Thread(target=pulse_a, daemon=True)
    beats.start()
    time.sleep(0.3)
    stall_s = 3 * CFG.lease_timeout_s
    core.stall_on["c"] = stall_s
    assert port.call(m.Heartbeat("c")) == m.Ok(), "the stalled request itself is not expired"
    caught_up = time.monotonic()
    gone_at = None
    while time.monotonic() - caught_up < CFG.lease_timeout_s + 1.0:
        port.tick()
        if gone_at is None and "b" not in core.nodes:
            gone_at = time.monotonic()
        time.sleep(CFG.server_tick_s)
    stop.set()
    beats.join(timeout=5.0)
    assert replies and all(r == m.Ok() for r in replies), [r for r in replies if r != m.Ok()][:3]
    assert "a" in core.nodes, "a client that pulsed through the stall lives on"
    assert gone_at is not None, "a client that stopped is still declared dead"
    assert gone_at - caught_up < CFG.lease_timeout_s + 0.3
    assert port.backlog.max_seen_s >= stall_s * 0.9


def test_the_stretch_is_bounded_by_lease_stretch_max_s():
    """However long the server stalls, a client is dead ``lease_timeout_s +
    lease_stretch_max_s`` after its last word: with a 0.2 s cap, a stall of three leases expires
    even the client that pulsed (the bound a stopped client is found within)."""
    cfg = CFG.replace(lease_stretch_max_s=0.2)
    core = _StallingCore(cfg)
    port = LocalPort(cfg, core=core)
    for cid in ("a", "c"):
        port.call(_reg(cid))
    core.stall_on["c"] = 3 * cfg.lease_timeout_s
    replies = []
    t = threading.Thread(target=lambda: (time.sleep(0.2), replies.append(port.call(m.Heartbeat("a")))))
    t.start()
    port.call(m.Heartbeat("c"))
    t.join(timeout=5.0)
    assert replies and isinstance(replies[0], m.ErrorReply) and replies[0].code == "UnknownClient"


# ---------------------------------------------------------------- through Ray

@pytest.mark.ray
def test_a_ray_server_whose_loop_stalls_past_the_lease_keeps_the_clients_that_pulsed(ray_cluster, model_name):
    """The actor's event loop is blocked for three leases; a client heartbeating through Ray
    meanwhile (its calls wait in Ray's queue) is not expired when the server resumes, and a
    client that stopped is declared dead within a lease of it having caught up. Its probes
    measured the stall (``behind_max_ms``), and a client that registered during the stall was
    shed (``ServerBusy``: ``Config.register_shed_s``)."""
    from tensorhub.ports import connect
    from tensorhub.server.find import find_server

    ray = ray_cluster
    cfg = Config(heartbeat_interval_s=0.25, lease_timeout_s=2.0, pulse_hold_s=0.0, liveness_check_s=0.0,
                 server_tick_s=0.1, server_name=f"tensorhub-overload-{uuid.uuid4().hex[:6]}")
    port = connect(cfg, model_name)
    for cid in ("a", "b"):
        r = _reg(cid)
        assert not isinstance(port.call(m.Register(cid, model_name, cid, 0, 1, r.layout, r.endpoint)), m.ErrorReply)
    server = find_server(cfg, model_name)
    stop = threading.Event()
    replies: list = []

    def pulse_a() -> None:
        while not stop.wait(cfg.heartbeat_interval_s):
            replies.append(port.call(m.Heartbeat("a")))

    beats = threading.Thread(target=pulse_a, daemon=True)
    beats.start()
    time.sleep(1.0)
    stall_s = 3 * cfg.lease_timeout_s
    stall = server.__ray_call__.remote(lambda self: time.sleep(stall_s))  # blocks its loop
    time.sleep(0.5)
    late: list = []
    joining = threading.Thread(target=lambda: late.append(port.call(
        m.Register("late", model_name, "late", 0, 1, r.layout, b"late"))))
    joining.start()  # a new client joins during the stall: its call waits in Ray's queue
    ray.get(stall)
    caught_up = time.monotonic()
    joining.join(timeout=10.0)

    def known() -> set:
        st = m.decode_reply(ray.get(server.status.remote(model_name)))
        return {h.client_id for mv in st.models for h in mv.holders}

    while "b" in known() and time.monotonic() - caught_up < cfg.lease_timeout_s + 3.0:
        time.sleep(0.1)
    took = time.monotonic() - caught_up
    stop.set()
    beats.join(timeout=5.0)
    assert replies and all(r == m.Ok() for r in replies), [r for r in replies if r != m.Ok()][:3]
    assert "a" in known(), "a client that pulsed through the stall lives on"
    assert "b" not in known() and took < cfg.lease_timeout_s + 1.5, took
    counts = ray.get(server.counts.remote())
    assert counts["behind_max_ms"] >= 0.8 * stall_s * 1000
    # Backpressure: the server, behind by the stall when it read the new client's Register,
    # shed it (ServerBusy, with a pause to honour) and registered nothing.
    assert late and isinstance(late[0], m.ErrorReply) and late[0].code == "ServerBusy", late
    assert 0 < late[0].retry_after_s <= cfg.lease_timeout_s and counts["shed"] == 1
    assert "late" not in known()
    ray.kill(server)


def test_a_crowd_registering_into_a_stalled_server_is_shed_and_joins_after_it_caught_up():
    """The server's handling of one request takes 3 s; meanwhile a handle registers (its call
    waits for the server behind the stall). The server, 3 s behind when it reads it, sheds it
    with ServerBusy (nothing registered), the handle pauses as asked and registers once the
    server caught up; the client that pulsed through the stall was never at risk."""
    import tensorhub

    cfg = SHED.replace(lease_timeout_s=5.0, request_timeout_s=30.0)
    core = _StallingCore(cfg)
    port = LocalPort(cfg, core=core)
    c = _reg("c")
    assert not isinstance(port.call(m.Register("c", "other", "c", 0, 1, c.layout, c.endpoint)), m.ErrorReply)
    seen: list = []
    handle = core.handle

    def spy(req, now):
        reply = handle(req, now)
        seen.append((type(req).__name__, getattr(req, "client_id", "")))
        return reply
    core.handle = spy
    hub = tensorhub.open("pol", port=port, config=cfg, replica="late")
    core.stall_on["c"] = 3.0
    stalled = threading.Thread(target=lambda: port.call(m.Heartbeat("c")))
    stalled.start()
    time.sleep(0.2)
    took = time.monotonic()
    try:
        import torch
        hub.register({"w": torch.zeros(1 << 16)})
        took = time.monotonic() - took
        stalled.join(timeout=10.0)
        assert hub.client_id in core.nodes
        regs = [cid for kind, cid in seen if kind == "Register"]
        assert port.shed >= 1, "the registration that waited behind the stall was shed"
        assert regs == [hub.client_id], "the shed attempts never reached the table; the retry did, once"
        # Shed when read, about 2.8 s behind (the stall less the 0.2 s head start), with
        # retry_after_s = behind * (0.5 + spread), spread in [0, 1): the retry lands 1.4 to 4.2 s
        # after the stall ends. The upper bound was 3.0 * 1.5 + 2.0 = 6.5 s, which left out the
        # stall itself and failed whenever spread drew above ~0.8 (6.55 s in a CI run).
        assert 2.8 < took < 3.0 + 3.0 * 1.5 + 1.5, took
    finally:
        hub.close()
