"""`lowbit eval` on the command line: flags, loading the reference and each weight layout, the table
and the JSON file. The measuring is runtime/eval/evaluate.py's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lowbit.runtime.errors import LowbitError

RECIPE = "recipe"  # --recipe's row: the weights column names it
AS_STORED = "as-stored"  # --reference's default --weights: each candidate file as it is stored

DEFAULT_KVS = "f16,k8v4"


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="measure what weight and KV formats cost in quality and save in memory",
                        description="Run the model over a text in windows of --ctx tokens, scoring the second half "
                                    "of each (as llama-perplexity --kl-divergence does), for every pair of "
                                    "--weights and --kv formats, against the unquantized model (source weights "
                                    "dequantized to fp32, f16 KV): perplexity, ΔPPL, KL divergence (mean, p99, max), "
                                    "same top-1, weight bytes held, bits per weight, KV bytes per token, decode tok/s. "
                                    "`lowbit eval plot A.json B.json` draws several runs in one Pareto chart.")
    ev.add_argument("--model", "-m", default=None, help="alias, .gguf path or HF directory (default: the default model)")
    ev.add_argument("--reference", nargs="+", default=None, metavar=("REF.lbref", "MODEL"),
                    help="score the MODELs (files or directories; default --model) against a reference saved by "
                         "`lowbit eval reference`, one model in memory at a time, over the reference's own windows: "
                         "the table adds median/p90/p99.9 KL, Δp and each mean KL's 99%% interval. --weights "
                         "defaults to as-stored here (a GGUF's blocks, a safetensors checkpoint's own dtype)")
    ev.add_argument("--weights", default=None,
                    help="comma list of weight layouts (default auto,int8,int4-g128, with --reference auto; `lowbit run --help` lists them), "
                         "including bnb-nf4 and bnb-int8: bitsandbytes' NF4 and LLM.int8(), quantized and "
                         "multiplied by bitsandbytes")
    ev.add_argument("--kv", default=None, help="comma list of KV formats: f16, k8v8, k8v4, k4v4 (default f16,k8v4; "
                                                 "with --attribute one format, default f16)")
    ev.add_argument("--recipe", default=None, metavar="FILE",
                    help="with --reference: score the MODEL built from a `lowbit fit` recipe (each matrix's layout, "
                         "each layer's K and V bits) in place of --weights and --kv")
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
    ev.add_argument("--attribute", action="store_true",
                    help="with --reference, one MODEL, one --weights LAYOUT and/or one quantized --kv: the KL of each "
                         "tensor alone at LAYOUT (every other at the file's lossless layout) and of each layer's K "
                         "and V alone at the --kv format, most sensitive first, beside the whole candidate's KL and "
                         "the parts' sum; --plot draws them as a layers x tensors heat map. One scoring per tensor "
                         "(210 on the default model): see --attribute-windows")
    ev.add_argument("--attribute-out", default=None, metavar="JSON", help="every part's figures (--attribute)")
    ev.add_argument("--attribute-windows", type=int, default=None, metavar="N",
                    help="score each part over the reference's first N windows (default: all of them)")
    plot_sub = ev.add_subparsers(dest="eval_command", metavar="{reference,plot}")
    ref = plot_sub.add_parser("reference", help="save a model's next-token distributions over a text (.lbref)",
                              description="Run MODEL once over the text's windows (as `lowbit eval` scores them) and "
                                          "save, per scored token, its top-k log-probs, the tail's mass, draws from the "
                                          "tail and the next token's log-prob (16 MB for 40 windows of 512), with the window ids and the tokenizer: "
                                          "`lowbit eval --reference REF A.gguf B.gguf ...` scores files against it.")
    ref.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                     help="alias, .gguf path or HF directory (default: the default model)")
    ref.add_argument("--weights", default=None,
                     help="the reference's layout (default: as stored — a GGUF's blocks, a safetensors checkpoint's "
                          "own float dtype; the exact path computes in fp32 either way)")
    ref.add_argument("--text", default=None, help="text file (default: the WikiText-2 excerpt shipped with lowbit)")
    ref.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    ref.add_argument("--chunks", type=int, default=None, help="most windows to score (default: all the text holds)")
    ref.add_argument("--top-k", type=int, default=64, help="log-probs kept per token, exactly (default 64)")
    ref.add_argument("--tail-draws", type=int, default=128,
                     help="tokens drawn per token from the rest of the distribution, which estimate its share of the "
                          "KL (default 128)")
    ref.add_argument("--out", "-o", required=True, help="the reference file to write (.lbref)")
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


def _progress(total: int, desc: str):
    """A bar over windows on a terminal (None elsewhere: logs and pipes get the table only)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="win", file=sys.stderr, leave=False)


