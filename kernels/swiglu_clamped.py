"""gpt-oss's gated activation: gate clamped above at `limit`, up clamped to [-limit, limit], then
gate * sigmoid(alpha * gate) * (up + 1) (alpha 1.702, limit 7: transformers' GptOssExperts._apply_gate and
OpenAI's reference). The clamps keep outliers of the 4-bit experts from blowing up the product.

The CPU backend runs lowbit's C loop (kernels/cpu_moe.c lowbit_swiglu_clamped: the sigmoid as
1 / (1 + exp(-alpha g)), exp 8 lanes at a time), the same loop the one-call experts (kernels/cpu_moe.py)
run, so a row is the same expert by expert or in one call; `swiglu_clamped_ref` is the spec, which CUDA
runs (elementwise over a token's k experts' columns, gpt-oss-20b: 4 x 2880, beside the expert matmuls).
"""

from __future__ import annotations

import torch


def swiglu_clamped_cpu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float, *, native) -> torch.Tensor:
    """The CPU backend's op (`native`: its C kernels, or None): the C loop for fp32 [M, I] with a contiguous
    last dim, else the spec."""
    if native is None or gate.dim() != 2 or gate.dtype != torch.float32 or up.dtype != torch.float32 \
            or gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        return swiglu_clamped_ref(gate, up, alpha, limit)
    return native.swiglu_clamped(gate, up, alpha, limit)


def swiglu_clamped_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate, up [..., I] → [..., I] in gate's dtype, computed in fp32."""
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(min=-limit, max=limit)
    return (g * torch.sigmoid(g * alpha) * (u + 1)).to(gate.dtype)
