"""Integer activations for the CPU decode kernels: the format, in plain torch (the spec).

Each row of x [M, K] is quantized on its own, per block of 32 along K:

    amax = max |x| over the block          s = amax / QMAX          q = round(x * (QMAX / amax))

(fp32, one IEEE division each, round half to even; amax = 0 gives s = 0, q = 0). QMAX = 32512 =
127 * 256 by default: 16-bit precision, 2^-16 of the block's largest value (bf16 keeps 2^-8 per
value, llama.cpp's Q8 activations 2^-8 of the block's max). The kernels split q into two int8 planes,
h = (q + 128) >> 8 in [-127, 127] and l = q - 256 h in [-128, 127], so one u8 x s8 dot product
instruction (vpdpbusd, vpmaddubsw) multiplies weight codes by each plane; the block sums are exact
integers either way.

Why 16 bits and not llama.cpp's 8: measured on the default model by fake-quantizing every linear's
input in the exact path (`tests/bench/activation_kl.py`, docs/perf.md), per-32 int8 activations
cost more KL than the budget the fast decode has (docs/perf.md has the figures).

The row and the block are the only context of a value's rounding, so a row's codes do not depend on
the other rows of a call: the integer kernels are batch-invariant by construction.
"""

from __future__ import annotations

import torch

BLOCK = 32  # activation values per scale
Q16_MAX = 32512  # 127 * 256: the two int8 planes h, l stay in [-127, 127] and [-128, 127]
Q8_MAX = 127  # llama.cpp's Q8_0/Q8_1 activations (the KL measurement's comparison)


def act_quant_ref(x: torch.Tensor, qmax: int = Q16_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) → (q int32 [M, K], s fp32 [M, K / 32]): x ≈ q * s per block."""
    M, K = x.shape
    if K % BLOCK:
        raise ValueError(f"act_quant_ref: K={K} is not a multiple of {BLOCK}")
    xb = x.float().reshape(M, K // BLOCK, BLOCK)  # [M, B, 32]
    amax = xb.abs().amax(-1)  # [M, B]
    nz = amax > 0
    one = torch.ones_like(amax)
    inv = torch.where(nz, torch.full_like(amax, float(qmax)) / torch.where(nz, amax, one), torch.zeros_like(amax))
    s = amax / float(qmax)
    q = torch.round(xb * inv[..., None]).clamp_(-qmax, qmax)  # [M, B, 32], round half to even
    return q.to(torch.int32).reshape(M, K), s


def act_fake_quant(x: torch.Tensor, qmax: int = Q16_MAX) -> torch.Tensor:
    """x [M, K] → fp32 [M, K]: x as the integer kernels see it (q * s), K zero-padded to whole blocks
    for the rounding and cut back after."""
    M, K = x.shape
    Kp = -(-K // BLOCK) * BLOCK
    q, s = act_quant_ref(torch.nn.functional.pad(x.float(), (0, Kp - K)), qmax)
    return (q.view(M, -1, BLOCK).float() * s[..., None]).reshape(M, Kp)[:, :K]


def act_planes_ref(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q int32 in [-32512, 32512] → (h, l) int8 with q = 256 h + l (the kernels' two planes)."""
    h = torch.div(q + 128, 256, rounding_mode="floor")
    return h.to(torch.int8), (q - 256 * h).to(torch.int8)
