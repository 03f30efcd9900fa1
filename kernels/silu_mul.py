"""SwiGLU's elementwise half: out = silu(gate) * up, in fp32, stored in gate's dtype.

gate and up are usually the two halves of one fused gate+up projection output [M, 2I], so each may
have any row stride; only the last dim must be contiguous. The grid is (M, cdiv(I, BLOCK)) with
BLOCK = min(1024, next_power_of_2(I)): SmolLM2's I = 1536 is two blocks per row.

silu(g) = g / (1 + exp(-g)), the form torch's CPU kernel uses; for g < -88, exp(-g) overflows to inf
and the result is -0.0, as in torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.kernels.triton_import import check_device, tl, triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_MAX_BLOCK = 1024  # 1024 fp32 lanes = 8 per thread at 4 warps; bigger rows take more programs


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_g, stride_u, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31 at long prompts
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    # Widen at once: the interpreter holds bf16 as raw uint16, and fp32 is the model's numerics anyway.
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [M, I] of one dtype (any row strides) → new contiguous [M, I] silu(gate) * up in
    gate's dtype."""
    check_device(gate, up)
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate and up must be [M, I] of one shape, got {tuple(gate.shape)} "
                         f"and {tuple(up.shape)}")
    if gate.dtype not in _FLOATS or up.dtype != gate.dtype:
        raise ValueError(f"silu_mul: gate and up must share an fp16/bf16/fp32 dtype, got {gate.dtype} "
                         f"and {up.dtype}")
    M, n_cols = gate.shape
    if n_cols > 1 and (gate.stride(1) != 1 or up.stride(1) != 1):
        raise ValueError(f"silu_mul: last dim must be contiguous, got strides {gate.stride()} and "
                         f"{up.stride()}")
    out = torch.empty((M, n_cols), dtype=gate.dtype, device=gate.device)
    if M == 0 or n_cols == 0:
        return out
    block = min(_MAX_BLOCK, triton.next_power_of_2(n_cols))
    _silu_mul_kernel[(M, triton.cdiv(n_cols, block))](gate, up, out, gate.stride(0), up.stride(0), n_cols,
                                                     BLOCK=block)
    return out


def silu_mul_cpu(gate: torch.Tensor, up: torch.Tensor, *, native) -> torch.Tensor:
    """The CPU backend's op (`native`: its C kernels, or None): lowbit's C loop (kernels/cpu_block.c,
    exp 8 lanes at a time) for fp32 [M, I] with a contiguous last dim, else the spec below."""
    if native is None or gate.dim() != 2 or gate.dtype != torch.float32 or up.dtype != torch.float32 \
            or gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        return silu_mul_ref(gate, up)
    return native.silu_mul(gate, up)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The spec, any leading shape: silu(gate) * up in fp32, cast to gate's dtype."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
