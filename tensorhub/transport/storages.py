"""The storages under a region's tensors, as the same-host tiers describe them to a reader, and
the shared-memory files the CPU tier moves them into.

:func:`share_storages` moves a region's storages into shared memory *in place* (the tensor
objects, their views and a model's parameters stay valid: each storage's memory is swapped, the
storage object stays) and packs them into **one** shared-memory file per call, so a process
holds one descriptor per region, not one per tensor (torch's ``share_memory_()`` keeps a
descriptor open per storage: a few hundred tensors and several regions exhaust the process's
descriptors). A file lives as long as any storage in it: the storages own it (each one's memory
holds a reference to the file's mapping), and torch keeps its descriptor open while it lives.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Optional

import torch

_ALIGN_BYTES = 64
"""Each storage's start in a shared file (torch's CPU allocator aligns to 64 bytes too)."""


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


@dataclasses.dataclass(frozen=True)
class SharedFile:
    """A shared-memory file of this process: the descriptor that keeps it (open while the file
    lives), its size, its identity (``st_dev``, ``st_ino``) and where it is mapped here."""

    fd: int
    nbytes: int
    dev: int
    ino: int
    addr: int

    def holds(self, ptr: int) -> bool:
        return self.addr <= ptr < self.addr + self.nbytes


_lock = threading.Lock()
_files: list[tuple[SharedFile, Any]] = []
"""Files made by :func:`share_storages`, each with a weak reference to the mapping the storages
in it keep alive (dead ones are dropped at the next call)."""


def _live_files() -> list[SharedFile]:
    """The files still alive, by address. Call under ``_lock``."""
    _files[:] = [(f, ref) for f, ref in _files if ref() is not None]
    return sorted((f for f, _ in _files), key=lambda f: f.addr)


def _file_holding(files: Sequence[SharedFile], ptr: int) -> Optional[SharedFile]:
    """The file of ``files`` (by address) that holds address ``ptr``, if any."""
    i = bisect.bisect_right(files, ptr, key=lambda f: f.addr) - 1
    return files[i] if i >= 0 and files[i].holds(ptr) else None


def _pinned(st: torch.UntypedStorage) -> bool:
    """Page-locked memory (moving it would silently unpin the user's buffer). Asked only where
    CUDA is initialized: nothing is pinned before, and asking would create a CUDA context."""
    return torch.cuda.is_initialized() and st.is_pinned()


def _torch_file(st: torch.UntypedStorage) -> SharedFile:
    """A storage torch already shares by descriptor (``share_memory_()`` by the user, or received
    through ``torch.multiprocessing``): its own file, as it is. Raises if torch cannot name a
    descriptor for it (memory mapped from a named file, another sharing strategy)."""
    fd, size = st._share_fd_cpu_()  # noqa: SLF001 - for a shared storage: its kept descriptor
    s = os.fstat(int(fd))
    return SharedFile(int(fd), int(size), s.st_dev, s.st_ino, st.data_ptr())


def _aligned(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offsets of pieces of ``sizes`` laid out one after the other, each aligned to
    :data:`_ALIGN_BYTES`, and the total."""
    offsets, total = [], 0
    for n in sizes:
        total = -(-total // _ALIGN_BYTES) * _ALIGN_BYTES
        offsets.append(total)
        total += n
    return offsets, total


def _file_of(total: int):
    """A new shared file of ``total`` bytes, listed in ``_files``, and a numpy view of it: a
    ``torch.from_numpy`` of a slice of the view gives a storage of those bytes that keeps the
    view, hence the file, alive (the file's own storage closes its descriptor). Call under
    ``_lock``."""
    backing = torch.UntypedStorage._new_using_fd_cpu(max(total, 1))  # noqa: SLF001 - no private copy first
    fd, size = backing._share_fd_cpu_()  # noqa: SLF001
    s = os.fstat(int(fd))
    flat = torch.empty(0, dtype=torch.uint8).set_(backing).numpy()
    f = SharedFile(int(fd), int(size), s.st_dev, s.st_ino, backing.data_ptr())
    del backing
    _files.append((f, weakref.ref(flat)))
    return f, flat


def _new_file(storages: Sequence[torch.UntypedStorage]) -> SharedFile:
    """Move ``storages`` (not shared, distinct) into one new shared file, in place. Call under
    ``_lock``."""
    offsets, total = _aligned([st.nbytes() for st in storages])
    f, flat = _file_of(total)
    for st, off in zip(storages, offsets):
        piece = torch.from_numpy(flat[off:off + st.nbytes()]).untyped_storage()
        piece.copy_(st)
        st._swap_data_ptr_(piece)  # noqa: SLF001 - st now lives in the file; piece frees the old memory
    return f


def shared_empty(like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """New CPU tensors of ``like``'s shapes and dtypes (contiguous, not initialized), made
    directly in one new shared file: registering them moves nothing (:func:`share_storages`
    finds them there), and their first touch is the file's, not a private copy's first and
    then the file's again."""
    sizes = [t.numel() * t.element_size() for t in like]
    offsets, total = _aligned(sizes)
    with _lock:
        _, flat = _file_of(total)
    return [torch.from_numpy(flat[off:off + n]).view(t.dtype).view(t.shape) if n else
            torch.empty(t.shape, dtype=t.dtype) for t, off, n in zip(like, offsets, sizes)]


def bytes_to_move(storages: Sequence[torch.UntypedStorage]) -> int:
    """The shared memory :func:`share_storages` would take for ``storages`` (those not shared
    yet), alignment included."""
    with _lock:
        files = _live_files()
        return sum(-(-st.nbytes() // _ALIGN_BYTES) * _ALIGN_BYTES for st in storages
                   if _file_holding(files, st.data_ptr()) is None and not st.is_shared())


def share_storages(storages: Sequence[torch.UntypedStorage]) -> Optional[list[tuple[SharedFile, int]]]:
    """Per storage (CPU, distinct), the shared file holding it and its byte offset there.

    Storages already in a file of this module stay there; storages torch already shares by
    descriptor stay as they are (a file each, offset 0); the others move, in place, into one new
    file (see the module docstring). Nothing moves, and None is returned, when some storage
    cannot be described (pinned, mapped from a named file, another sharing strategy). After a
    storage moved, it may not be resized (torch refuses: its memory is not its allocator's), and
    sharing it again with torch (``share_memory_()``, or sending it through
    ``torch.multiprocessing``, which does that) would move it out of the file: the contract of a
    registered region forbids it anyway (no reallocation while registered: NIXL registered the
    addresses too).

    May raise ``OSError``/``RuntimeError`` when the file cannot be made (no descriptor left,
    ``/dev/shm`` full): then the storages not yet moved stay where they were; those moved stay
    valid in the file."""
    with _lock:  # the whole move: a storage two calls both found unshared would move twice
        return _share_locked(storages)


def _share_locked(storages: Sequence[torch.UntypedStorage]) -> Optional[list[tuple[SharedFile, int]]]:
    out: list[Optional[tuple[SharedFile, int]]] = [None] * len(storages)
    files = _live_files()
    fresh, torch_shared = [], []
    for i, st in enumerate(storages):
        if (f := _file_holding(files, st.data_ptr())) is not None:
            out[i] = (f, st.data_ptr() - f.addr)
        elif _pinned(st):
            return None
        elif st.is_shared():
            torch_shared.append(i)
        else:
            fresh.append(i)
    try:
        for i in torch_shared:
            out[i] = (_torch_file(storages[i]), 0)
    except (RuntimeError, OSError):
        return None
    if fresh:
        f = _new_file([storages[i] for i in fresh])
        for i in fresh:
            out[i] = (f, storages[i].data_ptr() - f.addr)
    return out  # type: ignore[return-value]  # every entry filled above
