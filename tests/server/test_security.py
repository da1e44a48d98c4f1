"""The reference server trusts no caller (docs/security.md; review issue 22 section 2).

Unit tier: the real ``ReferenceServer`` class driven as a foreign job would (its ``call`` /
``notes`` / ``status``, no Ray cluster), the client's bounds, the secrets kept out of reprs.
Ray tier: a second job (its own driver process, ``tensorhub.testing.foreign_job``) attacks a
running model's server; every attack is refused, typed, and the model's holders and readers
go on untouched.

    trainer (job A) -> rollout (job A)        foreign job B: refused
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import uuid

import pytest
import torch

import tensorhub
from tensorhub import auth, errors
from tensorhub.config import Config
from tensorhub.core import bounds
from tensorhub.core import messages as m
from tensorhub.ports import LocalPort

LAY = m.LayoutInfo(fingerprint="f", unit_count=4, total_bytes=4096)
CFG = Config(unit_bytes=4096, unit_count_target=0, heartbeat_interval_s=0.05, lease_timeout_s=2.0,
             request_timeout_s=5.0, liveness_check_s=0, pulse_hold_s=0)


def _reg(cid: str, replica: str, model: str = "policy", **kw) -> m.Register:
    return m.Register(client_id=cid, model=model, replica_id=replica, shard=0, num_shards=1,
                      layout=LAY, endpoint=cid.encode(), **kw)


class _Server:
    """The real server actor class in this process (``liveness_check_s=0`` unless given: no
    Ray calls)."""

    def __init__(self, model: str = "policy", **cfg) -> None:
        from tensorhub.server.actor import ReferenceServer

        self.config = Config(**{"liveness_check_s": 0, **cfg})
        self.srv = ReferenceServer.__ray_actor_class__(dataclasses.asdict(self.config), model)
        self.loop = asyncio.new_event_loop()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()

    def call(self, req, keys: auth.Keyring | None = None, secret: str = ""):
        """``req`` as sent by a client whose port holds ``keys`` (None: sent bare)."""
        env = keys.sign(req, secret) if keys is not None else req
        reply = m.decode_reply(self.run(self.srv.call(m.encode(env), 0.0)))
        if keys is not None:
            keys.answered(env, reply, secret)
        return reply

    @property
    def core(self):
        return self.srv.core


def _code(reply) -> str:
    return reply.code if isinstance(reply, m.ErrorReply) else type(reply).__name__


def _table(core) -> list:
    return sorted((n.id, n.state.value, n.version, n.endpoint, tuple(sorted(n.readers))) for n in core.nodes.values())


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@pytest.fixture
def server():
    """Builds :class:`_Server` s, closed after the test."""
    made = []

    def make(*args, **kw) -> _Server:
        made.append(_Server(*args, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


# --------------------------------------------------------------------------- the repro, unit tier


def test_a_readers_query_gives_the_placements_digests_and_still_no_client(server):
    """A vLLM engine decides its path from ``Query``: whether the trainer registered a placement
    (``ModelView.placements``: digests and how many clients use each), which the reader's view
    keeps; holders and client ids stay out of it."""
    from tensorhub import placement as P

    s = server()
    trainer = auth.Keyring()
    lay = m.LayoutInfo(fingerprint="w", unit_count=1, total_bytes=64, tensors=(m.TensorMeta("w", "float32", (4, 4), 64),))
    placement = P.whole_placement([P.GlobalTensor("w", "float32", (4, 4))])
    reg = m.Register(client_id="policy/trainer/0/aaaaaa", model="policy", replica_id="trainer", shard=0,
                     num_shards=1, layout=lay, endpoint=b"placed", placement=placement)
    assert isinstance(s.call(reg, trainer), m.Registered)
    (view,) = s.call(m.Query(model="policy", layouts=True)).models
    assert view.holders == ()
    assert [(u.digest, u.nodes) for u in view.placements] == [(placement.digest(), 1)]


def test_a_readers_query_gives_the_models_schema_whatever_the_trainers_shards(server):
    """``Query(layouts=True)`` carries the model's global tensors (``ModelView.schema``): a
    reader of a trainer of 2 row shards learns the global shapes, not the shards' local ones,
    and derives its own placement from them. Without ``layouts``, or before any placement, none."""
    from tensorhub import placement as P

    s = server()
    w, b = P.GlobalTensor("w", "float32", (8, 4)), P.GlobalTensor("b", "float32", (3,))
    (unplaced,) = s.call(m.Query(model="policy", layouts=True)).models or (None,)
    assert unplaced is None
    keys = [auth.Keyring(), auth.Keyring()]
    for k in range(2):
        locs = [P.split(w, 0, k, 2)] + ([P.whole(b)] if k == 0 else [])
        place = P.Placement.build(locs, [w, b])
        lay = m.LayoutInfo(fingerprint=f"s{k}", unit_count=len(locs), total_bytes=sum(t.nbytes for t in locs),
                           tensors=tuple(m.TensorMeta(t.name, t.dtype, t.shape, t.nbytes) for t in locs))
        reg = m.Register(client_id=f"policy/trainer/{k}/aaaaa{k}", model="policy", replica_id="trainer", shard=k,
                         num_shards=2, layout=lay, endpoint=b"placed", placement=place)
        assert isinstance(s.call(reg, keys[k]), m.Registered)
    (view,) = s.call(m.Query(model="policy", layouts=True)).models
    assert view.schema == (b, w) and view.holders == ()
    assert [sl.layout.tensors[0].shape for sl in view.layouts] == [(4, 4), (4, 4)]
    (bare,) = s.call(m.Query(model="policy")).models
    assert bare.schema == ()
    # A version part way through its publish (shard 0 only) is named, without a client, and
    # no longer once it is whole (a trainer rank restarted alone joins it: the vLLM trainer).
    assert s.call(m.Publish("policy/trainer/0/aaaaa0", 5), keys[0]) == m.Ok()
    (view,) = s.call(m.Query(model="policy")).models
    assert (view.publishing, view.available, view.holders) == ((5,), (), ())
    assert s.call(m.Publish("policy/trainer/1/aaaaa1", 5), keys[1]) == m.Ok()
    (view,) = s.call(m.Query(model="policy")).models
    assert (view.publishing, view.available) == ((), (5,))


def test_a_foreign_caller_cannot_act_for_the_trainer_and_changes_nothing(server):
    """``server_accepts_any_caller.py``: a process of another job, with no credential beyond
    cluster membership, reads the trainer's id and the layout, then sends Unpublish, Leave,
    Publish, Announce, Pulse and a notes poll in the trainer's name (bare, and with a forged
    capability): each is refused ``Unauthorized`` and the table is as before."""
    s = server()
    trainer, rollout = auth.Keyring(), auth.Keyring()
    assert isinstance(s.call(_reg("policy/trainer/0/aaaaaa", "trainer"), trainer), m.Registered)
    assert s.call(m.Publish("policy/trainer/0/aaaaaa", 7), trainer) == m.Ok()
    assert isinstance(s.call(_reg("policy/rollout/0/bbbbbb", "rollout"), rollout), m.Registered)

    st = s.call(m.Query(model="policy", layouts=True))
    (view,) = st.models
    assert view.holders == (), "a reader's Query names no client"
    assert view.layouts[0].layout == LAY and view.available == (7,), "but gives what a reader needs"
    victim = "policy/trainer/0/aaaaaa"
    before = _table(s.core)

    forged = m.Signed  # a capability made up by the attacker
    attacks = {
        "unpublish": m.Unpublish(victim),
        "leave": m.Leave(victim, drop_last_copy=True),
        "publish": m.Publish(victim, 8),
        "pulse": m.Pulse(beats=(m.Beat(victim),)),
        "announce": m.Announce(register=_reg(victim, "trainer"), holding=m.Holding(published=9)),
        "re-register": _reg(victim, "trainer"),
        "replicate for the rollout": m.Replicate("policy/rollout/0/bbbbbb", "latest", seq=1),
        "stage for the rollout": _reg("evil/0", "evil", stage_for="policy/rollout/0/bbbbbb"),
        "swap with the trainer's copy": m.Swap("policy/rollout/0/bbbbbb", victim, 7),
    }
    for what, req in attacks.items():
        assert _code(s.call(req)) == "Unauthorized", f"bare {what}"
        caps = {cid: os.urandom(auth.CAP_BYTES) for cid in auth.acts_for(req)}
        assert _code(s.call(forged(request=req, caps=caps))) == "Unauthorized", f"forged {what}"
        assert _table(s.core) == before, what
    with pytest.raises(errors.Unauthorized):
        s.run(s.srv.notes(victim))
    # the trainer itself goes on: its own requests carry its capability
    assert s.call(m.Heartbeat(victim), trainer) == m.Ok()
    assert s.call(m.Leave(victim, drop_last_copy=True), trainer) == m.Ok()
    assert victim not in s.core.nodes


def test_an_open_model_admits_a_foreign_replica_but_not_an_unbounded_version(server):
    """Without a model secret any job may join the model as a replica of its own (docs/security.md:
    "an open model"), but a version above ``bounds.VERSION_MAX`` is refused, so a rollout's
    ``update("latest")`` still goes to the trainer."""
    s = server()
    trainer, evil, rollout = auth.Keyring(), auth.Keyring(), auth.Keyring()
    s.call(_reg("t", "trainer"), trainer)
    s.call(m.Publish("t", 7), trainer)
    assert isinstance(s.call(_reg("evil/0", "evil"), evil), m.Registered)
    assert _code(s.call(m.Publish("evil/0", 2**62), evil)) == "OutOfBounds"
    assert s.core.available("policy") == [7]
    s.call(_reg("r", "rollout"), rollout)
    a = s.call(m.Replicate("r", "latest", seq=1), rollout)
    assert isinstance(a, m.Assignment) and (a.version, a.source_id) == (7, "t")


def test_a_model_secret_refuses_foreign_registrations_and_proves_itself(server):
    """A server created with ``model_secret`` refuses a Register/Announce without its proof
    (bare, or proving another secret); the rollout that holds it registers and gets the
    server's proof back; a client holding a secret refuses a server that cannot prove it."""
    s = server(model_secret="s3cr3t")
    trainer = auth.Keyring()
    assert isinstance(s.call(_reg("t", "trainer"), trainer, "s3cr3t"), m.Registered)
    s.call(m.Publish("t", 7), trainer, "s3cr3t")
    before = _table(s.core)
    for secret in ("", "guess"):
        evil = auth.Keyring()
        assert _code(s.call(_reg("evil/0", "evil"), evil, secret)) == "Unauthorized"
        announce = m.Announce(register=_reg("evil/1", "evil"), holding=m.Holding(published=2**40))
        assert _code(s.call(announce, auth.Keyring(), secret)) == "Unauthorized"
    assert _table(s.core) == before and s.core.available("policy") == [7]

    # the operator view needs the secret's proof; the reader's Query does not name holders
    assert _code(m.decode_reply(s.run(s.srv.status("")))) == "Unauthorized"
    full = m.decode_reply(s.run(s.srv.status("", auth.operator_proof("s3cr3t", ""))))
    assert [h.client_id for h in full.models[0].holders] == ["t"]

    # a server without the secret (another job created it under the model's name) is refused
    squatter = server()
    with pytest.raises(errors.Unauthorized, match="does not hold this model secret"):
        squatter.call(_reg("t2", "trainer"), auth.Keyring(), "s3cr3t")


