"""A vLLM weight-transfer backend that moves the weights with TensorHub: ``backend="tensorhub"``.

vLLM 0.32's pluggable weight transfer (``vllm.distributed.weight_transfer``) has a worker-side
``WeightTransferEngine`` (one per vLLM worker rank, in the engine's processes) and a trainer-side
``TrainerWeightTransferEngine``, each registered by name in a factory. This module registers
both as ``"tensorhub"`` from the ``vllm.general_plugins`` entry point (:func:`register`, declared
in TensorHub's package metadata), so every vLLM process finds it with nothing configured::

    llm = LLM(model=path, weight_transfer_config=WeightTransferConfig(backend="tensorhub"))

    # the trainer (any process of the Ray cluster), each RL step:
    engine = WeightTransferTrainerFactory.trainer_init(
        TensorHubTrainerInitInfo(model="policy", rank=0), client=client, source=ModuleSource(policy))
    engine.send_weights()        # publish, then start / update / finish on every engine

    # or an engine on its own, between generate() calls (pull mode, no trainer RPC):
    llm.update_weights({"update_info": {"version": "latest"}})

Two paths, chosen when an engine joins (``TensorHubInitInfo.path``: ``"auto"``, the default,
takes the direct one when it can, and :func:`report` says which was taken and why):

- *direct*: each worker rank derives, from vLLM's own layers, which boxes of which checkpoint
  tensors every parameter holds (:mod:`tensorhub.integrations.vllm_layout`: fused ``qkv_proj``
  and ``gate_up_proj``, column and row splits by TP rank, replicated KV heads, a padded
  vocabulary), registers a *slice buffer* with that placement, and reads exactly its own bytes,
  resharded from the trainer's layout by the server's plan and checked cell by cell
  (docs/placements.md); then it copies them into the live parameters and, on vLLM's CPU build,
  re-packs the linear layers (the build packs their weights for its GEMM and frees them). The
  ranks of one engine are the shards of one replica, and engines of one layout share a layout
  class: they pipeline from each other. No ``load_weights``, and per rank 1/TP of the model.
- *checkpoint format*: the engine receives the checkpoint's tensors, names, dtypes and shapes
  into a buffer of the whole checkpoint per rank (resharded from the trainer's shards when it
  holds slices, e.g. FSDP), and loads them with the model's own ``load_weights`` inside vLLM's
  layerwise reload. Taken when asked for, or when no parameter at all can be derived.
- *mixed* (``auto`` only): the direct path for every layer it can express, and for the others
  (quantized, an unknown layer class, a checkpoint that stores a fused layer already, as
  Phi-3's ``qkv_proj``) the checkpoint tensors no direct parameter takes, read whole into the
  same buffer and loaded first with ``load_weights``; a layer is loaded one way. ``load_weights``
  must say it loaded every parameter left to it, else the update raises ``LayoutMismatch``
  before any direct parameter is touched. ``report`` names the layers and why.

What each call does::

    trainer_init        sender (rank 0): a staging buffer shaped as source.metadata() (the
                        registered copy buffer of the paper's RDMA-copy mode), registered as
                        shard 0 of replica "vllm-trainer" with a whole placement (the schema);
                        then the engines' init over the client. With world_size > 1 every rank
                        registers its own part as shard `rank` (trainer_parts: DTensors' local
                        shards, other parameters whole): no rank gathers the model
    init_transfer_engine  worker: connect to the cluster, wait for the trainer's layout, choose
                        the path, allocate its buffer (the rank's slice, or the whole checkpoint)
                        and register it: a holder too, so engines read from each other
    send_weights        sender: stop serving the last version (drain), copy what the source yields
                        into the buffer, publish version v, then start_weight_update,
                        update_weights({"version": v}), finish_weight_update(str(v)) through the
                        client; other trainer ranks iterate the source (its collectives), or, with
                        world_size > 1, drain, copy and publish their own parts the same way
                        (staging=False: no copy; the parameters themselves are published)
    release             trainer rank: drain the version published (staging=False: call it before
                        the optimizer changes the parameters; send_weights refuses otherwise)
    receive_weights     worker: update(version) into its buffer: every byte verified before the
                        model is touched; then the copy and re-pack (direct) or the layerwise
                        reload around model.load_weights (checkpoint). A failed read leaves the
                        model as it was (all or nothing, across the TP ranks too: they agree over
                        the TP group before loading; the last rank raises, the others return, and
                        the client ends their session: end_failed_update) and raises
    start/finish_weight_update   worker: nothing (the load runs inside receive_weights, so a
                        failed or abandoned update never leaves layers half loaded)

Not built: reading straight into live GPU parameters without the slice buffer (no extra memory
at all, but a read that fails halfway would leave the engine between versions). Every byte is
verified before the model is touched, but a load that fails inside ``load_weights`` (the
checkpoint path, or a mixed layout's residual layers) can leave those layers loaded. Nothing
here ran on a GPU: the CPU build is the only one on these machines.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Union

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import tensorhub
from tensorhub import errors
from tensorhub import placement as P
from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.handle import Hub, ReadStats
from tensorhub.layout import dtype_name
from tensorhub.integrations import vllm_layout as VL
from tensorhub.integrations.trainer_parts import RankPart
from tensorhub.integrations.vllm_layout import DirectLayout
from tensorhub.integrations.waiting import PublishWait

log = logging.getLogger(__name__)

BACKEND = "tensorhub"
"""The name vLLM's ``WeightTransferConfig(backend=...)`` selects."""

