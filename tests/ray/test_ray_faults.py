"""Faults on a real local Ray cluster: killed sources, spot waves, a killed server. Every
finished replica's bytes are compared with the publisher's.

Each scenario is arranged so the fault it names always happens where it says (a source killed
while its reader reads from it, a version held only by a spot replica): reads are made slow
(small units, one read in flight), the driver watches the server's table until the reader is
where it must be, then kills the process at once (SIGKILL; the actors are local)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from tensorhub.testing import workload
from tensorhub.testing.replica import spawn_many

pytestmark = pytest.mark.ray

SPEC = workload.small_spec(64 << 20, big=4, tiny=16)
SLOW = dict(reads_in_flight=1, nixl_workers=1, nixl_threads=0, unit_bytes=4 << 10, same_host=False)
"""A 64 MiB read in 16k units of 4 KiB, one at a time: about 1.5 s here, long enough to kill a
process mid-read after watching the server's table. Through NIXL, as between hosts: a same-host
reader maps a complete holder's memory, which outlives the holder's death (it would finish the
read from it: the bytes are final and verified), so these faults would not bite."""


def _cfg(**kw) -> dict:
    base = dict(unit_bytes=1 << 20, heartbeat_interval_s=0.3, lease_timeout_s=2.0, source_stall_timeout_s=1.5,
                request_timeout_s=60.0, server_name=f"tensorhub-faults-{uuid.uuid4().hex[:6]}")
    base.update(kw)
    return base


def _err(ray, ref) -> str:
    try:
        ray.get(ref, timeout=60)
    except Exception as e:  # noqa: BLE001
        return type(getattr(e, "cause", None) or e).__name__
    return "ok"


def _pid(ray, actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def _server(cfg: dict, model: str):
    """The running server actor of ``model`` (its own with ``server_per_model``)."""
    from tensorhub.server.find import find_server
    from tensorhub.config import Config

    return find_server(Config(**cfg), model)


def _table(ray, cfg: dict, model: str) -> dict:
    """The server's holders of ``model`` by client id (host copies under their own ids)."""
    from tensorhub.core import messages as m

    server = _server(cfg, model)
    status = m.decode_reply(ray.get(server.status.remote(model)))
    return {h.client_id: h for mv in status.models for h in mv.holders}


def _wait_table(ray, cfg: dict, model: str, cond, what: str, timeout_s: float = 20.0) -> dict:
    """Poll the server's table until ``cond(table)``; the table that satisfied it."""
    t_end = time.monotonic() + timeout_s
    while True:
        table = _table(ray, cfg, model)
        if cond(table):
            return table
        assert time.monotonic() < t_end, f"timed out waiting until {what}: {table}"
        time.sleep(0.005)


def test_source_killed_mid_read_reader_fails_over_with_exact_bytes(ray_cluster, model_name):
    """holder -> A -> B ; A is killed while B reads from it: B finishes from the holder.

    One reader per source: the holder is busy with A when B asks, so B's first source is A, a
    partial holder. A is killed as soon as the server shows B reading from it."""
    ray = ray_cluster
    cfg = _cfg(readers_per_source_max=1, **SLOW)
    holder, a, b = spawn_many(model_name, SPEC, ["holder", "A", "B"], config=cfg)
    id_h, id_a, id_b = ray.get([x.ping.remote() for x in (holder, a, b)])
    pid_a = _pid(ray, a)
    d = ray.get(holder.publish.remote(1))
    ra = a.replicate.remote(1)
    _wait_table(ray, cfg, model_name, lambda t: t[id_a].state == "reading", "A reads")
    rb = b.replicate.remote(1)
    t = _wait_table(ray, cfg, model_name, lambda t: t[id_b].state == "reading", "B reads")
    os.kill(pid_a, signal.SIGKILL)
    # B's source was A, still partial: the holder serves A alone, A serves B.
    assert (t[id_a].state, t[id_a].readers, t[id_h].readers) == ("reading", 1, 1)
    st = ray.get(rb, timeout=60)
    assert _err(ray, ra) == "ActorDiedError"  # A never finished
    assert (st["version"], st["digest"]) == (1, d)
    assert st["partial_source"] and st["failovers"] >= 1
    assert (st["sources"][0], st["sources"][-1]) == (id_a, id_h)
    ray.get([x.close.remote() for x in (holder, b)])


