"""Handles against an in-process server (:class:`~tensorhub.ports.LocalPort`), for tests.

``CONFIG`` keeps the units small and the timeouts short and uses the NIXL data path (every
handle of one process shares one host, so the same-host tier would otherwise take over);
``open_hub`` registers fresh tensors, ``publish`` moves a holder to a new version's bytes, and
``hold_half_way`` pauses a handle's next reads half way, so a test can act while it is partial.
"""

from __future__ import annotations

import threading

import torch

import tensorhub
from tensorhub.config import Config
from tensorhub.testing import workload

CONFIG = Config(unit_bytes=256 << 10, heartbeat_interval_s=0.2, lease_timeout_s=5.0, source_stall_timeout_s=2.0,
                same_host=False)
SPEC = workload.small_spec(2 << 20, big=2, tiny=12)


def open_hub(port, model: str = "m", *, config: Config = CONFIG, spec: workload.Spec = SPEC,
             **kw) -> tuple[tensorhub.Hub, list[torch.Tensor]]:
    """A registered handle on fresh tensors (``kw``: ``tensorhub.open``'s), and its tensors."""
    named = workload.allocate(spec)
    hub = tensorhub.open(model, port=port, config=config, **kw)
    hub.register(named)
    return hub, [t for _, t in named]


def publish(hub: tensorhub.Hub, tensors: list[torch.Tensor], version: int) -> None:
    """Unpublish what ``hub`` publishes (if anything), write ``version``'s bytes, publish it."""
    if hub.version is not None:
        hub.unpublish()
    workload.fill_version(tensors, version)
    hub.publish(version)


def hold_half_way(hub: tensorhub.Hub) -> tuple[threading.Event, threading.Event]:
    """From now on each read of ``hub`` stops half way: ``half`` is set there, and the read goes
    on once ``go`` is set (within 30 s)."""
    half, go = threading.Event(), threading.Event()
    pull_range = hub.reads.pull_range

    def held(a, end_unit, **kw):
        n = pull_range(a, end_unit // 2, **kw)
        half.set()
        assert go.wait(30)
        return n + pull_range(a, end_unit, **kw)

    hub.reads.pull_range = held
    return half, go
