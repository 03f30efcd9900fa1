"""The elementwise Triton kernels (kernels/rms_norm.py, rotary.py, silu_mul.py) against their `_ref`
specs, and each spec against an independent oracle.

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without
CUDA); on a GPU machine the `cuda` cases run and the `cpu` ones skip. Shapes are small and odd (M = 1,
3, 17; D = 576, 1000; 9 heads / 3 KV heads at D = 64 and 80; I = 1, 1000, 1536) so that masked tails
and multi-block rows are hit while the interpreter, which runs one program at a time, stays fast.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lowbit.kernels.rms_norm import add_rms_norm, add_rms_norm_ref
from lowbit.kernels.rotary import rotary_, rotary_ref
from lowbit.kernels.silu_mul import silu_mul, silu_mul_ref
from lowbit.kernels.triton_import import interpreting

# (atol, rtol) for kernel output against its ref. Both compute in fp32 and differ by a few fp32 ulps
# (reduction order; on GPU the approximate rsqrt/exp/div and fused multiply-adds), and Triton's
# interpreter casts fp32 -> bf16 by truncation where torch rounds to nearest (half the bf16 outputs
# come out one ulp toward zero). Either moves a rounded result by at most one ulp of its dtype, and
# one ulp is at most 2^-mantissa_bits of the value: rtol = 2^-10 (fp16), 2^-7 (bf16). fp32 outputs
# get 8 ulps (2^-20) for the few-ulp differences (measured here: 2.4e-7 rms norm, 3.0e-7 silu).
# atol = 1e-6 covers rotary's cancellation near 0: an FMA changes x1*cos - x2*sin by up to half an
# fp32 ulp of the products, 2^-24 * |x| = 2.4e-7 at |x| = 4.
TOL = {
    torch.float16: (1e-6, 2.0 ** -10),
    torch.bfloat16: (1e-6, 2.0 ** -7),
    torch.float32: (1e-6, 2.0 ** -20),
}
DTYPES = list(TOL)
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreting(),
                                                 reason="CPU runs kernels only under TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    atol, rtol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def randn(*shape, gen, device, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    """Drawn on the CPU from a seeded generator, so both devices see the same numbers."""
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def rope_cos_sin(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """theta [M, D/2] → fp32 cos, sin [M, D] with equal halves, as models/rope.py builds them."""
    theta = torch.cat((theta, theta), dim=-1).double()  # [M, D]
    return theta.cos().float(), theta.sin().float()


# ---- add_rms_norm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("D", [576, 1000])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_ref(device, dtype, M, D, with_residual):
    gen = torch.Generator().manual_seed(M * D)
    wide = randn(M, D + 24, gen=gen, device=device, dtype=dtype)
    x = wide[:, 7:7 + D]  # [M, D] with row stride D + 24: a slice of a wider buffer
    residual = randn(M, D, gen=gen, device=device, scale=4.0) if with_residual else None
    weight = randn(D, gen=gen, device=device)
    eps = 1e-5
    want, want_res = add_rms_norm_ref(x, residual, weight, eps)
    residual_before = None if residual is None else residual.clone()
    x_before = x.clone()

    got, got_res = add_rms_norm(x, residual, weight, eps)

    assert got.is_contiguous() and got.dtype == dtype
    assert_close(got, want)
    # The residual add is one fp32 addition on both sides: bit-exact, and done in place when given.
    assert torch.equal(got_res, want_res) and got_res.dtype == torch.float32
    if with_residual:
        assert got_res is residual
        assert torch.equal(residual, residual_before + x_before.float())
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("x_dtype", "out_dtype"), [(torch.bfloat16, torch.float32),
                                                    (torch.float32, torch.bfloat16),
                                                    (torch.float32, torch.float16)])
def test_add_rms_norm_out_dtype(device, x_dtype, out_dtype):
    gen = torch.Generator().manual_seed(5)
    x = randn(3, 576, gen=gen, device=device, dtype=x_dtype)
    residual, weight = randn(3, 576, gen=gen, device=device), randn(576, gen=gen, device=device)
    want, _ = add_rms_norm_ref(x, residual.clone(), weight, 1e-6, out_dtype)
    got, _ = add_rms_norm(x, residual, weight, 1e-6, out_dtype)
    assert_close(got, want)


def test_add_rms_norm_ref_against_torch_rms_norm():
    """Independent oracle: torch's own rms_norm on r = residual + x, in fp32; any leading shape."""
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 5, 1000, generator=gen), torch.randn(2, 5, 1000, generator=gen) * 4
    weight = torch.randn(1000, generator=gen)
    x_before, residual_before = x.clone(), residual.clone()
    normed, r = add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # nothing mutated
    assert torch.equal(r, residual + x)
    torch.testing.assert_close(normed, F.rms_norm(residual + x, (1000,), weight, 1e-5), atol=1e-6, rtol=1e-6)
    normed, r = add_rms_norm_ref(x.half(), None, weight, 1e-5)
    assert normed.dtype == torch.float16 and torch.equal(r, x.half().float())
    torch.testing.assert_close(normed.float(), F.rms_norm(x.half().float(), (1000,), weight, 1e-5),
                               atol=2.0 ** -25, rtol=2.0 ** -11)  # the final fp16 rounding (atol: subnormals)


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_bad_inputs(device):
    x, w = torch.zeros(3, 64, device=device), torch.ones(64, device=device)
    res = torch.zeros(3, 64, device=device)
    with pytest.raises(ValueError, match="x must be"):
        add_rms_norm(x[None], None, w, 1e-5)  # 3-D
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, w.half(), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, res[:2], w, 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, res.half(), w, 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm(torch.zeros(64, 3, device=device).t(), None, w, 1e-5)
    with pytest.raises(ValueError, match="x must be"):
        add_rms_norm(x.to(torch.int32), None, w, 1e-5)


