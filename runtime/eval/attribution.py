"""Where a quantized model's error comes from (`lowbit eval --reference REF MODEL --weights L --attribute`):
for each tensor whose layout L changes, the KL against a saved reference (runtime/eval/reference.py) of the
model with that tensor alone at L and every other at the reference's lossless layout; with a quantized
`--kv F`, each layer's keys alone and values alone at F's bits (every other side f16). Beside them, the
whole candidate's KL (every tensor at L, KV at F) and the sum of the parts.

Each row is a measurement, not an estimate: a tensor's KL is that of the model with that one tensor
quantized, scored like any candidate, so the most sensitive tensors listed are confirmed by quantizing them
alone by construction (tests/test_eval_attribution.py holds rows against models built whole with that one
tensor at L). The rows are first order: they add up to the whole candidate's KL only as far as the errors
do not interact. On the default model at int4-g128 (4 windows of 512) the 210 tensors' KLs sum to 0.75x the
whole model's (0.360 of 0.478: together they cost more than apart); at k4v4 the 60 KV sides' to 1.09x
(docs/quality.md, "Where the error comes from").

How: the reference-layout model is built once and run over a window once, each block's output kept. A
tensor of layer i rebuilds block i alone from the two layouts' weights (a GGUF's are read from the file as
each is asked for: runtime/load/gguf.py LazyWeights), which stands in the model's layer list while the
blocks before it replay their kept outputs (the same inputs give the same numbers, and only layers i.. are
run: half the blocks on average); then the original blocks are put back. A block is self-contained: its
KV layer, rotary table and window are its own arguments, and each block reads only its own KV layer; the
exact path the scoring takes does not use the model's one-call C decode (`fused_layers`, built over the
original blocks), which is set aside during a swap all the same. Tensors outside the blocks (an embedding
table or LM head a float layout changes) rebuild the model. A KV side is a pool whose layers have their own
formats (runtime/engine/kv_cache.py layer_formats).

Cost: one scoring per part and window: 210 x 4 windows of 512 for SmolLM2-135M took 22 min on 2 CPU cores
shared with other jobs, one window 3 min on them alone; `--attribute-windows` bounds the windows.
"""

from __future__ import annotations

import gc
import math
import re
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from lowbit.models.llama import Block, Llama
from lowbit.quant.kv import KV_FORMATS, KVFormat
from lowbit.runtime.eval.candidates import score
from lowbit.runtime.eval.evaluate import window_logprobs
from lowbit.runtime.eval.heatmap import SIDES
from lowbit.runtime.eval.reference import ROWS, SavedReference
from lowbit.runtime.eval.topk_kl import TopkScores
from lowbit.runtime.load.recipe import Chosen

_EXPERT = re.compile(r"experts\.\d+\.")  # a mixture's E experts of one kind are one GGUF tensor: one part


@dataclass
class Part:
    name: str  # "layers.3.wq", "layers.3.experts.w_gate", "embed", "output", "layers.3.K"
    layer: int | None  # the model's layer (None: outside the blocks)
    kind: str  # "wq" … "w_down", "experts.w_gate", "embed", "output", "K", "V"
    keys: tuple[str, ...] = ()  # the weights it covers (every expert's for an expert kind; none for a KV side)
    kl_mean: float = math.nan
    kl_tail_bound: float = math.nan  # 2.58 standard errors of the mean's tail estimate (runtime/eval/topk_kl.py)
    bytes_saved: int = 0  # weights: bytes held at the reference's layout less at L; a KV side: per token

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "keys"}


@dataclass
class Attribution:
    parts: list[Part]  # in the model's order
    whole: dict  # the candidate's summary (TopkScores): every part at once
    baseline: dict  # the reference-layout model's: KL 0 when the reference was made from this file at that layout
    notes: list[str]  # what was not attributed, and why

    @property
    def sum_kl(self) -> float:
        return sum(p.kl_mean for p in self.parts)


