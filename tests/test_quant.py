"""Weight layouts (quant/int4.py, quant/int8.py) against hand-computed error bounds, and the CPU
weight-only matmuls (kernels/int4_mm.py, kernels/int8_mm.py) against their fp32 `_ref` specs.

Layout bounds, per element, with d the group's stored scale (fp16 unit roundoff e = 2^-11):
  round to nearest          |w - ŵ| ≤ d/2 inside the representable range
  int4 asymmetric           m = fp16(lo) may sit up to e·|lo| above lo, and d = fp16((hi - m)/15)
                            up to e·d below the exact step, so the clamped ends add
                            ≤ e·|lo| (bottom) or ≤ 15·e·d (top): ≤ d/2 + e·(|lo| + 15d)
  int4 symmetric (Q4_0)     codes span [-8d, 7d] with -8d ≈ the group's extreme; a value of the
                            other sign beyond 7|d| clamps: error = its distance to the range, ≤ |d|(1 + 8e)
  int8 per channel          d = amax/127 in fp32: ≤ d/2
  int8 per group            d = fp16(amax/127): amax/d ≤ 127.07 still rounds to 127: ≤ d/2
plus fp32 arithmetic in quantize/dequantize (≤ 4 ulp of the group's magnitude, taken as 1e-6·amax).

Kernel bounds (u = 2^-8, bf16 unit roundoff): the CPU kernels round x to bf16, use bf16 copies of
the scales (int4: scale and zero = min + 8·scale) and return bf16 (int8 per group: bf16 partial sums
added in fp32). With S = |x| @ |W|ᵀ (the sum of absolute products, which bounds |y|):
  int4   |y - ref| ≤ u·|ref| + u·(S + |x| @ (|u - 8|·|d| + |zero|)ᵀ)      rtol = u, atol = u·(...)
  int8   |y - ref| ≤ 3u·S   (x, scale, output: one bf16 rounding each)   rtol = 0, atol = 3u·S
first-order, times 1.05 for second-order terms and fp32 accumulation (K·2^-24 ≤ 1e-4 relative).
Measured: the worst err/bound is 0.21-0.31 over these shapes (random rounding errors partly cancel);
a wrong nibble order, group index or zero point gives errors of order S, i.e. ~100x the bound.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lowbit.kernels.int4_mm import EXACT_MIN_ROWS, int4_mm, int4_mm_ref, int4_pack
from lowbit.kernels.int8_mm import int8_mm, int8_mm_ref, int8_pack
from lowbit.quant import Int4Weight, Int8Weight, parse_weights, quantize_weight

E16 = 2.0 ** -11  # fp16 unit roundoff
U = 2.0 ** -8  # bf16 unit roundoff


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: with 2 intra-op threads on a loaded 2-core machine each call can wait a whole
    scheduler slice (measured 8 ms per call); one thread keeps this file well under a second."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _matrix(N: int, K: int, seed: int) -> torch.Tensor:
    """Gaussian rows with a per-row offset, so some groups are all-positive or all-negative (the
    asymmetric min matters) and magnitudes vary from row to row."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 2 + torch.randn(N, 1, generator=g)


