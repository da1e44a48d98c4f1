"""``TENSORHUB_LOG=LEVEL``: TensorHub's own log lines in every process that runs it.

TensorHub logs through the standard :mod:`logging` loggers under ``tensorhub`` and configures no
handler (that is the application's business). In a Ray actor nobody does, so the reference
server's and the handles' INFO lines (which replica seeds which datacenter, each read's sources
and time) are lost. Set ``TENSORHUB_LOG=INFO`` (or ``DEBUG``, ``WARNING``) in the job's
environment (``runtime_env={"env_vars": {...}}`` reaches every actor) and each process that opens a
handle or runs a server writes them to its stderr -- for a Ray actor, its worker log file.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s %(message)s"
_configured = False


def configure_from_env() -> None:
    """Give the ``tensorhub`` logger a stderr handler at ``TENSORHUB_LOG``'s level, once per
    process; nothing if the variable is unset or empty. An unknown level name is ignored with a
    warning (a typo must not break a job)."""
    global _configured
    level_name = os.environ.get("TENSORHUB_LOG", "").strip().upper()
    if _configured or not level_name:
        return
    _configured = True
    level = logging.getLevelName(level_name)
    root = logging.getLogger("tensorhub")
    if not isinstance(level, int):
        root.warning("TENSORHUB_LOG=%r is not a logging level; ignored", level_name)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
