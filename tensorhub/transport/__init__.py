"""Moving bytes between processes.

- :mod:`tensorhub.transport.base`: the interfaces: a source (three kinds) and a tier's pull (two
  tiers), as every kind and tier has them;
- :mod:`tensorhub.transport.agent`: the process's NIXL agent and the rules for calling into one;
- :mod:`tensorhub.transport.nixl`: registered regions with their control blocks, sources (remote
  regions seen from a reader);
- :mod:`tensorhub.transport.reader`: the reader loop (one-sided reads of a possibly partial holder);
- :mod:`tensorhub.transport.pacing`: how many reads the loop keeps posted and how long it sleeps;
- :mod:`tensorhub.transport.ranges`: a resharding plan's runs read from one holder shard straight
  into the reader's tensors (NIXL range reads, same-host range copies);
- :mod:`tensorhub.transport.reshard_read`: a reader shard's resharded read from every shard of a
  holder replica (plan, range reads, cell checks, publish; the handle drives it from the
  server's reshard assignments: :mod:`tensorhub.handle.reshard`);
- :mod:`tensorhub.transport.shm`: the same-host tier (a holder's memory mapped by a reader on its
  host), and :mod:`tensorhub.transport.cuda_ipc`, its CUDA IPC half for GPU tensors.

Their public names are re-exported here, by name (``tests/project/test_exports.py`` pins them). Importing this package does not import nixl (the agent
is created lazily).
"""

from tensorhub.transport.agent import Agent, get_agent
from tensorhub.transport.nixl import (Endpoint, MemRegion, Region, Source, decode_endpoint, encode_endpoint,
                                     open_source)
from tensorhub.transport.reader import KnownProgress, pull

__all__ = ["Agent", "Endpoint", "KnownProgress", "MemRegion", "Region", "Source", "decode_endpoint",
           "encode_endpoint", "get_agent", "open_source", "pull"]
