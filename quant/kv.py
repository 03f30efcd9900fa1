"""KV cache formats: how many bits keys and values get, and at what granularity.

    name   K                           V                           bytes/token/head (D = 64)  vs f16
    f32    fp32                        fp32                        512                        2
    f16    fp16                        fp16                        256                        1
    k8v8   int8, one scale per 64      int8, one scale per 64      132                        0.52
    k8v4   int8, one scale per 64      int4 asym, scale+min per 32 106                        0.41
    k4v4   int4 asym, per 32           int4 asym, per 32           80                         0.31

Why this granularity. Measured on the default model (docs/quality.md), WikiText-2 test, 512 tokens in
chunks of 16, every token attending over the quantized cache; mean KL against the f16 cache over
all 512 tokens. The alternatives were measured by a one-off simulation (K/V quantized and
dequantized just before attention in the exact forward pass; the script was not kept), which gave
0.0125 for llama.cpp's q8_0-K/q4_0-V — close to the 0.0106 llama.cpp itself measures:
- Per token, not per channel: a token is quantized when it is written, so pages never need
  re-quantizing and prefill chunks and decode steps write the same way. KIVI quantizes keys per
  channel because keys carry fixed outlier channels; here a randomized Hadamard rotation of each
  head's vector (kernels/kv_quant.py) spreads those outliers instead, and attention is unchanged.
  K8/V4 per token without rotation: 0.0064-0.0073; Hadamard on both: 0.0053; with random signs
  first: 0.0047.
- Values get the scale and the min (asymmetric, min-max): symmetric 4-bit V measured 0.0079 against
  0.0058 asymmetric with the same rotation; NF4 levels 0.0063; MSE-searched clipping no better.
- Groups: 64 (a whole head) for 8-bit keys costs 0.25 bits per value and was as good as 32;
  4-bit values need 32 (0.0078 at 64). Values are the limit: with f16 keys, V4 alone gave 0.0056.
The acceptance figure, scored like llama-perplexity (second half of the window), is in
tests/test_kv_quality.py: k8v4 0.00477 — inside its 0.005 bar by 5%, a thin margin.

f32 is the exact reference cache, which saves no memory: K and V stored as the fp32 values the
model computed, so attention over the paged pool reads exactly what was written — the numbers of an
fp32 contiguous cache. Verified greedy (the exact model's greedy reply) runs in the paged engine on
it. It costs twice f16's bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal


@dataclass(frozen=True)
class KVFormat:
    name: str
    k_bits: int  # 32 | 16 | 8 | 4 (32 and 16: floats, fp32 / fp16, no scales)
    v_bits: int
    k_group: int  # values per scale (capped at head_dim)
    v_group: int
    rotate: bool  # Hadamard-rotate each head's vector before quantizing (power-of-2 head_dim only)

    def side_bits(self, side: Literal["k", "v"]) -> int:
        """The bits of the keys ("k") or the values ("v")."""
        if side not in ("k", "v"):
            raise ValueError(f"a KV side is 'k' or 'v', got {side!r}")
        return self.k_bits if side == "k" else self.v_bits

    def side_group(self, side: Literal["k", "v"], head_dim: int) -> int:
        """Values per scale of the keys ("k") or the values ("v") at this head dim: the format's group
        capped at head_dim (a group lies within one head's vector); head_dim for a float side (16 or
        32 bits), which has no scales."""
        group = self.k_group if side == "k" else self.v_group
        return min(group, head_dim) if self.side_bits(side) < 16 else head_dim

    def rotates(self, head_dim: int) -> bool:
        return self.rotate and head_dim & (head_dim - 1) == 0

    def side_bytes(self, side: Literal["k", "v"], head_dim: int) -> int:
        """Bytes one head's vector of one token takes on one side: codes plus fp16 scales (and mins);
        for a float side, its D values (2 or 4 bytes each)."""
        bits = self.side_bits(side)
        if bits >= 16:
            return bits // 8 * head_dim
        n_groups = head_dim // self.side_group(side, head_dim)
        return head_dim * bits // 8 + 2 * n_groups * (2 if bits == 4 else 1)

    def bytes_per_token(self, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
        per_head = self.side_bytes("k", head_dim) + self.side_bytes("v", head_dim)
        return n_layers * n_kv_heads * per_head


KV_FORMATS = MappingProxyType({
    "f32": KVFormat("f32", 32, 32, 0, 0, False),
    "f16": KVFormat("f16", 16, 16, 0, 0, False),
    "k8v8": KVFormat("k8v8", 8, 8, 64, 64, True),
    "k8v4": KVFormat("k8v4", 8, 4, 64, 32, True),
    "k4v4": KVFormat("k4v4", 4, 4, 32, 32, True),
})
DEFAULT_KV_FORMAT = "k8v4"


# A quantized side's group is the one its bits have in every named format above (8 bits: a whole 64-head,
# 4 bits: 32 — the measurements in this module's docstring), so a layer of a per-layer recipe at "k8v4"
# is byte for byte a k8v4 layer.
SIDE_GROUP = MappingProxyType({8: 64, 4: 32})


def side_format(k_bits: int, v_bits: int) -> KVFormat:
    """One layer's format from its two sides' bits (16, 8 or 4 each): `lowbit fit` chooses them per layer.
    Named "k{K}v{V}" ("f16" for 16/16): k8v8, k8v4 and k4v4 are the named formats themselves."""
    for bits in (k_bits, v_bits):
        if bits not in (16, *SIDE_GROUP):
            raise ValueError(f"a KV side has 16, 8 or 4 bits, got {bits}")
    if k_bits == v_bits == 16:
        return KV_FORMATS["f16"]
    return KVFormat(f"k{k_bits}v{v_bits}", k_bits, v_bits, SIDE_GROUP.get(k_bits, 0), SIDE_GROUP.get(v_bits, 0), True)


def parse_kv_format(name: str) -> KVFormat:
    """A named format (KV_FORMATS), or one layer's "k{K}v{V}" with K, V in 16, 8, 4 (side_format)."""
    if name in KV_FORMATS:
        return KV_FORMATS[name]
    m = re.fullmatch(r"k(16|8|4)v(16|8|4)", name)
    if m is None:
        raise ValueError(f"unknown KV cache format {name!r}; expected one of {', '.join(KV_FORMATS)}")
    return side_format(int(m.group(1)), int(m.group(2)))
