"""What integer activations would cost in quality, measured before any kernel uses them.

    python tests/bench/activation_kl.py [--model PATH] [--text FILE] [--ctx 512] [--chunks 40]

The exact path (every matmul in fp32 on exactly dequantized weights) is run with each linear's input
first rounded as an integer kernel would see it (kernels/act_quant.py: per row, per block of 32
values, an fp32 scale and integer codes), and scored like `lowbit eval` (docs/quality.md's protocol:
windows of --ctx tokens, second halves scored, KL divergence against the fp32 model with an f16
cache; the weights are the file's own, relaid losslessly, so "auto, fp32 activations" is the
no-rounding row). Rows:

- int16: codes in +-32512 (what lowbit's kernels use);
- int8: codes in +-127, llama.cpp's Q8_0/Q8_1 activations (its fp16 scale rounding left out);
- int8, fp32 into w_down and the LM head: int8 everywhere but the two inputs with the heaviest tails
  (the gated MLP's product and the final norm's output).

The text defaults to the shipped WikiText excerpt (2 windows of 512); docs/perf.md's figures use
the whole test split (`--text ../shared/data/wikitext-2-raw/wiki.test.raw`, 40 windows).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

from lowbit.kernels.act_quant import Q8_MAX, Q16_MAX, act_fake_quant
from lowbit.quant.linear import QuantLinear
from lowbit.runtime.eval.evaluate import Variant, evaluate, markdown_table
from lowbit.runtime.load.loader import load
from lowbit.runtime.load.registry import resolve

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def rounded_inputs(model, qmax: int | None, skip: tuple[str, ...] = ()):
    """Every QuantLinear of `model` whose name does not end in one of `skip` multiplies
    act_fake_quant(x, qmax) instead of x while the context is open (qmax None: unchanged)."""
    patched = []
    for name, mod in model.named_modules():
        if qmax is None or not isinstance(mod, QuantLinear) or name.endswith(skip):
            continue
        inner = mod.matmul

        def rounded(x, w, exact, out_dtype=None, inner=inner):
            return inner(act_fake_quant(x, qmax).to(x.dtype), w, exact, out_dtype)

        mod.matmul = rounded
        patched.append((mod, inner))
    try:
        yield
    finally:
        for mod, inner in patched:
            mod.matmul = inner


def variant(name: str, lm, qmax: int | None, skip: tuple[str, ...] = ()) -> Variant:
    from lowbit.runtime.eval.evaluate import window_logprobs

    def logprobs(ids):
        with rounded_inputs(lm.model, qmax, skip):
            return window_logprobs(lm.model, ids, "f16")

    return Variant(name, "f16", lm.model, lm.weight_bytes, logprobs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", help="GGUF path (default: the smollm2-135m alias)")
    ap.add_argument("--text", type=Path, default=REPO / "tests/data/wikitext2_test_excerpt.txt")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    path = a.model or str(resolve("smollm2-135m"))
    reference = load(path, "f32", progress=False)
    lm = load(path, "auto", progress=False)
    ids = reference.tokenizer.encode(a.text.read_text(encoding="utf-8", errors="replace"), add_special=False)
    variants = [variant("auto, fp32 activations", lm, None),
                variant("auto, int16 activations (per 32)", lm, Q16_MAX),
                variant("auto, int8 activations (per 32)", lm, Q8_MAX),
                variant("auto, int8 but w_down and LM head fp32", lm, Q8_MAX, ("w_down", "output"))]
    base, rows = evaluate(reference.model, variants, ids, a.ctx, a.chunks)
    print(f"{Path(path).name} on {a.text.name}: {rows[0].tokens} scored tokens, {a.ctx}-token windows")
    print(markdown_table(base, rows))
    print("\nKL against the fp32 model, unrounded (the table keeps 5 decimals):")
    for r in rows:
        print(f"  {r.weights:<42} mean {r.kl_mean:.3e}  p99 {r.kl_p99:.3e}  max {r.kl_max:.3e}  top-1 {r.top1_pct:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