def first_windows(saved: SavedReference, n: int | None) -> SavedReference:
    """The reference's first n windows (all of them for None)."""
    if n is None or n >= saved.ids.shape[0]:
        return saved
    rows = n * saved.scored_per_window
    return SavedReference(saved.ids[:n], **{k: getattr(saved, k)[:rows] for k in ROWS}, pieces=saved.pieces,
                          meta={**saved.meta, "windows": n, "tokens": rows})


def mixed(ref: Mapping, cand: Mapping, keys: tuple[str, ...]) -> Chosen:
    """The reference layout's weights but `keys`, taken at the candidate's: what a block or model with those
    tensors quantized is built from."""
    return Chosen(ref, {k: cand for k in keys})


def weight_parts(ref_w: Mapping, cand_w: Mapping) -> tuple[list[Part], list[str]]:
    """The tensors whose layout differs between the two weight sets (one part per tensor; a mixture's
    experts of one kind together), in the model's order, and a note on the matrices both hold alike. Vectors
    (norms, biases) are float in every layout. Same spec means the same values: the loaders convert one
    source deterministically, and a GGUF whose type is the asked layout is relaid losslessly either way."""
    groups: dict[tuple[int | None, str], list[str]] = {}
    same: list[str] = []
    for key in list(ref_w):
        a = ref_w[key]
        if not hasattr(a, "spec"):  # a float vector
            continue
        b = cand_w[key]
        if a.spec == b.spec:
            same.append(key)
            continue
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            groups.setdefault((int(i), _EXPERT.sub("experts.", rest)), []).append(key)
        else:
            groups.setdefault((None, key), []).append(key)
    parts = [Part(kind if layer is None else f"layers.{layer}.{kind}", layer, kind, tuple(keys))
             for (layer, kind), keys in groups.items()]
    notes = []
    outside = [k for k in same if not k.startswith("layers.")]
    if outside:
        notes.append(f"{', '.join(outside)}: the same layout in both (a quantized layout keeps the embedding "
                     "table and LM head at the file's precision): not attributed")
    inside = len(same) - len(outside)
    if inside:
        notes.append(f"{inside} matrices inside the blocks are held alike in both layouts (a router, or a tensor "
                     "the file already stores in the candidate's layout): not attributed")
    return parts, notes


def kv_parts(c, fmt: KVFormat) -> list[Part]:
    """Each attention layer's K and V sides (c: the model's config), in the model's order."""
    f16 = KV_FORMATS["f16"]
    out = []
    for layer in c.attention_layers:
        for side in SIDES:
            s = side.lower()
            saved = c.n_kv_heads * (f16.side_bytes(s, c.head_dim) - fmt.side_bytes(s, c.head_dim))
            out.append(Part(f"layers.{layer}.{side}", layer, side, bytes_saved=saved))
    return out


def side_alone(c, fmt: KVFormat, layer: int, side: str) -> list[KVFormat]:
    """One format per KV layer (c: the model's config): f16 everywhere but `side` ("K" | "V") of model layer
    `layer`, at fmt's bits."""
    f16 = KV_FORMATS["f16"]
    one = KVFormat(f"{fmt.name}:{side}", fmt.k_bits if side == "K" else 16, fmt.v_bits if side == "V" else 16,
                   fmt.k_group if side == "K" else 0, fmt.v_group if side == "V" else 0, fmt.rotate)
    return [one if i == layer else f16 for i in c.attention_layers]


def block(model: Llama, layer: int, weights: Mapping) -> Block:
    """Block `layer` of `model` built anew from `weights`, as Llama.__init__ builds it."""
    c = model.config
    with torch.no_grad():
        return Block(c, weights, f"layers.{layer}.", model.backend, None, layer,
                     model.rope_kinds.index(c.rope_of(layer)))


