"""Ray Compiled Graph pipelines built from transfer plans.

- :class:`GraphMember`: mixin that makes any Ray actor with a hub (``self.tensorhub_handle``)
  a graph member.
- :func:`replicate_group`: replicate one version into a group of members, by a cached compiled
  graph or by the plain pull path (``path="auto"|"graph"|"pull"``); falls back to pull on failure.
- :class:`GraphCache` / :data:`default_cache`: compiled graphs by topology.
- :func:`build_plan`: the pure planner (assignments -> who feeds whom).

Importing this package does not import Ray's DAG modules until a graph is compiled.
"""

from tensorhub.graphs.member import GraphMember
from tensorhub.graphs.plan import Plan, PlanError, batch_end, build_plan

__all__ = ["GraphCache", "GraphMember", "GroupResult", "Plan", "PlanError", "batch_end", "build_plan",
           "default_cache", "replicate_group"]


def __getattr__(name):
    # pipeline imports ray; keep `import tensorhub.graphs` light for the mixin's users.
    if name in ("GraphCache", "GroupResult", "default_cache"):
        from tensorhub.graphs import pipeline

        return getattr(pipeline, name)
    if name == "replicate_group":
        from tensorhub.graphs import group

        return group.replicate_group
    raise AttributeError(name)
