"""Finding a namespace's reference servers in Ray: create a model's on first use, find a running
one, list them all. Their names are :mod:`tensorhub.server.naming`'s."""

from __future__ import annotations

import dataclasses
from typing import Optional

import ray

from tensorhub.config import Config
from tensorhub.server.actor import ReferenceServer
from tensorhub.server.naming import actor_name, served_model


_MAX_CONCURRENCY = 1_000_000
"""Calls the server may have open at once: every idle process keeps one pulse held there
(Ray's default for an async actor, 1,000, would queue the fleet's other calls behind them)."""


def server_handle(config: Config, model: str):
    """The server actor of ``model`` (:func:`~tensorhub.server.naming.actor_name`), created on first use
    (detached, named, get-if-exists; ``ray.init()`` first if Ray is not initialised), on the
    caller's node with ``server_near_creator``. Blocks until it answers a ping. The first
    caller's ``config`` becomes the server's."""
    if not ray.is_initialized():
        ray.init(namespace=config.namespace, log_to_driver=False)
    name = actor_name(config, model)
    placement = {}
    node_id = _creator_node() if config.server_near_creator else None
    if node_id:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # Hard affinity: the creator's node is alive (the creator runs there) and a zero-CPU
        # actor fits it. Ray 2.60 places a *soft*-affine detached actor on the head node
        # whatever the node named (measured on the emulated cluster: 3 of 3 placements).
        placement["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    handle = ReferenceServer.options(
        name=name, namespace=config.namespace, lifetime="detached", get_if_exists=True,
        max_concurrency=_MAX_CONCURRENCY, **placement,
    ).remote(dataclasses.asdict(config), model if config.server_per_model else "")
    ray.get(handle.ping.remote())
    return handle


def _creator_node() -> Optional[str]:
    """This process's Ray node (hex id), or None where Ray cannot say (a Ray Client driver):
    then the server goes wherever Ray puts it."""
    try:
        return ray.get_runtime_context().get_node_id() or None
    except Exception:  # noqa: BLE001 - placement is a preference, never a reason to fail
        return None


def find_server(config: Config, model: str):
    """The running server actor of ``model``; never creates one. Raises ValueError (as
    ``ray.get_actor``) when there is none. For tools and tests (kill it, read its status)."""
    return ray.get_actor(actor_name(config, model), namespace=config.namespace)


def list_servers(config: Config) -> dict[str, str]:
    """Every live server actor of ``config.server_name`` in ``config.namespace``, both modes:
    ``{actor name: model it serves}`` ("" for a one-server-for-all actor). One GCS call
    (``ray.util.list_named_actors(all_namespaces=True)``: the caller's namespace may differ);
    a killed actor's name is released, so it is not listed."""
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != config.namespace:
            continue
        model = served_model(config, entry["name"])
        if model is not None:
            out[entry["name"]] = model
    return dict(sorted(out.items()))