class _Record(torch.nn.Module):
    """A block whose outputs (delta, residual) this pass are kept, as copies: the next block adds into the
    residual in place."""

    def __init__(self, block: Block, into: list):
        super().__init__()
        self.block, self.into, self.sinks = block, into, block.sinks

    def forward(self, *args, **kwargs):
        out = self.block(*args, **kwargs)
        self.into.append(tuple(t.clone() for t in out))
        return out


class _Replay(torch.nn.Module):
    """Stands in for a block before the one measured: its recorded outputs for this window, as copies. Its KV
    layer is left unwritten, which no later block reads (each reads its own)."""

    def __init__(self, out: tuple, sinks):
        super().__init__()
        self.out, self.sinks = out, sinks  # sinks: read by Llama.forward_paged per KV layer (gpt-oss)

    def forward(self, *args, **kwargs):
        return tuple(t.clone() for t in self.out)


@contextmanager
def _layers(model: Llama, stand_ins: dict[int, torch.nn.Module]):
    """Modules in place of some blocks for the duration (the step-level C decode, built over the original
    blocks, set aside)."""
    old = {i: model.layers[i] for i in stand_ins}
    fused = model.fused_layers
    for i, m in stand_ins.items():
        model.layers[i] = m
    model.fused_layers = None
    try:
        yield model
    finally:
        for i, m in old.items():
            model.layers[i] = m
        model.fused_layers = fused


def swapped(model: Llama, layer: int, new: Block):
    """`new` in place of block `layer` for the duration."""
    return _layers(model, {layer: new})


def held(module: torch.nn.Module) -> int:
    """Bytes of the module's tensors (a shared one once)."""
    return sum(b.numel() * b.element_size() for b in module.buffers())


def attribute(saved: SavedReference, config, ref_w: Mapping, cand_w: Mapping, backend, kv: KVFormat | None = None,
              progress: Callable[[int], object] | None = None) -> Attribution:
    """ref_w, cand_w: the model's weights at the reference's layout and at the candidate's (runtime/load/loader.py
    read_weights; the same object: KV sides only); kv: the candidate's KV format (None: f16, weights only).
    progress(total) → a tqdm-like bar updated once per window scored (each part's, the whole's, the
    baseline's), or None.

    A block's parts are measured window by window: the reference-layout model runs the window once, each block's
    outputs kept, and a part of layer i then runs layers i.. only, the blocks before it replaying their outputs
    (exactly what they compute: the same inputs). On the default model a part's window then takes 0.86 s on
    average (3 min 2 s for 212 on 2 quiet cores), a whole pass ~1.4 s."""
    parts, notes = weight_parts(ref_w, cand_w) if cand_w is not ref_w else ([], [])
    sides = kv_parts(config, kv) if kv is not None and (kv.k_bits < 16 or kv.v_bits < 16) else []
    W, half = saved.ids.shape[0], saved.ctx // 2
    bar = progress(W * (len(parts) + len(sides) + 2)) if progress else None
    try:
        with torch.no_grad():
            cand = Llama(config, cand_w, backend).eval()
        whole = score(saved, cand, ["f16" if kv is None else kv.name], bar)[0]
        del cand
        gc.collect()  # before the reference model: the peak is one model
        with torch.no_grad():
            model = Llama(config, ref_w, backend).eval()
        for p in (p for p in parts if p.layer is None):  # outside the blocks: a model of its own
            with torch.no_grad():
                other = Llama(config, mixed(ref_w, cand_w, p.keys), backend).eval()
            s, p.bytes_saved = score(saved, other, ["f16"], bar)[0], held(model) - held(other)
            p.kl_mean, p.kl_tail_bound = s["kl_mean"], s["kl_tail_bound"]
            del other
        inside = [p for p in parts if p.layer is not None] + sides
        stats, base = {p.name: TopkScores() for p in inside}, TopkScores()
        for w in range(W):
            ids, rows = saved.window(w)
            targets = torch.tensor(ids[half:], dtype=torch.long)
            outs: list[tuple] = []  # each block's (delta, residual) on this window
            with _layers(model, {i: _Record(b, outs) for i, b in enumerate(model.layers)}):
                base.add(rows, window_logprobs(model, ids, "f16")[half - 1:-1], targets)
            for p in inside:
                before = {i: _Replay(outs[i], model.layers[i].sinks) for i in range(p.layer)}
                if p.kind in SIDES:
                    with _layers(model, before):
                        lp = window_logprobs(model, ids, side_alone(config, kv, p.layer, p.kind))
                else:
                    new = block(model, p.layer, mixed(ref_w, cand_w, p.keys))
                    p.bytes_saved = held(model.layers[p.layer]) - held(new)
                    with _layers(model, {**before, p.layer: new}):
                        lp = window_logprobs(model, ids, "f16")
                    del new
                stats[p.name].add(rows, lp[half - 1:-1], targets)
                if bar is not None:
                    bar.update(1)
            del outs
            if bar is not None:
                bar.update(1)
        for p in inside:
            s = stats[p.name].summary()
            p.kl_mean, p.kl_tail_bound = s["kl_mean"], s["kl_tail_bound"]
        baseline = base.summary()
    finally:
        if bar is not None:
            bar.close()
    return Attribution(parts + sides, whole, baseline, notes)


