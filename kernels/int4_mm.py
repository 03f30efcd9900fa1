"""int4 weight-only matmul: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, w = (u - 8) * scale + zero.

CPU has two paths, chosen per call by M (the rows of x):

- M < EXACT_MIN_ROWS (decode, speculative verification, small batches): lowbit's C kernel
  (kernels/cpu_native.py, cpu_wq_mm.c), fp32 in and out, reading the codes in torch's packed layout
  with the exact fp16 scales. Where it cannot be built (no C compiler, no AVX2/FMA/F16C, or
  LOWBIT_NATIVE=0): torch's fused kernel `_weight_int4pack_mm_for_cpu`, which is fast only in bf16
  (1728x576 weight, M = 1: bf16 0.085 ms, fp16 1.48 ms, fp32 1.17 ms), so x and the scale/zero
  pairs go in as bf16 and y comes out bf16; its cost grows with every row (M = 5: 0.32 ms, against
  0.17 ms for the C kernel).
- M >= EXACT_MIN_ROWS (prefill, evaluation): the codes are unpacked from the kernel's layout and
  dequantized with the exact fp16 scales into an fp32 tile that lives for this call only, then
  multiplied by oneDNN's fp32 GEMM. Exact, and faster than the fused kernel once M is large
  (M = 512: 7.7 ms against 21 ms for the bf16 kernel on the 1728x576 weight).

A torch build whose packing differs from torch 2.13's (torch 2.11 on a CUDA machine did) keeps the
codes in lowbit's own nibble layout instead and runs the exact path for every M: correct, with a
slower decode, and a warning saying so.

Only the packed codes and the file's own fp16 scales and mins are held (torch's kernel gets its bf16
scale/zero pairs rebuilt per call), so memory stays at the GGUF's size.

The kernel's convention w = (u - 8) * scale + zero covers both lowbit layouts: asymmetric
(w = d * u + m) is scale = d, zero = m + 8 d; symmetric (w = d * (u - 8)) is zero = 0.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowbit.kernels import cpu_native

EXACT_MIN_ROWS = 16
_BLOCK_N = 32  # rows per tile in torch 2.13's CPU int4 packing; checked on every weight at pack time


@dataclass
class Int4Packed:
    packed: torch.Tensor  # uint8: torch's CPU tile layout of codes [Np, Kp]; if not `fused`, [Kp, Np/2] nibbles
    scale_min: torch.Tensor  # fp16 [G, Np, 2]: (d, m) pairs, the kernel's pair layout; [G, Np, 1] (d) if symmetric
    group_size: int
    out_features: int  # N before padding to 16 rows
    in_features: int  # K before padding to a whole group
    fused: bool = True  # `packed` is in the layout torch's fused kernel reads

    def codes_t(self) -> torch.Tensor:
        """uint8 codes W^T [Kp, Np]."""
        Np, Kp = self.padded_shape
        if self.fused:
            return _unpack_cpu_t(self.packed, Np, Kp)
        return torch.stack((self.packed & 0xF, self.packed >> 4), dim=2).view(Kp, Np)  # [Kp, Np/2, 2] → [Kp, Np]

    @property
    def padded_shape(self) -> tuple[int, int]:
        return self.scale_min.shape[1], self.scale_min.shape[0] * self.group_size

    def scale_zeros(self) -> torch.Tensor:
        """bf16 [G, Np, 2] (scale, zero) for the fused kernel: zero = m + 8 d (asymmetric), 0 (symmetric).
        Rebuilt per call (~80 us for a 3072x576 weight) so only the exact fp16 pairs are held."""
        f = self.scale_min.float()
        if self.symmetric:
            return F.pad(f, (0, 1)).to(torch.bfloat16)
        f[..., 1].add_(f[..., 0], alpha=8.0)
        return f.to(torch.bfloat16)

    @property
    def symmetric(self) -> bool:
        return self.scale_min.shape[2] == 1


def _unpack_cpu_t(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """Inverse of `_convert_weight_to_int4pack_for_cpu` (torch 2.13), transposed: uint8 codes [K, N].

    Full tiles of 32 rows store byte[k*16 + d] = row d | row (d+16) << 4; a last tile of r < 32
    rows stores byte[k*r/2 + j] = row 2j | row (2j+1) << 4. K-major output is what the exact path
    multiplies by (x @ W^T), and it lets the per-group scales broadcast along contiguous rows.
    """
    flat = packed.reshape(-1)
    full = N // _BLOCK_N
    parts = []
    if full:
        b = flat[: full * _BLOCK_N * K // 2].view(full, K, _BLOCK_N // 2)  # [tiles, K, 16]
        parts.append(torch.cat((b & 0xF, b >> 4), dim=2).transpose(0, 1).reshape(K, full * _BLOCK_N))  # [K, N_full]
    rest = N - full * _BLOCK_N
    if rest:
        b = flat[full * _BLOCK_N * K // 2:].view(K, rest // 2)  # [K, r/2]
        parts.append(torch.stack((b & 0xF, b >> 4), dim=2).reshape(K, rest))  # [K, r]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def int4_pack(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
              in_features: int) -> Int4Packed:
    """codes uint8 [N, Kp] (0..15), scales/mins fp16 [N, G] → the form both CPU paths read."""
    N, Kp = codes.shape
    if Kp % group_size:
        raise ValueError(f"K={Kp} is not a whole number of groups of {group_size}")
    Np = -(-N // 16) * 16  # the fused kernel wants N % 16 == 0
    if Np != N:
        codes = F.pad(codes, (0, 0, 0, Np - N), value=8)
        scales = F.pad(scales, (0, 0, 0, Np - N))
        mins = None if mins is None else F.pad(mins, (0, 0, 0, Np - N))
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    fused = torch.equal(_unpack_cpu_t(packed, Np, Kp), codes.to(torch.uint8).t())
    if not fused:
        warnings.warn(f"torch {torch.__version__} packs int4 weights in a layout lowbit does not know (it reads "
                      "torch 2.13's); int4 layers run the exact dequantize + fp32 GEMM path, with a slower decode",
                      RuntimeWarning, stacklevel=2)
        ut = codes.to(torch.uint8).t()  # [Kp, Np]
        packed = (ut[:, 0::2] | (ut[:, 1::2] << 4)).contiguous()  # [Kp, Np/2]
    pairs = (scales.t(),) if mins is None else (scales.t(), mins.t())
    scale_min = torch.stack(pairs, dim=-1).half().contiguous()  # [G, Np, 2] or [G, Np, 1]
    return Int4Packed(packed, scale_min, group_size, N, in_features, fused)


def dequantize_packed_t(w: Int4Packed) -> torch.Tensor:
    """Exact fp32 W^T [Kp, Np] (a tile for one call, never kept), computed in the reference's
    order — d * (u - 8), d * u + m — so it matches quant/int4.py's dequantize bit for bit."""
    if w.fused and w.packed.device.type == "cpu" and (kernels := cpu_native.native()) is not None:
        return kernels.int4_dequant_t(w.packed, w.scale_min, w.group_size)  # the same numbers, in one C pass
    Np, Kp = w.padded_shape
    G, g = Kp // w.group_size, w.group_size
    u = w.codes_t().view(G, g, Np)  # [G, g, Np]: rows of one group are contiguous
    sm = w.scale_min.float()  # [G, Np, 1 or 2]
    d = sm[:, None, :, 0]  # [G, 1, Np]
    if w.symmetric:
        wt = (u.to(torch.int16) - 8) * d
    else:
        wt = (u * d).add_(sm[:, None, :, 1])
    return wt.view(Kp, Np)


