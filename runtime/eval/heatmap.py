"""The heat map of an attribution (`lowbit eval --reference REF MODEL --weights L --attribute --plot heat.png`):
one row per layer, one column per tensor kind (wq … w_down, then K and V when KV sides were measured), the
color log10 of the KL that tensor alone at L costs (runtime/eval/attribution.py). Tensors outside the blocks
(an embedding or LM head a float layout changes) take a row of their own at the bottom.

A part's KL estimate can come out at or below 0 where quantizing it changes nothing the reference's top-k
and tail draws see (runtime/eval/topk_kl.py: the tail is estimated, not clamped); such a cell cannot sit on a
log scale and is drawn grey. A kind a layer does not have (a hybrid's recurrent layers) is left blank.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

KINDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # a dense block's, in the order it uses them
SIDES = ("K", "V")  # a layer's KV cache sides (runtime/eval/attribution.py)


def columns(parts: list[dict]) -> list[str]:
    """The kinds present: a dense block's in the order it uses them, then any others sorted, then K, V."""
    kinds = {p["kind"] for p in parts}
    return [k for k in KINDS if k in kinds] + sorted(kinds - set(KINDS) - set(SIDES)) + \
        [k for k in SIDES if k in kinds]


def heatmap(parts: list[dict], out: Path, title: str = "") -> None:
    """parts: the attribution's rows (Part.as_dict: layer, kind, kl_mean). Writes the PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    import numpy as np

    cols = columns(parts)
    layers = sorted({p["layer"] for p in parts if p["layer"] is not None})
    outside = any(p["layer"] is None for p in parts)
    rows = [str(i) for i in layers] + (["model"] if outside else [])
    grid = np.full((len(rows), len(cols)), np.nan)  # [layers (+1), kinds]: log10 KL; NaN: no such tensor
    nonpos = np.zeros_like(grid, dtype=bool)  # a KL estimate <= 0: grey
    for p in parts:
        r = len(layers) if p["layer"] is None else layers.index(p["layer"])
        c = cols.index(p["kind"])
        if p["kl_mean"] > 0:
            grid[r, c] = math.log10(p["kl_mean"])
        else:
            nonpos[r, c] = True
    # a column per kind, but wide enough for the title (two KV columns alone would clip it)
    width = max(6.5, 1.0 + 0.9 * len(cols))
    fig, ax = plt.subplots(figsize=(width, 1.5 + 0.25 * len(rows)))
    ax.imshow(np.where(nonpos, 1.0, np.nan), cmap="Greys", vmin=0, vmax=4, aspect="auto", interpolation="nearest")
    im = ax.imshow(grid, cmap="magma_r", aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows, fontsize=7 if len(rows) > 24 else 9)
    ax.set_xlabel("tensor" + (" (K, V: one layer's cache side)" if any(k in SIDES for k in cols) else ""))
    ax.set_ylabel("layer")
    ax.tick_params(axis="x", labelrotation=45)
    fig.colorbar(im, ax=ax, label="log10 KL alone" + ("; grey: <= 0" if nonpos.any() else ""))
    if title:
        ax.set_title("\n".join(textwrap.wrap(title, int(width * 11))), fontsize=9)  # ~11 characters an inch at 9 pt
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
