"""The server's cost and memory follow its live clients, not the table's history (issue 22, 3).

Each test is a review reproduction (``/work/shared/repro``) turned into a bound. Timing bounds
compare two sizes within one run (the cost at 10,000 clients against the cost at 100, best of
a few tries each), never absolute times: the machine may be a slow, shared VM.

- a removal does not rescan every replica for offload seeding (``declare_dead_rescans_every_replica``);
- a wave of pushed deaths is removed in one pass of the core (``death_wave_blocks_the_server``);
- the round table forgets departed replicas and is not scanned per request (``round_table_never_shrinks``);
- mailboxes of evicted clients are forgotten (``mailboxes_keep_dead_clients_forever``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import random
import time

import pytest

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.reference import ReferenceCore
from tensorhub.core.rounds import DEPARTED_ROUNDS_LEASES, DEPARTED_ROUNDS_MAX
from tensorhub.server.requests import EVICTED_MAILBOXES_MAX, Mailboxes, apply_request

LAY = m.LayoutInfo(fingerprint="f", unit_count=4, total_bytes=4096)
RATIO_MAX = 3.0
"""The goal: an operation at 10,000 clients costs at most 3x what it costs at 100."""


@pytest.fixture(autouse=True)
def _quiet():
    """Removal logs a line per replica; thousands of them would time the log handler."""
    logging.disable(logging.INFO)
    yield
    logging.disable(logging.NOTSET)


def reg(cid, replica, shard=0, num_shards=1, dc="default", spot=False, process=m.ProcessId()):
    return m.Register(client_id=cid, model="policy", replica_id=replica, shard=shard, num_shards=num_shards,
                      layout=LAY, endpoint=cid.encode(), datacenter=dc, spot=spot, process=process)


def ok(core, req, now=0.0):
    reply, effects = core.handle(req, now)
    assert not isinstance(reply, m.ErrorReply), reply
    return reply, effects


def best_of(tries: int, run) -> float:
    return min(run() for _ in range(tries))


def mailboxes(mail: Mailboxes) -> int:
    """Clients with a mailbox."""
    return len(mail.terminal.keys() | mail.background.keys())


def settled() -> None:
    """Before a timed part: the index is flushed by the caller, and the garbage collector's
    full pass over the table just built is done now (not charged to the first removals)."""
    gc.collect()


# ---------------------------------------------------------------------- removal and seeding


def _two_datacenters(n: int) -> ReferenceCore:
    """A trainer in datacenter "a" holding version 1; ``n`` readers, half in "a", half in "b"
    (offload seeding on, the default: "b" has a seeder asked)."""
    core = ReferenceCore(Config(lease_timeout_s=10.0, heartbeat_interval_s=1.0))
    ok(core, reg("T", "trainer", dc="a"))
    ok(core, m.Publish("T", 1))
    for i in range(n):
        ok(core, reg(f"r{i}", f"r{i}", dc="ab"[i % 2], spot=i % 3 == 0))
    core.index.flush()
    return core


def _per_death_s(n: int, batches: int = 10, per_batch: int = 4) -> float:
    """Seconds per ``declare_dead`` of one client (the best batch of ``per_batch``): alternately
    a reader of "a" (the datacenter that holds the version) and the seeder asked in "b"
    (another replica there takes over)."""
    core = _two_datacenters(n)
    mod = core.models["policy"]
    assert mod.seed_asked["b"][1], "datacenter b has a seeder asked"
    victims = iter(f"r{i}" for i in range(0, n, 2))
    settled()
    best = float("inf")
    for _ in range(batches):
        t0 = time.perf_counter()
        for k in range(per_batch):
            cid = next(victims) if k % 2 else mod.seed_asked["b"][1]
            core.declare_dead([cid], 0.0, "gone")
        best = min(best, (time.perf_counter() - t0) / per_batch)
    assert mod.seed_asked["b"][1] in core.nodes, "a live seeder was asked each time"
    return best


def test_a_removal_costs_the_same_at_10000_clients_as_at_100():
    """declare_dead_rescans_every_replica: with offload seeding on, each removal rescanned every
    replica of the model (10 ms per death at 1,000 clients, 123 ms at 10,000). Now the index
    answers what seeding needs: the datacenters the removal concerns, O(shards) each."""
    small = best_of(2, lambda: _per_death_s(100))
    big = best_of(2, lambda: _per_death_s(10_000))
    assert big / small <= RATIO_MAX, f"per removal: {big * 1e6:.0f} us at 10,000 vs {small * 1e6:.0f} us at 100"


def test_seed_candidates_follow_the_table():
    """The seeder index (whole replicas per datacenter, by rank) says what a scan of the
    replicas says, after random registrations and departures of sharded replicas (a replica
    whose shards sit in two datacenters, or that lacks a shard, is no candidate)."""
    rng = random.Random(7)
    core = ReferenceCore(Config(lease_timeout_s=10.0, heartbeat_interval_s=1.0))
    for step in range(600):
        rid = f"x{rng.randrange(40)}"
        shard = rng.randrange(2)
        cid = f"{rid}/{shard}"
        if cid in core.nodes:
            ok(core, m.Leave(cid, drop_last_copy=True))
        else:
            ok(core, reg(cid, rid, shard, 2, dc=rng.choice("ab"), spot=rng.random() < 0.3))
        expect: dict[str, list] = {}
        for (mo, r), ids in core.table.replicas.items():
            nodes = [core.nodes[i] for i in ids]
            if len(nodes) == 2 and len({n.datacenter for n in nodes}) == 1:
                expect.setdefault(nodes[0].datacenter, []).append(
                    (any(n.spot for n in nodes), min(n.order for n in nodes), r))
        got = core.crossdc.candidates.datacenters("policy")
        assert {dc: sorted(v) for dc, v in expect.items()} == got, f"step {step}"


def test_the_seeder_is_idle_before_busy_and_non_spot_before_spot():
    """What the scan chose, the index chooses. Datacenter "b": s0 (spot, idle), b1 (busy: reading
    version 1), b2 (idle), registered in that order. Version 2 is committed in "a": b2 seeds it;
    once b2 is gone, s0 (idle before busy, even a spot one)."""
    core = ReferenceCore(Config(lease_timeout_s=10.0, heartbeat_interval_s=1.0))
    ok(core, reg("T", "trainer", dc="a"))
    ok(core, m.Publish("T", 1))
    ok(core, reg("s0", "s0", dc="b", spot=True))
    ok(core, reg("b1", "b1", dc="b"))
    ok(core, reg("b2", "b2", dc="b"))
    mod = core.models["policy"]
    assert mod.seed_asked["b"][:2] == (1, "s0"), "the only replica of b when it registered"
    ok(core, m.Replicate("b1", 1, seq=1))
    assert core.nodes["b1"].state.value in ("waiting", "reading")
    ok(core, reg("T2", "T2", dc="a"))
    ok(core, m.Publish("T2", 2))
    assert mod.seed_asked["b"][:2] == (2, "b2")
    core.declare_dead(["b2"], 0.0, "gone")
    assert mod.seed_asked["b"][:2] == (2, "s0")


# ---------------------------------------------------------------------- a death wave


def _server_wave_s(n: int, wave: int) -> float:
    """Seconds the real server class (no Ray cluster) spends on Ray pushing the deaths of
    ``wave`` worker processes among ``n`` clients (one client per worker), until all are
    removed; checks that a live client is still served."""
    from tensorhub.server.actor import ReferenceServer
    from tensorhub.auth import Keyring

    srv = ReferenceServer.__ray_actor_class__(dataclasses.asdict(Config(liveness_check_s=0)), "policy")
    core = srv.core
    ok(core, reg("T", "trainer"))
    ok(core, m.Publish("T", 1))
    for i in range(n):
        ok(core, reg(f"r{i}", f"r{i}", spot=i < wave, process=m.ProcessId(job_id="01", worker_id=f"w{i}", pid=i + 1)))
    core.index.flush()
    srv._clients_by("worker_id")  # warm, as when a wave comes: Ray pushes every worker exit of the cluster
    settled()
    t0 = time.perf_counter()
    srv._on_deaths({f"w{i}" for i in range(wave)}, set())
    dt = time.perf_counter() - t0
    assert len(core.nodes) == n + 1 - wave and srv.pushed_deaths == wave
    keys = Keyring()  # a live client's calls are still served, through the gate as a Hub's are

    async def live_client():
        for req in (reg("L", "live"), m.Heartbeat("L")):
            reply = m.decode_reply(await srv.call(m.encode(keys.sign(req)), 0.0))
            assert not isinstance(reply, m.ErrorReply), reply

    asyncio.run(live_client())
    return dt


def test_a_wave_of_pushed_deaths_costs_per_death_what_a_small_one_does():
    """death_wave_blocks_the_server: 1,000 pushed deaths among 10,000 clients blocked the
    server's event loop for 27 s (one rescanning removal each). Now the wave is removed in one
    pass (``declare_gone``) whose cost per death does not grow with the table."""
    small = best_of(5, lambda: _server_wave_s(100, 10)) / 10
    big = best_of(2, lambda: _server_wave_s(10_000, 1_000)) / 1_000
    assert big / small <= RATIO_MAX, f"per death: {big * 1e6:.0f} us in a wave of 1,000 among 10,000, " \
                                     f"{small * 1e6:.0f} us in a wave of 10 among 100"


def test_declare_gone_removes_every_replica_of_a_wave_with_its_reason():
    """One pass over many clients: each replica goes once (a sibling shard listed too is no
    second removal), each client hears its own replica's reason, unknown ids are ignored."""
    core = ReferenceCore(Config(lease_timeout_s=10.0, heartbeat_interval_s=1.0))
    for s in (0, 1):
        ok(core, reg(f"a/{s}", "a", s, 2))
        ok(core, reg(f"b/{s}", "b", s, 2))
    effects = core.declare_gone({"a/0": "node 1 died", "a/1": "node 1 died", "b/1": "worker 7 died", "zz": "?"}, 0.0)
    assert not core.nodes
    assert sorted((e.client_id, e.event.reason) for e in effects) == [
        ("a/0", "node 1 died"), ("a/1", "node 1 died"), ("b/0", "worker 7 died"), ("b/1", "worker 7 died")]


