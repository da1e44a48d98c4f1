"""Pipeline replication of one version to a group of actors, as a Ray Compiled Graph.

    from tensorhub import graphs
    res = graphs.replicate_group([r0, r1, r2], "latest", path="auto")
    res.path, res.per_member        # "graph" | "pull", one stats dict per member

The driver asks every member for a source (the core answers ``holder -> r0 -> r1 -> r2``),
turns those assignments into a graph (:mod:`tensorhub.graphs.plan`) whose node ``i`` is
``r_i.th_graph_fetch`` fed by its upstream's output, and executes it once per batch index with
enough executions in flight to keep every member of the chain busy (depth + 2), so batches stream
down the chain. A batch is one unit by default (``batches=None``), so a member lags its upstream
by one unit, as on the pull path. Graph edges carry the progress itself: ``(k, checksums of
batch k's units)``, "these units are final here and hash to this"; the downstream member reads
exactly those units without reading its upstream's control block. Bytes move by NIXL reads
straight into each member's registered tensors. Finally every member runs ``th_graph_finish``
(pull whatever is missing, with failover; report done).

Compiled graphs are cached by topology (:class:`GraphCache`): the same ordered members wired the
same way reuse one graph across versions. Rules the cache keeps, from Ray 2.60's behaviour:

- an actor can run only one compiled graph at a time: compiling a graph tears down every cached
  graph that shares an actor with it;
- every compile leaves channel buffers in the object store (channels x in-flight x buffer size),
  so buffers are small and fixed (``buffer_bytes``), graphs few (``graphs_max``) and reused;
  payloads are a batch index and at most ``UNITS_PER_BATCH_MAX`` checksums (failures are
  negative ints, never exceptions), so no channel ever grows past its buffer (teardown would
  hang);
- a failed execution (a member died, a read failed, a timeout) tears the graph down and drops it;
  the members then fall back to the pull path from their own progress (nothing fetched twice).

Path choice (``path="auto"``): from measurements (:mod:`tensorhub.graphs.choice`): the pull path
while no graph is cached for the topology (with ``compile="background"`` the graph is compiled
after the group finished, off the critical path, for the next version), then each path once,
then whichever measured fewer seconds per byte for this topology (the other is re-measured now
and then only while the two measured within 10% of each other: a path measured clearly slower is
not taken again for that topology). ``path="graph"`` compiles synchronously on a miss (0.1-3 s measured here).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Optional, Sequence

import ray

from tensorhub.graphs.choice import PathChooser
from tensorhub.graphs.plan import Plan, build_plan

log = logging.getLogger(__name__)

PATHS = ("auto", "graph", "pull")


@dataclasses.dataclass
class GroupResult:
    """What one :func:`replicate_group` did."""

    path: str
    """``"graph"``, ``"pull"``, ``"fallback"`` (graph failed, finished on the pull path) or ``"noop"``."""
    version: Optional[int]
    seconds: float
    per_member: list[Any]
    """One entry per actor (in the order given): a stats dict, or the exception it raised."""
    plan: Optional[Plan] = None
    compiled: bool = False
    """A graph was compiled synchronously by this call."""
    compile_s: float = 0.0
    why: str = ""
    """Why this path was taken (``path="auto"``: the measurement that decided)."""
    error: Optional[str] = None
    """Why the graph path failed (``path == "fallback"``)."""
    plan_drawing: str = ""
    """The chain as text (``holder -> a0 -> a1``), also when the plan ran server side."""


@dataclasses.dataclass
class _Entry:
    dag: Any
    actor_ids: frozenset
    compile_s: float
    max_inflight: int
    uses: int = 0
    """Executions it was held for (:meth:`GraphCache.acquire`; a lookup is not a use)."""
    busy: int = 0
    """Executions running on it now (:meth:`GraphCache.acquire`): never torn down while idle."""
    last_used: float = dataclasses.field(default_factory=time.monotonic)


def _actor_key(actor) -> str:
    return actor._actor_id.hex()


class GraphCache:
    """Compiled graphs by topology key. Thread-safe; one per driver process is typical
    (:data:`default_cache`). ``graphs_max`` bounds how many live graphs (and their channel
    buffers) exist at once; the least recently used is torn down first.

    ``idle_teardown_s``: a graph not executed for this long is torn down (0: never). A live Ray
    compiled graph busy-waits on every member (each polls its input channel: one core per member
    while idle, measured); tearing it down stops that, and the next ``path="graph"`` call
    compiles again (0.1-3 s; ``path="auto"`` takes the pull path meanwhile and compiles in the
    background). One daemon thread (``tensorhub-graph-idle``) watches while graphs are cached
    and ends with the last of them. A graph that is executing is never torn down for idleness."""

    def __init__(self, *, graphs_max: int = 4, buffer_bytes: int = 64 << 10, max_inflight: int = 4,
                 submit_timeout_s: float = 60.0, idle_teardown_s: float = 60.0) -> None:
        if graphs_max < 1 or buffer_bytes < 1024 or max_inflight < 1 or submit_timeout_s <= 0:
            raise ValueError("graphs_max >= 1, buffer_bytes >= 1024, max_inflight >= 1, submit_timeout_s > 0")
        if not idle_teardown_s >= 0:
            raise ValueError("idle_teardown_s must be >= 0 (0: never)")
        self.idle_teardown_s = idle_teardown_s
        self.idle_teardowns = 0
        """Graphs torn down for idleness so far (counted in ``teardowns`` too). A graph leaves the
        cache before its teardown ends; it is counted once the teardown has ended."""
        self._idle_thread: Optional[threading.Thread] = None
        self._idle_wake = threading.Condition()
        self.graphs_max = graphs_max
        self.buffer_bytes = buffer_bytes
        self.max_inflight = max_inflight
        self.submit_timeout_s = submit_timeout_s
        self.compiles = 0
        """Graphs compiled so far (tests pin reuse with it)."""
        self.choice = PathChooser()
        """What each path measured per topology (``path="auto"`` decides from it)."""
        self.teardowns = 0
        self.compile_s: list[float] = []
        self._graphs: "collections.OrderedDict[tuple, _Entry]" = collections.OrderedDict()
        self._lock = threading.RLock()
        self._background: Optional[threading.Thread] = None

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, key: tuple) -> Optional[Any]:
        """The cached compiled graph for ``key`` or None (marks it recently used)."""
        return self._touch(key, hold=False)

    def acquire(self, key: tuple) -> Optional[Any]:
        """The cached graph for ``key``, held for an execution until :meth:`release` (not torn
        down for idleness meanwhile), or None."""
        return self._touch(key, hold=True)

    def _touch(self, key: tuple, hold: bool) -> Optional[Any]:
        """The cached graph for ``key`` marked recently used, or None; with ``hold`` also held
        busy and its idle clock restarted (under the lock: the idle watcher cannot take it
        between the lookup and the hold)."""
        with self._lock:
            e = self._graphs.get(key)
            if e is None:
                return None
            self._graphs.move_to_end(key)
            if hold:
                e.uses += 1
                e.busy += 1
                e.last_used = time.monotonic()
            return e.dag

    def release(self, key: tuple) -> None:
        """The execution :meth:`acquire` held ``key`` for ended; its idle time starts now."""
        with self._lock:
            e = self._graphs.get(key)
            if e is not None:
                e.busy = max(0, e.busy - 1)
                e.last_used = time.monotonic()

    def _watch_idle(self) -> None:
        """The idle watcher (see the class docstring): sleeps until the oldest idle graph is due,
        tears down those past ``idle_teardown_s``, ends when no graph is cached."""
        limit = self.idle_teardown_s
        while True:
            now = time.monotonic()
            with self._lock:  # taken out under the lock: an acquire cannot slip in before the teardown
                if not self._graphs:
                    self._idle_thread = None
                    return
                due = [self._graphs.pop(k) for k, e in list(self._graphs.items())
                       if not e.busy and now - e.last_used >= limit]
                wait = min((limit - (now - e.last_used) for e in self._graphs.values() if not e.busy), default=limit)
            for e in due:
                self._teardown(e)
                with self._lock:
                    self.idle_teardowns += 1
                log.info("tore down a compiled graph idle for %.0fs", limit)
            if not due:
                with self._idle_wake:
                    self._idle_wake.wait(max(0.05, wait))

    def _start_idle_watch(self) -> None:
        """Called under the lock with a graph cached."""
        if self.idle_teardown_s <= 0 or (self._idle_thread is not None and self._idle_thread.is_alive()):
            return
        self._idle_thread = threading.Thread(target=self._watch_idle, name="tensorhub-graph-idle", daemon=True)
        self._idle_thread.start()

    def inflight(self, key: tuple) -> int:
        """Executions the graph for ``key`` was compiled to keep in flight."""
        with self._lock:
            e = self._graphs.get(key)
            return e.max_inflight if e is not None else self.max_inflight

    def compile(self, key: tuple, actors: Sequence, plan: Plan) -> Any:
        """Compile (and cache) the graph for ``plan`` over ``actors``, first tearing down every
        cached graph that shares an actor (Ray: one live graph per actor) and the least recently
        used ones past ``graphs_max``. Blocks for the compile (0.1-3 s on small machines). The
        graph keeps ``max(max_inflight, depth + 2)`` executions in flight: every member of the
        chain works on its own batch at once."""
        from ray.dag import DAGContext, InputNode, MultiOutputNode

        ids = frozenset(_actor_key(a) for a in actors)
        with self._lock:
            if key in self._graphs:
                return self.get(key)
            for k in [k for k, e in self._graphs.items() if e.actor_ids & ids]:
                self.drop(k)
            while len(self._graphs) >= self.graphs_max:
                self.drop(next(iter(self._graphs)))
            t = time.perf_counter()
            ray.get([a.th_graph_setup.remote(self.buffer_bytes) for a in actors], timeout=60)
            with InputNode() as batch:
                out: dict[int, Any] = {}
                for i in plan.order:
                    up = plan.upstream[i]
                    out[i] = actors[i].th_graph_fetch.bind(batch if up is None else out[up])
                dag = MultiOutputNode([out[i] for i in plan.leaves])
            # Some channels (the driver's input/output ones) size themselves from the context,
            # not from the compile argument: set both, so every buffer is small.
            ctx = DAGContext.get_current()
            saved, ctx.buffer_size_bytes = ctx.buffer_size_bytes, self.buffer_bytes
            inflight = max(self.max_inflight, plan.depth + 2)
            try:
                compiled = dag.experimental_compile(
                    _max_inflight_executions=inflight, _buffer_size_bytes=self.buffer_bytes,
                    _submit_timeout=self.submit_timeout_s)
            finally:
                ctx.buffer_size_bytes = saved
            dt = time.perf_counter() - t
            self._graphs[key] = _Entry(compiled, ids, dt, inflight)
            self._start_idle_watch()
            self.compiles += 1
            self.compile_s.append(dt)
            log.info("compiled graph #%d over %d actors in %.3fs", self.compiles, len(actors), dt)
            return compiled

    def drop(self, key: tuple) -> bool:
        """Tear down and forget the graph for ``key`` (no-op if absent). Never raises."""
        with self._lock:
            e = self._graphs.pop(key, None)
        if e is None:
            return False
        self._teardown(e)
        return True

    def _teardown(self, e: _Entry) -> None:
        try:
            e.dag.teardown()
        except Exception:  # noqa: BLE001 - a member may be dead; the graph is gone either way
            log.warning("teardown of a compiled graph failed", exc_info=True)
        with self._lock:  # the idle watcher and callers tear down from different threads
            self.teardowns += 1

    def drop_actor(self, actor) -> int:
        """Tear down every graph over ``actor`` (membership changed). Returns how many."""
        aid = _actor_key(actor)
        with self._lock:
            keys = [k for k, e in self._graphs.items() if aid in e.actor_ids]
        return sum(self.drop(k) for k in keys)

    def clear(self) -> None:
        """Tear down every cached graph (call before ``ray.shutdown()``)."""
        self.wait_background()
        with self._lock:
            keys = list(self._graphs)
        for k in keys:
            self.drop(k)

    def compile_in_background(self, key: tuple, actors: Sequence, plan: Plan) -> None:
        """Compile ``key`` in a thread (one at a time; skipped if one is running)."""
        with self._lock:
            if key in self._graphs or (self._background is not None and self._background.is_alive()):
                return

            def run() -> None:
                try:
                    self.compile(key, actors, plan)
                except Exception:  # noqa: BLE001 - the pull path keeps working without it
                    log.warning("background compile failed", exc_info=True)

            self._background = threading.Thread(target=run, name="tensorhub-graph-compile", daemon=True)
            self._background.start()

    def wait_background(self, timeout_s: Optional[float] = None) -> None:
        t = self._background
        if t is not None:
            t.join(timeout_s)


default_cache = GraphCache()
"""The process-wide cache :func:`run_group` (``replicate_group(where="local")``) uses unless given one."""


def run_group(actors: Sequence, spec="latest", *, update: bool = True, path: str = "auto",
              batches: Optional[int] = None, cache: Optional[GraphCache] = None,
              compile: str = "background", timeout_s: float = 300.0) -> GroupResult:
    """:func:`tensorhub.graphs.replicate_group` in this process (``where="local"``), with
    ``cache`` (default: :data:`default_cache`); the server-side coordinator runs this too."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if compile not in ("background", "never"):
        raise ValueError("compile must be 'background' or 'never'")
    if (batches is not None and batches < 1) or not actors:
        raise ValueError("need batches >= 1 (or None) and at least one actor")
    cache = default_cache if cache is None else cache
    t0 = time.perf_counter()
    # Begin one by one in the given order: the core then wires the same chain for every version
    # (holder -> a0 -> a1 -> ...), so the topology, and the compiled graph, repeat.
    begun: list[Any] = []
    for a in actors:
        try:
            begun.append(ray.get(a.th_graph_begin.remote(spec, update, batches), timeout=timeout_s))
        except Exception as e:  # noqa: BLE001 - that member is out of this round
            begun.append(e)
    live = [i for i, b in enumerate(begun) if isinstance(b, dict) and b["action"] == "assigned"]
    per_member: list[Any] = list(begun)
    version = next((b["version"] for b in begun if isinstance(b, dict)), None)
    if not live:
        return GroupResult("noop", version, time.perf_counter() - t0, per_member)
    members = [actors[i] for i in live]
    batches = begun[live[0]]["batches"]  # the members resolved None the same way (same layout)
    plan = build_plan([(begun[i]["client_id"], begun[i]["source_id"]) for i in live])
    key = plan.key([_actor_key(a) for a in members]) + (batches,)
    dag = cache.get(key)
    why = path
    if path == "auto":
        choice, why = cache.choice.choose(key, dag is not None)
    use_graph = path == "graph" or (path == "auto" and choice == "graph")
    result = GroupResult("pull", version, 0.0, per_member, plan=plan, why=why,
                         plan_drawing=plan.draw([begun[i]["client_id"] for i in live]))
    if use_graph:
        dag = cache.acquire(key)  # held: not torn down for idleness while it runs
        if dag is None:
            tc = time.perf_counter()
            compiled = cache.compile(key, members, plan)
            dag = cache.acquire(key) or compiled
            result.compiled, result.compile_s = True, time.perf_counter() - tc
        try:
            err = _execute(dag, batches, cache.inflight(key), timeout_s)
        finally:
            cache.release(key)
        if err is None:
            result.path = "graph"
        else:
            result.path, result.error = "fallback", err
            log.warning("graph over %d members failed (%s): falling back to the pull path", len(members), err)
            ray.get([a.th_graph_abort.remote() for a in members if _alive(a)], timeout=timeout_s)
            cache.drop(key)
    finals = _finish_all(members, timeout_s)
    for i, f in zip(live, finals):
        per_member[i] = f
    result.seconds = time.perf_counter() - t0
    ok = all(isinstance(f, dict) for f in finals)
    if ok:
        cache.choice.record(key, result.path, result.seconds - result.compile_s,
                            sum(f.get("bytes", 0) for f in finals))
    if path == "auto" and compile == "background" and cache.get(key) is None and ok:
        cache.compile_in_background(key, members, plan)
    return result


