"""The same-host tier: a reader on the holder's host copies straight out of the holder's memory.

Two processes on one host should not go through a network transport. At registration a
holder's CPU tensors move into shared memory *in place*, packed into one shared-memory file
per region (:func:`~tensorhub.transport.storages.share_storages`: each storage's memory is
swapped, so the tensor objects, their views and a model's parameters stay valid; one descriptor
per region, whatever its tensor count), and so does the region's control block. The endpoint
then also carries :class:`ShmInfo`: the host's identity, the holder's pid and, per file, the
descriptor that keeps it in the holder's process with the file's identity (device, inode). A
reader on the same host opens ``/proc/<pid>/fd/<fd>``, checks that it is the published file,
maps it (once: mappings are cached with the source) and copies units with a few threads;
every other rule is the NIXL read loop's (:class:`~tensorhub.transport.readstate.ReadState`):
only units the source's control block shows final, the verified prefix in unit order, the
checksums, the stall timeout, a partial holder's progress. The control block is another
process's live memory: it is read as a seqlock (see :func:`pull`).

Host identity is the kernel's boot id, the network namespace and the PID namespace: the
emulated cluster's hosts (namespaces on one machine) are different hosts, two Ray nodes in one
namespace are one, and two containers that share the host's network but not its PID namespace
are two (a pid names another process in each: the reader would map the wrong memory, and
checksums would not tell, the control block being the wrong process's too).

CUDA tensors take CUDA IPC instead (:mod:`tensorhub.transport.cuda_ipc`: the handles travel in
:attr:`ShmInfo.cuda`, the control block stays here in host shared memory). Where ``/dev/shm``
lacks the room the region keeps NIXL only. A reader that cannot open the holder's memory, or
finds a descriptor that is not the published file (no permission, a reused descriptor number,
a GPU it does not see), falls back to NIXL too.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import logging
import mmap
import os
import stat
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Optional

import msgspec
import torch
import xxhash

from tensorhub.config import Config
from tensorhub.errors import ChecksumMismatch, InvalidState, SourceUnreachable, TransferError
from tensorhub.layout import Layout, checksum_unit
from tensorhub.transport import cuda_ipc
from tensorhub.transport.storages import bytes_to_move, distinct_storages, share_storages
from tensorhub.transport.cuda_ipc import CudaStorage
from tensorhub.transport.readstate import ReadState

logger = logging.getLogger(__name__)

_HEADER = 2  # the control block: [version, progress, checksum per unit] (as in nixl.py)


class ShmFile(msgspec.Struct, frozen=True):
    """A shared-memory file of the holder: the descriptor ``fd`` that keeps it in the holder's
    process, its size, and its identity (``st_dev``, ``st_ino``), which a reader checks after
    opening ``/proc/<pid>/fd/<fd>``: a descriptor number names whatever the process that has
    that pid *here* holds under it (another PID namespace, a reused number)."""

    fd: int
    nbytes: int
    dev: int
    ino: int


class ShmInfo(msgspec.Struct, frozen=True):
    """How a reader on the same host maps a region: ``files`` are shared-memory files of the
    holder's process ``pid``; ``tensors`` (layout order) are (file index, byte offset), -1 for an
    empty tensor; ``control`` the control block's (file index, byte offset, bytes). For a region
    on a GPU, ``files`` holds the control block only and ``tensors`` index ``cuda``, the
    exported CUDA storages."""

    host: str
    pid: int
    files: tuple[ShmFile, ...]
    tensors: tuple[tuple[int, int], ...]
    control: tuple[int, int, int]
    cuda: tuple[CudaStorage, ...] = ()


@functools.lru_cache(maxsize=1)
def host_key() -> str:
    """This host's identity for the same-host tier: the boot id, the network namespace and the
    PID namespace, "" where this process cannot take part (no ``/proc``, or a ``/proc`` of
    another PID namespace, where ``/proc/<pid>`` does not name the process of that pid here).
    Two processes with one key resolve each other's pid to the same process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
        pidns = os.stat("/proc/self/ns/pid").st_ino
        if os.readlink("/proc/self") != str(os.getpid()):
            return ""
    except OSError:
        return ""
    return f"{boot}:{netns}:{pidns}"


