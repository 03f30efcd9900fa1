"""One side — the keys or the values — of one layer of the paged KV pool, as every KV kernel takes it:
the plain-torch specs (runtime/engine/kv_cache.py, kernels/kv_quant.py), the Triton kernels
(kernels/kv_write.py, kernels/paged_attention.py) and the C ones (kernels/cpu_native.py).

The pool (runtime/engine/kv_cache.py) allocates each side once and hands out the same `KVSide`; its
tensors are written in place, so a side never needs rebuilding. The layout, P pages of `page`
tokens, Hkv KV heads, head dim D, G = D / group groups per vector:

    f32   data   fp32  [P, Hkv, page, D]
    f16   data   fp16  [P, Hkv, page, D]
    int8  codes  int8  [P, Hkv, page, D]     scales fp16 [P, Hkv, page, G]
    int4  codes  uint8 [P, Hkv, page, D/2]   scales, mins fp16 [P, Hkv, page, G]

A page's scales sit beside its codes (same leading index), so a page is freed or shared as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from lowbit.kernels.kv_quant import dequantize_int4, dequantize_int8


# eq=False: the fields are tensors, whose == is elementwise (a generated __eq__ would raise); sides
# compare and hash by identity, and a pool's side is one object for the pool's lifetime
@dataclass(frozen=True, eq=False)
class KVSide:
    bits: int  # 32 | 16 | 8 | 4
    group: int  # values per scale, the format's group capped at D (KVFormat.side_group); D for 32 and 16 bits
    data: torch.Tensor | None = None  # fp32 / fp16 [P, Hkv, page, D]: a 32- or 16-bit (float) side only
    codes: torch.Tensor | None = None  # int8 [P, Hkv, page, D], or uint8 [P, Hkv, page, D/2] packed low nibble first
    scales: torch.Tensor | None = None  # fp16 [P, Hkv, page, G]: 8 and 4 bits
    mins: torch.Tensor | None = None  # fp16 [P, Hkv, page, G]: 4 bits only (asymmetric)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The side's tensors by field name ("data" | "codes", "scales"[, "mins"]), in field order."""
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if isinstance(t, torch.Tensor):
                out[f.name] = t
        return out

    @property
    def n_kv_heads(self) -> int:
        """Hkv, the heads each page holds a vector of per token."""
        return next(iter(self.tensors().values())).shape[1]

    def pages(self, index: torch.Tensor) -> KVSide:
        """The same side over pages `index` (int [n]): every tensor [n, Hkv, page, ...], a copy."""
        return replace(self, **{name: t[index] for name, t in self.tensors().items()})

    def dequantize(self) -> torch.Tensor:
        """Every stored vector → fp32 [..., D] by kernels/kv_quant.py's spec (still rotated, if the
        format rotates). The groups come from the scales' shape. A 32-bit side's is its data itself
        (no copy: callers read `pages`' copy)."""
        if self.bits >= 16:
            return self.data.float()
        if self.bits == 8:
            return dequantize_int8(self.codes, self.scales)
        return dequantize_int4(self.codes, self.scales, self.mins)

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes or data, scales, mins) for a Triton kernel, which takes three pointers whatever the
        format: the codes stand in for the ones this side lacks (never read)."""
        codes = self.data if self.bits >= 16 else self.codes
        return (codes, codes if self.scales is None else self.scales, codes if self.mins is None else self.mins)

    def check(self, D: int, page_size: int | None, Hkv: int | None, op: str) -> tuple[int, int, int]:
        """That the side has the layout above for head dim D (and page_size tokens a page, Hkv heads,
        where given); `op` names the caller in the error. Returns (P, Hkv, page) of its tensors."""
        bits, group = self.bits, D if self.bits >= 16 else self.group
        if bits in (32, 16):
            want = {"data": (torch.float32 if bits == 32 else torch.float16, D)}
        elif bits in (8, 4):
            if group < 1 or D % group or (bits == 4 and group % 2):
                raise ValueError(f"{op}: group {group} must divide head_dim {D}"
                                 + (" and be even" if bits == 4 else ""))
            G = D // group
            want = {"codes": (torch.int8, D), "scales": (torch.float16, G)} if bits == 8 else \
                {"codes": (torch.uint8, D // 2), "scales": (torch.float16, G), "mins": (torch.float16, G)}
        else:
            raise ValueError(f"{op}: bits must be 32, 16, 8 or 4, got {bits}")
        held = self.tensors()
        if set(held) != set(want):
            raise ValueError(f"{op}: a {bits}-bit side holds {sorted(want)}, got {sorted(held)}")
        lead = None
        for name, (dtype, last) in want.items():
            t = held[name]
            if t.dim() != 4 or t.dtype != dtype or t.shape[3] != last or not t.is_contiguous():
                raise ValueError(f"{op}: {name} must be contiguous {dtype} [P, Hkv, page, {last}], got {t.dtype} "
                                 f"{tuple(t.shape)} strides {t.stride()}")
            if lead is None:
                lead = tuple(t.shape[:3])
            elif tuple(t.shape[:3]) != lead:
                raise ValueError(f"{op}: {name} has leading shape {tuple(t.shape[:3])}, the others {lead}")
        if page_size is not None and lead[2] != page_size:
            raise ValueError(f"{op}: the buffers hold pages of {lead[2]} tokens, not page_size={page_size}")
        if Hkv is not None and lead[1] != Hkv:
            raise ValueError(f"{op}: the buffers hold {lead[1]} KV heads, x has {Hkv}")
        return lead
