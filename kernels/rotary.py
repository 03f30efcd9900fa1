"""Rotary position embedding applied in place to q and k, rotate-half convention (HF's).

Pairs are (x[i], x[i + D/2]) turned by angle theta_i:
    out[:D/2] = x1 * cos - x2 * sin,    out[D/2:] = x2 * cos + x1 * sin
which is x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1). GGUF llama files store
Q/K for llama.cpp's adjacent-pair convention and are un-permuted at load (models/rope.py), so this is
the only convention.

q and k are usually column slices of one fused QKV output [M, (H + 2 Hkv) D] viewed as [M, H, D] and
[M, Hkv, D], so only the last dim is assumed contiguous. One launch rotates both: one program per token
holds all heads of that token as a [BLOCK_H, D/2] tile (SmolLM2: 9 heads x 32 → a 16 x 32 tile), once
for q and once for k. The cos/sin tables are per token [M, D] with equal halves (models/rope.py's
rope_tables), so only their first half is read.
"""

from __future__ import annotations

import torch

from lowbit.kernels.triton_import import check_device, tl, triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(x_ptr, row, stride_m, stride_h, n_heads, c, s, half, cols,
                  BLOCK_H: tl.constexpr):
    """Rotate all heads of one token in place; c, s are fp32 [1, BLOCK_HALF]."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < n_heads) & (cols < half)
    p1 = x_ptr + row * stride_m + heads * stride_h + cols  # [BLOCK_H, BLOCK_HALF] pointers to x1
    # Widen at once: the interpreter holds bf16 as raw uint16, and fp32 is the model's numerics anyway.
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + half, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qm, stride_qh, stride_km, stride_kh,
                   H, HKV, D, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: token * stride can pass 2^31 in long prefills
    half = D // 2
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    c = tl.load(cos_ptr + row * D + cols, mask=cols < half, other=0.0)  # [1, BLOCK_HALF]
    s = tl.load(sin_ptr + row * D + cols, mask=cols < half, other=0.0)
    _rotate_heads(q_ptr, row, stride_qm, stride_qh, H, c, s, half, cols, BLOCK_H)
    _rotate_heads(k_ptr, row, stride_km, stride_kh, HKV, c, s, half, cols, BLOCK_HKV)


def _check_heads(name: str, x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"rotary_: {name} must be [M, heads, D], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"rotary_: {name} must be fp16, bf16 or fp32, got {x.dtype}")
    if x.stride(2) != 1:
        raise ValueError(f"rotary_: {name}'s last dim must be contiguous, got strides {x.stride()}")


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [M, H, D] and k [M, Hkv, D] in place (any strides on dims 0 and 1) with per-token
    cos/sin fp32 [M, D] whose halves are equal; math in fp32, stored in each tensor's dtype.
    Returns (q, k)."""
    check_device(q, k, cos, sin)
    _check_heads("q", q)
    _check_heads("k", k)
    M, H, D = q.shape
    if k.shape[0] != M or k.shape[2] != D:
        raise ValueError(f"rotary_: k must be [{M}, Hkv, {D}] like q {tuple(q.shape)}, got {tuple(k.shape)}")
    if D % 2:
        raise ValueError(f"rotary_: head_dim must be even, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (M, D) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"rotary_: {name} must be contiguous fp32 [{M}, {D}], got {t.dtype} "
                             f"{tuple(t.shape)} strides {t.stride()}")
    Hkv = k.shape[1]
    if M == 0 or D == 0:
        return q, k
    _rotary_kernel[(M,)](q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), H, Hkv, D,
                         BLOCK_H=triton.next_power_of_2(H), BLOCK_HKV=triton.next_power_of_2(Hkv),
                         BLOCK_HALF=triton.next_power_of_2(D // 2))
    return q, k


def rotary_cpu(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               *, native) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU backend's op (`native`: its C kernels, or None): lowbit's C loop (kernels/cpu_block.c), in
    place, for fp32 q/k with a contiguous last dim — the spec's arithmetic exactly (two products and a
    sum, no FMA) — else the spec below."""
    if native is None or any(t.dtype != torch.float32 or t.dim() != 3 or t.stride(2) != 1 for t in (q, k)) \
            or not (cos.is_contiguous() and sin.is_contiguous()):
        return rotary_ref(q, k, cos, sin)
    return native.rotary(q, k, cos, sin)


def _rotary_ref_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x.float() * cos[:, None, :] + torch.cat((-x2, x1), -1).float() * sin[:, None, :]  # [M, H, D]
    return out.to(x.dtype)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec: q [M, H, D], k [M, Hkv, D], cos/sin [M, D] → new rotated (q, k) in their dtypes,
    computed in fp32 as x * cos + rotate_half(x) * sin."""
    return _rotary_ref_one(q, cos, sin), _rotary_ref_one(k, cos, sin)
