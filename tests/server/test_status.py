"""``tensorhub status`` against a live cluster with transfers in flight.

The picture is made to hold still: reader A reads from the publisher in 4 KiB units, one at a
time, and is stopped (SIGSTOP) once the server shows it reading; B then asks for the same
version and is stopped too once the server shows it reading. The publisher serves one reader at
a time, so B's source is another holder of the version: the publisher's host copy when the
server has one, else A (a partial holder). While both are stopped the server's table shows two
transfers in flight; then both continue and finish with the publisher's bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tensorhub.server.find import find_server
from tensorhub.config import Config
from tensorhub.testing import workload
from tensorhub.testing.replica import spawn_many

SPEC = workload.small_spec(16 << 20, big=2, tiny=8)
CFG = dict(unit_bytes=4 << 10, reads_in_flight=1, nixl_workers=1, nixl_threads=0, heartbeat_interval_s=1.0,
           lease_timeout_s=120.0, source_stall_timeout_s=120.0, request_timeout_s=120.0)


def _wait(cond, what: str, timeout_s: float = 30.0):
    t_end = time.monotonic() + timeout_s
    while not (out := cond()):
        assert time.monotonic() < t_end, f"timed out waiting until {what}"
        time.sleep(0.005)
    return out


def test_add_rates_from_two_samples():
    from tensorhub.status import add_rates

    def snap(t, done):
        return {"time": t, "models": [{"transfers": [
            {"reader": "r", "version": 3, "units_done": done, "unit_bytes": 1_000_000}]}]}

    first, second = snap(10.0, 4), snap(12.0, 10)
    add_rates(first, None)
    add_rates(second, first)
    assert first["models"][0]["transfers"][0]["rate_units_s"] is None
    assert second["models"][0]["transfers"][0]["rate_units_s"] == 3.0
    assert second["models"][0]["transfers"][0]["rate_mb_s"] == 3.0


@pytest.mark.ray
def test_status_shows_two_paused_transfers_with_their_sources_and_the_host_copy(ray_cluster, model_name):
    from tensorhub import status

    ray = ray_cluster
    cfg = dict(CFG, server_name=f"tensorhub-status-{uuid.uuid4().hex[:6]}")
    names = ["holder", "A", "B"]
    holder, a, b = spawn_many(model_name, SPEC, names, per_name={n: {"replica": n} for n in names}, config=cfg)
    id_h, id_a, id_b = ray.get([x.ping.remote() for x in (holder, a, b)])
    pid_a, pid_b = ray.get([x.__ray_call__.remote(lambda self: os.getpid()) for x in (a, b)])
    server = find_server(Config(**cfg), model_name)

    def holders() -> dict:
        snap = status.snapshot(server, model_name)
        return {h["client_id"]: h for mv in snap["models"] for h in mv["holders"]}

    digest = ray.get(holder.publish.remote(1))
    ra = a.replicate.remote(1)
    _wait(lambda: holders()[id_a]["state"] == "reading", "A reads")
    os.kill(pid_a, signal.SIGSTOP)
    try:
        rb = b.replicate.remote(1)
        _wait(lambda: holders()[id_b]["state"] == "reading", "B reads")
        os.kill(pid_b, signal.SIGSTOP)

        snap = status.snapshot(server, model_name)
        (mv,) = snap["models"]
        units = {h["units"] for h in mv["holders"] + mv["host_copies"]}
        assert len(units) == 1 and units.pop() == 4096, mv  # 16 MiB in 4 KiB units
        assert mv["available"] == [1] and mv["retained"] == [1] and mv["waiting"] == [], mv
        by = {h["replica"]: h for h in mv["holders"]}
        assert (by["holder"]["state"], by["holder"]["version"], by["holder"]["readers"]) == ("published", 1, 1)
        assert by["holder"]["units_done"] == by["holder"]["units"]
        assert (by["A"]["state"], by["B"]["state"], by["B"]["readers"]) == ("reading", "reading", 0), mv
        host = [h["replica"] for h in mv["host_copies"] if h["version"] == 1]
        assert host in ([], ["holder#host"]), mv["host_copies"]
        flows = {(t["reader_replica"], t["source_replica"], t["version"]) for t in mv["transfers"]}
        b_source = next(src for reader, src, _ in flows if reader == "B")
        assert b_source in {"A/0"} | {f"{h}/0" for h in host}, flows  # busy publisher: another holder of 1
        assert flows == {("A", "holder/0", 1), ("B", b_source, 1)}, mv["transfers"]

        # The command, as a user runs it against this cluster: JSON, then the table.
        addr = ray.get_runtime_context().gcs_address
        argv = [sys.executable, "-m", "tensorhub.cli", "status", "--address", addr, "--model", model_name,
                "--server-name", cfg["server_name"]]
        env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
        out = subprocess.run(argv + ["--json"], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        cli = json.loads(out.stdout.strip().splitlines()[-1])
        (cmv,) = cli["models"]
        assert {(t["reader_replica"], t["source_replica"]) for t in cmv["transfers"]} == {("A", "holder/0"), ("B", b_source)}
        assert all("rate_mb_s" in t for t in cmv["transfers"]), cmv["transfers"]  # second sample taken
        table = subprocess.run(argv + ["--sample-s", "0"], capture_output=True, text=True, timeout=120,
                               env={**env, "COLUMNS": "140"})
        assert table.returncode == 0, table.stderr[-3000:]
        text = table.stdout
        assert model_name in text and "transfers in flight" in text and "holder/0" in text and b_source in text, text
        assert "published" in text and "reading" in text and "no waiting readers" in text, text
    finally:
        os.kill(pid_a, signal.SIGCONT)
        os.kill(pid_b, signal.SIGCONT)
    st_a, st_b = ray.get([ra, rb], timeout=120)
    assert (st_a["version"], st_b["version"]) == (1, 1)
    assert ray.get([a.digest.remote(), b.digest.remote()]) == [digest, digest]
    ray.get([x.close.remote() for x in (b, a, holder)])


@pytest.mark.ray
def test_status_lists_a_waiting_reader_and_the_transfer_it_waits_behind(ray_cluster, model_name):
    """holder (dc-a) -> A (dc-b, the seeder of its datacenter, stopped mid-read); B (dc-a) must
    read inside its own datacenter, where the only candidate is the busy holder: B waits. The
    status shows A <- holder/0 with units done/total and B among the waiting readers; when A
    continues, B gets the holder and both finish with the publisher's bytes."""
    from tensorhub import status

    ray = ray_cluster
    cfg = dict(CFG, server_name=f"tensorhub-status-{uuid.uuid4().hex[:6]}", readers_per_source_max=1)
    dcs = {"holder": "dc-a", "A": "dc-b", "B": "dc-a"}
    holder, a, b = spawn_many(model_name, SPEC, list(dcs),
                              per_name={n: {"replica": n, "datacenter": dc} for n, dc in dcs.items()}, config=cfg)
    id_h, id_a, id_b = ray.get([x.ping.remote() for x in (holder, a, b)])
    (pid_a,) = ray.get([a.__ray_call__.remote(lambda self: os.getpid())])
    server = find_server(Config(**cfg), model_name)

    def model_view() -> dict:
        (mv,) = status.snapshot(server, model_name)["models"]
        return mv

    def state_of(mv: dict, client_id: str) -> str:
        return next(h["state"] for h in mv["holders"] if h["client_id"] == client_id)

    digest = ray.get(holder.publish.remote(1))
    ra = a.replicate.remote(1)
    _wait(lambda: state_of(model_view(), id_a) == "reading", "A reads")
    os.kill(pid_a, signal.SIGSTOP)
    try:
        rb = b.replicate.remote(1)
        def b_waits():
            mv = model_view()
            return mv if state_of(mv, id_b) == "waiting" else None

        mv = _wait(b_waits, "B waits")
        assert mv["waiting"] == [{"reader": id_b, "replica": "B", "shard": 0, "version": 1}], mv
        (tr,) = mv["transfers"]
        assert (tr["reader_replica"], tr["source"], tr["source_replica"], tr["version"]) == ("A", id_h, "holder/0", 1), tr
        assert tr["units"] == 4096 and 0 <= tr["units_done"] < tr["units"], tr  # 16 MiB in 4 KiB units
        assert tr["unit_bytes"] == 4096, tr
        by = {h["replica"]: h for h in mv["holders"]}
        assert by["B"]["source"] is None and by["A"]["source"] == id_h and by["holder"]["readers"] == 1, mv

        addr = ray.get_runtime_context().gcs_address
        argv = [sys.executable, "-m", "tensorhub.cli", "status", "--address", addr, "--model", model_name,
                "--server-name", cfg["server_name"]]
        env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
        out = subprocess.run(argv + ["--json"], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        (cmv,) = json.loads(out.stdout.strip().splitlines()[-1])["models"]
        assert [w["replica"] for w in cmv["waiting"]] == ["B"], cmv
        assert [(t["reader_replica"], t["source_replica"], t["units"]) for t in cmv["transfers"]] == [("A", "holder/0", 4096)]
        assert cmv["transfers"][0]["rate_mb_s"] is not None, cmv["transfers"]  # second sample taken
        table = subprocess.run(argv + ["--sample-s", "0"], capture_output=True, text=True, timeout=120,
                               env={**env, "COLUMNS": "140"})
        assert table.returncode == 0, table.stderr[-3000:]
        text = table.stdout
        assert "waiting readers" in text and "no waiting readers" not in text and "/4096" in text, text
    finally:
        os.kill(pid_a, signal.SIGCONT)
    st_a, st_b = ray.get([ra, rb], timeout=120)
    assert (st_a["version"], st_b["version"]) == (1, 1)
    assert ray.get([a.digest.remote(), b.digest.remote()]) == [digest, digest]
    ray.get([x.close.remote() for x in (b, a, holder)])
