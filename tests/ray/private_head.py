"""A ``ray start --head`` cluster of the test's own: free ports, a private ``--temp-dir``, and a
teardown that stops exactly the processes it started (never ``ray stop``, which would take every
Ray cluster on the machine with it).

``ray start --head --block`` runs in a new session (``start_new_session``): the head's processes
and the workers its raylet spawns stay in that session, so teardown signals that process group
and then SIGKILLs whatever of the session is left, by pid.

The head has a token of its own (``RAY_AUTH_TOKEN_PATH`` in the private temp dir): ``ray start``
never creates one, so on a fresh machine, where no ``ray.init()`` has written ``~/.ray/auth_token``
yet, a head that relied on that file refused to start. :attr:`Head.env` is what a client of it
needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Iterator, Optional


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclasses.dataclass
class Head:
    pid: int
    gcs_address: str
    dashboard_url: str
    metrics_port: int
    temp_dir: str
    env: dict  # os.environ plus this head's auth (RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH), no RAY_ADDRESS

    def session_pids(self) -> list[int]:
        """Live (non-zombie) processes of the head's session."""
        out = subprocess.run(["ps", "-o", "pid=,stat=", "--sid", str(self.pid)], capture_output=True, text=True).stdout
        return [int(p) for p, st in (ln.split() for ln in out.splitlines()) if not st.startswith("Z")]


def _stop(proc: subprocess.Popen, head: Optional[Head]) -> None:
    # SIGTERM to the whole group, then SIGKILL whatever of the session is still there. Processes
    # whose parent died before them stay as zombies when PID 1 does not reap (as on these VMs):
    # dead, holding nothing but a pid.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    t_end = time.monotonic() + 10
    while time.monotonic() < t_end and head is not None and head.session_pids():
        time.sleep(0.2)
    if head is not None:
        for pid in head.session_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


START_TRIES = 3
_PORT_TAKEN = ("Address already in use", "Failed to start the grpc server")


class PortTaken(RuntimeError):
    """``ray start`` exited because a port :func:`free_ports` found free was taken before it bound
    it (another process of the busy machine, e.g. a worker of another cluster)."""


@contextlib.contextmanager
def private_head(num_cpus: int = 2, env: Optional[dict] = None, timeout_s: float = 120.0) -> Iterator[Head]:
    """Start a head, wait until its job API answers, yield it; stop it on exit. A start that
    loses one of its ports to another process is tried again with fresh ports (``START_TRIES``)."""
    for attempt in range(START_TRIES):
        try:
            cm = _private_head(num_cpus, env, timeout_s)
            head = cm.__enter__()
        except PortTaken:
            if attempt == START_TRIES - 1:
                raise
            continue
        with contextlib.ExitStack() as stack:
            stack.push(cm)
            yield head
        return


@contextlib.contextmanager
def _private_head(num_cpus: int, env: Optional[dict], timeout_s: float) -> Iterator[Head]:
    tmp = tempfile.mkdtemp(prefix="tensorhub-head-")
    gcs, dash, client, metrics, agent_grpc, agent_http, rtenv, nm, om = free_ports(9)
    wmin = 20000 + random.randrange(90) * 100
    argv = [
        "ray", "start", "--head", "--block", "--disable-usage-stats", f"--temp-dir={tmp}/ray",
        f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
        f"--ray-client-server-port={client}", f"--metrics-export-port={metrics}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--dashboard-agent-listen-port={agent_http}",
        f"--runtime-env-agent-port={rtenv}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
        f"--min-worker-port={wmin}", f"--max-worker-port={wmin + 99}", f"--num-cpus={num_cpus}",
        "--include-dashboard=true",
    ]
    token_path = os.path.join(tmp, "auth_token")
    with open(os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(secrets.token_hex(32))
    client_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    client_env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path)
    full_env = {**client_env, **(env or {})}
    log = open(os.path.join(tmp, "head.log"), "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    head = Head(pid=proc.pid, gcs_address=f"127.0.0.1:{gcs}", dashboard_url=f"http://127.0.0.1:{dash}",
                metrics_port=metrics, temp_dir=f"{tmp}/ray", env=client_env)
    try:
        t_end = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                out = open(log.name).read()
                kind = PortTaken if any(m in out for m in _PORT_TAKEN) else RuntimeError
                raise kind(f"ray start exited {proc.returncode}: {out[-3000:]}")
            try:
                with urllib.request.urlopen(f"{head.dashboard_url}/api/version", timeout=2) as r:
                    if r.status == 200:
                        break
            except urllib.error.HTTPError:
                break  # it answers (token auth may refuse an anonymous request)
            except OSError:
                pass
            if time.monotonic() > t_end:
                raise RuntimeError(f"head did not come up in {timeout_s}s: {open(log.name).read()[-3000:]}")
            time.sleep(0.5)
        yield head
    finally:
        _stop(proc, head)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
