"""The tensor-core operand tile of the GPU weight-only matmul (kernels/wq_mm.py): how a 128-row x
64-column block of quantized weights lies in memory so that each thread's 16-byte loads hold exactly
the codes its part of the MMA's A operand needs, and how those codes become fp16/bf16 in registers.

The matmul is swapped, y^T[N, M] = W[N, K] @ x^T[K, M], so the weights are the dot's left operand,
which Hopper's wgmma (and Ampere's mma) take from registers. Triton gives that operand, for a
[128, 64] fp16 tile over 4 warps, the linear layout (bits of the row n and the column k each come
from one bit of the register, lane or warp index):

    register bits  k0 n3 k3 k4 k5 n6      (a 32-bit register holds the pair k, k+1)
    lane bits      k1 k2 n0 n1 n2
    warp bits      n4 n5

A tile is stored so that a plain coalesced load — [128, 16] 16-bit words for int4 (16 bytes, then a
second lane, per thread), [128, 64] bytes for int8 — lands in registers in exactly that layout after
a reshape and a transpose that only rename bits (no data moves). Nothing is converted through
shared memory: tests/bench/sass_count.py counts the loop. Groups of 32 (or an odd multiple) use the
same 64-column tiles; the kernel splits a tile's two halves apart in the dot, not in registers.

int4: 16-bit word u of a tile row holds four codes, nibble j (bits 4j .. 4j + 3) being column
k = 32 u3 + 16 j1 + 8 j0 + (u & 7) (u3, j1, j0: bits of u and j). In memory, row T and word R of
the loaded [128, 16] block hold the tile's (n, k) with, bit for bit,
    T = (k2, n0, n1, n2, n4, n5, n6),  R = (k0, n3, k5, k1)   (least significant first),
so a 32-bit register holds the words of columns k and k + 1, and nibble j of both words decodes
into one fp16/bf16 pair: codes (0, 4) of the register, (1, 5), (2, 6), (3, 7).
int8: the code of (n, k) itself, with
    T = (n0, n1, n2, n4, n5, k5, n6),  R = (k0, n3, k3, k4, k1, k2).

Codes to floats, two per 32-bit instruction (the magic-number trick of FasterTransformer/Marlin):
OR a code into the mantissa of 1024 (fp16 0x6400, ulp 1) or 128 (bf16 0x4300), which gives
1024 + c / 128 + c exactly. fp16 then subtracts the magic (and 8 for symmetric int4), and its 10-bit
mantissa also takes the nibble above in place (1024 + 16 c), scaled back by one fma with 1/16, so a
register's 8 codes cost one shift, 4 lop3 and 4 f16x2 ops. bf16's 7 bits do not take the nibble
above, so bf16 shifts for each nibble (3 shifts, 4 lop3) and keeps the magic: a bf16 tile holds
u + 128, the weight's integer plus `int4_tile_bias` (128, or 136 symmetric), which the matmul
takes back off inside each dot (kernels/wq_mm.py) — 4 instructions a word fewer than subtracting
here. int8 codes q become q + 128 (xor 0x80) under the magic byte. On CUDA the decode is PTX
(`tl.inline_asm_elementwise`, elementwise over the 16-bit words); elsewhere (the interpreter) the
same values by integer ops, and the fp32 exact path widens the codes directly.
"""

from __future__ import annotations

import torch

from lowbit.kernels.triton_import import tl, triton

TILE_N = 128  # weight rows (output features) per tile: two 64-row wgmma blocks over 4 warps
TILE_K = 64  # columns (input features) per tile
TILE_WARPS = 4  # the layouts here are the operand layout of a 4-warp program


def tile_bytes(bits: int) -> int:
    return TILE_N * TILE_K * bits // 8


def padded(n: int, k: int) -> tuple[int, int]:
    """A weight's [N, K] rounded up to whole tiles."""
    return triton.cdiv(n, TILE_N) * TILE_N, triton.cdiv(k, TILE_K) * TILE_K


def _bit(x: torch.Tensor, i: int) -> torch.Tensor:
    return (x >> i) & 1


def _index(bits: list[torch.Tensor]) -> torch.Tensor:
    """Bits, least significant first → the number."""
    return sum(b << i for i, b in enumerate(bits))


