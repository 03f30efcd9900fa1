"""`lowbit fit MODEL --reference REF --memory 120MB --ctx 8k [--out recipe.json]`: each matrix's layout and each
layer's K and V bits for the least measured KL within a memory budget (runtime/eval/fit.py), the recipe's
predicted and measured KL beside every uniform layout x KV format that fits, and the recipe saved for
`--recipe` (serve, run, chat, eval)."""

from __future__ import annotations

import sys
from pathlib import Path

from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.registry import DEFAULT_MODEL

DEFAULT_LAYOUTS = "int8,int4-g32,int4-g64,int4-g128"
MIB = 1 << 20  # --memory reads K/M/G as binary units (engine_args.parse_size): so does the report


def add_fit_parser(sub) -> None:
    f = sub.add_parser("fit", help="choose each tensor's layout and each layer's KV bits for a memory budget",
                       description="Measure, against a reference saved by `lowbit eval reference`, the KL of each "
                                   "weight matrix alone at each --layouts layout and of each layer's K and V alone at "
                                   "each --kv-bits width; choose the combination with the least summed KL whose "
                                   "weights plus one sequence's KV cache at --ctx fit --memory (a greedy knapsack); "
                                   "then build it and score it against the reference beside every uniform layout and "
                                   "KV format that fits the same budget. The recipe runs with `lowbit serve --recipe "
                                   "FILE` (and run, chat, eval). Cost: one scoring per tensor, layout and window "
                                   "(the default model: 210 tensors, ~1 s each per window of 512 on 2 cores).")
    f.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"alias (default: {DEFAULT_MODEL}), .gguf path or Hugging Face directory; the reference must "
                        "share its tokenizer")
    f.add_argument("--reference", required=True, metavar="REF.lbref",
                   help="the saved reference (`lowbit eval reference MODEL --out REF.lbref`)")
    f.add_argument("--memory", required=True, metavar="SIZE",
                   help="bytes for the weights plus one sequence's KV cache at --ctx: 120MB, 12GiB, 5e9 (K/M/G binary)")
    f.add_argument("--ctx", default=None, metavar="TOKENS",
                   help="the context the KV cache is sized for: 8192, 8k, 32k (default: the model's)")
    f.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                   help=f"the layouts a matrix may take besides the file's own (default {DEFAULT_LAYOUTS}; "
                        "`lowbit run --help` lists them)")
    f.add_argument("--kv-bits", default="8,4", help="the bits a K or V side may take besides 16 (default 8,4)")
    f.add_argument("--windows", type=int, default=None, metavar="N",
                   help="measure over the reference's first N windows (default: all of them)")
    f.add_argument("--data", default=None, metavar="JSON",
                   help="keep the measurements in this file and reuse them when it holds this model's, reference's and "
                        "options' (another --memory or --ctx then takes seconds, not a measurement per tensor)")
    f.add_argument("--out", "-o", default="recipe.json", help="the recipe file to write (default recipe.json)")


def parse_tokens(text: str) -> int:
    """'8192', '8k', '32K' → tokens (k = 1024, as llama.cpp's 32k context is 32,768)."""
    t = text.strip().lower()
    try:
        n = int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    except ValueError:
        raise LowbitError(f"--ctx: cannot read {text!r} as tokens (examples: 8192, 8k, 32k)") from None
    if n < 1:
        raise LowbitError(f"--ctx must be >= 1 token, got {text!r}")
    return n


def cmd_fit(args) -> int:
    from lowbit.runtime.cli.engine_args import parse_size

    budget = parse_size(args.memory)
    if not isinstance(budget, int):
        raise LowbitError(f"--memory takes a size like 120MB or 12GiB, got {args.memory!r}")
    try:
        bits = sorted({int(b) for b in args.kv_bits.split(",") if b.strip()}, reverse=True)
    except ValueError:
        bits = [0]
    if any(b not in (8, 4) for b in bits):
        raise LowbitError(f"--kv-bits takes a comma list of 8 and 4, got {args.kv_bits!r}")
    if args.windows is not None and args.windows < 1:
        raise LowbitError("--windows must be >= 1")
    if not Path(args.out).resolve().parent.is_dir():
        raise LowbitError(f"--out: no such directory: {Path(args.out).parent}")
    return _fit(args, budget, bits)


def _fit(args, budget: int, bits: list[int]) -> int:
    from lowbit.runtime.eval.fit import at_ctx, choose, fixed_bytes, recipe_of, score_recipe
    from lowbit.runtime.load.loader import read_weights
    from lowbit.runtime.load.recipe import write

    saved, path, lossless, layouts, backend = _inputs(args)
    config, ref_w = read_weights(path, lossless)
    ctx = parse_tokens(args.ctx) if args.ctx else config.max_seq_len
    at = {lossless: ref_w}

    def weights_at(layout: str):  # a GGUF's weights are lazy: asking again costs a mapping, not a model
        return at[layout] if layout in at else read_weights(path, layout)[1]

    bar = _bar if sys.stderr.isatty() else _line
    n = saved.ids.shape[0]
    print(f"fitting {path.name} into {budget / MIB:,.1f} MiB (weights + KV for {ctx:,} tokens) against "
          f"{Path(args.reference).name}: {n} window{'s' * (n > 1)} of {saved.ctx}", file=sys.stderr)
    items = at_ctx(_measurements(args, saved, path, config, ref_w, weights_at, lossless, layouts, bits, ctx, budget,
                                 backend, bar), ctx)
    fixed = fixed_bytes(ref_w, items)
    try:
        choose(items, budget - fixed)
    except ValueError as e:
        raise LowbitError(f"{path.name} does not fit {args.memory} with a KV cache of {ctx:,} tokens: {e} (give more "
                          "--memory, a smaller --ctx, or smaller --layouts)") from None
    recipe = recipe_of(items, config, path.name, lossless, ctx, budget, fixed)
    rows = score_recipe(saved, config, recipe, weights_at, [lossless, *layouts], backend, bar)
    recipe.measured["reference"] = Path(args.reference).name
    write(recipe, Path(args.out))
    print(report(recipe, items, rows, budget))
    print(f"recipe: {args.out} (run it: lowbit serve {args.model} --recipe {args.out})", file=sys.stderr)
    return 0


