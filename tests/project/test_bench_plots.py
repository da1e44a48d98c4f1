"""benchmarks/plots.py draws the PNGs RESULTS.md shows, from a benchmark's JSON summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", ["pipeline", "failover"])
def test_plot_from_the_shipped_summary_is_a_png_and_results_md_shows_it(kind, tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plots
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / f"{kind}.png"
    plots.PLOTS[kind](json.loads((ROOT / "benchmarks" / f"{kind}.json").read_text()), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"]({kind}.png)" in (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert (ROOT / "benchmarks" / f"{kind}.png").read_bytes()[:4] == b"\x89PNG"
