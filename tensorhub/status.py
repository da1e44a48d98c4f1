"""``tensorhub status``: what the reference servers of a running cluster know, per model.

    tensorhub status [--address auto] [--model NAME] [--json] [--watch [SECONDS]]

Per model: the available and retained versions, host copies, every holder (replica, shard,
state, datacenter, spot, version, units done, readers attached), the transfers in flight
(reader <- source, units done/total, rate) and the waiting readers. Tables on a terminal (rich),
one JSON object per sample with ``--json``, a refreshing view with ``--watch``.

Which servers: every server actor of the namespace named after ``server_name`` (one per model
with ``Config.server_per_model``, or one for all), found by listing Ray's named actors and asked
at once; ``--model`` asks only the server that serves that model. Each model row names its
server; a server that does not answer is reported on stderr and under ``unreachable``.

Where the numbers come from: the server actor's ``status(model)`` (:class:`~tensorhub.core.
messages.Status`): per node its state, version, units done, unit count, size and the source it
reads from. Rates are computed here from two samples (``--watch``: consecutive refreshes;
one-shot: a second sample ``--sample-s`` later when a transfer is in flight). The server learns
a reader's units done from the reader's reports (each heartbeat, a failover, the end of the
read), not unit by unit, so a rate is as coarse as ``heartbeat_interval_s`` and 0 means "no
progress *reported*" between the two samples. A server older than the ``source`` / ``units``
fields shows no source and no unit count (``None`` in JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional

from tensorhub.config import Config
from tensorhub.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto", help="Ray address (default: auto, as the Ray CLI)")
    p.add_argument("--model", default="", help="only this model (default: every model)")
    p.add_argument("--json", action="store_true", help="print one JSON object per sample")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--sample-s", type=float, default=0.5,
                   help="one-shot: second sample this much later to compute transfer rates (0: none)")
    p.add_argument("--server-name", default=None,
                   help="server actor name, the prefix of the per-model servers' names (default: config's)")
    p.add_argument("--namespace", default=None, help="server actor namespace (default: config's)")


def _proof(model_secret: str, model: str) -> bytes:
    from tensorhub.auth import operator_proof

    return operator_proof(model_secret, model) if model_secret else b""


def snapshot(server, model: str = "", model_secret: str = "") -> dict[str, Any]:
    """One sample of one server as plain data: ``{"time", "models": [{model, num_shards,
    available, retained, host_copies, holders, transfers, waiting, placements}]}``. Blocks on one actor call
    (30 s at most). A server created with a model secret answers only with ``model_secret``
    (its proof goes, not the secret); else raises Unauthorized."""
    import ray

    from tensorhub.core import messages as m
    from tensorhub.errors import from_code

    status = m.decode_reply(ray.get(server.status.remote(model, _proof(model_secret, model)), timeout=30))
    if isinstance(status, m.ErrorReply):
        raise from_code(status.code, status.message)
    return {"time": time.time(), "models": _model_rows(status)}


def snapshot_all(servers: dict[str, Any], model: str = "", model_secret: str = "") -> dict[str, Any]:
    """One sample across ``servers`` (``{actor name: handle}``, as :func:`find_servers` returns):
    the models of every server that answered, sorted by name, each with a ``"server"`` key (its
    actor's name), plus ``"unreachable"``: the servers that did not answer (killed between the
    listing and the call, or 30 s without a reply; ``{name: error}``; ``Unauthorized``: the
    server has a model secret and ``model_secret`` is not it). Asks them all at once."""
    import ray

    from tensorhub.core import messages as m

    proof = _proof(model_secret, model)
    refs = {name: h.status.remote(model, proof) for name, h in servers.items()}
    models, unreachable = [], {}
    for name, ref in refs.items():
        try:
            status = m.decode_reply(ray.get(ref, timeout=30))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            unreachable[name] = type(e).__name__
            continue
        if isinstance(status, m.ErrorReply):
            unreachable[name] = f"{status.code} (set TENSORHUB_MODEL_SECRET to the model's secret)"
            continue
        models += [{**row, "server": name} for row in _model_rows(status)]
    return {"time": time.time(), "models": sorted(models, key=lambda r: r["model"]), "unreachable": unreachable}


def find_servers(cfg: Config, model: str = "") -> dict[str, Any]:
    """``{actor name: handle}`` of the servers in ``cfg.namespace`` named after
    ``cfg.server_name`` (per-model servers and a one-server-for-all actor alike, whatever
    ``cfg.server_per_model`` says: the tool reads what the cluster runs). With ``model``: only
    the servers that may serve it (its own, or a shared one)."""
    import ray

    from tensorhub.server.find import list_servers

    out = {}
    for name, served in list_servers(cfg).items():
        if model and served not in ("", model):
            continue
        try:
            out[name] = ray.get_actor(name, namespace=cfg.namespace)
        except ValueError:  # killed since the listing
            continue
    return out


def _model_rows(status) -> list[dict[str, Any]]:
    """The per-model rows of one server's :class:`~tensorhub.core.messages.Status`."""
    replica_of = {}
    models = []
    for mv in status.models:
        holders, host_copies = [], []
        for h in mv.holders:
            units = h.units or None  # 0: a server that does not send it
            row = {
                "client_id": h.client_id, "replica": h.replica_id, "shard": h.shard, "state": h.state,
                "datacenter": h.datacenter, "spot": h.spot, "host_copy": h.host, "version": h.version,
                "units_done": h.progress, "units": units,
                "unit_bytes": h.total_bytes // units if units else None, "readers": h.readers,
                "source": h.source or None,
            }
            replica_of[h.client_id] = f"{h.replica_id}/{h.shard}"  # a host copy's replica id ends in #host
            (host_copies if h.host else holders).append(row)
        transfers = [
            {"reader": r["client_id"], "reader_replica": r["replica"], "shard": r["shard"],
             "source": r["source"], "version": r["version"], "units_done": r["units_done"],
             "units": r["units"], "unit_bytes": r["unit_bytes"]}
            for r in holders if r["state"] == "reading"
        ]
        for tr in transfers:
            tr["source_replica"] = replica_of.get(tr["source"], tr["source"])
        waiting = [{"reader": r["client_id"], "replica": r["replica"], "shard": r["shard"], "version": r["version"]}
                   for r in holders if r["state"] == "waiting"]
        models.append({
            "model": mv.model, "num_shards": mv.num_shards, "available": list(mv.available),
            "retained": list(mv.committed), "host_copies": host_copies, "holders": holders,
            "transfers": transfers, "waiting": waiting,
            "placements": [{"digest": u.digest, "nodes": u.nodes} for u in mv.placements],
        })
    return models


