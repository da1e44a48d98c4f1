"""Moving bytes between processes. The NIXL one-sided-read data path lives in
:mod:`tensorhub.transport.nixl`; its public names are re-exported here. Importing this package
does not import nixl (the agent is created lazily)."""

from tensorhub.transport.nixl import (
    Agent,
    Endpoint,
    MemRegion,
    Region,
    Source,
    decode_endpoint,
    encode_endpoint,
    get_agent,
    open_source,
    pull,
)

__all__ = [
    "Agent",
    "Endpoint",
    "MemRegion",
    "Region",
    "Source",
    "decode_endpoint",
    "encode_endpoint",
    "get_agent",
    "open_source",
    "pull",
]
