"""`lowbit fit --memory 120MB --ctx 8k --reference REF MODEL`: the layout of each weight matrix and the bits of
each layer's K and V that give the least KL against a saved reference (runtime/eval/reference.py) within a
byte budget for the weights plus one sequence's KV cache at that context.

The data are measured, first order: each matrix alone at each candidate layout and each layer's K and V alone
at each bit width, every other part at the file's lossless layout and f16 (runtime/eval/attribution.py), with
their bytes. The choice is a greedy knapsack: every part starts at its smallest option; then, while bytes are
left, the one step up (to any larger option of one part) that removes the most KL per byte is taken. A part's
options that cost more bytes for no less KL are dropped first, so each step is a real trade.

Parts interact, so the sum of the chosen parts' KLs predicts the recipe's KL only roughly (on the default model
at int4-g128 the 210 tensors' sum was 0.75x the whole's: docs/quality.md): the recipe is then built and scored
against the reference like any candidate, and beside it every uniform layout x KV format that fits the same
budget, so the figure printed is a measurement and the comparison is fair.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lowbit.models.llama import Llama
from lowbit.quant.kv import KV_FORMATS, KVFormat, parse_kv_format, side_format
from lowbit.runtime.engine.kv_cache import bytes_per_token
from lowbit.runtime.eval.attribution import attribute
from lowbit.runtime.eval.candidates import score
from lowbit.runtime.eval.heatmap import SIDES
from lowbit.runtime.eval.reference import SavedReference
from lowbit.runtime.load.recipe import Recipe, chosen

KV_BITS = (16, 8, 4)  # a side's options; 16 is f16, the reference's


@dataclass
class Option:
    label: str  # a layout ("int4-g128"), or a KV side's bits ("8")
    bytes: int  # a matrix's bytes held at that layout; a KV side's bytes for one sequence at the context
    kl: float  # the model's KL with this part alone at this option (0 at the reference's own)


@dataclass
class Item:
    name: str  # "layers.3.wq", "layers.3.experts.w_gate", "layers.3.K"
    layer: int | None
    kind: str  # "wq" … "w_down", "K", "V"
    keys: tuple[str, ...]  # the weights it covers (none for a KV side)
    options: list[Option] = field(default_factory=list)
    pick: int = 0  # index into options

    @property
    def chosen(self) -> Option:
        return self.options[self.pick]


def frontier(options: list[Option]) -> list[Option]:
    """The options by bytes, each with less KL than every smaller one (the rest buy nothing)."""
    out: list[Option] = []
    for o in sorted(options, key=lambda o: (o.bytes, o.kl)):
        if not out or o.kl < out[-1].kl:
            out.append(o)
    return out


def choose(items: list[Item], budget: int) -> int:
    """Set each item's pick: the greedy knapsack of the module's docstring → bytes left. budget: bytes for the
    items (the fixed bytes already taken off). ValueError when even the smallest options do not fit."""
    for it in items:
        it.options, it.pick = frontier(it.options), 0
    left = budget - sum(it.chosen.bytes for it in items)
    if left < 0:
        raise ValueError(f"the smallest choice needs {-left:,} bytes more than the budget")
    while True:
        best, step = 0.0, None
        for it in items:
            cur = it.chosen
            for j in range(it.pick + 1, len(it.options)):
                o = it.options[j]
                cost = o.bytes - cur.bytes
                if cost <= left and (cur.kl - o.kl) / cost > best:
                    best, step = (cur.kl - o.kl) / cost, (it, j)
        if step is None:
            return left
        it, j = step
        left -= it.options[j].bytes - it.chosen.bytes
        it.pick = j


def nbytes(w) -> int:
    """Bytes a weight holds (a packed matrix's `nbytes`, a float vector's elements)."""
    return w.nbytes if hasattr(w, "spec") else w.numel() * w.element_size()


def kv_side_bytes(config, bits: int, side: str) -> int:
    """One layer's K or V ("K" | "V") at `bits`, per token."""
    fmt = side_format(bits if side == "K" else 16, bits if side == "V" else 16)
    return config.n_kv_heads * fmt.side_bytes(side.lower(), config.head_dim)


