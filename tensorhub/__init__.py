"""TensorHub: reference-oriented weight transfer for LLM RL on Ray.

    hub = tensorhub.open("policy")          # one shard of one replica
    hub.register(model.state_dict())
    hub.publish(step)       # trainer
    hub.update("latest")    # rollout

See docs/ for the manual: docs/concepts.md, docs/configuration.md, docs/limits.md.
"""

from __future__ import annotations

from typing import Optional

from tensorhub.handle import Hub, HubState, ReadStats
from tensorhub.config import Config
from tensorhub.errors import TensorHubError

__all__ = ["Config", "Hub", "HubState", "ReadStats", "TensorHubError", "open"]
__version__ = "0.1.0"


def open(  # noqa: A001 - the paper's name for it
    model: str,
    *,
    shard: int = 0,
    num_shards: int = 1,
    replica: Optional[str] = None,
    datacenter: Optional[str] = None,
    spot: bool = False,
    retains: bool = True,
    config: Optional[Config] = None,
    port=None,
) -> Hub:
    """Open a handle on one shard of one replica of ``model``.

    Connects to the reference server of ``model`` (a detached named Ray actor, created by the
    first ``open()`` of the model in the namespace; with ``Config.server_per_model`` off, one
    server for every model; ``ray.init()`` is called if Ray is not initialised yet). Works
    from a driver, a task or inside any Ray actor. ``replica`` names the replica (required when
    ``num_shards > 1``: all shards of one replica pass the same name). ``spot=True`` marks a
    holder that may vanish at any time (it does not count toward retention). ``retains=False``
    marks a holder that never keeps a retention copy (a host copy of a retained version) and whose
    copies do not count toward retention either: a rollout engine whose memory is for serving,
    while the trainer keeps the retained versions. ``config`` defaults
    to ``Config.from_env()``. ``port`` overrides the server connection (tests:
    ``tensorhub.ports.LocalPort``).
    """
    config = config or Config.from_env()
    if port is None:
        from tensorhub.ports import connect

        port = connect(config, model)
    return Hub(model, port, shard=shard, num_shards=num_shards, replica=replica,
               datacenter=datacenter, spot=spot, retains=retains, config=config)
