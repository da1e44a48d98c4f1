"""Compiled-graph pipelines (tensorhub.graphs): planner tables, then Ray tests comparing bytes."""

from __future__ import annotations

import time

import pytest

from tensorhub.graphs import PlanError, batch_end, build_plan
from tensorhub.testing import workload

SPEC = workload.small_spec(12 << 20, big=3, tiny=16)
CFG = dict(unit_bytes=512 << 10, lease_timeout_s=30.0, heartbeat_interval_s=0.5, source_stall_timeout_s=5.0)


# ----------------------------------------------------------------------------- pure planner


@pytest.mark.parametrize("assignments, upstream, leaves, depth", [
    # T -> r0 -> r1 -> r2
    ([("r0", "T"), ("r1", "r0"), ("r2", "r1")], (None, 0, 1), (2,), 3),
    # given out of order: T -> r0 -> r1 -> r2
    ([("r2", "r1"), ("r0", "T"), ("r1", "r0")], (2, None, 1), (0,), 3),
    # a tree: T -> r0 -> {r1, r2}
    ([("r0", "T"), ("r1", "r0"), ("r2", "r0")], (None, 0, 0), (1, 2), 2),
    # a forest of two holders: T -> r0 ; H -> r1
    ([("r0", "T"), ("r1", "H")], (None, None), (0, 1), 1),
])
def test_plan_wires_each_member_to_its_assigned_upstream(assignments, upstream, leaves, depth):
    p = build_plan(assignments)
    assert p.upstream == upstream
    assert set(p.leaves) == set(leaves) and p.depth == depth
    pos = {i: n for n, i in enumerate(p.order)}
    assert all(u is None or pos[u] < pos[i] for i, u in enumerate(p.upstream)), "upstream bound first"


def test_plan_rejects_cycles_and_duplicates_and_key_ignores_the_root():
    with pytest.raises(PlanError):
        build_plan([("a", "b"), ("b", "a")])
    with pytest.raises(PlanError):
        build_plan([("a", "T"), ("a", "T")])
    k1 = build_plan([("a", "trainer"), ("b", "a")]).key(["A", "B"])
    k2 = build_plan([("a", "trainer#host"), ("b", "a")]).key(["A", "B"])
    assert k1 == k2


@pytest.mark.parametrize("units, batches", [(10, 4), (3, 8), (64, 8), (1, 1)])
def test_batches_cover_all_units_once_in_order(units, batches):
    ends = [batch_end(units, batches, k) for k in range(batches)]
    assert ends == sorted(ends) and ends[-1] == units and ends[0] >= 0


# ----------------------------------------------------------------------------- Ray


def _spawn(model, names, spec=SPEC):
    from tensorhub.testing.replica import spawn_many

    return spawn_many(model, spec, names, config=CFG)


@pytest.fixture
def cache(ray_cluster):
    from tensorhub.graphs import GraphCache

    c = GraphCache(max_inflight=3)
    yield c
    c.clear()


@pytest.mark.ray
def test_chain_of_three_graph_is_byte_exact_and_reused_across_versions(ray_cluster, model_name, cache):
    """trainer -> r0 -> r1 -> r2, as one compiled graph; version 2 reuses it (no recompile)."""
    from tensorhub.graphs import replicate_group

    ray = ray_cluster
    actors = _spawn(model_name, ["trainer", "r0", "r1", "r2"])
    trainer, readers = actors[0], actors[1:]
    d1 = ray.get(trainer.publish.remote(1))
    res = replicate_group(readers, 1, update=False, path="graph", batches=6, cache=cache)
    assert res.path == "graph", res.error
    assert res.plan.depth == 3 and cache.compiles == 1
    assert [ray.get(r.digest.remote()) for r in readers] == [d1] * 3
    assert all(s["version"] == 1 and s["graph_bytes"] == s["bytes"] > 0 for s in res.per_member)
    assert all(s["pull_bytes"] == 0 and s["failed"] is None for s in res.per_member), res.per_member
    trainer_id = ray.get(trainer.ping.remote())
    assert [s["sources"][0] for s in res.per_member][0] == trainer_id

    d2 = ray.get(trainer.publish.remote(2))
    res2 = replicate_group(readers, "latest", path="graph", batches=6, cache=cache)
    assert res2.path == "graph" and not res2.compiled, res2.error
    assert cache.compiles == 1, "same members, same wiring: the compiled graph is reused"
    assert [e.uses for e in cache._graphs.values()] == [2], "one use per execution, not per lookup"
    assert [ray.get(r.digest.remote()) for r in readers] == [d2] * 3
    assert [ray.get(r.version.remote()) for r in readers] == [2] * 3
    cache.clear()
    ray.get([a.close.remote() for a in actors])


