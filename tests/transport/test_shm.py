"""The same-host tier (tensorhub.transport.shm): tensors moved into shared memory in place at
register, read by plain memory copies under the read loop's rules. Every test compares bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import tensorhub
from tensorhub import errors
from tensorhub.config import Config
from tensorhub.layout import Layout, checksum_all
from tensorhub.ports import LocalPort
from tensorhub.testing import workload
from tensorhub.transport import Agent, Region, decode_endpoint, encode_endpoint, shm

CFG = Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10, source_stall_timeout_s=1.0, heartbeat_interval_s=0.2,
             lease_timeout_s=5.0)


@pytest.fixture(scope="module")
def agent():
    return Agent(CFG, name="test-shm-agent")


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    named = [(f"tiny{i}", torch.randn(50 + 7 * i, generator=g)) for i in range(12)]
    named += [("big", torch.randn(300_000, generator=g)), ("empty", torch.empty(0)),
              ("i8", torch.randint(-100, 100, (70_001,), dtype=torch.int8, generator=g))]
    return named


def _bytes(t):
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _holder_and_reader(agent, version=7, complete=True):
    named = _model()
    layout = Layout.build(named, CFG.unit_bytes, CFG.pack_below_bytes)
    src = [t for _, t in named]
    holder = Region.register(src, layout, CFG, agent=agent)
    sums = checksum_all(src, layout)
    if complete:
        holder.publish_complete(version, sums)
    dst = [torch.zeros_like(t) for t in src]
    recv = Region.register(dst, layout, CFG.replace(same_host=False), agent=agent)
    info = decode_endpoint(encode_endpoint(holder.endpoint())).shm
    return named, layout, holder, recv, shm.ShmSource(info), sums


def test_register_moves_tensors_into_shared_memory_in_place(agent):
    """The tensor objects, their views and a Parameter stay valid: storages are swapped, not
    tensors replaced; a write through any of them is seen through the published file."""
    p = torch.nn.Parameter(torch.randn(1000))
    base = torch.randn(4096)
    view = base[100:200]
    ts = [p.data, base]
    before = [_bytes(t) for t in ts]
    layout = Layout.build([("p", p.data), ("base", base)], CFG.unit_bytes, CFG.pack_below_bytes)
    region = Region.register(ts, layout, CFG, agent=agent)
    src = None
    try:
        assert view.data_ptr() == base.data_ptr() + 400, "a view follows its storage"
        assert [_bytes(t) for t in ts] == before
        info = region.endpoint().shm
        assert info is not None and shm.usable(info) and info.pid == os.getpid()
        assert len(info.files) == 1, "one file for the region: tensors and control block"
        base[150] = 42.0
        p.data[3] = -7.0
        assert view[50].item() == 42.0
        src = shm.ShmSource(info)
        assert src.piece(1, 150 * 4, 4).view(torch.float32).item() == 42.0
        assert src.piece(0, 3 * 4, 4).view(torch.float32).item() == -7.0
        region.set_version(5)
        assert int(src.control[0]) == 5
    finally:
        if src is not None:
            src.close()
        region.close()


def test_same_host_pull_is_byte_exact_and_resumes(agent):
    named, layout, holder, recv, src, _ = _holder_and_reader(agent)
    try:
        n = shm.pull(recv, src, layout, expect_version=7, config=CFG, end_unit=3)
        assert recv.progress == 3 and n == sum(layout.unit_nbytes(u) for u in range(3))
        shm.pull(recv, src, layout, expect_version=7, config=CFG, start_unit=3)
        assert recv.progress == layout.unit_count and recv.version == 7
        for (name, a), b in zip(named, recv.tensors):
            assert _bytes(a) == _bytes(b), name
        assert recv.checksums() == holder.checksums()
    finally:
        src.close(); recv.close(); holder.close()


def test_same_host_pull_follows_a_partial_holder_unit_by_unit(agent):
    """The source is still receiving: only units its control block shows final are read, and
    the reader finishes as the source's progress reaches the end."""
    named, layout, holder, recv, src, sums = _holder_and_reader(agent, complete=False)
    holder.set_version(7)
    holder.set_checksums(sums[:2])
    holder.set_progress(2)
    seen = []
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("n", shm.pull(
        recv, src, layout, expect_version=7, config=CFG.replace(source_stall_timeout_s=5.0), on_unit=seen.append)))
    t.start()
    try:
        deadline = time.monotonic() + 5
        while recv.progress < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        assert recv.progress == 2, "nothing past the source's progress"
        for u in range(2, layout.unit_count):
            holder.set_checksums(sums[u:u + 1], start=u)
            holder.set_progress(u + 1)
            time.sleep(0.002)
        t.join(10)
        assert not t.is_alive() and seen == list(range(layout.unit_count))
        assert recv.starved_s > 0.02, "it waited for the source to advance: counted as stall"
        for (name, a), b in zip(named, recv.tensors):
            assert _bytes(a) == _bytes(b), name
    finally:
        src.close(); recv.close(); holder.close()


