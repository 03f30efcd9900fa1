"""SASS instructions per packed weight word in the main loop of each GPU decode kernel, compiled for
sm_90 (H100/H200) on the CPU — no GPU needed.

    python tests/bench/sass_count.py [--arch 90] [--layouts int4-g128,int4-g32,...] [--rows 1,16]
                                     [--dtypes float16,bfloat16] [--helpers]

Each decode configuration `kernels/wq_mm.py` `choose_config` picks (for a 4096x4096 weight on a
132-SM device with 228 KiB of shared memory) is compiled with `triton.compile` for a CUDA target,
with the divisibility hints a real launch gives, and the cubin disassembled with the `nvdisasm` in
Triton's wheel. The main loop is the longest span between a label and a branch back to it among
those that load weights (evict-first loads); its instructions are classed by opcode
(integer/logic, conversion, FMA/MMA, global load/store, shared memory (cp.async included), warp
shuffles and barriers) and scaled to thread-instructions per packed 32-bit weight word:

    per word = instructions in the loop x threads of a program / words one iteration loads
             (words = weight columns per iteration x 128 rows x bits / 32)

That is the loop's budget: at 4.8 TB/s (1.2 G words/s) over 132 SMs issuing 4 x 32
thread-instructions a cycle at ~1.98 GHz, an H200 has ~28 thread-instructions per word at full
issue, so >= 70% of bandwidth needs <= ~20. Weight round trips — shared-memory staging or layout
conversions of the packed bytes or of decoded weight tiles in the TTGIR loop — show whether the
weights are reshuffled on their way to the MMA (x's operand tiles always go through shared memory:
wgmma reads its B operand there). One line per kernel, activation dtype and configuration; rows
of 17-255 count the 64-row prefill tiles, and --helpers also compiles the kernels a launch runs
beside the matmul (x's sums for the mins and for bf16's bias, the prefill form's dequantize).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import torch


CLASSES = (  # opcode prefixes (the part before the first dot) → class; the first match wins
    # LDGSTS (cp.async) copies global memory into shared: the start of a round trip through shared memory
    ("shared", ("LDS", "STS", "LDSM", "STSM", "ATOMS", "LDGSTS")),
    ("load/store", ("LDG", "STG", "LD", "ST", "RED", "ATOM", "UBLKCP", "UTMALDG")),
    ("FMA/MMA", ("FFMA", "FMUL", "FADD", "FMNMX", "HFMA2", "HADD2", "HMUL2", "HMMA", "IMMA", "HGMMA", "IGMMA",
                 "DFMA", "FSWZADD")),
    ("conversion", ("I2F", "F2I", "F2F", "I2FP", "F2FP", "FRND", "I2I")),
    ("integer/logic", ("IADD3", "IMAD", "LOP3", "SHF", "SHL", "SHR", "PRMT", "ISETP", "IMNMX", "LEA", "SEL", "MOV",
                       "IABS", "POPC", "FLO", "BMSK", "SGXT", "VIADD", "VIMNMX", "UIADD3", "UIMAD", "ULOP3",
                       "USHF", "UMOV", "USEL", "ULEA", "UISETP", "R2UR", "S2R", "S2UR", "CS2R", "PLOP3", "P2R",
                       "R2P", "FSETP", "FSEL", "HSETP2", "IDP", "IDP4A")),
    ("shuffle/sync", ("SHFL", "BAR", "DEPBAR", "LDGDEPBAR", "WARPSYNC", "BRA", "LDC", "NOP", "MEMBAR")),
)
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
LABEL = re.compile(r"^\.(L_x_\d+):")
BRANCH = re.compile(r"BRA\s+`?\(?\.(L_x_\d+)")


def classify(op: str) -> str:
    base = op.split(".")[0]
    for name, prefixes in CLASSES:
        if base in prefixes:
            return name
    return "other"


def main_loop(sass: str) -> list[str]:
    """The opcodes of the K loop: from a label to the last branch back to it — of the loops that
    load weights (evict-first loads, `LDG.E.EF`, which only the weight tiles use), else of all, the
    longest. (The asymmetric layouts' kernel has a second loop, over the mins.)"""
    ops: list[str] = []
    labels: dict[str, int] = {}
    backs: list[tuple[str, int]] = []
    for line in sass.splitlines():
        m = LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(ops)
            continue
        m = LINE.search(line)
        if not m:
            continue
        b = BRANCH.search(line)
        if b and b.group(1) in labels:
            backs.append((b.group(1), len(ops)))
        ops.append(m.group(3))
    loops = [ops[labels[lab]:end + 1] for lab, end in backs]
    weights = [loop for loop in loops if any(op.startswith("LDG.E.EF") for op in loop)]
    return max(weights or loops, key=len, default=[])


POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}  # Triton's signature types


