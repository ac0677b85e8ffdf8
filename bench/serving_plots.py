"""PNG plots of bench/serving.py results: latency CDFs per run, output throughput against load."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any


def plot(runs: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Latency CDFs (TTFT, ITL, E2E) per run and output throughput against load."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plots", file=sys.stderr)
        return []
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in zip(axes, ("ttft", "itl", "e2e"), ("TTFT", "ITL", "E2E latency")):
        for r in runs:
            vals = sorted(v * 1e3 for v in r["raw"][key] if not math.isnan(v))
            if vals:
                ys = [(i + 1) / len(vals) for i in range(len(vals))]
                ax.step(vals, ys, where="post", label=f"{r['target']} {r['load']}")
        ax.set(
            title=f"{title} CDF",
            xlabel="ms",
            ylabel="fraction of requests" if key != "itl" else "fraction of gaps",
        )
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name in dict.fromkeys(r["target"] for r in runs):
        rs = [r for r in runs if r["target"] == name]
        ax.plot(
            [r["load_value"] for r in rs],
            [r["summary"]["output_throughput"] for r in rs],
            marker="o",
            label=name,
        )
    kind = runs[0]["load_kind"] if runs else "concurrency"
    ax.set(xlabel=kind, ylabel="output tokens/s", title=f"output throughput vs {kind}")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
