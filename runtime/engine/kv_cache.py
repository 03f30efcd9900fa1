"""The KV pool: one preallocated set of pages per layer, in a KV format (quant/kv.py).

Pages hold `page_size` tokens; the page manager (runtime/engine/pages.py) decides which page and
slot each token gets, this module only stores and reads. Per layer and side (K, V), one `KVSide`
(kernels/kv_side.py), which is what the kernels take:

    f32   data   fp32  [P, Hkv, page, D]
    f16   data   fp16  [P, Hkv, page, D]
    int8  codes  int8  [P, Hkv, page, D]     scales fp16 [P, Hkv, page, G]
    int4  codes  uint8 [P, Hkv, page, D/2]   scales, mins fp16 [P, Hkv, page, G]

A page's scales sit beside its codes (same leading index), so a page is freed or shared as a
whole. A hybrid model's pool holds pages for its attention layers only (`n_layers` is theirs: Qwen3.5's
one layer in four) and carries the recurrent-state slots of its other layers as `states`
(runtime/engine/state_cache.py), counted in `nbytes`. A pool may give each layer its own format
(`layer_formats`: `lowbit eval --attribute` quantizes one layer's K or V and keeps the rest f16; the engine's
EngineConfig.kv_layers, `lowbit fit`'s bits per layer); every side carries its own bits and group, and the one
rotation is applied to the quantized sides only.
Writing quantizes each token vector as it arrives (kernels/kv_quant.py); reading gathers a sequence's
pages and dequantizes them (the CPU path; the CUDA path reads codes in-kernel).
"""

from __future__ import annotations

from typing import Literal

import torch

from lowbit.kernels.kv_quant import quantize_int4, quantize_int8, rotation
from lowbit.kernels.kv_side import KVSide
from lowbit.quant.kv import KVFormat

GIB = 1 << 30


def bytes_per_token(fmt: KVFormat, n_layers: int, n_kv_heads: int, head_dim: int,
                    layer_formats: list[KVFormat] | None = None) -> int:
    """Bytes one token takes in every layer of a pool: n_layers of `fmt`, or the sum of each layer's own
    (layer_formats; n_layers of them)."""
    if layer_formats is None:
        return fmt.bytes_per_token(n_layers, n_kv_heads, head_dim)
    if len(layer_formats) != n_layers:
        raise ValueError(f"KVPool: {len(layer_formats)} layer formats for {n_layers} layers")
    return sum(f.bytes_per_token(1, n_kv_heads, head_dim) for f in layer_formats)


