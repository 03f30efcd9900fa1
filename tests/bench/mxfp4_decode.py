"""A decode-shaped matmul (M = 1, gpt-oss-20b's N = K = 2880) in MXFP4 against Q4_0 on lowbit's C kernels.

    python tests/bench/mxfp4_decode.py [--reps 400] [--copies 24] [--isa avx512] [--threads 2]

Each format as a load holds it: MXFP4 repacked into its 16-row tiles (kernels/kq_mm.py; 4.26 bits a weight
at K = 2880), Q4_0 moved into the int4 tiles (kernels/int4_mm.py, 4.5 bits), and for reference MXFP4 kept
as the file's blocks (kernels/ggml_mm.py: what K not a multiple of 64 gets). Weights from gguf's own
quantizer on the same random matrix. Two settings: warm, one matrix multiplied again and again (it stays
in L2/L3: the kernels' compute); cold, a call on each of `--copies` matrices in turn (24 x ~4.4 MB, more
than a 32 MB L3: each call reads its weights from memory, as a decode step over many experts does).
Formats alternate call by call, so drift hits each alike. Prints the medians (us, GB/s of weight bytes),
the MXFP4 / Q4_0 time ratios, the CPU's name, the instruction set and the thread count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_prefill import cpu_name  # noqa: E402


def packed(fmt: str, raw: np.ndarray, K: int, native):
    """One matrix as a CPU load holds it → (its matmul on x [1, K], bytes of weights it reads)."""
    from lowbit.kernels.ggml_mm import ggml_mm, ggml_pack
    from lowbit.kernels.int4_mm import int4_mm
    from lowbit.kernels.kq_mm import kq_mm, kq_pack
    from lowbit.quant.ggml_tiles import relaid_tiles

    b = torch.from_numpy(raw)
    if fmt == "MXFP4 tiles":
        w = kq_pack(b, int(T.MXFP4), K, native=native)
        return (lambda x: kq_mm(x, w, False)), w.data.numel()
    if fmt == "MXFP4 blocks":
        w = ggml_pack(b, int(T.MXFP4), K, native=native)
        return (lambda x: ggml_mm(x, w, False)), w.data.numel()
    w = relaid_tiles([b], int(T.Q4_0), K, native)
    return (lambda x: int4_mm(x, w, False)), w.data.numel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", type=int, default=2880)
    ap.add_argument("--K", type=int, default=2880)
    ap.add_argument("--reps", type=int, default=400, help="calls per format and setting")
    ap.add_argument("--copies", type=int, default=24, help="matrices per format cycled through when cold")
    ap.add_argument("--isa", default=None, help="avx2 | vnni256 | avx512 (default: the best here)")
    ap.add_argument("--threads", type=int, default=None, help="default: torch's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from lowbit.kernels.cpu_native import native

    k = native()
    if k is None:
        sys.exit("lowbit's C kernels do not build here")
    k = k.with_isa(args.isa) if args.isa else k
    N, K = args.N, args.K
    rng = np.random.default_rng(0)
    fmts = {"MXFP4 tiles": T.MXFP4, "Q4_0": T.Q4_0, "MXFP4 blocks": T.MXFP4}
    mats = {f: [] for f in fmts}
    for c in range(args.copies):
        w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
        for f, qt in fmts.items():
            mats[f].append(packed(f, quants.quantize(w, qt), K, k))
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(1))
    for f in fmts:  # warm up every copy once (first-touch, the qact buffers)
        for mm, _ in mats[f]:
            mm(x)
    out = {}
    for setting in ("warm", "cold"):
        times = {f: [] for f in fmts}
        for r in range(args.reps):
            for f in fmts:
                mm, _ = mats[f][0 if setting == "warm" else r % args.copies]
                t0 = time.perf_counter()
                mm(x)
                times[f].append(time.perf_counter() - t0)
        out[setting] = {f: statistics.median(t) for f, t in times.items()}
    print(f"CPU: {cpu_name()}; isa {k.isa}; threads {torch.get_num_threads()}; M=1 N={N} K={K}; "
          f"{args.reps} calls per format and setting, medians; cold = {args.copies} matrices in turn")
    for setting, med in out.items():
        for f, t in med.items():
            nbytes = mats[f][0][1]
            print(f"  {setting:4s} {f:12s} {t * 1e6:8.1f} us  {nbytes / t / 1e9:6.1f} GB/s  "
                  f"({8 * nbytes / (N * K):.3f} bits/weight held)")
        print(f"  {setting:4s} MXFP4 tiles / Q4_0 time: {med['MXFP4 tiles'] / med['Q4_0']:.3f}; "
              f"MXFP4 blocks / Q4_0: {med['MXFP4 blocks'] / med['Q4_0']:.3f}")


if __name__ == "__main__":
    main()
