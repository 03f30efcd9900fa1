"""Weight formats. One module per format; `quantize_weight` picks by spec."""

from __future__ import annotations

import torch

from lowbit.quant import bnb, dense, int4, int8
from lowbit.quant.bnb import BnbWeight
from lowbit.quant.dense import FloatWeight
from lowbit.quant.int4 import Int4Weight
from lowbit.quant.int8 import Int8Weight
from lowbit.quant.spec import WeightSpec, parse_weights

Weight = Int4Weight | Int8Weight | FloatWeight | BnbWeight


def quantize_weight(w: torch.Tensor, spec: WeightSpec) -> Weight:
    """A full-precision [N, K] matrix into the layout `spec` names."""
    if spec.codec:
        return bnb.quantize(w, spec)
    if spec.bits == 4:
        return int4.quantize(w, spec)
    if spec.bits == 8:
        return int8.quantize(w, spec)
    return dense.to_float(w, spec)


__all__ = ["BnbWeight", "FloatWeight", "Int4Weight", "Int8Weight", "Weight", "WeightSpec", "parse_weights", "quantize_weight"]
