"""``tensorhub chaos``: randomized fault rounds on a real local Ray cluster.

Each round the trainer publishes a new version and the rollouts ``update("latest")`` at
once while one fault strikes: a source killed mid-read, a wave of spot kills, the reference
server killed, or none. Every replica that reports success has its bytes compared with the
trainer's digest of that version; a typed error is counted per type; a digest mismatch is
*corrupt* (must stay 0). Killed actors are replaced before the next round. The last stdout
line with ``--json`` is one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import sys
import time

FAULTS = ("none", "kill_source", "spot_wave", "kill_server", "kill_trainer_after_publish")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollouts", type=int, default=4, help="rollout actors (half of them spot)")
    p.add_argument("--size-mb", type=int, default=16)
    p.add_argument("--time-limit-s", type=float, default=1200.0, help="stop starting rounds after this")
    p.add_argument("--address", default=None)
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    rep = run_chaos(rounds=args.rounds, seed=args.seed, rollouts=args.rollouts, size_mb=args.size_mb,
                    time_limit_s=args.time_limit_s, address=args.address,
                    log=(sys.stderr if args.json else sys.stdout))
    if args.json:
        print(json.dumps(rep))
    return 1 if rep["corrupt"] else 0


def run_chaos(*, rounds: int, seed: int = 0, rollouts: int = 4, size_mb: int = 16, time_limit_s: float = 1200.0,
              address=None, log=sys.stderr, init_ray: bool = True) -> dict:
    import ray

    from tensorhub.config import Config
    from tensorhub.testing import workload
    from tensorhub.testing.replica import spawn_many

    t_start = time.perf_counter()
    rng = random.Random(seed)
    if init_ray and not ray.is_initialized():
        ray.init(address=address, namespace="tensorhub-chaos", num_cpus=None if address else 8,
                 include_dashboard=False, log_to_driver=False)
    cfg = Config(unit_bytes=64 << 10, reads_in_flight=2, heartbeat_interval_s=0.3, lease_timeout_s=2.0,
                 source_stall_timeout_s=1.5, request_timeout_s=60.0, server_name=f"tensorhub-chaos-{seed}-{rng.getrandbits(24):06x}")
    cfgd = dataclasses.asdict(cfg)
    spec = workload.small_spec(size_mb << 20, big=4, tiny=32)
    model = f"chaos-{seed}"
    names = ["trainer"] + [f"r{i}" for i in range(rollouts)]
    spot = {n: (i % 2 == 1) for i, n in enumerate(names[1:])}
    gen = collections.Counter()

    def spawn(name: str):
        gen[name] += 1
        # A fresh replica id per generation: the killed one stays registered until its lease ends.
        (a,) = spawn_many(model, spec, [f"{name}-g{gen[name]}"], config=cfgd, replica=f"{name}-g{gen[name]}",
                          spot=spot.get(name, False))
        return a

    actors = {n: spawn(n) for n in names}
    digests: dict[int, str] = {}
    faults = collections.Counter()
    failures = collections.Counter()
    verified = 0
    corrupt = 0
    done_rounds = 0

    for rnd in range(1, rounds + 1):
        if time.perf_counter() - t_start > time_limit_s:
            break
        fault = rng.choice(FAULTS)
        faults[fault] += 1
        version = rnd
        try:
            digests[version] = ray.get(actors["trainer"].publish.remote(version), timeout=120)
        except Exception as e:  # noqa: BLE001
            failures[_err_name(e)] += 1
            actors["trainer"] = _replace(ray, actors, "trainer", spawn)
            continue
        refs = {n: actors[n].update.remote("latest") for n in names[1:]}
        killed: list[str] = []
        time.sleep(rng.uniform(0.0, 0.15))
        if fault == "kill_source":
            victim = rng.choice(names[1:])
            ray.kill(actors[victim], no_restart=True)
            killed.append(victim)
        elif fault == "spot_wave":
            for n in names[1:]:
                if spot[n] and rng.random() < 0.7:
                    ray.kill(actors[n], no_restart=True)
                    killed.append(n)
        elif fault == "kill_server":
            try:
                ray.kill(ray.get_actor(cfg.server_name, namespace=cfg.namespace), no_restart=True)
            except ValueError:
                pass
        elif fault == "kill_trainer_after_publish":
            ray.kill(actors["trainer"], no_restart=True)
            killed.append("trainer")
        for n, ref in refs.items():
            if n in killed:
                continue
            try:
                st = ray.get(ref, timeout=120)
            except Exception as e:  # noqa: BLE001 - classify typed errors, count the rest
                failures[_err_name(e)] += 1
                print(f"round {rnd}: {n}: {_err_name(e)}: {_err_msg(e)}", file=log)
                continue
            want = digests.get(st["version"])
            if want is None:
                failures["UnknownVersionDigest"] += 1
            elif st["digest"] == want:
                verified += 1
            else:
                corrupt += 1
                print(f"round {rnd}: {n} version {st['version']} CORRUPT", file=log)
        for n in killed:
            actors[n] = spawn(n)
        done_rounds = rnd
        print(f"round {rnd:3d} fault={fault:<26} verified={verified} failures={dict(failures)}", file=log)

    for a in actors.values():
        try:
            ray.get(a.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001
            pass
    try:
        ray.kill(ray.get_actor(cfg.server_name, namespace=cfg.namespace), no_restart=True)
    except Exception:  # noqa: BLE001
        pass
    return {
        "rounds": done_rounds,
        "faults": dict(faults),
        "replicas_verified": verified,
        "failures": dict(failures),
        "corrupt": corrupt,
        "seconds": round(time.perf_counter() - t_start, 2),
    }


def _replace(ray, actors: dict, name: str, spawn):
    try:
        ray.kill(actors[name], no_restart=True)
    except Exception:  # noqa: BLE001
        pass
    return spawn(name)


def _err_msg(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    return str(cause if cause is not None else e).splitlines()[-1][:300]


def _err_name(e: BaseException) -> str:
    """The typed TensorHub error inside a Ray task error, else the exception's class name."""
    cause = getattr(e, "cause", None)
    if cause is not None:
        return type(cause).__name__
    return type(e).__name__