def _text(arg) -> Path:
    from lowbit.runtime.bench.client import DEFAULT_TEXT

    path = Path(arg) if arg else DEFAULT_TEXT
    if not path.is_file():
        raise LowbitError(f"--text: no such file: {path}")
    return path


# glibc's M_MMAP_THRESHOLD (malloc.h), in bytes: allocations from this size up are mapped alone and unmapped when freed
M_MMAP_THRESHOLD, MMAP_FROM = -3, 1 << 20


def _heap_to_system() -> None:
    """A reference holds the whole unquantized model, so what its passes leave in the heap counts: glibc serves
    freed blocks of up to 32 MB (its dynamic threshold) from its arenas and keeps them, and the exact path's fp32
    weight ranges, activations and logits left 0.6 GB there on a BF16 8B (14.77 GB of tensors): 1.085-1.097x
    of peak RSS, 1.045x with blocks of 1 MB and up mapped (tests/bench/reference_rss.py; ~5% longer: they are
    faulted in afresh on each call). glibc only; elsewhere nothing changes."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_FROM)
    except (OSError, AttributeError):
        pass


def _cmd_reference(args) -> int:
    from lowbit.runtime.eval.reference import build_reference, save, text_sha256
    from lowbit.runtime.load.loader import load, lossless_weights, weight_elements
    from lowbit.runtime.load.registry import resolve

    if args.ctx < 4 or args.ctx % 2:
        raise LowbitError("--ctx must be an even number >= 4")
    out, text_path = Path(args.out), _text(args.text)
    if not out.parent.is_dir():
        raise LowbitError(f"--out: no such directory: {out.parent}")
    path = resolve(args.model_pos or args.model)
    weights = args.weights or lossless_weights(path)
    _heap_to_system()
    lm = load(str(path), weights, progress=None)
    ids = lm.tokenizer.encode(text_path.read_text(encoding="utf-8", errors="replace"), add_special=False)
    n = min(len(ids) // args.ctx, args.chunks or len(ids))
    bar = _progress(n, "reference windows")
    try:
        ref = build_reference(lm.model, lm.tokenizer, ids, args.ctx, args.chunks, args.top_k, args.tail_draws, bar)
    except ValueError as e:
        raise LowbitError(str(e)) from None
    finally:
        if bar is not None:
            bar.close()
    ref.meta.update(model=path.name, weights=weights, kv="f16", text=str(text_path), text_sha256=text_sha256(text_path),
                    weight_elements=weight_elements(path), weight_bytes=lm.weight_bytes)
    size = save(ref, out)
    m = ref.meta
    print(f"reference: {out} ({size / 1e6:.1f} MB): {path.name} ({weights}), {m['windows']} windows of {args.ctx} "
          f"tokens, top {args.top_k} + {args.tail_draws} drawn of {len(ref.pieces):,} per scored token "
          f"({m['tokens']:,}); "
          f"PPL {m['ppl']:.3f} ± {m['ppl_stderr']:.3f}")
    return 0


def _cmd_against(args) -> int:
    """`lowbit eval --reference REF [MODEL ...]`."""
    from lowbit.quant.kv import KV_FORMATS, parse_kv_format
    from lowbit.runtime.cli.engine_args import read_recipe
    from lowbit.runtime.eval.candidates import candidate_rows, reference_table
    from lowbit.runtime.eval.evaluate import decode_tps
    from lowbit.runtime.eval.reference import read, text_sha256
    from lowbit.runtime.load.loader import load, lossless_weights
    from lowbit.runtime.load.registry import resolve

    ref_path, models = Path(args.reference[0]), args.reference[1:] or [args.model]
    try:
        saved = read(ref_path)
    except (OSError, ValueError) as e:
        raise LowbitError(str(e)) from None
    if args.text and text_sha256(_text(args.text)) != saved.meta.get("text_sha256"):
        raise LowbitError(f"--text: {args.text} is not the text {ref_path.name} was made from "
                          f"({saved.meta.get('text')}); the reference keeps its windows: leave --text out")
    weights = [w.strip() for w in (args.weights or AS_STORED).split(",") if w.strip()]
    kvs = [k.strip() for k in (args.kv or DEFAULT_KVS).split(",") if k.strip()]
    if not weights or not kvs or any(k not in KV_FORMATS for k in kvs):
        raise LowbitError(f"--kv takes a comma list of {', '.join(KV_FORMATS)}; --weights a non-empty list")
    recipe = read_recipe(args)
    if recipe is not None:
        if args.weights or args.kv:
            raise LowbitError("--recipe sets every tensor's layout and every layer's KV format: leave out --weights "
                              "and --kv")
        weights, kvs = [RECIPE], [[parse_kv_format(k) for k in recipe.kv]]

    def load_one(model, w):
        try:
            if w == RECIPE:
                return load(model, "auto", progress=None, recipe=recipe)
            if w == AS_STORED:  # a GGUF's blocks, a safetensors checkpoint's own dtype: the file as its maker meant it
                w = lossless_weights(resolve(model))
            return load(model, w, progress=None)
        except ValueError as e:
            raise LowbitError(str(e)) from None

    n = saved.ids.shape[0]
    try:
        rows = candidate_rows(saved, models, weights, kvs, load_one,
                              None if args.no_speed else lambda lm, kv: decode_tps(lm.model, lm.tokenizer, kv),
                              lambda desc: _progress(n, desc))
    except ValueError as e:
        raise LowbitError(str(e)) from None
    print(reference_table(saved, rows))
    m = saved.meta
    doc = {"model": m.get("model"), "text": m.get("text"), "ctx": saved.ctx, "windows": n, "reference_file": str(ref_path),
           "reference": {k: m[k] for k in ("ppl", "ppl_stderr", "tokens")}, "rows": [r.as_dict() for r in rows]}
    if args.plot:
        from lowbit.runtime.eval.plot import plot

        title = f"against {ref_path.name} ({m.get('model')}): {n} windows of {saved.ctx} tokens"
        best = plot(doc["rows"], Path(args.plot), args.plot_ctx, args.plot_batch, title + " (filled: on the frontier)")
        doc["plot"] = {"file": args.plot, "ctx": args.plot_ctx, "batch": args.plot_batch,
                       "frontier": [[r["model"], r["weights"], r["kv"]] for r in best]}
        print(f"chart: {args.plot}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"results: {args.out}", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    if getattr(args, "eval_command", None) == "plot":
        return _cmd_plot(args)
    if getattr(args, "eval_command", None) == "reference":
        return _cmd_reference(args)
    if args.recipe and (args.attribute or not args.reference):
        raise LowbitError("--recipe is scored against a saved reference: `lowbit eval --reference REF.lbref MODEL "
                          "--recipe FILE` (`lowbit eval reference MODEL --out REF.lbref` saves one)")
    if args.attribute or args.attribute_out or args.attribute_windows is not None:
        if not args.attribute:
            raise LowbitError("--attribute-out and --attribute-windows go with --attribute")
        if not args.reference:
            raise LowbitError("--attribute needs --reference REF.lbref (saved by `lowbit eval reference`)")
        from lowbit.runtime.cli.eval_attribute import cmd_attribute

        return cmd_attribute(args)
    if args.reference:
        return _cmd_against(args)
    from lowbit.quant.kv import KV_FORMATS
    from lowbit.runtime.bench.client import DEFAULT_TEXT
    from lowbit.runtime.eval.evaluate import Variant, decode_tps, evaluate, markdown_table
    from lowbit.runtime.load.loader import load

    weights = [w.strip() for w in (args.weights or "auto,int8,int4-g128").split(",") if w.strip()]
    kvs = [k.strip() for k in (args.kv or DEFAULT_KVS).split(",") if k.strip()]
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
