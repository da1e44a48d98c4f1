"""The examples in examples/ run as a user runs them (a subprocess each) and do what they say.

Each example starts its own local Ray cluster (``--address local``: never an existing cluster on
this machine) or, for submit_job.sh, a ``ray start --head`` cluster on private ports that the
script stops itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _last_json(stdout: str) -> dict:
    """The last stdout line that is a JSON object (NIXL and Ray may log on stdout before it)."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in output:\n{stdout[-3000:]}")


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    return p


def test_rl_loop_tensorhub_part_is_at_most_40_lines():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import rl_loop
    finally:
        sys.path.remove(str(EXAMPLES))
    n = rl_loop.tensorhub_loc(str(EXAMPLES / "rl_loop.py"))
    assert 0 < n <= 40, n
    n = rl_loop.tensorhub_loc(str(EXAMPLES / "vllm_rl.py"))  # run in the vllm environment's tests
    assert 0 < n <= 40, n
    # nothing of ours outside the markers but the import
    text = (EXAMPLES / "rl_loop.py").read_text()
    outside, inside = [], False
    for line in text.splitlines():
        s = line.strip()
        if s in ("# --- tensorhub ---", "# --- end tensorhub ---"):
            inside = s == "# --- tensorhub ---"
        elif not inside and "hub." in s and not s.startswith("#"):
            outside.append(s)
    assert outside == [], outside


@pytest.mark.ray
def test_rl_loop_reward_improves_with_weights_moved_by_tensorhub():
    """30 REINFORCE steps, 2 rollouts on-policy (the driver checks every batch's version):
    the mean reward of the last steps is far above the first steps' (random policy ~ 1/16)."""
    p = _run([sys.executable, str(EXAMPLES / "rl_loop.py"), "--steps", "30", "--rollouts", "2",
              "--json", "--address", "local"], timeout_s=240)
    out = _last_json(p.stdout)
    assert out["steps"] == 30 and out["versions_published"] == 30 and out["rollouts"] == 2, out
    assert out["reward_first"] < 0.25, out
    assert out["reward_last"] > out["reward_first"] + 0.3, out
    assert out["weight_sync_s"] > 0 and 0 < out["weight_sync_loc"] <= 40, out


@pytest.mark.ray
def test_reshard_example_gives_every_engine_rank_exactly_its_slice():
    """examples/reshard.py: a 2-shard row-split trainer, a TP=2 engine with vLLM's fused layout and
    a TP=1 engine, each rank a Ray actor: every step every rank holds its slice of that step,
    each TP=2 rank received half the model's bytes (its slice; the norm both), TP=1 all of it."""
    p = _run([sys.executable, str(EXAMPLES / "reshard.py"), "--steps", "2", "--address", "local"], timeout_s=240)
    out = _last_json(p.stdout)
    assert out["steps"] == 2 and out["all_exact"], out
    norm = 256 * 4
    assert out["tp2_rank_bytes"] == [(out["model_bytes"] - norm) // 2 + norm] * 2, out
    assert out["tp1_bytes"] == out["model_bytes"], out


@pytest.mark.ray
def test_attach_existing_actor_gets_the_trainers_weights_directly_and_through_the_graph_mixin():
    """A foreign actor class (two lines in __init__ + update) and a GraphMember group (compiled
    graph path) compute with exactly the trainer's weights after versions 1 and 2."""
    p = _run([sys.executable, str(EXAMPLES / "attach_existing_actor.py"), "--json", "--address", "local",
              "--path", "graph", "--generators", "2"], timeout_s=240)
    out = _last_json(p.stdout)
    assert out["ok"] is True, out
    assert out["scorer_differs_before_update"] and out["scorer_matches_trainer"] and out["scorer_matches_trainer_2"], out
    assert (out["scorer_version"], out["scorer_version_2"]) == (1, 2), out
    assert out["group_path"] == "graph" and (out["group_version"], out["group_version_2"]) == (1, 2), out
    assert out["generators_match_trainer"] and out["generators_match_trainer_2"], out


@pytest.mark.ray
def test_submit_job_script_runs_the_rl_loop_as_a_ray_job_that_succeeds_and_stops_its_head():
    """examples/submit_job.sh: ray start --head (private ports and temp dir), ray job submit
    --working-dir, ray job logs/status; the job SUCCEEDED, its JSON shows the reward improving,
    and no process of the head's session is left afterwards."""
    p = _run(["bash", str(EXAMPLES / "submit_job.sh"), "--steps", "25", "--rollouts", "2"], timeout_s=420)
    out = _last_json(p.stdout)
    assert out["steps"] == 25 and out["reward_last"] > out["reward_first"] + 0.2, out
    assert "succeeded" in p.stdout.lower()
    head = next(line for line in p.stdout.splitlines() if line.startswith("head: pid "))
    sid = head.split()[2].rstrip(",")
    deadline = time.monotonic() + 20.0  # a loaded machine: an idle worker may take a moment to exit
    while True:
        left = subprocess.run(["ps", "-o", "pid=,stat=,cmd=", "--sid", sid], capture_output=True, text=True).stdout
        alive = [ln for ln in left.splitlines() if ln.split()[1][0] != "Z"]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert alive == [], left