def kv_bytes(config, kv: list[KVFormat], ctx: int) -> int:
    """A pool of one format per attention layer, for one sequence of ctx tokens."""
    return bytes_per_token(kv[0], len(kv), config.n_kv_heads, config.head_dim, kv) * ctx


def measure(saved: SavedReference, config, ref_w: Mapping, weights_at: Callable[[str], Mapping], lossless: str,
            layouts: list[str], kv_bits: list[int], backend, progress=None) -> list[Item]:
    """The items, each with its measured options (a KV side's bytes per token: `at_ctx` sizes them).
    weights_at(layout) → the model's weights at that layout (runtime/load/loader.py read_weights);
    progress(total, desc) → a tqdm-like bar, or None."""
    items: dict[str, Item] = {}
    for layout in layouts:
        cand_w = weights_at(layout)
        att = attribute(saved, config, ref_w, cand_w, backend, None,
                        (lambda n, d=f"each tensor alone at {layout}": progress(n, d)) if progress else None)
        for p in att.parts:
            it = items.setdefault(p.name, Item(p.name, p.layer, p.kind, p.keys,
                                               [Option(lossless, sum(nbytes(ref_w[k]) for k in p.keys), 0.0)]))
            it.options.append(Option(layout, sum(nbytes(cand_w[k]) for k in p.keys), p.kl_mean))
        del cand_w, att
        gc.collect()
    for bits in kv_bits:
        att = attribute(saved, config, ref_w, ref_w, backend, side_format(bits, bits),
                        (lambda n, d=f"each K and V alone at {bits} bits": progress(n, d)) if progress else None)
        for p in att.parts:
            it = items.setdefault(p.name, Item(p.name, p.layer, p.kind, (),
                                               [Option("16", kv_side_bytes(config, 16, p.kind), 0.0)]))
            it.options.append(Option(str(bits), kv_side_bytes(config, bits, p.kind), p.kl_mean))
    return list(items.values())


def least_bytes(config, ref_w: Mapping, layouts: list[str], kv_bits: list[int], ctx: int) -> int:
    """A floor on any choice's bytes, before anything is measured: each matrix at its smallest layout by the
    layouts' own arithmetic (runtime/load/fits.py spec_bytes), each KV side at its fewest bits."""
    from lowbit.quant import parse_weights
    from lowbit.runtime.load.fits import spec_bytes

    specs = [parse_weights(name) for name in layouts]
    total = 0
    for k in ref_w:
        w = ref_w[k]
        n = w.shape[0] * w.shape[1] if hasattr(w, "spec") else 0
        total += min([nbytes(w), *(spec_bytes(n, s) for s in specs if n)])
    bits = min(kv_bits, default=16)
    return total + sum(kv_side_bytes(config, bits, side) for _ in config.attention_layers for side in SIDES) * ctx


def at_ctx(items: list[Item], ctx: int) -> list[Item]:
    """The items with each KV side's bytes for one sequence of ctx tokens (measure's are per token)."""
    return [Item(it.name, it.layer, it.kind, it.keys,
                 [Option(o.label, o.bytes * ctx, o.kl) for o in it.options] if it.kind in SIDES else list(it.options))
            for it in items]


def save(path: Path, key: dict, items: list[Item]) -> None:
    """The measurements, for another budget or context without measuring again (`lowbit fit --data`)."""
    path.write_text(json.dumps({"key": key, "items": [asdict(it) for it in items]}) + "\n")


