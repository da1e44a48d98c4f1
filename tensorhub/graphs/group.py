"""The entry point of :mod:`tensorhub.graphs`: :func:`replicate_group` runs a group's
replication here (:func:`tensorhub.graphs.pipeline.run_group`) or in the model's server-side
coordinator (:mod:`tensorhub.graphs.coordinator`, which runs ``run_group`` there). This module
sits above both, so neither imports the other's caller."""

from __future__ import annotations

from typing import Optional, Sequence

import ray

from tensorhub.graphs import pipeline
from tensorhub.graphs.coordinator import coordinator


def replicate_group(actors: Sequence, spec="latest", *, update: bool = True, path: str = "auto",
                    batches: Optional[int] = None, cache: Optional[pipeline.GraphCache] = None,
                    compile: str = "background", timeout_s: float = 300.0,
                    where: Optional[str] = None, config=None) -> pipeline.GroupResult:
    """Replicate version ``spec`` into every actor of ``actors`` (each a :class:`GraphMember`).

    Blocks until every member holds the version (or failed: its entry in ``per_member`` is the
    exception). ``update=True`` behaves like ``Hub.update`` (no-op when current), else like
    ``Hub.replicate``. ``path``: ``"graph"`` forces the compiled graph (compiling synchronously
    on a cache miss), ``"pull"`` the plain concurrent pull path, ``"auto"`` whichever measured
    faster for this topology (module doc; ``result.why`` says why). ``compile="background"``
    (auto only) compiles a missing graph after the pull path finished, for the next version;
    ``"never"`` does not. ``batches`` (None: one per unit, at most ``BATCHES_MAX``) is fixed per
    topology (part of the key): batch k covers units ``[end(k-1), end(k))``. Raises
    ``ValueError`` on bad arguments; member failures never raise here, the survivors finish on
    the pull path.

    ``where``: ``"server"`` (the default when no ``cache`` is given) builds, caches and runs the
    graph in the server-side :class:`~tensorhub.graphs.coordinator.GraphCoordinator` of the
    members' model (found by ``config``'s server name and namespace, and the model the first
    member reports; :func:`~tensorhub.server.naming.graphs_actor_name`), so every driver shares one cache and
    compiled graphs outlive the calling process; ``"local"`` (the default with a ``cache``) runs
    them in this process with ``cache``. With ``"server"`` the result's ``plan`` is None and
    ``plan_drawing`` shows the chain."""
    if where is None:
        where = "local" if cache is not None else "server"
    if where not in ("server", "local"):
        raise ValueError(f"where must be 'server' or 'local', got {where!r}")
    if where == "server":
        if cache is not None:
            raise ValueError("a cache lives in this process: pass where='local' with it")
        kwargs = dict(update=update, path=path, batches=batches, compile=compile, timeout_s=timeout_s)
        model = _members_model(actors, timeout_s) if (config is None or config.server_per_model) else ""
        out = ray.get(coordinator(config, model).replicate_group.remote(list(actors), spec, kwargs))
        drawing = out.pop("plan")
        return pipeline.GroupResult(**out, plan=None, plan_drawing=drawing)
    return pipeline.run_group(actors, spec, update=update, path=path, batches=batches, cache=cache,
                              compile=compile, timeout_s=timeout_s)


def _members_model(actors: Sequence, timeout_s: float) -> str:
    """The model of the first member that answers (the members of a group share one), or ""
    when none does (the namespace's shared coordinator then runs it; the members' failures
    show in its result as usual)."""
    for a in actors:
        try:
            return ray.get(a.th_graph_model.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a dead member: ask the next
            continue
    return ""