def _groups(w: torch.Tensor, g: int) -> torch.Tensor:
    """[N, K] → [N, G, g], the last group zero-padded (the layout's documented padding)."""
    N, K = w.shape
    Kp = -(-K // g) * g
    return torch.nn.functional.pad(w, (0, Kp - K)).view(N, Kp // g, g)


def _per_element(t: torch.Tensor, g: int, K: int) -> torch.Tensor:
    """Per-group [N, G] → per-element [N, K]."""
    return t.repeat_interleave(g, dim=1)[:, :K]


# ---- layouts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("K", [384, 379], ids=["K_whole_groups", "K_partial_group"])
def test_int4_asymmetric_error_bound(group, K):
    w = _matrix(24, K, seed=group + K)
    q = quantize_weight(w, parse_weights(f"int4-g{group}"))
    assert isinstance(q, Int4Weight) and q.mins is not None
    Kp = -(-K // group) * group
    assert q.qweight.shape == (24, Kp // 2) and q.qweight.dtype == torch.uint8
    assert q.scales.shape == (24, Kp // group) and q.scales.dtype == torch.float16
    # hand-computed scale and min, straight from the Q4_1 definition
    wg = _groups(w, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    m = lo.half()
    d = ((hi - m.float()) / 15).half()
    assert torch.equal(q.mins, m) and torch.equal(q.scales, d)
    err = (q.dequantize() - w).abs()
    assert err.shape == (24, K)
    d_e, lo_e = _per_element(d.float(), group, K), _per_element(lo.abs(), group, K)
    bound = d_e / 2 + E16 * (lo_e + 15 * d_e) + 1e-6 * w.abs().amax()
    assert (err <= bound).all(), (err - bound).max()
    assert (err / d_e).max() > 0.4  # the bound is near-tight: these really are 16 levels per group


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("K", [384, 379], ids=["K_whole_groups", "K_partial_group"])
def test_int4_symmetric_error_bound(group, K):
    w = _matrix(24, K, seed=7 * group + K)
    q = quantize_weight(w, parse_weights(f"int4-sym-g{group}"))
    assert q.mins is None
    wg = _groups(w, group)
    extreme = torch.gather(wg, -1, wg.abs().argmax(-1, keepdim=True)).squeeze(-1)
    d = (extreme / -8).half()
    assert torch.equal(q.scales, d)
    d_e = _per_element(d.float(), group, K)
    lo_rep, hi_rep = torch.minimum(-8 * d_e, 7 * d_e), torch.maximum(-8 * d_e, 7 * d_e)
    outside = (lo_rep - w).clamp(min=0) + (w - hi_rep).clamp(min=0)  # distance to [-8d, 7d]
    bound = torch.where(outside > 0, outside, d_e.abs() / 2) + 1e-6 * w.abs().amax()
    err = (q.dequantize() - w).abs()
    assert (err <= bound).all(), (err - bound).max()
    assert (err <= d_e.abs() * (1 + 8 * E16) + 1e-6 * w.abs().amax()).all()
    if K % group:  # padded codes are 8, i.e. exactly 0 (asymmetric pads need not be)
        assert (q.codes()[:, K:] == 8).all()


@pytest.mark.parametrize("name", ["int8", "int8-g32", "int8-g64", "int8-g128"])
@pytest.mark.parametrize("K", [384, 379], ids=["K_whole_groups", "K_partial_group"])
def test_int8_error_bound(name, K):
    spec = parse_weights(name)
    w = _matrix(24, K, seed=K + spec.group_size)
    q = quantize_weight(w, spec)
    assert isinstance(q, Int8Weight) and q.qweight.dtype == torch.int8
    g = spec.group_size or K
    amax = _groups(w, g).abs().amax(-1)
    if spec.group_size:
        d = (amax / 127).half()  # Q8_0: fp16 scale per group
        assert q.scales.dtype == torch.float16 and q.qweight.shape == (24, -(-K // g) * g)
    else:
        d = amax / 127  # per channel: fp32 (its cost is nil, its rounding would dominate)
        assert q.scales.dtype == torch.float32 and q.scales.shape == (24, 1)
    assert torch.equal(q.scales, d)
    assert q.qweight.abs().max() <= 127
    err = (q.dequantize() - w).abs()
    d_e = _per_element(d.float(), g, K)
    assert (err <= d_e / 2 + 1e-6 * w.abs().amax()).all()
    assert (err / d_e).max() > 0.4


def test_zero_group_and_bf16_source():
    """An all-zero group has scale 0 and dequantizes to exactly 0 (no 0/0); a bf16 source tensor
    quantizes exactly as its fp32 upcast (the loader hands bf16 checkpoints straight in)."""
    w = _matrix(16, 96, seed=1)
    w[:, 32:64] = 0
    for name in ("int4-g32", "int4-sym-g32", "int8-g32"):
        q = quantize_weight(w, parse_weights(name))
        assert torch.equal(q.dequantize()[:, 32:64], torch.zeros(16, 32)), name
        wb = w.bfloat16()
        a, b = quantize_weight(wb, parse_weights(name)), quantize_weight(wb.float(), parse_weights(name))
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales), name


# ---- kernels -----------------------------------------------------------------------------------

SHAPES_MN = [(M, N) for M in (1, 3, 17) for N in (16, 48, 576)]


def _fp32_tol(K: int, S: torch.Tensor) -> torch.Tensor:
    """Error bound of fp32 sums of K + a few terms whose absolute values sum to S (the C kernel, and
    the exact path from EXACT_MIN_ROWS rows): (K + 4) units of fp32 roundoff."""
    return (K + 4) * 2.0 ** -24 * S


@pytest.mark.parametrize("name", ["int4-g32", "int4-sym-g32", "int4-g64", "int4-g128"])
@pytest.mark.parametrize("M,N", SHAPES_MN + [(1, 40), (17, 40), (11, 48)])
@pytest.mark.parametrize("K_groups", [3.0, 2.5], ids=["K_whole_groups", "K_partial_group"])
def test_int4_mm_matches_ref(name, M, N, K_groups, decode_kernel):
    spec = parse_weights(name)
    K = int(K_groups * spec.group_size) + (1 if K_groups % 1 else 0)  # partial: odd K as well
    w = quantize_weight(_matrix(N, K, seed=N + K), spec)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    codes = w.codes()
    y = int4_mm(x, int4_pack(codes, w.scales, w.mins, spec.group_size, K))
    # decode-sized M: the C kernel (fp32) or torch's fused kernel (bf16); larger M: the exact fp32 path
    bf16 = decode_kernel == "torch" and M < EXACT_MIN_ROWS
    assert y.shape == (M, N) and y.dtype == (torch.bfloat16 if bf16 else torch.float32)
    ref = int4_mm_ref(x, codes, w.scales, w.mins, spec.group_size)
    d = _per_element(w.scales.float(), spec.group_size, K)
    zero = torch.zeros_like(d) if w.mins is None else _per_element(
        w.mins.float() + 8 * w.scales.float(), spec.group_size, K)
    S = x.abs() @ w.dequantize().abs().t()
    S_sz = x.abs() @ ((codes[:, :K].float() - 8).abs() * d.abs() + zero.abs()).t()
    err = (y.float() - ref).abs()
    if bf16:  # x and the scale/zero pairs rounded to bf16
        tol = 1.05 * U * (S + S_sz) + 1.05 * U * ref.abs()
    else:  # the C kernel sums d * (u . x) + m * sum(x) per group: its terms' sizes, in fp32
        tol = _fp32_tol(K, S + x.abs() @ (codes[:, :K].float() * d.abs() + zero.abs() + 8 * d.abs()).t())
    assert (err <= tol).all(), (err / tol).max()


@pytest.mark.parametrize("name", ["int4-g32", "int4-sym-g64"])
def test_int4_unknown_torch_packing_falls_back_to_the_exact_path(name, monkeypatch):
    """torch 2.11 (seen on a CUDA machine) packs int4 differently from torch 2.13: lowbit then keeps
    its own nibble layout and multiplies exactly for every M, with a warning, instead of refusing."""
    spec = parse_weights(name)
    K, N = 2 * spec.group_size + 5, 40
    w = quantize_weight(_matrix(N, K, seed=3), spec)
    real = torch._convert_weight_to_int4pack_for_cpu
    # a different layout: the same bytes, tiles reversed
    monkeypatch.setattr(torch, "_convert_weight_to_int4pack_for_cpu", lambda c, k: real(c, k).flip(0))
    with pytest.warns(RuntimeWarning, match="layout lowbit does not know"):
        p = int4_pack(w.codes(), w.scales, w.mins, spec.group_size, K)
    assert not p.fused
    for M in (1, 17):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        y = int4_mm(x, p)
        assert y.dtype == torch.float32 and y.shape == (M, N)
        torch.testing.assert_close(y, int4_mm_ref(x, w.codes(), w.scales, w.mins, spec.group_size),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["int8", "int8-g32", "int8-g128"])
@pytest.mark.parametrize("M,N", SHAPES_MN + [(3, 40)])
@pytest.mark.parametrize("K_kind", ["whole", "partial"], ids=["K_whole_groups", "K_partial_group"])
def test_int8_mm_matches_ref(name, M, N, K_kind, decode_kernel):
    spec = parse_weights(name)
    if spec.group_size:
        K = 3 * spec.group_size if K_kind == "whole" else 2 * spec.group_size + 19
    else:
        # Per channel there are no groups; K % 8 != 0 is not exercised in-process: torch's kernel
        # segfaults or returns garbage there (test_int8_per_channel_odd_K below).
        K = 576 if K_kind == "whole" else 104
    w = quantize_weight(_matrix(N, K, seed=N + K), spec)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    y = int8_mm(x, int8_pack(w.qweight, w.scales, K))
    assert y.shape == (M, N)
    ref = int8_mm_ref(x, w.qweight, w.scales)
    S = x.abs() @ w.dequantize().abs().t()
    atol = 1.05 * 3 * U * S if decode_kernel == "torch" and M < EXACT_MIN_ROWS else _fp32_tol(K, S)
    err = (y.float() - ref).abs()
    assert (err <= atol).all(), (err / atol).max()


def test_int8_rows_are_the_dequantized_rows():
    """Embedding lookups read the packed table: the same values as the reference dequantization."""
    for name in ("int8", "int8-g32"):
        w = quantize_weight(_matrix(300, 101, seed=5), parse_weights(name))
        ids = torch.tensor([0, 299, 17, 17, 42])
        assert torch.equal(int8_pack(w.qweight, w.scales, 101).rows(ids), w.dequantize()[ids])


_ODD_K_SCRIPT = """
import torch
from lowbit.kernels.int8_mm import int8_mm, int8_mm_ref, int8_pack
from lowbit.quant import parse_weights, quantize_weight
torch.manual_seed(0)
for K in (91, 251):
    for M in (1, 3):
        w = quantize_weight(torch.randn(48, K), parse_weights("int8"))
        x = torch.randn(M, K)
        y = int8_mm(x, int8_pack(w.qweight, w.scales, K)).float()
        ref = int8_mm_ref(x, w.qweight, w.scales)
        S = x.abs() @ w.dequantize().abs().t()
        assert ((y - ref).abs() <= 1.05 * 3 * 2 ** -8 * S).all(), (K, M)
"""


def test_int8_per_channel_odd_K():
    """In a subprocess: a segfault must fail this test, not kill the test session."""
    r = subprocess.run([sys.executable, "-c", _ODD_K_SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-500:]}"


@pytest.mark.parametrize("name", ["int4-g32", "int4-sym-g64", "int4-g128", "int8", "int8-g32"])
@pytest.mark.parametrize("M", [16, 40])
def test_exact_path_matches_ref_in_fp32(name, M):
    """From EXACT_MIN_ROWS rows on, the kernels dequantize with the exact scales and multiply in
    fp32: the result equals the fp32 reference up to fp32 summation order (K = 200 terms)."""
    torch.manual_seed(M)
    spec = parse_weights(name)
    K = 200 if spec.bits == 8 else 256
    w = quantize_weight(torch.randn(40, K), spec)
    x = torch.randn(M, K)
    if spec.bits == 4:
        y = int4_mm(x, int4_pack(w.codes(), w.scales, w.mins, spec.group_size, K))
        ref = int4_mm_ref(x, w.codes(), w.scales, w.mins, spec.group_size)
    else:
        y = int8_mm(x, int8_pack(w.qweight, w.scales, K))
        ref = int8_mm_ref(x, w.qweight, w.scales)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