def load(path: Path, key: dict) -> list[Item] | None:
    """The measurements saved in `path` for this key (model, reference, windows, options), or None."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("key") != key:
            return None
        items = [Item(d["name"], d["layer"], d["kind"], tuple(d["keys"]), [Option(**o) for o in d["options"]])
                 for d in doc["items"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return items


def fixed_bytes(ref_w: Mapping, items: list[Item]) -> int:
    """The bytes no choice changes: vectors, and matrices every layout holds alike (an embedding table)."""
    covered = {k for it in items for k in it.keys}
    return sum(nbytes(ref_w[k]) for k in ref_w if k not in covered)


def recipe_of(items: list[Item], config, model: str, lossless: str, ctx: int, budget: int, fixed: int) -> Recipe:
    """The picks as a recipe, with their first-order prediction."""
    layouts = {k: it.chosen.label for it in items if it.kind not in SIDES and it.chosen.label != lossless
               for k in it.keys}
    bits = {(it.layer, it.kind): int(it.chosen.label) for it in items if it.kind in SIDES}
    kv = [side_format(bits.get((i, "K"), 16), bits.get((i, "V"), 16)).name for i in config.attention_layers]
    w = fixed + sum(it.chosen.bytes for it in items if it.kind not in SIDES)
    predicted = {"kl": sum(it.chosen.kl for it in items), "weight_bytes": w,
                 "kv_bytes": kv_bytes(config, [parse_kv_format(n) for n in kv], ctx)}
    return Recipe(model, lossless, layouts, kv, ctx, budget, predicted)


def build(config, recipe: Recipe, weights_at: Callable[[str], Mapping], backend) -> Llama:
    """The recipe's model (its KV formats are the pool's to take)."""
    with torch.no_grad():
        return Llama(config, chosen(recipe, {n: weights_at(n) for n in recipe.used}), backend).eval()


def held(model: Llama) -> int:
    return sum(b.numel() * b.element_size() for b in model.buffers())


@dataclass
class Uniform:
    weights: str
    kv: str
    bytes: int  # weights held + one sequence's KV at the context
    kl: dict | None = None  # the TopkScores summary, when measured


def uniforms(saved: SavedReference, config, weights_at: Callable[[str], Mapping], layouts: list[str], ctx: int,
             budget: int, backend, progress=None) -> list[Uniform]:
    """Every uniform layout x KV format (f16, k8v8, k8v4, k4v4); those within the budget scored (KL), the
    others listed with their bytes only."""
    kvs = [n for n in KV_FORMATS if n != "f32"]
    out = []
    for layout in layouts:
        with torch.no_grad():
            model = Llama(config, weights_at(layout), backend).eval()
        w = held(model)
        rows = [Uniform(layout, kv, w + kv_bytes(config, [KV_FORMATS[kv]] * len(config.attention_layers), ctx))
                for kv in kvs]
        fit = [r for r in rows if r.bytes <= budget]
        if fit:
            bar = progress(saved.ids.shape[0], f"every KV format that fits at {layout}") if progress else None
            try:
                for r, s in zip(fit, score(saved, model, [r.kv for r in fit], bar)):
                    r.kl = s
            finally:
                if bar is not None:
                    bar.close()
        out += rows
        del model
        gc.collect()
    return out


def score_recipe(saved: SavedReference, config, recipe: Recipe, weights_at: Callable[[str], Mapping],
                 layouts: list[str], backend, progress=None) -> list[Uniform]:
    """Build the recipe and score it against the reference (its figures and bytes into recipe.measured, with the
    best uniform choice that fits the same budget) → every uniform row (`uniforms`)."""
    model = build(config, recipe, weights_at, backend)
    kv = [parse_kv_format(k) for k in recipe.kv]
    s = score(saved, model, [kv])[0]
    recipe.measured = {"kl": s["kl_mean"], "kl_tail_bound": s["kl_tail_bound"], "top1_pct": s["top1_pct"],
                       "ppl": s["ppl"], "weight_bytes": held(model), "kv_bytes": kv_bytes(config, kv, recipe.ctx),
                       "windows": saved.ids.shape[0]}
    del model
    gc.collect()
    rows = uniforms(saved, config, weights_at, layouts, recipe.ctx, recipe.memory_bytes, backend, progress)
    fit = [r for r in rows if r.kl]
    if fit:
        best = min(fit, key=lambda r: r.kl["kl_mean"])
        recipe.measured["best_uniform"] = {"weights": best.weights, "kv": best.kv, "bytes": best.bytes,
                                           "kl": best.kl["kl_mean"], "kl_tail_bound": best.kl["kl_tail_bound"]}
    return rows
