"""The server's liveness checks never hold what must not wait for Ray: a GCS call that hangs
(seen as a 50-55 s read in the emulated stale-job test, where the lease, not Ray, removed the
corpses) delays neither a request past one heartbeat interval nor the tick that judges leases
and probes. The real ``ReferenceServer`` class, in this process, with a liveness whose every
call blocks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tensorhub import auth
from tensorhub.core import messages as m

from test_security import _Server, _reg


class _SlowLiveness:
    """Ray's answer after ``delay_s``: every client asked about is gone."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0
        self.released = threading.Event()

    def gone(self, processes, targeted=()):
        self.calls += 1
        self.released.wait(self.delay_s)
        return {cid: "its actor is dead (test)" for cid in targeted}


class _NoPushes:
    def __init__(self, *args) -> None:
        pass

    async def run(self) -> None:
        return None


@pytest.fixture
def slow_server(monkeypatch):
    import tensorhub.server.actor as server_mod

    monkeypatch.setattr(server_mod, "DeathWatch", _NoPushes)
    made = []

    def make(delay_s: float, **cfg) -> tuple[_Server, _SlowLiveness]:
        s = _Server(**cfg)
        s.srv._liveness = _SlowLiveness(delay_s)
        made.append(s)
        return s, s.srv._liveness

    yield make
    for s in made:
        s.srv._liveness.released.set()
        s.close()


def test_a_request_waits_for_a_hanging_liveness_check_one_interval_then_goes_on(slow_server):
    """A Replicate starts a check (none for half a period); Ray hangs 3 s; the reply comes after
    one heartbeat interval (0.2 s), and the check's finding is applied when it arrives."""
    s, live = slow_server(3.0, heartbeat_interval_s=0.2, lease_timeout_s=30.0, liveness_check_s=60.0)
    keys, corpse = auth.Keyring(), auth.Keyring()
    assert isinstance(s.call(_reg("corpse", "c"), corpse), m.Registered)
    assert isinstance(s.call(_reg("r", "r"), keys), m.Registered)
    s.srv._swept_at = float("-inf")  # a Replicate asks Ray when it has not for half a period
    s.core.nodes["corpse"].last_seen -= 10.0  # overdue: the check names it
    t0 = time.monotonic()
    reply = s.call(m.Replicate("r", "latest"), keys)
    took = time.monotonic() - t0
    assert live.calls == 1, "the Replicate asked Ray"
    assert took < 1.0, f"the request waited {took:.1f} s for Ray (one interval is 0.2 s)"
    assert isinstance(reply, m.ErrorReply) and reply.code == "VersionNotFound", reply
    counts = s.run(s.srv.counts())
    assert counts.get("sweeps_slow") == 1, counts
    assert "corpse" in s.core.nodes, "not yet known gone"
    s.run(asyncio.sleep(3.5))
    assert "corpse" not in s.core.nodes, "the late answer was applied"


def test_the_tick_judges_leases_while_a_periodic_liveness_sweep_hangs(slow_server):
    """The periodic sweep runs beside the tick, not in it: with Ray hanging 5 s, a client whose
    0.6 s lease ran out is removed by the tick on time. (Before, the tick awaited the sweep, and
    every lease and probe waited for Ray.)"""
    s, live = slow_server(5.0, heartbeat_interval_s=0.2, lease_timeout_s=0.6, liveness_check_s=0.1,
                          server_tick_s=0.05, lease_stretch_max_s=0.0)
    keys = auth.Keyring()
    assert isinstance(s.call(_reg("quiet", "q"), keys), m.Registered)
    t0 = time.monotonic()
    while "quiet" in s.core.nodes and time.monotonic() - t0 < 4.0:
        s.run(asyncio.sleep(0.05))
    took = time.monotonic() - t0
    assert live.calls >= 1, "a periodic sweep was started"
    assert "quiet" not in s.core.nodes and took < 2.0, f"lease of 0.6 s judged after {took:.1f} s"
    assert live.calls == 1, "one periodic sweep in flight at a time"


def test_a_process_ray_reported_gone_does_not_come_back_with_a_late_announce(slow_server):
    """CI (the emulated stale-job test, 39 s): a job's actor, declared gone with its ended job
    while Ray had not killed it yet, re-announced itself; the server took the corpse back as a
    holder, and its announcement opened a recovery window on a server that never restarted.
    Now a Register or Announce from a process declared gone is refused and changes nothing;
    another process of the same job (and the same replica name) still registers."""
    s, live = slow_server(0.0, heartbeat_interval_s=0.2, lease_timeout_s=30.0, liveness_check_s=60.0)
    dead = m.ProcessId(job_id="01000000", actor_id="a1", worker_id="w1", node_id="n1", pid=11)
    keys = auth.Keyring()
    assert isinstance(s.call(_reg("corpse", "c", process=dead), keys), m.Registered)
    s.srv._on_deaths({"w1"}, set())
    assert "corpse" not in s.core.nodes
    before = (sorted(s.core.nodes), s.core.recovery.until)
    again = m.Announce(register=_reg("corpse", "c", process=dead), holding=m.Holding(published=1))
    reply = s.call(again, auth.Keyring())
    assert isinstance(reply, m.ErrorReply) and reply.code == "UnknownClient", reply
    assert "reported gone" in reply.message
    reply = s.call(_reg("corpse-2", "c", process=dead), auth.Keyring())
    assert isinstance(reply, m.ErrorReply) and reply.code == "UnknownClient", reply
    assert (sorted(s.core.nodes), s.core.recovery.until) == before, "nothing changed, no window opened"
    alive = m.ProcessId(job_id="01000000", actor_id="a2", worker_id="w2", node_id="n1", pid=12)
    assert isinstance(s.call(_reg("fresh", "c", process=alive), auth.Keyring()), m.Registered)
