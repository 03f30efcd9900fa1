"""GGML block formats held as GGUF stores them: Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4.

Storage: each row's blocks exactly as in the file (kernels/ggml_blocks.py says what a block holds),

    data   uint8 [N, K / QK * bytes]     one type for every row, or
    data2  uint8 [N2, …] of type qtype2  rows after data's (a fused QKV whose V rows have another type)

so the bytes held are the file's own, and `dequantize` is gguf.quants.dequantize's arithmetic bit for
bit. The kernels read these bytes directly (kernels/ggml_mm.py); nothing is repacked, so loading one
costs a copy. There is no `quantize`: lowbit does not make these files, llama.cpp's quantizer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lowbit.kernels.ggml_blocks import BLOCKS, ggml_dequant_ref, row_bytes
from lowbit.quant.spec import WeightSpec

# nominal bits of each type's codes (WeightSpec.bits), for the layout's name and the memory report
CODE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "IQ4_NL": 4, "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "IQ4_XS": 4,
             "MXFP4": 4}
TYPE_OF = {name: qtype for qtype, (name, _, _) in BLOCKS.items()}


def block_spec(qtype: int) -> WeightSpec:
    name, qk, _ = BLOCKS[qtype]
    return WeightSpec(bits=CODE_BITS[name], group_size=qk, codec=name)


@dataclass
class GgmlWeight:
    spec: WeightSpec  # the first rows' type (block_spec)
    in_features: int  # K
    data: torch.Tensor  # uint8 [N1, row_bytes]: the file's blocks
    data2: torch.Tensor | None = None  # uint8 [N2, row_bytes2] of spec2's type, or None
    spec2: WeightSpec | None = None

    @property
    def qtype(self) -> int:
        return TYPE_OF[self.spec.codec]

    @property
    def qtype2(self) -> int:
        return TYPE_OF[self.spec2.codec] if self.spec2 is not None else self.qtype

    @property
    def split(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.split + (0 if self.data2 is None else self.data2.shape[0]), self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in (self.data, self.data2) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], bit for bit gguf.quants.dequantize."""
        parts = [ggml_dequant_ref(self.data, self.qtype, self.in_features)]
        if self.data2 is not None:
            parts.append(ggml_dequant_ref(self.data2, self.qtype2, self.in_features))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def rows(self, index: torch.Tensor) -> "GgmlWeight":
        """The same type restricted to some output rows (GGUF Q/K un-permutation, embedding lookups).
        Only a single-type weight has rows taken from it."""
        assert self.data2 is None, "rows of a two-type weight"
        return GgmlWeight(self.spec, self.in_features, self.data[index].contiguous())


class FileBlocks(GgmlWeight):
    """A GGML-block weight whose rows are still in their file (`source`: the loader's, with `path`,
    `offset` of the tensor's data, `perm` int64 [N] or None — output row n is the file's row perm[n] —
    and `read()` → uint8 [N, row bytes]). The CPU's tiles are packed straight from the file by C
    (quant/linear.py), so an 8B load holds its tiles and no copy of the file; anything else that asks
    for `data` reads it once into memory of its own."""

    def __init__(self, spec: WeightSpec, in_features: int, source):
        self.spec, self.in_features, self.source = spec, in_features, source
        self.data2, self.spec2, self._data = None, None, None

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            self._data = self.source.read()
        return self._data

    @property
    def unread(self) -> bool:
        """Whether nothing has read the rows into memory yet (so packing them should read the file)."""
        return self._data is None

    @property
    def split(self) -> int:
        return self.source.N

    def rows(self, index: torch.Tensor) -> "FileBlocks":
        return FileBlocks(self.spec, self.in_features, self.source.with_rows(index))


def from_file(raw: np.ndarray, qtype: int, N: int, K: int) -> GgmlWeight:
    """The tensor's bytes as they are in the file ([N, row_bytes]) → GgmlWeight. What is kept must own its
    bytes, never alias the read-only file map: a read-only array (a memmap) is copied, one read into
    memory of its own (runtime/load/gguf_file.py GGUFFile.read) is taken as it is."""
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(N, row_bytes(qtype, K))
    if not b.flags.writeable:
        b = b.copy()
    return GgmlWeight(block_spec(qtype), K, torch.from_numpy(b))


def as_blocks(w) -> GgmlWeight | None:
    """An int4-g32 / int4-sym-g32 / int8-g32 weight (what Q4_1 / Q4_0 / Q8_0 load into) as those GGML
    blocks, the same values (None for any other layout): so it can share a call with rows of a
    type only kept as blocks."""
    from lowbit.quant.int4 import Int4Weight
    from lowbit.quant.int8 import Int8Weight

    if isinstance(w, GgmlWeight):
        return w
    spec = w.spec
    if spec.group_size != 32 or spec.codec or w.in_features % 32 or w.scales.dtype != torch.float16:
        return None
    N, G = w.scales.shape
    d = w.scales.contiguous().view(torch.uint8).view(N, G, 2)  # [N, G, 2]: fp16 bytes
    if isinstance(w, Int8Weight):
        blocks = torch.cat([d, w.qweight.view(torch.uint8).view(N, G, 32)], dim=-1)  # Q8_0: d, qs[32]
        return GgmlWeight(block_spec(8), w.in_features, blocks.reshape(N, -1).contiguous())
    if not isinstance(w, Int4Weight):
        return None
    u = w.codes().view(N, G, 32)
    qs = u[..., :16] | (u[..., 16:] << 4)  # [N, G, 16]: element j low, j + 16 high
    parts = [d] if w.mins is None else [d, w.mins.contiguous().view(torch.uint8).view(N, G, 2)]
    blocks = torch.cat([*parts, qs], dim=-1)  # Q4_0: d, qs; Q4_1: d, m, qs
    return GgmlWeight(block_spec(2 if w.mins is None else 3), w.in_features, blocks.reshape(N, -1).contiguous())


def concat_rows(weights: list) -> GgmlWeight | None:
    """Weights stacked along N (QKV, gate+up) as one GGML-block weight: at most two runs of one type
    each, every part a GGML-block weight or one as_blocks turns into one; else None."""
    blocks = [as_blocks(w) for w in weights]
    if any(b is None or b.data2 is not None or b.in_features != weights[0].in_features for b in blocks):
        return None
    runs: list[list[GgmlWeight]] = []
    for b in blocks:
        if runs and runs[-1][0].spec == b.spec:
            runs[-1].append(b)
        else:
            runs.append([b])
    if len(runs) > 2:
        return None
    data = [torch.cat([b.data for b in run]) for run in runs]
    return GgmlWeight(runs[0][0].spec, weights[0].in_features, data[0], *(
        (data[1], runs[1][0].spec) if len(runs) == 2 else ()))

