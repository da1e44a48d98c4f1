"""What Ray knows about dead clients: the process that runs a handle, and whether it is gone.

A client registers its :class:`~tensorhub.core.messages.ProcessId` (job, actor, worker, node).
The reference server asks Ray's GCS whether those processes are gone, so that a holder whose job
ended (its driver exited and took its actors along) stops being a source within a second instead
of a lease (``lease_timeout_s``), and a reader does not burn its failover budget on corpses.

Rules (a process is *gone* when):
- it runs an actor and Ray reports that actor ``DEAD`` or ``RESTARTING``, or alive with another
  pid (it restarted: the handle and its registered memory died with the old process), or the
  actor is not detached and its job is dead (Ray kills it with the job);
- it runs no actor (a driver, a task) and its job is dead.

A sweep (:meth:`RayLiveness.gone`) costs one GCS call for the job table plus one per actor
process of a dead job (detached actors outlive their job); a targeted check of named clients
(:meth:`RayLiveness.gone` with ``targeted``: a reader's reported source, and every client whose
pulse is overdue) also asks for each named actor process, once however many handles it hosts. Errors talking to
the GCS mean "not known to be gone" (the lease still catches the client).

Pushed deaths (:class:`DeathWatch`): the server also subscribes to the GCS's worker-failure,
node and job channels, so a client whose worker process exits (killed, crashed, its actor killed) or
whose node dies is removed within milliseconds of Ray learning it, whatever the heartbeat
interval or pulse hold: liveness does not rest on a client's silence. A job that ends has its
clients checked at once (the sweep's rules: a non-actor process of a dead job is gone, an
actor is looked up, since a detached one outlives its job).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable, Mapping

from tensorhub.core.messages import ProcessId

log = logging.getLogger(__name__)


def current_process() -> ProcessId:
    """The :class:`ProcessId` of the calling process (empty fields outside a Ray process)."""
    import os

    try:
        import ray

        if not ray.is_initialized():
            return ProcessId(pid=os.getpid())
        ctx = ray.get_runtime_context()
        return ProcessId(job_id=ctx.get_job_id() or "", actor_id=ctx.get_actor_id() or "",
                         worker_id=ctx.get_worker_id() or "", node_id=ctx.get_node_id() or "",
                         pid=os.getpid())
    except Exception:  # noqa: BLE001 - identity is an optimisation; leases still work without it
        log.debug("no Ray identity", exc_info=True)
        return ProcessId(pid=os.getpid())


class RayLiveness:
    """Queries Ray's GCS (blocking calls: run them off the event loop)."""

    def gone(self, processes: Mapping[str, ProcessId], targeted: Iterable[str] = ()) -> dict[str, str]:
        """Client ids (of ``processes``) whose process is gone, with the reason. Clients in
        ``targeted`` are checked one by one (their actor too, even if their job is alive); the
        others only against the job table."""
        from ray._private.state import state

        targeted = set(targeted)
        try:
            dead_jobs = {j["JobID"] for j in state.job_table() if j["IsDead"]}
        except Exception:  # noqa: BLE001
            log.warning("cannot read Ray's job table", exc_info=True)
            return {}
        out: dict[str, str] = {}
        seen: dict[tuple[str, int], str] = {}  # one lookup per actor process, however many handles
        for cid, p in processes.items():
            if not p.job_id:
                continue  # not a Ray process: only the lease can tell
            job_dead = p.job_id in dead_jobs
            if p.actor_id and (job_dead or cid in targeted):
                key = (p.actor_id, p.pid)
                if key not in seen:
                    seen[key] = self._actor_gone(p, job_dead)
                why = seen[key]
                if why:
                    out[cid] = why
            elif not p.actor_id and job_dead:
                out[cid] = f"its job {p.job_id} ended"
        return out

    @staticmethod
    def _actor_gone(p: ProcessId, job_dead: bool = False) -> str:
        from ray._private.state import state

        try:
            info = state.actor_table(p.actor_id)
        except Exception:  # noqa: BLE001
            log.warning("cannot read Ray's actor table for %s", p.actor_id, exc_info=True)
            return ""
        if not info:
            return ""
        if job_dead and info.get("IsDetached") is False:
            return f"its actor {p.actor_id[:12]} died with its job {p.job_id}"  # not yet marked DEAD
        st = info.get("State")
        if st in ("DEAD", "RESTARTING"):
            return f"its actor {p.actor_id[:12]} is {st.lower()}"
        if p.pid and info.get("Pid") and int(info["Pid"]) != p.pid:
            return f"its actor {p.actor_id[:12]} restarted (pid {p.pid} -> {info['Pid']})"
        return ""


