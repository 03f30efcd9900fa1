"""int8 weight layout: symmetric 8-bit codes, one scale per group along K or per output channel.

    qweight  int8 [N, Kp]   Kp = K rounded up to a whole group (K itself when per channel)
    scales   fp16 [N, G]    G = Kp / group_size; G = 1 per channel
    w = scale * q           (GGUF Q8_0 is exactly this with group 32, fp16 scales)

Per-channel scales are kept in fp32: with one scale per 576..8192 weights their cost is nil and
fp16 rounding would be the largest error left.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.kernels.int8_mm import int8_dequant_ref
from lowbit.quant.spec import WeightSpec


@dataclass
class Int8Weight:
    spec: WeightSpec
    in_features: int  # K before padding
    qweight: torch.Tensor  # int8 [N, Kp]
    scales: torch.Tensor  # fp16 [N, G] (grouped) or fp32 [N, 1] (per channel)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))

    def dequantize(self) -> torch.Tensor:
        """Reference dequantization, fp32 [N, K], computed as GGUF's reference does (d * q)."""
        return int8_dequant_ref(self.qweight, self.scales)[:, : self.in_features]

    def rows(self, index: torch.Tensor) -> "Int8Weight":
        return Int8Weight(self.spec, self.in_features, self.qweight[index].contiguous(),
                          self.scales[index].contiguous())


def quantize(w: torch.Tensor, spec: WeightSpec) -> Int8Weight:
    """fp32/fp16/bf16 [N, K] → Int8Weight (round to nearest, amax maps to ±127)."""
    assert spec.bits == 8
    N, K = w.shape
    g = spec.group_size or K
    Kp = -(-K // g) * g
    w = torch.nn.functional.pad(w.float(), (0, Kp - K)).view(N, Kp // g, g)  # [N, G, g]
    d = w.abs().amax(dim=-1, keepdim=True) / 127.0
    d = d.half().float() if spec.group_size else d
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = (w * inv).round().clamp(-127, 127).to(torch.int8)
    scales = d.squeeze(-1)
    scales = scales.half() if spec.group_size else scales
    return Int8Weight(spec, K, q.reshape(N, Kp).contiguous(), scales.contiguous())