def table(att: Attribution, top: int | None = None) -> str:
    """The parts as Markdown, most sensitive first (at most `top` of each table), then the whole and the sum."""
    total = att.sum_kl
    weights = sorted((p for p in att.parts if p.kind not in SIDES), key=lambda p: -p.kl_mean)
    sides = sorted((p for p in att.parts if p.kind in SIDES), key=lambda p: -p.kl_mean)
    share = lambda p: f"{100 * p.kl_mean / total:.1f}" if total > 0 else "-"
    out = []
    if weights:
        out.append("| tensor | layer | KL alone (± tail) | share of sum % | MB saved | KL per MB saved |\n"
                   "|---|---:|---:|---:|---:|---:|")
        for p in weights[:top]:
            mb = p.bytes_saved / 1e6
            per = f"{p.kl_mean / mb:.2e}" if mb > 0 else "-"
            out.append(f"| {p.kind} | {'-' if p.layer is None else p.layer} | {p.kl_mean:.2e} ± {p.kl_tail_bound:.0e} "
                       f"| {share(p)} | {mb:.3f} | {per} |")
        if top is not None and len(weights) > top:
            out.append(f"\n({len(weights) - top} more tensors: --attribute-out keeps every row)")
    if sides:
        out.append(("\n" if out else "") + "| KV side | layer | KL alone (± tail) | share of sum % | "
                   "bytes/token saved |\n|---|---:|---:|---:|---:|")
        for p in sides[:top]:
            out.append(f"| {p.kind} | {p.layer} | {p.kl_mean:.2e} ± {p.kl_tail_bound:.0e} | {share(p)} | "
                       f"{p.bytes_saved:,} |")
        if top is not None and len(sides) > top:
            out.append(f"\n({len(sides) - top} more sides: --attribute-out keeps every row)")
    w = att.whole
    ratio = f" ({total / w['kl_mean']:.2f}x the whole)" if w["kl_mean"] > 0 else ""
    out.append(f"\nWhole candidate: KL {w['kl_mean']:.5f} ± {w['kl_tail_bound']:.1e}, "
               f"same top-1 {w['top1_pct']:.2f}%; sum of the {len(att.parts)} parts' KLs: {total:.5f}{ratio} — "
               "first order: the parts add up only as far as their errors do not interact.")
    if att.baseline["kl_mean"] != 0:
        out.append(f"Note: the reference-layout model itself scores KL {att.baseline['kl_mean']:.2e} against the "
                   "reference (it was not made from this file at this layout, or on another device): every row "
                   "includes that.")
    out += [f"Note: {n}" for n in att.notes]
    return "\n".join(out)
