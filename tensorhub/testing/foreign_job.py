"""A second job on a running Ray cluster that attacks a model's reference server.

    python -m tensorhub.testing.foreign_job --address GCS --namespace NS --server-name NAME \\
        --model M --victim TRAINER_ID --reader ROLLOUT_ID

Its own driver process (``ray.init(address=...)``: a job of its own, as any other job of the
cluster), with no credential but cluster membership. It finds the model's server by name and
tries what review issue 22 showed worked: read the table, act with the trainer's and a reader's
ids (they are passed in, as if read from a log), register a replica of its own and publish
2**62, register a model with a 1 MiB name and another model on this model's server. Prints one
JSON line: per attack the reply's error code (or the reply's type), plus what a reader's
``Query`` gave (``query_holders``, ``query_layouts``) and its own ``job_id``. Changes nothing
if the server is right (docs/security.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tensorhub.server.naming import actor_name


def _code(reply) -> str:
    from tensorhub.core import messages as m

    return reply.code if isinstance(reply, m.ErrorReply) else type(reply).__name__


def attack(server, model: str, victim: str, reader: str) -> dict:
    """Every attack against ``server`` (a handle to the actor of ``model``)."""
    import ray

    from tensorhub import auth, errors
    from tensorhub.core import messages as m

    def call(req, keys=None):
        env = keys.sign(req) if keys is not None else req
        return m.decode_reply(ray.get(server.call.remote(m.encode(env), 0.0), timeout=60))

    out = {}
    st = call(m.Query(model=model, layouts=True))
    view = st.models[0]
    out["query_holders"], out["query_layouts"] = len(view.holders), len(view.layouts)
    lay = view.layouts[0].layout
    out["status"] = _code(m.decode_reply(ray.get(server.status.remote(model), timeout=60)))

    def reg(cid: str, replica: str, **kw) -> m.Register:
        return m.Register(client_id=cid, model=kw.pop("model", model), replica_id=replica, shard=0,
                          num_shards=1, layout=lay, endpoint=b"attacker-chosen endpoint", **kw)

    evil = auth.Keyring()
    out["rogue_register"] = _code(call(reg("evil/0", "evil"), evil))
    out["rogue_publish_2_62"] = _code(call(m.Publish("evil/0", 2**62), evil))
    out["unpublish"] = _code(call(m.Unpublish(victim)))
    out["forged_unpublish"] = _code(call(m.Signed(request=m.Unpublish(victim), caps={victim: os.urandom(32)})))
    out["leave"] = _code(call(m.Leave(victim, drop_last_copy=True)))
    out["publish"] = _code(call(m.Publish(victim, 1 << 40)))
    out["pulse"] = _code(call(m.Pulse(beats=(m.Beat(victim),))))
    out["announce"] = _code(call(m.Announce(register=reg(victim, "trainer"), holding=m.Holding(published=1 << 40))))
    out["replicate"] = _code(call(m.Replicate(reader, "latest", seq=99)))
    out["stage_for"] = _code(call(reg("evil/1", "evil~prefetch", stage_for=reader), evil))
    try:
        ray.get(server.notes.remote(victim), timeout=60)
        out["notes"] = "accepted"
    except errors.Unauthorized:  # Ray re-raises the server's typed error (a subclass of it)
        out["notes"] = "Unauthorized"
    out["big_model"] = _code(call(reg("evil/2", "evil", model="x" * (1 << 20)), evil))
    out["other_model"] = _code(call(reg("evil/3", "evil", model="another-model"), evil))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", required=True, help="the cluster's GCS address")
    ap.add_argument("--namespace", required=True, help="of the model's server")
    ap.add_argument("--server-name", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--victim", required=True, help="the trainer's client id")
    ap.add_argument("--reader", required=True, help="a rollout's client id")
    args = ap.parse_args(argv)

    import ray

    from tensorhub.config import Config

    ray.init(address=args.address, namespace="tensorhub-foreign-job", log_to_driver=False, logging_level="ERROR")
    cfg = Config(server_name=args.server_name, namespace=args.namespace)
    server = ray.get_actor(actor_name(cfg, args.model), namespace=args.namespace)
    res = attack(server, args.model, args.victim, args.reader)
    res["job_id"] = ray.get_runtime_context().get_job_id()
    print(json.dumps(res), flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
