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

Kernel bounds. The exact path (and everything where the C kernels are not built) dequantizes with
the exact scales and multiplies in fp32: |y - ref| <= (K + 4) 2^-24 S, S = |x| @ |W|^T. The C
kernel rounds each block of 32 activations to 16-bit codes (kernels/act_quant.py: s = amax / 32512,
|x - q s| <= 0.5 s, plus 2^-24 relative for the fp32 product that chooses q) and is then exact in
integers: it must equal its torch spec (int4_mm_fast_ref, int8_mm_fast_ref) bit for bit, and the spec
must sit within 0.51 s_b |W|^T summed over blocks (the rounding) plus the fp32 bound of its epilogue
of those of the reference. A wrong nibble order, group index or zero point gives errors of order S.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowbit.kernels.act_quant import BLOCK, act_quant_ref
from lowbit.kernels.int4_mm import Int4Packed, int4_mm, int4_mm_fast_ref, int4_mm_ref, int4_pack
from lowbit.kernels.int8_mm import int8_mm, int8_mm_fast_ref, int8_mm_ref, int8_pack
from lowbit.quant import Int4Weight, Int8Weight, parse_weights, quantize_weight

E16 = 2.0 ** -11  # fp16 unit roundoff


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
    the exact path): (K + 4) units of fp32 roundoff."""
    return (K + 4) * 2.0 ** -24 * S


def _rounding_bound(x: torch.Tensor, w_abs: torch.Tensor) -> torch.Tensor:
    """What rounding x's blocks of 32 to 16-bit codes can move y = x @ W^T by: 0.51 s_b per value
    (half a step, and the fp32 product that picks the code), times |W|. x [M, Kp], w_abs [N, Kp]."""
    _, s = act_quant_ref(x)  # [M, B]
    return (0.51 * s.repeat_interleave(BLOCK, dim=1)) @ w_abs.t()


def _check_mm(y: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, S: torch.Tensor, fast=None) -> None:
    """y from int4_mm/int8_mm against the fp32 reference, S the sizes of its fp32 terms. fast: (the C
    kernel's spec as a function of x padded to Kp, |W| [N, Kp]) when y came from the C kernel, whose
    rows must then be the spec's bit for bit, within the activation rounding of the reference."""
    K = x.shape[1]
    tol = _fp32_tol(K, S)
    if fast is not None:
        spec, w_abs = fast
        xp = F.pad(x, (0, w_abs.shape[1] - K))
        assert torch.equal(y, spec(xp)), "the C kernel differs from its spec"
        tol = tol + _rounding_bound(xp, w_abs)
    err = (y - ref).abs()
    assert (err <= tol).all(), (err / tol).max()


@pytest.mark.parametrize("name", ["int4-g32", "int4-sym-g32", "int4-g64", "int4-g128"])
@pytest.mark.parametrize("M,N", SHAPES_MN + [(1, 40), (17, 40), (11, 48)])
@pytest.mark.parametrize("K_groups", [3.0, 2.5], ids=["K_whole_groups", "K_partial_group"])
def test_int4_mm_matches_ref(name, M, N, K_groups, decode_kernel):
    spec = parse_weights(name)
    K = int(K_groups * spec.group_size) + (1 if K_groups % 1 else 0)  # partial: odd K as well
    w = quantize_weight(_matrix(N, K, seed=N + K), spec)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    codes = w.codes()
    p = int4_pack(codes, w.scales, w.mins, spec.group_size, K, native=decode_kernel.native)
    y = int4_mm(x, p)
    assert y.shape == (M, N) and y.dtype == torch.float32
    ref = int4_mm_ref(x, codes, w.scales, w.mins, spec.group_size)
    Kp = codes.shape[1]
    d = _per_element(w.scales.float(), spec.group_size, Kp)
    zero = torch.zeros_like(d) if w.mins is None else _per_element(w.mins.float(), spec.group_size, Kp)
    w_abs = w.dequantize().abs()
    # the sizes of the fp32 terms: the products, and the fast path's d s T and m s S (asymmetric) or
    # d s (T - 8 S) per block
    S = x.abs() @ (w_abs + codes[:, :K].float() * d[:, :K].abs() + zero[:, :K].abs() + 8 * d[:, :K].abs()).t()
    fast = (lambda xp: int4_mm_fast_ref(xp, codes, w.scales, w.mins, spec.group_size), F.pad(w_abs, (0, Kp - K)))
    _check_mm(y, x, ref, S, fast if decode_kernel.native is not None else None)


def test_int4_layout_is_lowbits_own():
    """The packed bytes are the documented layout (kernels/int4_mm.py, tile_layout.py), hand-checked at
    every position of one group: per 16-row tile and group of 32, d then m fp16 (64 bytes), then byte
    [j][r][i] = u[r][8j+i] | u[r][8j+4+i] << 4; symmetric scales (32 bytes) go two groups to a
    64-byte line, an odd last one padded; as many bytes as the codes and scales themselves (plus that
    padding); `unpack` inverts it; a 20-row weight is padded to 32 rows of zero weights."""
    N, K = 20, 96
    u = (torch.arange(N)[:, None] * 7 + torch.arange(K)[None, :] * 3) % 16  # [N, K]
    d = (torch.arange(N * 3).view(N, 3) + 1).half() / 64
    m = -d * 3
    p = int4_pack(u.to(torch.uint8), d, m, 32, K, native=None)
    assert p.data.shape == (2, 3 * (64 + 256)) and p.data.dtype == torch.uint8
    t = p.data[0, 320:640]  # tile 0 (rows 0-15), group 1 (k 32-63)
    assert torch.equal(t[:32].view(torch.float16), d[:16, 1]) and torch.equal(t[32:64].view(torch.float16), m[:16, 1])
    for j in range(4):
        for r in range(16):
            for i in range(4):
                lo, hi = int(u[r, 32 + 8 * j + i]), int(u[r, 32 + 8 * j + 4 + i])
                assert int(t[64 + 64 * j + 4 * r + i]) == lo | hi << 4, (j, r, i)
    uu, dd, mm = p.unpack()
    assert torch.equal(uu[:N], u.to(torch.uint8)) and torch.equal(dd[:N], d) and torch.equal(mm[:N], m)
    assert torch.equal(uu[N:], torch.full((12, K), 8, dtype=torch.uint8)) and not dd[N:].any() and not mm[N:].any()
    sym = int4_pack(u.to(torch.uint8), d, None, 32, K, native=None)
    # groups 0, 1: [d0 d1][codes 0][codes 1]; group 2: [d2, 32 zero bytes][codes 2]
    assert sym.data.shape == (2, 64 + 512 + 64 + 256)
    t = sym.data[1]  # tile 1: rows 16-19 and padding
    assert torch.equal(t[32:64].view(torch.float16)[:4], d[16:, 1]) and not t[32:64].view(torch.float16)[4:].any()
    assert torch.equal(t[576:608].view(torch.float16)[:4], d[16:, 2]) and not t[608:640].any()
    assert int(t[64 + 256 + 4 * 2 + 1]) == int(u[18, 33]) | int(u[18, 37]) << 4  # group 1, j 0, row 2, i 1
    assert torch.equal(sym.unpack()[0][:N], u.to(torch.uint8)) and torch.equal(sym.unpack()[1][:N], d)


def test_the_cpu_path_never_uses_torchs_private_int4_layout(monkeypatch):
    """Packing, the exact path and the fast path of a small model run without torch's int4/int8
    weight-only kernels and their packing (whose layout differs between torch's AVX2 and AVX-512
    builds): each raises if called."""
    from lowbit.models.config import LlamaConfig
    from lowbit.models.llama import Llama
    from lowbit.models.synthetic import random_weights

    def refuse(*a, **k):
        raise AssertionError("torch's private weight-only layout was used")

    for fn in ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm"):
        monkeypatch.setattr(torch, fn, refuse)
    cfg = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                      vocab_size=80, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64, tie_embeddings=True)
    model = Llama(cfg, random_weights(cfg, "int4-g32", "int8-g32", seed=3)).eval()
    from tests.helpers import Sequences

    with torch.inference_mode():
        seq = Sequences(model, 1, 24)
        seq.step(torch.arange(20)[None], exact=True)
        logits = seq.step(torch.tensor([[5]]), exact=False)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["int8", "int8-g32", "int8-g128"])
