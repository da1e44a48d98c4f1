"""Moving bytes between processes.

- :mod:`tensorhub.transport.nixl`: NIXL agents, registered regions with their control blocks,
  sources (remote regions seen from a reader);
- :mod:`tensorhub.transport.reader`: the reader loop (one-sided reads of a possibly partial holder);
- :mod:`tensorhub.transport.pacing`: how many reads the loop keeps posted and how long it sleeps;
- :mod:`tensorhub.transport.shm`: the same-host tier (a holder's memory mapped by a reader on its
  host), and :mod:`tensorhub.transport.cuda_ipc`, its CUDA IPC half for GPU tensors.

Their public names are re-exported here. Importing this package does not import nixl (the agent
is created lazily).
"""

from tensorhub.transport import nixl as _nixl
from tensorhub.transport import reader as _reader
from tensorhub.transport.nixl import *  # noqa: F401,F403 - the names in nixl.__all__
from tensorhub.transport.reader import pull

__all__ = list(_nixl.__all__) + list(_reader.__all__)
