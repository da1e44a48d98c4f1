"""Every source kind and every tier has the interface tensorhub/transport/base.py states: real
instances of the three source kinds (one process, its own NIXL agent), and the signatures of the
two pull functions. A kind or tier that drifts from the declared interface fails here."""

from __future__ import annotations

import inspect

import pytest
import torch

from tensorhub.config import Config
from tensorhub.layout import Layout, checksum_all
from tensorhub.transport import Agent, Region, base, decode_endpoint, encode_endpoint, open_source, reader, shm

CFG = Config(unit_bytes=64 << 10, pack_below_bytes=16 << 10, source_stall_timeout_s=2.0)


@pytest.fixture(scope="module")
def holder():
    agent = Agent(CFG, name="test-interfaces-agent")
    named = [("w", torch.randn(40_000)), ("b", torch.randn(100))]
    layout = Layout.build(named, CFG.unit_bytes, CFG.pack_below_bytes)
    tensors = [t for _, t in named]
    region = Region.register(tensors, layout, CFG, agent=agent)
    region.publish_complete(3, checksum_all(tensors, layout))
    yield agent, layout, region
    region.close()


def test_each_source_kind_is_a_source_and_the_near_ones_are_near(holder):
    agent, layout, region = holder
    endpoint = encode_endpoint(region.endpoint())
    remote = open_source(endpoint, config=CFG, agent=agent)
    mapped = shm.ShmSource(decode_endpoint(endpoint).shm)
    local = shm.LocalSource(region, "own-staging")
    try:
        for src in (remote, mapped, local):
            assert isinstance(src, base.Source), type(src)
            assert isinstance(src.name, str) and src.name
        for src in (mapped, local):
            assert isinstance(src, base.NearSource), type(src)
            assert src.still_same() and src.alive()
            assert bytes(src.piece(0, 0, 16).numpy()) == bytes(region.tensors[0].view(torch.uint8)[:16].numpy())
        assert not isinstance(remote, base.NearSource), "a NIXL source is read by READs, not copies"
    finally:
        remote.close()
        mapped.close()


@pytest.mark.parametrize("tier", [reader.pull, shm.pull], ids=["nixl", "same_host"])
def test_each_tier_takes_the_declared_pull_parameters(tier):
    declared = {n: p for n, p in inspect.signature(base.Pull.__call__).parameters.items() if n != "self"}
    actual = inspect.signature(tier).parameters
    positional = [n for n, p in declared.items() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    first = list(actual.values())[:len(positional)]
    assert all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in first), first
    for name, p in declared.items():
        if name in positional:
            continue
        assert name in actual, f"{tier.__module__}.pull lacks {name}"
        assert actual[name].kind == p.kind, (name, actual[name].kind, p.kind)
        assert actual[name].default == p.default, (name, actual[name].default, p.default)
    extra = [n for n, p in list(actual.items())[len(positional):]
             if n not in declared and p.default is inspect.Parameter.empty]
    assert not extra, f"{tier.__module__}.pull requires parameters the interface does not declare: {extra}"