def int4_offsets(n: torch.Tensor, k: torch.Tensor, k_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the int4 code of weight (n, k) lies in a tiled buffer of `k_tiles` tiles per row block:
    (byte offset, shift of its nibble in that byte), broadcast over n and k (int64)."""
    nl, kl = n % TILE_N, k % TILE_K
    nb = [_bit(nl, i) for i in range(7)]
    kb = [_bit(kl, i) for i in range(6)]
    t = _index([kb[2], nb[0], nb[1], nb[2], nb[4], nb[5], nb[6]])  # T = (k2, n0, n1, n2, n4, n5, n6)
    r = _index([kb[0], nb[3], kb[5], kb[1]])  # R = (k0, n3, k5, k1)
    word = ((n // TILE_N) * k_tiles + k // TILE_K) * (TILE_N * 16) + t * 16 + r  # 16-bit words
    return 2 * word + kb[4], 4 * kb[3]  # nibble j = (k3, k4): byte j1 of the word, nibble j0 of it


def int8_offsets(n: torch.Tensor, k: torch.Tensor, k_tiles: int) -> torch.Tensor:
    """Where the int8 code of weight (n, k) lies in a tiled buffer (byte offset, int64)."""
    nl, kl = n % TILE_N, k % TILE_K
    nb = [_bit(nl, i) for i in range(7)]
    kb = [_bit(kl, i) for i in range(6)]
    t = _index([nb[0], nb[1], nb[2], nb[4], nb[5], kb[5], nb[6]])  # T = (n0, n1, n2, n4, n5, k5, n6)
    r = _index([kb[0], nb[3], kb[3], kb[4], kb[1], kb[2]])  # R = (k0, n3, k3, k4, k1, k2)
    return ((n // TILE_N) * k_tiles + k // TILE_K) * (TILE_N * TILE_K) + t * TILE_K + r


def _grid(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = codes.shape
    return (torch.arange(N, device=codes.device)[:, None], torch.arange(K, device=codes.device)[None, :])


def tile_pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [Np, Kp] (0..15, whole tiles) → uint8 [Np/128, Kp/64, bytes], each tile in the order
    the kernel loads it."""
    Np, Kp = codes.shape
    off, shift = int4_offsets(*_grid(codes), Kp // TILE_K)
    buf = torch.zeros(Np * Kp // 2, dtype=torch.int32, device=codes.device)
    buf.scatter_add_(0, off.flatten(), (codes.to(torch.int32) << shift.to(torch.int32)).flatten())  # each nibble once
    return buf.to(torch.uint8).reshape(Np // TILE_N, Kp // TILE_K, tile_bytes(4))


def tile_pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """codes int8 [Np, Kp] (whole tiles) → int8 [Np/128, Kp/64, bytes] in load order."""
    Np, Kp = codes.shape
    buf = torch.empty(Np * Kp, dtype=torch.int8, device=codes.device)
    buf[int8_offsets(*_grid(codes), Kp // TILE_K).flatten()] = codes.flatten()
    return buf.reshape(Np // TILE_N, Kp // TILE_K, tile_bytes(8))


def tile_codes(tiles: torch.Tensor, bits: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The codes back from a tiled buffer [Np/128, Kp/64, bytes]: uint8 0..15 (int4) or int8,
    [Np, Kp] or [len(rows), Kp] for some rows only (a gather: embedding lookups)."""
    tn, tk, _ = tiles.shape
    n = torch.arange(tn * TILE_N, device=tiles.device) if rows is None else rows.to(tiles.device, torch.int64)
    k = torch.arange(tk * TILE_K, device=tiles.device)[None, :]
    flat = tiles.reshape(-1)
    if bits == 4:
        off, shift = int4_offsets(n[:, None], k, tk)
        return ((flat[off].to(torch.int32) >> shift) & 0xF).to(torch.uint8)
    return flat[int8_offsets(n[:, None], k, tk)]


# PTX, one 32-bit register in ($4 int4: two 16-bit words of 4 codes each; $2 int8: 4 codes' bytes),
# fp16/bf16 pairs out. int4: $j the pair of nibble j of word 0 (low half) and of word 1 (high half);
# int8: $0 $1 bytes (0, 1) and (2, 3). Magic constants: fp16 1024 = 0x6400, 1/16 = 0x2c00,
# -64 = 0xd400, -72 = 0xd480, 1152 = 0x6480; bf16 128 = 0x4300 (its values stay biased).
_INT4_F16 = """{{
    .reg .b32 t, m, sc, of;
    mov.b32 m, {sub};
    mov.b32 sc, 0x2c002c00;
    mov.b32 of, {off};
    shr.u32 t, $4, 8;
    lop3.b32 $0, $4, 0x000f000f, 0x64006400, 0xea;
    lop3.b32 $1, $4, 0x00f000f0, 0x64006400, 0xea;
    lop3.b32 $2, t, 0x000f000f, 0x64006400, 0xea;
    lop3.b32 $3, t, 0x00f000f0, 0x64006400, 0xea;
    sub.f16x2 $0, $0, m;
    fma.rn.f16x2 $1, $1, sc, of;
    sub.f16x2 $2, $2, m;
    fma.rn.f16x2 $3, $3, sc, of;
}}"""
_INT4_BF16 = """{
    .reg .b32 s1, s2, s3;
    shr.u32 s1, $4, 4;
    shr.u32 s2, $4, 8;
    shr.u32 s3, $4, 12;
    lop3.b32 $0, $4, 0x000f000f, 0x43004300, 0xea;
    lop3.b32 $1, s1, 0x000f000f, 0x43004300, 0xea;
    lop3.b32 $2, s2, 0x000f000f, 0x43004300, 0xea;
    lop3.b32 $3, s3, 0x000f000f, 0x43004300, 0xea;
}"""
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
INT4_BF16 = tl.constexpr(_INT4_BF16)
INT8_F16 = tl.constexpr(_INT8_F16)
INT8_BF16 = tl.constexpr(_INT8_BF16)


@triton.constexpr_function
def int4_tile_bias(dtype, sym):
    """What an int4 tile in `dtype` holds above the weight's integer u (u - 8 when `sym`): bf16 keeps
    the magic, u + 128, so 128 (136 symmetric); fp16 and fp32 nothing."""
    return (136 if sym else 128) if dtype == tl.bfloat16 else 0


@triton.jit
def load_int4_tile(q_ptr, tile, SYM: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """Tile `tile` of an int4 weight → its values [128, 64] in DTYPE, row n, column k, as
    `tile_pack_int4` laid them: the weight's integers u (u - 8 when SYM) plus int4_tile_bias(DTYPE,
    SYM) — bf16 u + 128 either way (the caller takes the bias off)."""
    t = tl.arange(0, 128)
    r = tl.arange(0, 16)
    words = q_ptr.to(tl.pointer_type(tl.uint16))
    mem = tl.load(words + tile.to(tl.int64) * 2048 + t[:, None] * 16 + r[None, :],
                  eviction_policy="evict_first")  # [128, 16] 16-bit words, 16 bytes per load
    mem = mem.reshape(2, 2, 2, 8, 2, 2, 2, 2, 2)  # n6, n5, n4, n2n1n0, k2, k1, k5, n3, k0
    u = mem.trans(0, 1, 2, 7, 3, 6, 4, 5, 8).reshape(128, 16)  # [n, (k5 k2 k1 k0)]
    if ASM:
        if DTYPE == tl.float16 and SYM:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(INT4_F16_SYM, "=r,=r,=r,=r,r", [u], (tl.float16,) * 4, True, 2)
        elif DTYPE == tl.float16:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(INT4_F16, "=r,=r,=r,=r,r", [u], (tl.float16,) * 4, True, 2)
        else:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(INT4_BF16, "=r,=r,=r,=r,r", [u], (tl.bfloat16,) * 4, True, 2)
    else:  # via fp32: the interpreter casts integers to bf16 wrongly
        off = (8 if SYM else 0) - int4_tile_bias(DTYPE, SYM)
        c0 = ((u & 0xF).to(tl.float32) - off).to(DTYPE)
        c1 = (((u >> 4) & 0xF).to(tl.float32) - off).to(DTYPE)
        c2 = (((u >> 8) & 0xF).to(tl.float32) - off).to(DTYPE)
        c3 = ((u >> 12).to(tl.float32) - off).to(DTYPE)
    a = tl.join(tl.join(c0, c1), tl.join(c2, c3))  # [128, 16, 2, 2]: [n, u, j0, j1]
    a = a.reshape(128, 2, 8, 2, 2).trans(0, 1, 4, 3, 2)  # n, k5, k4 (j1), k3 (j0), k2k1k0
    return a.reshape(128, 64)


@triton.jit
def load_int8_tile(q_ptr, tile, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """Tile `tile` of an int8 weight → its codes [128, 64] in DTYPE, as `tile_pack_int8` laid them."""
    t = tl.arange(0, 128)
    r = tl.arange(0, 64)
    mem = tl.load(q_ptr + tile.to(tl.int64) * 8192 + t[:, None] * 64 + r[None, :],
                  eviction_policy="evict_first")  # [128, 64] int8
    mem = mem.reshape(2, 2, 4, 8, 4, 4, 2, 2)  # n6, k5, n5n4, n2n1n0, k2k1, k4k3, n3, k0
    q = mem.trans(0, 2, 6, 3, 1, 5, 4, 7).reshape(128, 64)  # [n, k]
    if ASM and DTYPE == tl.float16:
        v = tl.inline_asm_elementwise(INT8_F16, "=r,=r,r", [q], tl.float16, True, 4)
    elif ASM:
        v = tl.inline_asm_elementwise(INT8_BF16, "=r,=r,r", [q], tl.bfloat16, True, 4)
    else:
        v = q.to(tl.float32).to(DTYPE)
    return v
