"""Shared fixtures. One local Ray cluster per test session (ray.init costs 7-9 s here)."""

from __future__ import annotations

import os
import uuid

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every ``ray`` test; over-subscribed CPUs are fine."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=16, namespace=f"tensorhub-tests-{uuid.uuid4().hex[:6]}",
                 include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def model_name(request) -> str:
    """A model name unique to the test, so tests sharing the server never interfere."""
    return f"{request.node.name[:40]}-{uuid.uuid4().hex[:6]}"
