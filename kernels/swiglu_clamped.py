"""gpt-oss's gated activation: gate clamped above at `limit`, up clamped to [-limit, limit], then
gate * sigmoid(alpha * gate) * (up + 1) (alpha 1.702, limit 7: transformers' GptOssExperts._apply_gate and
OpenAI's reference). The clamps keep outliers of the 4-bit experts from blowing up the product.

One spec in plain torch, fp32, for every backend: it is elementwise over a token's k experts' columns
(gpt-oss-20b: 4 x 2880 per token), a few microseconds beside the expert matmuls it sits between.
"""

from __future__ import annotations

import torch


def swiglu_clamped_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate, up [..., I] → [..., I] in gate's dtype, computed in fp32."""
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(min=-limit, max=limit)
    return (g * torch.sigmoid(g * alpha) * (u + 1)).to(gate.dtype)
