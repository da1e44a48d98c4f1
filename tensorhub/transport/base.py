"""The transport's interfaces: what a source is, and what a tier's pull does.

A *source* is a holder's region seen from a reader. Three kinds, one interface (:class:`Source`):

- :class:`tensorhub.transport.nixl.Source`: a region of another process, read by one-sided NIXL
  READs (RDMA where the NIC has it; a UCX cross-memory copy on one host without it);
- :class:`tensorhub.transport.shm.ShmSource`: a region of another process on this host, its memory
  mapped here (shared-memory files, or CUDA IPC handles for GPU tensors);
- :class:`tensorhub.transport.shm.LocalSource`: a region of this very process (a handle's prefetch
  staging copy read by the handle itself).

The last two are *near* sources (:class:`NearSource`): their bytes and control block are memory of
this process, copied by :func:`tensorhub.transport.shm.pull`.

A *tier* is a pull function (:class:`Pull`): :func:`tensorhub.transport.reader.pull` for NIXL
sources, :func:`tensorhub.transport.shm.pull` for near ones. Both read units
``[start_unit, end_unit)`` of ``expect_version`` straight into the reader's registered region,
verify and publish their progress unit by unit (so the reader can be a source itself while it
reads), call ``on_unit(u)`` after each, stop when ``should_stop()`` says so, return the bytes read,
and end every read they started before they return or raise. Which tier a read takes is the
handle's choice (:mod:`tensorhub.handle.sources`: the same-host tier where the holder lives on
this host and the config allows it, else NIXL). ``tests/transport/test_transport_interfaces.py`` checks that
every kind and tier has the interface stated here.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from tensorhub.config import Config
from tensorhub.layout import Layout


@runtime_checkable
class Source(Protocol):
    """A holder's region seen from a reader. ``name`` names the holder in errors and logs;
    ``reached`` is true once a read of it succeeded (its peer was reachable)."""

    name: str
    reached: bool

    def close(self) -> None:
        """Release what reading it holds (idempotent). The source's owner closes it, never a
        pull."""


@runtime_checkable
class NearSource(Source, Protocol):
    """A source whose memory this process reads directly (the same-host tier)."""

    control: torch.Tensor
    """The holder's control block (version, progress, checksums), live memory it writes."""

    def piece(self, tensor_index: int, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes of the holder's tensor ``tensor_index`` from ``offset`` (a view)."""

    def still_same(self) -> bool:
        """The memory still belongs to the region the endpoint published."""

    def alive(self) -> bool:
        """The holder's process is still there."""


class Pull(Protocol):
    """A tier: read units of ``expect_version`` from ``source`` into ``region`` (see the module
    docstring). Returns the bytes read. The region, the source and the layout are passed by
    position; the rest by name."""

    def __call__(self, region, source: Source, layout: Layout, /, *, expect_version: int, config: Config,
                 start_unit: int = 0, end_unit: Optional[int] = None,
                 on_unit: Optional[Callable[[int], None]] = None,
                 should_stop: Optional[Callable[[], bool]] = None) -> int: ...