def _shm_free_bytes() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _describe(storages: Sequence[torch.UntypedStorage]) -> Optional[tuple[list[ShmFile], list[tuple[int, int]]]]:
    """Share ``storages`` (:func:`~tensorhub.transport.storages.share_storages`): the files, and
    per storage (file index, byte offset); None (logged) where they cannot be shared."""
    try:
        placed = share_storages(storages)
    except (OSError, RuntimeError) as e:  # no descriptor left, /dev/shm full
        logger.info("same-host tier off for this region: %s", e)
        return None
    if placed is None:
        logger.info("same-host tier off for this region: a storage cannot be shared (pinned or file-mapped)")
        return None
    index: dict[int, int] = {}  # a file's address here -> its index in the endpoint
    files: list[ShmFile] = []
    out = []
    for f, off in placed:
        if f.addr not in index:
            index[f.addr] = len(files)
            files.append(ShmFile(f.fd, f.nbytes, f.dev, f.ino))
        out.append((index[f.addr], off))
    return files, out


def share(tensors: Sequence[torch.Tensor], control: torch.Tensor, config: Config) -> Optional[ShmInfo]:
    """Move ``tensors`` (CPU, contiguous) and ``control`` into shared memory in place, so that
    same-host readers can map them; None if not possible or not wanted (then nothing moved,
    except where the shared memory ran out midway: the storages moved stay valid)."""
    if not config.same_host or not host_key():
        return None
    devices = {t.device.type for t in tensors}
    if devices == {"cuda"}:
        return _share_cuda(tensors, control, config)
    if devices != {"cpu"}:
        return None
    found = distinct_storages(list(tensors) + [control])
    need = bytes_to_move(list(found.values()))
    if need and need * 1.1 > _shm_free_bytes():
        logger.info("same-host tier off for this region: /dev/shm has %d bytes free, %d needed",
                    _shm_free_bytes(), need)
        return None
    storages = list(found.values())
    described = _describe(storages)
    if described is None:
        return None
    files, placed = described
    where = {st.data_ptr(): at for st, at in zip(storages, placed)}  # the addresses after the move
    spans = []
    for t in tensors:
        if not t.numel():
            spans.append((-1, 0))
        else:
            st = t.untyped_storage()
            fi, off = where[st.data_ptr()]
            spans.append((fi, off + t.data_ptr() - st.data_ptr()))
    ci, coff = where[control.untyped_storage().data_ptr()]
    return ShmInfo(host=host_key(), pid=os.getpid(), files=tuple(files), tensors=tuple(spans),
                   control=(ci, coff + control.data_ptr() - control.untyped_storage().data_ptr(),
                            control.numel() * 8))


def _share_cuda(tensors: Sequence[torch.Tensor], control: torch.Tensor, config: Config) -> Optional[ShmInfo]:
    """CUDA tensors: their storages exported by CUDA IPC, the control block in shared memory."""
    if not config.cuda_ipc:
        return None
    exported = cuda_ipc.export(tensors)
    if exported is None:
        return None
    cuda, descs = exported
    described = _describe([control.untyped_storage()])
    if described is None:
        return None
    files, [(ci, coff)] = described
    return ShmInfo(host=host_key(), pid=os.getpid(), files=tuple(files), tensors=descs,
                   control=(ci, coff + control.data_ptr() - control.untyped_storage().data_ptr(),
                            control.numel() * 8),
                   cuda=cuda)


def usable(info: Optional[ShmInfo]) -> bool:
    """Whether a region described by ``info`` can be read through shared memory from here (for a
    GPU region: by CUDA IPC, every GPU it uses visible in this process)."""
    if info is None or not info.host or info.host != host_key() or info.pid <= 0:
        return False
    # CUDA cannot open this process's own IPC handles: a GPU region of this process goes by NIXL
    return not info.cuda or (info.pid != os.getpid() and cuda_ipc.usable(info.cuda))