def int4_mm(x: torch.Tensor, w: Int4Packed, exact: bool | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype) → y [M, N]: exact fp32 when `exact` (default: M >= EXACT_MIN_ROWS),
    else from the C kernel (fp32) or torch's fused kernel (bf16)."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"int4_mm: x has shape {tuple(x.shape)}, expected [M, {w.in_features}]")
    if x.device.type != "cpu":
        raise NotImplementedError("int4_mm: only the CPU path exists yet")
    Np, Kp = w.padded_shape
    if Kp != w.in_features:
        x = F.pad(x, (0, Kp - w.in_features))
    if not w.fused or (exact if exact is not None else x.shape[0] >= EXACT_MIN_ROWS):
        y = x.float() @ dequantize_packed_t(w)
    elif (kernels := cpu_native.native()) is not None:
        y = kernels.int4_mm(x.float(), w.packed, w.scale_min, w.group_size)
    else:
        y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), w.packed, w.group_size,
                                              w.scale_zeros())
    return y[:, : w.out_features] if Np != w.out_features else y


def int4_dequant_ref(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     group_size: int) -> torch.Tensor:
    """The spec of the int4 layouts: codes uint8 [N, Kp], scales/mins [N, G] → fp32 [N, Kp],
    computed in GGUF's order (d * (u - 8), d * u + m) so Q4_0/Q4_1 relayouts compare bit-exactly."""
    N, Kp = codes.shape
    u = codes.view(N, Kp // group_size, group_size).float()  # [N, G, g]
    d = scales.float().unsqueeze(-1)  # [N, G, 1]
    w = d * (u - 8.0) if mins is None else d * u + mins.float().unsqueeze(-1)
    return w.reshape(N, Kp)


def int4_mm_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                group_size: int) -> torch.Tensor:
    """The matmul's spec in plain fp32 torch: dequantize then multiply."""
    return x.float() @ int4_dequant_ref(codes, scales, mins, group_size)[:, : x.shape[1]].t()
