"""GGML block formats → lowbit layouts.

Every common GGUF type is held losslessly — the file's codes and scales, so lowbit's dequantization
equals gguf.quants.dequantize bit for bit (tests/test_ggml_relayout.py, tests/test_ggml_kquants.py):

    Q4_0  block 32, 18 bytes: d fp16, qs[16]     w[j] = d * ((qs[j] & 15) - 8), w[j+16] = d * ((qs[j] >> 4) - 8)
    Q4_1  block 32, 20 bytes: d, m fp16, qs[16]  w[j] = d * (qs[j] & 15) + m,   w[j+16] = d * (qs[j] >> 4) + m
    Q8_0  block 32, 34 bytes: d fp16, qs[32] i8  w[j] = d * qs[j]

are lowbit's int4/int8 layouts up to the order of codes in a block and move into them (relayout) and back
(to_blocks, which `lowbit quantize` writes);
Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS and MXFP4 (two-level scales, 5-bit codes,
codebooks, MXFP4's E8M0 power-of-two scale: kernels/ggml_blocks.py) are kept as the file stores them
(quant/ggml_block.py) and multiplied by kernels that read those blocks, or that read them repacked into
lowbit's CPU tiles (quant/ggml_tiles.py). MXFP4 (gpt-oss's experts: 17 bytes per 32 weights, 4.25 bits)
was requantized to int4-g32 (5.0 bits, lossy) before it had kernels of its own. The rarer types gguf can
decode (IQ1-IQ3, TQ1_0/TQ2_0, NVFP4) are requantized to int4-g32 with a note naming them; anything else
is refused.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from lowbit.quant import Weight, quantize_weight
from lowbit.kernels.ggml_blocks import BLOCKS
from lowbit.quant.dense import FloatWeight
from lowbit.quant.ggml_block import FileBlocks, block_spec, from_file
from lowbit.quant.int4 import Int4Weight, pack_nibbles
from lowbit.quant.int8 import Int8Weight
from lowbit.quant.spec import WeightSpec, parse_weights

RELAYOUT = MappingProxyType({T.Q4_0: parse_weights("int4-sym-g32"), T.Q4_1: parse_weights("int4-g32"),
                             T.Q8_0: parse_weights("int8-g32")})
RELAID = MappingProxyType({int(t): t for t in RELAYOUT})  # the same by GGML type number
# held as the file stores them (BLOCKS also has Q4_0/Q4_1/Q8_0, for fused rows: quant/ggml_block.py as_blocks)
KEPT = MappingProxyType({T(q): block_spec(q) for q in BLOCKS if T(q) not in RELAYOUT})
LOSSLESS = MappingProxyType({**RELAYOUT, **KEPT})
# Rare low-bit types gguf.quants decodes (all under 4.5 bits per weight): int4-g32 keeps what they have.
REQUANTIZED = MappingProxyType({getattr(T, n): parse_weights("int4-g32") for n in (
    "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "NVFP4")
    if hasattr(T, n)})
FLOATS = MappingProxyType({T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16})
SUPPORTED = (*LOSSLESS, *REQUANTIZED, *FLOATS)


class UnsupportedType(ValueError):
    pass


def native_spec(qtype: T) -> WeightSpec | None:
    """The layout `auto` gives a tensor of this type (None: keep it as a float tensor)."""
    if qtype in LOSSLESS:
        return LOSSLESS[qtype]
    if qtype in REQUANTIZED:
        return REQUANTIZED[qtype]
    if qtype in FLOATS:
        return None
    raise UnsupportedType(f"tensor type {qtype.name} is not supported (supported: {', '.join(t.name for t in SUPPORTED)})")


def to_float_tensor(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    """Any supported type → fp32 tensor of `shape` (torch order, outermost first). `raw` may be the
    tensor's bytes (uint8) or an already typed array."""
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if qtype in FLOATS:
        words = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.int16}[qtype]
        t = torch.from_numpy(b.view(words).copy())  # copy: the file is mapped read-only
        if qtype == T.BF16:  # numpy has no bf16: reinterpret the 16-bit words
            t = t.view(torch.bfloat16)
        return t.float().reshape(shape)
    native_spec(qtype)  # raises for unsupported types
    return torch.from_numpy(quants.dequantize(b, qtype).astype(np.float32, copy=False)).reshape(shape)


