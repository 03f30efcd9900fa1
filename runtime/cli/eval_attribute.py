"""`lowbit eval --reference REF MODEL --weights LAYOUT [--kv FORMAT] --attribute`: the flags' checks, the two
weight sets, the table, the JSON file and the heat map. The measuring is runtime/eval/attribution.py's; the
flags are declared with `lowbit eval`'s (runtime/cli/eval.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lowbit.runtime.errors import LowbitError

ATTRIBUTE_TOP = 30  # rows of each table printed; --attribute-out keeps them all


def scoring_backend(saved, path: Path):
    """The backend a model built part by part from `path` is scored on against `saved` (a SavedReference), once
    its tokenizer is checked to be the reference's (one line else): `--attribute`'s and `lowbit fit`'s."""
    from lowbit.models.backend import select_backend
    from lowbit.runtime.eval.reference import pieces_of, tokenizer_mismatch
    from lowbit.runtime.load.loader import read_tokenizer

    why = tokenizer_mismatch(saved.pieces, pieces_of(read_tokenizer(path)))
    if why is not None:
        raise LowbitError(f"{path.name}: its tokenizer is not the reference's ({saved.meta.get('model')}): {why}")
    try:
        return select_backend("auto", "float16")
    except (ValueError, RuntimeError) as e:
        raise LowbitError(str(e)) from None


def cmd_attribute(args) -> int:
    """`lowbit eval --reference REF MODEL --weights LAYOUT [--kv FORMAT] --attribute`."""
    from lowbit.quant.kv import KV_FORMATS
    from lowbit.runtime.cli.eval import AS_STORED
    from lowbit.runtime.eval.attribution import attribute, first_windows, table
    from lowbit.runtime.eval.reference import read
    from lowbit.runtime.load.loader import lossless_weights, read_weights
    from lowbit.runtime.load.registry import resolve

    ref_path, models = Path(args.reference[0]), args.reference[1:] or [args.model]
    weights = [w.strip() for w in (args.weights or "").split(",") if w.strip()]
    kvs = [k.strip() for k in (args.kv or "f16").split(",") if k.strip()]
    if len(models) != 1 or len(weights) > 1 or len(kvs) != 1:
        raise LowbitError("--attribute measures one candidate: one MODEL, one --weights layout and one --kv format")
    if kvs[0] not in KV_FORMATS:
        raise LowbitError(f"--kv: unknown format {kvs[0]!r}; expected one of {', '.join(KV_FORMATS)}")
    if args.attribute_windows is not None and args.attribute_windows < 1:
        raise LowbitError("--attribute-windows must be >= 1")
    for flag, out in (("--attribute-out", args.attribute_out), ("--plot", args.plot)):
        if out and not Path(out).parent.is_dir():
            raise LowbitError(f"{flag}: no such directory: {Path(out).parent}")
    try:
        saved = first_windows(read(ref_path), args.attribute_windows)
    except (OSError, ValueError) as e:
        raise LowbitError(str(e)) from None
    path = resolve(models[0])
    lossless = lossless_weights(path)
    layout = weights[0] if weights and weights[0] != AS_STORED else lossless
    kv = KV_FORMATS[kvs[0]]
    if layout == lossless and kv.k_bits >= 16 and kv.v_bits >= 16:
        raise LowbitError(f"--attribute: nothing to attribute: give a --weights layout other than {lossless} (the "
                          "file's lossless one) or a quantized --kv")
    backend = scoring_backend(saved, path)
    config, ref_w = read_weights(path, lossless)
    cand_w = ref_w if layout == lossless else read_weights(path, layout)[1]
    n = saved.ids.shape[0]

    def bar(total: int):
        if not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc=f"attributing ({n} windows a part)", unit="win", file=sys.stderr, leave=False)

    try:
        att = attribute(saved, config, ref_w, cand_w, backend, None if kv.name == "f16" else kv, bar)
    except ValueError as e:
        raise LowbitError(f"{path.name}: {e}") from None
    m = saved.meta
    print(f"{path.name} at {layout}, KV {kv.name}, against {ref_path.name} ({m.get('model')}, {m.get('weights')}): "
          f"each part alone over {n} windows of {saved.ctx} tokens ({m['tokens']:,} scored)\n")
    print(table(att, ATTRIBUTE_TOP))
    doc = {"model": path.name, "weights": layout, "reference_weights": lossless, "kv": kv.name,
           "reference_file": str(ref_path), "ctx": saved.ctx, "windows": n, "tokens": m["tokens"],
           "whole": att.whole, "baseline": att.baseline, "sum_kl": att.sum_kl, "notes": att.notes,
           "parts": [p.as_dict() for p in att.parts]}
    if args.plot:
        from lowbit.runtime.eval.heatmap import heatmap

        at = f"{path.name} at {layout}" + ("" if kv.name == "f16" else f", KV {kv.name}")
        windows = f"{n} window{'s' if n > 1 else ''} of {saved.ctx}"
        heatmap(doc["parts"], Path(args.plot), f"{at}: KL of each part alone ({windows})")
        print(f"heat map: {args.plot}", file=sys.stderr)
    if args.attribute_out:
        Path(args.attribute_out).write_text(json.dumps(doc, indent=1))
        print(f"attribution: {args.attribute_out}", file=sys.stderr)
    return 0
