"""The names of a namespace's server actors: pure functions of a :class:`~tensorhub.Config`.

With ``server_per_model`` (the default) every model has its own reference server, named
``<server_name>/<model percent-encoded>``, and its compiled-graph coordinator beside it,
``<server_name>-graphs/<model encoded>``; without, one server ``server_name`` serves every model
(and one coordinator ``<server_name>-graphs``). Nothing here talks to Ray
(:mod:`tensorhub.server.find` does).
"""

from __future__ import annotations

import urllib.parse

from tensorhub.errors import ConfigError


def actor_name(config, model: str) -> str:
    """The name of the reference server actor that serves ``model`` (in ``config.namespace``).

    With ``server_per_model``: ``<server_name>/<model>``, the model percent-encoded
    (``urllib.parse.quote(model, safe="")``: letters, digits and ``_.-~`` stay, every other
    byte of its UTF-8 becomes ``%XX``, so "/" never appears in the suffix), e.g.
    ``tensorhub-server/policy`` and ``tensorhub-server/org%2Fpolicy%20v2``. Without:
    ``server_name`` for every model. Raises ConfigError for an empty model."""
    if not isinstance(model, str) or not model:
        raise ConfigError("model must be a non-empty string")
    if not config.server_per_model:
        return config.server_name
    return f"{config.server_name}/{urllib.parse.quote(model, safe='')}"


def served_model(config, name: str) -> str | None:
    """The inverse of :func:`actor_name` for any mode: the model a server actor of
    ``config.server_name`` serves by its name, ``""`` for the one-server-for-all actor, None
    for a name that is not one of ours (``<server_name>-graphs``, another prefix)."""
    if name == config.server_name:
        return ""
    head, sep, tail = name.partition("/")
    if head != config.server_name or not sep or not tail or tail != urllib.parse.quote(urllib.parse.unquote(tail), safe=""):
        return None
    return urllib.parse.unquote(tail)


def graphs_actor_name(config, model: str = "") -> str:
    """The compiled-graph coordinator's actor name beside the server of ``model``:
    ``<server_name>-graphs/<model, encoded as above>`` with ``server_per_model`` and a
    model, else ``<server_name>-graphs`` (one per namespace)."""
    if not config.server_per_model or not model:
        return f"{config.server_name}-graphs"
    return f"{config.server_name}-graphs/{urllib.parse.quote(model, safe='')}"
