"""A handle that registers a placement (``Hub.register(placement=)``, issue 24 stage 2b), against
an in-process server (LocalPort): what the handle checks before it registers anything, what the
server then knows, and the coverage refusal at publish.

    trainer, 2 shards, rows split:   shard 0 = w[0:8], b[0:8]    shard 1 = w[8:16], b[8:16]
    reader replica, same placement:  reads whole shards (another layout reshards:
                                     tests/handle/test_reshard_handle.py)
"""

from __future__ import annotations

import pytest
import torch

import tensorhub
from tensorhub import errors
from tensorhub import placement as P
from tensorhub.core import messages as m
from tensorhub.ports import LocalPort
from tensorhub.testing import inproc

CFG = inproc.CONFIG
SCHEMA = P.Schema.of([P.GlobalTensor("w", "float32", (16, 4)), P.GlobalTensor("b", "float32", (16,))])
G = SCHEMA.by_name()


@pytest.fixture
def port():
    return LocalPort(CFG)


def _rows(rank: int, count: int = 2) -> P.Placement:
    return P.Placement.build([P.split(G["w"], 0, rank, count), P.split(G["b"], 0, rank, count)], SCHEMA)


def _tensors(rows: int, fill: float) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.full((rows, 4), fill)), ("b", torch.full((rows,), fill))]


def _open(port, replica, shard, placement, fill=0.0):
    hub = tensorhub.open("m", port=port, config=CFG, replica=replica, shard=shard, num_shards=2)
    named = _tensors(8, fill)
    hub.register(named, placement=placement)
    return hub, named


def _view(port) -> m.ModelView:
    """The operator's view of model m (every holder, the placements in use)."""
    with port._lock:
        return next(v for v in port.core.status("m").models)


def _clients(port) -> int:
    with port._lock:
        return len(port.core.nodes)


def test_a_sharded_replica_with_placements_publishes_and_a_reader_of_the_same_placement_reads_it(port):
    trainers = [_open(port, "trainer", k, _rows(k), fill=float(k + 1)) for k in range(2)]
    readers = [_open(port, "rollout", k, _rows(k)) for k in range(2)]
    for hub, _ in trainers:
        hub.publish(1)
    for k, (hub, named) in enumerate(readers):
        assert hub.replicate("latest").version == 1
        assert all(bool((t == float(k + 1)).all()) for _, t in named)
    uses = {u.digest: u.nodes for u in _view(port).placements}
    assert uses == {_rows(0).digest(): 2, _rows(1).digest(): 2}, "one copy per distinct placement"
    for hub, _ in readers + trainers:
        hub.close(drop_last_copy=True)
    with port._lock:
        assert not port.core.placements.view("m"), "the last client gone, no placement kept"


@pytest.mark.parametrize("bad, error, says", [
    ("not a placement", errors.ConfigError, "must be a tensorhub.placement.Placement"),
    (P.Placement.build([P.split(G["b"], 0, 0, 2), P.split(G["w"], 0, 0, 2)], SCHEMA), errors.LayoutMismatch,
     "tensor #0 is w"),
    (P.Placement.build([P.split(G["w"], 0, 0, 2)], SCHEMA), errors.LayoutMismatch, "1 local tensors, the layout 2"),
])
def test_a_placement_that_does_not_fit_the_tensors_is_refused_before_anything_is_registered(port, bad, error, says):
    hub = tensorhub.open("m", port=port, config=CFG, replica="r", shard=0, num_shards=2)
    with pytest.raises(error, match=says):
        hub.register(_tensors(8, 0.0), placement=bad)
    assert hub.state is tensorhub.HubState.OPEN and hub._memory.region is None
    assert _clients(port) == 0
    hub.register(_tensors(8, 0.0), placement=_rows(0))  # the handle is still usable
    hub.close(drop_last_copy=True)


def test_a_replica_whose_shards_leave_rows_uncovered_cannot_publish(port):
    """Both shards hold rows 0:8: rows 8:16 of w and b are nobody's, so version 1 must not commit."""
    shards = [_open(port, "trainer", k, _rows(0)) for k in range(2)]
    with pytest.raises(errors.LayoutMismatch, match=r"uncovered: .*w \[8:16"):
        shards[0][0].publish(1)
    assert shards[0][0].version is None and shards[0][0].state is tensorhub.HubState.IDLE
    assert _view(port).available == () and _view(port).committed == ()
    for hub, _ in shards:
        hub.close(drop_last_copy=True)
