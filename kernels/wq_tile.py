"""The tensor-core operand tile of the GPU weight-only matmul (kernels/wq_mm.py): how a 128-row x
64-column (or 32-column) block of quantized weights lies in memory so that each thread's 16-byte loads hold exactly
the codes its part of the MMA's A operand needs, and how those codes become fp16/bf16 in registers.

The matmul is swapped, y^T[N, M] = W[N, K] @ x^T[K, M], so the weights are the dot's left operand,
which Hopper's wgmma (and Ampere's mma) take from registers. Triton gives that operand, for a
[128, 64] fp16 tile over 4 warps, the linear layout (bits of the row n and the column k each come
from one bit of the register, lane or warp index):

    register bits  k0 n3 k3 k4 k5 n6      (a 32-bit register holds the pair k, k+1)
    lane bits      k1 k2 n0 n1 n2
    warp bits      n4 n5

A tile is stored so that a plain coalesced load — [128, 32] bytes for int4 (16 bytes, then a
second lane, per thread), [128, 64] for int8 — lands in registers in exactly that layout after a
reshape and a transpose that only rename bits (no data moves). Nothing is converted through shared
memory: tests/bench/sass_count.py counts the loop.

int4: byte b of a tile row holds two codes, nibble j (0 low, 1 high) being column
k = 16 (b >> 3) + 8 j + (b & 7), so the low nibbles of 8 consecutive bytes are 8 consecutive k and
their high nibbles the 8 after; every byte is decoded alone (lo, hi), which is what lets the
interpreter decode it with plain integer ops. In memory, row T and byte R of the loaded [128, 32]
block hold the tile's (n, b) with, bit for bit,
    T = (b2, n0, n1, n2, n4, n5, n6),  R = (b0, n3, b3, b4, b1)   (least significant first).
int8: the code of (n, k) itself, with
    T = (n0, n1, n2, n4, n5, k5, n6),  R = (k0, n3, k3, k4, k1, k2).
Groups of 32 (or odd multiples) take tiles of 32 columns instead, so that no tile holds two groups
(the operand then drops k5): int4 [128, 16] bytes with T = (b1, b2, n0, n1, n2, n4, n5),
R = (b0, n3, b3, n6); int8 [128, 32] with T = (k2, n0, n1, n2, n4, n5, n6), R = (k0, n3, k3, k4, k1).

Codes to floats, two per 32-bit instruction (the magic-number trick of FasterTransformer/Marlin):
OR a code into the mantissa of 1024 (fp16 0x6400, ulp 1) or 128 (bf16 0x4300), then subtract the
magic (and 8 for symmetric int4) — exact, since every code is a small integer. fp16's 10-bit
mantissa also takes a high nibble in place (1024 + 16 c), scaled back by one fma with 1/16; bf16's
7 bits do not, so bf16 shifts first. int8 codes q become q + 128 (xor 0x80) under the magic byte.
On CUDA the decode is PTX (`tl.inline_asm_elementwise`); elsewhere (the interpreter) the same
values by integer ops, and the fp32 exact path widens the codes directly.
"""

from __future__ import annotations

import torch

from lowbit.kernels.triton_import import tl, triton

TILE_N = 128  # weight rows (output features) per tile: two 64-row wgmma blocks over 4 warps
TILE_K = 64  # columns (input features) per tile; 32 for groups that are not a multiple of 64
TILE_WARPS = 4  # the layouts here are the operand layout of a 4-warp program


def tile_width(group_size: int, per_channel: bool) -> int:
    """Columns per tile: 64, or 32 where groups of 32 (or an odd multiple) would cut 64-wide tiles,
    so that a tile never holds two groups' codes and never has to be split in registers."""
    return TILE_K if per_channel or group_size % TILE_K == 0 else TILE_K // 2


def tile_bytes(bits: int, tile_k: int) -> int:
    return TILE_N * tile_k * bits // 8


def padded(n: int, k: int) -> tuple[int, int]:
    """A weight's [N, K] rounded up to whole tiles (K to 64 for either width)."""
    return triton.cdiv(n, TILE_N) * TILE_N, triton.cdiv(k, TILE_K) * TILE_K


def _bit(x: torch.Tensor, i: int) -> torch.Tensor:
    return (x >> i) & 1


def _index(bits: list[torch.Tensor]) -> torch.Tensor:
    """Bits, least significant first → the number."""
    return sum(b << i for i, b in enumerate(bits))