TRAINER_REPLICA = "vllm-trainer"
PATHS = ("auto", "direct", "checkpoint")
_POLL_S = 0.05


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register ``tensorhub`` in both of vLLM's
    weight-transfer factories (by module path). Idempotent. vLLM loads general plugins in the
    processes where it builds engines; a trainer process that runs none registers by importing
    this module (which it does for :class:`TensorHubTrainerInitInfo`)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, "TensorHubWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "TensorHubTrainerWeightTransferEngine")):
        if BACKEND not in factory._registry:
            factory.register_engine(BACKEND, __name__, cls)


# ---------------------------------------------------------------------------------- init and update info


@dataclass
class TensorHubInitInfo(WeightTransferInitInfo):
    """What a worker engine needs to join (``init_weight_transfer_engine``'s ``init_info``).

    ``model``: the TensorHub model name. ``config``: :class:`~tensorhub.config.Config` fields
    over ``Config.from_env()`` (``model_secret`` among them, when the model has one).
    ``ray_address``: the cluster to join ("" : ``RAY_ADDRESS``, else ``"auto"``; the trainer
    fills it in). ``datacenter``, ``spot``: as :func:`tensorhub.open`. ``wait_timeout_s``: how long
    to wait for the trainer's layout and for a version to be published. ``stall_timeout_s``: how
    long to wait for a version that cannot be published as things stand
    (:class:`~tensorhub.errors.VersionStalled`: a trainer rank without a client, that died or left
    after its peers published; raised then, the engine keeps its weights). ``path``: ``"auto"``
    (direct when every parameter's placement can be derived, mixed when some can, else
    checkpoint format),
    ``"direct"`` (``LayoutMismatch`` naming what cannot be derived, the engine unchanged) or
    ``"checkpoint"``. ``retains``: whether the engine keeps retention copies (host copies of
    retained versions, ``tensorhub.open(retains=...)``); False (the default): an engine's memory is
    for serving, the trainer keeps the retained versions (each engine would otherwise hold a
    pooled buffer and, in turn, the previous version: up to 2 model slices of host memory)."""

    model: str
    config: dict = field(default_factory=dict)
    ray_address: str = ""
    datacenter: str = ""
    spot: bool = False
    wait_timeout_s: float = 600.0
    stall_timeout_s: float = 60.0
    path: str = "auto"
    retains: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise errors.ConfigError(f"init_info.model must be a non-empty string, got {self.model!r}")
        if not isinstance(self.config, dict):
            raise errors.ConfigError(f"init_info.config must be a dict of Config fields, got {type(self.config).__name__}")
        _check_timeouts(self)
        if self.path not in PATHS:
            raise errors.ConfigError(f"init_info.path must be one of {', '.join(PATHS)}, got {self.path!r}")
        for name in ("spot", "retains"):
            if not isinstance(getattr(self, name), bool):
                raise errors.ConfigError(f"init_info.{name} must be a bool, got {getattr(self, name)!r}")