def test_death_watch_hands_a_wave_over_in_one_call():
    """Batches that arrive on the worker and node channels before the loop's next callback
    reach the server as one ``on_deaths``: it removes them in one pass."""
    from types import SimpleNamespace as NS

    from tensorhub.server.liveness import DeathWatch

    got = []

    async def main():
        w = DeathWatch(lambda workers, nodes: got.append((workers, nodes)))
        w._workers([(b"k", NS(worker_id=b"\x01"))])
        w._workers([(b"k", NS(worker_id=b"\x02"))])
        w._nodes([(b"k", NS(node_id=b"\x0a", state=1)), (b"k", NS(node_id=b"\x0b", state=0))], 1)
        await asyncio.sleep(0)
        w._workers([(b"k", NS(worker_id=b"\x03"))])
        await asyncio.sleep(0)

    asyncio.run(main())
    assert got == [({"01", "02"}, {"0a"}), ({"03"}, set())]


# ---------------------------------------------------------------------- the round table


def _round_cost_s(departed: int, k: int = 100) -> tuple[float, ReferenceCore]:
    """Seconds per Register/Replicate of a new sharded replica (the best of ``k``) after
    ``departed`` replicas did one round each and left."""
    core = ReferenceCore(Config(lease_timeout_s=10.0, heartbeat_interval_s=1.0, offload_seeding=False))
    for s in (0, 1):
        ok(core, reg(f"T{s}", "trainer", s, 2))
        ok(core, m.Publish(f"T{s}", 1))
    for i in range(departed):
        for s in (0, 1):
            ok(core, reg(f"r{i}/{s}", f"r{i}", s, 2, spot=True))
        for s in (0, 1):
            ok(core, m.Replicate(f"r{i}/{s}", "latest", seq=1))
            ok(core, m.ReplicateAbort(f"r{i}/{s}"))
        for s in (0, 1):
            ok(core, m.Leave(f"r{i}/{s}", drop_last_copy=True))
    settled()
    best = float("inf")
    for i in range(k):
        t0 = time.perf_counter()
        for s in (0, 1):
            ok(core, reg(f"n{i}/{s}", f"n{i}", s, 2, spot=True))
        for rnd in (1, 2, 3):
            for s in (0, 1):
                ok(core, m.Replicate(f"n{i}/{s}", "latest", seq=rnd))
                ok(core, m.ReplicateAbort(f"n{i}/{s}"))
        best = min(best, (time.perf_counter() - t0) / (2 * 4))
    return best, core


