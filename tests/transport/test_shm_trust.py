"""What the same-host tier trusts (tensorhub.transport.shm), pinned by the review's repros:

- it maps another process's memory only when it is sure it is that process's: the PID namespace
  is part of the host identity, and every descriptor is checked against the device and inode
  the endpoint published (``pidns.py``, ``same_host_maps_any_fd.py``, ``shm_size_not_checked.py``);
- the holder's control block is read as a seqlock, and re-checked after every copy
  (``shm_no_seqlock.py``, ``shm_control_snapshot_torn.py``);
- descriptors do not grow with the tensor count (``fd_per_tensor.py``).

Every pull test compares bytes: a unit counted final holds the version it was read for.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import msgspec
import pytest
import torch

import tensorhub
from tensorhub import errors
from tensorhub.config import Config
from tensorhub.layout import Layout, checksum_all
from tensorhub.ports import LocalPort
from tensorhub.testing import workload
from tensorhub.transport import shm

CFG = Config(unit_bytes=1 << 20, unit_bytes_min=256 << 10, same_host_threads=1, source_stall_timeout_s=1.0)
N = 4  # tensors of 256 KiB: one unit each


def _i64(s: int) -> int:
    return s - (1 << 64) if s >= 1 << 63 else s


def _nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


class _Region:
    """The part of a Region that shm.pull uses: tensors and a control block."""

    def __init__(self, tensors, unit_count):
        self.tensors = tensors
        self.control = torch.zeros(2 + unit_count, dtype=torch.int64)
        self.control[0] = -1
        self.starved_s = 0.0

    version = property(lambda s: int(s.control[0]))
    progress = property(lambda s: int(s.control[1]))

    def set_version(self, v):
        self.control[0] = v

    def set_progress(self, p):
        self.control[1] = p


class _Holder:
    """A same-host source as shm.pull sees one (a ShmSource's duck type), over this process's
    tensors; ``on_piece(tensor_index)`` runs before each piece is handed out for copying."""

    verify = True
    reached = True
    name = "holder"

    def __init__(self, tensors, control, on_piece=lambda ti: None):
        self.tensors, self.control, self.on_piece = tensors, control, on_piece

    def still_same(self):
        return True

    def alive(self):
        return True

    def piece(self, ti, off, n):
        self.on_piece(ti)
        return self.tensors[ti].view(torch.uint8)[off:off + n]


def _tensors(fill):
    return [torch.full((1 << 18,), fill, dtype=torch.uint8) for _ in range(N)]


def _layout(ts):
    return Layout.for_config([(f"t{i}", t) for i, t in enumerate(ts)], CFG)


def _assert_final_units_hold(reader, layout, fill):
    """Every unit the reader counts final holds version ``fill``'s bytes."""
    for u in range(reader.progress):
        for p in layout.units[u]:
            got = reader.tensors[p.tensor_index].view(torch.uint8)[p.offset:p.offset + p.nbytes]
            assert bool((got == fill).all()), f"unit {u} counted final with other bytes"


# ---- the control block as a seqlock ------------------------------------------------------

@pytest.mark.parametrize("slow_copy", [False, True])
@pytest.mark.parametrize("checksums", [False, True])
def test_a_unit_copied_while_the_holder_hides_its_version_is_not_used(checksums, slow_copy):
    """shm_no_seqlock.py: the holder hides version 5 (progress 0, version -1) and writes other
    bytes while the last unit is copied. The pull must not count that unit, with or without
    checksums, and must say that the source moved on (not that its bytes are corrupt).

    ``slow_copy``: the copy outlasts the pull's wait for it, so the pull reads the control block
    again before the copy ends and sees the hidden version there first (the interleaving of a
    loaded machine: CI once saw it and got another message for the same event)."""
    src = _tensors(7)
    layout = _layout(src)
    holder = _Region(src, layout.unit_count)
    sums = checksum_all(src, layout)
    holder.control[2:] = torch.tensor([_i64(s) for s in sums])
    holder.set_version(5)
    holder.set_progress(layout.unit_count)

    def hide_and_write(ti):
        if ti == N - 1:
            holder.set_progress(0)
            holder.set_version(-1)
            src[ti].fill_(0xEE)
            if slow_copy:
                time.sleep(0.2)  # past shm.pull's 50 ms wait for a copy

    reader = _Region([torch.zeros_like(t) for t in src], layout.unit_count)
    with pytest.raises(errors.TransferError, match="moved on"):
        shm.pull(reader, _Holder(src, holder.control, hide_and_write), layout, expect_version=5,
                 config=CFG.replace(checksums=checksums))
    assert reader.progress < layout.unit_count
    _assert_final_units_hold(reader, layout, 7)


class _TornControl:
    """The holder's control block as the reader reads it: between the reader's first and second
    access, the holder's copy of version 1 fails (hidden), its user updates to version 2 and all
    of version 2's units land, with their checksums."""

    def __init__(self, ctl, tensors, layout):
        self.ctl, self.tensors, self.layout, self.reads = ctl, tensors, layout, 0

    def __getitem__(self, k):
        self.reads += 1
        if self.reads == 2:
            self.ctl[1] = 0
            self.ctl[0] = -1
            for t in self.tensors:
                t.fill_(0x22)
            self.ctl[2:] = torch.tensor([_i64(s) for s in checksum_all(self.tensors, self.layout)])
            self.ctl[0] = 2
            self.ctl[1] = self.layout.unit_count
        return self.ctl[k]


def test_a_torn_control_block_snapshot_is_not_used():
    """shm_control_snapshot_torn.py: with checksums on, version 1 read before the holder
    switched and progress and checksums after must not make version 2's bytes pass for
    version 1's."""
    src = _tensors(0x11)
    layout = _layout(src)
    ctl = torch.zeros(2 + layout.unit_count, dtype=torch.int64)
    ctl[2:4] = torch.tensor([_i64(s) for s in checksum_all(src, layout)[:2]])
    ctl[0], ctl[1] = 1, 2  # a partial holder of version 1: two units final
    reader = _Region([torch.zeros_like(t) for t in src], layout.unit_count)
    with pytest.raises(errors.TransferError, match="version 2"):
        shm.pull(reader, _Holder(src, _TornControl(ctl, src, layout)), layout, expect_version=1,
                 config=CFG, end_unit=layout.unit_count)
    assert reader.progress == 0
    _assert_final_units_hold(reader, layout, 0x11)


def test_a_control_block_with_an_impossible_progress_fails_the_pull():
    src = _tensors(3)
    layout = _layout(src)
    ctl = torch.zeros(2 + layout.unit_count, dtype=torch.int64)
    ctl[0], ctl[1] = 5, layout.unit_count + 10
    reader = _Region([torch.zeros_like(t) for t in src], layout.unit_count)
    with pytest.raises(errors.TransferError, match="progress"):
        shm.pull(reader, _Holder(src, ctl), layout, expect_version=5, config=CFG)
    assert reader.progress == 0


# ---- descriptors: identity, kind, size -----------------------------------------------------

def _shared_file():
    """A real shared region of this process: (tensor, control, ShmInfo)."""
    t = torch.arange(1024, dtype=torch.uint8)
    c = torch.zeros(16, dtype=torch.int64)
    info = shm.share([t], c, Config())
    assert info is not None
    return t, c, info


def _with_file(info, **changes):
    f = msgspec.structs.replace(info.files[0], **changes)
    return msgspec.structs.replace(info, files=(f,) + info.files[1:])


def test_an_endpoint_naming_a_file_that_is_not_the_published_one_is_not_mapped():
    """same_host_maps_any_fd.py: a descriptor of the holder's pid that is not the file the
    endpoint published (another identity), or a named file (its identity copied into the
    endpoint), or a FIFO (opening it would block), is never mapped: SourceUnreachable, the
    client's cue to read by NIXL."""
    t, c, info = _shared_file()
    src = shm.ShmSource(info)  # the genuine endpoint maps
    assert bytes(src.piece(0, 0, 4).tolist()) == bytes([0, 1, 2, 3])
    src.close()
    with pytest.raises(errors.SourceUnreachable, match="not the file the endpoint published"):
        shm.ShmSource(_with_file(info, ino=info.files[0].ino + 1))
    fd = os.open("/etc/hostname", os.O_RDONLY)
    fifo_dir = None
    try:
        st = os.fstat(fd)
        with pytest.raises(errors.SourceUnreachable, match="not a shared-memory file"):
            shm.ShmSource(_with_file(info, fd=fd, nbytes=st.st_size, dev=st.st_dev, ino=st.st_ino))
        fifo_dir = tempfile.mkdtemp()
        os.mkfifo(os.path.join(fifo_dir, "p"))
        rfd = os.open(os.path.join(fifo_dir, "p"), os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(rfd)
            t0 = time.monotonic()
            with pytest.raises(errors.SourceUnreachable):
                shm.ShmSource(_with_file(info, fd=rfd, nbytes=4096, dev=st.st_dev, ino=st.st_ino))
            assert time.monotonic() - t0 < 2
        finally:
            os.close(rfd)
    finally:
        os.close(fd)
        if fifo_dir:
            shutil.rmtree(fifo_dir)


def test_a_mapping_larger_than_its_file_is_unreachable_not_a_raw_error():
    """shm_size_not_checked.py: an endpoint claiming more bytes than the file holds (a reused
    descriptor, a lie) raises SourceUnreachable (a TransferError: the client falls back to
    NIXL), not mmap's ValueError."""
    t, c, info = _shared_file()
    with pytest.raises(errors.SourceUnreachable, match="bytes"):
        shm.ShmSource(_with_file(info, nbytes=1 << 30))
    with pytest.raises(errors.SourceUnreachable, match="control block"):
        shm.ShmSource(msgspec.structs.replace(info, control=(0, info.files[0].nbytes, 128)))


def test_tensors_outside_the_mapped_file_fail_the_pull_before_any_copy():
    t, c, info = _shared_file()
    lay = Layout.for_config([("t", t)], Config())
    bad = shm.ShmSource(msgspec.structs.replace(info, tensors=((0, info.files[0].nbytes - 10),)))
    reader = _Region([torch.zeros_like(t)], lay.unit_count)
    c[0], c[1] = 1, lay.unit_count
    with pytest.raises(errors.SourceUnreachable, match="outside"):
        shm.pull(reader, bad, lay, expect_version=1, config=Config())
    assert reader.progress == 0
    bad.close()


# ---- the PID namespace -----------------------------------------------------------------------

def test_the_pid_namespace_is_part_of_the_host_identity():
    pidns = os.stat("/proc/self/ns/pid").st_ino
    assert shm.host_key().endswith(f":{pidns}")


_ROLE = r"""
import json, os, sys
import msgspec, torch
from tensorhub.config import Config
from tensorhub.layout import Layout, checksum_all
from tensorhub import errors
from tensorhub.transport import shm

role, path = sys.argv[1], sys.argv[2]
cfg = Config(unit_bytes=1 << 20, unit_bytes_min=256 << 10)
ts = [torch.full((1 << 18,), 0xAA if role == "A" else 0xBB, dtype=torch.uint8) for _ in range(4)]
layout = Layout.for_config([(f"t{i}", t) for i, t in enumerate(ts)], cfg)
ctl = torch.zeros(2 + layout.unit_count, dtype=torch.int64)
info = shm.share(ts, ctl, cfg)
ctl[2:] = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in checksum_all(ts, layout)])
ctl[0], ctl[1] = 5, layout.unit_count
if role == "A":
    open(path + ".tmp", "wb").write(msgspec.msgpack.encode(info)); os.rename(path + ".tmp", path)
    sys.stdin.readline(); sys.exit(0)
a = msgspec.msgpack.decode(open(path, "rb").read(), type=shm.ShmInfo)
out = {"pid": os.getpid(), "a_pid": a.pid, "usable": shm.usable(a)}
try:
    src = shm.ShmSource(a)
    out["mapped_first_byte"] = int(src.piece(0, 0, 1)[0])
except errors.SourceUnreachable as e:
    out["unreachable"] = str(e)
print("RESULT:" + json.dumps(out), flush=True)
"""


def _can_unshare_pid() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.mark.skipif(not _can_unshare_pid(), reason="needs root and unshare --pid")
def test_a_holder_in_another_pid_namespace_is_not_mapped(tmp_path):
    """pidns.py: two PID namespaces sharing one network namespace (containers with host
    networking). Each process is pid 1 in its own; B resolving A's pid 1 would find itself and
    map its own memory, control block included, so checksums would pass. B must neither take
    A's endpoint as its host's nor map it."""
    path = str(tmp_path / "infoA.bin")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    ns = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _ROLE]
    a = subprocess.Popen(ns + ["A", path], stdin=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            assert a.poll() is None and time.monotonic() < deadline, "holder A did not start"
            time.sleep(0.05)
        b = subprocess.run(ns + ["B", path], capture_output=True, text=True, env=env, timeout=120)
        line = [ln for ln in b.stdout.splitlines() if ln.startswith("RESULT:")]
        assert line, b.stdout + b.stderr
        out = json.loads(line[0][len("RESULT:"):])
        assert out["pid"] == out["a_pid"] == 1, "the setting of the repro: both are pid 1"
        assert not out["usable"], "another PID namespace is another host for this tier"
        assert "mapped_first_byte" not in out, f"mapped the wrong memory: {out}"
        assert "not the file the endpoint published" in out["unreachable"]
    finally:
        a.stdin.close()
        a.wait(30)


@pytest.mark.skipif(not _can_unshare_pid(), reason="needs root and unshare --pid")
def test_a_process_whose_proc_shows_another_pid_namespace_stays_off_the_tier():
    """``unshare --pid`` without a /proc of its own: /proc/<pid> names other processes than
    this namespace's pids, so it can neither be named nor name others."""
    code = "from tensorhub.transport import shm; print('KEY:' + repr(shm.host_key()))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", code], capture_output=True,
                       text=True, env=env, timeout=60)
    assert "KEY:''" in r.stdout, r.stdout + r.stderr