def test_a_request_for_another_model_or_out_of_bounds_is_refused_before_the_table(server):
    """A model server serves its model only, and every name, count and version has a bound:
    the 1 MiB model name of the repro, another model, a too-long replica, 2**62, too many
    shards -- refused typed, no model added (its name never becomes a metrics label)."""
    s = server()
    keys = auth.Keyring()
    big = "x" * (1 << 20)
    assert _code(s.call(_reg("z/0", "z", model=big), keys)) == "OutOfBounds"
    assert _code(s.call(_reg("z/1", "z", model="other"), keys)) == "WrongModel"
    assert _code(s.call(_reg("z/2", "r" * (bounds.NAME_CHARS_MAX + 1)), keys)) == "OutOfBounds"
    assert _code(s.call(_reg("z/3", "z\n"), keys)) == "OutOfBounds", "no control characters in a name"
    wide = m.Register(client_id="z/4", model="policy", replica_id="z", shard=0, num_shards=bounds.SHARDS_MAX + 1,
                      layout=LAY)
    assert _code(s.call(wide, keys)) == "OutOfBounds"
    assert _code(s.call(m.Query(model="other"))) == "WrongModel"
    assert s.core.models == {} and s.core.nodes == {}

    shared = server(model="")  # server_per_model off: one server, at most MODELS_MAX models
    assert isinstance(shared.call(_reg("a/0", "a", model="a"), keys), m.Registered)
    assert _code(shared.call(_reg("b/0", "b", model=big), keys)) == "OutOfBounds"
    assert _code(shared.call(m.Publish("a/0", bounds.VERSION_MAX + 1), keys)) == "OutOfBounds"
    assert shared.call(m.Publish("a/0", bounds.VERSION_MAX), keys) == m.Ok()
    assert _code(shared.call(m.Register(client_id="c/0", model="c", replica_id="c", shard=0, num_shards=1,
                                        layout=m.LayoutInfo("f", bounds.UNITS_MAX + 1, 1)), keys)) == "OutOfBounds"
    assert list(shared.core.models) == ["a"]
    oversized = b"\0" * (bounds.REQUEST_BYTES_MAX + 1)
    assert _code(m.decode_reply(shared.run(shared.srv.call(oversized, 0.0)))) == "OutOfBounds"


