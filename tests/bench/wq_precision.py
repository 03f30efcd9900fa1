"""How close the GPU weight-only matmul (kernels/wq_mm.py) comes to the exact product, per
activation dtype, on the CPU under Triton's interpreter (numpy's fp32 matmul standing in for the
MMA's fp32 accumulation; no GPU needed).

    python tests/bench/wq_precision.py [--layouts int4-sym-g32,int4-sym-g128,int4-g32] [--k 4096]
                                       [--rows 1,20]

For each layout, input and row count: y = wq_mm(x, W) in fp32 (no output rounding to hide behind)
against the float64 product of the very same x and dequantized weights, as log2 of max |error| /
max |y|, for bf16 x (whose int4 tiles hold u + 128, taken off by one more k-step of each dot) and
for the same values as fp16 x (the unbiased decode; bf16 values of these inputs are exact in fp16).
Inputs: x ~ N(0, 1); every x near 50 (sums of x far larger than y); half of x near 50 and half
0.01-0.02 of either sign (fine bits that partial sums of ~136 x sum(x) round away). Rows 1-16 take the split-K
decode launch, 17-255 the 64-row prefill tiles. For reference, bf16's own rounding of y is 2^-9 of
max |y|.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import torch  # noqa: E402


def inputs(M: int, K: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    near50 = 50 + torch.randn(M, K, generator=g)
    # 0.01-0.02 either sign: fine bits, and in fp16's normal range (so exact there too)
    fine = 0.01 * (1 + torch.rand(M, K, generator=g)) * torch.randn(M, K, generator=g).sign()
    return {"N(0,1)": torch.randn(M, K, generator=g), "near 50": near50,
            "half near 50": torch.where(torch.rand(M, K, generator=g) < 0.5, near50, fine)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="int4-sym-g32,int4-sym-g128,int4-g32")
    ap.add_argument("--k", type=int, default=4096, help="in features K")
    ap.add_argument("--n", type=int, default=256, help="out features N")
    ap.add_argument("--rows", default="1,20", help="row counts M")
    args = ap.parse_args()
    helpers = Path(__file__).resolve().parents[1] / "helpers.py"
    spec = importlib.util.spec_from_file_location("lowbit_test_helpers", helpers)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.fix_interpreter_bf16_dot()  # the interpreter's bf16 dot is wrong without it

    from lowbit.kernels.wq_mm import wq_dequant_ref, wq_mm, wq_pack_int4
    from lowbit.quant import parse_weights, quantize_weight

    rows = [int(m) for m in args.rows.split(",")]
    xs = inputs(max(rows), args.k)
    print(f"{'layout':<15} {'x':<13} {'M':>3} {'bf16':>8} {'fp16':>8}   (log2 of max |error| / max |y|)")
    for layout in args.layouts.split(","):
        torch.manual_seed(0)
        w = quantize_weight(torch.randn(args.n, args.k) * 0.02, parse_weights(layout))
        p = wq_pack_int4(w.codes(), w.scales, w.mins, w.spec.group_size, args.k)
        W = wq_dequant_ref(p).double()
        for name, x in xs.items():
            x = x.to(torch.bfloat16)
            assert torch.equal(x.half().bfloat16(), x), "these inputs are exact in fp16"
            ref = x.double() @ W.T
            for M in rows:
                err = []
                for dtype in (torch.bfloat16, torch.float16):
                    y = wq_mm(x[:M].to(dtype), p, out_dtype=torch.float32).double()
                    err.append(float((y - ref[:M]).abs().max() / ref[:M].abs().max()))
                print(f"{layout:<15} {name:<13} {M:>3} {math.log2(err[0]):>8.1f} {math.log2(err[1]):>8.1f}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
