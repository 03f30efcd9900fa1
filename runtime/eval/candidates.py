"""Many files against one saved reference (`lowbit eval --reference ref.lbref A.gguf B.gguf C/`): each
candidate is loaded, scored over the reference's own windows and let go before the next is loaded, so the
peak is the largest candidate, not their sum, and the reference model is not loaded at all.

A candidate is a (model, weights layout) pair, run with each KV format asked for. Its tokenizer must be
the reference's, piece for piece: the saved distributions are over the reference's token ids.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import torch

from lowbit.quant.kv import KV_FORMATS
from lowbit.runtime.engine.kv_cache import bytes_per_token
from lowbit.runtime.eval.evaluate import Row, window_logprobs
from lowbit.runtime.eval.reference import SavedReference, pieces_of, tokenizer_mismatch
from lowbit.runtime.eval.topk_kl import TopkScores


def score(saved: SavedReference, model, kvs: list, progress=None) -> list[dict]:
    """One loaded model against the saved reference, once per KV format (a name, or one KVFormat per KV layer)
    → TopkScores summaries, in order."""
    scores = [TopkScores() for _ in kvs]
    half = saved.ctx // 2
    for i in range(saved.ids.shape[0]):
        ids, rows = saved.window(i)
        targets = torch.tensor(ids[half:], dtype=torch.long)
        for kv, sc in zip(kvs, scores):
            sc.add(rows, window_logprobs(model, ids, kv)[half - 1:-1], targets)  # [n, V] against the saved rows
        if progress is not None:
            progress.update(1)
    return [sc.summary() for sc in scores]


def candidate_rows(saved: SavedReference, models: list[str], weights: list[str], kvs: list[str], load: Callable,
                   speed: Callable | None = None, progress: Callable | None = None) -> list[Row]:
    """Rows for every model x weights layout x KV format (a name, or one KVFormat per KV layer: a recipe's).
    load(model, weights) → LoadedModel; speed(lm, kv) →
    decode tok/s (None: not measured); progress(description) → a tqdm-like bar over windows, or None."""
    c = saved.meta
    rows = []
    for ref in models:
        for w in weights:
            lm = load(ref, w)
            why = tokenizer_mismatch(saved.pieces, pieces_of(lm.tokenizer))
            if why is not None:
                raise ValueError(f"{lm.path.name}: its tokenizer is not the reference's ({c.get('model')}): {why}")
            bar = progress(f"{lm.path.name} {w}") if progress else None
            try:
                summaries = score(saved, lm.model, kvs, bar)
            finally:
                if bar is not None:
                    bar.close()
            mc = lm.config
            for kv, s in zip(kvs, summaries):
                named = isinstance(kv, str)
                rows.append(Row(
                    weights=w, kv=kv if named else "per layer", weight_bytes=lm.weight_bytes,
                    bits_per_weight=8 * lm.weight_bytes / c["weight_elements"],
                    kv_bytes_per_token=bytes_per_token(KV_FORMATS[kv] if named else kv[0], mc.n_kv_layers,
                                                       mc.n_kv_heads, mc.head_dim, None if named else kv),
                    dppl_pct=100 * (s["ppl"] / c["ppl"] - 1), model=Path(lm.path).name,
                    decode_tps=speed(lm, kv) if speed else None,
                    **{k: v for k, v in s.items() if k in Row.__dataclass_fields__}))
            del lm
            gc.collect()  # before the next candidate loads: the peak is one model's
    return rows


def reference_table(saved: SavedReference, rows: list[Row]) -> str:
    """The rows as llama-perplexity's KL report reads, one line per candidate, most faithful first."""
    m = saved.meta
    head = ("| model | weights | KV | weight MB | bits/weight | PPL | ΔPPL % | mean KL (± tail) | median KL | p90 KL | "
            "p99 KL | p99.9 KL | max KL | same top-1 % | Δp mean % | RMS Δp % | decode tok/s |\n"
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in sorted(rows, key=lambda r: r.kl_mean):
        tps = "-" if r.decode_tps is None else f"{r.decode_tps:.1f}"
        lines.append(f"| {r.model} | {r.weights} | {r.kv} | {r.weight_bytes / 1e6:.1f} | {r.bits_per_weight:.2f} | "
                     f"{r.ppl:.3f} ± {r.ppl_stderr:.3f} | {r.dppl_pct:+.2f} | {r.kl_mean:.5f} ± {r.kl_tail_bound:.1e} | "
                     f"{r.kl_median:.5f} | {r.kl_p90:.4f} | {r.kl_p99:.4f} | {r.kl_p999:.3f} | {r.kl_max:.3f} | "
                     f"{r.top1_pct:.2f} | {100 * r.dp_mean:+.3f} | {100 * r.dp_rms:.3f} | {tps} |")
    lines.append(f"\nReference: {m.get('model')} ({m.get('weights')} weights, f16 KV), PPL {m['ppl']:.3f} ± "
                 f"{m['ppl_stderr']:.3f} over {m['tokens']:,} scored tokens in {m['windows']} windows of {m['ctx']}; "
                 f"KL exact on its top {m['top_k']} tokens, the rest estimated from {m['tail_draws']} draws from the "
                 "tail per token: ± is 2.58 standard errors of that estimate (99%).")
    return "\n".join(lines)
