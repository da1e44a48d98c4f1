"""What one reference server costs per client, at 100 to 10,000 clients of one model.

Core part (no Ray): ``ReferenceCore.handle`` driven directly, one model, one trainer holding
version 1, N single-shard readers. Per N, microseconds per operation, averaged over the N
operations of one round (so a cost that grows with the table shows as growth with N), median
of ``--reps`` rounds:

- ``Register``: N readers register one after another (the table grows from 1 to N + 1);
- ``Replicate``: every reader asks for ``"latest"`` (a storm; with the default
  ``readers_per_source_max = 1`` they form the pipeline ``trainer -> r1 -> r2 -> ... -> rN``);
- ``ReplicateDone``: every reader finishes, in pipeline order;
- ``Heartbeat+tick``: one reader's heartbeat followed by one ``tick`` (lease expiry), for
  ``min(N, 2000)`` readers.

Ray part (``--ray``, see ``ray_part``): load-generator processes send raw protocol messages to
a real ``ReferenceServer`` actor standing in for 10,000 clients at the default config. They are
all clients of one model, so this is one model's server; with ``server_per_model`` (default)
other models' fleets load their own servers, not this one.

Isolation part (``--isolation``, see ``isolation_part``): one model's fleet saturates its server
while a client of a second model times its own calls, with a server per model
(``server_per_model``, the default) and with one server for both.

Churn part (no Ray, always run; see ``churn_round``): every core operation (``CHURN_OPS``) with
``--churn-live`` live clients plus ``--churn-departed`` departed ones (sharded replicas that did
a round and died), against its cost with 100 live clients and none departed:
``core_churn_us`` = {op: {"100": us, "<live>+<departed>": us}} and ``core_churn_ratio`` = {op:
ratio} (the goal: at most 3 at 10,000 + 20,000).

Death-wave part (``--death-wave``, see ``death_wave_part``): a real ``ReferenceServer`` with
``--clients`` clients, ``--wave`` of them hosted by ``--wave-processes`` Ray actors that are
killed at once: ``death_wave_s``, from the kill until Ray pushed the deaths, the server removed
every one of those clients and it answered a live client's call (the goal: at most 0.5 s).

Last stdout line: one JSON object, ``core_us`` = {op: {N: microseconds}} and the churn figures
(and, with ``--ray``, ``steady_busy_fraction_10k`` and ``storm_10k_s``; with ``--isolation``,
``isolation_ms``; with ``--death-wave``, ``death_wave_s``). Human lines go to stderr.

    python benchmarks/server_scale.py --json [--sizes 100,1000,10000] [--ray] [--isolation] [--death-wave]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time

OPS = ("Register", "Replicate", "ReplicateDone", "Heartbeat+tick")


def _signed(req) -> bytes:
    """``req`` encoded as a Hub's port sends it, with the capability of every client it acts for
    (docs/security.md): drawn from the client id, so every process of the benchmark agrees."""
    import hashlib

    from tensorhub.auth import acts_for
    from tensorhub.core import messages as m

    caps = {cid: hashlib.sha256(b"bench\0" + cid.encode()).digest() for cid in acts_for(req)}
    return m.encode(m.Signed(request=req, caps=caps))


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def core_round(n: int) -> dict[str, float]:
    """One storm of ``n`` readers against a fresh core; microseconds per operation."""
    from tensorhub.config import Config
    from tensorhub.core import messages as m
    from tensorhub.core.reference import ReferenceCore

    layout = m.LayoutInfo("fp", 4, 4 << 20, (m.TensorMeta("w", "float32", (1 << 20,), 4 << 20),))
    core = ReferenceCore(Config())
    clock = [0.0]

    def send(req):
        clock[0] += 1e-6  # virtual time moves on, far below any lease
        reply, _ = core.handle(req, clock[0])
        assert not isinstance(reply, m.ErrorReply), reply
        return reply

    send(m.Register("t", "pol", "t", 0, 1, layout, b"t"))
    send(m.Publish("t", 1))
    ids = [f"r{i}" for i in range(n)]
    out = {}

    t0 = time.perf_counter()
    for cid in ids:
        send(m.Register(cid, "pol", cid, 0, 1, layout, cid.encode(), machine=f"h{hash(cid) % 64}"))
    out["Register"] = (time.perf_counter() - t0) / n * 1e6

    t0 = time.perf_counter()
    for cid in ids:
        send(m.Replicate(cid, "latest", 1))
    out["Replicate"] = (time.perf_counter() - t0) / n * 1e6
    assert all(core.nodes[c].state.value == "reading" for c in ids), "every reader is assigned"

    t0 = time.perf_counter()
    for cid in ids:
        send(m.ReplicateDone(cid, 1))
    out["ReplicateDone"] = (time.perf_counter() - t0) / n * 1e6
    assert all(core.nodes[c].state.value == "published" for c in ids)

    k = min(n, 2000)
    t0 = time.perf_counter()
    for cid in ids[:k]:
        send(m.Heartbeat(cid))
        clock[0] += 1e-6
        core.tick(clock[0])
    out["Heartbeat+tick"] = (time.perf_counter() - t0) / k * 1e6
    return out


def core_part(sizes: list[int], reps: int) -> dict[str, dict[str, float]]:
    """Per N, the median of ``reps`` rounds (after one warm-up round at the smallest N)."""
    table: dict[str, dict[str, float]] = {op: {} for op in OPS}
    core_round(min(sizes))
    for n in sizes:
        t0 = time.perf_counter()
        rounds = [core_round(n) for _ in range(reps)]
        row = {op: statistics.median(r[op] for r in rounds) for op in OPS}
        for op in OPS:
            table[op][str(n)] = round(row[op], 2)
        say(f"core N={n}: " + ", ".join(f"{op} {row[op]:.1f} us" for op in OPS)
            + f"  ({time.perf_counter() - t0:.1f} s)")
    return table


CHURN_OPS = ("Register", "Replicate", "ReplicateDone", "Heartbeat+tick", "declare_dead", "Leave", "Publish")


def churn_round(live: int, departed: int, k: int = 20) -> dict[str, float]:
    """Microseconds per core operation in a table of ``live`` clients plus ``departed`` gone.

    One model of two shards, offload seeding on (the default), two datacenters: the trainer's
    replica in "a" holds version 1; ``departed // 2`` replicas (alternately in "a" and "b",
    spot) each registered, replicated one round and died (``declare_dead``), then ``live // 2``
    idle replicas registered (alternately in "a" and "b"). Then, ``k`` of each, per call:
    ``Register`` (new replicas' shards), their ``Replicate("latest")`` and ``ReplicateDone``,
    a live client's ``Heartbeat`` plus a ``tick``, the death of a live replica
    (``declare_dead`` of one shard: the replica goes), a live client's ``Leave``, and the
    ``Publish`` of both shards of a new replica holding a new version (its commit asks every
    datacenter's seeder anew). Before each timed part the table just built is collected and
    frozen (``gc.freeze``): the collector's passes over the whole heap grow with every
    long-lived object, whatever the operation, and are not the operation's cost."""
    import gc

    from tensorhub.config import Config
    from tensorhub.core import messages as m
    from tensorhub.core.reference import ReferenceCore

    assert live // 2 >= 2 * k, "enough live replicas for the deaths and leaves"
    layout = m.LayoutInfo("fp", 4, 4 << 20, (m.TensorMeta("w", "float32", (1 << 20,), 4 << 20),))
    core = ReferenceCore(Config())
    clock = [0.0]

    def send(req):
        clock[0] += 1e-6
        reply, _ = core.handle(req, clock[0])
        assert not isinstance(reply, m.ErrorReply), reply
        return reply

    def register(rid: str, dc: str, spot: bool = False) -> None:
        for s in (0, 1):
            send(m.Register(f"{rid}/{s}", "pol", rid, s, 2, layout, rid.encode(), datacenter=dc, spot=spot))

    register("t", "a")
    for s in (0, 1):
        send(m.Publish(f"t/{s}", 1))
    for i in range(departed // 2):
        register(f"d{i}", "ab"[i % 2], spot=True)
        for s in (0, 1):
            send(m.Replicate(f"d{i}/{s}", "latest", 1))
        core.declare_dead([f"d{i}/0"], clock[0], "gone")
    for i in range(live // 2):
        register(f"r{i}", "ab"[i % 2])
    out: dict[str, float] = {}

    def timed(op: str, calls: int, body) -> None:
        core.index.flush()
        gc.collect()
        gc.freeze()
        try:
            t0 = time.perf_counter()
            body()
            out[op] = (time.perf_counter() - t0) / calls * 1e6
        finally:
            gc.unfreeze()

    new = [f"n{j}" for j in range(k)]
    timed("Register", 2 * k, lambda: [register(rid, "ab"[j % 2]) for j, rid in enumerate(new)])
    timed("Replicate", 2 * k, lambda: [send(m.Replicate(f"{rid}/{s}", "latest", 1)) for rid in new for s in (0, 1)])
    timed("ReplicateDone", 2 * k, lambda: [send(m.ReplicateDone(f"{rid}/{s}", core.nodes[f"{rid}/{s}"].version))
                                           for rid in new for s in (0, 1)])

    def beats() -> None:
        for j in range(k):
            send(m.Heartbeat(f"r{j}/0"))
            clock[0] += 1e-6
            core.tick(clock[0])

    timed("Heartbeat+tick", k, beats)
    timed("declare_dead", k, lambda: [core.declare_dead([f"r{j}/0"], clock[0], "gone") for j in range(k)])
    timed("Leave", k, lambda: [send(m.Leave(f"r{k + j}/0", drop_last_copy=True)) for j in range(k)])

    for j in range(k):
        register(f"p{j}", "a")
    timed("Publish", 2 * k, lambda: [send(m.Publish(f"p{j}/{s}", 2 + j)) for j in range(k) for s in (0, 1)])
    return out


def churn_part(live: int, departed: int, reps: int) -> dict:
    """``core_churn_us`` (best of ``reps`` rounds per size) and ``core_churn_ratio``."""
    big = f"{live}+{departed}"
    rows = {"100": [churn_round(100, 0) for _ in range(reps)], big: [churn_round(live, departed) for _ in range(reps)]}
    us = {op: {size: round(min(r[op] for r in rounds), 2) for size, rounds in rows.items()} for op in CHURN_OPS}
    ratio = {op: round(us[op][big] / max(us[op]["100"], 1e-9), 2) for op in CHURN_OPS}
    say(f"churn ({big} vs 100): " + ", ".join(f"{op} {us[op][big]:.0f}/{us[op]['100']:.0f} us = {ratio[op]}x"
                                            for op in CHURN_OPS))
    return {"core_churn_us": us, "core_churn_ratio": ratio, "core_churn_ratio_max": max(ratio.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,1000,10000", help="reader counts for the core part")
    ap.add_argument("--reps", type=int, default=3, help="core rounds per N (the median is reported)")
    ap.add_argument("--ray", action="store_true", help="also run the Ray part (10,000 simulated clients)")
    ap.add_argument("--clients", type=int, default=10_000, help="Ray part: simulated clients")
    ap.add_argument("--generators", type=int, default=4, help="Ray part: load-generator processes")
    ap.add_argument("--steady-s", type=float, default=60.0, help="Ray part: steady-state window measured (after one hold)")
    ap.add_argument("--handles-per-process", type=int, default=1,
                    help="Ray part, steady state: handles one process hosts (its pulse carries them all)")
    ap.add_argument("--isolation", action="store_true",
                    help="also time a second model's calls while the first model's fleet saturates its server")
    ap.add_argument("--isolation-s", type=float, default=5.0, help="isolation part: seconds of load per mode")
    ap.add_argument("--churn-live", type=int, default=10_000, help="churn part: live clients")
    ap.add_argument("--churn-departed", type=int, default=20_000, help="churn part: departed clients")
    ap.add_argument("--churn-reps", type=int, default=3, help="churn part: rounds per size (the best is reported)")
    ap.add_argument("--death-wave", action="store_true",
                    help="also run the death wave (--wave of --clients die at once, pushed by Ray)")
    ap.add_argument("--wave", type=int, default=1_000, help="death wave: clients that die")
    ap.add_argument("--wave-processes", type=int, default=10, help="death wave: the Ray actors hosting them")
    ap.add_argument("--json", action="store_true", help="no extra human output (the JSON line is printed either way)")
    args = ap.parse_args()

    sizes = [int(s) for s in args.sizes.split(",") if s]
    summary: dict = {"name": "server_scale", "core_us": core_part(sizes, args.reps)}
    big, small = str(max(sizes)), str(min(sizes))
    summary["core_ratio_max_over_min"] = {
        op: round(summary["core_us"][op][big] / summary["core_us"][op][small], 2) for op in OPS
    }
    summary.update(churn_part(args.churn_live, args.churn_departed, args.churn_reps))
    if args.ray:
        summary.update(ray_part(args))
    if args.death_wave:
        summary.update(death_wave_part(args))
    if args.isolation:
        summary["isolation_ms"] = isolation_part(args)
    print(json.dumps(summary), flush=True)
    return 0


def ray_part(args) -> dict:
    """A real ReferenceServer actor and ``--generators`` load-generator actors that stand in for
    ``--clients`` clients with raw protocol messages (no tensors, no client library):

    - capacity: calls/s the server answers when pipelined heartbeats keep it busy;
    - the fleet starts: every process registers its handles at once (``register_10k_s``: until
      the last is answered) and, as a ``Hub`` does, pulses from its own registration on;
    - steady state, right after the clients registered: every process does what the ``Hub``'s
      liveness loop does at the default config while idle: one ``Pulse`` carrying the
      heartbeats of its ``--handles-per-process`` handles, held by the server up to
      ``pulse_hold_s`` (the reply brings their background events: no notes poll), the next one
      as soon as it returns (at most one per ``heartbeat_interval_s``). Measured over
      ``--steady-s`` once the first round of held pulses has come back: calls/s achieved and
      the server process's CPU seconds per wall second. Busy fraction: the larger of calls/s
      over capacity calls/s and the server's CPU over its CPU at capacity (above 1 the server
      is saturated);
    - ``steady_clients_expired``: the clients whose lease ran out from the fleet's start to the
      end of the steady state (a pulse answered with them unknown: the server declared them
      dead although they pulsed; a server that falls behind must stretch leases by its
      backlog, not expire its fleet); they register again. ``steady_server_behind_max_s``: the
      most the server found itself behind in reading its queue so far (``port.Backlog``);
      ``register_shed``: registrations the server refused ``ServerBusy`` while behind (they
      pause as asked and register again, as ``Hub.register`` does);
    - then the storm: a trainer publishes a new version and every client sends
      ``Replicate("latest")`` at once, while the trainer heartbeats once per interval (its
      heartbeats wait in the same queue); seconds from the first send to the last
      ``Assignment`` received, and ``storm_assigned``: how many were assigned (all of them
      unless a lease, the trainer's included, ran out); ``storm_server_behind_max_s`` as above,
      through the storm.
    """
    import os
    import uuid

    import ray

    from tensorhub.server.find import server_handle
    from tensorhub.server.naming import actor_name
    from tensorhub.config import Config
    from tensorhub.core import messages as m

    ns = f"tensorhub-bench-scale-{uuid.uuid4().hex[:6]}"
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    # address="local": a cluster of our own, never one another user started on this machine.
    ray.init(address="local", namespace=ns, num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})
    config = Config(server_name="tensorhub-bench-scale", namespace=ns)
    server = server_handle(config, "pol")  # the one model's own server (server_per_model)
    pid = ray.get(server.__ray_call__.remote(lambda self: os.getpid()))
    tick_hz = os.sysconf("SC_CLK_TCK")

    def cpu_s() -> float:
        """The server process's user + system CPU seconds (Linux /proc), all its threads."""
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick_hz

    n, g = args.clients, args.generators
    ids = [f"c{i}" for i in range(n)]
    gens = [LoadGen.remote(actor_name(config, "pol"), ns, ids[i::g]) for i in range(g)]
    out: dict = {"clients": n, "generators": g, "heartbeat_interval_s": config.heartbeat_interval_s}

    # capacity: pipelined heartbeats from every generator (clients unknown: answered UnknownClient,
    # the same path through the actor as a heartbeat)
    ray.get([gen.burst.remote("Heartbeat", 50) for gen in gens])  # warm up: workers, connections
    t0, c0 = time.perf_counter(), cpu_s()
    done = sum(ray.get([gen.burst.remote("Heartbeat", 10_000 // g) for gen in gens]))
    wall = time.perf_counter() - t0
    out["capacity_calls_per_s"] = round(done / wall, 1)
    out["capacity_server_cpu_fraction"] = round((cpu_s() - c0) / wall, 3)
    say(f"capacity: {out['capacity_calls_per_s']} calls/s (server CPU {out['capacity_server_cpu_fraction']})")

    per = max(1, args.handles_per_process)
    hold = config.pulse_hold_s
    # The fleet starts: every process registers its handles and pulses from then on, as a Hub
    # does (a client whose registration was answered early pulses while the others wait).
    t0 = time.perf_counter()
    bad = [c for errs in ray.get([gen.fleet.remote(config.heartbeat_interval_s, per, hold) for gen in gens])
           for c in errs]
    assert not bad, bad[:3]
    out["register_10k_s"] = round(time.perf_counter() - t0, 3)
    say(f"registered {n} clients in {out['register_10k_s']} s")

    warm = hold + 2 * config.heartbeat_interval_s if hold else config.heartbeat_interval_s
    # the server's CPU over the counted window only: sampled by a timer thread
    cpu_marks: dict = {}

    def mark(key: str, at: float) -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        cpu_marks[key] = (time.perf_counter(), cpu_s())

    start = time.monotonic()
    marks = [threading.Thread(target=mark, args=(k, start + dt), daemon=True)
             for k, dt in (("from", warm), ("to", warm + args.steady_s))]
    for t in marks:
        t.start()
    stats = ray.get([gen.steady.remote(args.steady_s, warm) for gen in gens])
    for t in marks:
        t.join()
    wall = cpu_marks["to"][0] - cpu_marks["from"][0]
    calls = sum(s["calls"] for s in stats)
    processes = sum(s["processes"] for s in stats)
    out["steady_handles_per_process"] = per
    out["steady_pulse_hold_s"] = hold
    out["steady_server_cpu_fraction"] = round((cpu_marks["to"][1] - cpu_marks["from"][1]) / wall, 3)
    out["steady_offered_calls_per_s"] = round(processes / (hold or config.heartbeat_interval_s), 1)
    out["steady_achieved_calls_per_s"] = round(calls / args.steady_s, 1)
    # The server's time the clients take: calls/s x seconds per call at capacity, and its CPU
    # against its CPU at capacity (this one also counts the ticks that stamp held handles).
    # The larger is the headline.
    by_calls = max(out["steady_offered_calls_per_s"], out["steady_achieved_calls_per_s"]) / out["capacity_calls_per_s"]
    by_cpu = out["steady_server_cpu_fraction"] / max(out["capacity_server_cpu_fraction"], 1e-9)
    out["steady_busy_by_calls"] = round(by_calls, 3)
    out["steady_busy_by_cpu"] = round(by_cpu, 3)
    out["steady_busy_fraction_10k"] = round(max(by_calls, by_cpu), 3)
    out["steady_late_rounds"] = sum(s["late"] for s in stats)
    out["steady_clients_expired"] = sum(s["expired"] for s in stats)
    counts = ray.get(server.counts.remote())
    out["steady_server_behind_max_s"] = round(counts.get("behind_max_ms", 0) / 1000, 3)
    out["register_shed"] = counts.get("shed", 0)
    say(f"steady: busy fraction {out['steady_busy_fraction_10k']} (calls {out['steady_busy_by_calls']}, CPU "
        f"{out['steady_busy_by_cpu']}), server CPU {out['steady_server_cpu_fraction']} of a core, "
        f"{out['steady_achieved_calls_per_s']} of {out['steady_offered_calls_per_s']} calls/s offered "
        f"(hold {hold} s); late rounds {out['steady_late_rounds']}, clients whose lease ran out "
        f"{out['steady_clients_expired']}; the server was behind by up to {out['steady_server_behind_max_s']} s; "
        f"registrations shed {out['register_shed']}")

    layout = m.LayoutInfo("fp", 4, 4 << 20, (m.TensorMeta("w", "float32", (1 << 20,), 4 << 20),))
    for req in (m.Register("trainer", "pol", "trainer", 0, 1, layout, b"t"), m.Publish("trainer", 1)):
        assert not isinstance(m.decode_reply(ray.get(server.call.remote(_signed(req)))), m.ErrorReply)
    stop = threading.Event()

    def trainer_alive() -> None:  # the trainer heartbeats as a Hub would (it roots the pipeline)
        while not stop.wait(config.heartbeat_interval_s):
            server.call.remote(_signed(m.Heartbeat("trainer")))

    threading.Thread(target=trainer_alive, daemon=True).start()
    t0 = time.time()
    spans = ray.get([gen.send_all.remote("Replicate") for gen in gens])
    stop.set()
    out["storm_10k_s"] = round(max(end for _, end, _, _ in spans) - t0, 3)
    out["storm_assigned"] = sum(k for _, _, k, _ in spans)
    out["storm_errors"] = sorted({c for *_, errs in spans for c in errs})
    out["storm_server_behind_max_s"] = round(ray.get(server.counts.remote()).get("behind_max_ms", 0) / 1000, 3)
    say(f"storm: {out['storm_assigned']} of {n} Replicates assigned in {out['storm_10k_s']} s "
        f"(errors: {out['storm_errors'] or 'none'}); the server was behind by up to {out['storm_server_behind_max_s']} s")

    ray.kill(server)
    ray.shutdown()
    return out


def death_wave_part(args) -> dict:
    """A real ReferenceServer actor (liveness on: Ray's pushed deaths) with ``--clients``
    clients registered by raw protocol messages, in two datacenters, a trainer in the first
    holding version 1. ``--wave`` of the clients name one of ``--wave-processes`` Ray actors as
    their process (a process hosting many handles, as on a node of many engines); all those
    actors are killed at once. ``death_wave_s``: from the kill until the server has removed
    every client of the wave (``pushed_deaths``, polled every 5 ms) and then answered a live
    client's heartbeat; ``death_wave_first_s``: until the first removal was seen (Ray's push:
    its latency is Ray's, 0.3-1 s on a loaded VM); ``death_wave_after_push_s``: the rest (the
    server's own part, at most). The lease is long (120 s) so that no client expires meanwhile: what removes the
    wave is Ray's push alone."""
    import os
    import uuid

    import ray

    from tensorhub.server.find import server_handle
    from tensorhub.config import Config
    from tensorhub.core import messages as m

    ns = f"tensorhub-bench-wave-{uuid.uuid4().hex[:6]}"
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    ray.init(address="local", namespace=ns, num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})
    config = Config(server_name="tensorhub-bench-wave", namespace=ns, lease_timeout_s=120.0)
    server = server_handle(config, "pol")
    n, wave, procs = args.clients, min(args.wave, args.clients), max(1, args.wave_processes)

    @ray.remote(num_cpus=0)
    class Victim:
        def process(self):
            from tensorhub.server.liveness import current_process

            return current_process()

    victims = [Victim.remote() for _ in range(procs)]
    processes = ray.get([v.process.remote() for v in victims])
    layout = m.LayoutInfo("fp", 4, 4 << 20, (m.TensorMeta("w", "float32", (1 << 20,), 4 << 20),))

    def call(req):
        return m.decode_reply(ray.get(server.call.remote(_signed(req), 0.0)))

    for req in (m.Register("trainer", "pol", "trainer", 0, 1, layout, b"t", datacenter="a"), m.Publish("trainer", 1)):
        assert not isinstance(call(req), m.ErrorReply)
    t0 = time.perf_counter()
    regs = [m.Register(f"c{i}", "pol", f"c{i}", 0, 1, layout, b"c", datacenter="ab"[i % 2], spot=i < wave,
                       process=processes[i % procs] if i < wave else m.ProcessId()) for i in range(n)]
    for lo in range(0, n, 1000):
        replies = ray.get([server.call.remote(_signed(r), 0.0) for r in regs[lo:lo + 1000]])
        assert not any(isinstance(m.decode_reply(r), m.ErrorReply) for r in replies)
    say(f"death wave: {n} clients registered in {time.perf_counter() - t0:.1f} s; killing {procs} processes "
        f"hosting {wave} of them")
    before = ray.get(server.counts.remote())["pushed_deaths"]
    t0 = time.perf_counter()
    for v in victims:
        ray.kill(v, no_restart=True)
    removed, first = before, None
    while removed - before < wave and time.perf_counter() - t0 < 60.0:
        removed = ray.get(server.counts.remote())["pushed_deaths"]
        if first is None and removed > before:
            first = time.perf_counter() - t0
        if removed - before < wave:
            time.sleep(0.005)
    live = call(m.Heartbeat(f"c{n - 1}"))
    out = {"death_wave_s": round(time.perf_counter() - t0, 3), "death_wave_removed": removed - before,
           "death_wave_first_s": round(first, 3) if first is not None else None,
           "death_wave_after_push_s": round(time.perf_counter() - t0 - first, 3) if first is not None else None,
           "death_wave_clients": n, "death_wave_processes": procs, "death_wave_live_reply": type(live).__name__}
    st = m.decode_reply(ray.get(server.status.remote("pol")))
    out["death_wave_clients_left"] = len(st.models[0].holders) if st.models else 0
    say(f"death wave: {out['death_wave_removed']} of {wave} removed and a live client answered in "
        f"{out['death_wave_s']} s ({out['death_wave_clients_left']} clients left)")
    ray.kill(server)
    ray.shutdown()
    return out


def isolation_part(args) -> dict:
    """Per mode (``per_model``: a server per model; ``shared``: one server for both), the
    milliseconds of a ``Heartbeat`` of a registered client of model "small" (p50 and p99 of
    sequential calls), first idle, then while ``--generators`` load generators keep model
    "big"'s server saturated with pipelined calls (200 in flight each). With a server per model
    the big fleet's queue is not in the small model's way; on a shared server it is."""
    import os
    import uuid

    import ray

    from tensorhub.server.find import server_handle
    from tensorhub.server.naming import actor_name
    from tensorhub.config import Config
    from tensorhub.core import messages as m

    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    ray.init(address="local", namespace=f"tensorhub-bench-iso-{uuid.uuid4().hex[:6]}", num_cpus=4,
             include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    ns = ray.get_runtime_context().namespace
    layout = m.LayoutInfo("fp", 4, 4 << 20, (m.TensorMeta("w", "float32", (1 << 20,), 4 << 20),))

    def timed(server, count: int) -> list[float]:
        data = _signed(m.Heartbeat("small-0"))
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            reply = m.decode_reply(ray.get(server.call.remote(data, 0.0)))
            out.append((time.perf_counter() - t0) * 1e3)
            assert not isinstance(reply, m.ErrorReply), reply
        return sorted(out)

    def pct(xs: list[float], q: float) -> float:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)

    result = {}
    for mode, per_model in (("per_model", True), ("shared", False)):
        config = Config(server_name=f"tensorhub-bench-iso-{mode}", namespace=ns, server_per_model=per_model)
        big, small = server_handle(config, "big"), server_handle(config, "small")
        reply = m.decode_reply(ray.get(small.call.remote(_signed(m.Register("small-0", "small", "small-0", 0, 1, layout, b"s")))))
        assert not isinstance(reply, m.ErrorReply), reply
        idle = timed(small, 200)
        gens = [LoadGen.remote(actor_name(config, "big"), ns, [f"c{i}"]) for i in range(args.generators)]
        ray.get([g.burst.remote("Heartbeat", 50) for g in gens])  # warm up
        loads = [g.hammer.remote(args.isolation_s) for g in gens]
        time.sleep(0.5)
        loaded = []
        t_end = time.monotonic() + args.isolation_s - 1.0
        while time.monotonic() < t_end:
            loaded += timed(small, 10)
        big_calls = sum(ray.get(loads))
        loaded.sort()
        result[mode] = {"idle_p50": pct(idle, 0.5), "loaded_p50": pct(loaded, 0.5), "loaded_p99": pct(loaded, 0.99),
                        "small_calls": len(loaded), "big_calls_per_s": round(big_calls / args.isolation_s, 1)}
        say(f"isolation {mode}: small model's heartbeat {result[mode]}")
        for a in (big, small) if per_model else (small,):
            ray.kill(a)
        for g in gens:
            ray.kill(g)
    ray.shutdown()
    return result


def _load_gen_class():
    import ray

    @ray.remote(num_cpus=0)
    class LoadGen:
        """Raw protocol messages for a slice of the simulated clients (async: many calls in flight)."""

        def __init__(self, server_name: str, namespace: str, ids: list[str]) -> None:
            from tensorhub.core import messages as m

            self.m = m
            self.server = ray.get_actor(server_name, namespace=namespace)
            self.ids = ids
            self.layout = m.LayoutInfo("fp", 4, 4 << 20, (m.TensorMeta("w", "float32", (1 << 20,), 4 << 20),))

        def _req(self, kind: str, cid: str):
            m = self.m
            if kind == "Register":
                return m.Register(cid, "pol", cid, 0, 1, self.layout, cid.encode(), machine=f"h{int(cid[1:]) // 8}")
            if kind == "Replicate":
                return m.Replicate(cid, "latest", 1)
            return m.Heartbeat(cid)

        async def burst(self, kind: str, count: int) -> int:
            data = _signed(self._req(kind, "c0"))
            await asyncio.gather(*[self.server.call.remote(data, 0.0) for _ in range(count)])
            return count

        async def hammer(self, duration_s: float, in_flight: int = 200) -> int:
            """Pipelined heartbeats, ``in_flight`` at a time, for ``duration_s``; calls answered."""
            data = _signed(self._req("Heartbeat", "c0"))
            end, done = time.monotonic() + duration_s, 0
            while time.monotonic() < end:
                await asyncio.gather(*[self.server.call.remote(data, 0.0) for _ in range(in_flight)])
                done += in_flight
            return done

        async def send_all(self, kind: str) -> tuple[float, float, int, list]:
            """Every client sends one ``kind`` at once; (first send, last reply, assignments, the
            first few error replies)."""
            msgs = [_signed(self._req(kind, cid)) for cid in self.ids]
            t0 = time.time()
            replies = await asyncio.gather(*[self.server.call.remote(d, 0.0) for d in msgs])
            end = time.time()
            decoded = [self.m.decode_reply(r) for r in replies]
            bad = [r.code for r in decoded if isinstance(r, self.m.ErrorReply)]
            return t0, end, sum(isinstance(r, self.m.Assignment) for r in decoded), bad

        async def fleet(self, interval_s: float, per_process: int = 1, hold_s: float = 0.0) -> list:
            """The fleet starts: each process registers its ``per_process`` clients one after the
            other (one ``Register`` each, as ``Hub.register``), then does what the Hub's liveness
            loop does while idle, until :meth:`steady` ends: one Pulse of its clients, asking the
            server to hold it up to ``hold_s``; the next leaves when it returns, never sooner
            than ``interval_s`` after the last. Their first holds end spread over one hold (a
            fleet is not in step). Returns once every client registered (the pulses go on): the
            error codes of refused registrations."""
            groups = [self.ids[i:i + per_process] for i in range(0, len(self.ids), per_process)]
            self._window = (float("inf"), float("inf"))
            self._stats = {"calls": 0, "late": 0, "expired": set(), "processes": len(groups)}
            registered = [asyncio.get_running_loop().create_future() for _ in groups]
            self._loops = [asyncio.get_running_loop().create_task(
                self._process(i, g, len(groups), interval_s, hold_s, registered[i])) for i, g in enumerate(groups)]
            return [c for errs in await asyncio.gather(*registered) for c in errs]

        async def _process(self, i: int, cids: list, processes: int, interval_s: float, hold_s: float,
                           registered: asyncio.Future) -> None:
            m, stats = self.m, self._stats
            errs = []
            for cid in cids:
                rep = await self._register(cid)
                if isinstance(rep, m.ErrorReply):
                    errs.append(rep.code)
            registered.set_result(errs)
            data = _signed(m.Pulse(beats=tuple(m.Beat(cid) for cid in cids)))
            wait = max(hold_s * (i + 1) / processes, interval_s) if hold_s else 0.0
            last = time.monotonic()
            while True:
                await asyncio.sleep(max(0.0, last + interval_s - time.monotonic()))
                sent = last = time.monotonic()
                t_from, t_to = self._window
                if t_from <= sent < t_to:
                    stats["calls"] += 1  # sent in the window (its reply may come after it)
                rep = m.decode_reply(await self.server.call.remote(data, wait))
                wait = hold_s
                if isinstance(rep, m.PulseReply) and rep.unknown:
                    # a lease ran out between two pulses: announce again, as a Hub would
                    stats["expired"].update(rep.unknown)
                    for cid in rep.unknown:
                        await self._register(cid)
                if not hold_s and time.monotonic() - sent > interval_s:
                    stats["late"] += 1

        async def _register(self, cid: str):
            """One ``Register``, as ``Hub.register`` does it: a ``ServerBusy`` reply (the server
            sheds new clients while it is behind, ``Config.register_shed_s``) pauses as asked
            and registers again."""
            m = self.m
            while True:
                rep = m.decode_reply(await self.server.call.remote(_signed(self._req("Register", cid)), 0.0))
                if not (isinstance(rep, m.ErrorReply) and rep.code == "ServerBusy"):
                    return rep
                await asyncio.sleep(min(max(rep.retry_after_s, 0.1), 60.0))

        async def steady(self, duration_s: float, warm_s: float = 0.0) -> dict:
            """Counts the fleet's pulses sent over ``duration_s`` after ``warm_s`` (a held
            fleet's first round of pulses is all sent at the start), then stops it (a pulse
            still held is left to the server). Returns calls, late rounds (unheld pulses
            answered after more than one interval), clients whose lease ran out since the fleet
            started, processes."""
            start = time.monotonic()
            self._window = (start + warm_s, start + warm_s + duration_s)
            await asyncio.sleep(warm_s + duration_s)
            for t in self._loops:
                t.cancel()
            await asyncio.gather(*self._loops, return_exceptions=True)
            s = self._stats
            return {"calls": s["calls"], "late": s["late"], "expired": len(s["expired"]), "processes": s["processes"]}

    return LoadGen


class _LazyLoadGen:
    def remote(self, *a):
        global LoadGen
        LoadGen = _load_gen_class()
        return LoadGen.remote(*a)


LoadGen = _LazyLoadGen()


if __name__ == "__main__":
    sys.exit(main())