@pytest.mark.parametrize("M,N", SHAPES_MN + [(3, 40)])
@pytest.mark.parametrize("K_kind", ["whole", "partial"], ids=["K_whole_groups", "K_partial_group"])
def test_int8_mm_matches_ref(name, M, N, K_kind, decode_kernel):
    spec = parse_weights(name)
    if spec.group_size:
        K = 3 * spec.group_size if K_kind == "whole" else 2 * spec.group_size + 19
    else:  # per channel: one group of K, zero-padded to whole activation blocks when K % 32 != 0
        K = 576 if K_kind == "whole" else 91
    w = quantize_weight(_matrix(N, K, seed=N + K), spec)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    p = int8_pack(w.qweight, w.scales, K, native=decode_kernel.native)
    y = int8_mm(x, p)
    assert y.shape == (M, N) and y.dtype == torch.float32
    ref = int8_mm_ref(x, w.qweight, w.scales)
    Kp = p.padded_shape[1]
    w_abs = w.dequantize().abs()
    qw = F.pad(w.qweight, (0, Kp - w.qweight.shape[1]))
    fast = (lambda xp: int8_mm_fast_ref(xp, qw, w.scales), F.pad(w_abs, (0, Kp - K)))
    _check_mm(y, x, ref, x.abs() @ w_abs.t(), fast if decode_kernel.native is not None else None)