def test_bytes_written_after_publish_are_caught_by_the_checksums(agent):
    named, layout, holder, recv, src, _ = _holder_and_reader(agent)
    try:
        named[-3][1].view(-1)[123] += 1.0  # "big", written while published (a contract breach)
        with pytest.raises(errors.ChecksumMismatch):
            shm.pull(recv, src, layout, expect_version=7, config=CFG)
        assert recv.progress < layout.unit_count
    finally:
        src.close(); recv.close(); holder.close()


def test_a_source_that_moved_on_or_stalls_fails_the_pull(agent):
    named, layout, holder, recv, src, sums = _holder_and_reader(agent)
    try:
        holder.set_version(8)
        with pytest.raises(errors.TransferError, match="holds version 8"):
            shm.pull(recv, src, layout, expect_version=7, config=CFG)
        holder.set_version(7)
        holder.set_progress(1)
        t0 = time.monotonic()
        with pytest.raises(errors.SourceStalled, match="stuck at 1/"):
            shm.pull(recv, src, layout, expect_version=7, config=CFG)
        assert 0.9 < time.monotonic() - t0 < 5 and recv.progress == 1
    finally:
        src.close(); recv.close(); holder.close()


def test_memory_of_another_process_is_mapped_by_pid():
    """A reader in this process maps a region a child process registered (the real case: two
    processes on one host), through /proc/<pid>/fd."""
    code = (
        "import sys, time, torch\n"
        "from tensorhub.config import Config\n"
        "from tensorhub.layout import Layout, checksum_all\n"
        "from tensorhub.transport import Region, encode_endpoint\n"
        "ts = [torch.arange(200_000, dtype=torch.float32), torch.ones(999, dtype=torch.int16)]\n"
        "lay = Layout.build([('a', ts[0]), ('b', ts[1])], 64 << 10, 16 << 10)\n"
        "r = Region.register(ts, lay, Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10))\n"
        "r.publish_complete(3, checksum_all(ts, lay))\n"
        "sys.stdout.buffer.write(b'EP:' + encode_endpoint(r.endpoint()).hex().encode() + b'\\n'); sys.stdout.flush()\n"
        "sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        line = b""
        while not line.startswith(b"EP:"):  # the transport may log to stdout first
            line = child.stdout.readline()
            assert line, "the child exited"
        ep = decode_endpoint(bytes.fromhex(line[3:].decode().strip()))
        assert ep.shm is not None and ep.shm.pid == child.pid and shm.usable(ep.shm)
        ts = [torch.zeros(200_000), torch.zeros(999, dtype=torch.int16)]
        lay = Layout.build([("a", ts[0]), ("b", ts[1])], 64 << 10, 16 << 10)
        cfg = Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10, same_host=False)
        recv = Region.register(ts, lay, cfg)
        src = shm.ShmSource(ep.shm)
        shm.pull(recv, src, lay, expect_version=3, config=cfg)
        assert torch.equal(ts[0], torch.arange(200_000, dtype=torch.float32)) and int(ts[1].sum()) == 999
        src.close(); recv.close()
    finally:
        child.stdin.write(b"\n"); child.stdin.flush(); child.wait(10)