@pytest.mark.ray
def test_member_killed_mid_graph_survivors_finish_by_fallback_with_exact_bytes(ray_cluster, model_name, cache):
    """trainer -> r0 -> r1 -> r2 ; r1 is killed while batches stream: r0 and r2 finish on the
    pull path from their own progress, bytes exact, no unit fetched twice."""
    import threading

    from tensorhub.graphs import replicate_group

    ray = ray_cluster
    spec = workload.small_spec(24 << 20, big=2, tiny=4)
    from tensorhub.testing.replica import spawn_many

    # Small units and one read in flight make the graph slow enough to kill a member mid-way.
    cfg = dict(CFG, unit_bytes=32 << 10, reads_in_flight=1)
    actors = spawn_many(model_name, spec, ["trainer", "r0", "r1", "r2"], config=cfg)
    trainer, r0, r1, r2 = actors
    d = ray.get(trainer.publish.remote(1))
    total = sum(t.numel() * t.element_size() for _, t in workload.allocate(spec))
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("res", replicate_group(
        [r0, r1, r2], 1, update=False, path="graph", batches=16, cache=cache)))
    th.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        v, p = ray.get(r2.th_graph_progress.remote())
        if v == 1 and p > 0:
            break
        time.sleep(0.01)
    v, p2_at_kill = ray.get(r2.th_graph_progress.remote())
    ray.kill(r1)
    th.join(120)
    assert not th.is_alive()
    res = out["res"]
    assert res.path == "fallback", res
    s0, s1, s2 = res.per_member
    assert isinstance(s1, Exception)
    assert ray.get(r0.digest.remote()) == d and ray.get(r2.digest.remote()) == d
    for s in (s0, s2):
        assert s["version"] == 1 and s["bytes"] == total, "every byte read exactly once"
    assert 0 < p2_at_kill and s2["graph_bytes"] > 0 and s2["pull_bytes"] > 0, s2
    assert cache.compiles == 1 and len(cache) == 0, "the failed graph was torn down and dropped"
    # The survivors are holders: a late reader gets the version from them.
    ray.get(trainer.unpublish.remote())
    ray.get(trainer.scribble.remote())
    late = spawn_many(model_name, spec, ["late"], config=cfg)[0]
    assert ray.get(late.replicate.remote(1))["digest"] == d
    ray.get([a.close.remote() for a in (trainer, r0, r2, late)])