def test_spot_wave_survivors_finish_and_lost_version_moves_on(ray_cluster, model_name):
    """trainer -> {s0, s1, s2 (spot), stable}: a spot wave kills s0 and s1 mid-read; s2 and
    stable finish version 1 with exact bytes.

    Then version 2 is made to live on spot s2 alone (s2 reads it, the trainer is killed), and
    stable reads 2 from s2 (unpublishing 1, it keeps the last non-spot copy of 1 in host memory).
    s2 is killed mid-read: no holder of 2 is left, so stable gets VersionLost, and
    update("latest") moves on to 1, the newest version still available: its bytes move from
    the host copy back into stable's (scribbled) tensors."""
    ray = ray_cluster
    cfg = _cfg(**SLOW)
    names = ["trainer", "s0", "s1", "s2", "stable"]
    per = {n: dict(spot=True) for n in ("s0", "s1", "s2")}
    actors = spawn_many(model_name, SPEC, names, per_name=per, config=cfg)
    trainer, s0, s1, s2, stable = actors
    ids = dict(zip(names, ray.get([x.ping.remote() for x in actors])))
    pids = dict(zip(names, ray.get([x.__ray_call__.remote(lambda self: os.getpid()) for x in actors])))

    d1 = ray.get(trainer.publish.remote(1))
    refs = dict(zip(names[1:], [x.update.remote("latest") for x in (s0, s1, s2, stable)]))
    _wait_table(ray, cfg, model_name, lambda t: all(t[ids[n]].state == "reading" for n in ("s0", "s1")),
                "s0 and s1 read")
    for n in ("s0", "s1"):
        os.kill(pids[n], signal.SIGKILL)
    assert [_err(ray, refs[n]) for n in ("s0", "s1")] == ["ActorDiedError"] * 2  # killed mid-read
    for n in ("s2", "stable"):
        st = ray.get(refs[n], timeout=60)
        assert (st["version"], st["digest"]) == (1, d1), n

    d2 = ray.get(trainer.publish.remote(2))
    st = ray.get(s2.update.remote(2), timeout=60)
    assert (st["version"], st["digest"]) == (2, d2)
    os.kill(pids["trainer"], signal.SIGKILL)
    t = _wait_table(ray, cfg, model_name, lambda t: ids["trainer"] not in t, "the server drops the dead trainer")
    assert [(cid, h.spot) for cid, h in t.items() if h.version == 2] == [(ids["s2"], True)]

    rs = stable.update.remote(2)
    t = _wait_table(ray, cfg, model_name, lambda t: t[ids["stable"]].state == "reading", "stable reads 2")
    os.kill(pids["s2"], signal.SIGKILL)
    assert (t[ids["stable"]].version, t[ids["s2"]].readers) == (2, 1)  # stable read from s2, the only holder
    assert [h.version for h in t.values() if h.host] == [1]  # stable kept the last non-spot copy of 1
    assert _err(ray, rs) == "VersionLost"

    scribbled = ray.get(stable.scribble.remote())
    assert scribbled != d1
    st = ray.get(stable.update.remote("latest"), timeout=60)
    assert (st["action"], st["version"], st["bytes"], st["digest"]) == ("replicated", 1, workload.spec_bytes(SPEC), d1)
    ray.get(stable.close.remote())


@pytest.mark.ray
def test_trainer_killed_mid_update_latest_moves_on_to_the_retained_version(ray_cluster, model_name):
    """trainer -> r0: r0 holds 1, the trainer publishes 2, r0 update("latest")s to it (keeping
    the last non-spot copy of 1 in host memory) and the trainer is killed mid-read. Version 2 is
    lost; update("latest") must retry once and land on 1, the newest version still available."""
    ray = ray_cluster
    cfg = _cfg(**SLOW)
    trainer, r0 = spawn_many(model_name, SPEC, ["trainer", "r0"], config=cfg)
    id_t, id_r = ray.get([x.ping.remote() for x in (trainer, r0)])
    pid_t = _pid(ray, trainer)
    d1 = ray.get(trainer.publish.remote(1))
    assert ray.get(r0.update.remote("latest"), timeout=60)["digest"] == d1
    ray.get(trainer.publish.remote(2))
    ref = r0.update.remote("latest")
    t = _wait_table(ray, cfg, model_name, lambda t: t[id_r].state == "reading", "r0 reads 2")
    os.kill(pid_t, signal.SIGKILL)
    assert (t[id_r].version, t[id_t].readers) == (2, 1)  # r0 read 2 from the trainer, its only holder
    assert [h.version for h in t.values() if h.host] == [1]  # r0 kept the last non-spot copy of 1
    st = ray.get(ref, timeout=60)
    assert (st["action"], st["version"], st["digest"]) == ("replicated", 1, d1)
    ray.get(r0.close.remote())


def test_server_killed_mid_run_clients_reconnect_and_nothing_is_lost(ray_cluster, model_name):
    """trainer -> r0 at version 1; the server is killed; the trainer publishes 2 through the
    outage and r0, r1 update to it. Every client reconnected (the new server lists exactly the
    three as publishers of 2) and nothing was lost: version 1, still retained, is read back
    by a fourth replica with exact bytes."""
    ray = ray_cluster
    cfg = _cfg()
    trainer, r0, r1, late = spawn_many(model_name, SPEC, ["trainer", "r0", "r1", "late"], config=cfg)
    d1 = ray.get(trainer.publish.remote(1))
    assert ray.get(r0.update.remote("latest"))["digest"] == d1
    ray.kill(_server(cfg, model_name), no_restart=True)
    # the trainer publishes through the outage; readers keep going
    d2 = ray.get(trainer.publish.remote(2), timeout=60)
    sts = ray.get([r0.update.remote("latest"), r1.update.remote("latest")], timeout=90)
    assert [(s["version"], s["digest"]) for s in sts] == [(2, d2), (2, d2)]
    ids = ray.get([x.ping.remote() for x in (trainer, r0, r1)])  # after any re-registration
    table = _table(ray, cfg, model_name)
    assert sorted(c for c, h in table.items() if not h.host and (h.state, h.version) == ("published", 2)) == sorted(ids)
    st = ray.get(late.replicate.remote(1), timeout=60)
    assert (st["action"], st["version"], st["digest"]) == ("replicated", 1, d1)
    ray.get([x.close.remote() for x in (trainer, r0, r1, late)])
    ray.kill(_server(cfg, model_name), no_restart=True)


def test_short_chaos_run_has_no_corruption_and_no_unexpected_failure(ray_cluster):
    from tensorhub.chaos import run_chaos

    rep = run_chaos(rounds=4, seed=7, rollouts=3, size_mb=8, time_limit_s=300, init_ray=False)
    assert rep["corrupt"] == 0
    assert rep["unexpected"] == []
    assert rep["replicas_verified"] > 0
    assert rep["rounds"] == 4
