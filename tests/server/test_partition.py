"""Partitioning: each model is served by its own reference server actor (``server_per_model``).

Two models, two fleets, one server each::

    trainer-a -> reader-a      (server <name>/<model a>)
    trainer-b -> reader-b      (server <name>/<model b>)

The names are pure functions of the config and the model (table tests, no Ray). On Ray: each
server's table lists only its model and a transfer works for both; killing model a's server
(its clients reconnect and re-announce to a new one) leaves model b's server, its table and
its clients untouched: not one of b's handles reconnects, and b's reads go on while a's
clients reconnect. ``tensorhub status`` shows both models across both servers, ``--model`` one.
One-server mode (``server_per_model=False``) still serves both models from one actor.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid

import pytest

from tensorhub.config import Config
from tensorhub.errors import ConfigError
from tensorhub.testing import workload
from tensorhub.server.naming import actor_name, graphs_actor_name, served_model

SPEC = workload.small_spec(1 << 20, big=2, tiny=4)
CFG = dict(unit_bytes=256 << 10, heartbeat_interval_s=0.3, lease_timeout_s=3.0, source_stall_timeout_s=2.0,
           request_timeout_s=60.0)


# ----------------------------------------------------------------------------- names (pure)

@pytest.mark.parametrize("model, name", [
    ("policy", "th/policy"),
    ("org/policy v2", "th/org%2Fpolicy%20v2"),  # "/" never reaches the suffix
    ("a%2Fb", "th/a%252Fb"),                    # a literal "%" is encoded too: no collision with "a/b"
    ("ü-7_x.y~z", "th/%C3%BC-7_x.y~z"),
])
def test_actor_name_encodes_the_model_and_decodes_back(model, name):
    cfg = Config(server_name="th")
    assert actor_name(cfg, model) == name
    assert served_model(cfg, name) == model


@pytest.mark.parametrize("name, served", [
    ("th", ""),              # the one-server-for-all actor
    ("th-graphs", None),     # the graph coordinator is not a server
    ("th-graphs/policy", None),
    ("th/a/b", None),        # not an encoding we produce
    ("th/%41", None),        # not canonical ("A" is never encoded)
    ("th/", None),
    ("other/policy", None),
])
def test_served_model_recognises_only_our_server_names(name, served):
    assert served_model(Config(server_name="th"), name) == served


def test_one_server_mode_names_one_actor_for_every_model():
    cfg = Config(server_name="th", server_per_model=False)
    assert {actor_name(cfg, m) for m in ("a", "b", "c/d")} == {"th"}
    assert graphs_actor_name(cfg, "a") == "th-graphs"
    assert graphs_actor_name(Config(server_name="th"), "a/b") == "th-graphs/a%2Fb"


def test_bad_names_raise_config_errors():
    with pytest.raises(ConfigError):
        Config(server_name="a/b")
    with pytest.raises(ConfigError):
        Config(server_name="")
    with pytest.raises(ConfigError):
        actor_name(Config(), "")
    assert Config.from_env({"TENSORHUB_SERVER_PER_MODEL": "0"}).server_per_model is False


# ----------------------------------------------------------------------------- on Ray

def _cfg(**kw) -> dict:
    return dict(CFG, server_name=f"tensorhub-part-{uuid.uuid4().hex[:6]}", **kw)


def _fleets(ray, cfg: dict, models: list[str]) -> dict[str, tuple]:
    """A trainer and a reader per model, all started at once; {model: (trainer, reader)}."""
    from tensorhub.testing.replica import ReplicaActor

    out = {m: tuple(ReplicaActor.remote(m, SPEC, config=cfg) for _ in ("trainer", "reader")) for m in models}
    ray.get([x.ping.remote() for f in out.values() for x in f])
    return out


def _server_tables(ray, cfg: dict) -> dict[str, dict[str, list[str]]]:
    """{server actor name: {model: [client ids]}} for every server of ``cfg`` in the namespace."""
    from tensorhub import status
    from tensorhub.server.find import list_servers

    out = {}
    for name in list_servers(Config(**cfg)):
        snap = status.snapshot(ray.get_actor(name, namespace="tensorhub"))
        out[name] = {mv["model"]: sorted(h["client_id"] for h in mv["holders"]) for mv in snap["models"]}
    return out


def _count_reconnects(ray, actors) -> None:
    """Wrap each actor's port.reconnect so it counts (read back with ``_reconnects``)."""
    def install(self):
        port = self.hub._port
        port.reconnects = 0
        inner = port.reconnect

        def counted():
            port.reconnects += 1
            inner()

        port.reconnect = counted
        return True

    ray.get([a.__ray_call__.remote(install) for a in actors])


