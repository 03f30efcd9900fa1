"""int8 weight-only matmul: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, W = scale * q.

CPU, like int4 (kernels/int4_mm.py), has two paths chosen by M:

- M < EXACT_MIN_ROWS: lowbit's C kernel (kernels/cpu_native.py), fp32, exact fp16 scales (LM head
  49152x576 Q8_0: 4.4 ms at M = 1, 11.4 ms at M = 5). Without it, torch's fused
  `_weight_int8pack_mm`, which takes one scale per output channel and is fast only in bf16 (LM
  head, M = 1: bf16 2.3 ms, fp32 20.7 ms): per-group scales (GGUF Q8_0: one per 32 weights) are
  served by calling it once per group on that group's columns and summing (LM head, M = 1: 4.6 ms,
  M = 5: 20 ms).
  The codes are kept group-major [G, N, g] so each group's slice is contiguous, and rows can still
  be gathered for embedding lookups.
- M >= EXACT_MIN_ROWS: exact fp32 — row tiles dequantized with the exact scales, fp32 GEMM.

The kernel reads K in steps of 8 (K % 8 != 0 returns garbage or crashes), so per-channel codes
are zero-padded to a multiple of 8; group sizes (32/64/128) already are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowbit.kernels import cpu_native
from lowbit.kernels.int4_mm import EXACT_MIN_ROWS

_TILE_ELEMS = 1 << 22  # exact path: dequantize ~4M weights (16 MB fp32) at a time


@dataclass
class Int8Packed:
    qweight: torch.Tensor  # int8 [G, N, g] group-major (per channel: [1, N, Kp8])
    scales: torch.Tensor  # fp16 [N, G] (grouped) or fp32 [N, 1]: the exact scales
    scales_t: torch.Tensor  # bf16 [G, N]: what the fused kernel multiplies by
    in_features: int  # K before padding

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (embedding lookup), fp32 [len(ids), K]."""
        return self.dequantize(ids)[:, : self.in_features]

    def dequantize(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Exact fp32 [n, Kp] of some rows (an index tensor or a slice)."""
        if isinstance(rows, slice) and rows.step is None and self.qweight.device.type == "cpu" \
                and (kernels := cpu_native.native()) is not None:  # the same numbers, in one C pass
            start, stop, _ = rows.indices(self.qweight.shape[1])
            return kernels.int8_dequant(self.qweight, self.scales, start, max(start, stop))
        q = self.qweight[:, rows, :]  # [G, n, g]
        w = q.float() * self.scales[rows].t().float().unsqueeze(-1)  # [G, n, g]
        return w.permute(1, 0, 2).reshape(q.shape[1], -1)


def int8_pack(qweight: torch.Tensor, scales: torch.Tensor, in_features: int) -> Int8Packed:
    """qweight int8 [N, Kp], scales [N, G] → group-major packed form."""
    N, Kp = qweight.shape
    G = scales.shape[1]
    if G == 1 and Kp % 8:
        qweight = F.pad(qweight, (0, 8 - Kp % 8))
        Kp = qweight.shape[1]
    q = qweight.view(N, G, Kp // G).transpose(0, 1).contiguous()  # [G, N, g]
    return Int8Packed(q, scales.contiguous(), scales.t().contiguous().to(torch.bfloat16), in_features)


def int8_mm(x: torch.Tensor, w: Int8Packed, exact: bool | None = None) -> torch.Tensor:
    """x [M, K] → y [M, N]: exact fp32 when `exact` (default: M >= EXACT_MIN_ROWS), else from the C
    kernel (fp32) or torch's bf16 fused kernel."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"int8_mm: x has shape {tuple(x.shape)}, expected [M, {w.in_features}]")
    if x.device.type != "cpu":
        raise NotImplementedError("int8_mm: only the CPU path exists yet")
    G, N, g = w.qweight.shape
    if G * g != w.in_features:
        x = F.pad(x, (0, G * g - w.in_features))
    if exact if exact is not None else x.shape[0] >= EXACT_MIN_ROWS:
        x = x.float()
        step = max(1, _TILE_ELEMS // (G * g))
        return torch.cat([F.linear(x, w.dequantize(slice(i, i + step))) for i in range(0, N, step)], dim=-1)
    if (kernels := cpu_native.native()) is not None:
        return kernels.int8_mm(x.float(), w.qweight, w.scales)
    x = x.to(torch.bfloat16)
    if G == 1:
        return torch._weight_int8pack_mm(x.contiguous(), w.qweight[0], w.scales_t[0])
    xs = x.view(x.shape[0], G, g)  # [M, G, g]
    y = torch._weight_int8pack_mm(xs[:, 0].contiguous(), w.qweight[0], w.scales_t[0]).float()
    for i in range(1, G):
        y += torch._weight_int8pack_mm(xs[:, i].contiguous(), w.qweight[i], w.scales_t[i])
    return y


def int8_dequant_ref(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The spec of the int8 layouts: qweight int8 [N, Kp], scales [N, G] → fp32 [N, Kp] (d * q,
    as GGUF's Q8_0 reference computes it)."""
    N, Kp = qweight.shape
    G = scales.shape[1]
    return (scales.float().unsqueeze(-1) * qweight.view(N, G, Kp // G).float()).reshape(N, Kp)  # via [N, G, g]


def int8_mm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The matmul's spec in fp32: dequantize then multiply."""
    return x.float() @ int8_dequant_ref(qweight, scales)[:, : x.shape[1]].t()
