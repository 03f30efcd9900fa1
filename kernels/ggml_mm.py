"""GGML-block weight matmul on CPU: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, W in a GGML block type
(Q5_0, Q5_1, IQ4_NL, Q2_K … Q6_K, IQ4_XS, MXFP4) exactly as GGUF stores it (kernels/ggml_blocks.py).

Two paths, chosen per call as for int4/int8 (kernels/int4_mm.py):

- fast (M < EXACT_MIN_ROWS by default): lowbit's C kernel (kernels/cpu_ggml.c), kind 3 of the C
  kernels' lowbit_linear, so the fused decode blocks (kernels/cpu_block.c) take these weights too:
  activations rounded per block of 32 to 16-bit codes (kernels/act_quant.py), each weight block
  decoded to integer codes, exact integer dot products per sub-block of 16, an fp32 epilogue in a
  fixed order; a row's result does not depend on M.
- exact: the rows dequantized in fp32 (C, or kernels/ggml_blocks.py's torch spec without the C
  kernels) in ranges of ~4M weights that live for this call only, then torch's fp32 GEMM
  (kernels/exact_mm.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowbit.kernels import cpu_native
from lowbit.kernels.exact_mm import exact_linear, in_tiles, takes_exact
from lowbit.kernels.ggml_blocks import BLOCKS, check_rows, ggml_dequant_ref


@dataclass
class GgmlPacked:
    data: torch.Tensor  # uint8 [split, row bytes]: rows of type qtype
    qtype: int
    in_features: int  # K
    data2: torch.Tensor | None = None  # uint8 [N - split, row bytes]: rows of type qtype2
    qtype2: int = 0
    native: object = field(default=None, repr=False, compare=False)  # the C kernels, or None: the exact path
    desc: object = field(default=None, repr=False, compare=False)  # their descriptor, built once

    @property
    def split(self) -> int:
        return self.data.shape[0]

    @property
    def out_features(self) -> int:
        return self.split + (0 if self.data2 is None else self.data2.shape[0])

    def c_desc(self) -> "cpu_native._Linear":
        if self.desc is None:
            two = self.data2 is not None
            self.desc = cpu_native._Linear(3, self.out_features, self.in_features, BLOCKS[self.qtype][1], self.qtype,
                                           self.data.data_ptr(), None, self.split, self.qtype2 if two else self.qtype,
                                           self.data2.data_ptr() if two else None)
        return self.desc

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """fp32 [stop - start, K] of rows start..stop-1, bit for bit kernels/ggml_blocks.py."""
        if self.native is not None:
            return self.native.ggml_dequant(self.c_desc(), start, stop)
        parts, s = [], self.split
        if start < s:
            parts.append(ggml_dequant_ref(self.data[start:min(stop, s)], self.qtype, self.in_features))
        if stop > s:
            parts.append(ggml_dequant_ref(self.data2[max(start, s) - s:stop - s], self.qtype2, self.in_features))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [n, K] of rows ids (the embedding lookup): the table's single type, decoded by the spec."""
        return ggml_dequant_ref(self.data[ids.to(torch.int64)], self.qtype, self.in_features)


def ggml_pack(data: torch.Tensor, qtype: int, in_features: int, data2: torch.Tensor | None = None,
              qtype2: int = 0, *, native) -> GgmlPacked:
    """The file's blocks as they are (no repacking), multiplied by `native` or, when None, the exact path."""
    check_rows(data, qtype, in_features)
    check_rows(data2, qtype2, in_features)
    return GgmlPacked(data.contiguous(), qtype, in_features, None if data2 is None else data2.contiguous(),
                      qtype2, native)


def ggml_mm(x: torch.Tensor, w: GgmlPacked, exact: bool | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype) → y fp32 [M, N]: exact when `exact` (default: from EXACT_MIN_ROWS
    rows) or when w has no C kernels, else the C kernel."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"ggml_mm: input {tuple(x.shape)} for K={w.in_features}")
    x = x.float()
    if w.native is None or takes_exact(exact) or x.shape[0] == 0:
        return in_tiles(w.out_features, w.in_features, lambda a, b: exact_linear(x, w.dequantize_rows(a, b)))
    return w.native.linear_mm(x, w.c_desc())