def _reconnects(ray, actors) -> list[int]:
    return ray.get([a.__ray_call__.remote(lambda self: self.hub._port.reconnects) for a in actors])


def _status_cli(ray, cfg: dict, *args: str) -> dict:
    addr = ray.get_runtime_context().gcs_address
    argv = [sys.executable, "-m", "tensorhub.cli", "status", "--address", addr, "--server-name", cfg["server_name"],
            "--json", "--sample-s", "0", *args]
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _close(ray, fleets: dict, config: Config) -> None:
    """Close every fleet's handles, then kill every server of the namespace."""
    from tensorhub.server.find import list_servers

    for t, r in fleets.values():
        ray.get([r.close.remote(), t.close.remote()])
    for name in list_servers(config):
        ray.kill(ray.get_actor(name, namespace="tensorhub"), no_restart=True)


def test_server_placement_falls_back_to_anywhere_when_ray_cannot_name_the_node(monkeypatch):
    """``server_near_creator``: the creator's node by affinity; where Ray cannot say which node
    this process is on (a Ray Client driver), no affinity rather than a failure."""
    import ray

    from tensorhub.server import find as server

    class Ctx:
        def get_node_id(self):
            raise RuntimeError("not in a worker")

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Ctx())
    assert server._creator_node() is None


@pytest.mark.ray
def test_two_models_two_servers_each_lists_only_its_model_and_both_transfer(ray_cluster, model_name):
    """trainer-a -> reader-a on a's server, trainer-b -> reader-b on b's: two server actors,
    each table holds only its model; both readers get their trainer's bytes; ``tensorhub
    status`` shows both models, each with its server, and ``--model`` narrows to one."""
    from tensorhub.server.find import list_servers

    ray = ray_cluster
    cfg = _cfg()
    config = Config(**cfg)
    a, b = f"{model_name}-a", f"{model_name}/b"  # b's name needs encoding
    fleets = _fleets(ray, cfg, [a, b])
    # Tensors in actors come from this checkout (the cwd leads sys.path), not another one.
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    where = ray.get(fleets[a][0].__ray_call__.remote(lambda self: __import__("tensorhub").__file__))
    assert where.startswith(here), (where, here)

    assert list_servers(config) == {actor_name(config, a): a, actor_name(config, b): b}
    digests = {m: ray.get(t.publish.remote(1)) for m, (t, _) in fleets.items()}
    reads = {m: ray.get(r.replicate.remote(1), timeout=60) for m, (_, r) in fleets.items()}
    for m, st in reads.items():
        assert (st["version"], st["digest"]) == (1, digests[m]), m

    ids = {m: sorted(ray.get([x.ping.remote() for x in fleets[m]])) for m in fleets}
    tables = _server_tables(ray, cfg)
    assert tables == {actor_name(config, a): {a: ids[a]}, actor_name(config, b): {b: ids[b]}}

    both = _status_cli(ray, cfg)
    assert [(mv["model"], mv["server"]) for mv in both["models"]] == sorted(
        [(a, actor_name(config, a)), (b, actor_name(config, b))]), both
    assert all(mv["available"] == [1] for mv in both["models"]) and both["unreachable"] == {}
    only_b = _status_cli(ray, cfg, "--model", b)
    assert [(mv["model"], sorted(h["client_id"] for h in mv["holders"])) for mv in only_b["models"]] == [(b, ids[b])]

    _close(ray, fleets, config)


