"""PNG plots of the benchmarks that produce a series (the ``bench`` extra: matplotlib).

The benchmarks call these through their ``--plot PATH`` flag; the same plots can be redrawn
from a saved JSON summary (a benchmark's last stdout line)::

    python benchmarks/plots.py pipeline benchmarks/pipeline.json benchmarks/pipeline.png
    python benchmarks/plots.py failover benchmarks/failover.json benchmarks/failover.png
    python benchmarks/plots.py vllm_update benchmarks/vllm_update.json benchmarks/vllm_update.png

(``benchmarks/fanout.py`` draws its own plot.)
"""

from __future__ import annotations

import json
import sys


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pipeline(summary: dict, path: str) -> None:
    """Time until the last of N readers has the version, per path (pull, graph, none)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for p in ("pull", "graph", "none"):
        rows = sorted((r for r in summary["results"] if r["path"] == p), key=lambda r: r["n"])
        if rows:
            ax.plot([r["n"] for r in rows], [r["total_s"] for r in rows], marker="o", label=p)
    ns = sorted({r["n"] for r in summary["results"]})
    ax.set_xticks(ns)
    ax.set_xlabel("readers N")
    ax.set_ylabel("seconds until the last reader has the version")
    ax.set_title(f"pipeline: one holder, N readers, {summary['bytes'] / 2**20:.0f} MiB")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_failover(summary: dict, path: str) -> None:
    """B's completion time against the time A (its partial source) was killed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = sorted(summary["results"], key=lambda r: r["fault_at_s"])
    ax.plot([r["fault_at_s"] for r in rows], [r["b_total_s"] for r in rows], marker="o", label="A killed at x")
    ax.axhline(summary["no_fault_s"], color="gray", linestyle="--", label="no fault")
    bad = [r for r in rows if not r["b_bytes_ok"]]
    if bad:
        ax.scatter([r["fault_at_s"] for r in bad], [r["b_total_s"] for r in bad], color="red", zorder=3,
                   label="bytes wrong")
    ax.set_xlabel("A killed at (s after B asked)")
    ax.set_ylabel("B total seconds")
    ax.set_title(f"failover: holder -> A -> B, {summary['bytes'] / 2**20:.0f} MiB")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_vllm_update(summary: dict, path: str) -> None:
    """Seconds per weight update into 1 and 2 vLLM engines, per path (benchmarks/vllm_update.py)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    paths = list(summary["seconds"])
    width = 0.38
    for i, n in enumerate(("1", "2")):
        xs = [k + (i - 0.5) * width for k in range(len(paths))]
        ax.bar(xs, [summary["seconds"][p][n] for p in paths], width, label=f"{n} engine{'s' if n != '1' else ''}")
    ax.set_xticks(range(len(paths)))
    ax.set_xticklabels([p.replace("tensorhub_", "tensorhub\n") for p in paths], fontsize=8)
    ax.set_ylabel("seconds per update (best repetition)")
    ax.set_title(f"one update into vLLM engines (CPU build), {summary['model_bytes'] / 2**20:.0f} MiB model")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLOTS = {"pipeline": plot_pipeline, "failover": plot_failover, "vllm_update": plot_vllm_update}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in PLOTS:
        print(__doc__, file=sys.stderr)
        return 2
    kind, src, dst = argv
    with open(src) as f:
        PLOTS[kind](json.load(f), dst)
    print(f"plot written to {dst}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