def test_register_and_replicate_cost_the_same_after_thousands_of_departed_replicas():
    """round_table_never_shrinks: every Register and every new round scanned the whole round
    table, which kept every departed replica's rounds (89 us per call with none departed, 1.8 ms
    with 20,000). Now a replica's rounds are found by replica, and departed ones are bounded."""
    small = best_of(3, lambda: _round_cost_s(0)[0])
    big, core = _round_cost_s(6_000)
    assert big / small <= RATIO_MAX, f"per call: {big * 1e6:.0f} us after 6,000 departed, {small * 1e6:.0f} us after none"
    assert core.txns.departed_count() <= DEPARTED_ROUNDS_MAX
    assert len(core.txns) <= DEPARTED_ROUNDS_MAX + 2 * 100  # the departed kept, and the live replicas' rounds


def test_departed_rounds_are_forgotten_after_the_bound_and_a_returning_replica_keeps_them():
    """A departed replica's rounds stay for ``DEPARTED_ROUNDS_LEASES`` leases: a shard that
    restarts within them counts on from its replica's round; after them it starts as a new
    replica (round 0), and so do its siblings. A replica with a client back keeps its rounds."""
    lease = 10.0
    core = ReferenceCore(Config(lease_timeout_s=lease, heartbeat_interval_s=1.0, offload_seeding=False))
    for s in (0, 1):
        ok(core, reg(f"T{s}", "trainer", s, 2))
        ok(core, m.Publish(f"T{s}", 1))
    for rid in ("gone", "back"):
        for s in (0, 1):
            ok(core, reg(f"{rid}/{s}", rid, s, 2))
        for rnd in (1, 2, 3):
            for s in (0, 1):
                ok(core, m.Replicate(f"{rid}/{s}", "latest", seq=rnd))
                ok(core, m.ReplicateAbort(f"{rid}/{s}"))
        core.declare_dead([f"{rid}/0"], 0.0, "node died")
    assert not core.table.replicas.get(("policy", "gone")) and core.txns.departed_count() == 2
    reply, _ = ok(core, reg("back/0", "back", 0, 2), now=1.0)  # within the bound
    assert reply == m.Registered(round_seq=3)
    bound = DEPARTED_ROUNDS_LEASES * lease
    for now in (bound - 1.0, bound + 2.0):  # the trainer heartbeats: only the departed go
        for s in (0, 1):
            ok(core, m.Heartbeat(f"T{s}"), now)
        ok(core, m.Heartbeat("back/0"), now)
        core.tick(now)
    assert core.txns.departed_count() == 0
    assert set(core.txns.of("policy", "back")) == {3} and not core.txns.of("policy", "gone")
    for s in (0, 1):
        reply, _ = ok(core, reg(f"gone/{s}", "gone", s, 2), now=bound + 2.0)
        assert reply == m.Registered(round_seq=0), "a forgotten replica starts anew, every shard alike"


