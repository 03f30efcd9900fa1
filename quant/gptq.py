"""Pre-quantized 4-bit GPTQ and AWQ checkpoints: their packing, read exactly, relayed into lowbit's layouts.

Per linear W [N, K] (N outputs, K inputs) in groups of g input columns, G = K / g groups:

  GPTQ (AutoGPTQ, GPTQModel; quantization_config.quant_method "gptq")
    qweight  int32 [K/8, N]  code q[k, n] is bits 4(k % 8) .. 4(k % 8) + 3 of qweight[k // 8, n]
    qzeros   int32 [G, N/8]  zero of (group, n) is bits 4(n % 8) .. of qzeros[group, n // 8]. Checkpoint
                             format "gptq" (v1, AutoGPTQ's) stores z - 1, "gptq_v2" stores z
    scales   fp16  [G, N]
    g_idx    int32 [K]       group of input column k: k // g, or any order under desc_act (act-order)
    w[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])

  AWQ (AutoAWQ GEMM; quant_method "awq", version "gemm", zero_point true)
    qweight  int32 [K, N/8]  packed along N: nibble i of qweight[k, c] holds column 8c + AWQ_ORDER[i]
    qzeros   int32 [G, N/8]  the same packing, z itself
    scales   fp16  [G, N]
    w[n, k] = scales[k // g, n] * (q[k, n] - z[k // g, n])

Into lowbit, every value exact (`to_lowbit`; tests/test_gptq_awq.py checks it bit for bit):

  z == 8 in every group (GPTQ sym=True)   int4-sym-g: w = d (u - 8) with the file's own scales and codes, 0.5 B
                                          a weight + 2 B a group, no zeros: at most the file's bytes.
  any other zeros (sym=False, AWQ)        int8-g: codes u - z in -15..15 with the file's scales. int4
                                          asymmetric (w = d u + m) would need m = -s z in fp16, and s z
                                          has up to 15 significant bits against fp16's 11: not exact.
                                          The price is 8 bits a code: 1.84x the file's quantized bytes
                                          at g32, 1.96x at g128 (1 B + 2 B a group, against 0.5 B + 2.5 B).
  act-order (g_idx not k // g)            the columns sorted by group (stable argsort of g_idx; every group
                                          must then be exactly g wide), held in that order, and the same
                                          permutation applied to the layer's input at run time
                                          (PermutedWeight, quant/linear.py QuantLinear).
  group_size -1 (one group a row), or a   held in groups of the largest of 128/64/32 that divides g, each
  multiple of 32                          with its file group's scale (exact; -1 costs 2 B per 128 weights).

Unquantized tensors of such checkpoints (embeddings, LM head, norms, biases) load as in any HF checkpoint
(runtime/load/safetensors.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lowbit.quant.int4 import Int4Weight, pack_nibbles
from lowbit.quant.int8 import Int8Weight
from lowbit.quant.spec import WeightSpec

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order; unpacking by it is its AWQ_REVERSE_ORDER
LOWBIT_GROUPS = (128, 64, 32)  # lowbit's int4/int8 group sizes, largest first
GPTQ_FORMATS = ("gptq", "gptq_v2")  # GPTQModel's checkpoint formats with this packing (marlin/bitblas differ)
INT = (torch.int32,)
INDEX = (torch.int32, torch.int64)
FLOAT = (torch.float16, torch.bfloat16, torch.float32)  # scales: kept only when exact in fp16


@dataclass
class Unpacked:
    """One matrix's codes, zeros and scales in lowbit's orientation (row n = output feature n)."""

    codes: torch.Tensor  # uint8 [N, K], 0..15
    zeros: torch.Tensor  # uint8 [N, G], 0..15
    scales: torch.Tensor  # fp16 [N, G]
    g_idx: torch.Tensor  # int64 [K]: the group of each input column
    group_size: int  # input columns per group (K when the file has one group a row)


@dataclass(frozen=True)
class GPTQSpec:
    group_size: int  # input columns per group; -1 = one group a row
    desc_act: bool  # act-order: g_idx in any order (otherwise it may be absent, meaning k // g)
    sym: bool  # as the file says; the layout follows the zeros actually stored (module docstring)
    v1: bool  # checkpoint format "gptq": qzeros holds z - 1
    keep_float: tuple[str, ...] = ()  # modules_to_not_convert: stored as plain `.weight`
    bits: int = 4
    method: str = "gptq"

    def tensors(self, N: int, K: int) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
        """The tensors of one linear W [N, K]: suffix → (shape, allowed dtypes)."""
        G = _groups(self.group_size, N, K)
        return {"qweight": ((K // 8, N), INT), "qzeros": ((G, N // 8), INT), "scales": ((G, N), FLOAT),
                "g_idx": ((K,), INDEX)}

    @property
    def optional(self) -> tuple[str, ...]:
        return () if self.desc_act else ("g_idx",)

    def unpack(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor | None = None) -> Unpacked:
        K = qweight.shape[0] * 8
        g = K if self.group_size == -1 else self.group_size
        codes = _nibbles(qweight, axis=0)  # [K, N]
        stored = _nibbles(qzeros, axis=1)  # [G, N]
        if self.v1:
            # AutoGPTQ packed z - 1 as uint32, so z = 0 went in as 0xF...F and spilled into the nibbles
            # above it; readers disagree on such a nibble (AutoGPTQ 0.7.1's own torch paths: 16 in
            # qlinear_cuda, 0 in qlinear_cuda_old): there is no exact value to load.
            if (stored == 15).any():
                raise ValueError("qzeros holds a 15 in the v1 'gptq' format (a zero point of 0 stored as -1, "
                                 "which corrupts its word); re-save it as gptq_v2")
            stored = stored + 1
        if g_idx is None:
            g_idx = torch.arange(K) // g
        g_idx = g_idx.long()
        G = K // g
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= G):
            raise ValueError(f"g_idx holds groups {int(g_idx.min())}..{int(g_idx.max())}, outside 0..{G - 1}")
        return Unpacked(_t(codes), _t(stored), _fp16(scales), g_idx, g)


@dataclass(frozen=True)
class AWQSpec:
    group_size: int  # input columns per group; -1 = one group a row
    keep_float: tuple[str, ...] = ()  # modules_to_not_convert: stored as plain `.weight`
    bits: int = 4
    method: str = "awq"

    def tensors(self, N: int, K: int) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
        G = _groups(self.group_size, N, K)
        return {"qweight": ((K, N // 8), INT), "qzeros": ((G, N // 8), INT), "scales": ((G, N), FLOAT)}

    optional = ()

    def unpack(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> Unpacked:
        K = qweight.shape[0]
        g = K if self.group_size == -1 else self.group_size
        codes = _nibbles(qweight, axis=1, order=AWQ_ORDER)  # [K, N]
        zeros = _nibbles(qzeros, axis=1, order=AWQ_ORDER)  # [G, N]
        return Unpacked(_t(codes), _t(zeros), _fp16(scales), torch.arange(K) // g, g)


PackedSpec = GPTQSpec | AWQSpec


def parse_quantization_config(qc: dict) -> PackedSpec:
    """config.json's quantization_config → its spec. ValueError, one line, for anything not read exactly."""
    method = str(qc.get("quant_method", qc.get("method", "?"))).lower()
    if method == "mxfp4":  # gpt-oss as OpenAI ships it: llama.cpp's converter keeps these bytes in its GGUF
        raise ValueError("MXFP4 safetensors (gpt-oss as published) are not read here; use its GGUF, which holds "
                         "the same MXFP4 experts (lowbit keeps them as they are)")
    if method not in ("gptq", "awq"):
        raise ValueError(f"pre-quantized checkpoint ({method}) is not supported; lowbit reads 4-bit gptq and awq "
                         "checkpoints, or full-precision ones it quantizes itself")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} checkpoint with bits={bits}: lowbit reads 4-bit {method} only")
    g = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(g, int) or isinstance(g, bool) or not (g == -1 or (g > 0 and g % LOWBIT_GROUPS[-1] == 0)):
        raise ValueError(f"{method} group_size {g}: lowbit holds groups of 32, 64 or 128 input columns "
                         "(a multiple of 32, or -1 for one group a row)")
    keep = tuple(str(m) for m in (qc.get("modules_to_not_convert") or ()))
    if method == "awq":
        version = str(qc.get("version") or qc.get("format") or "gemm").lower()  # GPTQModel writes `format`
        if version != "gemm":
            raise ValueError(f"awq version {version!r}: lowbit reads the GEMM packing only")
        if qc.get("zero_point", True) is not True:
            raise ValueError("awq with zero_point false: lowbit reads zero-point AWQ (AutoAWQ's default) only")
        return AWQSpec(g, keep)
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"gptq checkpoint_format {fmt!r}: lowbit reads {' and '.join(GPTQ_FORMATS)}")
    if qc.get("dynamic"):
        raise ValueError("gptq with per-module overrides (dynamic) is not supported")
    if qc.get("lm_head"):
        raise ValueError("gptq with a quantized lm_head is not supported")
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise ValueError(f"gptq pack_dtype {qc['pack_dtype']}: lowbit reads int32 packing only")
    return GPTQSpec(g, bool(qc.get("desc_act", False)), bool(qc.get("sym", True)), fmt == "gptq", keep)


