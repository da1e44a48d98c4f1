"""``tensorhub chaos``: randomized fault rounds on a real local Ray cluster.

Each round the trainer publishes a new version and the rollouts ``update("latest")`` at
once while one fault strikes: a source killed mid-read, a wave of spot kills, the reference
server killed, the trainer killed right after publishing, or none. Every replica that reports
success has its bytes compared with the trainer's digest of that version; a mismatch is
*corrupt* (must stay 0). Killed actors are replaced before the next round. The last stdout
line with ``--json`` is one JSON object; the exit code is 1 when anything was corrupt or a
failure was unexpected. ``faults_mid_read`` counts, per fault, the rounds in which it struck
while some read was still in flight (a fault after every read finished tests nothing).

Every failed operation is judged against the driver's own ground truth, never the server's
view: :class:`Holdings` replays what the driver did (who published or finished which
version, who unpublished, whom it killed and when) and says, for each retained version,
whether a live non-spot process held a complete copy at the moment of the failure. The
rules are :func:`classify`; an *unexpected* failure is one those copies should have
prevented, and is reported in full (round, actor, error, what was alive).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import json
import random
import sys
import time
from typing import Iterable, Mapping

FAULTS = ("none", "kill_source", "spot_wave", "kill_server", "kill_trainer_after_publish")


# ---------------------------------------------------------------------------- ground truth


class Copy(enum.Enum):
    """Whether a live non-spot process holds a complete copy of a version (published or in
    host memory after a retention offload)."""

    LIVE = "live"
    GONE = "gone"
    UNKNOWN = "unknown"
    """A host copy was made by one of several concurrent unpublishers (the driver cannot see
    which) and some of them, not all, were killed since."""


class Verdict(enum.Enum):
    EXPECTED = "expected"
    UNEXPECTED = "unexpected"


def classify(*, killed_self: bool, typed: bool, copies: Mapping[int, Copy]) -> tuple[Verdict, str]:
    """Judge one failed operation. ``killed_self``: the driver killed the actor that ran it;
    ``typed``: the error is a :class:`~tensorhub.errors.TensorHubError`; ``copies``: each
    retained version's :class:`Copy` at the moment of the failure. Rules, in order:

    1. The operation's own actor was killed: expected (whatever Ray raised).
    2. A retained version had a live non-spot copy: unexpected (a reader should have got it).
    3. The error is not a typed TensorHub error (a hang, a crash): unexpected.
    4. Otherwise every retained version was gone (or possibly gone): expected.
    """
    if killed_self:
        return Verdict.EXPECTED, "its actor was killed"
    live = sorted(v for v, c in copies.items() if c is Copy.LIVE)
    if live:
        return Verdict.UNEXPECTED, f"version {live[-1]} had a live non-spot holder"
    if not typed:
        return Verdict.UNEXPECTED, "not a typed TensorHub error"
    unknown = sorted(v for v, c in copies.items() if c is Copy.UNKNOWN)
    if unknown:
        return Verdict.EXPECTED, f"no certain live non-spot holder (version {unknown[-1]}'s host copy may have been killed)"
    return Verdict.EXPECTED, "no live non-spot holder of any retained version"


class Holdings:
    """Who holds which complete version, replayed from what the driver did (pure, no Ray).

    Mirrors the retention rule (docs/concepts.md, "Retention"): when the last live non-spot holder of a retained
    version unpublishes, it keeps a host copy. Concurrent unpublishers of one version are a
    *wave*: one of them (the driver cannot see which) keeps the copy, so the copy lives while
    all of them do, is gone when none does, and is :attr:`Copy.UNKNOWN` in between. Host copies
    live and die with their owner and are freed once their version falls out of retention.
    """

    def __init__(self, versions_retained: int) -> None:
        assert versions_retained >= 1
        self.versions_retained = versions_retained
        self.spot: dict[str, bool] = {}
        self.dead: set[str] = set()
        self.published: dict[str, int] = {}
        self.host: dict[int, list[frozenset[str]]] = collections.defaultdict(list)
        self.committed: list[int] = []

    def spawn(self, actor: str, *, spot: bool) -> None:
        self.spot[actor] = spot

    def kill(self, actor: str) -> None:
        self.dead.add(actor)
        self.published.pop(actor, None)

    def alive(self) -> list[str]:
        return sorted(a for a in self.spot if a not in self.dead)

    def retained(self) -> list[int]:
        return sorted(self.committed)[-self.versions_retained:]

    def leave(self, actors: Iterable[str]) -> None:
        """A wave of concurrent unpublishes (a trainer's publish, or rollouts starting an update)."""
        by_version: dict[int, set[str]] = collections.defaultdict(set)
        for a in actors:
            v = self.published.pop(a, None)
            if v is not None and a not in self.dead:
                by_version[v].add(a)
        for v, leavers in sorted(by_version.items()):
            keepers = frozenset(a for a in leavers if not self.spot[a])
            if keepers and v in self.retained() and self.copy(v) is not Copy.LIVE:
                self.host[v].append(keepers)

    def publish(self, actor: str, version: int) -> None:
        """``actor`` (the trainer) unpublished its version, wrote ``version`` and published it."""
        self.leave([actor])
        self.finish(actor, version)
        if version not in self.committed:
            self.committed.append(version)
        for v in list(self.host):
            if v not in self.retained():
                del self.host[v]

    def finish(self, actor: str, version: int) -> None:
        """``actor`` holds every verified byte of ``version`` and publishes it."""
        if actor not in self.dead:
            self.published[actor] = version

    def copy(self, version: int) -> Copy:
        if any(v == version and not self.spot[a] for a, v in self.published.items()):
            return Copy.LIVE
        groups = self.host.get(version, ())
        if any(not (g & self.dead) for g in groups):
            return Copy.LIVE
        if any(g - self.dead for g in groups):
            return Copy.UNKNOWN
        return Copy.GONE

    def copies(self) -> dict[int, Copy]:
        return {v: self.copy(v) for v in self.retained()}

    def holders(self) -> dict[str, list[str]]:
        """For a report: every live holder of each retained version (spot ones marked)."""
        out: dict[str, list[str]] = {}
        for v in self.retained():
            names = [a + (" (spot)" if self.spot[a] else "") for a, pv in sorted(self.published.items()) if pv == v]
            names += ["host copy in one of " + "/".join(sorted(g)) for g in self.host.get(v, ()) if g - self.dead]
            out[str(v)] = names
        return out


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
    return 1 if rep["corrupt"] or rep["unexpected_failures"] else 0


def run_chaos(*, rounds: int, seed: int = 0, rollouts: int = 4, size_mb: int = 16, time_limit_s: float = 1200.0,
              address=None, log=sys.stderr, init_ray: bool = True) -> dict:
    import ray

    from tensorhub.server.find import find_server
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

    holdings = Holdings(cfg.versions_retained)

    def inst(name: str) -> str:
        return f"{name}-g{gen[name]}"

    def spawn(name: str):
        gen[name] += 1
        # A fresh replica id per generation: the killed one stays registered until its lease ends.
        (a,) = spawn_many(model, spec, [inst(name)], config=cfgd, replica=inst(name), spot=spot.get(name, False))
        holdings.spawn(inst(name), spot=spot.get(name, False))
        return a

    actors = {n: spawn(n) for n in names}
    digests: dict[int, str] = {}
    faults = collections.Counter()
    mid_read = collections.Counter()
    failures = collections.Counter()
    unexpected: list[dict] = []
    expected = 0
    verified = 0
    corrupt = 0
    done_rounds = 0

    def judge(rnd: int, fault: str, name: str, op: str, err: BaseException, at_s: float, killed: dict) -> None:
        nonlocal expected
        failures[_err_name(err)] += 1
        verdict, reason = classify(killed_self=inst(name) in killed, typed=_typed(err), copies=holdings.copies())
        print(f"round {rnd}: {inst(name)} {op}: {_err_name(err)}: {_err_msg(err)} -> {verdict.value} ({reason})", file=log)
        if verdict is Verdict.EXPECTED:
            expected += 1
            return
        unexpected.append({
            "round": rnd, "fault": fault, "actor": inst(name), "op": op, "error": _err_name(err),
            "message": _err_msg(err), "at_s": round(at_s, 3), "reason": reason,
            "killed": {a: round(t, 3) for a, t in killed.items()},
            "alive": holdings.alive(), "holders": holdings.holders(),
        })

    for rnd in range(1, rounds + 1):
        if time.perf_counter() - t_start > time_limit_s:
            break
        fault = rng.choice(FAULTS)
        faults[fault] += 1
        version = rnd
        t0 = time.time()
        try:
            digests[version] = ray.get(actors["trainer"].publish.remote(version), timeout=120)
        except Exception as e:  # noqa: BLE001
            judge(rnd, fault, "trainer", "publish", e, time.time() - t0, {})
            holdings.kill(inst("trainer"))
            actors["trainer"] = _replace(ray, actors, "trainer", spawn)
            continue
        holdings.publish(inst("trainer"), version)
        t0 = time.time()
        refs = {n: actors[n].update.remote("latest") for n in names[1:]}
        holdings.leave(inst(n) for n in names[1:])
        killed: dict[str, float] = {}  # instance -> seconds after the updates started

        def kill(name: str) -> None:
            killed[inst(name)] = time.time() - t0
            ray.kill(actors[name], no_restart=True)

        time.sleep(rng.uniform(0.0, 0.15))
        t_fault = time.time() - t0
        if fault == "kill_source":
            kill(rng.choice(names[1:]))
        elif fault == "spot_wave":
            for n in names[1:]:
                if spot[n] and rng.random() < 0.7:
                    kill(n)
        elif fault == "kill_server":
            try:
                ray.kill(find_server(cfg, model), no_restart=True)  # this model's server
            except ValueError:
                pass
        elif fault == "kill_trainer_after_publish":
            kill("trainer")
        # Replay the round in time order: kills, then each update's outcome when it arrived.
        events = [(t, 0, a, None) for a, t in killed.items()]
        # A success counts from its last byte (``finished_at``), a failure from when it arrived.
        events += [((out["finished_at"] if isinstance(out, dict) else t) - t0, 1, n, out)
                   for n, t, out in _settle(ray, refs, deadline_s=120)]
        if fault != "none" and any(at_s > t_fault for at_s, kind, _, _ in events if kind == 1):
            mid_read[fault] += 1  # the fault struck while a read was still in flight
        for at_s, _, who, out in sorted(events, key=lambda e: e[:2]):
            if out is None:
                holdings.kill(who)
            elif isinstance(out, BaseException):
                judge(rnd, fault, who, "update", out, at_s, killed)
            else:
                want = digests.get(out["version"])
                if want is None:
                    judge(rnd, fault, who, "update", UnknownVersionDigest(f"version {out['version']}"), at_s, killed)
                elif out["digest"] == want:
                    verified += 1
                    holdings.finish(inst(who), out["version"])
                else:
                    corrupt += 1
                    print(f"round {rnd}: {inst(who)} version {out['version']} CORRUPT", file=log)
        for a in killed:
            name = a.rsplit("-g", 1)[0]
            actors[name] = spawn(name)
        done_rounds = rnd
        print(f"round {rnd:3d} fault={fault:<26} verified={verified} failures={dict(failures)} "
              f"unexpected={len(unexpected)}", file=log)

    for a in actors.values():
        try:
            ray.get(a.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001
            pass
    try:
        ray.kill(find_server(cfg, model), no_restart=True)
    except Exception:  # noqa: BLE001
        pass
    return {
        "rounds": done_rounds,
        "faults": dict(faults),
        "faults_mid_read": dict(mid_read),
        "replicas_verified": verified,
        "failures": dict(failures),
        "expected_failures": expected,
        "unexpected_failures": len(unexpected),
        "unexpected": unexpected,
        "corrupt": corrupt,
        "seconds": round(time.perf_counter() - t_start, 2),
    }


class UnknownVersionDigest(Exception):
    """An update reported a version the driver never saw published: its bytes cannot be checked."""


def _settle(ray, refs: dict, deadline_s: float) -> list[tuple[str, float, object]]:
    """Wait for every ref; ``(name, time.time() when it was seen done, result or exception)``.
    Refs still running at the deadline come back as a ``GetTimeoutError``."""
    by_ref = {ref: n for n, ref in refs.items()}
    pending = list(by_ref)
    out = []
    t_end = time.time() + deadline_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, t_end - time.time()))
        now = time.time()
        if not ready:
            out += [(by_ref[r], now, ray.exceptions.GetTimeoutError(f"no answer in {deadline_s:.0f} s")) for r in pending]
            break
        for r in ready:
            try:
                out.append((by_ref[r], now, ray.get(r)))
            except Exception as e:  # noqa: BLE001 - judged by the caller
                out.append((by_ref[r], now, e))
    return out


def _replace(ray, actors: dict, name: str, spawn):
    try:
        ray.kill(actors[name], no_restart=True)
    except Exception:  # noqa: BLE001
        pass
    return spawn(name)


def _typed(e: BaseException) -> bool:
    from tensorhub.errors import TensorHubError

    return isinstance(getattr(e, "cause", None) or e, TensorHubError)


def _err_msg(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    return str(cause if cause is not None else e).splitlines()[-1][:300]


def _err_name(e: BaseException) -> str:
    """The typed TensorHub error inside a Ray task error, else the exception's class name."""
    cause = getattr(e, "cause", None)
    if cause is not None:
        return type(cause).__name__
    return type(e).__name__
