"""The server side of compiled-graph pipelines: a detached named actor that owns the graph cache.

The reference server itself is an async actor that must never block, and a compiled graph can
only be executed by the process that compiled it; so graphs are built, cached and executed by
this companion actor, one group at a time: ``<server_name>-graphs/<model>`` beside each model's
server with ``Config.server_per_model`` (one model's compiles never queue behind another's),
``<server_name>-graphs`` otherwise (:func:`tensorhub.server.naming.graphs_actor_name`). It
turns the plan the core produced (the chain of assignments the members received) into a Ray
Compiled Graph, keeps it across versions while the members stay the same, and tears it down
when membership changes or a member fails. ``replicate_group(..., where="server")`` uses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import ray

from tensorhub.config import Config
from tensorhub.graphs.pipeline import GraphCache, run_group
from tensorhub.server.naming import graphs_actor_name


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1)
class GraphCoordinator:
    """Runs :func:`tensorhub.graphs.pipeline.run_group` with its own :class:`GraphCache`.
    ``max_concurrency=1``: one group at a time (an actor may be in one live graph only)."""

    def __init__(self, cache_kwargs: Optional[dict] = None) -> None:
        self.cache = GraphCache(**(cache_kwargs or {}))

    def replicate_group(self, actors: Sequence, spec: Any, kwargs: dict) -> dict:
        res = run_group(list(actors), spec, cache=self.cache, **kwargs)
        out = {f.name: getattr(res, f.name) for f in dataclasses.fields(res)}
        out["plan"] = res.plan_drawing
        del out["plan_drawing"]
        out["per_member"] = [m if isinstance(m, dict) else {"error": f"{type(m).__name__}: {m}"} for m in res.per_member]
        return out

    def stats(self) -> dict:
        return {"compiles": self.cache.compiles, "teardowns": self.cache.teardowns, "graphs": len(self.cache)}

    def clear(self) -> None:
        self.cache.clear()


def coordinator(config: Optional[Config] = None, model: str = ""):
    """The coordinator actor of ``model`` (``""``, or ``server_per_model`` off: the one of the
    namespace), created on first use (detached, named). Blocks until it answers."""
    config = config or Config.from_env()
    handle = GraphCoordinator.options(
        name=graphs_actor_name(config, model), namespace=config.namespace, lifetime="detached",
        get_if_exists=True,
    ).remote()
    ray.get(handle.stats.remote())
    return handle
