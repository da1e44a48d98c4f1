"""benchmarks/delta_density.py: its delta codecs are lossless, and a tiny run prints its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import delta_density
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return delta_density


def test_every_codec_rebuilds_the_new_version_bit_exact_and_varints_round_trip():
    dd = _bench()
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1 << 16, 100_000, dtype=np.uint16)
    new = base.copy()
    idx = rng.choice(base.size, 3_000, replace=False)
    new[idx] += rng.choice(np.array([1, 2, 0xFFFF, 0x8000], np.uint16), idx.size)  # +-ulps, a sign flip
    new[[0, base.size - 1]] ^= 1  # the first and last element: gaps of 0 and to the end
    for name, codec in dd.codecs().items():
        out = base.copy()
        codec.apply(out, codec.encode(base, new))
        assert np.array_equal(out, new), name
        out = new.copy()
        codec.apply(out, codec.encode(new, new))  # an empty delta is a no-op
        assert np.array_equal(out, new), name
    v = np.array([0, 1, 127, 128, 16383, 16384, (1 << 31) - 1], np.int64)
    assert np.array_equal(dd.varint_decode(dd.varint_encode(v)), v)


def test_a_tiny_run_prints_one_json_line_with_every_mode_and_codec():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "delta_density.py"), "--json", "--steps", "2",
                          "--lrs", "1e-5", "--hidden", "64"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["mode"] for r in res["runs"]] == ["fp32_master", "bf16"]
    for r in res["runs"]:
        assert len(r["steps"]) == 2 and 0 < r["summary"]["changed_median"] < 1
        assert set(r["summary"]["codecs"]) == set(res["codecs"]) >= {"sparse_i32", "sparse_diff_zlib1", "planes_zlib1"}
    assert res["random_fill"]["sparse_diff_zlib1"]["ratio"] > 0.5  # a fresh fill is no delta