# ---- descriptors per region ----------------------------------------------------------------

def test_descriptors_do_not_grow_with_the_tensor_count():
    """fd_per_tensor.py: three regions of 400 tensors each take a descriptor each (not 1,200:
    with a soft limit of 1,024 every open() of the process failed), and the bytes are
    readable through the published files."""
    before = _nfds()
    regions = []
    for r in range(3):
        ts = [torch.full((64,), float(r * 1000 + i)) for i in range(400)]
        ctl = torch.zeros(10, dtype=torch.int64)
        info = shm.share(ts, ctl, Config())
        assert info is not None
        regions.append((ts, ctl, info))
    assert _nfds() - before <= 3
    assert all(len(info.files) == 1 for _, _, info in regions)
    ts, ctl, info = regions[2]
    src = shm.ShmSource(info)
    try:
        for i in (0, 199, 399):
            assert src.piece(i, 0, 4).view(torch.float32).item() == 2000.0 + i
        ctl[0] = 9
        assert int(src.control[0]) == 9
    finally:
        src.close()
    del regions, ts, ctl, info, src
    gc.collect()
    assert _nfds() <= before, "a file is closed once no tensor uses it"


def test_sharing_tensors_again_reuses_their_file_and_keeps_earlier_readers_right():
    """A region registered again over tensors already shared (a handle reopened on the same
    parameters) describes the same file: nothing moves, so a reader of the first endpoint
    still sees every write."""
    ts = [torch.zeros(1000), torch.zeros(77, dtype=torch.int16)]
    first = shm.share(ts, torch.zeros(4, dtype=torch.int64), Config())
    reader = shm.ShmSource(first)
    ptrs = [t.data_ptr() for t in ts]
    fds = _nfds()
    second = shm.share(ts, torch.zeros(4, dtype=torch.int64), Config())
    try:
        assert [t.data_ptr() for t in ts] == ptrs, "nothing moved"
        assert second.files[0] == first.files[0] and second.tensors == first.tensors
        assert _nfds() - fds <= 1, "only the new control block's file"
        ts[0][10] = 3.5
        ts[1][76] = -9
        assert reader.piece(0, 40, 4).view(torch.float32).item() == 3.5
        assert reader.piece(1, 152, 2).view(torch.int16).item() == -9
    finally:
        reader.close()