@pytest.mark.ray
def test_killing_one_models_server_affects_only_that_model(ray_cluster, model_name):
    """a's server is killed. Right after (while a's clients find a new a-server and re-announce),
    b publishes 2 and b's reader updates to it with exact bytes; then a publishes 2 through
    the outage and a's reader moves to it too. b's server is the same actor throughout, its table has the same clients, and not one
    of b's handles reconnected."""
    from tensorhub.server.find import find_server

    ray = ray_cluster
    cfg = _cfg()
    config = Config(**cfg)
    a, b = f"{model_name}-a", f"{model_name}-b"
    fleets = _fleets(ray, cfg, [a, b])
    everyone = [x for f in fleets.values() for x in f]
    _count_reconnects(ray, everyone)
    d1 = {m: ray.get(t.publish.remote(1)) for m, (t, _) in fleets.items()}
    assert all(ray.get(r.replicate.remote(1), timeout=60)["digest"] == d1[m] for m, (_, r) in fleets.items())
    server_b = find_server(config, b)._actor_id.hex()
    ids_b = sorted(ray.get([x.ping.remote() for x in fleets[b]]))

    old_a = find_server(config, a)
    ray.kill(old_a, no_restart=True)
    tb, rb = fleets[b]
    d2b = ray.get(tb.publish.remote(2), timeout=30)
    st = ray.get(rb.update.remote("latest"), timeout=30)
    assert (st["action"], st["version"], st["digest"]) == ("replicated", 2, d2b)
    assert _reconnects(ray, fleets[b]) == [0, 0]  # b's handles never noticed

    ta, ra = fleets[a]
    d2a = ray.get(ta.publish.remote(2), timeout=60)  # through the outage: reconnect, re-announce
    st = ray.get(ra.update.remote("latest"), timeout=60)
    assert (st["version"], st["digest"]) == (2, d2a)
    assert all(n >= 1 for n in _reconnects(ray, fleets[a])), _reconnects(ray, fleets[a])
    assert find_server(config, a)._actor_id != old_a._actor_id  # a new a-server

    assert _reconnects(ray, fleets[b]) == [0, 0]
    assert find_server(config, b)._actor_id.hex() == server_b
    ids_a = sorted(ray.get([x.ping.remote() for x in fleets[a]]))  # after a's re-registration
    tables = _server_tables(ray, cfg)
    assert tables == {actor_name(config, a): {a: ids_a}, actor_name(config, b): {b: ids_b}}

    _close(ray, fleets, config)


@pytest.mark.ray
def test_one_server_mode_serves_both_models_from_one_actor(ray_cluster, model_name):
    """server_per_model=False: one actor named ``server_name`` holds both models' tables;
    both transfers work and status narrowed to a model shows that model only."""
    from tensorhub import status
    from tensorhub.server.find import list_servers

    ray = ray_cluster
    cfg = _cfg(server_per_model=False)
    config = Config(**cfg)
    a, b = f"{model_name}-a", f"{model_name}-b"
    fleets = _fleets(ray, cfg, [a, b])
    for m, (t, r) in fleets.items():
        d = ray.get(t.publish.remote(1))
        assert ray.get(r.replicate.remote(1), timeout=60)["digest"] == d, m
    assert list_servers(config) == {cfg["server_name"]: ""}
    ids = {m: sorted(ray.get([x.ping.remote() for x in fleets[m]])) for m in fleets}
    assert _server_tables(ray, cfg) == {cfg["server_name"]: ids}
    snap = status.snapshot_all(status.find_servers(config, b), b)
    assert [(mv["model"], mv["server"]) for mv in snap["models"]] == [(b, cfg["server_name"])]

    _close(ray, fleets, config)


def test_status_table_names_each_models_server():
    """The table view across servers: one panel per model, titled with its server."""
    from rich.console import Console

    from tensorhub.status import add_rates, render

    def model(name: str, server: str) -> dict:
        return {"model": name, "server": server, "num_shards": 1, "available": [1], "retained": [1],
                "host_copies": [], "holders": [], "transfers": [], "waiting": []}

    snap = {"time": 0.0, "unreachable": {}, "models": [model("a", "th/a"), model("b/c", "th/b%2Fc")]}
    add_rates(snap, None)
    console = Console(width=140, record=True, file=io.StringIO())
    console.print(render(snap))
    text = console.export_text()
    assert "model a   server th/a" in text and "model b/c   server th/b%2Fc" in text, text