class ShmSource:
    """The holder's memory mapped into this process (read-only). Raises
    :class:`SourceUnreachable` if it cannot be mapped, or if a descriptor of process
    ``info.pid`` is not the shared-memory file the endpoint published (identity, size): that pid
    names another process here, or the holder reused the number; the read then goes by NIXL."""

    def __init__(self, info: ShmInfo) -> None:
        self.info = info
        self.name = f"shm:{info.pid}"
        self._maps: list[mmap.mmap] = []
        try:
            files = [self._map(f) for f in info.files]
            self.control = self._control(files)
            views = files
            if info.cuda:
                views = cuda_ipc.open_storages(info.cuda)
                self.name = f"cuda-ipc:{info.pid}"
        except SourceUnreachable:
            self.close()
            raise
        except (OSError, RuntimeError, LookupError, ValueError) as e:
            self.close()
            raise SourceUnreachable(f"cannot map the memory of process {info.pid}: {e}") from e
        self._views = views
        self.reached = True

    def _path(self, f: ShmFile) -> str:
        return f"/proc/{self.info.pid}/fd/{f.fd}"

    def _check(self, f: ShmFile, st: os.stat_result) -> None:
        """``st`` (of what the descriptor names) must be the file ``f`` published: a deleted
        regular file (shared memory: never a named file of the holder) with its identity and at
        least its size."""
        if (st.st_dev, st.st_ino) != (f.dev, f.ino):
            raise SourceUnreachable(f"{self._path(f)} is not the file the endpoint published: process "
                                    f"{self.info.pid} here is not the holder, or the descriptor was reused")
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 0:
            raise SourceUnreachable(f"{self._path(f)} is not a shared-memory file")
        if not 0 < f.nbytes <= st.st_size:
            raise SourceUnreachable(f"{self._path(f)} has {st.st_size} bytes, the endpoint says {f.nbytes}")

    def _map(self, f: ShmFile) -> torch.Tensor:
        path = self._path(f)
        self._check(f, os.stat(path))  # before opening: never open what is not ours (a FIFO blocks)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self._check(f, os.fstat(fd))  # what we opened: the number may have been reused meanwhile
            mm = mmap.mmap(fd, f.nbytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps.append(mm)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: we never write through it
            return torch.frombuffer(mm, dtype=torch.uint8)

    def _control(self, files: Sequence[torch.Tensor]) -> torch.Tensor:
        fi, off, nbytes = self.info.control
        if not (0 <= fi < len(files) and off >= 0 and off % 8 == 0 and nbytes >= 8 * _HEADER
                and nbytes % 8 == 0 and off + nbytes <= files[fi].numel()):
            raise SourceUnreachable(f"process {self.info.pid}: control block {self.info.control} outside its file")
        return files[fi][off:off + nbytes].view(torch.int64)

    def check_layout(self, layout: Layout) -> None:
        """Raise :class:`SourceUnreachable` unless every tensor of ``layout`` and the control
        block lie inside the memory mapped (an endpoint's offsets are not trusted)."""
        spans = self.info.tensors
        if len(spans) != len(layout.metas) or self.control.numel() < _HEADER + layout.unit_count:
            raise SourceUnreachable(f"{self.name}: the endpoint does not describe this layout")
        for (si, off), m in zip(spans, layout.metas):
            if m.nbytes and not (0 <= si < len(self._views) and 0 <= off
                                 and off + m.nbytes <= self._views[si].numel()):
                raise SourceUnreachable(f"{self.name}: tensor {m.name!r} lies outside the memory mapped")

    def still_same(self) -> bool:
        """The holder still has the memory we mapped (a descriptor number can be reused)."""
        try:
            for f in self.info.files:
                st = os.stat(self._path(f))
                if (st.st_dev, st.st_ino) != (f.dev, f.ino):
                    return False
        except OSError:
            return False
        return True

    def alive(self) -> bool:
        """The holder process still holds its control block (cheap: one ``stat``). Its memory
        outlives it while mapped here, but a dead partial holder will never advance."""
        f = self.info.files[self.info.control[0]]
        try:
            st = os.stat(self._path(f))
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (f.dev, f.ino)

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
    handle itself (:meth:`tensorhub.Hub.prefetch`). Same read loop as a mapped same-host
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


@functools.cache
def _omp_set_num_threads():
    """OpenMP's ``omp_set_num_threads`` of the runtime torch loaded (None: none found)."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line})
        for path in paths:
            return ctypes.CDLL(path).omp_set_num_threads
    except (OSError, AttributeError):
        pass
    return None


def _single_threaded_copies() -> None:
    """A copy thread's initializer: torch's copies in this thread run on it alone. Several copy
    threads each splitting their ``copy_`` over a team of the process's intra-op threads (torch's
    default) oversubscribe the cores: through ``transfer.py``'s ``ReplicaActor``s, 4 copy threads
    hashed at 6.3 GB/s where the tier alone, with one intra-op thread, reached 9.5. OpenMP's
    thread count is per thread, so this thread's setting leaves the process's as it is (torch's
    own ``set_num_threads`` would change it for every thread started later)."""
    torch.get_num_threads()  # torch's lazy per-thread setup first: it would undo the setting below
    fn = _omp_set_num_threads()
    if fn is not None:
        fn(1)


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
                                                                   thread_name_prefix="tensorhub-shm",
                                                                   initializer=_single_threaded_copies)
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


_SLICE_BYTES = 4 << 20
"""A checksummed CPU copy copies and hashes a unit in slices of this size, each hashed right
after its copy, from the cache (L3 here: 32 MiB shared by 2 cores). Per-slice cost in Python is
about 20 us with 4 copy threads (256 KiB slices ran at 0.6x of 1 MiB ones), so slices are not
smaller: in-process, 1 GiB, 4 threads, medians of 5 (issue 27): 1 MiB 10.5, 2 MiB 11.2, 4 MiB
11.1, 8 MiB 10.7 GB/s, and with the numpy view taken once per piece (as below) 1 MiB 11.0, 4 MiB
11.5, against 14.0 without checksums."""


def _copy_hash_unit(src, dst: Sequence[torch.Tensor], unit) -> int:
    """Copy one unit into CPU ``dst`` and return :func:`~tensorhub.layout.checksum_unit` of
    what landed (xxh3-64, streamed over the same bytes in the same order: the same value)."""
    h = xxhash.xxh3_64()
    for p in unit:
        d = dst[p.tensor_index].reshape(-1).view(torch.uint8)[p.offset:p.offset + p.nbytes]
        s = src.piece(p.tensor_index, p.offset, p.nbytes)
        hashed = d.numpy()  # one view per piece: slicing numpy costs less than torch per slice
        for at in range(0, p.nbytes, _SLICE_BYTES):
            d[at:at + _SLICE_BYTES].copy_(s[at:at + _SLICE_BYTES])
            h.update(hashed[at:at + _SLICE_BYTES])
    return h.intdigest()


def _copy_units(src, dst: Sequence[torch.Tensor], layout: Layout, units: Sequence[int],
                checksums: bool) -> list[Optional[int]]:
    """Copy (and hash) a run of units; one task per run keeps the hand-offs between threads few."""
    out = []
    for u in units:
        unit = layout.units[u]
        if checksums and not dst[0].is_cuda:
            out.append(_copy_hash_unit(src, dst, unit))
            continue
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


def _snapshot(ctl: torch.Tensor, version: int, known: int, unit_count: int,
              name: str) -> tuple[int, int, Optional[list[int]]]:
    """The source's (version, progress, checksums), read version first, then progress and the
    checksums past the ``known`` units, then the version again; a torn snapshot (the version
    changed in between) gives the version read last with nothing final. Checksums only for
    ``version``. Raises :class:`TransferError` for a progress outside ``[0, unit_count]``."""
    v = int(ctl[0])
    if v != version:
        return v, 0, None
    p = int(ctl[1])
    if not 0 <= p <= unit_count:
        raise TransferError(f"{name} publishes progress {p} of {unit_count} units")
    sums = ctl[_HEADER:_HEADER + p].tolist() if p > known else None
    if (again := int(ctl[0])) != v:
        return again, 0, None
    return v, p, sums


def pull(region, src, layout: Layout, *, expect_version: int, config: Config,
         start_unit: int = 0, end_unit: Optional[int] = None,
         on_unit: Optional[Callable[[int], None]] = None,
         should_stop: Optional[Callable[[], bool]] = None) -> int:
    """Like :func:`tensorhub.transport.reader.pull`, from a same-host source's memory (a
    :class:`ShmSource`, or a :class:`LocalSource` of this process): copies units
    ``[start_unit, end_unit)`` of ``expect_version`` into ``region`` and returns the bytes read;
    every copy it started has ended when it returns or raises.

    The source's control block is live memory another process writes, so it is read as a
    seqlock reader: version, then progress and checksums, then the version again (a snapshot
    whose version changed is not used), and after every copy the version once more: a unit
    counts only if the source still held ``expect_version`` after its bytes were copied (the
    holder hides a version, ``set_progress(0)`` then ``set_version``, before it writes other
    bytes), with or without checksums. A source that moved on raises :class:`TransferError`;
    a :class:`ShmSource` whose endpoint does not fit ``layout`` raises
    :class:`SourceUnreachable` before any copy."""
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
    if isinstance(src, ShmSource):
        src.check_layout(layout)
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
            st.source_state(*_snapshot(ctl, expect_version, st.remote_progress, layout.unit_count, src.name), now)
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
            if moved and (v := int(ctl[0])) != expect_version:  # seqlock: after the copies ended
                raise TransferError(f"{src.name} moved on from version {expect_version} (now {v}) while units "
                                    f"{st.prefix}+ were copied: they are not used")
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
