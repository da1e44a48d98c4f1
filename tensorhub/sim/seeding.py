"""Offload seeding in the simulator: a rollout that acts on ``SeedAhead`` as the real handle does.

:class:`SeedingClient` does what ``Hub._seed_asked`` / ``Hub.prefetch`` do: open a staging
handle on the same host (replica ``<replica>~prefetch``, ``stage_for`` the handle) and
``replicate`` it to the version in the background, one prefetch at a time, the newest asked
next. The staging handle lives in its owner's process: a crash takes both
(``World.crash``). Used by the fault-injecting scenarios of the ``crossdc`` workload and by the
paper what-if (:mod:`tensorhub.sim.whatif_paper`).

A user's ``Hub.prefetch("latest")`` is the same staging read, asked by the user instead of a
``SeedAhead`` (:meth:`SeedingClient.prefetch`): the staging copy counts its own rounds, and
the owner's next ``update()`` is assigned its staging copy first (the scheduler's rule 2),
behind it if it is still arriving.
"""

from __future__ import annotations

from typing import Optional

import msgspec

from tensorhub.core import messages as m
from tensorhub.sim.client import SimClient


def seed_round(version: int) -> int:
    """``tensorhub.client._seed_round``: a seed of ``version`` is the staging copy's round
    ``version + 1``, whichever seeds each shard skipped (a count would put the shards of a
    replica in different rounds for good); a user prefetch lets the staging copy count."""
    return version + 1


class StagingClient(SimClient):
    """A prefetch staging handle (``Hub._open_stage``): a holder of its own in host memory on
    its owner's host; the owner reads from it first."""

    def __init__(self, world, cid: str, *, stage_for: str, **kw) -> None:
        self.stage_for = stage_for
        super().__init__(world, cid, **kw)
        self.machine.incomplete_wait_s = world.config.lease_timeout_s  # Hub._open_stage

    def registration(self) -> m.Register:
        return msgspec.structs.replace(super().registration(), stage_for=self.stage_for)


class SeedingClient(SimClient):
    """A rollout shard that acts on ``SeedAhead`` as ``Hub._seed_asked`` does: prefetch the
    version into its staging copy in the background (one prefetch at a time, newest wins)."""

    def __init__(self, world, cid: str, *, staging_own_nic: bool = False, **kw) -> None:
        self.staging_own_nic = staging_own_nic
        """Put the staging copy on a host of its own (a NIC of its own, not the seeder's)."""
        self.stage: Optional[StagingClient] = None
        self.seeding = -1
        self.seed_next: Optional[int] = None
        self.seeds: list[tuple[int, float, float, str]] = []
        """(version, asked at, done at, code) of every prefetch."""
        self.user_prefetches = 0
        self.stages_opened = 0
        super().__init__(world, cid, **kw)

    def _notes(self, notes: list) -> None:
        for note in notes:
            if isinstance(note, m.SeedAhead):
                self._seed_asked(note.version)
        super()._notes([n for n in notes if not isinstance(n, m.SeedAhead)])

    def _seed_asked(self, version: int) -> None:
        if not self.alive or (self.published is not None and self.published >= version) or self.seeding >= version:
            return
        st = self.stage
        if st is not None and st.published is not None and st.published >= version:
            return
        if st is not None and st.machine.seq >= seed_round(version):
            return  # Hub: the staging copy's rounds are past this seed's (prefetch() counted ahead)
        self.seeding = version
        if st is not None and st.op is not None:
            self.seed_next = version  # Hub: prefetches run one after the other
            return
        self._prefetch(version)

    def _prefetch(self, version) -> None:
        """Read ``version`` (or ``"latest"``) into the staging copy, opened on first use."""
        w, asked = self.world, self.world.sim.now
        if self.stage is None:
            # A client id of its own (the Hub's are unique): a restarted process's staging copy
            # must not be taken for its dead predecessor's, which the server may still list.
            cid = self.cid.replace("/", "~prefetch/", 1) + (f"-{self.stages_opened}" if self.stages_opened else "")
            self.stages_opened += 1
            # Host memory of the seeder's process: behind the seeder's NIC, unless the what-if
            # gives host memory a NIC of its own (one of a node's other RDMA NICs).
            host = w.add_host(self.dc) if self.staging_own_nic else self.host
            self.stage = StagingClient(w, cid, stage_for=self.cid, replica_id=f"{self.replica_id}~prefetch",
                                       shard=self.shard, num_shards=self.num_shards, host=host, dc=self.dc,
                                       spot=self.spot, role="staging")
            w.clients[cid] = self.stage
            self.stage.register(lambda code, _v: self._stage_registered(code, version, asked))
        else:
            self._stage_read(version, asked)

    def _stage_registered(self, code: str, version, asked: float) -> None:
        if code == "ok":
            self._stage_read(version, asked)
        elif self.stage is not None and self.stage.op is None:
            # Hub._open_stage: a staging handle whose register() raised is dropped (the next
            # prefetch opens another); the server lets a registration it got expire.
            self.stage.retire()
            self.stage = None

    def prefetch(self) -> bool:
        """The user's ``Hub.prefetch("latest")``, called only once the previous one is done (a
        user that waits on its future); False if the handle cannot prefetch now."""
        st = self.stage
        if not self.alive or not self.registered or (st is not None and st.op is not None):
            return False
        self.user_prefetches += 1
        self._prefetch("latest")
        return True

    def _stage_read(self, spec, asked: float) -> None:
        def done(code: str, v: int) -> None:
            version = v if spec == "latest" else spec
            self.seeds.append((version, asked, self.world.sim.now, code))
            nxt, self.seed_next = self.seed_next, None
            if nxt is not None and nxt > version:
                self._prefetch(nxt)
        self.stage.replicate(spec, True, done, round=seed_round(spec) if isinstance(spec, int) else None)
