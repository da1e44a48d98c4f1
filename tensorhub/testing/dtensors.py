"""Real DTensors without a real process group, for tests of what a trainer rank holds.

A rank's ``DTensor`` parameters are built on torch's fake process group (this process as
``rank`` of ``world``), their local shards cut by torch itself
(``compute_local_shape_and_global_offset``). A DTensor keeps its mesh coordinate once the group
is destroyed, but torch caches device meshes per process: build each rank in a process of its
own (a second rank in the same process gets the first one's coordinate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tensorhub import placement as P


def dtensor_params(tensors: Mapping[str, torch.Tensor], placements: Mapping[str, Any], rank: int,
                   world: int) -> dict[str, torch.nn.Parameter]:
    """Rank ``rank``'s parameters of the global ``tensors``: a DTensor over a 1-D mesh of
    ``world`` for each name in ``placements`` (a torch ``Shard``/``Replicate``), the whole tensor
    (a copy) for the others. Raises if a process group is initialized already."""
    import torch.distributed as dist
    import torch.distributed.tensor as dt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed import fake_pg

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        out = {}
        for name, g in tensors.items():
            g = g.detach()
            if name not in placements:
                out[name] = torch.nn.Parameter(g.clone())
                continue
            shape, offset = compute_local_shape_and_global_offset(g.shape, mesh, [placements[name]])
            local = g[tuple(slice(o, o + n) for o, n in zip(offset, shape))].contiguous().clone()
            out[name] = torch.nn.Parameter(dt.DTensor.from_local(
                local, mesh, [placements[name]], run_check=False, shape=g.shape, stride=g.stride()))
        return out
    finally:
        dist.destroy_process_group()


def copy_local(params: Sequence[tuple[str, torch.Tensor]], full: Mapping[str, torch.Tensor]) -> None:
    """An optimizer step on a rank: each parameter takes its bytes of ``full[name]`` (a DTensor
    its local shard's box, by :func:`tensorhub.placement.dtensor_placement`; another, all)."""
    with torch.no_grad():
        for name, p in params:
            g = full[name].detach()
            if not hasattr(p, "device_mesh"):
                p.copy_(g)
                continue
            local = p.to_local()
            if local.numel():
                box = P.dtensor_placement(name, p)[1].pieces[0].box
                local.copy_(g[tuple(slice(a, z) for a, z in zip(box.start, box.stop))])
