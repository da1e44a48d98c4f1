"""The same-host tier for CUDA tensors (CUDA IPC): device matching and the NIXL fallback on CPU;
real handles between two processes in the ``gpu`` tests (skipped without a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tensorhub import errors
from tensorhub.config import Config
from tensorhub.layout import Layout, checksum_all
from tensorhub.transport import Region, cuda_ipc, decode_endpoint, encode_endpoint, shm
from tensorhub.transport.nixl import Endpoint, MemRegion


def _storage(uuid: str, nbytes: int = 4096) -> cuda_ipc.CudaStorage:
    return cuda_ipc.CudaStorage(device_uuid=uuid, handle=b"\x01" * 64, nbytes=nbytes, offset=0,
                                ref_counter_handle=b"/torch_rc", ref_counter_offset=0)


@pytest.fixture
def two_gpus(monkeypatch):
    """This process sees two GPUs, in the order B, A (as Ray's CUDA_VISIBLE_DEVICES may give)."""
    uuids = ["GPU-bbbb", "GPU-aaaa"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))
    cuda_ipc.local_device.cache_clear()
    yield
    cuda_ipc.local_device.cache_clear()


def test_devices_are_matched_by_uuid_not_index(two_gpus):
    assert cuda_ipc.local_device("GPU-aaaa") == 1 and cuda_ipc.local_device("GPU-bbbb") == 0
    assert cuda_ipc.local_device("GPU-cccc") is None
    assert cuda_ipc.usable([_storage("GPU-aaaa"), _storage("GPU-bbbb")])
    assert not cuda_ipc.usable([_storage("GPU-aaaa"), _storage("GPU-cccc")])


def test_a_gpu_region_seen_from_a_process_without_its_gpu_goes_by_nixl(two_gpus):
    info = shm.ShmInfo(host=shm.host_key(), pid=1, files=(), tensors=((0, 0),), control=(0, 0, 4096),
                       cuda=(_storage("GPU-cccc"),))
    assert not shm.usable(info)
    visible = shm.ShmInfo(host=shm.host_key(), pid=1, files=(), tensors=((0, 0),), control=(0, 0, 4096),
                          cuda=(_storage("GPU-aaaa"),))
    assert shm.usable(visible)
    own = shm.ShmInfo(host=shm.host_key(), pid=os.getpid(), files=(), tensors=((0, 0),),
                      control=(0, 0, 4096), cuda=(_storage("GPU-aaaa"),))
    assert not shm.usable(own)  # CUDA cannot open a process's own handles


def test_no_cuda_here_means_no_cuda_ipc_and_an_unopenable_source_is_unreachable():
    cuda_ipc.local_device.cache_clear()
    info = shm.ShmInfo(host=shm.host_key(), pid=2**22 + 7, files=(), tensors=((0, 0),), control=(0, 0, 4096),
                       cuda=(_storage("GPU-aaaa"),))
    if not torch.cuda.is_available():
        assert not shm.usable(info)
    with pytest.raises(errors.SourceUnreachable):
        shm.ShmSource(info)  # no such process (nor GPU): the client falls back to NIXL


def test_cuda_handles_travel_in_the_endpoint():
    info = shm.ShmInfo(host="h", pid=5, files=(), tensors=((0, 0), (-1, 0), (0, 512)), control=(0, 0, 4096),
                       cuda=(_storage("GPU-aaaa", 1024),))
    ep = Endpoint(agent_name="a", agent_metadata=b"m", tensors=(MemRegion(1, 512, "VRAM", 0),),
                  control=MemRegion(2, 64), fingerprint="f", unit_signature="s", unit_count=1, shm=info)
    back = decode_endpoint(encode_endpoint(ep))
    assert back.shm == info and back.shm.cuda[0].handle == b"\x01" * 64


def test_cpu_regions_carry_no_cuda_handles():
    ts = [torch.arange(1000, dtype=torch.float32)]
    lay = Layout.build([("a", ts[0])], 64 << 10, 16 << 10)
    r = Region.register(ts, lay, Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10))
    try:
        assert r.shm_info is not None and r.shm_info.cuda == () and r.shm_info.files
    finally:
        r.close()


_HOLDER = (
    "import sys, torch\n"
    "from tensorhub.config import Config\n"
    "from tensorhub.layout import Layout, checksum_all\n"
    "from tensorhub.transport import Region, encode_endpoint\n"
    "ts = [torch.arange(300_000, dtype=torch.float32, device='cuda'), torch.ones(999, dtype=torch.int16, device='cuda')]\n"
    "lay = Layout.build([('a', ts[0]), ('b', ts[1])], 64 << 10, 16 << 10)\n"
    "r = Region.register(ts, lay, Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10))\n"
    "torch.cuda.synchronize()\n"
    "r.publish_complete(3, checksum_all(ts, lay))\n"
    "sys.stdout.buffer.write(b'EP:' + encode_endpoint(r.endpoint()).hex().encode() + b'\\n'); sys.stdout.flush()\n"
    "sys.stdin.readline()\n"
    "ts[0][:10] = -1; torch.cuda.synchronize()\n"  # written after publish: a reader must catch it
    "sys.stdout.buffer.write(b'WROTE\\n'); sys.stdout.flush()\n"
    "sys.stdin.readline()\n"
)


@pytest.mark.gpu
@pytest.mark.parametrize("checksums", [True, False])
def test_gpu_region_of_another_process_is_read_by_cuda_ipc(checksums):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    child = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        line = b""
        while not line.startswith(b"EP:"):
            line = child.stdout.readline()
            assert line, "the holder exited"
        ep = decode_endpoint(bytes.fromhex(line[3:].decode().strip()))
        assert ep.shm is not None and ep.shm.cuda and shm.usable(ep.shm)
        ts = [torch.zeros(300_000, device="cuda"), torch.zeros(999, dtype=torch.int16, device="cuda")]
        lay = Layout.build([("a", ts[0]), ("b", ts[1])], 64 << 10, 16 << 10)
        cfg = Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10, checksums=checksums)
        recv = Region.register(ts, lay, cfg)
        src = shm.ShmSource(ep.shm)
        assert src.name.startswith("cuda-ipc:")
        n = shm.pull(recv, src, lay, expect_version=3, config=cfg)
        assert n == lay.total_bytes and recv.progress == lay.unit_count
        assert torch.equal(ts[0].cpu(), torch.arange(300_000, dtype=torch.float32)) and int(ts[1].sum()) == 999
        assert recv.checksums() == checksum_all([t.cpu() for t in ts], lay)
        if checksums:
            child.stdin.write(b"\n"); child.stdin.flush()
            while child.stdout.readline() != b"WROTE\n":
                pass
            with pytest.raises(errors.ChecksumMismatch):
                shm.pull(recv, src, lay, expect_version=3, config=cfg)
        src.close(); recv.close()
    finally:
        child.stdin.write(b"\n\n"); child.stdin.flush(); child.wait(20)
