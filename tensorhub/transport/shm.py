"""The same-host tier: a reader on the holder's host copies straight out of the holder's memory.

Two processes on one host should not go through a network transport. At registration a
holder's CPU tensors move into shared memory *in place* (``UntypedStorage.share_memory_()``
swaps each storage for a shared one: the tensor objects, their views and a model's parameters
stay valid), and so does the region's control block. The endpoint then also carries
:class:`ShmInfo`: the host's identity, the holder's pid and, per storage, the file descriptor
that keeps its shared memory alive. A reader on the same host opens ``/proc/<pid>/fd/<fd>``,
maps it (once: mappings are cached with the source) and copies units with a few threads;
every other rule is the NIXL read loop's (:class:`~tensorhub.transport.readstate.ReadState`):
only units the source's control block shows final, the verified prefix in unit order, the
checksums, the stall timeout, a partial holder's progress.

Host identity is the kernel's boot id plus the network namespace: the emulated cluster's hosts
(namespaces on one machine) are different hosts, two Ray nodes in one namespace are one.

CUDA tensors take CUDA IPC instead (:mod:`tensorhub.transport.cuda_ipc`: the handles travel in
:attr:`ShmInfo.cuda`, the control block stays here in host shared memory). Where ``/dev/shm``
lacks the room the region keeps NIXL only. A reader that cannot open the holder's memory
(another PID namespace, no permission, a GPU it does not see) falls back to NIXL too.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import mmap
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Optional

import msgspec
import torch

from tensorhub.config import Config
from tensorhub.errors import ChecksumMismatch, InvalidState, SourceUnreachable
from tensorhub.layout import Layout, checksum_unit
from tensorhub.transport import cuda_ipc
from tensorhub.transport.storages import distinct_storages, storage_offsets
from tensorhub.transport.cuda_ipc import CudaStorage
from tensorhub.transport.readstate import ReadState

logger = logging.getLogger(__name__)

_HEADER = 2  # the control block: [version, progress, checksum per unit] (as in nixl.py)


class ShmInfo(msgspec.Struct, frozen=True):
    """How a reader on the same host maps a region: ``storages`` are (fd, bytes) in the
    holder's process ``pid``; ``tensors`` (layout order) are (storage index, byte offset), -1
    for an empty tensor; ``control`` the control block's (fd, bytes). For a region on a GPU,
    ``storages`` is empty and ``cuda`` holds the exported CUDA storages ``tensors`` index."""

    host: str
    pid: int
    storages: tuple[tuple[int, int], ...]
    tensors: tuple[tuple[int, int], ...]
    control: tuple[int, int]
    cuda: tuple[CudaStorage, ...] = ()


@functools.lru_cache(maxsize=1)
def host_key() -> str:
    """This host's identity for the same-host tier (boot id + network namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    return f"{boot}:{netns}"


def _shm_free_bytes() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def share(tensors: Sequence[torch.Tensor], control: torch.Tensor, config: Config) -> Optional[ShmInfo]:
    """Move ``tensors`` (CPU, contiguous) and ``control`` into shared memory in place, so that
    same-host readers can map them; None (nothing changed) if not possible or not wanted."""
    if not config.same_host or not host_key():
        return None
    devices = {t.device.type for t in tensors}
    if devices == {"cuda"}:
        return _share_cuda(tensors, control, config)
    if devices != {"cpu"}:
        return None
    found = distinct_storages(list(tensors) + [control])
    need = sum(st.nbytes() for st in found.values() if not st.is_shared())
    if need and need * 1.1 > _shm_free_bytes():
        logger.info("same-host tier off for this region: /dev/shm has %d bytes free, %d needed",
                    _shm_free_bytes(), need)
        return None
    try:
        fds: dict[int, tuple[int, int]] = {}
        for st in found.values():
            st.share_memory_()  # a no-op for memory already shared
            fd, size = st._share_fd_cpu_()
            fds[st.data_ptr()] = (int(fd), int(size))
    except Exception as e:  # noqa: BLE001 - e.g. an mmapped or pinned storage, another strategy
        logger.info("same-host tier off for this region: %s", e)
        return None
    order = list(fds)
    ctl_fd, ctl_size = fds[control.untyped_storage().data_ptr()]
    return ShmInfo(host=host_key(), pid=os.getpid(), storages=tuple(fds[p] for p in order),
                   tensors=storage_offsets(tensors, order), control=(ctl_fd, ctl_size))


