"""int4 weight layout: 4-bit codes in groups along K, fp16 scale (and min) per group.

Storage (the canonical, device-independent layout; kernels derive their own from it once):

    qweight  uint8 [N, Kp/2]  code of element k of row n is nibble (k & 1) of byte k // 2, low first
    scales   fp16  [N, G]     G = Kp / group_size, Kp = K rounded up to a whole group
    mins     fp16  [N, G]     asymmetric only

    asymmetric: w = scale * u + min        (u in 0..15; GGUF Q4_1 is exactly this with group 32)
    symmetric:  w = scale * (u - 8)        (GGUF Q4_0 is exactly this with group 32)

fp16 scales are what GGUF stores, so Q4_0/Q4_1 move in without rounding anything; for load-time
quantization the scale is rounded to fp16 *before* the codes are chosen, so the codes fit the
scale that is actually kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lowbit.kernels.int4_mm import int4_dequant_ref
from lowbit.quant.spec import WeightSpec


@dataclass
class Int4Weight:
    spec: WeightSpec
    in_features: int  # K before padding to a whole group
    qweight: torch.Tensor  # uint8 [N, Kp/2]
    scales: torch.Tensor  # fp16 [N, G]
    mins: torch.Tensor | None  # fp16 [N, G] (asymmetric) or None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins) if t is not None)

    def codes(self) -> torch.Tensor:
        """uint8 [N, Kp] codes 0..15."""
        return unpack_nibbles(self.qweight)

    def dequantize(self) -> torch.Tensor:
        """Reference dequantization, fp32 [N, K]. Computes in the order GGUF's reference does
        (scale * u + min, scale * (u - 8)) so lossless relayouts compare bit-exactly."""
        return int4_dequant_ref(self.codes(), self.scales, self.mins, self.spec.group_size)[:, : self.in_features]

    def rows(self, index: torch.Tensor) -> "Int4Weight":
        """The same layout restricted to some output rows (used to un-permute GGUF Q/K rows)."""
        return Int4Weight(self.spec, self.in_features, self.qweight[index].contiguous(),
                          self.scales[index].contiguous(),
                          None if self.mins is None else self.mins[index].contiguous())


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (K even, values 0..15) → uint8 [N, K/2], low nibble = even k.
    Byte work goes through numpy: torch's uint8 kernels are ~10x slower on strided views."""
    a = u.to(torch.uint8).numpy()
    return torch.from_numpy(np.ascontiguousarray(a[:, 0::2] | (a[:, 1::2] << 4)))


def unpack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] → uint8 codes [N, K]."""
    a = q.numpy()
    out = np.empty((a.shape[0], a.shape[1], 2), dtype=np.uint8)  # [N, K/2, (even, odd)]
    np.bitwise_and(a, 0xF, out=out[..., 0])
    np.right_shift(a, 4, out=out[..., 1])
    return torch.from_numpy(out.reshape(a.shape[0], -1))


def quantize(w: torch.Tensor, spec: WeightSpec) -> Int4Weight:
    """fp32/fp16/bf16 [N, K] → Int4Weight. A partial last group is zero-padded (the pad codes
    dequantize to exactly 0 only in the symmetric case; they multiply padded zeros in x either way)."""
    assert spec.bits == 4 and spec.group_size > 0
    N, K = w.shape
    g = spec.group_size
    Kp = -(-K // g) * g
    w = torch.nn.functional.pad(w.float(), (0, Kp - K)).view(N, Kp // g, g)  # [N, G, g]
    if spec.symmetric:
        # Like Q4_0: the element of largest magnitude maps to code 0 (value -8 * d) so the whole
        # [-8, 7] range is used on the side that needs it.
        idx = w.abs().argmax(dim=-1, keepdim=True)
        extreme = torch.gather(w, -1, idx)
        d = (extreme / -8.0).half()
        inv = torch.where(d != 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        u = (w * inv + 8.0).round().clamp(0, 15)
        mins = None
    else:
        lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
        m = lo.half()
        d = ((hi - m.float()) / 15.0).half()
        inv = torch.where(d != 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        u = ((w - m.float()) * inv).round().clamp(0, 15)
        mins = m.squeeze(-1).contiguous()
    qweight = pack_nibbles(u.reshape(N, Kp))
    return Int4Weight(spec, K, qweight, d.squeeze(-1).contiguous(), mins)
