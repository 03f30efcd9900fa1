"""Fused residual add + RMS norm: r = residual + x (fp32, in place), normed = r / rms(r) * weight.

The residual stream is kept in fp32 (models/llama.py's precision policy) while the layer outputs
that are added into it may be fp16/bf16, so one pass does what the model otherwise does in four:
widen x, add it into the residual, normalize, cast for the next matmul. For SmolLM2-135M (dim 576)
a row is 576 fp32 = 2.3 KB, so one program holds a whole row in registers: one program per row,
BLOCK_D = next_power_of_2(D) lanes, the tail masked (D = 576 → 1024 lanes, 44% idle, still one
memory pass).

Every value is widened to fp32 as soon as it is loaded: besides being the model's numerics, Triton's
interpreter keeps bf16 as raw uint16 bits, so arithmetic on a bf16 value there is on integers.
"""

from __future__ import annotations

import torch

from lowbit.kernels.triton_import import check_device, tl, triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, D, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: M * stride passes 2^31 at long prompts
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * D + cols, mask=mask, other=0.0) + x
    else:
        r = x
    tl.store(res_ptr + row * D + cols, r, mask=mask)  # masked lanes are 0 (other=0.0): add nothing below
    # Same order as the ref: mean = sum / D, then (r * rsqrt) * weight.
    rstd = tl.rsqrt(tl.sum(r * r, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * D + cols, (r * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, D] fp16/bf16/fp32 (any row stride); residual fp32 [M, D] contiguous, updated in place to
    residual + x, or None (a new fp32 residual = x is made); weight fp32 [D].
    Returns (normed [M, D] in out_dtype or x.dtype, residual)."""
    check_device(x, residual, weight)
    if x.dim() != 2:
        raise ValueError(f"add_rms_norm: x must be [M, D], got shape {tuple(x.shape)}")
    M, D = x.shape
    if x.dtype not in _FLOATS:
        raise ValueError(f"add_rms_norm: x must be fp16, bf16 or fp32, got {x.dtype}")
    if D > 1 and x.stride(1) != 1:
        raise ValueError(f"add_rms_norm: x's last dim must be contiguous, got strides {x.stride()}")
    if weight.shape != (D,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"add_rms_norm: weight must be contiguous fp32 [{D}], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if residual is not None and (residual.shape != (M, D) or residual.dtype != torch.float32
                                 or not residual.is_contiguous()):
        raise ValueError(f"add_rms_norm: residual must be contiguous fp32 [{M}, {D}], got {residual.dtype} "
                         f"{tuple(residual.shape)} strides {residual.stride()}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _FLOATS:
        raise ValueError(f"add_rms_norm: out_dtype must be fp16, bf16 or fp32, got {out_dtype}")
    has_residual = residual is not None
    if residual is None:
        residual = torch.empty((M, D), dtype=torch.float32, device=x.device)
    out = torch.empty((M, D), dtype=out_dtype, device=x.device)
    if M == 0 or D == 0:
        return out, residual
    _add_rms_norm_kernel[(M,)](x, residual, weight, out, x.stride(0), D, float(eps),
                               HAS_RESIDUAL=has_residual, BLOCK_D=triton.next_power_of_2(D))
    return out, residual


def add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out_dtype: torch.dtype | None = None, *, native) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU backend's op (`native`: its C kernels, or None): lowbit's C row loop (kernels/cpu_block.c)
    for fp32 [M, D] rows — residual updated in place, as here on CUDA — else (no C kernels, other
    dtypes or shapes) the spec below."""
    if native is None or x.dim() != 2 or x.dtype != torch.float32 or x.stride(-1) != 1 or (
            residual is not None and not residual.is_contiguous()):
        return add_rms_norm_ref(x, residual, weight, eps, out_dtype)
    return native.add_rms_norm(x, residual, weight, eps, out_dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec, any leading shape [..., D]. Mutates nothing: the residual comes back as a new tensor
    (when residual is None and x is fp32 it is x itself, as x.float() is). The expression order is the
    CPU model's, so that path stays bit-identical."""
    r = x.float() if residual is None else residual + x.float()
    normed = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight
    return normed.to(out_dtype or x.dtype), r
