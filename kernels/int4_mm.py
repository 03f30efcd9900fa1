"""int4 weight-only matmul on CPU: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, w = d u + m or d (u - 8).

The weight is repacked once, at load, into lowbit's own layout (`Int4Packed`, written by
`int4_pack`, read by the C kernels and by the torch code below; no library's private layout):

    tiles of 16 output rows (N padded to 16 with zero weights) in kernels/tile_layout.py's units: per
    group of `gs` k (32, 64 or 128), the 16 rows' scales d (fp16 [16]) and mins m (fp16 [16],
    asymmetric only), then gs / 32 blocks of codes, each 4 x 64 bytes in VNNI quad order: byte
    [j][r][i] = u[r][8j + i] | u[r][8j + 4 + i] << 4 (4 consecutive k of one row adjacent; one 64-byte
    load is 16 rows x 8 k). Bytes per weight are the GGUF's: Q4_1 is 20 bytes per 32 weights in
    either, Q4_0 18 (plus 32 bytes per tile where a row has an odd number of groups).

One thread of the C kernel streams a contiguous range of tiles, codes next to their scales; the
quad order lets one vpdpbusd (or vpmaddubsw) multiply 16 (or 8) rows x 4 k by one broadcast
activation word.

CPU has two paths, chosen per call (`exact`, by default by M, the rows of x):

- fast (decode, speculative verification, M < EXACT_MIN_ROWS by default): lowbit's C kernel
  (kernels/cpu_native.py, cpu_wq_mm.c, cpu_wq_tiles.c): x rounded per block of 32 to 16-bit codes
  (kernels/act_quant.py), exact integer block sums, one fp32 epilogue; `int4_mm_fast_ref` is its
  spec, bit for bit, and a row's result does not depend on M or on the instruction set.
- exact (prefill, evaluation, and every call where the C kernels are not built): W^T dequantized
  with the exact fp16 scales into fp32 tiles of ~4M weights that live for this call only
  (kernels/exact_mm.py `in_tiles`), then torch's fp32
  GEMM (M = 512: 7.7 ms against 21 ms for torch's bf16 int4 kernel on a 1728x576 weight), its rows
  independent of M (kernels/exact_mm.py).

Only the packed codes and the file's own fp16 scales and mins are held, so memory stays at the GGUF's
size. `int4_dequant_ref` / `int4_mm_ref` are the format's spec (GGUF's arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lowbit.kernels import cpu_native
from lowbit.kernels.act_quant import BLOCK, act_quant_ref
from lowbit.kernels.exact_mm import exact_mm, in_tiles, takes_exact
from lowbit.kernels.tile_layout import TILE, pack_tiles, padded_input, unpack_tiles


@dataclass
class Int4Packed:
    data: torch.Tensor  # uint8 [N/16, tile bytes]: per group, d [16] (, m [16]) fp16 and the codes (module docstring)
    group_size: int
    symmetric: bool  # w = d (u - 8), no mins
    out_features: int  # N before padding to 16 rows
    in_features: int  # K before padding to a whole group
    padded_in: int  # K padded to a whole group
    # the C kernels that multiply it (the backend's choice, kernels/cpu_native.py), None: the exact path
    native: object = field(default=None, repr=False, compare=False)
    desc: object = field(default=None, repr=False, compare=False)  # the C kernels' descriptor, built once

    @property
    def padded_shape(self) -> tuple[int, int]:
        return self.data.shape[0] * TILE, self.padded_in

    @property
    def scales_per_row(self) -> int:
        return 1 if self.symmetric else 2

    def c_desc(self) -> "cpu_native._Linear":
        if self.desc is None:
            Np, Kp = self.padded_shape
            self.desc = cpu_native._Linear(1, Np, Kp, self.group_size, self.scales_per_row, self.data.data_ptr(), None)
        return self.desc

    def unpack(self, tiles: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes uint8 [n, Kp], scales fp16 [n, G], mins fp16 [n, G] or None) of the rows of these tiles
        (default all: n = Np): the inverse of int4_pack."""
        data = self.data[tiles]
        T, P, g = data.shape[0], self.scales_per_row, self.group_size
        G, nb = self.padded_in // g, g // BLOCK
        sc, codes = unpack_tiles(data, G, 32 * P, 8 * g)  # [T, G, 32 P], [T, G, 8 g]
        sc = sc.contiguous().view(torch.float16).view(T, G, P, TILE).permute(0, 3, 1, 2).reshape(T * TILE, G, P)
        b = codes.reshape(T, G, nb, 4, TILE, 4)  # [t, g, block, j, r, i]
        u = torch.stack((b & 0xF, b >> 4), dim=-1)  # [t, g, block, j, r, i, half]: k = 8j + 4 half + i
        u = u.permute(0, 4, 1, 2, 3, 6, 5).reshape(T * TILE, G * g)  # [Np, Kp]
        return u, sc[..., 0], None if self.symmetric else sc[..., 1]


