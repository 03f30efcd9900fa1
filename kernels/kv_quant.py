"""The KV cache's number formats, as plain-torch specs: quantize on write, dequantize on read.

Each cached vector (one token, one KV head, D values) is quantized on its own, so a token can be
written the moment it is computed and a page never has to be re-quantized (KIVI's per-channel keys
need a whole group of tokens first). Before quantizing, a vector may be rotated by a normalized
Hadamard matrix H (D a power of 2): attention is unchanged — (qH)(kH)^T = qk^T and P(vH)H^T = Pv —
but the few outlier channels that keys and values carry (KVQuant, QuaRot) are spread over all D
values, so one scale per group fits every value instead of being set by the outlier (`rotation`:
random signs, then H).

    int8  symmetric, one fp16 scale per `group` values      x = d * q,            q in -127..127
    int4  asymmetric, fp16 scale and min per `group` values  x = d * u + m,        u in 0..15

Codes of int4 are packed two per byte, low nibble first (as quant/int4.py packs weights).
"""

from __future__ import annotations

import math

import torch


def rotation(D: int, device=None) -> torch.Tensor:
    """The KV rotation: fp32 [D, D] = diag(s) @ H with fixed pseudo-random signs s (seed 0), the
    randomized Hadamard of QuaRot. The signs decorrelate the outlier channels from H's rows: on the
    default model k8v4 measured mean KL 0.00455 against 0.00492 with H alone."""
    g = torch.Generator().manual_seed(0)
    signs = torch.where(torch.rand(D, generator=g) < 0.5, -1.0, 1.0)
    return (signs[:, None] * hadamard(D)).to(device)


def hadamard(D: int, device=None) -> torch.Tensor:
    """fp32 [D, D] orthonormal Sylvester-Hadamard matrix (D a power of 2): H @ H.T = I."""
    if D & (D - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-2 head_dim, got {D}")
    H = torch.ones(1, 1)
    while H.shape[0] < D:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return (H / math.sqrt(D)).to(device)


def quantize_int8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] → codes int8 [..., D], scales fp16 [..., D/group]. The scale is rounded to fp16
    before the codes are chosen, so the codes fit the scale that is kept."""
    g = x.float().unflatten(-1, (-1, group))  # [..., G, g]
    d = (g.abs().amax(-1, keepdim=True) / 127.0).half()
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = (g * inv).round().clamp(-127, 127).to(torch.int8)
    return q.flatten(-2), d.squeeze(-1)


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes int8 [..., D], scales [..., G] → fp32 [..., D]."""
    g = codes.unflatten(-1, (scales.shape[-1], -1)).float()  # [..., G, g]
    return (g * scales.float().unsqueeze(-1)).flatten(-2)


def quantize_int4(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] → packed codes uint8 [..., D/2], scales and mins fp16 [..., D/group]: min-max
    asymmetric (the range's two ends are exact, all 16 levels used)."""
    g = x.float().unflatten(-1, (-1, group))  # [..., G, g]
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    m = lo.half()
    d = ((hi - m.float()) / 15.0).half()
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    u = ((g - m.float()) * inv).round().clamp(0, 15).to(torch.uint8).flatten(-2)  # [..., D]
    return u[..., 0::2] | (u[..., 1::2] << 4), d.squeeze(-1), m.squeeze(-1)


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., D/2], scales/mins [..., G] → fp32 [..., D]."""
    u = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)  # [..., D], even k low nibble
    g = u.unflatten(-1, (scales.shape[-1], -1)).float()  # [..., G, g]
    return (g * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)).flatten(-2)
