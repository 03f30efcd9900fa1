"""tests/bench/sass_count.py: the decode kernels compiled for sm_90 on the CPU, their main loop found
in the SASS and counted. Checked on a hand-written listing and on one real compile."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent / "bench"
sys.path.insert(0, str(BENCH))
import sass_count  # noqa: E402

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   LOP3.LUT R3, R2, 0xf, RZ, 0xc0, !PT ;
        /*0030*/                   I2FP.F32.U32 R3, R3 ;
        /*0040*/                   FFMA R5, R3, R6, R5 ;
        /*0050*/                   STS [R7], R5 ;
        /*0060*/              @!P1 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
"""


def test_the_loop_is_found_and_classed():
    loop = sass_count.main_loop(LISTING)
    assert loop == ["LDG.E", "LOP3.LUT", "I2FP.F32.U32", "FFMA", "STS", "BRA"]
    assert [sass_count.classify(op) for op in loop] == ["load/store", "integer/logic", "conversion", "FMA/MMA",
                                                        "shared", "shuffle/sync"]


def test_the_int4_decode_loop_fits_the_budget_on_sm90():
    """The acceptance count, compiled for sm_90 on the CPU: the int4 decode loop (groups of 128 and
    of 32, asymmetric and symmetric, the config choose_config picks for 4096x4096 on an H200)
    issues at most 20 thread-instructions per packed 32-bit word, the ~70%-of-4.8 TB/s budget, with
    fp16 activations (the CUDA default) and with bf16; and no weight tile goes through shared memory
    or a layout conversion in any of them."""
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, str(BENCH / "sass_count.py"), "--layouts",
                        "int4-g128,int4-sym-g128,int4-g32,int4-sym-g32", "--rows", "1"],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = re.findall(r"^(int4\S*) (float16|bfloat16) M=1 .* -> ([\d.]+) instructions per packed word .*"
                       r"layout conversions (\d+)$", r.stdout, re.M)
    assert len(lines) == 8, r.stdout
    for layout, dtype, per_word, trips in lines:
        assert trips == "0", (layout, dtype, trips)
        assert float(per_word) <= 20, (layout, dtype, per_word)


def test_prefill_tiles_and_every_helper_compile_for_sm90():
    """What the decode count does not compile: the 64-row prefill tiles (M = 64) and the kernels a
    launch runs beside the matmul — the pre-pass of x's group sums (asymmetric int4) and 32-column
    sums in bf16 parts (int4 with bf16 x), either or both, and the prefill form's dequantize
    (M = 300) — each compiled for sm_90 on the CPU, for int4 by halves and by whole groups,
    symmetric and not, int8 per group and per channel, in both 16-bit dtypes: the interpreter runs
    them all but would not catch what only the compiler rejects."""
    pytest.importorskip("triton")
    layouts = ["int4-g32", "int4-sym-g32", "int4-g128", "int4-sym-g64", "int8-g32", "int8"]
    r = subprocess.run([sys.executable, str(BENCH / "sass_count.py"), "--layouts", ",".join(layouts), "--rows",
                        "64,300", "--shape", "512x512", "--helpers"], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    for layout in layouts:
        for dtype in ("float16", "bfloat16"):
            want = {"_wq_dequant_kernel"}
            int4 = layout.startswith("int4")
            want |= {"_xprep_kernel"} if int4 and ("sym" not in layout or dtype == "bfloat16") else set()
            got = set(re.findall(rf"^{layout} {dtype} helper (\w+): compiled, [1-9]\d* SASS instructions$",
                                 r.stdout, re.M))
            assert got == want, (layout, dtype, got, r.stdout)
            assert re.search(rf"^{layout} {dtype} M=64 form=mma tile 64x128x64 .* -> [\d.]+ instructions per packed "
                             r"word", r.stdout, re.M), (layout, dtype, r.stdout)
            assert re.search(rf"^{layout} {dtype} M=300 form=dequant", r.stdout, re.M), (layout, dtype, r.stdout)


def test_weight_round_trips_are_told_from_x_tiles():
    """In the loop body of a TTGIR listing, conversions of 128-row weight tiles and of packed codes
    (bytes, 16-bit words) count; x's 64-row operand tiles and the per-row scales ([128], or [128, 8]
    for groups of 32) do not."""
    ttgir = """
    %a = arith.constant 0 : i32
    %r = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %z) -> (tensor<128x16xf32, #mma>) : i32 {
      %x = ttg.local_alloc %xt : (tensor<64x16xf16, #blocked>) -> !ttg.memdesc<64x16xf16, #shared, #smem>
      %d = ttg.convert_layout %s : tensor<128xf32, #blocked4> -> tensor<128xf32, #ttg.slice<{dim = 1}>>
      %w = ttg.convert_layout %t : tensor<128x64xf16, #linear> -> tensor<128x64xf16, #ttg.dot_op<{opIdx = 0}>>
      %b = ttg.local_load %m : !ttg.memdesc<128x32xi8, #shared, #smem> -> tensor<128x32xi8, #blocked>
      %u = ttg.convert_layout %v : tensor<128x16xi16, #blocked> -> tensor<128x16xi16, #linear>
      %g = ttg.convert_layout %e : tensor<128x8xf32, #blocked2> -> tensor<128x8xf32, #linear1>
      scf.yield %acc : tensor<128x16xf32, #mma>
    }
    %late = ttg.convert_layout %r : tensor<128x16xf32, #mma> -> tensor<128x16xf32, #blocked>
    """
    assert sass_count.weight_round_trips(ttgir) == 3
