"""What a handle's registration is checked against, before and after the server answers.

Pure helpers of :class:`~tensorhub.handle.hub.Hub` (``register``, ``prefetch(buffer=)``):

- :func:`layout_info`: the layout as the server sees it (``Register.layout``); its fingerprint
  ends with the handle's ``checksums`` setting, which every client of a model must share;
- :func:`like`: a second set of tensors (a double buffer, a prefetch buffer) must have the
  registered layout, and :func:`share_memory` must not find it inside the registered tensors
  (a prefetch would write the published tensors while readers fetch them);
- :func:`check_identity`: a handle's model, shard and replica names, checked when it is made
  (``ConfigError``; ``OutOfBounds`` as the server would raise it);
- :func:`check_placement`: a placement given to ``register`` is well formed, within the
  server's bounds and names the registered tensors (the server checks it again);
- :func:`explain_mismatch`: a layout the server refused that differs from the model's only in
  the ``checksums`` setting is a :class:`~tensorhub.errors.ConfigError` saying so (the server
  can only name a fingerprint).

Every refusal raises before anything is registered or changed.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import torch

from tensorhub import errors
from tensorhub.config import Config
from tensorhub.core import bounds
from tensorhub.core import messages as m
from tensorhub.core.placements import check_locals
from tensorhub.layout import Layout
from tensorhub.placement import Placement
from tensorhub.ports import ServerPort
from tensorhub.transport.storages import distinct_storages

NamedTensors = Union[Mapping[str, torch.Tensor], Sequence[tuple[str, torch.Tensor]]]

SUMS_TAG = {True: ":sums", False: ":nosums"}
"""The end of a registered layout's fingerprint: the handle's ``checksums`` setting, which every
client of a model must share (the server refuses a registration whose fingerprint differs)."""


def check_identity(model: str, shard: int, num_shards: int, replica: Optional[str],
                   datacenter: Optional[str]) -> None:
    """A handle's identity as ``tensorhub.open`` takes it: ``ConfigError`` for a missing model
    name, a shard out of range or a sharded replica without a name; ``OutOfBounds``
    (:mod:`tensorhub.core.bounds`) for a name or count the server would refuse."""
    if not isinstance(model, str) or not model:
        raise errors.ConfigError("model must be a non-empty string")
    if not isinstance(num_shards, int) or num_shards < 1 or not isinstance(shard, int) or not 0 <= shard < num_shards:
        raise errors.ConfigError(f"shard {shard!r} of {num_shards!r} is out of range")
    if num_shards > 1 and not replica:
        raise errors.ConfigError("a sharded replica needs replica=<name shared by its shards>")
    bounds.check_name("model", model)
    bounds.check_int("num_shards", num_shards, 1, bounds.SHARDS_MAX)
    if replica:
        bounds.check_name("replica", replica, max_chars=bounds.NAME_CHARS_MAX - bounds.REPLICA_SUFFIX_CHARS)
    if datacenter:
        bounds.check_name("datacenter", datacenter)


def check_placement(placement: object, info: m.LayoutInfo) -> Placement:
    """``placement`` as ``register(placement=)`` takes it: a :class:`~tensorhub.placement.Placement`
    (``ConfigError`` otherwise), within the bounds the server applies (``OutOfBounds``), well
    formed and naming exactly the layout's tensors, in order (``LayoutMismatch`` naming the
    tensor). Raises before anything is registered; the server checks all of it again."""
    if not isinstance(placement, Placement):
        raise errors.ConfigError(f"placement must be a tensorhub.placement.Placement, got {type(placement).__name__}")
    bounds.check_placement(placement)
    placement.check()
    check_locals(info, placement)
    return placement


def check_layout_key(key: object, placement: Optional[Placement]) -> None:
    """``layout_key`` as ``register`` takes it: "" or a name within the server's bounds
    (``OutOfBounds``), given only with a placement (``ConfigError``): it names a layout of
    placements. Raises before anything is registered; the server checks it again."""
    if key == "":
        return
    bounds.check_name("layout_key", key)
    if placement is None:
        raise errors.ConfigError("layout_key names a replica's layout of placements: give a placement too")


def named_list(named: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs as a list; a mapping, a sequence or a generator, read once."""
    return list(named.items()) if isinstance(named, Mapping) else list(named)


def layout_info(layout: Layout, checksums: bool = True) -> m.LayoutInfo:
    """The layout as a registration states it to the server."""
    return m.LayoutInfo(
        fingerprint=layout.fingerprint + ":" + layout.unit_signature[:16] + SUMS_TAG[bool(checksums)],
        unit_count=layout.unit_count,
        total_bytes=layout.total_bytes,
        tensors=tuple(m.TensorMeta(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in layout.metas),
    )


def like(named: NamedTensors, layout: Layout, config: Config, what: str) -> list[tuple[str, torch.Tensor]]:
    """``named`` as a list, if its layout is ``layout``'s (names, dtypes, shapes and order);
    ``LayoutMismatch`` naming ``what`` otherwise."""
    items = named_list(named)
    if layout_info(Layout.for_config(items, config)) != layout_info(layout):
        raise errors.LayoutMismatch(f"{what}: its layout differs from the registered tensors' (names, "
                                    "dtypes, shapes and order must match)")
    return items


def apart(named: NamedTensors, layout: Layout, config: Config, registered: Sequence[torch.Tensor],
          what: str) -> list[tuple[str, torch.Tensor]]:
    """:func:`like`, and sharing no memory with ``registered`` (``LayoutMismatch`` otherwise)."""
    items = like(named, layout, config, what)
    if share_memory([t for _, t in items], registered):
        raise errors.LayoutMismatch(f"{what}: shares memory with the registered tensors")
    return items


def share_memory(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether any tensor of ``a`` lies in memory under a tensor of ``b``: one storage, or two
    storages whose byte ranges overlap on one device (e.g. views made with ``from_blob``)."""
    spans = [(st.device, st.data_ptr(), st.data_ptr() + st.nbytes()) for st in distinct_storages(b).values()]
    for st in distinct_storages(a).values():
        lo, hi = st.data_ptr(), st.data_ptr() + st.nbytes()
        if any(dev == st.device and lo < end and start < hi for dev, start, end in spans):
            return True
    return False


def explain_mismatch(port: ServerPort, model: str, shard: int, checksums: bool, mine: m.LayoutInfo,
                     refused: errors.LayoutMismatch) -> None:
    """The server refused the layout ``mine``: if the model's layout for ``shard`` differs from
    it only in the ``checksums`` setting, raise ``ConfigError`` saying so. Else return:
    ``refused`` stands. Costs one query, on this failure path only."""
    try:
        status = port.call(m.Query(model=model, layouts=True))
    except errors.TensorHubError:
        return
    if not isinstance(status, m.Status):
        return
    view = next((v for v in status.models if v.model == model), None)
    known = next((sl.layout for sl in (view.layouts if view is not None else ()) if sl.shard == shard), None)
    if known is None:
        return
    if known.fingerprint == mine.fingerprint.removesuffix(SUMS_TAG[checksums]) + SUMS_TAG[not checksums]:
        raise errors.ConfigError(
            f"model={model} shard={shard}: this handle runs with checksums={checksums}, the model's "
            f"other clients with checksums={not checksums}; every client of a model must use the same setting "
            f"(Config.checksums, TENSORHUB_CHECKSUMS)") from refused
