"""The same-host tier for CUDA tensors: CUDA IPC handles instead of a network transport.

A holder whose registered tensors live on a GPU exports every distinct CUDA storage once, at
registration (torch's ``UntypedStorage._share_cuda_``: what ``torch.multiprocessing`` sends, and
what co-located RL frameworks pass between their trainer and rollout processes). The handles
travel in the endpoint (:class:`CudaStorage`, inside :class:`~tensorhub.transport.shm.ShmInfo`)
next to the control block, which stays in host shared memory. A reader on the same host opens
the handles once (:func:`open_storages`) and copies units GPU to GPU with the read loop of the
CPU tier (:func:`tensorhub.transport.shm.pull`): only units the control block shows final, the
verified prefix, the checksums, the stall timeout, a partial holder's progress.

Devices are matched by UUID, not index: Ray gives every actor its own ``CUDA_VISIBLE_DEVICES``,
so device 0 of the holder may be device 1 of the reader, or not visible to it at all; then the
tier is not used and the read goes through NIXL. So does any read whose handles cannot be opened.

Lifetime: an opened handle maps the holder's allocation; the holder frees its tensors only on
close, after draining its readers (the unpublish contract). A reader drops its mapping when the
source is closed (the sources it keeps open are bounded).

Untested on the development machines (no GPU): the tests that exercise real handles are marked
``gpu``; the device matching and the fallback are tested on CPU.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Optional

import msgspec
import torch

from tensorhub.transport.storages import distinct_storages, storage_offsets

logger = logging.getLogger(__name__)

__all__ = ["CudaStorage", "export", "local_device", "open_storages", "usable"]


class CudaStorage(msgspec.Struct, frozen=True):
    """One exported CUDA storage: the device's UUID and the arguments of
    ``UntypedStorage._new_shared_cuda`` (handle of the allocation, the storage's bytes and its
    offset in the allocation, torch's IPC reference counter, the producer's event)."""

    device_uuid: str
    handle: bytes
    nbytes: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: Optional[bytes] = None
    event_sync_required: bool = False


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


@functools.lru_cache(maxsize=64)
def local_device(device_uuid: str) -> Optional[int]:
    """This process's index of the GPU with ``device_uuid``; None if it is not visible here
    (or there is no CUDA)."""
    try:
        if not torch.cuda.is_available():
            return None
        for i in range(torch.cuda.device_count()):
            if _uuid(i) == device_uuid:
                return i
    except Exception:  # noqa: BLE001 - a broken driver: no CUDA IPC, NIXL instead
        logger.debug("cannot enumerate CUDA devices", exc_info=True)
    return None


def usable(storages: Sequence[CudaStorage]) -> bool:
    """Whether every storage's GPU is visible to this process."""
    return all(local_device(s.device_uuid) is not None for s in storages)


def export(tensors: Sequence[torch.Tensor]) -> Optional[tuple[tuple[CudaStorage, ...], tuple[tuple[int, int], ...]]]:
    """Export the CUDA storages under ``tensors`` (layout order): the storages, and per tensor
    (storage index, byte offset in the storage), ``(-1, 0)`` for an empty tensor. None if CUDA
    IPC cannot export them (e.g. memory from another allocator): the region then keeps NIXL."""
    found = distinct_storages(tensors)
    out: dict[int, CudaStorage] = {}
    try:
        for ptr, st in found.items():
            _dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = st._share_cuda_()
            out[ptr] = CudaStorage(
                device_uuid=_uuid(st.device.index), handle=bytes(handle), nbytes=int(size), offset=int(offset),
                ref_counter_handle=bytes(rc_handle), ref_counter_offset=int(rc_offset),
                event_handle=bytes(ev_handle) if ev_handle else None, event_sync_required=bool(ev_sync))
    except Exception as e:  # noqa: BLE001 - not exportable: NIXL only
        logger.info("CUDA IPC off for this region: %s", e)
        return None
    order = list(out)
    return tuple(out[p] for p in order), storage_offsets(tensors, order)


def open_storages(storages: Sequence[CudaStorage]) -> list[torch.Tensor]:
    """Open exported storages in this process: one uint8 tensor over each storage's bytes, on
    this process's index of its GPU. Raises ``RuntimeError`` (from CUDA) or ``LookupError`` (GPU
    not visible) when a handle cannot be opened."""
    views = []
    for s in storages:
        dev = local_device(s.device_uuid)
        if dev is None:
            raise LookupError(f"GPU {s.device_uuid} is not visible in this process")
        torch.cuda._lazy_init()  # noqa: SLF001 - what torch.multiprocessing does before opening
        st = torch.UntypedStorage._new_shared_cuda(  # noqa: SLF001
            dev, s.handle, s.nbytes, s.offset, s.ref_counter_handle, s.ref_counter_offset,
            s.event_handle, s.event_sync_required)
        views.append(torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(st, 0, (s.nbytes,)))
    return views


def synchronize(tensors: Sequence[torch.Tensor]) -> None:
    """Wait for the copies this thread queued on the GPUs of ``tensors`` (a unit counts as
    landed only once its bytes are there; ``copy_`` between GPU tensors returns before)."""
    seen = set()
    for t in tensors:
        if t.device.type == "cuda" and t.device not in seen:
            seen.add(t.device)
            torch.cuda.current_stream(t.device).synchronize()
