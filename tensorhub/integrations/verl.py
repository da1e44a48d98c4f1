"""A verl checkpoint-engine backend that moves the weights with TensorHub.

Selected by configuration alone (verl 0.9.x)::

    actor_rollout_ref:
      rollout:
        checkpoint_engine:
          backend: tensorhub
          custom_backend_module: tensorhub.integrations.verl
          engine_kwargs:
            tensorhub: {model: my-policy}       # optional, see TensorHubCheckpointEngine

verl's ``CheckpointEngineManager`` calls, per update, ``prepare`` on every rank, the classmethod
``build_topology``, ``init_process_group``, then trainer ``send_weights`` together with rollout
``receive_weights``, then ``finalize``. What each does here::

    prepare              every rank: {"backend", "model", "num_shards", "last_version"}; allocates
                         nothing
    build_topology       roles, ranks, and the update's version floor (the trainer's last version
                         + 1); checks the ranks agree on model and num_shards; no process group,
                         so rollouts may join or leave between updates
    init_process_group   records the role, rank and floor
    send_weights         trainer rank r < num_shards: copy what the generator yields into this
                         shard's registered staging buffer (RDMA-copy mode: the first update
                         allocates and registers it, sized from its layout), publish(version);
                         other trainer ranks consume the generator (it may run collectives)
    receive_weights      rollout: the first update allocates a buffer per shard from the layouts the
                         trainer registered and registers it; every update: update(version) on
                         each shard, then yield (name, tensor) views of the buffer in the
                         trainer's order, with its names, dtypes and shapes
    finalize             trainer: unpublish (drains readers), so the version is served by the
                         rollouts that have it and a rollout joining later reads from a peer;
                         rollout: nothing (it keeps holding the version and serving it)

    trainer -> r0 -> r1 -> r2 ...   (TensorHub's pipeline: each rollout serves the next one)

The update's version is ``max(global_steps, floor)`` on both sides (``global_steps`` None counts
as 0): it is ``global_steps`` while steps grow, and a new version whenever verl repeats a step or
passes none, so a rollout never takes an older publication for this update's weights and never
races the trainer (it asks for that exact version and waits for it).

Retention stays with the rollouts here (their handles keep copies, unlike vLLM's engines, which
open with ``retains=False``): the trainer unpublishes at every ``finalize``, so a trainer that
kept the retained versions would copy its staging buffer to host memory at each of them, on the
update's path; the first rollout to finish a version copies it in the background instead.

A rollout that dies mid-update does not hang the others: their reads fail over to another source
(TensorHub's scheduler). A sharded trainer (``num_shards`` > 1: trainer rank r yields the
tensors of shard r) maps onto TensorHub shards; each rollout rank then holds all shards (one
replica of its own) and yields them in shard order.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator, Iterable, Optional, Union

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

import tensorhub
from tensorhub import errors
from tensorhub.handle import Hub, ReadStats
from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.integrations.waiting import PublishWait

log = logging.getLogger(__name__)

BACKEND = "tensorhub"
"""The name verl's config selects: ``checkpoint_engine.backend: tensorhub``."""

TRAINER, ROLLOUT = "trainer", "rollout"

_POLL_S = 0.05
"""Pause between looks at the server while a rollout waits for the trainer's first layout or
for the version it asked for to be published."""