@pytest.mark.ray
def test_graph_member_mixin_on_a_foreign_actor_class(ray_cluster, model_name, cache):
    """A user's actor class that knows TensorHub only through the mixin + opening a hub."""
    import tensorhub
    from tensorhub.graphs import GraphMember, replicate_group

    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Rollout(GraphMember):
        def __init__(self, model: str):
            self.weights = workload.allocate(SPEC)
            self.tensorhub_handle = tensorhub.open(model, config=tensorhub.Config(**CFG))
            self.tensorhub_handle.register(self.weights)

        def generate(self) -> str:  # the app's own method
            return workload.digest([t for _, t in self.weights])

        def stop(self) -> None:
            self.tensorhub_handle.close(drop_last_copy=True)

    (trainer,) = _spawn(model_name, ["trainer"])
    d = ray.get(trainer.publish.remote(5))
    rollouts = [Rollout.remote(model_name) for _ in range(3)]
    res = replicate_group(rollouts, "latest", path="graph", batches=4, cache=cache)
    assert res.path == "graph" and res.plan.depth == 3, res
    assert ray.get([r.generate.remote() for r in rollouts]) == [d] * 3
    noop = replicate_group(rollouts, "latest", path="graph", cache=cache)
    assert noop.path == "noop" and noop.version == 5
    # auto decides from measurements of this topology: the graph was measured above, pull not
    # yet, so pull once; then the faster of the two (the cached graph is reused, never recompiled)
    d6 = ray.get(trainer.publish.remote(6))
    auto = replicate_group(rollouts, "latest", path="auto", batches=4, cache=cache)
    assert auto.path == "pull" and "pull not measured" in auto.why, auto
    assert ray.get([r.generate.remote() for r in rollouts]) == [d6] * 3
    key = next(k for k in cache._graphs)
    measured = cache.choice.measured(key)
    assert set(measured) == {"graph", "pull"} and all(v > 0 for v in measured.values()), measured
    d7 = ray.get(trainer.publish.remote(7))
    auto = replicate_group(rollouts, "latest", path="auto", batches=4, cache=cache)
    assert auto.path == min(measured, key=measured.get) and "measured faster" in auto.why, (auto, measured)
    assert not auto.compiled and cache.compiles == 1, auto
    assert ray.get([r.generate.remote() for r in rollouts]) == [d7] * 3
    ray.get([r.stop.remote() for r in rollouts])
    ray.get(trainer.close.remote())


@pytest.mark.ray
def test_compile_teardown_cycles_keep_object_store_usage_bounded(ray_cluster, model_name):
    """Compile, run, tear down, repeat (alternating two topologies over the same actors, so each
    compile must first tear the other down): object store usage stays bounded."""
    from tensorhub.graphs import GraphCache, build_plan
    from tensorhub.graphs.pipeline import _actor_key, _execute, object_store_bytes_used

    ray = ray_cluster
    spec = workload.small_spec(1 << 20, big=1, tiny=2)
    actors = _spawn(model_name, ["a", "b", "c"], spec=spec)
    cache = GraphCache(max_inflight=2, buffer_bytes=4096)
    chain = build_plan([("a", "T"), ("b", "a"), ("c", "b")])
    tree = build_plan([("a", "T"), ("b", "a"), ("c", "a")])
    keys = [_actor_key(a) for a in actors]
    base = object_store_bytes_used()
    used = []
    for i in range(8):
        plan = chain if i % 2 == 0 else tree
        dag = cache.compile(plan.key(keys), actors, plan)
        # no read in progress: every fetch answers "nothing to do" (a negative int), quickly
        assert _execute(dag, 4, 2, 30) is not None
        assert len(cache) == 1, "a second graph over the same actors tears the first down"
        used.append(object_store_bytes_used() - base)
    cache.clear()
    after = object_store_bytes_used() - base
    assert cache.compiles == 8 and cache.teardowns == 8
    # Ray 2.60 leaves each compile's channel buffers in the object store even after teardown;
    # with 4 KiB buffers (set on the driver and in every member by the cache) that is ~4 channels
    # x 5 in flight (depth 3 + 2, so every member of the chain works at once) x 4 KiB per
    # compile, not the ~6 MB per compile of Ray's 1 MB default.
    growth = [b - a for a, b in zip([0] + used, used)]
    assert max(growth) <= 96 << 10 and after < (1 << 20), (used, after)
    ray.get([a.close.remote() for a in actors])


