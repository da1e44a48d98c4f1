"""Starting, recognising and killing the processes of one emulated cluster, and nothing else.

A process is ours when (a) its environment carries ``TENSORHUB_EMULATED_CLUSTER=<name>:<run_id>``
(every process we start gets it; Ray's raylets, agents and workers inherit it), or (b) it lives
inside one of our network namespaces. A recorded pid is only trusted while its start time still
matches the record, so a reused pid is never signalled. The calling process and its ancestors
are never killed. ``ray stop`` is never used: other Ray clusters on this machine are not ours.
"""

from __future__ import annotations

import enum
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import msgspec

MARKER_ENV = "TENSORHUB_EMULATED_CLUSTER"
NETNS_DIR = Path("/run/netns")
KILL_POLL_S = 0.05
LOG_TAIL_BYTES = 4000


class Role(str, enum.Enum):
    HEAD = "head"  # `ray start --head --block` in the root namespace
    HOST = "host"  # `ray start --block` inside a host's namespace
    WIRE = "wire"  # the delay-wire process (emucluster.wire)


class ProcRecord(msgspec.Struct, frozen=True):
    """One process we started; ``host`` is the host index for ``Role.HOST``, else -1."""

    role: Role
    host: int
    pid: int
    start_ticks: int
    log_path: str


def _stat_fields(pid: int) -> Optional[list[str]]:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses; fields resume after the last ')'.
    return raw[raw.rindex(")") + 2:].split()


def start_ticks(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot, or None if it does not exist."""
    f = _stat_fields(pid)
    return int(f[19]) if f else None


def is_running(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    f = _stat_fields(pid)
    return bool(f) and f[0] not in ("Z", "X")


def is_same_running(rec: ProcRecord) -> bool:
    """True if the recorded process is still running (same pid *and* start time)."""
    return is_running(rec.pid) and start_ticks(rec.pid) == rec.start_ticks


def spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path, *, role: Role,
          host: int) -> tuple[subprocess.Popen, ProcRecord]:
    """Starts ``argv`` in its own session (a Ctrl-C to the caller's terminal does not reach
    it), stdout and stderr appended to ``log_path``. Does not wait."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    ticks = start_ticks(proc.pid)
    return proc, ProcRecord(role=role, host=host, pid=proc.pid, start_ticks=ticks or 0, log_path=str(log_path))


def owned_pids(marker: Optional[str], namespaces: Iterable[str], netns_dir: Path = NETNS_DIR) -> set[int]:
    """Every running process whose environment carries ``MARKER_ENV=marker`` (``None``: no
    marker matches), or whose network namespace is one of ``namespaces`` (names under
    ``netns_dir``, as ``ip netns`` keeps them). One pass over /proc."""
    needle = f"{MARKER_ENV}={marker}\0".encode() if marker is not None else None
    ns_ids = set()
    for ns in namespaces:
        try:
            st = os.stat(netns_dir / ns)
            ns_ids.add((st.st_dev, st.st_ino))
        except OSError:
            pass
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            st = os.stat(f"/proc/{pid}/ns/net")
            if (st.st_dev, st.st_ino) in ns_ids and is_running(pid):
                found.add(pid)
                continue
            env = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue
        if needle is not None and (env.startswith(needle) or b"\0" + needle in env) and is_running(pid):
            found.add(pid)
    return found


def _protected() -> set[int]:
    """This process and its ancestors."""
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        f = _stat_fields(pid)
        if not f:
            break
        pid = int(f[1])
    return pids


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_all(records: Sequence[ProcRecord], marker: Optional[str], namespaces: Sequence[str], *, grace_s: float,
             timeout_s: float, keep: Iterable[int] = ()) -> set[int]:
    """Stops our processes: SIGTERM to the recorded leaders still running (``ray start
    --block`` then stops its own children), up to ``grace_s`` for them to exit, then SIGKILL
    to every process :func:`owned_pids` finds until none is left or ``timeout_s`` passed.
    Never signals the pids in ``keep``. Returns the survivors (empty on success). Idempotent."""
    protected = _protected() | set(keep)
    leaders = {r.pid for r in records if is_same_running(r)} - protected
    _signal(leaders, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_running(p) for p in leaders):
        time.sleep(KILL_POLL_S)
    deadline = time.monotonic() + timeout_s
    while True:
        left = owned_pids(marker, namespaces) - protected
        left |= {r.pid for r in records if is_same_running(r)} - protected
        if not left or time.monotonic() >= deadline:
            return left
        _signal(left, signal.SIGKILL)
        time.sleep(KILL_POLL_S * 2)


def kill_namespaces(namespaces: Sequence[str], *, timeout_s: float) -> set[int]:
    """SIGKILLs every process inside ``namespaces`` (ours: nobody else starts processes in
    them) until none is left or ``timeout_s`` passed. Returns the survivors (empty on success)."""
    return kill_all([], None, namespaces, grace_s=0.0, timeout_s=timeout_s)


def reap(procs: Iterable[subprocess.Popen]) -> None:
    """Collects exit statuses of our own children so they do not linger as zombies."""
    for p in procs:
        try:
            p.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass


def log_tail(path: str, nbytes: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode(errors="replace")
    except OSError as e:
        return f"<no log at {path}: {e}>"
