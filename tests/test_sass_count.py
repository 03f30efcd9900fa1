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


def test_a_real_compile_for_sm90():
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, str(BENCH / "sass_count.py"), "--layouts", "int4-g32", "--rows", "1",
                        "--shape", "512x512"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    m = re.search(r"int4-g32 M=1 form=dot .* -> ([\d.]+) instructions per packed word", r.stdout)
    assert m and 5 < float(m.group(1)) < 1000, r.stdout
