"""The process's NIXL agent, and the rules for calling into one.

One NIXL agent per process (:func:`get_agent`), built with the project's progress-delay patch
(:func:`_new_nixl_agent`: the wrapper's progress thread otherwise spins a core) and
``NIXL_THREAD_SYNC_RW``. A NIXL agent is not thread-safe for transfers, so every transfer call
into one :class:`Agent` is made under its ``xfer_lock``; a pull lets go of the lock while it
sleeps (:func:`sleep_unlocked`), so two pulls of one process interleave.

A posted READ is released only once NIXL reports it terminal (:func:`is_terminal`,
:func:`await_terminal`): releasing one in progress does not stop it (see
:mod:`tensorhub.transport.nixl`).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
import uuid
from typing import Any, Optional

from tensorhub.config import Config
from tensorhub.errors import TransferError
from tensorhub.transport.follow import Inbox

logger = logging.getLogger(__name__)

__all__ = ["Agent", "get_agent"]

@contextlib.contextmanager
def unlocked(lock: threading.RLock):
    """Let go of ``lock`` (an agent's ``xfer_lock``, held by this thread) for the block, so
    another thread's pull on the same agent makes progress while this one waits. A thread that
    holds it more than once keeps it (only one level is let go): correct, merely serial."""
    lock.release()
    try:
        yield
    finally:
        lock.acquire()


def sleep_unlocked(lock: threading.RLock, seconds: float) -> None:
    """Sleep without holding ``lock`` (see :func:`unlocked`)."""
    with unlocked(lock):
        time.sleep(seconds)


class XferState(str, enum.Enum):
    """What NIXL's ``transfer`` / ``check_xfer_state`` return (plain strings on the wire)."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"

POLL_FIRST_S = 50e-6
"""First pause between looks at a posted transfer; it doubles up to :data:`POLL_MAX_S`."""
POLL_MAX_S = 2e-3


def is_terminal(nx: Any, handle: Any) -> bool:
    """Whether NIXL reports the transfer done or failed. A state that cannot be read is not
    terminal (nothing is known about the bytes)."""
    try:
        return nx.check_xfer_state(handle) != XferState.PROC
    except Exception:  # noqa: BLE001 - unknown state: keep the handle
        logger.debug("check_xfer_state failed", exc_info=True)
        return False


def release_terminal(nx: Any, handles: dict[Any, Any]) -> None:
    """Release and drop the handles whose transfer is terminal; keep the others."""
    for key, h in list(handles.items()):
        if is_terminal(nx, h):
            del handles[key]
            try:
                h.release()
            except Exception:  # noqa: BLE001 - terminal: nothing can land any more
                logger.warning("releasing a finished transfer failed", exc_info=True)


def await_terminal(nx: Any, handles: dict[Any, Any], timeout_s: float,
                    lock: Optional[threading.RLock] = None) -> None:
    """Poll ``handles`` (any keys) until each is terminal, releasing and dropping it then, for at
    most ``timeout_s`` (0: look once). What is left in ``handles`` is still in flight. ``lock``
    is taken around each look, not across the sleeps. One look when every read is already done."""
    deadline = time.monotonic() + timeout_s
    delay = POLL_FIRST_S
    while True:
        if lock is None:
            release_terminal(nx, handles)
        else:
            with lock:
                release_terminal(nx, handles)
        left = deadline - time.monotonic()
        if not handles or left <= 0:
            return
        time.sleep(min(delay, left))
        delay = min(2 * delay, POLL_MAX_S)



# --------------------------------------------------------------------------- agent


class Agent:
    """A NIXL agent plus the set of remote peers already added to it. Not thread-safe for
    transfers (see module docstring). Use :func:`get_agent` for the process-wide one; tests may
    build more with ``Agent(config)`` (several agents in one process work)."""

    def __init__(self, config: Config, name: Optional[str] = None):
        self.name = name or f"tensorhub-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.backend = config.backend
        self.nixl = _new_nixl_agent(self.name, config)
        params = dict(self.nixl.get_plugin_params(config.backend))
        if config.backend == "UCX":
            params["num_workers"] = str(config.nixl_workers)
            if config.nixl_threads > 0:
                params["num_threads"] = str(config.nixl_threads)
        try:
            self.nixl.create_backend(config.backend, params)
        except Exception as e:  # noqa: BLE001 - reported as a typed error below
            logger.warning("NIXL backend %s with %s failed: %s", config.backend, params, e)
        if config.backend not in self.nixl.backends:
            raise TransferError(f"NIXL backend {config.backend!r} could not be created")
        self._remotes: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.xfer_lock = threading.RLock()
        """Held by :func:`pull` and control reads: NIXL agents are not thread-safe for transfers."""
        self.inbox = Inbox(self.nixl)
        """Progress pushes to and from followers (:mod:`tensorhub.transport.follow`)."""
        logger.info("nixl agent %s up (backend %s)", self.name, config.backend)

    def metadata(self) -> bytes:
        return self.nixl.get_agent_metadata()

    def ensure_remote(self, name: str, metadata: bytes) -> None:
        """Add peer ``name``, or load newer metadata of it. A peer's metadata grows as it
        registers memory (a host copy, a source's scratch block): loading it again adds the new
        registrations and keeps the handles already prepared against the peer valid (removing
        the peer first invalidated them: a follower's reads failed with NIXL_ERR_NOT_FOUND). A
        restarted peer has another name (pid and a uuid are in it), so nothing is removed."""
        if name == self.name:
            return  # reads from a region of this very process: NIXL handles them locally
        with self._lock:
            if self._remotes.get(name) == metadata:
                return
            try:
                got = self.nixl.add_remote_agent(metadata)
            except Exception as e:
                raise TransferError(f"cannot add remote agent {name}: {e}") from e
            if isinstance(got, bytes):
                got = got.decode()
            if got != name:  # metadata that says it is someone else: do not trust it
                try:
                    self.nixl.remove_remote_agent(got)
                except Exception:  # noqa: BLE001
                    logger.debug("remove_remote_agent(%s) failed", got, exc_info=True)
                raise TransferError(f"metadata for agent {name} names agent {got}")
            self._remotes[name] = metadata

    def reload_remote(self, name: str) -> None:
        """Load ``name``'s metadata again at the next :meth:`ensure_remote` (after a read from it
        failed: NIXL may have dropped the peer on a broken connection). Nothing is removed."""
        with self._lock:
            self._remotes.pop(name, None)

    def forget_remote(self, name: str) -> None:
        """Drop a peer (e.g. one reported dead). Idempotent."""
        with self._lock:
            if self._remotes.pop(name, None) is not None:
                try:
                    self.nixl.remove_remote_agent(name)
                except Exception:  # noqa: BLE001
                    logger.debug("remove_remote_agent(%s) failed", name, exc_info=True)


_construct_lock = threading.Lock()


def _new_nixl_agent(name: str, config: Config):
    """A nixl_agent whose progress thread sleeps ``nixl_progress_delay_us`` between rounds.

    The Python wrapper hard-codes a delay of 0, and that thread then spins a whole core in
    every process, idle or not (measured: 100% of a core idle; 2% with 100 us). The thread is
    needed where the target must progress (same-process peers, UCX over TCP), so it stays on
    and the delay is patched into the config the wrapper builds."""
    from nixl import _api as api  # heavy import, keep it lazy
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    # RW: the agent locks its own state (exclusive for register/deregister, shared for
    # transfers). The wrapper's default without a listener thread is NONE, and then a retention
    # buffer registered by one handle's pool thread while another handle of the process
    # deregisters on close corrupts the heap (seen as a segfault in deregister_memory).
    conf = nixl_agent_config(enable_prog_thread=True, backends=[],
                             sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
    delay = int(config.nixl_progress_delay_us)
    real = api.nixlBind.nixlAgent

    def with_delay(agent_name, agent_config):
        agent_config.pthrDelay = delay
        return real(agent_name, agent_config)

    with _construct_lock:
        api.nixlBind.nixlAgent = with_delay
        try:
            return nixl_agent(name, conf)
        finally:
            api.nixlBind.nixlAgent = real


_agent: Optional[Agent] = None
_agent_lock = threading.Lock()


def get_agent(config: Config) -> Agent:
    """The process-wide :class:`Agent`, created on first call (unique name
    ``tensorhub-<pid>-<uuid8>``). Later calls return the same agent whatever their config."""
    global _agent
    with _agent_lock:
        if _agent is None:
            _agent = Agent(config)
        elif _agent.backend != config.backend:
            logger.warning("agent %s uses backend %s, not %s", _agent.name, _agent.backend, config.backend)
        return _agent