def _share_cuda(tensors: Sequence[torch.Tensor], control: torch.Tensor, config: Config) -> Optional[ShmInfo]:
    """CUDA tensors: their storages exported by CUDA IPC, the control block in shared memory."""
    if not config.cuda_ipc:
        return None
    exported = cuda_ipc.export(tensors)
    if exported is None:
        return None
    cuda, descs = exported
    try:
        st = control.untyped_storage()
        st.share_memory_()
        fd, size = st._share_fd_cpu_()
    except Exception as e:  # noqa: BLE001
        logger.info("CUDA IPC off for this region: control block not shareable: %s", e)
        return None
    return ShmInfo(host=host_key(), pid=os.getpid(), storages=(), tensors=descs, control=(int(fd), int(size)),
                   cuda=cuda)


def usable(info: Optional[ShmInfo]) -> bool:
    """Whether a region described by ``info`` can be read through shared memory from here (for a
    GPU region: by CUDA IPC, every GPU it uses visible in this process)."""
    if info is None or not info.host or info.host != host_key():
        return False
    # CUDA cannot open this process's own IPC handles: a GPU region of this process goes by NIXL
    return not info.cuda or (info.pid != os.getpid() and cuda_ipc.usable(info.cuda))


class ShmSource:
    """The holder's memory mapped into this process (read-only). Raises
    :class:`SourceUnreachable` if it cannot be mapped."""

    def __init__(self, info: ShmInfo) -> None:
        self.info = info
        self.name = f"shm:{info.pid}"
        self._maps: list[mmap.mmap] = []
        self._ids: list[tuple[int, int]] = []
        try:
            views = [self._map(fd, size) for fd, size in info.storages]
            self.control = self._map(*info.control).view(torch.int64)
            if info.cuda:
                views = cuda_ipc.open_storages(info.cuda)
                self.name = f"cuda-ipc:{info.pid}"
        except (OSError, RuntimeError, LookupError) as e:
            self.close()
            raise SourceUnreachable(f"cannot map the memory of process {info.pid}: {e}") from e
        self._views = views
        self.reached = True

    def _map(self, fd: int, size: int) -> torch.Tensor:
        path = f"/proc/{self.info.pid}/fd/{fd}"
        f = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(f)
            mm = mmap.mmap(f, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ)
        finally:
            os.close(f)
        self._maps.append(mm)
        self._ids.append((st.st_dev, st.st_ino))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: we never write through it
            return torch.frombuffer(mm, dtype=torch.uint8)

    def still_same(self) -> bool:
        """The holder still has the memory we mapped (a descriptor number can be reused)."""
        try:
            for (fd, _), ident in zip(self.info.storages + (self.info.control,), self._ids):
                st = os.stat(f"/proc/{self.info.pid}/fd/{fd}")
                if (st.st_dev, st.st_ino) != ident:
                    return False
        except OSError:
            return False
        return True

    def alive(self) -> bool:
        """The holder process still holds its control block (cheap: one ``stat``). Its memory
        outlives it while mapped here, but a dead partial holder will never advance."""
        try:
            st = os.stat(f"/proc/{self.info.pid}/fd/{self.info.control[0]}")
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._ids[-1]

    def piece(self, tensor_index: int, offset: int, nbytes: int) -> torch.Tensor:
        si, base = self.info.tensors[tensor_index]
        return self._views[si][base + offset:base + offset + nbytes]

    def close(self) -> None:
        self._views = []
        self.control = None
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
        self._maps = []