# ---- rotary_ --------------------------------------------------------------------------------------


def fused_qkv(M, H, Hkv, D, *, gen, device, dtype):
    """One [M, (H + 2 Hkv) D] projection output and q, k, v views of its column slices."""
    buf = randn(M, (H + 2 * Hkv) * D, gen=gen, device=device, dtype=dtype, scale=2.0)
    q = buf[:, : H * D].view(M, H, D)  # [M, H, D], strides ((H + 2 Hkv) D, D, 1)
    k = buf[:, H * D : (H + Hkv) * D].view(M, Hkv, D)  # [M, Hkv, D]
    v = buf[:, (H + Hkv) * D :]  # [M, Hkv D]
    return buf, q, k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("D", [64, 80])
def test_rotary_matches_ref_in_place_on_fused_qkv(device, dtype, M, D):
    H, Hkv = 9, 3
    gen = torch.Generator().manual_seed(M * D)
    buf, q, k, v = fused_qkv(M, H, Hkv, D, gen=gen, device=device, dtype=dtype)
    positions = torch.randint(0, 4096, (M,), generator=gen).double()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    cos, sin = (t.to(device) for t in rope_cos_sin(positions[:, None] * inv_freq[None, :]))
    want_q, want_k = rotary_ref(q, k, cos, sin)
    v_before = v.clone()
    q_ptr, k_ptr = q.data_ptr(), k.data_ptr()

    got_q, got_k = rotary_(q, k, cos, sin)

    assert got_q is q and got_k is k and q.data_ptr() == q_ptr and k.data_ptr() == k_ptr
    assert_close(buf[:, : H * D].view(M, H, D), want_q)  # written into the fused buffer itself
    assert_close(buf[:, H * D : (H + Hkv) * D].view(M, Hkv, D), want_k)
    assert torch.equal(v, v_before)  # V sits next to K in the buffer and is not touched


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_contiguous_and_mixed_dtypes(device):
    """q head-major (strides (D, M D, 1)), k contiguous, of different dtypes: each in its own dtype."""
    gen = torch.Generator().manual_seed(3)
    q = randn(4, 5, 64, gen=gen, device=device, dtype=torch.float16).transpose(0, 1)  # [M=5, H=4, D]
    k = randn(5, 2, 64, gen=gen, device=device, dtype=torch.bfloat16)
    cos, sin = (t.to(device) for t in rope_cos_sin(torch.rand(5, 32, generator=gen) * 6.3))
    want_q, want_k = rotary_ref(q, k, cos, sin)
    rotary_(q, k, cos, sin)
    assert_close(q, want_q)
    assert_close(k, want_k)