def test_the_gate_of_a_restarted_server_binds_the_ids_that_announce_again():
    """After a restart the table is empty: a handle's re-announcement binds its id to the same
    capability (it never changes, so a retried or doubled announcement is no conflict); a
    staging copy announced before its owner binds the owner's id to the owner's capability,
    which the owner then brings -- and a foreign claim of that id does not."""
    port = LocalPort(CFG)
    owner = m.Register(client_id="o", model="p", replica_id="o", shard=0, num_shards=1, layout=LAY)
    stage = m.Register(client_id="s", model="p", replica_id="o~prefetch", shard=0, num_shards=1, layout=LAY,
                       stage_for="o")
    assert isinstance(port.call(owner), m.Registered) and isinstance(port.call(stage), m.Registered)
    port.restart()
    assert port.call(m.Announce(register=stage, holding=m.Holding())) == m.Ok()
    foreign = auth.Keyring()
    assert _code(port.call(foreign.sign(m.Announce(register=owner, holding=m.Holding())))) == "Unauthorized"
    for _ in range(2):  # idempotent
        assert port.call(m.Announce(register=owner, holding=m.Holding())) == m.Ok()
    assert port.call(m.Heartbeat("o")) == m.Ok()


# --------------------------------------------------------------------------- the client's side


def test_the_client_checks_its_bounds_at_open_register_and_publish():
    port = LocalPort(CFG)
    with pytest.raises(errors.OutOfBounds):
        tensorhub.open("x" * (bounds.NAME_CHARS_MAX + 1), port=port, config=CFG)
    with pytest.raises(errors.OutOfBounds):
        tensorhub.open("m", replica="r" * bounds.NAME_CHARS_MAX, port=port, config=CFG)
    with pytest.raises(errors.OutOfBounds):
        tensorhub.open("m", datacenter="dc\t1", port=port, config=CFG)
    hub = tensorhub.open("m", port=port, config=CFG)
    with pytest.raises(errors.OutOfBounds):
        hub.register([("w" * (bounds.TENSOR_NAME_CHARS_MAX + 1), torch.zeros(4))])
    assert port.core.nodes == {}, "nothing registered"
    hub.register([("w", torch.zeros(1024))])
    with pytest.raises(errors.OutOfBounds):
        hub.publish(2**62)
    assert port.core.available("m") == []
    hub.publish(1)
    hub.close(drop_last_copy=True)