def add_rates(now: dict, before: Optional[dict]) -> None:
    """Fill ``rate_units_s`` / ``rate_mb_s`` of each transfer in ``now`` from the same reader's
    units done in ``before`` (None where there is no earlier sample of that read)."""
    prev = {}
    if before is not None:
        for mv in before["models"]:
            for tr in mv["transfers"]:
                prev[(tr["reader"], tr["version"])] = tr["units_done"]
    dt = now["time"] - before["time"] if before is not None else 0.0
    for mv in now["models"]:
        for tr in mv["transfers"]:
            p = prev.get((tr["reader"], tr["version"]))
            if p is None or dt <= 0:
                tr["rate_units_s"] = tr["rate_mb_s"] = None
            else:
                tr["rate_units_s"] = round(max(tr["units_done"] - p, 0) / dt, 2)
                tr["rate_mb_s"] = round(tr["rate_units_s"] * (tr["unit_bytes"] or 0) / 1e6, 3)


def _has_transfers(snap: dict) -> bool:
    return any(mv["transfers"] for mv in snap["models"])


def render(snap: dict):
    """A rich renderable: one panel of tables per model."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    def units(done, total) -> str:
        return f"{done}/{total}" if total is not None else str(done)

    parts = []
    if not snap["models"]:
        return Text("no models on these servers")
    for mv in snap["models"]:
        head = Text.assemble(
            ("available ", "bold"), str(mv["available"] or "-"), ("   retained ", "bold"), str(mv["retained"] or "-"),
            ("   shards ", "bold"), str(mv["num_shards"]),
            ("   host copies ", "bold"), ", ".join(f"v{h['version']} by {h['replica']}/{h['shard']}"
                                                  for h in mv["host_copies"]) or "-",
        )
        if mv.get("placements"):  # distinct placements (docs/placements.md): digest and the clients using it
            head.append_text(Text.assemble(("   placements ", "bold"), ", ".join(
                f"{p['digest'][:12]} x{p['nodes']}" for p in mv["placements"])))
        hold = Table(title="holders", title_justify="left", expand=False)
        for col in ("replica", "shard", "state", "dc", "spot", "version", "units", "readers"):
            hold.add_column(col, justify="right" if col in ("shard", "version", "readers", "units") else "left")
        for h in mv["holders"]:
            hold.add_row(h["replica"], str(h["shard"]), h["state"], h["datacenter"] or "-", "yes" if h["spot"] else "",
                         str(h["version"]) if h["version"] >= 0 else "-", units(h["units_done"], h["units"]),
                         str(h["readers"]))
        tr = Table(title="transfers in flight", title_justify="left")
        for col in ("reader", "<- source", "version", "units", "rate"):
            tr.add_column(col, justify="right" if col in ("version", "units", "rate") else "left")
        for t in mv["transfers"]:
            rate = "-" if t.get("rate_mb_s") is None else f"{t['rate_mb_s']:.1f} MB/s"
            tr.add_row(f"{t['reader_replica']}/{t['shard']}", str(t["source_replica"] or "?"), str(t["version"]),
                       units(t["units_done"], t["units"]), rate)
        wt = Table(title="waiting readers", title_justify="left")
        for col in ("replica", "shard", "version"):
            wt.add_column(col)
        for w in mv["waiting"]:
            wt.add_row(w["replica"], str(w["shard"]), str(w["version"]) if w["version"] >= 0 else "-")
        body = [head, hold]
        body.append(tr if mv["transfers"] else Text("no transfers in flight", style="dim"))
        body.append(wt if mv["waiting"] else Text("no waiting readers", style="dim"))
        where = f"   server {mv['server']}" if "server" in mv else ""
        parts.append(Panel(Group(*body), title=f"model [bold]{mv['model']}[/bold]{where}", title_align="left"))
    return Group(*parts)


def run(args: argparse.Namespace) -> int:
    import ray

    cfg = Config.from_env()
    try:
        cfg = cfg.replace(server_name=args.server_name or cfg.server_name, namespace=args.namespace or cfg.namespace)
    except ConfigError as e:
        print(f"bad --server-name: {e}", file=sys.stderr)
        return 2
    try:
        ray.init(address=args.address, namespace=cfg.namespace, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as e:
        print(f"no Ray cluster at {args.address}: {e}", file=sys.stderr)
        return 1

    def sample() -> dict:
        # Listed anew each time: a model's server may appear, die or be recreated between samples.
        return snapshot_all(find_servers(cfg, args.model), args.model, cfg.model_secret)

    servers = find_servers(cfg, args.model)
    if not servers:
        what = f"for model '{args.model}' " if args.model else ""
        print(f"no TensorHub server '{cfg.server_name}' {what}in namespace '{cfg.namespace}' on this cluster",
              file=sys.stderr)
        return 1
    first = snapshot_all(servers, args.model, cfg.model_secret)
    for name, why in first["unreachable"].items():
        print(f"server '{name}' did not answer ({why})", file=sys.stderr)

    if args.watch is None:
        snap = first
        if args.sample_s > 0 and _has_transfers(snap):
            time.sleep(args.sample_s)
            snap, before = sample(), snap
            add_rates(snap, before)
        else:
            add_rates(snap, None)
        _emit(snap, args.json)
        return 0

    from rich.live import Live

    before = None
    try:
        if args.json:
            while True:
                snap = sample()
                add_rates(snap, before)
                _emit(snap, True)
                before = snap
                time.sleep(args.watch)
        with Live(auto_refresh=False) as live:
            while True:
                snap = sample()
                add_rates(snap, before)
                live.update(render(snap), refresh=True)
                before = snap
                time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _emit(snap: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(snap), flush=True)
        return
    from rich.console import Console

    Console().print(render(snap))