def test_departed_rounds_are_bounded_in_count():
    """More departures than ``kept_max`` at one moment: the oldest departures' rounds go first."""
    from tensorhub.core.rounds import RoundTable

    t = RoundTable(kept_s=100.0, kept_max=3)
    for i in range(5):
        t[("m", f"r{i}", 1)] = ("latest", 1, {0})
        t.departed("m", f"r{i}", float(i))
    assert len(t) == 3 and [k[1] for k in t] == ["r2", "r3", "r4"]
    t.returned("m", "r2")
    t.prune(103.5)  # r3 (departed at 3) is past 100 s, r4 is not, r2 is back
    assert [k[1] for k in t] == ["r2", "r4"] and t.departed_count() == 1


# ---------------------------------------------------------------------- mailboxes


def test_mailboxes_of_dead_clients_are_forgotten():
    """mailboxes_keep_dead_clients_forever: 12,000 deaths left 12,000 mailboxes (each with the
    ``Evicted`` nobody would read). Now at most ``EVICTED_MAILBOXES_MAX`` evicted clients keep
    one; a client that registered again keeps its own."""
    core = ReferenceCore(Config(lease_timeout_s=10.0, heartbeat_interval_s=1.0))
    mail = Mailboxes()
    now = 0.0
    apply_request(core, mail, reg("T", "trainer"), now)
    apply_request(core, mail, m.Publish("T", 1), now)
    apply_request(core, mail, reg("keep", "keep", spot=True), now)
    mail.route(core.declare_dead(["keep"], now, "gone"))  # evicted once ...
    apply_request(core, mail, reg("keep", "keep", spot=True), now)  # ... and back
    mail.route([m.Deliver("keep", m.SeedAhead(version=1))])
    for wave in range(5):  # spot waves preempted: silent until their leases run out
        for i in range(2000):
            apply_request(core, mail, reg(f"s{wave}-{i}", f"s{wave}-{i}", spot=True), now)
        now += 11.0
        apply_request(core, mail, m.Heartbeat("T"), now)
        apply_request(core, mail, m.Heartbeat("keep"), now)
        mail.route(core.tick(now))
    for i in range(2000):  # and pushed deaths
        apply_request(core, mail, reg(f"x{i}", f"x{i}", spot=True), now)
    mail.route(core.declare_dead([f"x{i}" for i in range(2000)], now, "process gone"))
    assert len(core.nodes) == 2
    assert mailboxes(mail) <= EVICTED_MAILBOXES_MAX + 1
    # its registration again dropped the Evicted of the one before (not news to a live client)
    assert mail.pop_background("keep") == [m.SeedAhead(version=1)]
    assert mail.pop_background("x1999") == [m.Evicted(reason="process gone")], "the newest evictions are kept"


