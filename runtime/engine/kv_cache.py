"""The KV pool: one preallocated set of pages per layer, in a KV format (quant/kv.py).

Pages hold `page_size` tokens; the page manager (runtime/engine/pages.py) decides which page and
slot each token gets, this module only stores and reads. Per layer and side (K, V):

    f16   data   fp16  [P, Hkv, page, D]
    int8  codes  int8  [P, Hkv, page, D]     scales fp16 [P, Hkv, page, G]
    int4  codes  uint8 [P, Hkv, page, D/2]   scales, mins fp16 [P, Hkv, page, G]

A page's scales sit beside its codes (same leading index), so a page is freed or shared as a
whole. Writing quantizes each token vector as it arrives (kernels/kv_quant.py); reading gathers a
sequence's pages and dequantizes them (the CPU path; the CUDA path reads codes in-kernel).
"""

from __future__ import annotations

import torch

from lowbit.kernels import cpu_native
from lowbit.kernels.kv_quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8, rotation
from lowbit.quant.kv import KVFormat

GIB = 1 << 30


class KVPool:
    def __init__(self, fmt: KVFormat, n_layers: int, n_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = 16, device: torch.device | str = "cpu"):
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.fmt, self.page_size, self.num_pages = fmt, page_size, num_pages
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.rot = rotation(head_dim, device) if fmt.rotates(head_dim) else None  # [D, D] orthonormal
        self.sides = [{"k": self._alloc(fmt.k_bits, fmt.k_group, device),
                       "v": self._alloc(fmt.v_bits, fmt.v_group, device)} for _ in range(n_layers)]

    @classmethod
    def from_budget(cls, fmt: KVFormat, n_layers: int, n_kv_heads: int, head_dim: int, budget_bytes: int,
                    page_size: int = 16, device="cpu") -> "KVPool":
        per_page = fmt.bytes_per_token(n_layers, n_kv_heads, head_dim) * page_size
        pages = budget_bytes // per_page
        if pages < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no page ({per_page} bytes each in {fmt.name})")
        return cls(fmt, n_layers, n_kv_heads, head_dim, int(pages), page_size, device)

    def _alloc(self, bits: int, group: int, device) -> dict[str, torch.Tensor]:
        P, H, S, D = self.num_pages, self.n_kv_heads, self.page_size, self.head_dim
        if bits == 16:
            return {"data": torch.zeros(P, H, S, D, dtype=torch.float16, device=device)}
        G = D // self.fmt.group(bits, group, D)
        out = {"scales": torch.zeros(P, H, S, G, dtype=torch.float16, device=device)}
        if bits == 8:
            out["codes"] = torch.zeros(P, H, S, D, dtype=torch.int8, device=device)
        else:
            out["codes"] = torch.zeros(P, H, S, D // 2, dtype=torch.uint8, device=device)
            out["mins"] = torch.zeros(P, H, S, G, dtype=torch.float16, device=device)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.sides for side in layer.values()
                   for t in side.values())

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [M, Hkv, D] (any float dtype) of M tokens → their slots (int [M]). On CPU with lowbit's
        C kernels, fp32 rows are quantized in C (kernels/cpu_attention.c: the specs' arithmetic, one
        call per side instead of ~15 torch ops)."""
        kernels = cpu_native.native() if k.device.type == "cpu" else None
        page, off = slots // self.page_size, slots % self.page_size
        for name, x, bits, group in (("k", k, self.fmt.k_bits, self.fmt.k_group),
                                     ("v", v, self.fmt.v_bits, self.fmt.v_group)):
            buf = self.sides[layer][name]
            if kernels is not None and x.dtype == torch.float32 and x.stride(-1) == 1 and x.stride(1) == x.shape[2]:
                kernels.kv_write(x, slots.to(torch.int64).contiguous(), self.page_size,
                                 (bits, self.fmt.group(bits, group, self.head_dim), buf), self.rot)
                continue
            if bits == 16:
                buf["data"][page, :, off] = x.to(buf["data"].dtype)  # [M, Hkv, D] at (page, :, off)
                continue
            x = x.float() if self.rot is None else x.float() @ self.rot
            g = self.fmt.group(bits, group, self.head_dim)
            if bits == 8:
                buf["codes"][page, :, off], buf["scales"][page, :, off] = quantize_int8(x, g)
            else:
                buf["codes"][page, :, off], buf["scales"][page, :, off], buf["mins"][page, :, off] = \
                    quantize_int4(x, g)

    def gather(self, layer: int, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first `length` tokens, dequantized and un-rotated: k, v fp32 [Hkv, length, D]."""
        k, v = self.gather_pages(layer, pages)
        return self.tokens(k, length), self.tokens(v, length)

    def gather_pages(self, layer: int, pages: torch.Tensor, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages, dequantized: k, v fp32 [n, Hkv, page, D]. rotated=True leaves rotated sides
        rotated (models/attention.py rotates q and the output instead); every value is then computed
        elementwise, so it does not depend on which other pages are read in the same call."""
        out = []
        for name, bits in (("k", self.fmt.k_bits), ("v", self.fmt.v_bits)):
            buf = {key: t[pages] for key, t in self.sides[layer][name].items()}  # [n, Hkv, page, ...]
            if bits == 16:
                x = buf["data"].float()
            elif bits == 8:
                x = dequantize_int8(buf["codes"], buf["scales"])
            else:
                x = dequantize_int4(buf["codes"], buf["scales"], buf["mins"])
            if self.rot is not None and bits < 16 and not rotated:
                x = x @ self.rot.T  # undo the rotation (orthonormal)
            out.append(x)
        return out[0], out[1]

    def tokens(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """[n, Hkv, page, D] pages of one sequence → its first `length` tokens [Hkv, length, D]."""
        return x.transpose(0, 1).reshape(self.n_kv_heads, -1, self.head_dim)[:, :length]  # [Hkv, n*page, D]
