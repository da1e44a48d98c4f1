"""The dashboard metrics, read back from Prometheus: a ``ray start --head --metrics-export-port``
cluster of the test's own runs ``tensorhub demo --address ...`` (a trainer and two rollouts, two
versions), then the test scrapes the head's metrics agent and checks the values per model
against what the demo did. The shipped Grafana dashboard queries exactly these series."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from private_head import private_head

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "tensorhub_grafana_dashboard.json"
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text format -> {metric name: [(labels, value)]}."""
    out: dict[str, list] = defaultdict(list)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out[m["name"]].append((dict(_LABEL.findall(m["labels"] or "")), float(m["value"])))
    return out


def total(samples: dict, name: str, **match) -> float:
    return sum(v for labels, v in samples.get(name, []) if all(labels.get(k) == x for k, x in match.items()))


def dashboard_metrics() -> set[str]:
    """Metric names the dashboard's panel queries read."""
    d = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    return {n for e in exprs for n in re.findall(r"\b(ray_tensorhub_\w+?)(?:_bucket)?\{", e)}


def test_dashboard_is_in_rays_grafana_form_and_reads_only_tensorhub_series():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "tensorhub" and d["schemaVersion"] == 27
    names = [v["name"] for v in d["templating"]["list"]]
    assert names == ["datasource", "SessionName", "model"], names  # Ray's generated dashboards' variables
    for p in d["panels"]:
        for t in p.get("targets", []):
            assert t["datasource"] == "${datasource}" and "$SessionName" in t["expr"], t
    assert dashboard_metrics() == {
        "ray_tensorhub_bytes_received_total", "ray_tensorhub_reads_total", "ray_tensorhub_publishes_total",
        "ray_tensorhub_failovers_total", "ray_tensorhub_transfer_seconds", "ray_tensorhub_read_seconds",
        "ray_tensorhub_stall_seconds", "ray_tensorhub_latest_version", "ray_tensorhub_holders",
        "ray_tensorhub_requests_total",
    }


@pytest.mark.ray
def test_demo_metrics_are_read_back_from_the_prometheus_endpoint_per_model():
    rollouts, versions, size_mb = 2, 2, 8
    # Ray's metrics report every 10 s by default; 1 s keeps the test short.
    with private_head(env={"RAY_metrics_report_interval_ms": "1000"}) as head:
        for attempt in range(2):
            demo = subprocess.run(
                [sys.executable, "-m", "tensorhub.cli", "demo", "--address", head.gcs_address, "--rollouts",
                 str(rollouts), "--versions", str(versions), "--size-mb", str(size_mb), "--layers", "2", "--json"],
                capture_output=True, text=True, timeout=300, env=head.env)
            # A busy machine's fresh head can miss the driver's first connection (seen once in a
            # full run: "Timed out while waiting for GCS to become available"): connect again.
            if demo.returncode == 0 or "waiting for GCS to become available" not in demo.stderr:
                break
        assert demo.returncode == 0, demo.stderr[-4000:]
        result = json.loads(demo.stdout.strip().splitlines()[-1])
        moved = result["bytes_moved"]
        assert moved > 0, result

        url = f"http://127.0.0.1:{head.metrics_port}/metrics"
        want_reads = rollouts * versions
        t_end = time.monotonic() + 90
        while True:
            with urllib.request.urlopen(url, timeout=10) as r:
                samples = parse_prometheus(r.read().decode())
            got = {
                "bytes": total(samples, "ray_tensorhub_bytes_received_total", model="demo-policy"),
                "reads": total(samples, "ray_tensorhub_reads_total", model="demo-policy", action="replicated"),
                "publishes": total(samples, "ray_tensorhub_publishes_total", model="demo-policy"),
                "latest": total(samples, "ray_tensorhub_latest_version", model="demo-policy"),
                "read_s_count": total(samples, "ray_tensorhub_read_seconds_count", model="demo-policy"),
                "transfer_s_count": total(samples, "ray_tensorhub_transfer_seconds_count", model="demo-policy"),
            }
            if got == {"bytes": moved, "reads": want_reads, "publishes": versions, "latest": versions,
                       "read_s_count": want_reads, "transfer_s_count": want_reads}:
                break
            assert time.monotonic() < t_end, (got, moved, sorted(n for n in samples if "tensorhub" in n))
            time.sleep(1)
        # every series the dashboard charts that the demo must have produced is there, per model
        failovers = total(samples, "ray_tensorhub_failovers_total", model="demo-policy")
        assert failovers == 0, failovers  # nothing failed: the counter is absent (0 is not exported)
        exported = {n.removesuffix("_bucket") for n in samples if n.startswith("ray_tensorhub_")}
        expected_absent = {"ray_tensorhub_failovers_total", "ray_tensorhub_stall_seconds"}
        assert dashboard_metrics() - expected_absent <= exported, (dashboard_metrics(), exported)
        holders = {lab["state"]: v for lab, v in samples["ray_tensorhub_holders"] if lab.get("model") == "demo-policy"}
        assert holders, samples["ray_tensorhub_holders"]
        # the model's own server (server_per_model) tags its request counts with the model
        assert total(samples, "ray_tensorhub_requests_total", model="demo-policy", type="Publish") >= versions, \
            samples["ray_tensorhub_requests_total"]


def test_a_holder_state_that_empties_is_shown_as_zero_not_its_last_count():
    """The table drops a state once no node is in it; its gauge must go to 0 (it kept showing,
    say, 3 readers after the last read ended)."""
    from tensorhub.server.actor import _Metrics

    class Gauge:
        def __init__(self):
            self.now = {}

        def set(self, value, tags):
            self.now[(tags["model"], tags.get("state"))] = value

    class Core:
        models = {}
        counts = {("m", "reading"): 3, ("m", "published"): 1}

        def holder_counts(self):
            return dict(self.counts)

    met = _Metrics.__new__(_Metrics)
    met.requests, met.holders, met.versions, met._shown = object(), Gauge(), Gauge(), set()
    core = Core()
    met.table(core)
    assert met.holders.now == {("m", "reading"): 3, ("m", "published"): 1}
    core.counts = {("m", "published"): 4}
    met.table(core)
    assert met.holders.now == {("m", "reading"): 0, ("m", "published"): 4}