def dequantize(u: Unpacked) -> torch.Tensor:
    """The formats' definition, fp32 [N, K]: s * (q - z) with each column's group (g_idx). Every value
    is exact in fp32 (an fp16 scale times an integer of 5 bits), so any exact relayout equals it."""
    return u.scales[:, u.g_idx].float() * (u.codes.float() - u.zeros[:, u.g_idx].float())


def to_lowbit(u: Unpacked) -> "Int4Weight | Int8Weight | PermutedWeight":
    """The lossless lowbit layout for these codes (module docstring); ValueError if there is none."""
    N, K = u.codes.shape
    g = u.group_size
    gl = next(c for c in LOWBIT_GROUPS if g % c == 0)  # the spec parser let through multiples of 32 only
    perm = torch.argsort(u.g_idx, stable=True)  # [K]: stored column j is input column perm[j]
    if not torch.equal(u.g_idx[perm], torch.arange(K) // g):
        counts = torch.bincount(u.g_idx, minlength=K // g)
        raise ValueError(f"g_idx puts {int(counts.min())}..{int(counts.max())} input columns in a group, "
                         f"not {g} in each")
    identity = torch.equal(perm, torch.arange(K))
    codes = u.codes if identity else u.codes[:, perm].contiguous()  # [N, K], groups contiguous
    scales = u.scales.repeat_interleave(g // gl, dim=1).contiguous()  # [N, K / gl]
    if bool((u.zeros == 8).all()):
        w = Int4Weight(WeightSpec(4, gl, symmetric=True), K, pack_nibbles(codes), scales, None)
    else:
        q = codes.view(N, K // g, g).to(torch.int16) - u.zeros.to(torch.int16)[..., None]  # [N, G, g]
        w = Int8Weight(WeightSpec(8, gl), K, q.to(torch.int8).view(N, K), scales)
    return w if identity else PermutedWeight(w, perm)


@dataclass
class PermutedWeight:
    """A layout whose input columns are held in another order: y = x[..., in_perm] @ W^T. GPTQ's
    act-order needs it; the same wrapper holds a kernel's packed form of such a weight
    (quant/linear.py QuantLinear), so code that reads packed forms directly sees it is not plain."""

    weight: object  # Int4Weight | Int8Weight, or a kernel's packed form of one
    in_perm: torch.Tensor  # int64 [K]: stored column j is input column in_perm[j]

    @property
    def spec(self) -> WeightSpec:
        return self.weight.spec

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    @property
    def in_features(self) -> int:
        return self.weight.in_features

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.in_perm.numel() * self.in_perm.element_size()

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K] in input column order."""
        w = self.weight.dequantize()
        out = torch.empty_like(w)
        out[:, self.in_perm] = w
        return out

    def rows(self, index: torch.Tensor) -> "PermutedWeight":
        return PermutedWeight(self.weight.rows(index), self.in_perm)


def _groups(group_size: int, N: int, K: int) -> int:
    """G for a [N, K] matrix; ValueError when the packing cannot hold it."""
    g = K if group_size == -1 else group_size
    if K % 8 or N % 8 or K % g:
        raise ValueError(f"a {N}x{K} matrix does not pack into 8 codes a word in groups of {g}")
    return K // g


def _nibbles(packed: torch.Tensor, axis: int, order=tuple(range(8))) -> np.ndarray:
    """int32 words of eight 4-bit values → uint8 values, `axis` 8x longer: bits 4i..4i+3 of word j land at
    8j + order[i] along it."""
    a = packed.contiguous().numpy().view(np.uint32)  # logical shifts, also for words with the top bit set
    out = np.empty(a.shape[:axis + 1] + (8,) + a.shape[axis + 1:], dtype=np.uint8)  # [.., words, 8, ..]
    for i, j in enumerate(order):
        out[(slice(None),) * (axis + 1) + (j,)] = (a >> (4 * i)) & 0xF
    return out.reshape(a.shape[:axis] + (a.shape[axis] * 8,) + a.shape[axis + 1:])


def _t(a: np.ndarray) -> torch.Tensor:
    """[K or G, N] → uint8 [N, K or G], lowbit's row-per-output orientation."""
    return torch.from_numpy(np.ascontiguousarray(a.T))


def _fp16(scales: torch.Tensor) -> torch.Tensor:
    """[G, N] scales → fp16 [N, G]; ValueError unless every value is exact in fp16."""
    s = scales.half()
    if scales.dtype != torch.float16 and not (torch.equal(s.to(scales.dtype), scales) and bool(s.isfinite().all())):
        raise ValueError(f"{scales.dtype} scales that fp16 does not hold exactly (lowbit keeps fp16 scales)")
    return s.t().contiguous()
