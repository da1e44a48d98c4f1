"""The simulated reference server: a ReferenceCore driven in virtual time.

Requests are applied when they arrive; replies and effects travel back over the network.
The server ticks every ``server_tick_s``. A crash loses all state and every message in
flight to or from it (the connections break: the epoch changes); a restart is a fresh core.
"""

from __future__ import annotations

from typing import Callable, Optional

from tensorhub.config import Config
from tensorhub.core import messages as m
from tensorhub.core.reference import ReferenceCore

CoreFactory = Callable[[Config], ReferenceCore]

NAME = "server"


class SimServer:
    def __init__(self, world, core_factory: Optional[CoreFactory] = None) -> None:
        self.world = world
        self.core_factory: CoreFactory = core_factory or ReferenceCore
        self.epoch = 0
        self.up = True
        self.core: Optional[ReferenceCore] = self.core_factory(world.config)
        self.requests = 0
        world.sim.after(world.config.server_tick_s, self._tick)

    # ------------------------------------------------------------------ faults

    def crash(self) -> None:
        self.world.sim.trace("server CRASH")
        self.up = False
        self.core = None
        self.epoch += 1

    def restart(self) -> None:
        self.world.sim.trace("server RESTART")
        self.up = True
        self.epoch += 1
        self.core = self.core_factory(self.world.config)

    def declare_dead(self, cid: str) -> None:
        """The cluster manager (Ray, in production) reports client ``cid``'s process gone."""
        if not self.up:
            return
        effects = self.core.declare_dead([cid], self.world.sim.now, "process gone")
        self.world.sim.trace(f"srv declare_dead {cid}")
        if effects:
            self.world.checker.on_server(None, None, None, effects, self.epoch)
            self._emit(effects)

    # ------------------------------------------------------------------ requests

    def send(self, client, req: m.Request, session: int, ctx: bool) -> None:
        """Client -> server. ``ctx``: the client wants the reply routed to ``on_reply``."""
        if not self.up:
            return
        self.world.net.send(client.cid, NAME, self._arrive, client, req, session, ctx, self.epoch)

    def _arrive(self, client, req: m.Request, session: int, ctx: bool, epoch: int) -> None:
        sim = self.world.sim
        if not self.up or epoch != self.epoch:
            return
        self.requests += 1
        reply, effects = self.core.handle(req, sim.now)
        sim.trace(f"srv {client.cid} {req!r} -> {reply!r}")
        self.world.checker.on_server(client.cid, req, reply, effects, self.epoch)
        self.world.net.send(NAME, client.cid, self._reply, client, req, reply, session, self.epoch)
        self._emit(effects)

    def _emit(self, effects: list[m.Deliver]) -> None:
        for eff in effects:
            self.world.sim.trace(f"evt {eff.client_id} {eff.event!r}")
            self.world.net.send(NAME, eff.client_id, self._event, eff.client_id, eff.event, self.epoch)

    def _reply(self, client, req, reply, session, epoch) -> None:
        if epoch == self.epoch and client.alive:
            client.on_reply(req, reply, session)

    def _event(self, client_id: str, event, epoch: int) -> None:
        if epoch != self.epoch:
            return
        client = self.world.clients.get(client_id)
        if client is not None and client.alive:
            client.on_event(event)

    def _tick(self) -> None:
        if self.up:
            effects = self.core.tick(self.world.sim.now)
            if effects:
                self.world.checker.on_server(None, None, None, effects, self.epoch)
                self._emit(effects)
        self.world.sim.after(self.world.config.server_tick_s, self._tick)

    def status(self, model: str = "") -> Optional[m.Status]:
        return self.core.status(model) if self.up else None