def test_a_partial_holder_that_dies_fails_the_pull_at_once():
    """Its memory stays mapped here, but it will never advance: the reader notices the process
    is gone (no stall timeout to wait for)."""
    code = (
        "import sys, torch\n"
        "from tensorhub.config import Config\n"
        "from tensorhub.layout import Layout, checksum_all\n"
        "from tensorhub.transport import Region, encode_endpoint\n"
        "ts = [torch.arange(300_000, dtype=torch.float32)]\n"
        "lay = Layout.build([('a', ts[0])], 64 << 10, 16 << 10)\n"
        "r = Region.register(ts, lay, Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10))\n"
        "r.set_version(3); r.set_checksums(checksum_all(ts, lay)[:2]); r.set_progress(2)\n"
        "sys.stdout.buffer.write(b'EP:' + encode_endpoint(r.endpoint()).hex().encode() + b'\\n'); sys.stdout.flush()\n"
        "sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    line = b""
    while not line.startswith(b"EP:"):
        line = child.stdout.readline()
        assert line, "the child exited"
    ep = decode_endpoint(bytes.fromhex(line[3:].decode().strip()))
    ts = [torch.zeros(300_000)]
    lay = Layout.build([("a", ts[0])], 64 << 10, 16 << 10)
    cfg = Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10, same_host=False, source_stall_timeout_s=30.0)
    recv = Region.register(ts, lay, cfg)
    src = shm.ShmSource(ep.shm)
    threading.Timer(0.3, child.kill).start()
    t0 = time.monotonic()
    with pytest.raises(errors.SourceUnreachable, match="gone"):
        shm.pull(recv, src, lay, expect_version=3, config=cfg)
    assert time.monotonic() - t0 < 5 and recv.progress == 2
    child.wait(10)
    src.close(); recv.close()


def test_unmappable_or_foreign_memory_is_not_used():
    info = shm.ShmInfo(host=shm.host_key(), pid=2**22 + 12345, files=(shm.ShmFile(3, 4096, 1, 1),),
                       tensors=((0, 0),), control=(0, 0, 4096))
    with pytest.raises(errors.SourceUnreachable):
        shm.ShmSource(info)
    assert not shm.usable(shm.ShmInfo(host="another-host", pid=1, files=(), tensors=(), control=(0, 0, 0)))
    assert not shm.usable(None)


def test_hub_reads_a_same_host_holder_through_shared_memory_not_nixl(monkeypatch):
    port = LocalPort(CFG)
    spec = workload.small_spec(2 << 20, big=2, tiny=12)

    def hub(name):
        named = workload.allocate(spec)
        h = tensorhub.open("m", port=port, config=CFG, replica=name)
        h.register(named)
        return h, [t for _, t in named]

    t, tt = hub("t")
    r, rt = hub("r")
    workload.fill_version(tt, 1)
    t.publish(1)

    def no_nixl(*a, **k):
        raise AssertionError("the NIXL read loop was used")

    monkeypatch.setattr(tensorhub.handle.hub.tx, "pull", no_nixl)
    st = r.replicate(1)
    assert st.version == 1 and workload.digest(rt) == workload.digest(tt)
    t.unpublish(); workload.fill_version(tt, 2); t.publish(2)
    assert r.update("latest").version == 2 and workload.digest(rt) == workload.digest(tt)
    r.close(drop_last_copy=True); t.close(drop_last_copy=True)


def test_a_checksummed_copy_hashes_slice_by_slice_to_the_whole_unit_checksum():
    """Issue 27: the tier hashes each 1 MiB slice right after copying it (from the cache); the
    value is the unit's checksum over the bytes that landed, for pieces of any size (slices
    cut inside pieces, pieces smaller than a slice, several pieces per unit)."""
    from tensorhub.layout import checksum_unit

    g = torch.Generator().manual_seed(3)
    named = [("a", torch.randn((5 << 20) // 4 + 3, generator=g)), ("b", torch.randn(1000, generator=g)),
             ("c", torch.randint(0, 255, ((1 << 20) + 1,), dtype=torch.uint8, generator=g))]
    layout = Layout.build(named, 4 << 20, 16 << 10)
    src = [t for _, t in named]

    class Src:
        def piece(self, i, offset, nbytes):
            return src[i].reshape(-1).view(torch.uint8)[offset:offset + nbytes]

    dst = [torch.zeros_like(t) for t in src]
    got = shm._copy_units(Src(), dst, layout, range(layout.unit_count), checksums=True)
    assert got == [checksum_unit(src, u) for u in layout.units]
    assert all(_bytes(a) == _bytes(b) for a, b in zip(src, dst))


def test_copy_threads_run_torch_copies_on_themselves_alone_and_leave_the_process_setting():
    """Issue 27: copy threads that each split their ``copy_`` over a team of the process's
    intra-op threads oversubscribe the cores. Each copy thread runs on one OpenMP thread; the
    caller's and a new thread's setting stay as they were."""
    import threading

    before = torch.get_num_threads()
    pool = shm._copier(2)
    seen = [pool.submit(torch.get_num_threads).result() for _ in range(4)]
    other = []
    t = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert seen == [1] * 4
    assert torch.get_num_threads() == before and other == [before]
