"""What the benchmarks share: the replica actor they use (a :class:`tensorhub.testing.replica.Replica`
plus the baselines' own data paths, so every path moves the same tensors between the same
processes), the NIXL progress-delay patch, and ``parse_bytes``.

- ``direct_pull``: read straight from another actor's registered tensors through the transport,
  bypassing the scheduler (the no-pipeline baseline: every reader reads the trainer);
- ``rdt_*``: Ray Direct Transport with NIXL (``tensor_transport="nixl"``), received into the
  actor's own tensors;
- ``gloo_*``: ``torch.distributed`` gloo broadcast from rank 0 (the NCCL-style baseline).

Ray Direct Transport creates its own NIXL agent whose progress thread spins a whole core (NIXL's
Python wrapper passes a delay of 0); with nine actors on two cores that would measure the CPU,
not the link. :func:`patch_nixl_progress_delay` gives every agent of this process the same
100 us delay TensorHub's own agent uses, which can only help the baseline.
"""

from __future__ import annotations

import time
from typing import Optional

import ray
import torch

from tensorhub.testing import workload
from tensorhub.testing.replica import Replica

_PATCHED = False


def parse_bytes(s: str) -> int:
    """``"64MiB"``, ``"1g"``, ``"4096"`` -> bytes."""
    s = s.strip().lower()
    for suf, mul in (("gib", 1 << 30), ("mib", 1 << 20), ("kib", 1 << 10), ("g", 1 << 30), ("m", 1 << 20)):
        if s.endswith(suf):
            return int(float(s[: -len(suf)]) * mul)
    return int(s)


def patch_nixl_progress_delay(delay_us: int = 100) -> None:
    """Every NIXL agent this process creates from now on sleeps ``delay_us`` between progress
    rounds (see module doc). Idempotent."""
    global _PATCHED
    if _PATCHED:
        return
    from nixl import _api as api

    real = api.nixlBind.nixlAgent

    def with_delay(name, cfg):
        cfg.pthrDelay = delay_us
        return real(name, cfg)

    api.nixlBind.nixlAgent = with_delay
    _PATCHED = True


class BenchReplica(Replica):
    """A Replica with the baselines' data paths (see module doc)."""

    def __init__(self, *args, **kwargs) -> None:
        patch_nixl_progress_delay()
        super().__init__(*args, **kwargs)
        self._rdt_registered = False
        self._gloo: Optional[int] = None

    # ---- no pipeline: read the trainer directly ------------------------------------------
    def endpoint(self) -> bytes:
        from tensorhub import transport as tx

        return tx.encode_endpoint(self.hub.reads.region.endpoint())

    def direct_pull(self, endpoint: bytes, version: int) -> tuple[float, str]:
        """Read version ``version`` from ``endpoint`` (not told to the server). Returns (done_at,
        digest). The handle is unpublished first and its region forgotten afterwards, so the
        next measured read starts from zero."""
        from tensorhub import transport as tx

        hub = self.hub
        hub.unpublish()
        src = tx.open_source(endpoint, config=hub.config)
        try:
            tx.pull(hub.reads.region, src, hub.reads.layout, expect_version=version, config=hub.config)
        finally:
            src.close()
        done = time.time()
        ok = workload.digest(self.tensors)
        hub.reads.region.set_progress(0)
        hub.reads.region.set_version(-1)
        return done, ok

    # ---- Ray Direct Transport ---------------------------------------------------------------
    def rdt_register(self) -> bool:
        """Register the tensors with RDT's NIXL agent once (not per call)."""
        if not self._rdt_registered:
            from ray.experimental import register_nixl_memory

            for t in self.tensors:
                if t.numel():
                    register_nixl_memory(t)
            self._rdt_registered = True
        return True

    @ray.method(tensor_transport="nixl")
    def rdt_tensors(self) -> list[torch.Tensor]:
        return self.tensors

    def rdt_fetch(self, holder) -> tuple[float, str]:
        """Fetch the holder's tensors by RDT into this actor's own tensors."""
        from ray.experimental import set_target_for_ref

        self.hub.unpublish()
        ref = holder.rdt_tensors.remote()
        set_target_for_ref(ref, self.tensors)
        got = ray.get(ref)
        if got[0].data_ptr() != self.tensors[0].data_ptr():  # not received in place: copy
            for d, s in zip(self.tensors, got):
                d.copy_(s)
        return time.time(), workload.digest(self.tensors)

    # ---- torch.distributed gloo broadcast ------------------------------------------------
    def gloo_init(self, rank: int, world: int, master: str, port: int) -> int:
        import torch.distributed as dist

        if self._gloo is not None:
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world)
        self._gloo = rank
        return rank

    def gloo_broadcast(self) -> tuple[float, str]:
        """Broadcast every tensor from rank 0 (the trainer) to the group, one call per tensor."""
        import torch.distributed as dist

        if self._gloo != 0:
            self.hub.unpublish()
        for t in self.tensors:
            if t.numel():
                dist.broadcast(t, src=0)
        return time.time(), workload.digest(self.tensors)

    def gloo_close(self) -> None:
        import torch.distributed as dist

        if self._gloo is not None:
            dist.destroy_process_group()
            self._gloo = None

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()
