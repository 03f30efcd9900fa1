"""`lowbit eval` on the command line: flags, loading the reference and each weight layout, the table
and the JSON file. The measuring is runtime/eval/evaluate.py's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lowbit.runtime.errors import LowbitError


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="measure what weight and KV formats cost in quality and save in memory",
                        description="Run the model over a text in windows of --ctx tokens, scoring the second half "
                                    "of each (as llama-perplexity --kl-divergence does), for every pair of "
                                    "--weights and --kv formats, against the unquantized model (source weights "
                                    "dequantized to fp32, f16 KV): perplexity, ΔPPL, KL divergence (mean, p99, max), "
                                    "same top-1, weight bytes held, bits per weight, KV bytes per token, decode tok/s. "
                                    "`lowbit eval plot A.json B.json` draws several runs in one Pareto chart.")
    ev.add_argument("--model", "-m", default=None, help="alias, .gguf path or HF directory (default: the default model)")
    ev.add_argument("--weights", default="auto,int8,int4-g128",
                    help="comma list of weight layouts (default auto,int8,int4-g128; `lowbit run --help` lists them), "
                         "including bnb-nf4 and bnb-int8: bitsandbytes' NF4 and LLM.int8(), quantized and "
                         "multiplied by bitsandbytes")
    ev.add_argument("--kv", default="f16,k8v4", help="comma list of KV formats: f16, k8v8, k8v4, k4v4 (default f16,k8v4)")
    ev.add_argument("--text", default=None, help="text file (default: the WikiText-2 excerpt shipped with lowbit)")
    ev.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    ev.add_argument("--chunks", type=int, default=None, help="most windows to score (default: all the text holds)")
    ev.add_argument("--peer", choices=("llama.cpp",), default=None,
                    help="add rows from llama-cpp-python on the same GGUF with its cache types --peer-kv")
    ev.add_argument("--peer-kv", default="f16/f16,q8_0/q8_0,q8_0/q4_0",
                    help="llama.cpp type_k/type_v pairs among f16, q8_0, q4_0 (default f16/f16,q8_0/q8_0,q8_0/q4_0)")
    ev.add_argument("--no-speed", action="store_true", help="skip the decode tok/s measurement")
    ev.add_argument("--out", "-o", default=None, help="JSON result file")
    ev.add_argument("--plot", default=None, metavar="PNG",
                    help="Pareto chart: memory (weights + KV for --plot-batch x --plot-ctx tokens) against mean KL")
    ev.add_argument("--plot-ctx", type=int, default=4096, help="context length the chart's KV memory is for (4096)")
    ev.add_argument("--plot-batch", type=int, default=1, help="sequences the chart's KV memory is for (default 1)")
    plot_sub = ev.add_subparsers(dest="eval_command", metavar="plot")
    plot = plot_sub.add_parser("plot", help="one Pareto chart (and table) from several result files",
                               description="Draw the rows of several `lowbit eval --out` files of the same model, "
                                           "text and windows (a weights sweep and a KV sweep, say) in one Pareto "
                                           "chart, and print their rows as one table.")
    plot.add_argument("results", nargs="+", help="result JSON files of lowbit eval")
    plot.add_argument("--out", "-o", default="eval.png", help="PNG to write (default eval.png)")
    plot.add_argument("--plot-ctx", type=int, default=4096, help="context length the KV memory is for (4096)")
    plot.add_argument("--plot-batch", type=int, default=1, help="sequences the KV memory is for (default 1)")


def _cmd_plot(args) -> int:
    from lowbit.runtime.eval.evaluate import Row, markdown_table
    from lowbit.runtime.eval.plot import merge, plot

    try:
        doc, rows = merge([Path(p) for p in args.results])
        title = f"{Path(doc['model']).name} on {Path(doc['text']).name}: {doc['windows']} windows of {doc['ctx']} tokens"
        plot(rows, Path(args.out), args.plot_ctx, args.plot_batch, title + " (filled: on the frontier)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LowbitError(f"cannot plot: {e}") from None
    print(markdown_table(doc["reference"], [Row(**r) for r in rows]))
    print(f"chart: {args.out}", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    if getattr(args, "eval_command", None) == "plot":
        return _cmd_plot(args)
    from lowbit.quant.kv import KV_FORMATS
    from lowbit.runtime.bench.client import DEFAULT_TEXT
    from lowbit.runtime.eval.evaluate import Variant, decode_tps, evaluate, markdown_table
    from lowbit.runtime.load.loader import load

    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    kvs = [k.strip() for k in args.kv.split(",") if k.strip()]
    bad = [k for k in kvs if k not in KV_FORMATS]
    if bad or not kvs or not weights:
        raise LowbitError(f"--kv takes a comma list of {', '.join(KV_FORMATS)}; --weights a non-empty list")
    if args.ctx < 4 or args.ctx % 2:
        raise LowbitError("--ctx must be an even number >= 4")
    if args.plot_ctx < 1 or args.plot_batch < 1:
        raise LowbitError("--plot-ctx and --plot-batch must be >= 1")
    text_path = Path(args.text) if args.text else DEFAULT_TEXT
    if not text_path.is_file():
        raise LowbitError(f"--text: no such file: {text_path}")
    reference = load(args.model, "f32", progress=False)
    ids = reference.tokenizer.encode(text_path.read_text(encoding="utf-8", errors="replace"), add_special=False)
    variants, loaded = [Variant("fp32 (reference)", "f16", reference.model, reference.weight_bytes)], {}
    for w in weights:
        try:
            lm = loaded.get(w) or load(args.model, w, progress=False)
        except ValueError as e:
            raise LowbitError(str(e)) from None
        loaded[w] = lm
        variants += [Variant(w, kv, lm.model, lm.weight_bytes) for kv in kvs]
    if args.peer == "llama.cpp":
        from lowbit.runtime.eval.evaluate import LLAMA_CPP_KV, llama_cpp_variants

        if reference.source != "gguf":
            raise LowbitError("--peer llama.cpp needs a GGUF model")
        pairs = [tuple(p.split("/")) for p in args.peer_kv.split(",") if p.strip()]
        if any(len(p) != 2 or not set(p) <= set(LLAMA_CPP_KV) for p in pairs):
            raise LowbitError(f"--peer-kv takes pairs like q8_0/q4_0 of {', '.join(LLAMA_CPP_KV)}")
        try:
            import torch

            variants += llama_cpp_variants(str(reference.path), pairs, reference.config, args.ctx,
                                           threads=torch.get_num_threads())  # lowbit's threads, not its cpu_count/2
        except ImportError:
            raise LowbitError("--peer llama.cpp needs llama-cpp-python (pip install llama-cpp-python)") from None
    n_windows = min(len(ids) // args.ctx, args.chunks or len(ids))
    progress = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        progress = tqdm(total=n_windows, desc="windows", unit="win", file=sys.stderr, leave=False)
    try:
        base, rows = evaluate(reference.model, variants, ids, args.ctx, args.chunks, progress)
    except ValueError as e:
        raise LowbitError(str(e)) from None
    finally:
        if progress is not None:
            progress.close()
    if not args.no_speed:
        for v, r in zip(variants, rows):
            if v.model is not None:  # peers' speed: tests/bench/decode_prefill.py measures it side by side
                r.decode_tps = decode_tps(v.model, reference.tokenizer, v.kv)
    print(markdown_table(base, rows))
    doc = {"model": str(reference.path), "text": str(text_path), "ctx": args.ctx, "windows": n_windows,
           "reference": base, "rows": [r.as_dict() for r in rows]}
    if args.plot:
        from lowbit.runtime.eval.plot import plot

        title = f"{reference.path.name} on {text_path.name}: {n_windows} windows of {args.ctx} tokens"
        best = plot(doc["rows"], Path(args.plot), args.plot_ctx, args.plot_batch, title + " (filled: on the frontier)")
        doc["plot"] = {"file": args.plot, "ctx": args.plot_ctx, "batch": args.plot_batch,
                       "frontier": [[r["weights"], r["kv"]] for r in best]}
        print(f"chart: {args.plot}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"results: {args.out}", file=sys.stderr)
    return 0
