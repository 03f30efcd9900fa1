"""int8 weight-only matmul on CPU: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, W = scale * q.

Like int4 (kernels/int4_mm.py), the weight is repacked once into lowbit's own tile layout
(`Int8Packed`, written by `int8_pack`):

    tiles of 16 output rows (N padded to 16 with zero weights) in kernels/tile_layout.py's units: per
    group of g k (32, 64, 128; per channel: one group of K rounded up to 32), the 16 rows' scales
    (fp16 [16], or fp32 [16] per channel), then g / 32 blocks of codes, each 8 x 64 bytes in VNNI
    quad order: byte [j][r][i] = q[r][4j + i] + 128 (stored unsigned, so one u8 x s8 dot product
    instruction multiplies them; the kernels subtract 128 x the activations' sum).

The same layout is the embedding table of a tied model (the default model's Q8_0 token_embd):
`rows` gathers a few rows of it for lookups, and the LM head multiplies it whole.

Two paths, chosen as int4's: the C kernel (16-bit activation codes, exact integer block sums, one
fp32 epilogue; `int8_mm_fast_ref` is its spec bit for bit; the default model's 49152x576 LM head)
and the exact path (row tiles dequantized with the exact scales, fp32 GEMM), which is also what runs
everywhere the C kernels are not built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lowbit.kernels import cpu_native
from lowbit.kernels.act_quant import BLOCK, act_quant_ref
from lowbit.kernels.exact_mm import exact_linear, in_tiles, takes_exact
from lowbit.kernels.tile_layout import TILE, pack_tiles, padded_input, unpack_tiles

@dataclass
class Int8Packed:
    data: torch.Tensor  # uint8 [N/16, tile bytes]: per group, 16 scales (fp16 or fp32) and the codes + 128
    group: int  # k per group (per channel: Kp)
    scale_bytes: int  # 2 (fp16 scales) or 4 (fp32, per channel)
    out_features: int  # N before padding to 16 rows
    in_features: int  # K before padding
    padded_in: int  # K padded to whole groups
    # the C kernels that multiply it (the backend's choice, kernels/cpu_native.py), None: the exact path
    native: object = field(default=None, repr=False, compare=False)
    desc: object = field(default=None, repr=False, compare=False)  # the C kernels' descriptor, built once

    @property
    def padded_shape(self) -> tuple[int, int]:
        return self.data.shape[0] * TILE, self.padded_in

    def c_desc(self) -> "cpu_native._Linear":
        if self.desc is None:
            Np, Kp = self.padded_shape
            self.desc = cpu_native._Linear(2, Np, Kp, self.group, self.scale_bytes, self.data.data_ptr(), None)
        return self.desc

    def _tiles(self, index: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Some tiles' (codes q int8 [n, 16, Kp], scales fp32 [n, 16, G]) in row order."""
        t = self.data[index]  # [n, tile bytes]
        n, G, g = t.shape[0], self.padded_in // self.group, self.group
        sc, c = unpack_tiles(t, G, 16 * self.scale_bytes, 16 * g)  # [n, G, 16 scale bytes], [n, G, 16 g]
        sc = sc.contiguous().view(torch.float16 if self.scale_bytes == 2 else torch.float32)  # [n, G, 16]
        c = c.reshape(n, G, g // BLOCK, 8, TILE, 4)  # [n, g, block, j, r, i]: k = 32 block + 4j + i
        q = (c.permute(0, 4, 1, 2, 3, 5).reshape(n, TILE, G * g).to(torch.int16) - 128).to(torch.int8)
        return q, sc.transpose(1, 2).float()  # [n, 16, Kp], [n, 16, G]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (embedding lookup), fp32 [len(ids), K]."""
        if self.native is not None:
            return self.native.int8_rows(self.c_desc(), ids)[:, : self.in_features]  # ~5 us, not ~0.2 ms of torch ops
        q, sc = self._tiles(ids // TILE)  # one tile per id
        r = ids % TILE
        q, sc = q[torch.arange(len(ids)), r], sc[torch.arange(len(ids)), r]  # [n, Kp], [n, G]
        w = sc[:, :, None] * q.view(len(ids), -1, self.group).float()  # [n, G, g]
        return w.reshape(len(ids), -1)[:, : self.in_features]

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """Exact fp32 [n, Kp] of rows start..stop-1: scale * q, as the spec."""
        Np, Kp = self.padded_shape
        start, stop, _ = rows.indices(Np)
        stop = max(start, stop)
        if self.native is not None:
            return self.native.int8_dequant(self.c_desc(), start, stop)  # the same numbers, in one C pass
        q, sc = self._tiles(slice(start // TILE, -(-stop // TILE)))
        w = sc[..., None] * q.view(*q.shape[:2], -1, self.group).float()  # [n, 16, G, g]
        return w.reshape(-1, Kp)[start % TILE: start % TILE + stop - start]


def int8_pack(qweight: torch.Tensor, scales: torch.Tensor, in_features: int, *, native) -> Int8Packed:
    """qweight int8 [N, Kp], scales [N, G] (fp16 per group, or fp32 [N, 1] per channel) → lowbit's
    tile layout (module docstring), multiplied by `native` (NativeKernels) or, when None, the exact path."""
    N, Kp = qweight.shape
    G = scales.shape[1]
    per_channel = G == 1 and scales.dtype == torch.float32
    if per_channel and Kp % BLOCK:  # one group of K: zero codes up to whole activation blocks
        qweight = F.pad(qweight, (0, BLOCK - Kp % BLOCK))
        Kp = qweight.shape[1]
    g = Kp // G
    if g % BLOCK or Kp % G:
        raise ValueError(f"int8 layout: K={Kp} in {G} groups (groups must be whole and a multiple of {BLOCK})")
    Np = -(-N // TILE) * TILE
    T, nb = Np // TILE, g // BLOCK
    u = (F.pad(qweight, (0, 0, 0, Np - N)).to(torch.int16) + 128).to(torch.uint8)  # [Np, Kp], pad rows q = 0
    u = u.view(T, TILE, G, nb, 8, 4).permute(0, 2, 3, 4, 1, 5).reshape(T, G, nb * 512)  # [t, g, block, j, r, i]
    sdt = torch.float32 if per_channel else torch.float16
    sc = F.pad(scales.to(sdt), (0, 0, 0, Np - N)).view(T, TILE, G).transpose(1, 2).contiguous().view(torch.uint8)
    return Int8Packed(pack_tiles(sc, u), g, 4 if per_channel else 2, N, in_features, Kp, native)


def int8_mm(x: torch.Tensor, w: Int8Packed, exact: bool | None = None) -> torch.Tensor:
    """x [M, K] → y fp32 [M, N]: exact when `exact` (default: from EXACT_MIN_ROWS rows,
    kernels/exact_mm.py) or when w has no C kernels, else the C kernel's integer path."""
    Np, Kp = w.padded_shape
    x = padded_input("int8_mm", x, w.in_features, Kp)
    if w.native is None or takes_exact(exact) or x.shape[0] == 0:
        return in_tiles(w.out_features, Kp, lambda a, b: exact_linear(x, w.dequantize(slice(a, b))))
    y = w.native.linear_mm(x, w.c_desc())
    return y[:, : w.out_features] if Np != w.out_features else y


def int8_dequant_ref(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The spec of the int8 layouts: qweight int8 [N, Kp], scales [N, G] → fp32 [N, Kp] (d * q,
    as GGUF's Q8_0 reference computes it)."""
    N, Kp = qweight.shape
    G = scales.shape[1]
    return (scales.float().unsqueeze(-1) * qweight.view(N, G, Kp // G).float()).reshape(N, Kp)  # via [N, G, g]


def int8_mm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The matmul's spec in fp32: dequantize then multiply."""
    return x.float() @ int8_dequant_ref(qweight, scales)[:, : x.shape[1]].t()


def int8_mm_fast_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fast path's spec, bit for bit: x [M, Kp] (Kp whole groups, a multiple of 32) → y fp32 [M, N].

    Per row and block b of 32: q, s = act_quant_ref(x); T = sum q_w q (exact); then in k order,
    y = y + (float)T * (d * s). (float)T rounds to nearest even where |T| >= 2^24, as the kernels'
    conversion does."""
    M, Kp = x.shape
    N, G = scales.shape
    q, s = act_quant_ref(x)  # [M, Kp], [M, B]
    B = Kp // BLOCK
    T = torch.einsum("mbk,nbk->mnb", q.view(M, B, BLOCK).long(), qweight.view(N, B, BLOCK).long())  # [M, N, B]
    per_block = Kp // G // BLOCK
    y = torch.zeros(M, N)
    for b in range(B):
        y = y + T[:, :, b].float() * (scales[:, b // per_block].float()[None, :] * s[:, b:b + 1])
    return y