def compile_sm(fn, sig: dict, const: dict, arch: int, attrs: dict | None = None, **options):
    """A kernel compiled for sm_<arch> on the CPU, from its argument types and constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn, {**sig, **{k: "constexpr" for k in const}}, constexprs=const, attrs=attrs or {})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def compile_config(w, cfg, x_dtype: torch.dtype, arch: int):
    """The decode kernel for this weight and launch config, compiled for sm_<arch> → (sass, ttgir).
    Pointers and the integer arguments a real launch passes as multiples of 16 (the shapes and
    strides of a 4096x4096 weight) are marked so, as Triton's launcher specializes them."""
    from lowbit.kernels.wq_mm import _wq_mm_kernel

    qt = "*u8" if w.bits == 4 else "*i8"
    st = "*fp32" if w.per_channel else "*fp16"
    sig = {"x_ptr": POINTER[x_dtype], "q_ptr": qt, "s_ptr": st, "m_ptr": st, "xs_ptr": "*fp32", "xp_ptr": "*bf16",
           "y_ptr": POINTER[x_dtype], "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
           "NP": "i32", "KT": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_xs": "i32", "stride_xp": "i32"}
    const = dict(BITS=w.bits, HAS_MIN=w.mins is not None, PER_CHANNEL=w.per_channel, GROUP=w.group_size,
                 BLOCK_M=cfg.block_m, SPLIT_K=cfg.split_k, ASM=x_dtype != torch.float32,
                 IEEE=x_dtype == torch.float32)
    sixteen = [n for n, t in sig.items() if t.startswith("*")] + ["N", "K", "NP", "KT", "stride_xm", "stride_ym",
                                                                  "stride_xs", "stride_xp"]
    attrs = {(_wq_mm_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in sixteen}
    k = compile_sm(_wq_mm_kernel, sig, const, arch, attrs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return disassemble(k.asm["cubin"]), k.asm["ttgir"]


def disassemble(cubin: bytes) -> str:
    """SASS of a cubin, by the nvdisasm in Triton's wheel."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout


def compile_helpers(w, x_dtype: torch.dtype, arch: int) -> dict[str, int]:
    """The other kernels a launch with this weight and activation dtype may run, compiled for
    sm_<arch> → SASS instructions of each: the per-call pre-pass (x's group sums for the mins, x's
    32-column sums in bf16 parts for bf16's biased int4 tiles: one kernel, either or both) and the
    prefill form's dequantize (16-bit x only)."""
    from lowbit.kernels import wq_mm

    x = POINTER[x_dtype]
    jobs = []
    sums, parts = w.mins is not None, w.bits == 4 and x_dtype == torch.bfloat16
    if sums or parts:
        jobs.append((wq_mm._xprep_kernel, {"x_ptr": x, "xs_ptr": "*fp32", "xp_ptr": "*bf16", "K": "i32", "G": "i32",
                                           "stride_xm": "i32", "stride_xs": "i32", "stride_xp": "i32"},
                     wq_mm.xprep_constexprs(w.group_size, sums, parts)))
    if x_dtype != torch.float32:
        st = "*fp32" if w.per_channel else "*fp16"
        jobs.append((wq_mm._wq_dequant_kernel, {"q_ptr": "*u8" if w.bits == 4 else "*i8", "s_ptr": st, "m_ptr": st,
                                                "w_ptr": x, "NP": "i32", "KT": "i32"},
                     dict(BITS=w.bits, HAS_MIN=w.mins is not None, PER_CHANNEL=w.per_channel, GROUP=w.group_size,
                          ASM=True)))
    out = {}
    for fn, sig, const in jobs:
        sass = disassemble(compile_sm(fn, sig, const, arch, num_warps=4).asm["cubin"])
        out[fn.__name__] = sum(1 for line in sass.splitlines() if LINE.search(line))
    return out


def weight(layout: str, N: int, K: int):
    from lowbit.kernels.wq_mm import wq_pack_int4, wq_pack_int8
    from lowbit.quant import parse_weights, quantize_weight

    w = quantize_weight(torch.randn(N, K) * 0.02, parse_weights(layout))
    if w.spec.bits == 4:
        return wq_pack_int4(w.codes(), w.scales, w.mins, w.spec.group_size, w.in_features)
    return wq_pack_int8(w.qweight, w.scales, w.in_features)


def loop_body(ttgir: str) -> list[str]:
    """The TTGIR lines inside the kernel's (first, outermost) K loop."""
    lines = ttgir.splitlines()
    start = next((i for i, line in enumerate(lines) if "scf.for" in line), None)
    if start is None:
        return []
    depth, body = 0, []
    for line in lines[start:]:
        depth += line.count("{") - line.count("}")
        body.append(line)
        if depth <= 0 and len(body) > 1:
            break
    return body


def weight_round_trips(ttgir: str) -> int:
    """Shared-memory staging or layout conversions of weight tensors in the loop: local_alloc /
    local_load / async copies / convert_layout on the packed codes (i8, i16) or on a 2-D tile of
    128 weight rows and >= 16 columns (x's tiles have 64 or 32 rows; a group's per-row scales —
    [128] or, for groups of 32, [128, 8] — are not weights)."""
    ops = ("ttg.local_alloc", "ttg.local_load", "ttg.async_copy_global_to_local", "ttg.convert_layout")

    def weights(line: str) -> bool:
        tile = re.search(r"tensor<128x(\d+)x", line)
        return "xi8" in line or "xi16" in line or (tile is not None and int(tile.group(1)) >= 16)
    return sum(1 for line in loop_body(ttgir) if any(op in line for op in ops) and weights(line))


def columns_per_iteration(w) -> int:
    """Weight columns one pass of the kernel's K loop reads: a group of 64k columns, 64 (one tile)
    per channel, else 256 (four 64-column tiles of groups of 32 or an odd multiple)."""
    return w.group_size if (not w.per_channel and w.group_size % 64 == 0) else (64 if w.per_channel else 256)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (default 90: H100/H200)")
    ap.add_argument("--layouts", default="int4-g128,int4-sym-g128,int4-g32,int4-sym-g32,int8-g32,int8")
    ap.add_argument("--rows", default="1,16", help="row counts M (each picks its config; 17-255: the 64-row "
                    "prefill tiles)")
    ap.add_argument("--shape", default="4096x4096", help="N x K the configs are chosen for")
    ap.add_argument("--dtypes", default="float16,bfloat16", help="activation dtypes (float16, bfloat16)")
    ap.add_argument("--helpers", action="store_true", help="also compile the pre-pass and dequantize kernels a "
                    "launch may run, one line each")
    # Triton 3.9 warns unless this is set; 1 is its current default (FMA contraction on). The kernels
    # are compiled, never interpreted, whatever TRITON_INTERPRET the caller has (the tests set it).
    import os
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    os.environ["TRITON_INTERPRET"] = "0"
    args = ap.parse_args()
    from lowbit.kernels import wq_mm
    from lowbit.kernels.wq_tile import TILE_K, TILE_N

    # the H200's: 132 SMs, 227 KiB of shared memory per block (choose_config asks the device)
    wq_mm._sm_count = lambda device: 132
    wq_mm._smem_limit = lambda device: 232448
    N, K = (int(v) for v in args.shape.split("x"))
    for layout in args.layouts.split(","):
        w = weight(layout, N, K)
        for dtype in args.dtypes.split(","):
            x_dtype = getattr(torch, dtype)
            if args.helpers:
                for name, n in compile_helpers(w, x_dtype, args.arch).items():
                    print(f"{layout} {dtype} helper {name}: compiled, {n} SASS instructions", flush=True)
            for M in (int(m) for m in args.rows.split(",")):
                cfg = wq_mm.choose_config(M, w, torch.device("cuda"), x_dtype)
                if cfg.form != "mma":
                    print(f"{layout} {dtype} M={M} form={cfg.form}: no K loop of its own (--helpers compiles its "
                          f"dequantize kernel)", flush=True)
                    continue
                sass, ttgir = compile_config(w, cfg, x_dtype, args.arch)
                loop = main_loop(sass)
                words = columns_per_iteration(w) * TILE_N * w.bits // 32
                threads = 32 * cfg.num_warps
                per_word = len(loop) * threads / words
                by = Counter(classify(op) for op in loop)
                classes = ", ".join(f"{name} {by[name] * threads / words:.1f}" for name, _ in CLASSES if by[name])
                other = by["other"] * threads / words
                print(f"{layout} {dtype} M={M} form={cfg.form} tile {cfg.block_m}x{cfg.block_n}x{TILE_K} warps "
                      f"{cfg.num_warps} split {cfg.split_k} stages {cfg.num_stages}: loop {len(loop)} instructions/thread, "
                      f"{words} words/iteration -> {per_word:.1f} instructions per packed word ({classes}, other "
                      f"{other:.1f}); shared-memory ops in the loop {by['shared']}, weight round trips through "
                      f"shared memory or layout conversions {weight_round_trips(ttgir)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