class KVPool:
    def __init__(self, fmt: KVFormat, n_layers: int, n_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = 16, device: torch.device | str = "cpu", states=None,
                 layer_formats: list[KVFormat] | None = None):
        """layer_formats: one format per layer in place of `fmt`, which then only names the pool."""
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        if layer_formats is not None and len(layer_formats) != n_layers:
            raise ValueError(f"KVPool: {len(layer_formats)} layer formats for {n_layers} layers")
        self.fmt, self.page_size, self.num_pages = fmt, page_size, num_pages
        self.formats = list(layer_formats) if layer_formats is not None else [fmt] * n_layers
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        rotates = any(f.rotates(head_dim) for f in self.formats)
        self.rot = rotation(head_dim, device) if rotates else None  # [D, D] orthonormal
        self._sides = [{"k": self._alloc("k", device, f), "v": self._alloc("v", device, f)} for f in self.formats]
        self.states = states  # StateCache or None

    @classmethod
    def from_budget(cls, fmt: KVFormat, n_layers: int, n_kv_heads: int, head_dim: int, budget_bytes: int,
                    page_size: int = 16, device="cpu", states=None,
                    layer_formats: list[KVFormat] | None = None) -> "KVPool":
        """As many pages as `budget_bytes` holds; a page costs every layer's bytes for page_size tokens (with
        layer_formats, each layer's own: `bytes_per_token`)."""
        per_page = bytes_per_token(fmt, n_layers, n_kv_heads, head_dim, layer_formats) * page_size
        pages = budget_bytes // per_page
        if pages < 1:
            named = fmt.name if layer_formats is None else "per-layer formats"
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no page ({per_page} bytes each in {named})")
        return cls(fmt, n_layers, n_kv_heads, head_dim, int(pages), page_size, device, states, layer_formats)

    def _alloc(self, name: Literal["k", "v"], device, fmt: KVFormat) -> KVSide:
        P, H, S, D = self.num_pages, self.n_kv_heads, self.page_size, self.head_dim
        bits, group = fmt.side_bits(name), fmt.side_group(name, D)
        if bits >= 16:  # f32, f16: the values themselves
            dtype = torch.float32 if bits == 32 else torch.float16
            return KVSide(bits, group, data=torch.zeros(P, H, S, D, dtype=dtype, device=device))
        G = D // group
        scales = torch.zeros(P, H, S, G, dtype=torch.float16, device=device)
        if bits == 8:
            return KVSide(bits, group, codes=torch.zeros(P, H, S, D, dtype=torch.int8, device=device), scales=scales)
        codes = torch.zeros(P, H, S, D // 2, dtype=torch.uint8, device=device)
        return KVSide(bits, group, codes=codes, scales=scales,
                      mins=torch.zeros(P, H, S, G, dtype=torch.float16, device=device))

    def side(self, layer: int, name: Literal["k", "v"]) -> KVSide:
        """One layer's keys ("k") or values ("v"): the pool's own tensors, written in place; the same
        object on every call."""
        return self._sides[layer][name]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self._sides for side in layer.values()
                   for t in side.tensors().values()) + (self.states.nbytes if self.states is not None else 0)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kernels=None) -> None:
        """k, v [M, Hkv, D] (any float dtype) of M tokens → their slots (int [M]). With lowbit's C kernels
        (the model backend's `native`), fp32 rows are quantized in C (kernels/cpu_attention.c: the
        specs' arithmetic, one call per side instead of ~15 torch ops)."""
        page, off = slots // self.page_size, slots % self.page_size
        for name, x in (("k", k), ("v", v)):
            side = self.side(layer, name)
            if kernels is not None and x.dtype == torch.float32 and x.stride(-1) == 1 and x.stride(1) == x.shape[2]:
                kernels.kv_write(x, slots.to(torch.int64).contiguous(), self.page_size, side, self.rot)
                continue
            if side.bits >= 16:
                side.data[page, :, off] = x.to(side.data.dtype)  # [M, Hkv, D] at (page, :, off)
                continue
            x = x.float() if self.rot is None else x.float() @ self.rot
            if side.bits == 8:
                side.codes[page, :, off], side.scales[page, :, off] = quantize_int8(x, side.group)
            else:
                side.codes[page, :, off], side.scales[page, :, off], side.mins[page, :, off] = \
                    quantize_int4(x, side.group)

    def gather(self, layer: int, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first `length` tokens, dequantized and un-rotated: k, v fp32 [Hkv, length, D]."""
        k, v = self.gather_pages(layer, pages)
        return self.tokens(k, length), self.tokens(v, length)

    def gather_pages(self, layer: int, pages: torch.Tensor, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages, dequantized: k, v fp32 [n, Hkv, page, D]. rotated=True leaves rotated sides
        rotated (models/attention.py rotates q and the output instead); every value is then computed
        elementwise, so it does not depend on which other pages are read in the same call."""
        out = []
        for side in (self.side(layer, "k"), self.side(layer, "v")):
            x = side.pages(pages).dequantize()  # [n, Hkv, page, D]
            if self.rot is not None and side.bits < 16 and not rotated:
                x = x @ self.rot.T  # undo the rotation (orthonormal)
            out.append(x)
        return out[0], out[1]

    def tokens(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """[n, Hkv, page, D] pages of one sequence → its first `length` tokens [Hkv, length, D]."""
        return x.transpose(0, 1).reshape(self.n_kv_heads, -1, self.head_dim)[:, :length]  # [Hkv, n*page, D]