def test_a_model_secret_end_to_end_and_never_in_a_repr_or_the_status():
    """Two handles of a model with a secret (LocalPort: the client and server sides of one
    config) register, publish and read; the secret is in no repr, no status row, no request on
    the wire (only proofs are)."""
    cfg = CFG.replace(model_secret="s3cr3t-xyz")
    assert "s3cr3t" not in repr(cfg) and "s3cr3t" not in str(cfg)
    assert Config.from_env({"TENSORHUB_MODEL_SECRET": "abc"}).model_secret == "abc"
    port = LocalPort(cfg)
    seen = []
    sign = port.keys.sign
    port.keys.sign = lambda req, secret="": seen.append(m.encode(sign(req, secret))) or sign(req, secret)
    trainer = tensorhub.open("m", port=port, config=cfg)
    trainer.register([("w", torch.arange(1024, dtype=torch.float32))])
    trainer.publish(1)
    rollout = tensorhub.open("m", port=port, config=cfg)
    rollout.register([("w", torch.zeros(1024))])
    rollout.update("latest")
    assert torch.equal(rollout.tensors[0][1], torch.arange(1024, dtype=torch.float32))
    assert seen and not any(b"s3cr3t" in data for data in seen)
    assert b"s3cr3t" not in m.encode(port.core.status())
    for obj in (port.gate, port.keys, m.Signed(request=m.Heartbeat("x"), caps={"x": b"k" * 32})):
        assert "s3cr3t" not in repr(obj) and "kkkk" not in repr(obj)
    rollout.close()
    trainer.close(drop_last_copy=True)


# --------------------------------------------------------------------------- a second Ray job


