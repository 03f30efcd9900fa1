"""Unquantized weight layout (bf16 / f16 / f32), for reference runs and norm-free float tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.quant.spec import WeightSpec


@dataclass
class FloatWeight:
    spec: WeightSpec
    weight: torch.Tensor  # [N, K] in spec.float_dtype

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    def rows(self, index: torch.Tensor) -> "FloatWeight":
        return FloatWeight(self.spec, self.weight[index].contiguous())


def to_float(w: torch.Tensor, spec: WeightSpec) -> FloatWeight:
    return FloatWeight(spec, w.to(getattr(torch, spec.float_dtype)).contiguous())
