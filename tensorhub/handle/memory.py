"""A handle's registered memory (``hub._memory``): the tensors, their layout and transport
region, and the checksums of the version they hold.

:class:`Memory` owns that state; the handle's parts read it here (the driver, the read path, the
background part through the handle's lambdas, host copies through :class:`~tensorhub.handle.
host_copies.Held`). Rules:

- Set once by ``register`` (:meth:`Memory.attach`); a refused registration leaves nothing
  (:meth:`Memory.detach`); ``close`` releases the region (:meth:`Memory.release`).
- A double buffer's swap exchanges two handles' tensors and regions (:meth:`Memory.exchange`),
  under both handles' machine locks; other readers of :attr:`Memory.region` and
  :attr:`Memory.tensors` read each attribute once and use what they read.
- :attr:`Memory.checksums` are those of the version the tensors hold (published or replicated):
  what is published again with it and what verify mode checks (:meth:`Memory.verify_unchanged`).
"""

from __future__ import annotations

from typing import Optional

import torch

from tensorhub import errors
from tensorhub import transport as tx
from tensorhub.config import Config
from tensorhub.layout import Layout, checksum_all, checksum_unit


class Memory:
    """The registered tensors of one handle. Empty until :meth:`attach`."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self.layout: Optional[Layout] = None
        self.tensors: list[torch.Tensor] = []
        self.region: Optional[tx.Region] = None
        """The tensors' transport registration and control block (None before register and
        after close)."""
        self.checksums: list[int] = []
        """The units' checksums of the version held (empty with checksums and verify mode off)."""

    def attach(self, layout: Layout, tensors: list[torch.Tensor], region: tx.Region) -> None:
        """``register``: these tensors, of ``layout``, registered as ``region``."""
        self.layout, self.tensors, self.region = layout, tensors, region

    def detach(self) -> None:
        """The registration was refused: hold nothing (the caller closes the region it made)."""
        self.layout, self.tensors, self.region = None, [], None

    @property
    def complete(self) -> bool:
        """The region holds every unit of the layout."""
        region, layout = self.region, self.layout
        return region is not None and layout is not None and region.progress == layout.unit_count

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors as ``(name, tensor)`` in layout order ([] before register)."""
        layout = self.layout
        return [] if layout is None else [(meta.name, t) for meta, t in zip(layout.metas, self.tensors)]

    def hold_checksums(self) -> None:
        """The region holds a new version: keep its checksums (the region's, with checksums on;
        computed, for verify mode alone)."""
        if self._config.checksums:
            self.checksums = self.region.checksums()
        elif self._config.verify_mutability:
            self.checksums = checksum_all(self.tensors, self.layout)

    def verify_unchanged(self, model: str, shard: int, version: Optional[int]) -> None:
        """Verify mode: the bytes must still be those of :attr:`checksums` (``MutabilityViolation``
        naming the first unit written and its tensors)."""
        if not self.checksums:
            return
        for u, unit in enumerate(self.layout.units):
            if checksum_unit(self.tensors, unit) != self.checksums[u]:
                names = sorted({self.layout.metas[p.tensor_index].name for p in unit})
                raise errors.MutabilityViolation(
                    f"{model} version {version} shard {shard}: unit {u} ({', '.join(names)}) "
                    f"was written while published")

    def exchange(self, other: "Memory") -> None:
        """A swap: the two sets of tensors and their regions change hands; ``other``'s region
        then holds nothing. The caller holds both handles' machine locks."""
        self.region, other.region = other.region, self.region
        self.tensors, other.tensors = other.tensors, self.tensors
        other.region.set_progress(0)
        other.region.set_version(-1)

    def release(self) -> None:
        """``close``: the region's transport registration goes (idempotent)."""
        if self.region is not None:
            self.region.close()
            self.region = None
