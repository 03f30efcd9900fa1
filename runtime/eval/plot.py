"""The Pareto chart of a `lowbit eval` run: what each (weights, KV) pair costs in quality against
what it holds in memory.

x = bytes held for weights + KV cache at a stated context length and batch (KV bytes/token x
ctx x batch), y = mean KL divergence from the reference (log scale), one labelled point per row.
A row is on the frontier when no other row is at least as small and at least as faithful; those
are joined and drawn filled, the rest hollow. Rows with KL exactly 0 (the reference itself, a
lossless relayout) cannot sit on a log axis: they are drawn on a line marked "0" below the
smallest KL measured.

`lowbit eval plot A.json B.json` draws the rows of several runs in one chart (a weights sweep and a
KV sweep, say); they must have measured the same model, text, window length and windows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def memory_bytes(row: dict, ctx: int, batch: int) -> int:
    return row["weight_bytes"] + row["kv_bytes_per_token"] * ctx * batch


def frontier(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the Pareto-optimal points (minimize both x and y), in order of x: a point is
    dropped when another is no larger in both and smaller in one."""
    keep = [i for i, (x, y) in enumerate(points)
            if not any((x2 <= x and y2 <= y) and (x2 < x or y2 < y) for x2, y2 in points)]
    return sorted(keep, key=lambda i: points[i])


def label(row: dict) -> str:
    """weights · KV, after the file's name where rows come from several files (`--reference`)."""
    return (f"{row['model']} " if row.get("model") else "") + f"{row['weights']} · {row['kv']}"


def _labels(rows: list[dict], xs: list[float], ys: list[float], on: set[int]):
    """One label per distinct point: rows at the same memory and KL (a lossless relayout and the
    layout it equals) share it, joined by '='. → (x, y, text, any on the frontier), top first."""
    groups: dict[tuple[float, float], list[int]] = {}
    for i in range(len(rows)):
        groups.setdefault((round(xs[i], 3), ys[i]), []).append(i)
    out = [(xs[g[0]], ys[g[0]], " = ".join(label(rows[i]) for i in g), any(i in on for i in g))
           for g in groups.values()]
    return sorted(out, key=lambda t: (-t[1], t[0]))


def plot(rows: list[dict], out: Path, ctx: int, batch: int, title: str = "") -> list[dict]:
    """Writes the PNG; returns the frontier rows (cheapest first)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    xs = [memory_bytes(r, ctx, batch) / 2**20 for r in rows]  # MiB
    positive = [r["kl_mean"] for r in rows if r["kl_mean"] > 0]
    zero_y = 10 ** math.floor(math.log10(min(positive)) - 1) if positive else 1e-6
    ys = [r["kl_mean"] if r["kl_mean"] > 0 else zero_y for r in rows]
    best = frontier(list(zip(xs, ys)))

    fig, ax = plt.subplots(figsize=(13, 6.5))
    on = set(best)
    ax.plot([xs[i] for i in best], [ys[i] for i in best], color="tab:green", lw=1.5, zorder=1, label="frontier")
    for i, r in enumerate(rows):
        peer = r["weights"].startswith(("llama.cpp", "bnb-"))
        color = "tab:orange" if peer else "tab:blue"
        ax.scatter(xs[i], ys[i], s=46, zorder=2, marker="s" if peer else "o", edgecolors=color,
                   facecolors=color if i in on else "white")
    # frontier points are labelled in place (they lie apart along the frontier); the others, often
    # clustered (every requantized 4-bit layout lands near the same spot), get a number and a line in
    # the key beside the plot
    key = []
    for x, y, names, best_here in _labels(rows, xs, ys, on):
        if best_here:
            ax.annotate(names, (x, y), textcoords="offset points", xytext=(6, 3), fontsize=7.5)
        else:
            kl = "0" if y == zero_y else f"{y:.3g}"
            key.append(f"{len(key) + 1:>2}  {names}: KL {kl}, {x:.0f} MiB")
            ax.annotate(str(len(key)), (x, y), textcoords="offset points", xytext=(-4, 5), fontsize=7,
                        color="dimgray", ha="right")
    if key:
        fig.text(0.715, 0.88, "not on the frontier:\n" + "\n".join(key), fontsize=7.5, va="top", family="monospace")
    ax.set_yscale("log")
    if any(r["kl_mean"] == 0 for r in rows):
        ax.axhline(zero_y, color="gray", lw=0.6, ls=":")
        ax.annotate("KL = 0 (exact)", (0.01, zero_y), xycoords=("axes fraction", "data"), xytext=(0, -11),
                    textcoords="offset points", fontsize=8, color="gray")
    ax.set_xlabel(f"memory held, MiB: weights + KV cache for {batch} x {ctx} tokens")
    ax.set_ylabel("mean KL divergence from the reference (log)")
    ax.grid(True, which="both", alpha=0.25)
    ax.scatter([], [], marker="o", edgecolors="tab:blue", facecolors="white", label="lowbit")
    ax.scatter([], [], marker="s", edgecolors="tab:orange", facecolors="white", label="bitsandbytes / llama.cpp")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(title or "lowbit eval: quality against memory (filled: on the frontier)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.71, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [rows[i] for i in best]



def merge(paths: list[Path]) -> tuple[dict, list[dict]]:
    """The rows of several `lowbit eval --out` files, each (weights, KV) pair once. Raises
    ValueError when the runs did not measure the same thing (their reference perplexities differ)."""
    docs = [json.loads(p.read_text()) for p in paths]
    first = docs[0]
    rows: dict[tuple[str, str], dict] = {}
    for p, doc in zip(paths, docs):
        same = all(doc[k] == first[k] for k in ("model", "text", "ctx", "windows"))
        if not same or doc["reference"]["ppl"] != first["reference"]["ppl"]:
            raise ValueError(f"{p} measured a different model, text or windows than {paths[0]}")
        for r in doc["rows"]:
            rows.setdefault((r["weights"], r["kv"]), r)
    return first, list(rows.values())