@CheckpointEngineRegistry.register(BACKEND)
class TensorHubCheckpointEngine(CheckpointEngine):
    """verl ``CheckpointEngine`` over TensorHub (see the module docstring for the call mapping).

    Built by verl as ``CheckpointEngineRegistry.new("tensorhub", bucket_size=..., [is_master=...],
    **engine_kwargs["tensorhub"])``. Keyword arguments (``engine_kwargs.tensorhub``):

    - ``model``: TensorHub model name (default ``"verl-policy"``); one per policy being trained.
    - ``num_shards``: trainer ranks that each publish a part (default 1: rank 0 publishes the
      whole model, as verl's FSDP/Megatron generators yield full tensors on every rank).
    - ``device``: where the trainer's staging buffer and the rollout's buffer live, ``"cpu"``
      (default: host memory, no GPU memory used) or ``"cuda"``.
    - ``datacenter``, ``spot``: passed to :func:`tensorhub.open` (rollouts; the trainer is never spot).
    - ``wait_timeout_s``: how long a rollout waits for the trainer's first layout and for the
      version it asked for (default 600); then :class:`~tensorhub.errors.RequestTimeout`.
    - ``stall_timeout_s``: how long a rollout waits for a version the server says cannot be
      published as things stand (default 60): a trainer rank without a client (it died or left
      after its peers published; :class:`~tensorhub.errors.VersionStalled`, then raised).
    - ``config``: :class:`~tensorhub.config.Config` fields over ``Config.from_env()``.

    ``bucket_size`` is accepted and unused (TensorHub cuts transfer units itself: ``unit_bytes``);
    ``is_master`` too (the rank comes from :meth:`build_topology`). Bad values raise
    :class:`~tensorhub.errors.ConfigError`.
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 0, is_master: Optional[bool] = None, *, model: str = "verl-policy",
                 num_shards: int = 1, device: str = "cpu", datacenter: Optional[str] = None,
                 spot: bool = False, wait_timeout_s: float = 600.0, stall_timeout_s: float = 60.0,
                 config: Optional[dict[str, Any]] = None) -> None:
        if not isinstance(model, str) or not model:
            raise errors.ConfigError(f"engine_kwargs.tensorhub.model must be a non-empty string, got {model!r}")
        if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1:
            raise errors.ConfigError(f"engine_kwargs.tensorhub.num_shards must be an int >= 1, got {num_shards!r}")
        if device not in ("cpu", "cuda"):
            raise errors.ConfigError(f"engine_kwargs.tensorhub.device must be 'cpu' or 'cuda', got {device!r}")
        for name, v in (("wait_timeout_s", wait_timeout_s), ("stall_timeout_s", stall_timeout_s)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise errors.ConfigError(f"engine_kwargs.tensorhub.{name} must be > 0, got {v!r}")
        try:
            self.config = Config.from_env(**dict(config or {}))
        except TypeError as e:
            raise errors.ConfigError(f"engine_kwargs.tensorhub.config: {e}") from None
        self.bucket_size = bucket_size
        self.model = model
        self.num_shards = num_shards
        self.device = device
        self.datacenter = datacenter
        self.spot = bool(spot)
        self.wait_timeout_s = float(wait_timeout_s)
        self.stall_timeout_s = float(stall_timeout_s)
        self.role: Optional[str] = None
        self.rank: Optional[int] = None
        self.replica = f"verl-rollout-{uuid.uuid4().hex[:8]}"
        """This rollout rank's replica name: fixed for the engine's life, not tied to its rank
        (ranks are renumbered whenever rollouts join or leave)."""
        self.last_reads: list[ReadStats] = []
        """Rollout: the :class:`~tensorhub.handle.ReadStats` of the last receive, one per shard."""
        self._port = None
        self._hubs: list[Hub] = []
        self._buffers: list[list[tuple[str, torch.Tensor]]] = []
        """Per shard this rank holds: the registered tensors, in layout order."""
        self._version: Optional[int] = None
        """Trainer: the last version published."""
        self._floor: Optional[int] = None
        """The current update's version floor, from :meth:`build_topology` (None: no topology)."""
        self._round = 0

    # ------------------------------------------------------------------ topology

    def prepare(self) -> dict[str, Any]:
        """Per update, on every rank. Allocates nothing (buffers are registered once, on the first
        send / receive); returns what :meth:`build_topology` needs. ``last_version``: the last
        version this rank published; a rank that has not published yet (and is not known to be a
        rollout) reports the newest version the server has of the model (a restarted trainer
        continues above it), None when there is none."""
        last = self._version
        if last is None and self.role != ROLLOUT:
            view = self._view(layouts=False)
            last = max(view.available) if view is not None and view.available else None
        return {"backend": BACKEND, "model": self.model, "num_shards": self.num_shards, "last_version": last}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Roles and ranks for :meth:`init_process_group`: trainer ranks ``0..A-1``, rollout ranks
        ``0..R-1``, and for all the update's version floor: 1 + the newest ``last_version`` of the
        trainer ranks (``metadata`` lists the trainer's ranks first, as verl's manager does), 0
        when none. Raises ``ConfigError`` when the metadata is not one entry per rank of this
        backend or the ranks disagree on ``model`` / ``num_shards``."""
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise errors.ConfigError(f"build_topology: {len(metadata)} metadata entries for "
                                     f"{actor_wg_world_size} trainer + {rollout_world_size} rollout ranks")
        seen = set()
        for md in metadata:
            if not isinstance(md, dict) or md.get("backend") != BACKEND:
                raise errors.ConfigError(f"build_topology: a rank's metadata is not from the {BACKEND} "
                                         f"backend: {md!r}")
            seen.add((md["model"], md["num_shards"]))
        if len(seen) > 1:
            raise errors.ConfigError(f"build_topology: ranks disagree on (model, num_shards): {sorted(seen)}")
        a, r = actor_wg_world_size, rollout_world_size
        lasts = [md["last_version"] for md in metadata[:a] if md.get("last_version") is not None]
        floor = max(lasts) + 1 if lasts else 0
        return ({"role": [TRAINER] * a, "rank": list(range(a)), "world_size": [a] * a, "version_floor": [floor] * a},
                {"role": [ROLLOUT] * r, "rank": list(range(r)), "world_size": [r] * r, "version_floor": [floor] * r})

    def init_process_group(self, role: str, rank: int, world_size: int, version_floor: Optional[int] = None,
                           **_: Any) -> None:
        """Record the role, rank and version floor :meth:`build_topology` gave this rank; no
        process group. Without ``version_floor`` (a rollout catching up on its own, outside an
        update of verl's manager) the next receive moves to ``global_steps`` or ``"latest"``. A
        rank's role cannot change (``InvalidState``); a trainer world smaller than ``num_shards``
        is a ``ConfigError``."""
        if role not in (TRAINER, ROLLOUT):
            raise errors.ConfigError(f"init_process_group: unknown role {role!r}")
        if self.role is not None and role != self.role:
            raise errors.InvalidState(f"model={self.model}: this engine is a {self.role}, asked to be a {role}")
        if role == TRAINER and world_size < self.num_shards:
            raise errors.ConfigError(f"model={self.model}: num_shards={self.num_shards} needs that many trainer "
                                     f"ranks, the trainer has {world_size}")
        self.role, self.rank, self._floor = role, rank, version_floor

    def finalize(self) -> None:
        """Per update, after every rank's send / receive. Trainer: unpublish (blocks until no
        reader reads the staging buffer), so that later readers are served by the rollouts that
        hold the version. Rollout: nothing; it keeps its buffer registered and published."""
        if self.role == TRAINER and self._hubs and self._hubs[0].version is not None:
            self._hubs[0].unpublish()

    def close(self, drop_last_copy: bool = False) -> None:
        """Leave TensorHub (not called by verl: a rank that goes away simply stops heartbeating).
        ``drop_last_copy``: as :meth:`tensorhub.Hub.close`."""
        hubs, self._hubs, self._buffers = self._hubs, [], []
        for hub in hubs:
            hub.close(drop_last_copy=drop_last_copy)

    # ------------------------------------------------------------------ trainer

    async def send_weights(self, weights, global_steps: Optional[int] = None) -> dict[str, float]:
        """Trainer: stage the (name, tensor) pairs ``weights`` yields (a generator or an async
        iterator) and publish them as the update's version, ``max(global_steps, floor)`` (see the
        module docstring). Returns once published, not once read: the rollouts read while the
        trainer trains on. Returns verl sync metrics (``tensorhub/...``, the version included).

        Raises ``LayoutMismatch`` when the tensors (names, dtypes, shapes, order, count) differ
        from the first update's (the version before stays available from the rollouts);
        ``BadVersionSpec`` for a ``global_steps`` that is not an int >= 0 or None;
        ``InvalidState`` without :meth:`init_process_group` for this update."""
        if self.role != TRAINER:
            raise errors.InvalidState(f"model={self.model}: send_weights on a {self.role or 'not initialised'} rank")
        version = self._update_version(global_steps)
        if version is None:
            raise errors.InvalidState(f"model={self.model}: send_weights without init_process_group for this update")
        if self.rank >= self.num_shards:
            async for _ in _iterate(weights):
                pass
            return {}
        t0 = time.perf_counter()
        hub = self._hubs[0] if self._hubs else None
        if hub is not None and hub.version is not None:
            await hub.aunpublish()  # finalize normally did; the staging buffer is written next
        staged = self._buffers[0] if self._buffers else []
        first = not staged
        count = 0
        async for name, tensor in _iterate(weights):
            if first:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
                staged.append((name, buf))
            elif count >= len(staged):
                raise errors.LayoutMismatch(f"model={self.model} shard {self.rank}: the generator yields more than "
                                            f"the {len(staged)} tensors of the first update (extra: {name!r})")
            else:
                _check_same(self.model, self.rank, count, staged[count], name, tensor)
            staged[count][1].copy_(tensor)
            count += 1
        if not first and count != len(staged):
            raise errors.LayoutMismatch(f"model={self.model} shard {self.rank}: the generator yielded {count} "
                                        f"tensors, the first update {len(staged)}")
        if first:
            if not staged:
                raise errors.LayoutMismatch(f"model={self.model} shard {self.rank}: the generator yielded no tensor")
            hub = await asyncio.to_thread(self._open, self.rank, self.num_shards, "verl-trainer", False)
            try:
                await hub.aregister(staged)
            except BaseException:
                await hub.aclose(drop_last_copy=True)
                raise
            self._hubs, self._buffers = [hub], [staged]
        t1 = time.perf_counter()
        await hub.apublish(version)
        self._version = version
        nbytes = sum(t.numel() * t.element_size() for _, t in staged)
        log.info("model=%s shard=%d published version %d (%d tensors, %d bytes, staged in %.3f s)",
                 self.model, self.rank, version, len(staged), nbytes, t1 - t0)
        return {"tensorhub/version": float(version), "tensorhub/stage_s": t1 - t0,
                "tensorhub/publish_s": time.perf_counter() - t1, "tensorhub/bytes": float(nbytes)}

    def _update_version(self, global_steps: Optional[int]) -> Optional[int]:
        """This update's version (and the floor is used up), or None without a floor."""
        if global_steps is not None and (not isinstance(global_steps, int) or isinstance(global_steps, bool)
                                         or global_steps < 0):
            raise errors.BadVersionSpec(f"global_steps must be an int >= 0 or None, got {global_steps!r}")
        floor, self._floor = self._floor, None
        return None if floor is None else max(global_steps or 0, floor)

    # ------------------------------------------------------------------ rollout

    async def receive_weights(self, global_steps: Optional[int] = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Rollout: move this rank to the update's version (``max(global_steps, floor)``, as the
        trainer publishes it), waiting up to ``wait_timeout_s`` for the trainer to publish it,
        then yield ``(name, tensor)`` for every tensor, shard after shard, in the trainer's order.
        Outside an update of verl's manager (:meth:`init_process_group` without a
        ``version_floor``: a rollout catching up on its own) it moves to ``global_steps`` (None:
        ``"latest"``), which the rollouts that hold it serve once the trainer has finalized.

        The tensors are views of the registered buffer, which now serves the version to other
        rollouts: read (copy) them, never write them. A no-op transfer when the rank already
        holds the version. Raises ``RequestTimeout``, ``VersionExpired``, ``VersionLost``, or
        ``ConfigError`` when the trainer's ``num_shards`` differs from this rank's."""
        if self.role != ROLLOUT:
            raise errors.InvalidState(f"model={self.model}: receive_weights on a {self.role or 'not initialised'} rank")
        version = self._update_version(global_steps)
        spec: m.VersionSpec = version if version is not None else "latest" if global_steps is None else global_steps
        deadline = time.monotonic() + self.wait_timeout_s
        if not self._hubs:
            await self._open_rollout(deadline)
        self._round += 1
        self.last_reads = await self._update_all(spec, deadline)
        for buffer in self._buffers:
            for name, tensor in buffer:
                yield name, tensor

    async def _open_rollout(self, deadline: float) -> None:
        """Allocate and register one buffer per shard, from the layouts the trainer registered."""
        layouts = await asyncio.to_thread(self._wait_layouts, deadline)
        hubs, buffers = [], []
        try:
            for shard, info in enumerate(layouts):
                buf = [(t.name, torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=self.device))
                       for t in info.tensors]
                hub = await asyncio.to_thread(self._open, shard, len(layouts), self.replica, self.spot)
                hubs.append(hub)
                await hub.aregister(buf)
                buffers.append(buf)
        except BaseException:
            for hub in hubs:
                await hub.aclose(drop_last_copy=True)
            raise
        self._hubs, self._buffers = hubs, buffers
        log.info("model=%s replica=%s registered %d shard(s), %d tensors", self.model, self.replica,
                 len(hubs), sum(len(b) for b in buffers))

    def _view(self, layouts: bool) -> Optional[m.ModelView]:
        status = self._server().call(m.Query(model=self.model, layouts=layouts))
        return next((v for v in status.models if v.model == self.model), None)

    def _wait_layouts(self, deadline: float) -> list[m.LayoutInfo]:
        while True:
            view = self._view(layouts=True)
            if view is not None:
                if view.num_shards != self.num_shards:
                    raise errors.ConfigError(f"model={self.model}: the trainer publishes {view.num_shards} shard(s), "
                                             f"this rollout is configured for num_shards={self.num_shards}")
                known = {sl.shard: sl.layout for sl in view.layouts}
                if len(known) == view.num_shards and all(known[i].tensors for i in known):
                    return [known[i] for i in range(view.num_shards)]
            if time.monotonic() > deadline:
                raise errors.RequestTimeout(f"model={self.model}: no trainer registered its layout within "
                                            f"{self.wait_timeout_s} s")
            time.sleep(_POLL_S)

    async def _update_all(self, spec: m.VersionSpec, deadline: float) -> list[ReadStats]:
        """update(spec) on every shard, retrying those whose version is not published yet: until
        ``deadline`` (``RequestTimeout``), or for ``stall_timeout_s`` while the server says it
        cannot be (``VersionStalled``, raised)."""
        stats: list[Optional[ReadStats]] = [None] * len(self._hubs)
        sharded = len(self._hubs) > 1
        wait = PublishWait(spec, deadline, self.wait_timeout_s, self.stall_timeout_s, f"model={self.model}: ")
        while True:
            todo = [i for i, s in enumerate(stats) if s is None]
            results = await asyncio.gather(
                *(self._hubs[i].aupdate(spec, round=self._round if sharded else None) for i in todo),
                return_exceptions=True)
            waiting = None
            for i, res in zip(todo, results):
                if isinstance(res, errors.VersionNotFound):
                    waiting = res
                elif isinstance(res, BaseException):
                    raise res
                else:
                    stats[i] = res
            if waiting is None:
                return stats
            wait.after(waiting)
            await asyncio.sleep(_POLL_S)

    # ------------------------------------------------------------------ both

    def _server(self):
        if self._port is None:
            from tensorhub.ports import connect

            self._port = connect(self.config, self.model)
        return self._port

    def _open(self, shard: int, num_shards: int, replica: str, spot: bool) -> Hub:
        return tensorhub.open(self.model, shard=shard, num_shards=num_shards, replica=replica,
                              datacenter=self.datacenter, spot=spot, config=self.config, port=self._server())


def _check_same(model: str, shard: int, index: int, have: tuple[str, torch.Tensor], name: str,
                tensor: torch.Tensor) -> None:
    hname, htensor = have
    if (name, tensor.dtype, tuple(tensor.shape)) != (hname, htensor.dtype, tuple(htensor.shape)):
        raise errors.LayoutMismatch(
            f"model={model} shard {shard}: tensor #{index} is {name!r} {tensor.dtype} {tuple(tensor.shape)}, "
            f"the first update's was {hname!r} {htensor.dtype} {tuple(htensor.shape)} (the layout is fixed "
            f"at the first update)")


async def _iterate(weights: Union[Iterable, AsyncIterator]) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item