class LocalSource:
    """A region of this very process as a source: a handle's prefetch staging copy read by the
    handle itself (:meth:`tensorhub.client.Hub.prefetch`). Same read loop as a mapped same-host
    source, over the region's own tensors (CPU or GPU) and control block; the units are not
    hashed again (they were verified when they landed in the staging copy, in this process):
    their checksums are carried over from the staging control block."""

    verify = False

    def __init__(self, region, name: str) -> None:
        self.name = name
        self.region = region
        self.control = region.control
        self._bytes = [t.reshape(-1).view(torch.uint8) if t.numel() else None for t in region.tensors]
        self.reached = True

    def still_same(self) -> bool:
        return not getattr(self.region, "_closed", False)

    def alive(self) -> bool:
        return self.still_same()

    def piece(self, tensor_index: int, offset: int, nbytes: int) -> torch.Tensor:
        return self._bytes[tensor_index][offset:offset + nbytes]

    def copy_all(self, dst: Sequence[torch.Tensor], threads: int) -> None:
        """Every byte at once (the common case: the staging copy was complete before the
        update): one ``copy_`` per tensor when torch runs its own intra-op threads, else the
        bytes cut into ``threads`` equal spans copied side by side."""
        pairs = [(d.reshape(-1).view(torch.uint8), s) for d, s in zip(dst, self._bytes) if s is not None]
        if threads <= 1 or torch.get_num_threads() > 1 or any(d.device.type != "cpu" for d, _ in pairs):
            for d, s in pairs:
                d.copy_(s)
            cuda_ipc.synchronize(dst)
            return
        total = sum(s.numel() for _, s in pairs)
        span = -(-total // threads)
        jobs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(threads)]
        pos = 0
        for d, s in pairs:
            off, n = 0, s.numel()
            while off < n:
                k = min(pos // span, threads - 1)
                take = min(n - off, (k + 1) * span - pos) if k < threads - 1 else n - off
                jobs[k].append((d[off:off + take], s[off:off + take]))
                off += take
                pos += take
        for f in [_copier(threads).submit(_copy_pairs, job) for job in jobs if job]:
            f.result()

    def close(self) -> None:
        self._bytes = []


def _copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for d, s in pairs:
        d.copy_(s)


class _Copier:
    """The process's same-host copy threads: one pool, replaced by a larger one when a pull asks
    for more threads. The pool replaced is shut down without waiting (its queued copies still
    run, then its threads exit); a pull holding this object submits to the current pool, so
    none submits to a pool shut down."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._threads = 0

    def at_least(self, threads: int) -> "_Copier":
        with self._lock:
            if self._pool is None or self._threads < threads:
                old = self._pool
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                                   thread_name_prefix="tensorhub-shm")
                self._threads = threads
                if old is not None:
                    old.shutdown(wait=False)
        return self

    def submit(self, fn, *args) -> concurrent.futures.Future:
        with self._lock:
            return self._pool.submit(fn, *args)


_COPIER = _Copier()


def _copier(threads: int) -> _Copier:
    """The copy threads, at least ``threads`` of them."""
    return _COPIER.at_least(threads)


def _copy_units(src, dst: Sequence[torch.Tensor], layout: Layout, units: Sequence[int],
                checksums: bool) -> list[Optional[int]]:
    """Copy (and hash) a run of units; one task per run keeps the hand-offs between threads few."""
    out = []
    for u in units:
        unit = layout.units[u]
        for p in unit:
            dst[p.tensor_index].reshape(-1).view(torch.uint8)[p.offset:p.offset + p.nbytes].copy_(
                src.piece(p.tensor_index, p.offset, p.nbytes))
        out.append(checksum_unit(dst, unit) if checksums else None)
    if not checksums and dst[0].is_cuda:  # GPU copies return early (hashing waits for them)
        cuda_ipc.synchronize(dst)
    return out


_TASK_BYTES = 32 << 20
"""Bytes one copy task covers (units in a row): fewer, larger tasks cost less Python per byte."""


def _to_u64(s: int) -> int:
    return s & 0xFFFFFFFFFFFFFFFF


def pull(region, src, layout: Layout, *, expect_version: int, config: Config,
         start_unit: int = 0, end_unit: Optional[int] = None,
         on_unit: Optional[Callable[[int], None]] = None,
         should_stop: Optional[Callable[[], bool]] = None) -> int:
    """Like :func:`tensorhub.transport.reader.pull`, from a same-host source's memory (a
    :class:`ShmSource`, or a :class:`LocalSource` of this process): copies units
    ``[start_unit, end_unit)`` of ``expect_version`` into ``region`` and returns the bytes read;
    every copy it started has ended when it returns or raises."""
    n_units = layout.unit_count if end_unit is None else max(0, min(end_unit, layout.unit_count))
    if start_unit == 0:
        region.set_progress(0)
        region.set_version(expect_version)
    else:
        if region.version != expect_version or not 0 < start_unit <= region.progress:
            raise InvalidState(f"cannot resume at unit {start_unit}: region holds version {region.version} "
                               f"with progress {region.progress}, want version {expect_version}")
        region.set_progress(start_unit)
    if start_unit >= n_units:
        return 0
    if not src.still_same():
        raise SourceUnreachable(f"{src.name}: the memory mapped earlier is gone")
    ctl = src.control
    if (isinstance(src, LocalSource) and start_unit == 0 and n_units == layout.unit_count
            and int(ctl[0]) == expect_version and int(ctl[1]) == n_units):
        # A complete copy in this process: one bulk copy, no per-unit pipeline to keep.
        src.copy_all(region.tensors, max(1, config.same_host_threads))
        region.control[_HEADER:_HEADER + n_units] = ctl[_HEADER:_HEADER + n_units]
        if int(ctl[0]) != expect_version:  # moved on meanwhile (cannot while we are its reader)
            raise SourceUnreachable(f"{src.name}: the staging copy changed version during the copy")
        region.set_progress(n_units)
        if on_unit is not None:
            for u in range(n_units):
                on_unit(u)
        return layout.total_bytes
    threads = max(1, config.same_host_threads)
    per_task = max(1, _TASK_BYTES // max(1, layout.total_bytes // max(1, layout.unit_count)))
    st = ReadState(expect_version, start_unit, n_units, window_max=threads * per_task,
                   stall_timeout_s=config.source_stall_timeout_s, now=time.monotonic(), source=src.name,
                   fixed_window=True)
    pool = _copier(threads)
    hash_units = config.checksums and getattr(src, "verify", True)
    inflight: dict[concurrent.futures.Future, list[int]] = {}
    landed: dict[int, Optional[int]] = {}
    nbytes = 0
    idle = 50e-6
    checked_alive = time.monotonic()
    try:
        while not st.finished:
            if should_stop is not None and should_stop():
                break
            now = time.monotonic()
            v, p = int(ctl[0]), int(ctl[1])
            st.source_state(v, p, ctl[_HEADER:_HEADER + p].tolist() if v == expect_version and p > st.remote_progress
                            else None, now)
            run: list[int] = []
            while (u := st.next_to_post()) is not None:
                run.append(u)
                st.posted(u, layout.unit_nbytes(u), now)
                if len(run) == per_task:
                    inflight[pool.submit(_copy_units, src, region.tensors, layout, run, hash_units)] = run
                    run = []
            if run:
                inflight[pool.submit(_copy_units, src, region.tensors, layout, run, hash_units)] = run
            if inflight:
                done, _ = concurrent.futures.wait(list(inflight), timeout=0.05,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
            else:
                done = set()
            moved = False
            for f in done:
                units = inflight.pop(f)
                landed.update(zip(units, f.result()))
                st.completed(units, time.monotonic())
                moved = True
            while (u := st.next_to_verify()) is not None:
                expected = st.expected_sum(u)
                got = landed.pop(u)
                if got is not None and got != _to_u64(expected):
                    raise ChecksumMismatch(f"unit {u} from {src.name}: checksum {got:#018x}, source published "
                                           f"{_to_u64(expected):#018x}")
                region.control[_HEADER + u] = expected
                nbytes += layout.unit_nbytes(u)
                st.verified(u, time.monotonic())
                region.set_progress(st.prefix)  # after the checksum: followers rely on the order
                if on_unit is not None:
                    on_unit(u)
            if moved:
                idle = 50e-6
                continue
            now = time.monotonic()
            st.check_stalled(now, inflight=[u for us in inflight.values() for u in us])
            if not inflight:  # starved: the source has not got further yet
                if now - checked_alive > 0.02:
                    checked_alive = now
                    if not src.alive():
                        raise SourceUnreachable(f"{src.name}: the holder process is gone at unit "
                                                f"{st.remote_progress} of {n_units}")
                slept = time.monotonic()
                time.sleep(idle)
                region.starved_s += time.monotonic() - slept
                idle = min(idle * 2, 2e-3)
    finally:
        if inflight:
            concurrent.futures.wait(list(inflight))  # memory copies: bounded
    return nbytes
