"""QuantLinear: a linear layer whose weight stays in its int4/int8 layout, and the embedding table.

Each layout is turned once, at construction, into the form its backend's kernel reads, and only
that form is kept: no full-precision shadow copy of a quantized weight ever exists. Every tensor
is also registered as a buffer so `model.buffers()` is the honest count of bytes held.

Two sets of kernels (`LinearKernels`): the CPU's (kernels/int4_mm.py, int8_mm.py: lowbit's C kernels
on its own packed layouts, or the exact dequantize + fp32 GEMM path) and the Triton kernel for CUDA
(kernels/wq_mm.py). The model picks one set per model
(models/backend.py); layers never test the device themselves. bitsandbytes' layouts (quant/bnb.py)
are kept as bitsandbytes holds them and multiplied by bitsandbytes, on CPU only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

from lowbit.kernels.exact_mm import exact_linear, in_tiles, takes_exact
from lowbit.kernels.ggml_mm import GgmlPacked, ggml_mm, ggml_pack
from lowbit.kernels.ggml_triton import GgmlTritonPacked, ggml_triton_mm, ggml_triton_pack, ggml_triton_rows
from lowbit.kernels.int4_mm import Int4Packed, int4_mm, int4_pack, int4_packed_rows
from lowbit.kernels.int8_mm import Int8Packed, int8_mm, int8_pack
from lowbit.kernels.kq_mm import KqPacked, kq_mm
from lowbit.kernels.segments import Segments
from lowbit.kernels.wq_mm import wq_mm, wq_pack_int4, wq_pack_int8, wq_rows
from lowbit.quant import BnbWeight, FloatWeight, Int4Weight, Int8Weight, Weight
from lowbit.quant.ggml import FileRelaid
from lowbit.quant.ggml_block import GgmlWeight, concat_rows
from lowbit.quant.ggml_tiles import cpu_pack_rows
from lowbit.quant.gptq import PermutedWeight


@dataclass(frozen=True)
class LinearKernels:
    """How one backend holds and multiplies weights.

    pack(weight) → the packed form; matmul(x [M, K], packed, exact, out_dtype) → y [M, N] in
    out_dtype (None: x's dtype);
    pack_embedding / rows: the embedding table's form and fp32 rows of it; shares_head(packed):
    whether the tied LM head can multiply by the embedding's packed form directly; pack_rows(weights):
    weights reading one input packed as one, their rows stacked, or None (then `fuse_rows` and `pack`)."""

    pack: Callable
    matmul: Callable
    pack_embedding: Callable
    rows: Callable
    shares_head: Callable
    pack_rows: Callable = lambda weights: None


def _cpu_pack(weight: Weight, native):
    if isinstance(weight, FileRelaid) and weight.unread and native is not None:  # straight from the file
        return cpu_pack_rows([weight], native)
    if isinstance(weight, Int4Weight):
        return int4_pack(weight.codes(), weight.scales, weight.mins, weight.spec.group_size, weight.in_features,
                         native=native)
    if isinstance(weight, Int8Weight):
        return int8_pack(weight.qweight, weight.scales, weight.in_features, native=native)
    if isinstance(weight, GgmlWeight):
        return _ggml_pack(weight, native)
    return weight


def _ggml_pack(weight: GgmlWeight, native):
    """GGML blocks → lowbit's tiles where the C kernels are there and take every run (kernels/kq_mm.py;
    Q4_0/Q4_1/Q8_0 runs as int4/int8 tiles), else the file's blocks as they are (kernels/ggml_mm.py)."""
    tiled = cpu_pack_rows([weight], native)
    if tiled is not None:
        return tiled
    return ggml_pack(weight.data, weight.qtype, weight.in_features, weight.data2, weight.qtype2, native=native)


