"""Targeted wake-ups in LocalPort: an event wakes only the blocking call waiting for it.

    A (published) -> rA      B (published) -> rB
Both holders unpublish and block on their drains; rA finishing wakes A's call, not B's."""

from __future__ import annotations

import threading
import time

from tensorhub import ports as port_mod
from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.ports import LocalPort

LAYOUT = m.LayoutInfo("fp", 4, 400, (m.TensorMeta("w", "float32", (100,), 400),))


class CountingCondition(threading.Condition):
    wakeups: dict = {}

    def wait(self, timeout=None):
        out = super().wait(timeout)
        CountingCondition.wakeups[id(self)] = CountingCondition.wakeups.get(id(self), 0) + 1
        return out


def test_an_event_wakes_only_the_call_waiting_for_it(monkeypatch):
    monkeypatch.setattr(port_mod.threading, "Condition", CountingCondition)
    cfg = Config(server_tick_s=60.0, versions_retained=1)  # no timer wake-ups within the test
    port = LocalPort(cfg)
    for cid in ("A", "B", "rA", "rB"):
        assert isinstance(port.call(m.Register(cid, "pol", cid, 0, 1, LAYOUT)), m.Registered)
    port.call(m.Publish("A", 1))
    assert port.call(m.Replicate("rA", 1, 1)).source_id == "A"
    port.call(m.Publish("B", 1))  # A is busy: rB reads from B
    assert port.call(m.Replicate("rB", 1, 1)).source_id == "B"

    replies = {}
    threads = [threading.Thread(target=lambda c=c: replies.__setitem__(c, port.call(m.Unpublish(c), 30.0)))
               for c in ("A", "B")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while len(port._waiters) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    cond_a, cond_b = port._waiters["A"].cond, port._waiters["B"].cond

    port.call(m.ReplicateDone("rA", 1))  # A's drain ends
    threads[0].join(5)
    assert isinstance(replies.get("A"), m.UnpublishDone)
    assert CountingCondition.wakeups.get(id(cond_a)) == 1
    assert CountingCondition.wakeups.get(id(cond_b)) is None, "B's call was woken by A's event"
    assert threads[1].is_alive()

    port.call(m.ReplicateDone("rB", 1))
    threads[1].join(5)
    assert isinstance(replies.get("B"), m.UnpublishDone)
    assert not port._waiters
