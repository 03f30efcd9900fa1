"""GeGLU's elementwise step (Gemma's gated MLP): gelu(gate, tanh approximation) * up.

The CPU backend runs lowbit's C loop (kernels/cpu_block.c lowbit_gelu_tanh_mul: 0.5 g (1 + tanh(z)) as
g / (1 + exp(-2z)), exp 8 lanes at a time), the same loop the fused C block runs, so a step's rows are
the same op by op or fused; `gelu_tanh_mul_ref` is the spec (transformers' gelu_pytorch_tanh), which
CUDA runs too (one torch op; the Triton kernels cover the matmuls, norms and rotary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh_mul_cpu(gate: torch.Tensor, up: torch.Tensor, *, native) -> torch.Tensor:
    """The CPU backend's op (`native`: its C kernels, or None): the C loop for fp32 [M, I] with a
    contiguous last dim, else the spec."""
    if native is None or gate.dim() != 2 or gate.dtype != torch.float32 or up.dtype != torch.float32 \
            or gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        return gelu_tanh_mul_ref(gate, up)
    return native.gelu_tanh_mul(gate, up)


def gelu_tanh_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The spec, any leading shape: gelu_tanh(gate) * up in fp32, cast to gate's dtype."""
    return (F.gelu(gate.float(), approximate="tanh") * up.float()).to(gate.dtype)