def object_store_bytes_used() -> int:
    """Bytes the local Ray cluster's object stores hold now (channel buffers of live and leaked
    compiled graphs count here). Uses Ray's memory-info API (what ``ray memory`` prints)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.object_store_bytes_used)


def _execute(dag, batches: int, max_inflight: int, timeout_s: float) -> Optional[str]:
    """Run batch indices 0..batches-1 with up to ``max_inflight`` in flight. None on success,
    else a short reason (a negative output: a member's fetch failed; or a Ray error)."""
    pending: collections.deque = collections.deque()
    bad: Optional[str] = None
    try:
        for k in range(batches):
            if len(pending) >= max_inflight:
                r = _check(pending.popleft(), timeout_s)
                bad = bad or r
            if bad:
                break  # later batches would only pass the failure along
            pending.append((k, dag.execute(k)))
        while pending:  # consume every submitted execution (the graph may be reused)
            r = _check(pending.popleft(), timeout_s)
            bad = bad or r
    except Exception as e:  # noqa: BLE001 - actor died, channel closed, timeout
        return f"{type(e).__name__}: {e}"[:500]
    return bad


def _check(item, timeout_s: float) -> Optional[str]:
    k, ref = item
    outs = ray.get(ref, timeout=timeout_s)
    if any(isinstance(o, int) or o[0] != k for o in outs):
        return f"batch {k}: member outputs {[o if isinstance(o, int) else o[0] for o in outs]}"
    return None


def _alive(actor) -> bool:
    try:
        ray.get(actor.th_graph_ping.remote(), timeout=10)
        return True
    except Exception:  # noqa: BLE001
        return False


def _finish_all(members: Sequence, timeout_s: float) -> list[Any]:
    refs = [a.th_graph_finish.remote() for a in members]
    out: list[Any] = []
    for r in refs:
        try:
            out.append(ray.get(r, timeout=timeout_s))
        except Exception as e:  # noqa: BLE001 - a dead member; survivors still finish
            out.append(e)
    return out
