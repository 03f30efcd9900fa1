"""The tile geometry shared by lowbit's int4 and int8 CPU layouts (kernels/int4_mm.py, int8_mm.py;
cpu_kernels.h reads it the same way).

A weight is cut into tiles of 16 output rows, stored one after the other. Within a tile, each group
of k (one scale per row) contributes its 16 rows' scales (`sb` bytes: 32 or 64) and its codes (`cb`
bytes, a multiple of 64). Units start on 64-byte boundaries so that every 64-byte load of codes is one
cache line: a unit holds 64 bytes of scales — one group's when they take 64 bytes, two groups' when
they take 32 — then those groups' codes:

    sb = 64:  [scales g][codes g]                      per group
    sb = 32:  [scales g][scales g+1][codes g][codes g+1] per pair of groups; an odd last group gets
              [scales g][32 bytes of zeros][codes g]
    sb > 64:  [header g][codes g]                      per group (GGML blocks in tiles, kernels/kq_mm.py:
              a header of 256 or 320 bytes, a whole number of lines)

Measured why (AMD EPYC Zen 4, 2 threads, all the 1.7B-shape model's int4 matmuls): with 288-byte
units (Q4_0, 32 bytes of scales per group) every code load straddled two cache lines and the kernel
streamed 27.3 GB/s, against 32.4 GB/s for 320-byte units (Q4_1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE = 16  # output rows per tile


def per_unit(sb: int) -> int:
    """Groups per unit: two when their scales fill 64 bytes together, else one."""
    return 2 if sb == 32 else 1


def unit_head(sb: int) -> int:
    """Bytes a unit's scales take: 64, or a header's own whole lines."""
    if sb > 64 and sb % 64:
        raise ValueError(f"tile layout: a header of {sb} bytes is not a whole number of 64-byte lines")
    return max(64, sb)


def tile_bytes(G: int, sb: int, cb: int) -> int:
    pair, A = per_unit(sb), unit_head(sb)
    return (G // pair) * (A + pair * cb) + (G % pair) * (A + cb)


def pack_tiles(scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """scales uint8 [T, G, sb], codes uint8 [T, G, cb] → uint8 [T, tile bytes] (module docstring)."""
    T, G, sb = scales.shape
    cb = codes.shape[2]
    pair, A = per_unit(sb), unit_head(sb)
    full = G // pair
    heads = scales[:, :full * pair].reshape(T, full, pair * sb)
    if pair * sb < A:  # one group of 64 bytes of scales or less: padded to the line
        heads = torch.cat([heads, torch.zeros(T, full, A - pair * sb, dtype=torch.uint8)], dim=-1)
    parts = [torch.cat([heads, codes[:, :full * pair].reshape(T, full, pair * cb)], dim=-1).reshape(T, -1)]
    if G % pair:  # an odd last group: its scales, padding to 64 bytes, its codes
        parts.append(torch.cat([scales[:, -1], torch.zeros(T, A - sb, dtype=torch.uint8), codes[:, -1]], dim=-1))
    return torch.cat(parts, dim=-1).contiguous()


def unpack_tiles(data: torch.Tensor, G: int, sb: int, cb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [n, tile bytes] → (scales uint8 [n, G, sb], codes uint8 [n, G, cb]): pack_tiles' inverse."""
    n = data.shape[0]
    pair, A = per_unit(sb), unit_head(sb)
    full = G // pair
    body = data[:, :full * (A + pair * cb)].reshape(n, full, A + pair * cb)
    scales = body[..., :pair * sb].reshape(n, full * pair, sb)
    codes = body[..., A:].reshape(n, full * pair, cb)
    if G % pair:
        last = data[:, full * (A + pair * cb):]
        scales = torch.cat([scales, last[:, None, :sb]], dim=1)
        codes = torch.cat([codes, last[:, None, A:]], dim=1)
    return scales, codes


def padded_input(op: str, x: torch.Tensor, in_features: int, Kp: int) -> torch.Tensor:
    """x [M, in_features] on the CPU → fp32 [M, Kp]: a weight of these layouts is padded to Kp (a
    whole group), and zeros past in_features keep its padding out of the sums."""
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"{op}: x has shape {tuple(x.shape)}, expected [M, {in_features}]")
    if x.device.type != "cpu":
        raise NotImplementedError(f"{op} multiplies lowbit's CPU layouts: x must be on the CPU, not {x.device}")
    x = x.float()
    return F.pad(x, (0, Kp - in_features)) if Kp != in_features else x
