"""A full-precision matrix into the layout its spec names, and the union of the layouts."""

from __future__ import annotations

import torch

from lowbit.quant import bnb, dense, int4, int8
from lowbit.quant.bnb import BnbWeight
from lowbit.quant.dense import FloatWeight
from lowbit.quant.int4 import Int4Weight
from lowbit.quant.int8 import Int8Weight
from lowbit.quant.spec import WeightSpec

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