def test_a_storage_torch_already_shares_is_described_as_it_is():
    user = torch.arange(100, dtype=torch.float32).share_memory_()
    ptr = user.data_ptr()
    fresh = torch.ones(50)
    info = shm.share([user, fresh], torch.zeros(4, dtype=torch.int64), Config())
    assert user.data_ptr() == ptr and len(info.files) == 2
    src = shm.ShmSource(info)
    try:
        assert src.piece(0, 4 * 99, 4).view(torch.float32).item() == 99.0
        assert src.piece(1, 0, 4).view(torch.float32).item() == 1.0
    finally:
        src.close()


def test_a_hub_reads_by_nixl_when_the_holder_file_is_not_the_published_one(monkeypatch):
    """End to end: every endpoint's file identity is off by one inode (as a foreign or reused
    descriptor looks), so the same-host tier refuses to map it and the handle reads the version
    through NIXL instead, byte-exact."""
    cfg = Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10, source_stall_timeout_s=1.0,
                 heartbeat_interval_s=0.2, lease_timeout_s=5.0)
    real_share = shm.share

    def forged(tensors, control, config):
        info = real_share(tensors, control, config)
        if info is None:
            return None
        f = msgspec.structs.replace(info.files[0], ino=info.files[0].ino + 1)
        return msgspec.structs.replace(info, files=(f,) + info.files[1:])

    monkeypatch.setattr(shm, "share", forged)
    nixl_pulls, shm_pulls = [], []
    real_nixl, real_shm = tensorhub.handle.hub.tx.pull, shm.pull
    monkeypatch.setattr(tensorhub.handle.hub.tx, "pull", lambda *a, **k: nixl_pulls.append(1) or real_nixl(*a, **k))
    monkeypatch.setattr(shm, "pull", lambda *a, **k: shm_pulls.append(1) or real_shm(*a, **k))
    port = LocalPort(cfg)
    spec = workload.small_spec(2 << 20, big=2, tiny=12)
    handles = []
    for name in ("t", "r"):
        named = workload.allocate(spec)
        h = tensorhub.open("m", port=port, config=cfg, replica=name)
        h.register(named)
        handles.append((h, [t for _, t in named]))
    (t, tt), (r, rt) = handles
    workload.fill_version(tt, 1)
    t.publish(1)
    assert r.replicate(1).version == 1 and workload.digest(rt) == workload.digest(tt)
    assert nixl_pulls and not shm_pulls
    r.close(drop_last_copy=True)
    t.close(drop_last_copy=True)