def test_the_churn_figure_of_server_scale_runs_every_operation():
    """``benchmarks/server_scale.py``'s churn part (every core operation with live and departed
    clients) runs at a small size and times each operation it names."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "server_scale.py"
    spec = importlib.util.spec_from_file_location("server_scale", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.churn_round(100, 200, k=10)
    assert set(out) == set(bench.CHURN_OPS) and all(us > 0 for us in out.values())


def test_departed_clients_leave_nothing_behind_after_the_bound():
    """The server's memory follows its live clients: after 1,500 sharded replicas each did a
    round and went (left, died, or fell silent), and the bound passed, no table of the core
    holds more than the live clients' entries, and the mailboxes at most the bounded evicted."""
    lease = 10.0
    core = ReferenceCore(Config(lease_timeout_s=lease, heartbeat_interval_s=1.0))
    mail = Mailboxes()
    live = [f"live{i}" for i in range(50)]

    def send(req, now):
        reply, _ = apply_request(core, mail, req, now)
        assert not isinstance(reply, m.ErrorReply), reply

    for s in (0, 1):
        send(reg(f"T/{s}", "trainer", s, 2, dc="a"), 0.0)
        send(m.Publish(f"T/{s}", 1), 0.0)
    for j, rid in enumerate(live):
        for s in (0, 1):
            send(reg(f"{rid}/{s}", rid, s, 2, dc="ab"[j % 2]), 0.0)
    now = 0.0
    for i in range(1500):
        rid = f"d{i}"
        for s in (0, 1):
            send(reg(f"{rid}/{s}", rid, s, 2, dc="ab"[i % 2], spot=True), now)
        for s in (0, 1):
            send(m.Replicate(f"{rid}/{s}", "latest", seq=1), now)
        if i % 3 == 0:
            mail.route(core.declare_dead([f"{rid}/0"], now, "worker died"))
        elif i % 3 == 1:
            for s in (0, 1):
                send(m.ReplicateAbort(f"{rid}/{s}"), now)
                send(m.Leave(f"{rid}/{s}", drop_last_copy=True), now)
        if i % 100 == 99:  # time passes; the live fleet heartbeats, the silent third expires
            now += 1.0
            for cid in [f"T/{s}" for s in (0, 1)] + [f"{r}/{s}" for r in live for s in (0, 1)]:
                send(m.Heartbeat(cid), now)
            mail.route(core.tick(now))
    end = now + DEPARTED_ROUNDS_LEASES * lease + 2 * lease
    while now < end:
        now += 1.0
        for cid in [f"T/{s}" for s in (0, 1)] + [f"{r}/{s}" for r in live for s in (0, 1)]:
            send(m.Heartbeat(cid), now)
        mail.route(core.tick(now))
    clients = 2 + 2 * len(live)
    assert len(core.nodes) == clients
    for owner, fields in ((core, vars(core)), (core.index, vars(core.index))):
        for name, value in fields.items():
            if hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
                assert len(value) <= clients, f"{type(owner).__name__}.{name} holds {len(value)} entries"
    assert core.txns.departed_count() == 0
    assert mailboxes(mail) <= clients + EVICTED_MAILBOXES_MAX
