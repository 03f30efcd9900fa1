"""QuantLinear: a linear layer whose weight stays in its int4/int8 layout, and the embedding table.

Each layout is turned once, at construction, into the form its kernel reads (kernels/), and only
that form is kept: no full-precision shadow copy of a quantized weight ever exists. Every tensor
is also registered as a buffer so `model.buffers()` is the honest count of bytes held.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.kernels.int4_mm import int4_mm, int4_pack
from lowbit.kernels.int8_mm import Int8Packed, int8_mm, int8_pack
from lowbit.quant import FloatWeight, Int4Weight, Int8Weight, Weight


def _register(module: nn.Module, obj) -> None:
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            module.register_buffer(name, value, persistent=False)


def pack(weight: Weight):
    """A weight layout → the object its kernel reads."""
    if isinstance(weight, Int4Weight):
        return int4_pack(weight.codes(), weight.scales, weight.mins, weight.spec.group_size, weight.in_features)
    if isinstance(weight, Int8Weight):
        return int8_pack(weight.qweight, weight.scales, weight.in_features)
    return weight


def fuse_rows(weights: list[Weight]) -> Weight | None:
    """Concatenate layouts along N (QKV, gate+up) so one kernel call serves them; None if their
    layouts differ (mixed-type GGUF files), in which case the caller keeps them separate."""
    first = weights[0]
    if any(type(w) is not type(first) or w.spec != first.spec or w.in_features != first.in_features for w in weights):
        return None
    if isinstance(first, Int4Weight):
        mins = None if first.mins is None else torch.cat([w.mins for w in weights])
        return Int4Weight(first.spec, first.in_features, torch.cat([w.qweight for w in weights]),
                          torch.cat([w.scales for w in weights]), mins)
    if isinstance(first, Int8Weight):
        return Int8Weight(first.spec, first.in_features, torch.cat([w.qweight for w in weights]),
                          torch.cat([w.scales for w in weights]))
    return FloatWeight(first.spec, torch.cat([w.weight for w in weights]))


class QuantLinear(nn.Module):
    """y = x @ W^T (+ b). Input any float dtype [..., K]; output fp32 [..., N].
    `exact`: force the exact fp32 path (True) or the fused low-precision kernel (False); None lets
    the kernel choose by the number of rows (see kernels/int4_mm.py)."""

    def __init__(self, weight: Weight | Int8Packed, bias: torch.Tensor | None = None, spec_name: str | None = None):
        super().__init__()
        self.spec_name = spec_name or weight.spec.name  # an already packed table passes its layout's name
        self.w = weight if isinstance(weight, Int8Packed) else pack(weight)
        _register(self, self.w)
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)

    def forward(self, x: torch.Tensor, exact: bool | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        if isinstance(self.w, FloatWeight):
            y = torch.nn.functional.linear(x2.to(self.w.weight.dtype), self.w.weight)
        elif isinstance(self.w, Int8Packed):
            y = int8_mm(x2, self.w, exact)
        else:
            y = int4_mm(x2, self.w, exact)
        y = y.float()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, -1)


class QuantEmbedding(nn.Module):
    """Token ids → fp32 rows, read straight from the quantized table."""

    def __init__(self, weight: Weight | Int8Packed):
        super().__init__()
        self.w = int8_pack(weight.qweight, weight.scales, weight.in_features) if isinstance(weight, Int8Weight) else weight
        _register(self, self.w)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if isinstance(self.w, Int8Packed):
            rows = self.w.rows(flat)
        elif isinstance(self.w, FloatWeight):
            rows = self.w.weight[flat].float()
        else:  # Int4Weight kept in its plain layout: dequantize just these rows
            rows = self.w.rows(flat).dequantize()
        return rows.reshape(*ids.shape, -1)