class DeathWatch:
    """Ray's pushed deaths (GCS pubsub: the worker-failure, node-info and job channels), handed
    to ``on_deaths(worker_ids, node_ids)`` and ``on_jobs_ended(job_ids)`` (hex ids, as :class:`ProcessId` holds them) on the
    server's event loop. Deaths from before the subscription are not replayed: the sweep
    (:class:`RayLiveness`) and the lease cover them. Runs until cancelled; a GCS error is logged
    and the subscription retried.

    A death wave is handed over in one call: the deaths of every batch that arrives on either
    channel before the loop runs its next callback (a node's death and its workers' exits, a
    poll of up to 1,000 worker exits) are collected and passed to one ``on_deaths``, so the
    server removes them in one pass (``ReferenceCore.declare_gone``)."""

    def __init__(self, on_deaths: Callable[[set, set], None], on_jobs_ended: Callable[[set], None] = lambda jobs: None) -> None:
        self.on_deaths = on_deaths
        self.on_jobs_ended = on_jobs_ended
        """Jobs Ray reports finished (hex ids): their clients are checked at once."""
        self._workers_dead: set[str] = set()
        self._nodes_dead: set[str] = set()
        self._flush_soon = False

    async def run(self) -> None:
        try:
            import ray
            from ray._private.gcs_pubsub import (GcsAioJobSubscriber, GcsAioNodeInfoSubscriber,
                                                 GcsAioWorkerDeltaSubscriber)
            from ray.core.generated import gcs_pb2

            address = ray.get_runtime_context().gcs_address
        except Exception:  # noqa: BLE001 - not in a Ray worker, or a Ray without the channels
            log.warning("no pushed deaths from Ray: the sweep and leases alone find dead clients", exc_info=True)
            return
        await asyncio.gather(self._follow(lambda: GcsAioWorkerDeltaSubscriber(address=address), self._workers),
                             self._follow(lambda: GcsAioNodeInfoSubscriber(address=address),
                                          lambda batch: self._nodes(batch, gcs_pb2.GcsNodeInfo.DEAD)),
                             self._follow(lambda: GcsAioJobSubscriber(address=address), self._jobs))

    def _jobs(self, batch) -> None:
        ended = {job.job_id.hex() for _, job in batch if job.is_dead}
        if ended:
            self.on_jobs_ended(ended)

    def _workers(self, batch) -> None:
        self._pushed({delta.worker_id.hex() for _, delta in batch}, set())

    def _nodes(self, batch, dead) -> None:
        self._pushed(set(), {info.node_id.hex() for _, info in batch if info.state == dead})

    def _pushed(self, workers: set[str], nodes: set[str]) -> None:
        """Collect deaths; one ``on_deaths`` for all collected by the loop's next callback."""
        if not workers and not nodes:
            return
        self._workers_dead |= workers
        self._nodes_dead |= nodes
        if self._flush_soon:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside an event loop: nothing else can arrive meanwhile
            self._flush()
            return
        self._flush_soon = True
        loop.call_soon(self._flush)

    def _flush(self) -> None:
        workers, nodes = self._workers_dead, self._nodes_dead
        self._workers_dead, self._nodes_dead, self._flush_soon = set(), set(), False
        try:
            self.on_deaths(workers, nodes)
        except Exception:  # noqa: BLE001 - a bad batch must not stop later ones; leases remain
            log.exception("handling %d pushed worker and %d node deaths failed", len(workers), len(nodes))

    @staticmethod
    async def _follow(make, handle) -> None:
        delay = 0.5
        while True:
            try:
                sub = make()
                await sub.subscribe()
                delay = 0.5
                while True:
                    batch = await sub.poll(batch_size=1000)
                    if batch:
                        handle(batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the GCS restarted or is slow: subscribe again
                log.warning("Ray death subscription failed; retrying in %.1f s", delay, exc_info=True)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