@pytest.mark.ray
def test_server_side_coordinator_builds_caches_and_reuses_the_graph(ray_cluster, model_name):
    """replicate_group(where="server"): the graph is compiled and run by the detached
    coordinator next to the reference server, from the plan the core produced, and reused for
    the next version."""
    import tensorhub
    from tensorhub.graphs.coordinator import coordinator
    from tensorhub.graphs import replicate_group

    ray = ray_cluster
    config = tensorhub.Config(**CFG)
    coord = coordinator(config, model_name)  # the model's own coordinator (server_per_model)
    ray.get(coord.clear.remote())
    before = ray.get(coord.stats.remote())["compiles"]
    trainer, *readers = _spawn(model_name, ["trainer", "g0", "g1", "g2"])
    d1 = ray.get(trainer.publish.remote(1))
    res = replicate_group(readers, "latest", path="graph", batches=4, config=config)
    assert res.path == "graph" and res.version == 1, res
    assert res.plan_drawing.count("->") == 3
    assert ray.get([r.digest.remote() for r in readers]) == [d1] * 3
    d2 = ray.get(trainer.publish.remote(2))
    res2 = replicate_group(readers, "latest", path="graph", batches=4, config=config)
    assert res2.path == "graph" and not res2.compiled
    assert ray.get([r.digest.remote() for r in readers]) == [d2] * 3
    assert ray.get(coord.stats.remote())["compiles"] == before + 1
    ray.get(coord.clear.remote())
    ray.get([a.close.remote() for a in [trainer, *readers]])


def _cpu_seconds(pids, window_s: float) -> list[float]:
    """CPU seconds each process used over ``window_s`` (user + system, from /proc)."""
    import os

    def used(pid: int) -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    before = [used(p) for p in pids]
    time.sleep(window_s)
    return [used(p) - b for p, b in zip(pids, before)]


@pytest.mark.ray
def test_an_idle_graph_is_torn_down_and_its_members_stop_spinning(ray_cluster, model_name):
    """A live compiled graph busy-waits on every member; idle for ``idle_teardown_s`` it is torn
    down (the members go quiet), and the next graph call compiles it again and is exact. A graph
    held by an execution is never torn down for idleness."""
    from tensorhub.graphs import GraphCache, replicate_group

    ray = ray_cluster
    cache = GraphCache(max_inflight=2, idle_teardown_s=1.5)
    trainer, *readers = _spawn(model_name, ["trainer", "i0", "i1"])
    pids = ray.get([r.pid.remote() for r in readers])
    try:
        ray.get(trainer.publish.remote(1))
        res = replicate_group(readers, 1, update=False, path="graph", batches=4, cache=cache)
        assert res.path == "graph" and len(cache) == 1, res.error
        spinning = _cpu_seconds(pids, 1.0)
        # The watcher takes the graph out of the cache, then tears it down and counts it: wait
        # for the count (the members are quiet once it is there), not for the empty cache.
        deadline = time.time() + 20
        while cache.idle_teardowns < 1 and time.time() < deadline:
            time.sleep(0.2)
        assert len(cache) == 0 and cache.idle_teardowns == 1 and cache.teardowns == 1
        quiet = _cpu_seconds(pids, 1.0)
        print(f"member CPU s over 1 s: graph live {spinning}, torn down {quiet}")
        assert max(quiet) < 0.1 and min(spinning) > 2 * max(quiet, default=0) + 0.05, (spinning, quiet)
        # Used again: compiled anew, exact.
        d2 = ray.get(trainer.publish.remote(2))
        res2 = replicate_group(readers, "latest", path="graph", batches=4, cache=cache)
        assert res2.path == "graph" and res2.compiled and cache.compiles == 2, res2.error
        assert ray.get([r.digest.remote() for r in readers]) == [d2] * 2
        # Held (an execution running): not torn down however long it is idle.
        key = next(iter(cache._graphs))
        assert cache.acquire(key) is not None
        time.sleep(2.5)
        assert len(cache) == 1
        cache.release(key)
        deadline = time.time() + 20
        while cache.idle_teardowns < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert len(cache) == 0 and cache.idle_teardowns == 2
    finally:
        cache.clear()
        ray.get([a.close.remote() for a in [trainer, *readers]])