def float_words(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    """An F32 / F16 / BF16 tensor's bytes → a tensor of `shape` in that dtype, over `raw`'s own memory when it
    is writeable (the loader's read buffer: nothing copied), else a copy (a view of the read-only file map).
    Not through fp32: each matrix was copied twice more on the way (its words, then fp32: 1.2 GB in transit for
    a BF16 8B's 403 MB head), and that load's peak RSS was 1.14x its tensor bytes before the forward pass began
    (tests/bench/reference_rss.py)."""
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if not b.flags.writeable:
        b = b.copy()
    t = torch.from_numpy(b.view({T.F32: np.float32, T.F16: np.float16, T.BF16: np.int16}[qtype]))
    return (t.view(torch.bfloat16) if qtype == T.BF16 else t).reshape(shape)  # numpy has no bf16: its 16-bit words


def relayout(raw: np.ndarray, qtype: T, N: int, K: int) -> Weight:
    """Q4_0 / Q4_1 / Q8_0 bytes of an [N, K] matrix → the lowbit layout with identical values.
    (numpy for the byte shuffling: a few ms for the largest matrix of the default model.)"""
    spec = RELAYOUT[qtype]
    nb = BLOCKS[int(qtype)][2]  # bytes per block
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(N, K // 32, nb)  # [N, G, nb]
    # np.array(copy=True): every array kept must own its bytes, never alias the read-only file map
    d = torch.from_numpy(np.array(b[..., 0:2], copy=True).view(np.float16)[..., 0])  # [N, G] fp16
    if qtype == T.Q8_0:
        q = np.array(b[..., 2:], copy=True).view(np.int8).reshape(N, K)
        return Int8Weight(spec, K, torch.from_numpy(q), d)
    qs = b[..., nb - 16:]  # [N, G, 16]: element j in the low nibble, element j + 16 in the high one
    codes = np.concatenate((qs & 0xF, qs >> 4), axis=-1).reshape(N, K)  # [N, K] in element order
    mins = torch.from_numpy(np.array(b[..., 2:4], copy=True).view(np.float16)[..., 0]) if qtype == T.Q4_1 else None
    return Int4Weight(spec, K, pack_nibbles(torch.from_numpy(codes)), d, mins)


# relayout's inverse: the lowbit layouts GGUF has a block type for (`lowbit quantize` writes them)
WRITES = MappingProxyType({spec: qtype for qtype, spec in RELAYOUT.items()})


def to_blocks(w: Int4Weight | Int8Weight) -> np.ndarray:
    """An int4-sym-g32 / int4-g32 / int8-g32 weight [N, K], K whole blocks of 32 → its Q4_0 / Q4_1 / Q8_0 bytes,
    uint8 [N, K / 32 * block bytes], which `relayout` (and gguf.quants.dequantize) read back to the same values
    bit for bit: the layouts keep fp16 scales and mins, as the blocks do, so nothing is rounded here."""
    qtype = WRITES[w.spec]
    N, K = w.shape
    if K % 32:
        raise ValueError(f"a {w.spec.name} matrix with rows of {K} is not whole {qtype.name} blocks of 32")
    G = K // 32
    scales = [w.scales, *([w.mins] if qtype == T.Q4_1 else [])]
    if any(s.dtype != torch.float16 for s in scales):
        raise ValueError(f"{qtype.name} blocks hold fp16 scales; this {w.spec.name} weight has {scales[0].dtype}")
    parts = [s.numpy().view(np.uint8).reshape(N, G, 2) for s in scales]  # [N, G, 2] each: d (then m) of a block
    if qtype == T.Q8_0:
        parts.append(w.qweight.numpy().view(np.uint8).reshape(N, G, 32))  # [N, G, 32] int8 codes
    else:
        u = w.codes().numpy()[:, :K].reshape(N, G, 2, 16)  # [N, G, (elements 0-15, 16-31), 16]
        parts.append(u[:, :, 0] | (u[:, :, 1] << 4))  # element j in the low nibble, j + 16 in the high one
    return np.concatenate(parts, axis=-1).reshape(N, -1)


class FileRelaid:
    """A Q4_0 / Q4_1 / Q8_0 weight (an Int4Weight or Int8Weight, `relayout`'s) whose rows are still in
    their file (`source`: the loader's, with `N`, `path`, `offset`, `perm` and `read()`, as
    quant/ggml_block.py FileBlocks'). The CPU's tiles are packed straight from the file by C
    (quant/linear.py); anything that asks for the codes or scales reads and relays them once."""

    def __init__(self, spec: WeightSpec, in_features: int, qtype: int, source):
        self.spec, self.in_features, self.qtype, self.source, self._w = spec, in_features, qtype, source, None

    def _relaid(self) -> Weight:
        if self._w is None:
            self._w = relayout(self.source.read().numpy(), T(self.qtype), self.source.N, self.in_features)
        return self._w

    qweight = property(lambda self: self._relaid().qweight)
    scales = property(lambda self: self._relaid().scales)
    shape = property(lambda self: (self.source.N, self.in_features))

    @property
    def unread(self) -> bool:
        """Whether nothing has read the rows into memory yet (so packing them should read the file)."""
        return self._w is None

    def rows(self, index: torch.Tensor):
        return type(self)(self.spec, self.in_features, self.qtype, self.source.with_rows(index))


class FileInt4(FileRelaid, Int4Weight):
    mins = property(lambda self: None if self.qtype == T.Q4_0 else self._relaid().mins)


class FileInt8(FileRelaid, Int8Weight):
    pass


def from_file_lazily(qtype: T, N: int, K: int, source) -> Weight:
    """`auto`'s weight for a tensor whose rows stay in the file until something packs or reads them: the
    file's blocks (FileBlocks) or, for Q4_0 / Q4_1 / Q8_0, their int4 / int8 layout (FileInt4, FileInt8)."""
    if qtype in KEPT:
        return FileBlocks(KEPT[qtype], K, source)
    if qtype in RELAYOUT and K % 32 == 0:
        return (FileInt8 if qtype == T.Q8_0 else FileInt4)(RELAYOUT[qtype], K, int(qtype), source)
    raise ValueError(f"tensor type {qtype.name} has no lossless layout kept in the file")


def load_matrix(raw: np.ndarray, qtype: T, N: int, K: int, target: WeightSpec | None) -> Weight:
    """One GGUF matrix into a lowbit layout. target None = `auto` (lossless where possible)."""
    want = native_spec(qtype) if target is None else target
    if want is None:  # float tensor under auto: keep its own precision
        return FloatWeight(WeightSpec(bits=16 if qtype != T.F32 else 32, float_dtype=str(FLOATS[qtype]).split(".")[1]),
                           float_words(raw, qtype, (N, K)))
    if qtype in KEPT and KEPT[qtype] == want:
        return from_file(raw, int(qtype), N, K)
    if qtype in RELAYOUT and RELAYOUT[qtype] == want and K % 32 == 0:
        return relayout(raw, qtype, N, K)
    return quantize_weight(to_float_tensor(raw, qtype, (N, K)), want)