def int4_packed_rows(w: Int4Packed, ids: torch.Tensor) -> torch.Tensor:
    """fp32 [n, K] of rows ids of a packed table (a tied embedding's lookups): the tiles holding them
    unpacked, the rows dequantized as quant/int4.py's dequantize computes them (bit for bit)."""
    ids = ids.to(torch.int64)
    tiles, where = torch.unique(torch.div(ids, TILE, rounding_mode="floor"), return_inverse=True)
    u, d, m = w.unpack(tiles)  # [len(tiles) * 16, Kp], [.., G]
    r = where * TILE + ids % TILE
    return int4_dequant_ref(u[r], d[r], None if m is None else m[r], w.group_size)[:, : w.in_features]


def int4_pack(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
              in_features: int, *, native) -> Int4Packed:
    """codes uint8 [N, Kp] (0..15), scales/mins fp16 [N, G] → lowbit's tile layout (module docstring),
    multiplied by `native` (kernels/cpu_native.py's NativeKernels) or, when None, the exact path."""
    N, Kp = codes.shape
    g = group_size
    if g % BLOCK or Kp % g:
        raise ValueError(f"int4 layout: K={Kp} in groups of {g} (groups must be whole and a multiple of {BLOCK})")
    Np, G = -(-N // TILE) * TILE, Kp // g
    T, nb = Np // TILE, g // BLOCK
    u = F.pad(codes.to(torch.uint8), (0, 0, 0, Np - N), value=8)  # pad rows: u = 8, d = 0 → w = 0 either way
    u = u.view(T, TILE, G, nb, 4, 2, 4).permute(0, 2, 3, 4, 1, 6, 5)  # [t, g, block, j, r, i, half]
    packed = (u[..., 0] | (u[..., 1] << 4)).reshape(T, G, nb * 256)
    parts = [scales] if mins is None else [scales, mins]
    sc = [F.pad(p.half(), (0, 0, 0, Np - N)).view(T, TILE, G).transpose(1, 2).contiguous().view(torch.uint8)
          for p in parts]  # each [T, G, 32]: the 16 rows' fp16 values of one group
    return Int4Packed(pack_tiles(torch.cat(sc, dim=-1), packed), g, mins is None, N, in_features, Kp, native)


def dequantize_packed_t(w: Int4Packed, rows: slice = slice(None)) -> torch.Tensor:
    """Exact fp32 W^T [Kp, n] of the output rows start..stop-1 (whole tiles of 16; a tile for one call,
    never kept), computed in the reference's order — d * (u - 8), d * u + m — so it matches
    quant/int4.py's dequantize bit for bit."""
    start, stop, _ = rows.indices(w.padded_shape[0])
    stop = max(start, stop)
    if w.native is not None:
        return w.native.int4_dequant_t(w.c_desc(), start, stop)  # the same numbers, in one C pass
    u, d, m = w.unpack(slice(start // TILE, -(-stop // TILE)))  # the rows' tiles: [n, Kp], [n, G]
    lo = start % TILE
    u, d, m = u[lo:lo + stop - start], d[lo:lo + stop - start], None if m is None else m[lo:lo + stop - start]
    Np, Kp = u.shape
    G, g = Kp // w.group_size, w.group_size
    ut = u.t().reshape(G, g, Np)  # [G, g, Np]: rows of one group are contiguous
    dt = d.t().float()[:, None, :]  # [G, 1, Np]
    if w.symmetric:
        wt = (ut.to(torch.int16) - 8) * dt
    else:
        wt = (ut * dt).add_(m.t().float()[:, None, :])
    return wt.reshape(Kp, Np)


def int4_mm(x: torch.Tensor, w: Int4Packed, exact: bool | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype) → y fp32 [M, N]: exact when `exact` (default: from EXACT_MIN_ROWS
    rows, kernels/exact_mm.py) or when w has no C kernels, else the C kernel's integer path."""
    Np, Kp = w.padded_shape
    x = padded_input("int4_mm", x, w.in_features, Kp)
    if w.native is None or takes_exact(exact) or x.shape[0] == 0:
        y = in_tiles(Np, Kp, lambda a, b: exact_mm(x, dequantize_packed_t(w, slice(a, b))))
    else:
        y = w.native.linear_mm(x, w.c_desc())
    return y[:, : w.out_features] if Np != w.out_features else y


def int4_dequant_ref(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     group_size: int) -> torch.Tensor:
    """The spec of the int4 layouts: codes uint8 [N, Kp], scales/mins [N, G] → fp32 [N, Kp],
    computed in GGUF's order (d * (u - 8), d * u + m) so Q4_0/Q4_1 relayouts compare bit-exactly."""
    N, Kp = codes.shape
    u = codes.view(N, Kp // group_size, group_size).float()  # [N, G, g]
    d = scales.float().unsqueeze(-1)  # [N, G, 1]
    w = d * (u - 8.0) if mins is None else d * u + mins.float().unsqueeze(-1)
    return w.reshape(N, Kp)


def int4_mm_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                group_size: int) -> torch.Tensor:
    """The matmul's spec in plain fp32 torch: dequantize then multiply."""
    return x.float() @ int4_dequant_ref(codes, scales, mins, group_size)[:, : x.shape[1]].t()


def int4_mm_fast_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     group_size: int) -> torch.Tensor:
    """The fast path's spec, bit for bit: x [M, Kp] (Kp whole groups) → y fp32 [M, N].

    Per row and block b of 32: q, s = act_quant_ref(x); T = sum u q (exact, int64 here); S = sum q;
    then in k order, y = y + (float)T * (d * s) and y = y + m * (s * (float)S) (asymmetric), or
    y = y + (float)(T - 8 S) * (d * s) (symmetric)."""
    M, Kp = x.shape
    N = codes.shape[0]
    q, s = act_quant_ref(x)  # [M, Kp], [M, B]
    B = Kp // BLOCK
    T = torch.einsum("mbk,nbk->mnb", q.view(M, B, BLOCK).long(), codes.view(N, B, BLOCK).long())  # [M, N, B]
    S = q.view(M, B, BLOCK).long().sum(-1)  # [M, B]
    per_block = group_size // BLOCK
    y = torch.zeros(M, N)
    for b in range(B):
        d = scales[:, b // per_block].float()[None, :]  # [1, N]
        sb = s[:, b:b + 1]  # [M, 1]
        if mins is None:
            y = y + (T[:, :, b] - 8 * S[:, b:b + 1]).float() * (d * sb)
        else:
            y = y + T[:, :, b].float() * (d * sb)
            y = y + mins[:, b // per_block].float()[None, :] * (sb * S[:, b:b + 1].float())
    return y
