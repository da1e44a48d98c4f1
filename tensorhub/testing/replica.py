"""A ready-made replica actor: holds one shard of a model and plays trainer or rollout.

Used by the demo, the tests and the benchmarks; also a template for attaching TensorHub to
your own actor (all it needs is ``tensorhub.open`` + ``register`` in ``__init__``). Every
method returns plain data (dicts, strings) so a driver can ``ray.get`` it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import ray
import torch

import tensorhub
from tensorhub.config import Config
from tensorhub.errors import TensorHubError
from tensorhub.graphs.member import GraphMember
from tensorhub.testing import workload


class Replica(GraphMember):
    """The plain-Python body of :class:`ReplicaActor` (usable without Ray for tests). As a
    :class:`~tensorhub.graphs.GraphMember` it can take part in compiled-graph pipelines
    (:func:`tensorhub.graphs.replicate_group`)."""

    def __init__(self, model: str, spec: workload.Spec, *, shard: int = 0, num_shards: int = 1,
                 replica: Optional[str] = None, datacenter: Optional[str] = None, spot: bool = False,
                 config: Optional[dict] = None, port=None) -> None:
        self.config = Config(**(config or {}))
        self.named = workload.allocate(spec)
        self.tensors = [t for _, t in self.named]
        self.hub = tensorhub.open(model, shard=shard, num_shards=num_shards, replica=replica,
                                  datacenter=datacenter, spot=spot, config=self.config, port=port)
        self.hub.register(self.named)

    @property
    def tensorhub_handle(self) -> tensorhub.Hub:
        """The hub :class:`~tensorhub.graphs.GraphMember` reads through."""
        return self.hub

    def ping(self) -> str:
        return self.hub.client_id

    def pid(self) -> int:
        """This process's id (a test kills it, or watches its CPU time)."""
        return os.getpid()

    def publish(self, version: int, fill: bool = True, density: Optional[float] = None) -> str:
        """Trainer step: unpublish (drain), write version ``version``'s bytes, publish.
        ``density``: change the previous version as an RL step does
        (:func:`~tensorhub.testing.workload.evolve_version`) instead of a fresh fill.
        Returns the digest of what is now published."""
        self.hub.unpublish()
        if fill and density is not None:
            workload.evolve_version(self.tensors, version, density)
        elif fill:
            workload.fill_version(self.tensors, version)
        self.hub.publish(version)
        return workload.digest(self.tensors)

    def unpublish(self) -> float:
        self.hub.unpublish()
        return time.time()

    def scribble(self, value: int = 0x5A) -> str:
        """Overwrite every byte (a trainer's optimizer step). Only legal while unpublished."""
        for t in self.tensors:
            if t.numel():
                t.view(-1).view(torch.uint8).fill_(value)
        return workload.digest(self.tensors)

    def replicate(self, spec="latest") -> dict:
        return self._stats(self.hub.replicate(spec))

    def update(self, spec="latest") -> dict:
        return self._stats(self.hub.update(spec))

    def try_call(self, method: str, *args) -> dict:
        """Call a hub method and report the typed error instead of raising (for tests)."""
        try:
            out = getattr(self.hub, method)(*args)
            return {"ok": True, "result": out if isinstance(out, (int, str, type(None))) else repr(out)}
        except TensorHubError as e:
            return {"ok": False, "error": type(e).__name__, "message": str(e)}

    def digest(self) -> str:
        return workload.digest(self.tensors)

    def version(self) -> Optional[int]:
        return self.hub.version

    def close(self, drop_last_copy: bool = True) -> None:
        """Close the hub. Default: a teardown (the job ends), so the last copy of a retained
        version may go; ``drop_last_copy=False`` makes the server refuse that (``LastCopyHeld``)."""
        self.hub.close(drop_last_copy=drop_last_copy)

    def _stats(self, st: tensorhub.ReadStats) -> dict:
        out = dataclasses.asdict(st)
        out["gbps"] = st.gbps
        out["client_id"] = self.hub.client_id
        out["digest"] = workload.digest(self.tensors)
        out["done_at"] = time.time()
        out["host_buffers_inline"] = self.hub.host_buffers_inline
        return out


ReplicaActor = ray.remote(num_cpus=0)(Replica)
"""``Replica`` as a Ray actor (``num_cpus=0``: it mostly waits on I/O)."""


def spawn(model: str, spec: workload.Spec, *, name: str, **kwargs):
    """Start a named ReplicaActor (``tensorhub-replica-<model>-<name>``) and wait until it is
    registered. Extra kwargs go to :class:`Replica`."""
    return spawn_many(model, spec, [name], **kwargs)[0]


def spawn_many(model: str, spec: workload.Spec, names: list[str], per_name: Optional[dict] = None, **kwargs):
    """Start several ReplicaActors at once (their processes start in parallel) and wait until
    all are registered. ``per_name`` maps a name to extra kwargs for that actor."""
    per_name = per_name or {}
    actors = [
        ReplicaActor.options(name=f"tensorhub-replica-{model}-{n}").remote(model, spec, **{**kwargs, **per_name.get(n, {})})
        for n in names
    ]
    ray.get([a.ping.remote() for a in actors])
    return actors
