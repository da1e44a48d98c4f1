"""Moving bytes between processes. The NIXL one-sided-read data path lives in
:mod:`tensorhub.transport.nixl`; its public names are re-exported here. Importing this package
does not import nixl (the agent is created lazily)."""

from tensorhub.transport import nixl as _nixl
from tensorhub.transport.nixl import *  # noqa: F401,F403 - the names in nixl.__all__

__all__ = list(_nixl.__all__)