def test_rotary_ref_against_complex_rotation():
    """Independent oracle: rotate-half turns the pair (x[i], x[i + D/2]) by theta_i, i.e. multiplies
    x[i] + j x[i + D/2] by exp(j theta_i)."""
    gen = torch.Generator().manual_seed(1)
    M, H, Hkv, D = 4, 3, 1, 80
    q, k = torch.randn(M, H, D, generator=gen), torch.randn(M, Hkv, D, generator=gen)
    theta = torch.rand(M, D // 2, generator=gen, dtype=torch.float64) * 100  # [M, D/2]
    cos, sin = rope_cos_sin(theta)
    q_before = q.clone()
    got_q, got_k = rotary_ref(q, k, cos, sin)
    assert torch.equal(q, q_before)  # the ref returns new tensors
    for x, got in ((q, got_q), (k, got_k)):
        z = torch.complex(x[..., : D // 2].double(), x[..., D // 2 :].double())  # [M, heads, D/2]
        z = z * torch.polar(torch.ones_like(theta), theta)[:, None, :]
        want = torch.cat((z.real, z.imag), dim=-1).float()  # [M, heads, D]
        # fp32 cos/sin carry 2^-24 relative error each; |x| < 5 keeps the error well under 1e-6.
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_bad_inputs(device):
    q, k = torch.zeros(3, 4, 64, device=device), torch.zeros(3, 2, 64, device=device)
    cos = sin = torch.zeros(3, 64, device=device)
    with pytest.raises(ValueError, match="q must be"):
        rotary_(q[:, 0], k, cos, sin)  # 2-D
    with pytest.raises(ValueError, match="k must be"):
        rotary_(q, k[:2], cos, sin)
    with pytest.raises(ValueError, match="cos"):
        rotary_(q, k, cos.half(), sin)
    with pytest.raises(ValueError, match="contiguous"):
        rotary_(torch.zeros(3, 64, 4, device=device).transpose(1, 2), k, cos, sin)
    with pytest.raises(ValueError, match="even"):
        rotary_(q[..., :63], k[..., :63], cos[:, :63].contiguous(), sin[:, :63].contiguous())


# ---- silu_mul -------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("I", [1, 1000, 1536])
def test_silu_mul_matches_ref(device, dtype, M, I):
    gen = torch.Generator().manual_seed(M * I)
    gate_up = randn(M, 2 * I, gen=gen, device=device, dtype=dtype, scale=3.0)
    gate, up = gate_up[:, :I], gate_up[:, I:]  # the two halves of one fused projection, row stride 2I
    before = gate_up.clone()
    got = silu_mul(gate, up)
    assert got.is_contiguous() and got.dtype == dtype
    assert_close(got, silu_mul_ref(gate, up))
    assert torch.equal(gate_up, before)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_different_row_strides(device):
    gen = torch.Generator().manual_seed(2)
    gate = randn(3, 1000, gen=gen, device=device, dtype=torch.bfloat16)  # row stride 1000
    up = randn(3, 1100, gen=gen, device=device, dtype=torch.bfloat16)[:, 50:1050]  # row stride 1100
    assert_close(silu_mul(gate, up), silu_mul_ref(gate, up))


def test_silu_mul_ref_against_hand_values():
    """Independent oracle: silu(g) = g / (1 + e^-g) written out at a few points, times up."""
    g = torch.tensor([[0.0, 1.0, -1.0, 2.0], [10.0, -10.0, 0.5, -0.5]])
    u = torch.tensor([[3.0, 1.0, 2.0, -0.5], [1.0, 1.0, 4.0, 4.0]])
    want = [[0.0, 1 / (1 + math.exp(-1)), -2 / (1 + math.e), -1 / (1 + math.exp(-2))],
            [10 / (1 + math.exp(-10)), -10 / (1 + math.exp(10)), 2 / (1 + math.exp(-0.5)),
             -2 / (1 + math.exp(0.5))]]
    torch.testing.assert_close(silu_mul_ref(g, u), torch.tensor(want), atol=0, rtol=2.0 ** -23)
    assert silu_mul_ref(g[None].half(), u[None].half()).shape == (1, 2, 4)  # any leading shape
    assert silu_mul_ref(g.bfloat16(), u.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_bad_inputs(device):
    gate = torch.zeros(3, 8, device=device)
    with pytest.raises(ValueError, match="one shape"):
        silu_mul(gate, gate[:, :4])
    with pytest.raises(ValueError, match="dtype"):
        silu_mul(gate, gate.half())
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul(torch.zeros(8, 3, device=device).t(), gate)


def test_launchers_refuse_cpu_tensors_outside_the_interpreter(monkeypatch):
    """Without the interpreter a CPU tensor is a caller's mistake: one ValueError, not a crash."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="CUDA"):
        add_rms_norm(x, None, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="CUDA"):
        silu_mul(x, x)
    with pytest.raises(ValueError, match="CUDA"):
        rotary_(x.view(2, 1, 8), x.view(2, 1, 8), x, x)
