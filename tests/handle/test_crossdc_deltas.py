"""Seeds as deltas with real handles against an in-process server (LocalPort, NIXL in one
process): ``Config.seed_deltas``.

    trainer (dc a): publish v -> delta(v-1 -> v) offered
    b0 (dc b, the seeder): SeedAhead(v), staging copy holds v-1 -> reads the delta, rebuilds v
    b1 (dc b): reads v from b0's staging copy, as without deltas

Every case compares bytes: a delta that meets the wrong base, damaged bytes, or no offer at all
falls back to the full seed and the staging copy holds exactly the trainer's version.
"""

from __future__ import annotations

import pytest

from tensorhub.config import Config
from tensorhub.handle import deltas as hd
from tensorhub.ports import LocalPort
from tensorhub.testing import inproc, workload
from tests.handle.test_crossdc import _staged, _wait

CFG = Config(unit_bytes=64 << 10, heartbeat_interval_s=0.1, lease_timeout_s=5.0, source_stall_timeout_s=2.0,
             same_host=False, versions_retained=3, seed_deltas=True)
SPEC = workload.small_spec(2 << 20, big=2, tiny=12, dtype="bfloat16")
DENSITY = 0.043


@pytest.fixture
def port():
    return LocalPort(CFG)


def _hub(port, dc, config=CFG, **kw):
    return inproc.open_hub(port, config=config, spec=SPEC, datacenter=dc, **kw)




def _step(trainer, tt, version):
    """The trainer's RL step: the previous version changed at the measured density."""
    trainer.unpublish()
    workload.evolve_version(tt, version, DENSITY)
    trainer.publish(version)


def _seeded(port, *, trainer_config=CFG):
    """Version 1 seeded into dc b (in full: b0's staging copy held nothing before)."""
    trainer, tt = _hub(port, "a", config=trainer_config, replica="trainer")
    b0, b0t = _hub(port, "b", replica="b0")
    inproc.publish(trainer, tt, 1)
    _wait(lambda: _staged(b0, 1))
    assert b0.update("latest").prefetched
    return trainer, tt, b0, b0t


def _close(*hubs):
    for h in hubs:
        h.close(drop_last_copy=True)


def test_the_next_seed_crosses_as_a_delta_and_the_datacenter_reads_the_exact_version(port, monkeypatch):
    from tensorhub import transport as tx

    real_pull, pulls = tx.pull, []

    def pull(region, source, layout, **kw):  # every NIXL read: (version, what it read, into what)
        pulls.append((kw["expect_version"], layout.names, region))
        return real_pull(region, source, layout, **kw)

    monkeypatch.setattr(tx, "pull", pull)
    trainer, tt, b0, b0t = _seeded(port)
    seeds = b0._staging.seeds
    assert seeds.applied == []  # version 1: no base there yet, the full seed
    b1, b1t = _hub(port, "b", replica="b1")
    _step(trainer, tt, 2)
    _wait(lambda: _staged(b0, 2))
    assert [(v, base) for v, base, _ in seeds.applied] == [(2, 1)] and seeds.fallbacks == []
    # Only the delta crossed: the reads of b0's seeder. b1 may already have prefetched version
    # 2 inside dc b, from b0's staging copy (CI saw it once the pulse brought its note at once).
    b1_regions = [h._memory.region for h in (b1, b1.staging) if h is not None]
    assert [names for v, names, into in pulls if v == 2 and not any(into is r for r in b1_regions)] == [("delta",)]
    nbytes = seeds.applied[0][2]
    shard = workload.spec_bytes(SPEC)
    assert nbytes < 0.15 * shard, nbytes / shard
    assert trainer._offers.offered[-1] == (2, 1, nbytes)
    assert workload.digest(b0.staging.tensors and [t for _, t in b0.staging.tensors]) == workload.digest(tt)
    up = b0.update("latest")
    assert up.version == 2 and up.prefetched and workload.digest(b0t) == workload.digest(tt)
    st = b1.update("latest")
    assert st.version == 2 and not st.cross_datacenter and workload.digest(b1t) == workload.digest(tt)
    _step(trainer, tt, 3)  # and the next one, against 2
    _wait(lambda: _staged(b0, 3))
    assert [v for v, _, _ in seeds.applied] == [2, 3]
    assert b0.update("latest").version == 3 and workload.digest(b0t) == workload.digest(tt)
    _close(b1, b0, trainer)


def test_a_delta_against_the_wrong_base_falls_back_to_the_full_seed(port, monkeypatch):
    """The trainer's copy of version 1 is not what dc b holds (its host copy went bad): the
    seeder's rebuild refuses the delta before writing, and the full seed crosses."""
    trainer, tt, b0, b0t = _seeded(port)
    offers = trainer._offers
    _wait(lambda: offers._prev_version == 1)
    offers._prev[0].view(-1)[:8].add_(1)  # the base the next delta is computed against
    _step(trainer, tt, 2)
    _wait(lambda: _staged(b0, 2))
    seeds = b0._staging.seeds
    assert seeds.applied == [] and [v for v, _ in seeds.fallbacks] == [2]
    assert "DeltaWrongBase" in seeds.fallbacks[0][1]
    assert b0.update("latest").version == 2 and workload.digest(b0t) == workload.digest(tt)
    _close(b0, trainer)


def test_damaged_delta_bytes_fall_back_to_the_full_seed(port, monkeypatch):
    real = hd.delta.encode

    def damaged(base, new, codec=0):
        buf = bytearray(real(base, new, codec))
        buf[-1] ^= 0x40  # damaged before its buffer's checksums: only the payload's own catches it
        return bytes(buf)

    trainer, tt, b0, b0t = _seeded(port)
    monkeypatch.setattr(hd.delta, "encode", damaged)
    _step(trainer, tt, 2)
    _wait(lambda: _staged(b0, 2))
    seeds = b0._staging.seeds
    assert seeds.applied == [] and "DeltaRejected" in seeds.fallbacks[0][1]
    assert b0.update("latest").version == 2 and workload.digest(b0t) == workload.digest(tt)
    _close(b0, trainer)


def test_no_delta_offered_is_the_full_seed(port):
    """A trainer without deltas: the seeder asks, finds none, and takes the full seed."""
    trainer, tt, b0, b0t = _seeded(port, trainer_config=CFG.replace(seed_deltas=False))
    _step(trainer, tt, 2)
    _wait(lambda: _staged(b0, 2))
    seeds = b0._staging.seeds
    assert seeds.applied == [] and "VersionNotFound" in seeds.fallbacks[0][1]
    assert b0.update("latest").version == 2 and workload.digest(b0t) == workload.digest(tt)
    _close(b0, trainer)
