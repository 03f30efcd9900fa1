"""`lowbit bench plot RESULTS...`: one PNG comparing result files of `lowbit bench`.

Four panels, x = output tok/s at each load level, y = median and p99 of TTFT (left) and TPOT
(right), a line per result file (its label, else its model) with each point marked by its load
(c=16, 2/s). Several servers benched with the same flags then read side by side: further right is
more throughput, lower is faster replies.
"""

from __future__ import annotations

import json
from pathlib import Path


def _load(path: Path) -> tuple[str, list[dict]]:
    doc = json.loads(path.read_text())
    rows = [r for r in doc["results"] if r.get("completed")]
    if not rows:
        raise ValueError(f"{path}: no load level with a completed request")
    return doc.get("label") or doc.get("model") or path.stem, rows


def plot(paths: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    runs = [_load(p) for p in paths]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    panels = [("ttft", "median", axes[0][0]), ("ttft", "p99", axes[1][0]),
              ("tpot", "median", axes[0][1]), ("tpot", "p99", axes[1][1])]
    for label, rows in runs:
        x = [r["output_throughput"] for r in rows]
        loads = [f"c={r['max_concurrency']}" if r.get("request_rate") is None else f"{r['request_rate']:g}/s"
                 for r in rows]
        for metric, stat, ax in panels:
            y = [r[f"{stat}_{metric}_ms"] for r in rows]
            line, = ax.plot(x, y, marker="o", label=label)
            for xi, yi, load in zip(x, y, loads):
                if yi is not None:
                    ax.annotate(load, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8,
                                color=line.get_color())
    for metric, stat, ax in panels:
        ax.set_title(f"{stat} {metric.upper()}")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("output tokens/s (all requests)")
    axes[0][0].legend(fontsize=9)
    fig.suptitle("lowbit bench: throughput against latency, per load level")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