def _cpu_matmul(x: torch.Tensor, w, exact: bool | None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if isinstance(w, BnbWeight):  # bitsandbytes' arithmetic is the format: no separate exact path
        y = w.matmul(x)
    elif isinstance(w, FloatWeight):
        y = _float_linear(x, w, exact)
    elif isinstance(w, Int8Packed):
        y = int8_mm(x, w, exact)
    elif isinstance(w, GgmlPacked):
        y = ggml_mm(x, w, exact)
    elif isinstance(w, KqPacked):
        y = kq_mm(x, w, exact)
    elif isinstance(w, Segments):
        y = w.matmul(x, exact)
    else:
        y = int4_mm(x, w, exact)
    return y.to(out_dtype or x.dtype)


def _float_linear(x: torch.Tensor, w: FloatWeight, exact: bool | None) -> torch.Tensor:
    """Float weights multiply in their own dtype; exact=True in fp32 (an fp32 copy of the weight for
    this call only), so the exact path means the same on every backend: fp16 GEMMs round differently
    on CPU and in cuBLAS (5e-4 on logits, measured on an H200). On CPU the copy is made a range of rows
    at a time (in_tiles, as the quantized layouts' exact path): a whole BF16 8B head in fp32 was 805 MB
    more at once (49K vocabulary; 2.1 GB at Llama-3's 128K), the step past 1.1x its tensor bytes of peak
    RSS for `lowbit eval reference` (tests/bench/reference_rss.py). The ranges give the same bits as one
    call (torch's fp32 GEMM, AMD EPYC, 1 and 2 threads, M 1 to 512: a row's sums do not depend on N)."""
    if exact:  # rows independent of how many share the call (kernels/exact_mm.py)
        if x.device.type == "cpu":
            xf, (N, K) = x.float(), w.shape
            return in_tiles(N, K, lambda a, b: exact_linear(xf, w.weight[a:b].float()))
        return torch.nn.functional.linear(x.float(), w.weight.float())
    return torch.nn.functional.linear(x.to(w.weight.dtype), w.weight)


def _cpu_rows(w, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(w, (Int8Packed, GgmlPacked, KqPacked)):
        return w.rows(ids)
    if isinstance(w, Int4Packed):
        return int4_packed_rows(w, ids)
    if isinstance(w, FloatWeight):
        return w.weight[ids].float()
    return w.rows(ids).dequantize()  # bitsandbytes' layouts: dequantize just these rows


def cpu_kernels(native) -> LinearKernels:
    """The CPU backend's: lowbit's layouts multiplied by `native` (kernels/cpu_native.py's C kernels),
    or, when it is None, by the exact path alone."""
    # A table is packed as any weight: the tied head multiplies that form and the lookups read it, so it
    # is held once (int4/int8 tiles, GGML blocks; a plain copy for lookups would double its bytes).
    pack = partial(_cpu_pack, native=native)
    shares = (Int8Packed, Int4Packed, GgmlPacked, KqPacked, FloatWeight)
    return LinearKernels(pack, _cpu_matmul, pack, _cpu_rows, lambda w: isinstance(w, shares),
                         partial(cpu_pack_rows, native=native))


def triton_kernels(device: torch.device) -> LinearKernels:
    """The Triton weight-only kernel for every int4/int8 layout; float weights through torch."""

    def pack(weight: Weight):
        if isinstance(weight, BnbWeight):
            raise ValueError(f"{weight.spec.name} runs on CPU only (bitsandbytes' own matmul); use --device cpu")
        if isinstance(weight, GgmlWeight):  # the file's blocks, decoded in the kernel (kernels/ggml_triton.py)
            return ggml_triton_pack(weight.data, weight.qtype, weight.in_features, weight.data2,
                                    weight.qtype2 if weight.data2 is not None else 0).to(device)
        if isinstance(weight, Int4Weight):
            w = wq_pack_int4(weight.codes(), weight.scales, weight.mins, weight.spec.group_size, weight.in_features)
        elif isinstance(weight, Int8Weight):
            w = wq_pack_int8(weight.qweight, weight.scales, weight.in_features)
        else:
            return FloatWeight(weight.spec, weight.weight.to(device))
        return w.to(device)

    def matmul(x: torch.Tensor, w, exact: bool | None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        xin = x.float() if exact else x  # exact: the kernel's IEEE fp32 path
        if isinstance(w, FloatWeight):
            return _float_linear(xin, w, exact).to(out_dtype or xin.dtype)
        if isinstance(w, GgmlTritonPacked):
            return ggml_triton_mm(xin, w, out_dtype=out_dtype)
        return wq_mm(xin, w, out_dtype=out_dtype)

    def rows(w, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(w, GgmlTritonPacked):
            return ggml_triton_rows(w, ids)
        return w.weight[ids].float() if isinstance(w, FloatWeight) else wq_rows(w, ids)

    return LinearKernels(pack, matmul, pack, rows, lambda w: True)


def _tensors(obj) -> dict[str, torch.Tensor]:
    """A packed form's tensors by name (a Segments' runs' as `part{i}_<name>`)."""
    if isinstance(obj, Segments):
        return {f"part{i}_{k}": v for i, p in enumerate(obj.parts) for k, v in _tensors(p).items()}
    return {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


def _register(module: nn.Module, obj) -> None:
    for name, value in _tensors(obj).items():
        module.register_buffer(name, value, persistent=False)


def fuse_rows(weights: list[Weight]) -> Weight | None:
    """Concatenate layouts along N (QKV, gate+up) so one kernel call serves them; None if their
    layouts differ (mixed-type GGUF files), in which case the caller keeps them separate."""
    first = weights[0]
    if isinstance(first, BnbWeight):  # bitsandbytes multiplies each matrix on its own, as transformers does
        return None
    if any(isinstance(w, PermutedWeight) for w in weights):  # act-order GPTQ: one input order for all, kept
        if not all(isinstance(w, PermutedWeight) and torch.equal(w.in_perm, first.in_perm) for w in weights):
            return None
        inner = fuse_rows([w.weight for w in weights])
        return None if inner is None else PermutedWeight(inner, first.in_perm)
    if any(isinstance(w, GgmlWeight) for w in weights):  # GGML blocks: up to two runs of one type each
        return concat_rows(weights)
    if any(type(w) is not type(first) or w.spec != first.spec or w.in_features != first.in_features for w in weights):
        return None
    if isinstance(first, Int4Weight):
        mins = None if first.mins is None else torch.cat([w.mins for w in weights])
        return Int4Weight(first.spec, first.in_features, torch.cat([w.qweight for w in weights]),
                          torch.cat([w.scales for w in weights]), mins)
    if isinstance(first, Int8Weight):
        return Int8Weight(first.spec, first.in_features, torch.cat([w.qweight for w in weights]),
                          torch.cat([w.scales for w in weights]))
    return FloatWeight(first.spec, torch.cat([w.weight for w in weights]))


@dataclass(frozen=True)
class ExactRows:
    """Per-row choice of path for one step: `mask` bool [M], True for rows computed exactly (fp32
    on exactly dequantized weights), False for the fast kernel. The engine marks prompt tokens
    exact and generated tokens fast, so a sequence's numbers depend on its own tokens only — not on
    how many other rows share the step, nor on how much of its prompt the prefix cache held (a
    repeated seeded request gives the same reply)."""

    mask: torch.Tensor  # bool [M]

    @staticmethod
    def of(mask: list[bool], device) -> "bool | ExactRows":
        """True/False when every row agrees (one kernel call), else an ExactRows."""
        if all(mask):
            return True
        if not any(mask):
            return False
        return ExactRows(torch.tensor(mask, dtype=torch.bool, device=device))

    def take(self, rows: torch.Tensor) -> "bool | ExactRows":
        """The choice for a subset of the rows (e.g. the rows whose logits are sampled)."""
        return ExactRows.of(self.mask[rows].tolist(), self.mask.device)


def all_fast(exact: bool | None | ExactRows, M: int) -> bool:
    """Whether every row of an M-row step takes the fast kernel (what the C block and one-call step
    need): the rule is the kernels' own (kernels/exact_mm.py takes_exact)."""
    return not isinstance(exact, ExactRows) and not takes_exact(exact)


class QuantLinear(nn.Module):
    """y = x @ W^T (+ b). Input [..., K] in the backend's activation dtype (or fp32); output in
    out_dtype, by default the input's. `exact`: force the exact fp32 path (True) or the fast kernel (False); None lets the
    kernel choose (CPU: by row count, see kernels/int4_mm.py; CUDA: the activation dtype)."""

    def __init__(self, weight, kernels: LinearKernels, bias: torch.Tensor | None = None,
                 spec_name: str | None = None, packed: bool = False):
        super().__init__()
        self.spec_name = spec_name or weight.spec.name  # an already packed table passes its layout's name
        perm = weight.in_perm if isinstance(weight, PermutedWeight) else None  # act-order GPTQ (quant/gptq.py)
        weight = weight.weight if perm is not None else weight
        self.w = weight if packed else kernels.pack(weight)
        self.matmul = kernels.matmul
        _register(self, self.w)
        device = self.w.weight.device if isinstance(self.w, FloatWeight) else next(iter(_tensors(self.w).values())).device
        self.register_buffer("bias", None if bias is None else bias.float().to(device), persistent=False)
        # int64 [K]: the input columns in the weight's stored order. The packed form is then kept wrapped,
        # so code that multiplies packed forms itself (kernels/cpu_block.py) sees it is not plain and
        # leaves this layer to forward().
        self.register_buffer("in_perm", None if perm is None else perm.to(device), persistent=False)
        if perm is not None:
            self.w = PermutedWeight(self.w, self.in_perm)

    def forward(self, x: torch.Tensor, exact: bool | None | ExactRows = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        w = self.w
        if self.in_perm is not None:
            x2, w = x2[:, self.in_perm], w.weight  # [M, K] in the weight's column order
        if isinstance(exact, ExactRows):
            m = exact.mask
            y_exact = self.matmul(x2[m], w, True, out_dtype)  # [E, N]
            y = torch.empty((x2.shape[0], y_exact.shape[1]), dtype=y_exact.dtype, device=x2.device)  # [M, N]
            y[m] = y_exact
            y[~m] = self.matmul(x2[~m], w, False, out_dtype).to(y.dtype)
        else:
            y = self.matmul(x2, w, exact, out_dtype)  # [M, N]
        if self.bias is not None:
            y = (y.float() + self.bias).to(y.dtype)
        return y.reshape(*lead, -1)


class QuantEmbedding(nn.Module):
    """Token ids → fp32 rows, read straight from the quantized table."""

    def __init__(self, weight: Weight, kernels: LinearKernels):
        super().__init__()
        self.w = kernels.pack_embedding(weight)
        self.lookup = kernels.rows
        _register(self, self.w)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(self.w, ids.reshape(-1)).reshape(*ids.shape, -1)
