"""Process-level liveness (:mod:`tensorhub.pulse`): one server call per process per heartbeat
interval, whatever the number of handles in it; background events ride on its reply."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest

import tensorhub
from tensorhub import pulse
from tensorhub.core import messages as m
from tensorhub.port import LocalPort
from tensorhub.testing import inproc, workload

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
    port = _Counting(CFG)
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
    assert beats and all(b.reading_units > 0 for b in beats), beats
    go.set()
    assert done.wait(10)
    # r holds the only copy of 1 once t moves on: r offloads; when 1 falls out of retention the
    # server tells r to drop its host copy -- through the pulse.
    inproc.publish(t, tt, 2)
    r.update("latest")
    assert list(r._host) == [1]
    polls = port.note_polls
    inproc.publish(t, tt, 3)
    deadline = time.monotonic() + 5
    while r._host and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not r._host and port.note_polls == polls
    r.close(drop_last_copy=True); t.close(drop_last_copy=True)


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
def test_one_process_with_three_handles_costs_one_call_per_interval_and_dies_whole(ray_cluster, model_name):
    """Through Ray: an actor hosting three handles sends one Pulse per interval (no heartbeat,
    progress or notes calls); killing the process removes all three from the server's table
    well within the lease (Ray's word that the process is gone, not the lease)."""
    from tensorhub.actors.server import find_server
    from tensorhub.config import Config
    from tensorhub.testing.replica import spawn_many

    ray = ray_cluster
    spec = workload.small_spec(1 << 20, big=1, tiny=4)
    cfg = dict(heartbeat_interval_s=0.25, lease_timeout_s=20.0, liveness_check_s=0.5,
               server_name=f"tensorhub-pulse-{uuid.uuid4().hex[:6]}")
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
    c0 = ray.get(server.counts.remote())
    time.sleep(2.0)
    c1 = ray.get(server.counts.remote())
    pulses = c1.get("Pulse", 0) - c0.get("Pulse", 0)
    assert 4 <= pulses <= 10, (c0, c1)  # 2 s / 0.25 s: one process, one pulse per interval
    for kind in ("Heartbeat", "Progress", "notes"):
        assert c1.get(kind, 0) == c0.get(kind, 0), (kind, c0, c1)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while holders() and time.monotonic() - t0 < 15:
        time.sleep(0.1)
    assert not holders(), "a dead process takes all its handles with it"
    assert time.monotonic() - t0 < cfg["lease_timeout_s"] / 2, "found by Ray's liveness, not the lease"
