"""Weight layout specs: what `--weights int4-g32` means, written down once.

A spec is explicit data, never guessed from a file name. Names:

    int4-g32 / int4-g64 / int4-g128     4-bit, asymmetric (scale and min per group), like GGUF Q4_1
    int4-sym-g32 / -g64 / -g128         4-bit, symmetric (w = scale * (u - 8)), like GGUF Q4_0
    int8                                8-bit symmetric, one scale per output channel
    int8-g32 / -g64 / -g128             8-bit symmetric, one scale per group, like GGUF Q8_0
    bnb-nf4 / bnb-int8                  bitsandbytes' NF4 and LLM.int8(), run by bitsandbytes on CPU
                                        (the comparison rows of `lowbit eval`, see quant/bnb.py)
    bf16 / f16 / f32                    unquantized (reference runs)
    Q4_K, Q6_K, Q5_0, IQ4_XS, …          GGML block types, held as the GGUF stores them (quant/ggml_block.py);
                                        only `auto` gives them, to the tensors a file has in them
    auto                                GGUF: keep every tensor in the layout that holds it losslessly,
                                        requantize the rest (see quant/ggml.py); safetensors: int4-g32
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

FLOAT_NAMES = MappingProxyType({"bf16": "bfloat16", "f16": "float16", "f32": "float32"})
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class WeightSpec:
    """One weight layout. bits 16/32 means unquantized, kept in `float_dtype`."""

    bits: int  # 4, 8, or 16/32 for float
    group_size: int = 0  # quantized values sharing one scale along K; 0 = whole row (per channel)
    symmetric: bool = True
    float_dtype: str = ""  # torch dtype name for unquantized layouts
    # "" = lowbit's own integer codes; "nf4" / "llm.int8" = bitsandbytes' (quant/bnb.py); a GGML block
    # type's name ("Q4_K", …) = that format as GGUF stores it (quant/ggml_block.py)
    codec: str = ""

    @property
    def quantized(self) -> bool:
        return self.bits in (4, 8)

    @property
    def name(self) -> str:
        if self.codec:
            return {"nf4": "bnb-nf4", "llm.int8": "bnb-int8"}.get(self.codec, self.codec)
        if not self.quantized:
            return {v: k for k, v in FLOAT_NAMES.items()}[self.float_dtype]
        if self.bits == 8:
            return "int8" if self.group_size == 0 else f"int8-g{self.group_size}"
        return f"int4-{'sym-' if self.symmetric else ''}g{self.group_size}"

    def __str__(self) -> str:
        return self.name


WEIGHT_NAMES = (
    [f"int4-g{g}" for g in GROUP_SIZES]
    + [f"int4-sym-g{g}" for g in GROUP_SIZES]
    + ["int8"]
    + [f"int8-g{g}" for g in GROUP_SIZES]
    + list(FLOAT_NAMES)
    + ["bnb-nf4", "bnb-int8"]
)
BNB = MappingProxyType({"bnb-nf4": WeightSpec(bits=4, group_size=64, codec="nf4"),
                        "bnb-int8": WeightSpec(bits=8, group_size=0, codec="llm.int8")})


def parse_weights(name: str) -> WeightSpec:
    """`int4-g32` → WeightSpec(4, 32, symmetric=False). Raises ValueError listing valid names."""
    s = name.strip().lower()
    if s in BNB:
        return BNB[s]
    if s in FLOAT_NAMES:
        return WeightSpec(bits=16 if s != "f32" else 32, float_dtype=FLOAT_NAMES[s])
    m = re.fullmatch(r"int4-(sym-)?g(\d+)", s)
    if m and int(m.group(2)) in GROUP_SIZES:
        return WeightSpec(bits=4, group_size=int(m.group(2)), symmetric=bool(m.group(1)))
    if s == "int8":
        return WeightSpec(bits=8, group_size=0, symmetric=True)
    m = re.fullmatch(r"int8-g(\d+)", s)
    if m and int(m.group(1)) in GROUP_SIZES:
        return WeightSpec(bits=8, group_size=int(m.group(1)), symmetric=True)
    raise ValueError(f"unknown weight format {name!r}; choose one of: auto, {', '.join(WEIGHT_NAMES)}")