def _check_timeouts(info) -> None:
    for name in ("wait_timeout_s", "stall_timeout_s"):
        v = getattr(info, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 86400:
            raise errors.ConfigError(f"init_info.{name} must be in (0, 86400], got {v!r}")


@dataclass
class TensorHubUpdateInfo(WeightTransferUpdateInfo):
    """One update (``update_weights``' ``update_info``): ``version``, an int >= 0 or a version
    spec (``"latest"``, ``"latest-1"``...), as :meth:`tensorhub.Hub.update` takes it."""

    version: Union[int, str] = "latest"

    def __post_init__(self) -> None:
        from tensorhub.core.versions import parse_spec

        try:
            parse_spec(self.version)
        except errors.BadVersionSpec as e:
            raise errors.BadVersionSpec(f"update_info.version: {e}") from None


@dataclass
class TensorHubTrainerInitInfo(TrainerInitInfo):
    """The trainer side's init info. ``model``, ``config``, ``datacenter``: as
    :class:`TensorHubInitInfo`. ``device``: where the trainer's staging buffer lives (``"cpu"``:
    host memory, no GPU memory used; ``"cuda"``). ``wait_timeout_s``, ``stall_timeout_s``,
    ``path``: passed to the engines (:class:`TensorHubInitInfo`); ``engines_retain``: passed as
    their ``retains``. The trainer's handle keeps the retained versions (its ``Config``:
    ``versions_retained``, ``host_copies_pooled``).

    ``world_size``: the trainer ranks that register parts of the model, each as a shard of the
    trainer's replica (ranks 0 to ``world_size - 1``), so no rank gathers the whole model: a
    ``ModuleSource``'s ``DTensor`` parameters (FSDP, TP) as their local shards, its other
    parameters whole; another source's ``held_names()`` whole, from its iteration
    (:mod:`tensorhub.integrations.trainer_parts`). The engines reshard their bytes from the ranks
    that hold them. 1 (the default): rank 0 registers the whole model, gathered by iterating the
    source (``full_tensor()`` on FSDP); the other ranks only iterate it, for its collectives.

    ``staging``: True (the default): each registering rank copies its part into a staging buffer
    of its own at every ``send_weights`` (the registered copy buffer; ``device``), so the trainer
    may change its parameters whenever it likes. False: a ``ModuleSource``'s parameters (their
    local shards) are registered themselves, with no copy and no memory of TensorHub's own; the
    trainer must then call :meth:`TensorHubTrainerWeightTransferEngine.release` on every
    registering rank before its optimizer changes them (``send_weights`` refuses otherwise)."""

    backend: ClassVar[str] = BACKEND

    model: str = "vllm-policy"
    config: dict = field(default_factory=dict)
    datacenter: str = ""
    device: str = "cpu"
    wait_timeout_s: float = 600.0
    stall_timeout_s: float = 60.0
    path: str = "auto"
    engines_retain: bool = False
    world_size: int = 1
    staging: bool = True

    def __post_init__(self) -> None:
        for name in ("rank", "world_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise errors.ConfigError(f"init_info.{name} must be an int >= 0, got {v!r}")
        if not 1 <= self.world_size <= 4096:
            raise errors.ConfigError(f"init_info.world_size must be in [1, 4096], got {self.world_size!r}")
        if self.world_size > 1 and self.rank >= self.world_size:
            raise errors.ConfigError(f"init_info.rank {self.rank} is not below world_size {self.world_size}")
        if not isinstance(self.staging, bool):
            raise errors.ConfigError(f"init_info.staging must be a bool, got {self.staging!r}")
        _check_timeouts(self)

    @property
    def registers(self) -> bool:
        """Whether this rank registers a part of the model (rank 0 alone when ``world_size`` is 1)."""
        return self.is_sender or self.world_size > 1


def _config(model: str, fields: dict) -> Config:
    try:
        return Config.from_env(**dict(fields))
    except TypeError as e:
        raise errors.ConfigError(f"model={model}: init_info.config: {e}") from None


def _join_ray(address: str, config: Config) -> None:
    """Join the cluster the trainer runs in (an engine's processes are not Ray workers)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", namespace=config.namespace,
                 log_to_driver=False, logging_level="ERROR")


# ---------------------------------------------------------------------------------- worker side


class TensorHubWeightTransferEngine(WeightTransferEngine[TensorHubInitInfo, TensorHubUpdateInfo]):
    """vLLM worker side (the module docstring's table). One per vLLM worker rank."""

    init_info_cls = TensorHubInitInfo
    update_info_cls = TensorHubUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.info: Optional[TensorHubInitInfo] = None
        self.hub_config: Optional[Config] = None
        self.replica = ""
        """This engine's replica: one per engine (its TP ranks are its shards) on the direct
        path, one per worker rank on the checkpoint path."""
        self.hubs: list[Hub] = []
        self.buffers: list[list[tuple[str, torch.Tensor]]] = []
        self.path = ""
        """``"direct"``, ``"mixed"`` (direct but for the layers loaded from whole checkpoint
        tensors) or ``"checkpoint"`` once joined."""
        self.layout: Optional[DirectLayout] = None
        """The direct path's derived placement; None on the checkpoint path."""
        self.fallback: dict[str, str] = {}
        """Why the direct path was not taken (parameter or checkpoint tensor: reason); empty on it."""
        self.version: Optional[int] = None
        """The version the model was last loaded with."""
        self.last_reads: list[ReadStats] = []
        """The :class:`~tensorhub.handle.ReadStats` of the last update, one per handle."""
        self.last_split_s: tuple[float, float] = (0.0, 0.0)
        """The last update's seconds: reading the version (waits included), loading it."""
        self._port = None
        self._round = 0
        """Updates asked of this engine: the round number of a sharded replica."""

    def parse_init_info(self, init_dict: dict[str, Any]) -> TensorHubInitInfo:
        try:
            return TensorHubInitInfo(**init_dict)
        except TypeError as e:
            raise errors.ConfigError(f"init_info for backend {BACKEND!r}: {e}") from None

    def parse_update_info(self, update_dict: dict[str, Any]) -> TensorHubUpdateInfo:
        try:
            return TensorHubUpdateInfo(**update_dict)
        except TypeError as e:
            raise errors.ConfigError(f"update_info for backend {BACKEND!r}: {e}") from None

    def init_transfer_engine(self, init_info: TensorHubInitInfo) -> None:
        """Join the model: wait for the trainer's layout, choose the path (direct: the rank's
        slice buffer with its derived placement; checkpoint: a buffer of the trainer's layout)
        and register. Called again with another model, it leaves the first (typed errors leave
        the engine as it was)."""
        tp_rank, tp_size = _tp_rank_size()
        replica = _engine_replica(tp_size)  # collective over the TP group: before anything may fail
        cfg = _config(init_info.model, init_info.config)
        _join_ray(init_info.ray_address, cfg)
        from tensorhub.ports import connect

        port = connect(cfg, init_info.model)
        deadline = time.monotonic() + init_info.wait_timeout_s
        layouts, schema = _wait_layouts(port, init_info.model, deadline)
        layout, why = self._direct_layout(init_info, schema)
        common = dict(datacenter=init_info.datacenter or None, spot=init_info.spot, retains=init_info.retains,
                      config=cfg, port=port)
        hubs, buffers = [], []
        try:
            if layout is not None:
                buf = layout.buffers()
                hub = tensorhub.open(init_info.model, shard=tp_rank, num_shards=tp_size, replica=replica, **common)
                hubs.append(hub)
                hub.register(buf, placement=layout.placement,
                             layout_key=VL.layout_key(layout.schema, self.model, tp_size))
                buffers.append(buf)
            elif schema is not None:
                # the whole checkpoint, in one buffer: the trainer's own layout when it is one
                # whole shard (the same class: a plain read), else resharded from its shards
                replica = f"{replica}-rank{tp_rank}"
                whole = VL.schema_of(layouts[0].tensors) if len(layouts) == 1 else schema
                buf = [(g.name, torch.zeros(g.shape, dtype=getattr(torch, g.dtype))) for g in whole.tensors]
                hub = tensorhub.open(init_info.model, replica=replica, **common)
                hubs.append(hub)
                hub.register(buf, placement=P.whole_placement(whole))
                buffers.append(buf)
            else:  # a trainer without placements: its layout, shard by shard
                replica = f"{replica}-rank{tp_rank}"
                for shard, lay in enumerate(layouts):
                    buf = [(t.name, torch.zeros(t.shape, dtype=getattr(torch, t.dtype))) for t in lay.tensors]
                    hub = tensorhub.open(init_info.model, shard=shard, num_shards=len(layouts), replica=replica,
                                         **common)
                    hubs.append(hub)
                    hub.register(buf)
                    buffers.append(buf)
        except BaseException:
            for hub in hubs:
                hub.close(drop_last_copy=True)
            raise
        self.shutdown()
        self.info, self.hub_config, self._port, self.replica = init_info, cfg, port, replica
        self.hubs, self.buffers = hubs, buffers
        self.path = "checkpoint" if layout is None else "mixed" if layout.mixed else "direct"
        self.layout, self.fallback = layout, why
        self.version, self._round = None, 0
        log.info("model=%s replica=%s: %s path, %d tensors registered%s", init_info.model, replica, self.path,
                 sum(len(b) for b in buffers), f" (direct not taken: {_first(why)})" if why else "")

    def _direct_layout(self, info: TensorHubInitInfo,
                       schema: Optional[P.Schema]) -> tuple[Optional[DirectLayout], dict[str, str]]:
        """The rank's derived placement over the model's ``schema`` (whatever the trainer's
        shards: a whole checkpoint, or FSDP / TP slices resharded by the server's plan) when the
        direct path is asked for and possible, else None and why not (``path="direct"`` raises
        ``LayoutMismatch`` with the reasons)."""
        if info.path == "checkpoint":
            return None, {"path": "checkpoint asked for"}
        why: dict[str, str] = {}
        if schema is None:
            why["trainer"] = "the trainer registered without a placement"
        layout = None
        if not why:
            layout = VL.derive(self.model, schema)
            why = dict(layout.fallback) or ({} if layout.placement is not None else {"model": "no parameter to take"})
        if not why:
            return layout, {}
        if info.path == "auto" and layout is not None and layout.placement is not None:
            return layout, why  # mixed: what cannot be derived is loaded from whole checkpoint tensors
        if info.path == "direct":
            raise errors.LayoutMismatch(f"model={info.model}: the direct path cannot take {len(why)} "
                                        f"parameter(s): {_first(why, 3)}")
        return None, why

    def start_weight_update(self) -> None:
        """Nothing: the load runs inside :meth:`receive_weights`, once the bytes are in."""

    def finish_weight_update(self) -> None:
        """Nothing (see :meth:`start_weight_update`)."""

    def receive_weights(self, update_info: TensorHubUpdateInfo) -> None:
        """Read ``update_info.version`` into the buffers (waiting up to ``wait_timeout_s`` for it
        to be published), then load it into the model: on the direct path a copy of each
        parameter's slice (and a re-pack of CPU-packed layers), on the checkpoint path vLLM's
        layerwise reload. The model is untouched unless every byte arrived and verified, on every
        TP rank of the engine: the ranks agree over vLLM's TP group before any loads, so a read
        that fails on one rank leaves all of them on the previous weights. A load that fails part
        way (``load_weights`` raising) is undone: every rank reads its previous version again and
        loads it (:meth:`_restore`; ``LoadFailed``). The last rank raises
        (the failed rank's own error when it is the only one, else ``TransferError`` naming each
        failed rank), the others return without loading (see below). A no-op transfer and load
        when the model already runs it."""
        if not self.hubs:
            raise errors.InvalidState(f"backend {BACKEND!r}: receive_weights before init_weight_transfer_engine")
        t0 = time.monotonic()
        deadline = t0 + self.info.wait_timeout_s
        self._round += 1
        sharded = self.hubs[0].num_shards > 1
        failed: Optional[BaseException] = None
        try:
            stats = _update_all(self.hubs, update_info.version, deadline, self.info,
                                self._round if sharded else None)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks agreed
            failed = e
        failures = _tp_failures(failed)
        if failures:
            rank, size = _tp_rank_size()
            if rank < size - 1:
                # vLLM's multiprocess executor reads the ranks' answers in rank order and stops
                # at the first error: an error from any rank but the last would leave the later
                # ranks' answers queued, read as the answers of the engine's next calls
                log.warning("model=%s replica=%s rank %d: version %r not loaded: %s", self.info.model,
                            self.replica, rank, update_info.version, _said(failures))
                return
            if failed is not None and len(failures) == 1:
                raise failed
            raise errors.TransferError(f"model={self.info.model} replica={self.replica}: version "
                                       f"{update_info.version!r} not loaded on any TP rank: {_said(failures)}")
        version = self.hubs[0].version
        self.last_reads = stats
        t1 = time.monotonic()
        if version == self.version:
            self.last_split_s = (t1 - t0, 0.0)
            return
        load_failed: Optional[BaseException] = None
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - every rank hears of it (below) before any raises
            load_failed = e
        failures = _tp_failures(load_failed)
        if failures:
            self._restore(update_info.version, failures, load_failed)
            return
        self.last_split_s = (t1 - t0, time.monotonic() - t1)
        self.version = version
        log.info("model=%s replica=%s: loaded version %s on the %s path (%d bytes read)", self.info.model,
                 self.replica, version, self.path, sum(s.bytes for s in stats))

    def _load(self) -> None:
        """The buffers into the model: the direct copies (and the residual's ``load_weights``),
        or the whole checkpoint through vLLM's layerwise reload."""
        if self.layout is not None:
            self.layout.apply(self.model, self.buffers[0],
                              lambda weights: _load_checkpoint(self.model, self.model_config, weights))
        else:
            _load_checkpoint(self.model, self.model_config, (t for buf in self.buffers for t in buf))

    def _restore(self, asked, failures: list[tuple[int, str]], mine: Optional[BaseException]) -> None:
        """A load failed on some TP rank (``failures``) after every byte had arrived: ``load_weights``
        or a copy raised part way, so the ranks that loaded anything may hold parts of two
        versions. Every rank reads the version it ran before again (retained: the trainer keeps
        it in host memory, and host copies are resharded reads' sources) and loads it, so the
        engine runs that version, whole, as before. The ranks agree on the outcome; the last
        rank raises :class:`~tensorhub.errors.LoadFailed` (the others return, as for a failed
        read), saying whether the engine runs its previous version again. An engine that ran
        no version yet (the weights it started with) cannot go back: it says so."""
        rank, size = _tp_rank_size()
        prev, why = self.version, ""
        if prev is None:
            why = "no earlier version to go back to (the engine ran the weights it was started with)"
        else:
            try:
                self._round += 1
                sharded = self.hubs[0].num_shards > 1
                _update_all(self.hubs, prev, time.monotonic() + self.info.wait_timeout_s, self.info,
                            self._round if sharded else None)
                self._load()
            except Exception as e:  # noqa: BLE001 - reported with the load's failure
                why = f"reading version {prev} again failed: {type(e).__name__}: {e}"
        again = _tp_failures(RuntimeError(why) if why else None)
        if again:
            self.version = None  # parts of two versions: nothing it can name
        where = f"model={self.info.model} replica={self.replica}"
        said = (f"the engine runs version {prev} again" if not again else
                f"its weights are parts of two versions ({_said(again)}): update it again")
        if rank < size - 1:
            log.warning("%s rank %d: version %r not loaded (%s); %s", where, rank, asked, _said(failures), said)
            return
        raise errors.LoadFailed(f"{where}: version {asked!r} not loaded: {_said(failures)}; {said}") from mine

    def shutdown(self) -> None:
        """Leave TensorHub (the buffer stops serving; the model keeps its weights)."""
        hubs, self.hubs, self.buffers = self.hubs, [], []
        for hub in hubs:
            try:
                hub.close()
            except errors.TensorHubError as e:  # the last copy elsewhere: keep it registered
                log.warning("model=%s: closing shard %d: %s", hub.model, hub.shard, e)
                hub.close(drop_last_copy=True)


def report(worker) -> dict[str, Any]:
    """What a worker's engine did, for ``llm.collective_rpc(report)`` (one dict per worker rank;
    passing a function needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``): ``path``, ``fallback``
    (what kept the direct path from being taken, by parameter), ``replica``, ``shard`` /
    ``num_shards`` (of the replica), ``version``, ``slice_bytes`` (the bytes this rank holds of
    the checkpoint: its slice on the direct path, the whole checkpoint on the other),
    ``last_read_bytes`` (what the last update moved into this rank), ``last_split_s``,
    ``pack_on_first_use`` (the modules whose CPU-packed copy is made again only if used),
    ``retention_bytes`` (host memory its handles hold for retention: host copies and pooled
    buffers; 0 unless ``init_info.retains``), ``last_sources`` (the clients the last update was
    told to read from, ``model/replica/shard/id``, sorted: ``ReadStats.holders``)."""
    e = worker.weight_transfer_engine
    hub = e.hubs[0] if e.hubs else None
    lazy = [n for n, m in worker.model_runner.model.named_modules()
            if isinstance(getattr(m, "cpu_linear", None), VL.PackOnFirstUse)]
    return {"pack_on_first_use": lazy, "path": e.path, "fallback": dict(e.fallback), "replica": e.replica,
            "shard": hub.shard if hub else None, "num_shards": hub.num_shards if hub else None,
            "version": e.version, "slice_bytes": sum(t.nbytes for buf in e.buffers for _, t in buf),
            "last_read_bytes": sum(s.bytes for s in e.last_reads), "last_split_s": list(e.last_split_s),
            "retention_bytes": sum(h.host_copies.held_bytes() for h in e.hubs),
            "last_sources": sorted({src for st in e.last_reads for src in st.holders})}


def _first(why: dict[str, str], n: int = 1) -> str:
    return "; ".join(f"{k}: {v}" for k, v in list(why.items())[:n]) + (f" (+{len(why) - n} more)" if len(why) > n else "")


def _tp_rank_size() -> tuple[int, int]:
    """This worker's TP rank and size (0, 1 outside a vLLM worker)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - no model parallel group: one rank
        return 0, 1


def _engine_replica(tp_size: int) -> str:
    """A replica name for this engine, the same on all its TP ranks (rank 0's, broadcast over
    vLLM's TP group: every rank runs ``init_transfer_engine``)."""
    name = f"vllm-{uuid.uuid4().hex[:8]}"
    if tp_size > 1:
        from vllm.distributed import get_tp_group

        name = get_tp_group().broadcast_object(name, src=0)
    return name


def _tp_failures(failed: Optional[BaseException]) -> list[tuple[int, str]]:
    """The TP ranks of this engine whose read failed, with their errors (a collective over
    vLLM's TP group's CPU group: every rank calls it, also one whose read failed); [] when none."""
    rank, size = _tp_rank_size()
    mine = None if failed is None else f"{type(failed).__name__}: {failed}"
    if size <= 1:
        return [] if mine is None else [(rank, mine)]
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    said: list[Optional[str]] = [None] * size
    dist.all_gather_object(said, mine, group=get_tp_group().cpu_group)
    return [(r, e) for r, e in enumerate(said) if e is not None]


def _said(failures: list[tuple[int, str]]) -> str:
    return "; ".join(f"TP rank {r}: {e}" for r, e in failures)


def _wait_layouts(port, model: str, deadline: float) -> tuple[list[m.LayoutInfo], Optional[P.Schema]]:
    """The layouts the trainer registered, one per shard, waiting for them until ``deadline``,
    and the model's schema (its global tensors; None when its registrations carry no
    placements). Raises ``LayoutMismatch`` for a schema that breaks its rules."""
    while True:
        status = port.call(m.Query(model=model, layouts=True))
        view = next((v for v in status.models if v.model == model), None)
        if view is not None:
            known = {sl.shard: sl.layout for sl in view.layouts}
            if len(known) == view.num_shards and all(known[i].tensors for i in known):
                schema = P.Schema.of(view.schema) if view.placements and view.schema else None
                return [known[i] for i in range(view.num_shards)], schema
        if time.monotonic() > deadline:
            raise errors.RequestTimeout(f"model={model}: no trainer registered its layout in time")
        time.sleep(_POLL_S)


def _update_all(hubs: list[Hub], spec, deadline: float, info: "TensorHubInitInfo",
                round_no: Optional[int]) -> list[ReadStats]:
    """update(spec) on every handle, as round ``round_no`` of a sharded replica (this engine's
    count of its updates: growing, the same on every shard; None: unsharded), retrying while the
    version is not published: until ``deadline`` (``RequestTimeout``), or for ``stall_timeout_s``
    of ``info`` while the server says it cannot be (``VersionStalled``, raised)."""
    stats: list[Optional[ReadStats]] = [None] * len(hubs)
    wait = PublishWait(spec, deadline, info.wait_timeout_s, info.stall_timeout_s)
    while True:
        waiting = None
        for i, hub in enumerate(hubs):
            if stats[i] is not None:
                continue
            try:
                stats[i] = hub.update(spec, round=round_no) if round_no is not None else hub.update(spec)
            except errors.VersionNotFound as e:
                waiting = e
        if waiting is None:
            return stats
        wait.after(waiting)
        time.sleep(_POLL_S)


def _load_checkpoint(model: torch.nn.Module, model_config, weights) -> Optional[set]:
    """``model.load_weights(weights)`` inside vLLM's layerwise reload (what a checkpoint-format
    engine must do: vllm-on-cpu note); the parameters it says it loaded (None if it does not say)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    try:
        loaded = model.load_weights(weights)
    finally:
        finalize_layerwise_reload(model, model_config)
    _repack_tied_cpu_gemm(model)
    return set(loaded) if loaded is not None else None


def _repack_tied_cpu_gemm(model: torch.nn.Module) -> None:
    """On CPU, vLLM packs a copy of a layer's weight for its GEMM when the layer is processed
    (``cpu_linear``, ``dispatch_cpu_unquantized_gemm``). The layerwise reload processes the
    layers it loaded, not one whose weight is tied to another layer's (Qwen2's tied ``lm_head``
    shares ``embed_tokens.weight``): that one would go on computing logits with the old weights
    (measured: a tied Qwen2 generated differently from an engine loaded from the same weights,
    every parameter equal). Re-pack every layer whose weight another layer shares."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    VL.repack_live(m for mods in VL.cpu_packed_users(model).values() if len(mods) > 1 for m in mods)


# ---------------------------------------------------------------------------------- an engine to put in an actor


class VLLMEngine:
    """A ``vllm.LLM`` whose weights TensorHub moves, with the methods vLLM's
    ``RayVLLMWeightSyncClient`` calls on an engine's actor, so a trainer drives it::

        Engine = ray.remote(VLLMEngine)          # or subclass it to add generate()
        engines = [Engine.remote(path, dtype="float32") for _ in range(2)]
        client = RayVLLMWeightSyncClient(engines)

    Not an actor itself: ``ray.remote(...)`` makes it one (the engine core is then a child
    process of the actor). ``model`` and ``llm_kwargs``: ``vllm.LLM``'s arguments, but for
    ``weight_transfer_config`` (always ``backend="tensorhub"``). ``llm``: the engine, for
    ``generate`` and the rest. Each method forwards to the engine and blocks until every worker
    rank of it has done the call; a failed update leaves the engine on its previous weights."""

    def __init__(self, model: str, **llm_kwargs: Any) -> None:
        from vllm import LLM  # not at import: vLLM imports this module while it builds an engine
        from vllm.config import WeightTransferConfig

        self.llm = LLM(model=model, weight_transfer_config=WeightTransferConfig(backend=BACKEND), **llm_kwargs)

    def init_weight_transfer_engine(self, request) -> None:
        """Join the trainer's model (``request``: ``{"init_info": ...}`` or vLLM's request)."""
        self.llm.init_weight_transfer_engine(request)

    def shutdown_weight_transfer_engine(self) -> None:
        """Leave TensorHub; the engine keeps its weights and goes on generating."""
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, request) -> None:
        """Read and load a version (``request``: ``{"update_info": {"version": ...}}`` or vLLM's)."""
        self.llm.update_weights(request)

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        """End the update; with ``weight_version``, also name the version the engine now runs
        (vLLM's Ray client names it with :meth:`update_weight_version` instead)."""
        self.llm.finish_weight_update(weight_version)

    def update_weight_version(self, version: str) -> None:
        self.llm.update_weight_version(version)

    def get_weight_version(self) -> str:
        """The version the engine runs, as the trainer named it."""
        return self.llm.get_weight_version()


# ---------------------------------------------------------------------------------- trainer side


class LocalLLMClient:
    """vLLM's ``VLLMWeightSyncClient`` over ``vllm.LLM`` objects of this process (vLLM ships
    HTTP and Ray actor clients): each call goes to every engine, one after another, so the later
    ones may read from the earlier ones; :meth:`update_each` (what ``send_weights`` uses) drives
    each engine through a whole update on its own. ``engines`` may be replaced between updates
    (an update of some engines only)."""

    def __init__(self, *engines: Any) -> None:
        self.engines = list(engines)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        for e in self.engines:
            e.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        for e in self.engines:
            e.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        for e in self.engines:
            e.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        for e in self.engines:
            e.finish_weight_update(weight_version)

    def update_each(self, version: int) -> list[tuple[str, BaseException]]:
        """start / update / finish ``version`` on each engine on its own, one after another:
        an engine that fails does not keep the later ones from taking the version, and only
        those that took it are finished with it (their ``get_weight_version()`` then names it).
        Blocks until the last engine is done. Returns the engines that failed, as
        ``("engine i", its error)`` (i: the index in ``engines``); ``[]`` when every one took it."""
        failed: list[tuple[str, BaseException]] = []
        for i, e in enumerate(self.engines):
            try:
                e.start_weight_update()
                try:
                    e.update_weights({"update_info": {"version": version}})
                except Exception:
                    end_failed_update(e.finish_weight_update)
                    raise
                e.finish_weight_update(str(version))
            except Exception as err:  # noqa: BLE001 - this engine's error
                failed.append((f"engine {i}", err))
        return failed


def end_failed_update(finish: Callable[[], Any]) -> None:
    """After an engine's ``update_weights`` raised: ``finish()`` (its ``finish_weight_update``,
    no version), ignoring what it raises. vLLM ends the session of the worker rank that raised,
    but the other ranks of a TP engine returned without loading (``receive_weights``: only the
    last rank raises, so vLLM's executor reads every rank's answer) and their sessions stay open:
    without this, the engine's next ``start_weight_update`` fails on them. The rank that raised
    has no session and refuses the finish: that error is expected."""
    try:
        finish()
    except Exception as e:  # noqa: BLE001 - see above
        log.debug("finish after a failed update: %s", e)


class TensorHubTrainerWeightTransferEngine(TrainerWeightTransferEngine[TensorHubTrainerInitInfo]):
    """vLLM trainer side (the module docstring's table)."""

    init_info_cls = TensorHubTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool,
                 info: TensorHubTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.hub: Optional[Hub] = None
        self.port = None
        self.part: Optional[RankPart] = None
        """This rank's staging buffer and its placement (None on a rank that registers nothing)."""
        self.module: Optional[torch.nn.Module] = None
        """A ``ModuleSource``'s module when the ranks register parts: filled from its parameters
        (DTensors' local shards), not from the source's iteration (which would gather them)."""
        self.version: Optional[int] = None
        """The last version published."""
        self.unpublish_s = 0.0
        """Seconds the last ``send_weights`` spent moving off the version before (an offload of it
        to host memory when no host copy was made ahead: engines keep none, so the server asks
        this trainer to copy each version ahead once the engines have read it)."""

    @property
    def buffer(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's staging buffer, (name, tensor) in registration order ([] if none)."""
        return self.part.buffers if self.part is not None else []

    @property
    def placement(self) -> Optional[P.Placement]:
        """The staging buffer's placement (the whole schema with ``world_size`` 1)."""
        return self.part.placement if self.part is not None else None

    @classmethod
    def trainer_init(cls, init_info: TensorHubTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: Optional[WeightSource] = None) -> "TensorHubTrainerWeightTransferEngine":
        """Every trainer rank. A rank that registers (rank 0, or every rank with ``world_size``
        > 1) opens its shard of the trainer's replica and registers its staging buffer with its
        placement; the sender then initialises the engines through ``client`` (they wait for
        every rank's registration, ``wait_timeout_s``)."""
        if source is None:
            raise errors.ConfigError(f"backend {BACKEND!r}: the trainer needs a WeightSource")
        if init_info.device not in ("cpu", "cuda"):
            raise errors.ConfigError(f"init_info.device must be 'cpu' or 'cuda', got {init_info.device!r}")
        if init_info.path not in PATHS:
            raise errors.ConfigError(f"init_info.path must be one of {', '.join(PATHS)}, got {init_info.path!r}")
        if not init_info.staging and not isinstance(source, ModuleSource):
            raise errors.ConfigError(f"backend {BACKEND!r}: staging=False registers the trainer's parameters "
                                     f"themselves, so it needs a ModuleSource, not a {type(source).__name__}")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if not init_info.registers:
            return engine
        cfg = _config(init_info.model, init_info.config)
        metas = source.metadata()
        if not metas:
            raise errors.LayoutMismatch(f"model={init_info.model}: the WeightSource declares no parameter")
        schema = [P.GlobalTensor(p.name, dtype_name(p.dtype), tuple(p.shape)) for p in metas]
        try:
            if init_info.world_size == 1 and init_info.staging:
                engine.part = RankPart.whole(schema, device=init_info.device)
            elif isinstance(source, ModuleSource):
                engine.module = source._module  # vLLM's ModuleSource keeps its module there
                engine.part = RankPart.of(engine.module.named_parameters(), schema, device=init_info.device,
                                          stage=init_info.staging)
            else:
                engine.part = RankPart.whole(schema, source.held_names(), device=init_info.device)
        except errors.LayoutMismatch as e:
            raise errors.LayoutMismatch(f"model={init_info.model} trainer rank {init_info.rank}: {e}") from None
        from tensorhub.ports import connect

        engine.port = connect(cfg, init_info.model)
        hub = tensorhub.open(init_info.model, replica=TRAINER_REPLICA,
                             shard=init_info.rank if init_info.world_size > 1 else 0, num_shards=init_info.world_size,
                             datacenter=init_info.datacenter or None, config=cfg, port=engine.port)
        try:
            # engines on the direct path reshard their slices from it
            hub.register(engine.part.buffers, placement=engine.part.placement)
            engine.hub = hub
            if engine.is_sender:
                client.init_weight_transfer_engine(dataclasses.asdict(TensorHubInitInfo(
                    model=init_info.model, config=dict(init_info.config), ray_address=_gcs_address(),
                    datacenter=init_info.datacenter, wait_timeout_s=init_info.wait_timeout_s,
                    stall_timeout_s=init_info.stall_timeout_s, path=init_info.path,
                    retains=init_info.engines_retain)))
        except BaseException:
            hub.close(drop_last_copy=True)
            raise
        return engine

    def send_weights(self, version: Optional[int] = None) -> int:
        """Publish this rank's part of what the source holds as ``version`` (None: the next one,
        :meth:`_next_version`, on which the ranks agree) and, on the sender, move every engine to it (start / update /
        finish through the client; the engines wait for the other ranks' parts). Returns the
        version. Every trainer rank calls it. With ``world_size`` 1 only the sender touches
        TensorHub and the others iterate the source. The source must yield the parameters of
        its metadata (``LayoutMismatch`` otherwise, nothing published: the engines keep the last
        version). An engine that dies or fails its update does not hold up the others
        (:func:`_update_engines`): they take the version and say so, then ``UpdateIncomplete``
        names the engines that did not (they keep their previous weights)."""
        if not self.info.registers:
            for _ in self.source:
                pass
            return -1
        hub = self.hub
        if hub is None:
            raise errors.InvalidState(f"model={self.info.model}: send_weights after shutdown")
        if hub.version is not None and not self.part.staged:
            raise errors.InvalidState(
                f"model={self.info.model} trainer rank {self.info.rank}: send_weights while version {hub.version} is "
                "still published from the parameters themselves (staging=False): call release() before the "
                "optimizer changes them; nothing was published")
        if version is None:
            version = self._next_version()
        if hub.version is not None:
            self.release()  # stop serving the last version before its bytes are overwritten
        try:
            self.part.fill(self.module.named_parameters() if self.module is not None else self.source)
        except errors.LayoutMismatch as e:
            raise errors.LayoutMismatch(f"model={self.info.model} trainer rank {self.info.rank}: {e}") from None
        hub.publish(version)
        self.version = version
        if not self.is_sender:
            return version
        failed = _update_engines(self.client, version)
        if failed:
            where, first = failed[0]
            raise errors.UpdateIncomplete(
                f"model={self.info.model}: version {version} is published but {len(failed)} engine(s) did not take it "
                f"({', '.join(w for w, _ in failed)}): {type(first).__name__}: {str(first)[:500]}") from first
        return version

    def release(self) -> None:
        """Stop serving the version published (its readers drain first; the last copy of a
        retained version moves to host memory unless a copy was made ahead): after it returns
        the registered tensors may change. With ``staging=False`` call it on every registering
        rank before the optimizer changes the parameters; with staging ``send_weights`` calls
        it. Idempotent; ``unpublish_s`` says how long it took."""
        hub = self.hub
        if hub is None or hub.version is None:
            return
        t0 = time.perf_counter()
        hub.unpublish()
        self.unpublish_s = time.perf_counter() - t0

    def _next_version(self) -> int:
        """One past the last version published here; at a rank's first ``send_weights``, one
        past the newest version the model has (a restarted trainer continues above what the
        engines hold), or the newer version another rank of the trainer publishes now (its
        peers are part way through publishing it: a rank restarted alone joins them instead of
        lagging behind them for good)."""
        if self.version is not None:
            return self.version + 1
        status = self.port.call(m.Query(model=self.info.model))
        view = next((v for v in status.models if v.model == self.info.model), None)
        known = [*(view.available if view else ()), *(view.committed if view else ())]
        nxt = max(known) + 1 if known else 0
        return max([nxt, *(p for v in status.models for p in v.publishing)])

    def shutdown(self) -> None:
        """Leave TensorHub; engines that hold the last version keep serving it to each other."""
        hub, self.hub = self.hub, None
        if hub is not None:
            try:
                hub.close()
            except errors.LastCopyHeld:
                hub.close(drop_last_copy=True)


def _update_engines(client: VLLMWeightSyncClient, version: int) -> list[tuple[str, BaseException]]:
    """start / update / finish ``version`` on every engine of ``client``; the engines that failed
    (which engine, its error). With vLLM's Ray client (``handles``) or :class:`LocalLLMClient`
    (:meth:`~LocalLLMClient.update_each`) each engine goes through the calls on its own (the Ray
    ones at once): one that dies or fails does not keep the others from finishing, and only those
    that took the version are finished with it (``get_weight_version`` then says the truth on
    each). Any other client (one engine, e.g. vLLM's HTTP client) is driven as one unit."""
    if isinstance(client, LocalLLMClient):
        return client.update_each(version)
    handles = getattr(client, "handles", None)
    if handles is None:
        try:
            client.start_weight_update()
        except Exception as e:  # noqa: BLE001 - the engine's error, whatever the client raises
            return [("the engine", e)]
        try:
            client.update_weights({"version": version})
        except Exception as e:  # noqa: BLE001
            end_failed_update(client.finish_weight_update)
            return [("the engine", e)]
        client.finish_weight_update(str(version))
        return []
    import ray
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    failed: list[tuple[str, BaseException]] = []
    live = list(enumerate(handles))
    for step in ("start", "update", "finish"):
        if step == "start":
            refs = [h.start_weight_update.remote() for _, h in live]
        elif step == "update":
            request = WeightTransferUpdateRequest(update_info={"version": version})
            refs = [h.update_weights.remote(request) for _, h in live]
        else:
            refs = [h.finish_weight_update.remote() for _, h in live]
        ok = []
        for (i, h), ref in zip(live, refs):
            try:
                ray.get(ref)
                ok.append((i, h))
            except Exception as err:  # noqa: BLE001 - a dead actor or the engine's error
                failed.append((f"engine {i}", err))
                if step == "update":
                    end_failed_update(lambda h=h: ray.get(h.finish_weight_update.remote(), timeout=60))
        live = ok
    for i, h in live:
        try:
            ray.get(h.update_weight_version.remote(str(version)))
        except Exception as err:  # noqa: BLE001
            failed.append((f"engine {i}", err))
    return failed


def _gcs_address() -> str:
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - not in a Ray job: the engines use RAY_ADDRESS or "auto"
        return ""


register()  # importing this module (e.g. for TensorHubTrainerInitInfo in a trainer that runs no engine) registers too