def int4_offsets(n: torch.Tensor, k: torch.Tensor, k_tiles: int, tile_k: int = TILE_K
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the int4 code of weight (n, k) lies in a tiled buffer of `k_tiles` tiles of `tile_k`
    columns per row block: (byte offset, shift of its nibble), broadcast over n and k (int64)."""
    nl, kl = n % TILE_N, k % tile_k
    b = 8 * (kl >> 4) + (kl & 7)  # the byte of the tile row; its nibble j = bit 3 of k
    nb = [_bit(nl, i) for i in range(7)]
    bb = [_bit(b, i) for i in range(5)]
    if tile_k == TILE_K:  # a [128, 32] byte block: T = (b2, n0, n1, n2, n4, n5, n6), R = (b0, n3, b3, b4, b1)
        t, r = _index([bb[2], nb[0], nb[1], nb[2], nb[4], nb[5], nb[6]]), _index([bb[0], nb[3], bb[3], bb[4], bb[1]])
    else:  # a [128, 16] block: T = (b1, b2, n0, n1, n2, n4, n5), R = (b0, n3, b3, n6)
        t, r = _index([bb[1], bb[2], nb[0], nb[1], nb[2], nb[4], nb[5]]), _index([bb[0], nb[3], bb[3], nb[6]])
    row = tile_k // 2
    return ((n // TILE_N) * k_tiles + k // tile_k) * (TILE_N * row) + t * row + r, 4 * _bit(kl, 3)


def int8_offsets(n: torch.Tensor, k: torch.Tensor, k_tiles: int, tile_k: int = TILE_K) -> torch.Tensor:
    """Where the int8 code of weight (n, k) lies in a tiled buffer (byte offset, int64)."""
    nl, kl = n % TILE_N, k % tile_k
    nb = [_bit(nl, i) for i in range(7)]
    kb = [_bit(kl, i) for i in range(6)]
    if tile_k == TILE_K:  # [128, 64]: T = (n0, n1, n2, n4, n5, k5, n6), R = (k0, n3, k3, k4, k1, k2)
        t, r = _index([nb[0], nb[1], nb[2], nb[4], nb[5], kb[5], nb[6]]), _index([kb[0], nb[3], kb[3], kb[4], kb[1],
                                                                                  kb[2]])
    else:  # [128, 32]: T = (k2, n0, n1, n2, n4, n5, n6), R = (k0, n3, k3, k4, k1)
        t, r = _index([kb[2], nb[0], nb[1], nb[2], nb[4], nb[5], nb[6]]), _index([kb[0], nb[3], kb[3], kb[4], kb[1]])
    return ((n // TILE_N) * k_tiles + k // tile_k) * (TILE_N * tile_k) + t * tile_k + r


def _grid(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = codes.shape
    return (torch.arange(N, device=codes.device)[:, None], torch.arange(K, device=codes.device)[None, :])


def tile_pack_int4(codes: torch.Tensor, tile_k: int = TILE_K) -> torch.Tensor:
    """codes [Np, Kp] (0..15, whole tiles) → uint8 [Np/128, Kp/tile_k, bytes], each tile in the order
    the kernel loads it."""
    Np, Kp = codes.shape
    off, shift = int4_offsets(*_grid(codes), Kp // tile_k, tile_k)
    buf = torch.zeros(Np * Kp // 2, dtype=torch.int32, device=codes.device)
    buf.scatter_add_(0, off.flatten(), (codes.to(torch.int32) << shift.to(torch.int32)).flatten())  # each nibble once
    return buf.to(torch.uint8).reshape(Np // TILE_N, Kp // tile_k, tile_bytes(4, tile_k))


def tile_pack_int8(codes: torch.Tensor, tile_k: int = TILE_K) -> torch.Tensor:
    """codes int8 [Np, Kp] (whole tiles) → int8 [Np/128, Kp/tile_k, bytes] in load order."""
    Np, Kp = codes.shape
    buf = torch.empty(Np * Kp, dtype=torch.int8, device=codes.device)
    buf[int8_offsets(*_grid(codes), Kp // tile_k, tile_k).flatten()] = codes.flatten()
    return buf.reshape(Np // TILE_N, Kp // tile_k, tile_bytes(8, tile_k))


def tile_codes(tiles: torch.Tensor, bits: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The codes back from a tiled buffer [Np/128, Kp/tile_k, bytes]: uint8 0..15 (int4) or int8,
    [Np, Kp] or [len(rows), Kp] for some rows only (a gather: embedding lookups)."""
    tn, tk, nbytes = tiles.shape
    tile_k = nbytes * 8 // (TILE_N * bits)
    n = torch.arange(tn * TILE_N, device=tiles.device) if rows is None else rows.to(tiles.device, torch.int64)
    k = torch.arange(tk * tile_k, device=tiles.device)[None, :]
    flat = tiles.reshape(-1)
    if bits == 4:
        off, shift = int4_offsets(n[:, None], k, tk, tile_k)
        return ((flat[off].to(torch.int32) >> shift) & 0xF).to(torch.uint8)
    return flat[int8_offsets(n[:, None], k, tk, tile_k)]


# PTX, one 32-bit register of 4 codes' bytes in ($4 int4 / $2 int8), fp16/bf16 pairs out. int4:
# $0 $1 the low nibbles of bytes (0, 1) and (2, 3), $2 $3 their high nibbles; int8: $0 $1 bytes
# (0, 1) and (2, 3). Magic constants: fp16 1024 = 0x6400, 1/16 = 0x2c00, -64 = 0xd400, -72 = 0xd480,
# 1152 = 0x6480; bf16 1.0 = 0x3f80, -128 = 0xc300, -136 = 0xc308.
_INT4_F16 = """{{
    .reg .b32 t0, t1, m, sc, of;
    mov.b32 m, {sub};
    mov.b32 sc, 0x2c002c00;
    mov.b32 of, {off};
    prmt.b32 t0, $4, 0, 0x7170;
    prmt.b32 t1, $4, 0, 0x7372;
    lop3.b32 $0, t0, 0x000f000f, 0x64006400, 0xea;
    lop3.b32 $1, t1, 0x000f000f, 0x64006400, 0xea;
    lop3.b32 $2, t0, 0x00f000f0, 0x64006400, 0xea;
    lop3.b32 $3, t1, 0x00f000f0, 0x64006400, 0xea;
    sub.f16x2 $0, $0, m;
    sub.f16x2 $1, $1, m;
    fma.rn.f16x2 $2, $2, sc, of;
    fma.rn.f16x2 $3, $3, sc, of;
}}"""
_INT4_BF16 = """{{
    .reg .b32 t0, t1, s0, s1, one, of;
    mov.b32 one, 0x3f803f80;
    mov.b32 of, {off};
    prmt.b32 t0, $4, 0, 0x7170;
    prmt.b32 t1, $4, 0, 0x7372;
    shr.u32 s0, t0, 4;
    shr.u32 s1, t1, 4;
    lop3.b32 $0, t0, 0x000f000f, 0x43004300, 0xea;
    lop3.b32 $1, t1, 0x000f000f, 0x43004300, 0xea;
    lop3.b32 $2, s0, 0x000f000f, 0x43004300, 0xea;
    lop3.b32 $3, s1, 0x000f000f, 0x43004300, 0xea;
    fma.rn.bf16x2 $0, $0, one, of;
    fma.rn.bf16x2 $1, $1, one, of;
    fma.rn.bf16x2 $2, $2, one, of;
    fma.rn.bf16x2 $3, $3, one, of;
}}"""
_INT8_F16 = """{
    .reg .b32 u, m, of;
    mov.b32 m, 0x64646464;
    mov.b32 of, 0x64806480;
    xor.b32 u, $2, 0x80808080;
    prmt.b32 $0, u, m, 0x7170;
    prmt.b32 $1, u, m, 0x7372;
    sub.f16x2 $0, $0, of;
    sub.f16x2 $1, $1, of;
}"""
# bf16 has no mantissa wide enough for 0..255 at ulp 1: fp32's magic 2^23 (0x4b000000), then a pair
# rounded (exactly: |q| <= 128) to bf16x2.
_INT8_BF16 = """{
    .reg .b32 u, m, f0, f1, f2, f3;
    .reg .f32 g0, g1, g2, g3, of;
    mov.b32 m, 0x4b000000;
    mov.b32 of, 0xcb000080;
    xor.b32 u, $2, 0x80808080;
    prmt.b32 f0, u, m, 0x7650;
    prmt.b32 f1, u, m, 0x7651;
    prmt.b32 f2, u, m, 0x7652;
    prmt.b32 f3, u, m, 0x7653;
    add.f32 g0, f0, of;
    add.f32 g1, f1, of;
    add.f32 g2, f2, of;
    add.f32 g3, f3, of;
    cvt.rn.bf16x2.f32 $0, g1, g0;
    cvt.rn.bf16x2.f32 $1, g3, g2;
}"""

# PTX per (bits, x dtype, symmetric), as constexprs a jit function may read
INT4_F16 = tl.constexpr(_INT4_F16.format(sub="0x64006400", off="0xd400d400"))
INT4_F16_SYM = tl.constexpr(_INT4_F16.format(sub="0x64086408", off="0xd480d480"))
INT4_BF16 = tl.constexpr(_INT4_BF16.format(off="0xc300c300"))
INT4_BF16_SYM = tl.constexpr(_INT4_BF16.format(off="0xc308c308"))
INT8_F16 = tl.constexpr(_INT8_F16)
INT8_BF16 = tl.constexpr(_INT8_BF16)


@triton.jit
def load_int4_tile(q_ptr, tile, SYM: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr, TK: tl.constexpr):
    """Tile `tile` of an int4 weight → its values [128, TK] in DTYPE (codes u, or u - 8 when SYM):
    row n, column k, as `tile_pack_int4` laid them."""
    t = tl.arange(0, 128)
    r = tl.arange(0, TK // 2)
    mem = tl.load(q_ptr + tile.to(tl.int64) * (64 * TK) + t[:, None] * (TK // 2) + r[None, :],
                  eviction_policy="evict_first")  # [128, TK/2] uint8, 16 bytes per load
    if TK == 64:
        mem = mem.reshape(8, 8, 4, 4, 2, 2)  # n6n5n4, n2n1n0, b2b1, b4b3, n3, b0
        b = mem.trans(0, 4, 1, 3, 2, 5).reshape(128, 32)  # [n, b]
    else:
        mem = mem.reshape(4, 8, 4, 2, 2, 2, 2)  # n5n4, n2n1n0, b2b1, n6, b3, n3, b0
        b = mem.trans(3, 0, 5, 1, 4, 2, 6).reshape(128, 16)  # [n, b]
    if ASM:
        if DTYPE == tl.float16 and SYM:
            lo, hi = tl.inline_asm_elementwise(INT4_F16_SYM, "=r,=r,=r,=r,r", [b], (tl.float16, tl.float16), True, 4)
        elif DTYPE == tl.float16:
            lo, hi = tl.inline_asm_elementwise(INT4_F16, "=r,=r,=r,=r,r", [b], (tl.float16, tl.float16), True, 4)
        elif SYM:
            lo, hi = tl.inline_asm_elementwise(INT4_BF16_SYM, "=r,=r,=r,=r,r", [b], (tl.bfloat16, tl.bfloat16), True,
                                               4)
        else:
            lo, hi = tl.inline_asm_elementwise(INT4_BF16, "=r,=r,=r,=r,r", [b], (tl.bfloat16, tl.bfloat16), True, 4)
    else:  # via fp32: the interpreter casts integers to bf16 wrongly
        off = 8.0 if SYM else 0.0
        lo = ((b & 0xF).to(tl.float32) - off).to(DTYPE)
        hi = ((b >> 4).to(tl.float32) - off).to(DTYPE)
    a = tl.join(lo, hi)  # [128, TK/2, 2]: [n, b, j]
    return a.reshape(128, TK // 16, 8, 2).trans(0, 1, 3, 2).reshape(128, TK)  # k = 16 (b >> 3) + 8 j + (b & 7)


@triton.jit
def load_int8_tile(q_ptr, tile, DTYPE: tl.constexpr, ASM: tl.constexpr, TK: tl.constexpr):
    """Tile `tile` of an int8 weight → its codes [128, TK] in DTYPE, as `tile_pack_int8` laid them."""
    t = tl.arange(0, 128)
    r = tl.arange(0, TK)
    mem = tl.load(q_ptr + tile.to(tl.int64) * (128 * TK) + t[:, None] * TK + r[None, :],
                  eviction_policy="evict_first")  # [128, TK] int8
    if TK == 64:
        mem = mem.reshape(2, 2, 4, 8, 4, 4, 2, 2)  # n6, k5, n5n4, n2n1n0, k2k1, k4k3, n3, k0
        q = mem.trans(0, 2, 6, 3, 1, 5, 4, 7).reshape(128, 64)  # [n, k]
    else:
        mem = mem.reshape(8, 8, 4, 4, 2, 2)  # n6n5n4, n2n1n0, k2k1, k4k3, n3, k0
        q = mem.trans(0, 4, 1, 3, 2, 5).reshape(128, 32)  # [n, k]
    if ASM and DTYPE == tl.float16:
        v = tl.inline_asm_elementwise(INT8_F16, "=r,=r,r", [q], tl.float16, True, 4)
    elif ASM:
        v = tl.inline_asm_elementwise(INT8_BF16, "=r,=r,r", [q], tl.bfloat16, True, 4)
    else:
        v = q.to(tl.float32).to(DTYPE)
    return v
