"""`lowbit quantize MODEL --weights LAYOUT | --recipe R --out FILE`: a GGUF in lowbit's layouts that GGUF has a
type for (one for every tensor, or each tensor's from a `lowbit fit` recipe), which lowbit and llama.cpp both load.
The writing is runtime/load/gguf_write.py's."""

from __future__ import annotations

import sys
from pathlib import Path

from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.registry import DEFAULT_MODEL

# spelled here, not imported from gguf_write: `lowbit --help` must not import torch (~4 s)
LAYOUT_HELP = ("auto (every tensor's bytes as stored: a lossless copy), int4-sym-g32 or q4_0 (Q4_0), int4-g32 or "
               "q4_1 (Q4_1), int8-g32 or q8_0 (Q8_0), f16, bf16, f32. int4-g64/g128, int8 per channel, int8-g64/g128 "
               "and bnb-* have no GGUF type")


def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="write a GGUF in one of lowbit's layouts (Q4_0, Q4_1, Q8_0, F16, ...)",
                       description="Read a GGUF model and write it again with its matrices in LAYOUT, quantized by "
                                   "lowbit's own quantizer (its codes and fp16 scales, exactly what lowbit holds for "
                                   "that --weights) into the GGUF block type that stores the layout losslessly; "
                                   "metadata and tokenizer are copied. Norms and other vectors stay as stored; an "
                                   "embedding or output already quantized in the file is copied, a float output head "
                                   "becomes Q8_0. llama.cpp loads the file too. A Hugging Face directory must be "
                                   "converted to GGUF by llama.cpp's convert_hf_to_gguf.py first.")
    q.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"alias (default: {DEFAULT_MODEL}), hf:ORG/REPO[:QUANT] or .gguf path")
    how = q.add_mutually_exclusive_group(required=True)
    how.add_argument("--weights", metavar="LAYOUT", help=LAYOUT_HELP)
    how.add_argument("--recipe", metavar="FILE",
                     help="a `lowbit fit` recipe: each tensor in its weights' layout (fit it with --layouts that GGUF "
                          "has a type for: int4-sym-g32, int4-g32, int8-g32, f16, bf16); its KV formats are not part "
                          "of a GGUF: run the file with --recipe for them")
    q.add_argument("--out", "-o", required=True, type=Path, help="the GGUF file to write (replaced if it exists)")


def cmd_quantize(args) -> int:
    from lowbit.runtime.cli.engine_args import read_recipe
    from lowbit.runtime.load.gguf_file import GGUFFile
    from lowbit.runtime.load.gguf_write import parse_layout, recipe_specs, write_gguf
    from lowbit.runtime.load.loader import progress_bar
    from lowbit.runtime.load.registry import resolve

    recipe = read_recipe(args)
    spec = None if recipe is not None else parse_layout(args.weights)  # a bad layout fails before any pull
    show = sys.stderr.isatty()
    path = resolve(args.model, progress=(lambda s: print(f"lowbit: {s}", file=sys.stderr)) if show else None)
    if path.is_dir():
        raise LowbitError(f"{path}: a Hugging Face directory; lowbit quantize reads GGUF files: convert it first "
                          "with llama.cpp's convert_hf_to_gguf.py (e.g. --outtype f16), then quantize that file")
    source = GGUFFile(path)
    update, close = progress_bar(len(source.tensors), f"writing {args.out.name}", show, unit="tensor")
    per_tensor = recipe_specs(source, recipe) if recipe is not None else None
    try:
        done = write_gguf(source, args.out, spec, update, per_tensor)
    finally:
        close()
    types = ", ".join(f"{k} {n}" for k, n in done.types.items())
    print(f"wrote {done.path}: {done.file_bytes:,} bytes, {len(source.tensors)} tensors ({types}), "
          f"{done.bits_per_weight:.2f} bits per weight")
    return 0
