"""The storages under a region's tensors, as the same-host tiers describe them to a reader."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def distinct_storages(tensors: Sequence[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The storages under the non-empty ``tensors``, each once (views share one), by address."""
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.numel():
            st = t.untyped_storage()
            out.setdefault(st.data_ptr(), st)
    return out


def storage_offsets(tensors: Sequence[torch.Tensor], order: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Per tensor, (index in ``order`` of its storage's address, byte offset in that storage);
    ``(-1, 0)`` for an empty tensor."""
    index = {ptr: i for i, ptr in enumerate(order)}
    out = []
    for t in tensors:
        if not t.numel():
            out.append((-1, 0))
        else:
            base = t.untyped_storage().data_ptr()
            out.append((index[base], t.data_ptr() - base))
    return tuple(out)