def test_int8_layout_is_lowbits_own():
    """int8 tiles, hand-checked: per tile, two groups' 16 fp16 scales to a 64-byte line, then their
    codes, byte [j][r][i] = q[r][4j+i] + 128 per block; per channel, fp32 scales (one 64-byte line) and
    K zero-padded to 32."""
    N, K = 16, 64
    q = ((torch.arange(N)[:, None] * 5 + torch.arange(K)[None, :] * 11) % 255 - 127).to(torch.int8)
    d = (torch.arange(N * 2).view(N, 2) + 1).half() / 256
    p = int8_pack(q, d, K, native=None)
    assert p.data.shape == (1, 64 + 2 * 512)
    t = p.data[0]
    assert torch.equal(t[:32].view(torch.float16), d[:, 0]) and torch.equal(t[32:64].view(torch.float16), d[:, 1])
    for j in range(8):
        for r in range(16):
            for i in range(4):
                assert int(t[64 + 512 + 64 * j + 4 * r + i]) == int(q[r, 32 + 4 * j + i]) + 128, (j, r, i)
    pc = int8_pack(q[:, :40], torch.rand(N, 1), 40, native=None)  # per channel, K = 40 → one group of 64
    assert pc.data.shape == (1, 64 + 64 * 16) and pc.scale_bytes == 4 and pc.padded_shape == (16, 64)


def test_int8_rows_are_the_dequantized_rows(decode_kernel):
    """Embedding lookups read the packed table (in C, or through torch without it): the same values
    as the reference dequantization."""
    for name in ("int8", "int8-g32"):
        w = quantize_weight(_matrix(300, 101, seed=5), parse_weights(name))
        ids = torch.tensor([0, 299, 17, 17, 42])
        assert torch.equal(int8_pack(w.qweight, w.scales, 101, native=decode_kernel.native).rows(ids), w.dequantize()[ids])


@pytest.mark.parametrize("name", ["int4-g32", "int4-sym-g64"])
def test_int4_table_lookups_read_the_tiles(name):
    """A tied int4 table is held once, in tiles, for the head's matmul and the lookups alike: its rows
    are the reference dequantization (N and K not whole tiles or groups), and the model keeps no copy."""
    from lowbit.kernels.int4_mm import int4_packed_rows
    from lowbit.quant.linear import cpu_kernels

    w = quantize_weight(_matrix(300, 101, seed=6), parse_weights(name))
    packed = int4_pack(w.codes(), w.scales, w.mins, w.spec.group_size, 101, native=None)
    ids = torch.tensor([0, 299, 17, 17, 42, 15, 16])
    assert torch.equal(int4_packed_rows(packed, ids), w.dequantize()[ids])
    kernels = cpu_kernels(None)
    table = kernels.pack_embedding(w)
    assert isinstance(table, Int4Packed) and kernels.shares_head(table)
    assert torch.equal(kernels.rows(table, ids), w.dequantize()[ids])


@pytest.mark.parametrize("name", ["int4-g32", "int8-g32", "f32"])
def test_exact_path_rows_do_not_depend_on_the_row_count(name):
    """The exact path gives a row the same bits whether it comes alone, with a few others or with
    many (torch's GEMM picks another kernel for a few rows: kernels/exact_mm.py) — the engine's
    prompt rows come in steps of any size. 2 threads, where the small-M kernels differ most."""
    from lowbit.kernels.cpu_native import native
    from lowbit.quant.linear import cpu_kernels

    kernels = cpu_kernels(native())
    spec = parse_weights(name)
    w = kernels.pack(quantize_weight(_matrix(200, 576, seed=9), spec))
    x = torch.randn(48, 576, generator=torch.Generator().manual_seed(1))
    torch.set_num_threads(2)
    try:
        full = kernels.matmul(x, w, True)
        for M in list(range(1, 17)) + [23, 31]:
            assert torch.equal(kernels.matmul(x[:M], w, True), full[:M]), M
    finally:
        torch.set_num_threads(1)  # this module's `one_thread`


@pytest.mark.parametrize("name", ["int4-g32", "int4-sym-g64", "int4-g128", "int8", "int8-g32"])
@pytest.mark.parametrize("M", [16, 40])
def test_exact_path_matches_ref_in_fp32(name, M, decode_kernel):
    """Asked for the exact path (prompts of verified greedy, evaluation's reference), the kernels
    dequantize with the exact scales and multiply in fp32: the result equals the fp32 reference up to
    fp32 summation order (K = 200 terms)."""
    torch.manual_seed(M)
    spec = parse_weights(name)
    K = 200 if spec.bits == 8 else 256
    w = quantize_weight(torch.randn(40, K), spec)
    x = torch.randn(M, K)
    if spec.bits == 4:
        y = int4_mm(x, int4_pack(w.codes(), w.scales, w.mins, spec.group_size, K, native=decode_kernel.native), True)
        ref = int4_mm_ref(x, w.codes(), w.scales, w.mins, spec.group_size)
    else:
        y = int8_mm(x, int8_pack(w.qweight, w.scales, K, native=decode_kernel.native), True)
        ref = int8_mm_ref(x, w.qweight, w.scales)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
