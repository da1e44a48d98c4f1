"""TENSORHUB_LOG: TensorHub's log lines in a process nobody configured logging in (a Ray actor)."""

from __future__ import annotations

import os
import subprocess
import sys

_SCRIPT = """
import logging
from tensorhub.logs import configure_from_env
configure_from_env(); configure_from_env()  # once per process, whatever the calls
logging.getLogger("tensorhub.core.reference").info("seeded %d", 7)
logging.getLogger("tensorhub.client").debug("hidden at INFO")
logging.getLogger("elsewhere").warning("not ours")
"""


def _run(level):
    env = {"PATH": "/usr/bin:/bin"} | ({"TENSORHUB_LOG": level} if level is not None else {})
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=60)


def test_tensorhub_log_sets_a_stderr_handler_at_its_level_once():
    out = _run("info")
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "tensorhub." in ln]
    assert len(lines) == 1 and "INFO tensorhub.core.reference seeded 7" in lines[0]
    assert "hidden at INFO" not in out.stderr


def test_without_tensorhub_log_nothing_is_configured_and_a_bad_level_is_ignored():
    quiet = _run(None)
    assert quiet.returncode == 0 and "seeded 7" not in quiet.stderr
    bad = _run("LOUD")
    assert bad.returncode == 0, bad.stderr
    assert "seeded 7" not in bad.stderr and "TENSORHUB_LOG='LOUD' is not a logging level" in bad.stderr