@pytest.mark.ray
@pytest.mark.parametrize("secret", ["", "the-model-secret"], ids=["open-model", "model-secret"])
def test_a_second_job_is_refused_and_the_model_goes_on(ray_cluster, model_name, secret):
    """Job A (this driver): a trainer and a rollout of ``model_name``. Job B (its own driver,
    ``python -m tensorhub.testing.foreign_job``, connected to the same cluster) reads what a
    reader may, then attacks with the trainer's and the rollout's ids: every attack is refused
    typed. A's holders are as before and the rollout then reads the trainer's next version."""
    ray = ray_cluster
    ns = f"tensorhub-sec-{uuid.uuid4().hex[:6]}"
    cfg = Config(namespace=ns, server_name=f"tensorhub-sec-{uuid.uuid4().hex[:6]}", unit_bytes=4096,
                 unit_count_target=0, heartbeat_interval_s=0.2, lease_timeout_s=5.0, model_secret=secret)
    trainer = tensorhub.open(model_name, replica="trainer", config=cfg)
    rollout = tensorhub.open(model_name, replica="rollout", config=cfg)
    try:
        trainer.register([("w", torch.arange(4096, dtype=torch.float32))])
        trainer.publish(1)
        rollout.register([("w", torch.zeros(4096))])
        rollout.update("latest")
        port = trainer._port
        def holders() -> list:  # the handles (host copies come and go by themselves: host_copy_ahead)
            return [(h.client_id, h.state, h.version) for h in port.status(model_name).models[0].holders
                    if not h.host and not h.client_id.startswith("evil")]

        before = holders()
        assert [c for c, *_ in before] == [trainer.client_id, rollout.client_id]

        env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("TENSORHUB_MODEL_SECRET", None)
        argv = [sys.executable, "-m", "tensorhub.testing.foreign_job",
                "--address", ray.get_runtime_context().gcs_address, "--namespace", ns,
                "--server-name", cfg.server_name, "--model", model_name,
                "--victim", trainer.client_id, "--reader", rollout.client_id]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])

        assert got["query_holders"] == 0 and got["query_layouts"] == 1, got
        assert got["job_id"] != ray.get_runtime_context().get_job_id(), "a job of its own"
        for attack in ("unpublish", "leave", "publish", "pulse", "announce", "replicate", "stage_for",
                       "forged_unpublish", "notes"):
            assert got[attack] == "Unauthorized", (attack, got)
        assert got["big_model"] == "OutOfBounds" and got["other_model"] == "WrongModel", got
        assert got["status"] == ("Unauthorized" if secret else "Status"), got
        assert got["rogue_register"] == ("Unauthorized" if secret else "Registered"), got
        assert got["rogue_publish_2_62"] == "OutOfBounds", got

        assert holders() == before
        trainer.unpublish()
        trainer._memory.tensors[0].add_(1)
        trainer.publish(2)
        stats = rollout.update("latest")
        assert stats.version == 2 and torch.equal(rollout.tensors[0][1], torch.arange(4096, dtype=torch.float32) + 1)
    finally:
        rollout.close(drop_last_copy=True)
        trainer.close(drop_last_copy=True)
        from tensorhub.server.find import find_server

        ray.kill(find_server(cfg, model_name))


def test_a_registration_answered_with_an_error_that_keeps_the_node_binds_its_capability():
    """Found by the simulator (seed 94, ``source_dies_at_done`` with a restart): after a server
    restart an Announce was answered ``VersionLost`` (its unconfirmed completion refused) while
    the table kept the client as an idle node; the gate bound no capability for it, so every
    later request of that client was refused ``Unauthorized`` until its lease expired. Whatever
    the reply, a node the registration left in the table is bound to the capability it carried;
    another caller is still refused."""
    from tensorhub.core.reference import ReferenceCore

    core, gate = ReferenceCore(CFG), auth.Gate()
    owner, other = auth.Keyring(), auth.Keyring()
    announce = owner.sign(m.Announce(register=_reg("r0", "r0"), holding=m.Holding()))
    req, refused = gate.admit(core, announce)
    assert refused is None
    core.handle(req, 0.0)  # the table takes the node ...
    assert "r0" in core.nodes
    gate.answered(core, announce, m.ErrorReply(code="VersionLost", message="refused completion"))  # ... and says no
    assert gate.admit(core, owner.sign(m.ReplicateAbort(client_id="r0")))[1] is None
    _, refused = gate.admit(core, other.sign(m.ReplicateAbort(client_id="r0")))
    assert refused is not None and refused.code == "Unauthorized"
