"""What Ray knows about dead clients: the process that runs a handle, and whether it is gone.

A client registers its :class:`~tensorhub.core.messages.ProcessId` (job, actor, worker, node).
The reference server asks Ray's GCS whether those processes are gone, so that a holder whose job
ended (its driver exited and took its actors along) stops being a source within a second instead
of a lease (``lease_timeout_s``), and a reader does not burn its failover budget on corpses.

Rules (a process is *gone* when):
- it runs an actor and Ray reports that actor ``DEAD`` or ``RESTARTING``, or alive with another
  pid (it restarted: the handle and its registered memory died with the old process);
- it runs no actor (a driver, a task) and its job is dead.

A sweep (:meth:`RayLiveness.gone`) costs one GCS call for the job table plus one per actor
process of a dead job (detached actors outlive their job); a targeted check of named clients
(:meth:`RayLiveness.gone` with ``targeted``: a reader's reported source, and every client whose
pulse is overdue) also asks for each named actor process, once however many handles it hosts. Errors talking to
the GCS mean "not known to be gone" (the lease still catches the client).
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping

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
                    seen[key] = self._actor_gone(p)
                why = seen[key]
                if why:
                    out[cid] = why
            elif not p.actor_id and job_dead:
                out[cid] = f"its job {p.job_id} ended"
        return out

    @staticmethod
    def _actor_gone(p: ProcessId) -> str:
        from ray._private.state import state

        try:
            info = state.actor_table(p.actor_id)
        except Exception:  # noqa: BLE001
            log.warning("cannot read Ray's actor table for %s", p.actor_id, exc_info=True)
            return ""
        if not info:
            return ""
        st = info.get("State")
        if st in ("DEAD", "RESTARTING"):
            return f"its actor {p.actor_id[:12]} is {st.lower()}"
        if p.pid and info.get("Pid") and int(info["Pid"]) != p.pid:
            return f"its actor {p.actor_id[:12]} restarted (pid {p.pid} -> {info['Pid']})"
        return ""