def _inputs(args):
    """→ (the reference's windows, the model's path, its lossless layout, the other layouts, the backend), each
    checked in one line."""
    from lowbit.quant import parse_weights
    from lowbit.runtime.cli.eval_attribute import scoring_backend
    from lowbit.runtime.eval.attribution import first_windows
    from lowbit.runtime.eval.reference import read
    from lowbit.runtime.load.loader import lossless_weights
    from lowbit.runtime.load.registry import resolve

    try:
        saved = first_windows(read(Path(args.reference)), args.windows)
    except (OSError, ValueError) as e:
        raise LowbitError(str(e)) from None
    path = resolve(args.model)
    lossless = lossless_weights(path)
    layouts = [w.strip() for w in args.layouts.split(",") if w.strip() and w.strip() != lossless]
    for w in layouts:
        try:
            parse_weights(w)
        except ValueError as e:
            raise LowbitError(f"--layouts: {e}") from None
    return saved, path, lossless, layouts, scoring_backend(saved, path)


def _measurements(args, saved, path, config, ref_w, weights_at, lossless, layouts, bits, ctx, budget, backend, bar):
    """The items (runtime/eval/fit.py measure): read back from --data when it holds this model's, reference's and
    options', else measured (and kept there); refused first when no choice can fit the budget."""
    from lowbit.runtime.eval.fit import least_bytes, measure
    from lowbit.runtime.eval.fit import load as load_data
    from lowbit.runtime.eval.fit import save as save_data

    floor = least_bytes(config, ref_w, layouts, bits, ctx)
    if floor > budget:  # before an hour of measuring on an 8B model
        raise LowbitError(f"{path.name} does not fit {args.memory} with a KV cache of {ctx:,} tokens: every matrix "
                          f"at its smallest layout and every KV side at {min(bits, default=16)} bits take "
                          f"{floor / MIB:,.1f} MiB (give more --memory, a smaller --ctx, or smaller --layouts)")
    ref = saved.meta
    key = {"model": path.name, "bytes": path.stat().st_size if path.is_file() else None, "reference": ref.get("model"),
           "text_sha256": ref.get("text_sha256"), "ctx": saved.ctx, "windows": saved.ids.shape[0],
           "layouts": layouts, "kv_bits": bits}
    cached = load_data(Path(args.data), key) if args.data else None
    if cached is not None:
        print(f"measurements: {args.data} (this model, reference and options: not measured again)", file=sys.stderr)
        return cached
    items = measure(saved, config, ref_w, weights_at, lossless, layouts, bits, backend, bar)
    if args.data:
        save_data(Path(args.data), key, items)
    return items


def _line(total: int, desc: str) -> None:
    """Progress where stderr is a log, not a terminal: one line per stage."""
    print(f"lowbit: {desc}: {total} window scorings", file=sys.stderr, flush=True)


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="win", file=sys.stderr, leave=False)


def report(recipe, items, rows, budget: int) -> str:
    """The recipe (layouts by count, KV per layer), its predicted and measured KL and bytes, and the uniform
    choices that fit, best first."""
    from collections import Counter

    from lowbit.runtime.eval.heatmap import SIDES

    m, p = recipe.measured, recipe.predicted
    weights = Counter(it.chosen.label for it in items if it.kind not in SIDES)
    kv = Counter(recipe.kv)
    total = m["weight_bytes"] + m["kv_bytes"]
    out = [f"Recipe for {recipe.model} in {budget / MIB:,.1f} MiB at {recipe.ctx:,} tokens:",
           "  matrices: " + ", ".join(f"{n} at {label}" for label, n in weights.most_common()),
           "  KV layers: " + ", ".join(f"{n} {name}" for name, n in kv.most_common()),
           (f"  bytes: weights {m['weight_bytes'] / MIB:,.2f} MiB + KV {m['kv_bytes'] / MIB:,.2f} MiB = "
            f"{total / MIB:,.2f} MiB ({100 * total / budget:.1f}% of the budget)"),
           (f"  KL: predicted {p['kl']:.5f} (the parts' sum, first order), measured {m['kl']:.5f} ± "
            f"{m['kl_tail_bound']:.1e}; same top-1 {m['top1_pct']:.2f}%"),
           "", "| uniform weights | KV | MiB | fits | mean KL (± tail) |", "|---|---|---:|---|---:|"]
    for r in sorted(rows, key=lambda r: (r.kl is None, r.kl["kl_mean"] if r.kl else r.bytes)):
        kl = f"{r.kl['kl_mean']:.5f} ± {r.kl['kl_tail_bound']:.1e}" if r.kl else "-"
        out.append(f"| {r.weights} | {r.kv} | {r.bytes / MIB:,.2f} | {'yes' if r.kl else 'no'} | {kl} |")
    best = m.get("best_uniform")
    if best:
        verdict = "better than" if m["kl"] < best["kl"] else "as good as" if m["kl"] == best["kl"] else "worse than"
        out.append(f"\nThe recipe ({m['kl']:.5f}) is {verdict} the best uniform choice that fits, {best['weights']} + "
                   f"{best['kv']} ({best['kl']:.5f}, {best['bytes'] / MIB:,.2f} MiB).")
    else:
        out.append("\nNo uniform layout and KV format fits this budget.")
    return "\n".join(out)
