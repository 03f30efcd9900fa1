"""GGML's K-quant, 5-bit and MXFP4 blocks (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, MXFP4) repacked at load into lowbit's tiles
(kind 4 of kernels/cpu_kernels.h) and multiplied by integer dot products (kernels/cpu_kq_tiles.c):
y[M, N] = x[M, K] @ dequant(W)[N, K]^T.

Why repack: as the file stores them (kernels/ggml_mm.py, a row kernel) every 32 weights cost ~28
instructions, three times the int4 tiles', and at 8B decode was compute-bound at 28% of the memory's
speed; in 16-row tiles one 64-byte load of codes serves 16 rows x 8 k, as for int4 (kernels/int4_mm.py).

The layout (nothing is requantized; bytes held = the file's, Q6_K's header padded to a line: 1.0095x;
MXFP4 at 4.25 bits a weight as its file, plus 32 bytes per 16 rows where K / 64 is odd, e.g. gpt-oss's
K = 2880: 1.0013x):

    tiles of 16 output rows (N padded with zero weights), per group — a super-block of 256 k (Q4_K,
    Q5_K, Q6_K), a block of 32 (Q5_0, Q5_1) or two (MXFP4: 16 exponent bytes per block would not fill
    the 32 bytes a header shares a line with) — its header, then its blocks of 32 k:
      header  Q4_K, Q5_K  d fp16 [16] | dmin fp16 [16] | the 12 packed scale bytes, byte i of the 16 rows
                          together (i = 0..11: 6-bit scale and min per 32, GGUF's packing)       256 B
              Q6_K        d fp16 [16] | int8 scale per 16 k: sub-block s of the 16 rows together | 32 zero  320 B
              Q5_0        d fp16 [16]                                                            32 B
              Q5_1        d fp16 [16] | m fp16 [16]                                              64 B
              MXFP4       E8M0 exponent byte of block b of the group, the 16 rows together (16 b + r) 32 B
      block   4 x 64 B of low nibbles, byte [j][r][i] = u[r][8j + i] & 15 | (u[r][8j + 4 + i] & 15) << 4
              (int4's quad order), then the high bits of the codes u (unsigned: 4, 5, 6 bits):
              5-bit: 64 B, byte [r][i] bit 2j + h = bit 4 of the code in nibble h of byte [j][r][i]
              6-bit: 2 x 64 B, bits 4-5 of that code at bits 2v, 2v + 1 of byte [r][i] of the first
                     (v = 2j + h < 4) or the second (v - 4) plane
              MXFP4: none; its nibbles u are indices into its codebook KVM (kernels/ggml_blocks.py)
    (kernels/tile_layout.py: a header of 32 bytes shares a line with the next group's, as Q4_0's scales)

The weights, as gguf computes them (kernels/ggml_blocks.py), with a = d sc, b = dmin m (exact fp32):
Q4_K / Q5_K w = a u - b per 32; Q6_K w = a (u - 32) per 16; Q5_0 w = d (u - 16); Q5_1 w = d u + m;
MXFP4 w = a KVM[u] per 32, a = 2^(e - 128) (fp32, from the exponent's bits: never rounded through fp16).

Two paths, as for int4 (kernels/int4_mm.py): fast — lowbit's C kernels, activations rounded per block of
32 to 16-bit codes (kernels/act_quant.py), exact integer sums, one fp32 epilogue (`kq_mm_fast_ref` is
its spec bit for bit, at every M and on every instruction set); exact — rows dequantized in fp32 by C
(bit for bit gguf's) in ranges, then torch's fp32 GEMM. The tiles exist only where the C kernels do:
without them a GGML-block weight stays in the file's blocks (kernels/ggml_mm.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.nn.functional as F

from lowbit.kernels import cpu_native
from lowbit.kernels.act_quant import BLOCK, act_quant_ref
from lowbit.kernels.exact_mm import exact_linear, in_tiles, takes_exact
from lowbit.kernels.ggml_blocks import BLOCKS, KVALUES_MXFP4, MXFP4, check_rows, e8m0_half, ggml_dequant_ref
from lowbit.kernels.tile_layout import TILE, pack_tiles, tile_bytes

Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 = 12, 13, 14, 6, 7
# type → (values per group, header bytes, code bytes per block of 32, code bits)
KQ_TYPES = MappingProxyType({Q4_K: (256, 256, 256, 4), Q5_K: (256, 256, 320, 5), Q6_K: (256, 320, 384, 6),
                             Q5_0: (32, 32, 320, 5), Q5_1: (32, 64, 320, 5), MXFP4: (64, 32, 256, 4)})


@dataclass
class KqPacked:
    data: torch.Tensor  # uint8 [N/16, tile bytes] (module docstring)
    qtype: int
    out_features: int  # N before padding to 16 rows
    in_features: int  # K (whole groups)
    native: object = field(default=None, repr=False, compare=False)  # the C kernels that multiply it
    desc: object = field(default=None, repr=False, compare=False)  # their descriptor, built once

    @property
    def padded_shape(self) -> tuple[int, int]:
        return self.data.shape[0] * TILE, self.in_features

    def c_desc(self) -> "cpu_native._Linear":
        if self.desc is None:
            Np, K = self.padded_shape
            self.desc = cpu_native._Linear(4, Np, K, KQ_TYPES[self.qtype][0], self.qtype, self.data.data_ptr(), None)
        return self.desc

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """fp32 [stop - start, K] of rows start..stop-1 (< N), bit for bit kernels/ggml_blocks.py."""
        return self.native.kq_dequant(self.c_desc(), start, stop)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [n, K] of rows ids (the embedding lookup), decoded from the tiles."""
        return self.native.kq_rows(self.c_desc(), ids)


def tiles_pack_rows(parts: list, qtype: int, in_features: int, tile_size: int, native) -> tuple[torch.Tensor, int]:
    """Weights of one GGML type stacked along N (each but the last whole 16-row tiles) → (their tiles
    uint8 [ceil(N / 16), tile_size], N), each packed straight into its tiles by C
    (NativeKernels.tiles_pack): uint8 [n, row bytes] rows in memory, or rows still in a file
    (runtime/load/gguf.py TensorRows: `path`, `offset`, `N`, `perm`), or a source that packs itself into its
    tiles (`pack_tiles`: runtime/load/expert_tiles.py, an expert packed with its neighbours in one call)."""
    sizes = [b.shape[0] if isinstance(b, torch.Tensor) else b.N for b in parts]
    for b in parts:
        if isinstance(b, torch.Tensor):
            check_rows(b, qtype, in_features)
    if any(n % TILE for n in sizes[:-1]):
        raise ValueError(f"tiles_pack_rows: stacked weights before the last must be whole {TILE}-row tiles")
    out = torch.empty(-(-sum(sizes) // TILE), tile_size, dtype=torch.uint8)
    t = 0
    for b, rows in zip(parts, sizes):
        n = -(-rows // TILE)
        if hasattr(b, "pack_tiles"):
            b.pack_tiles(qtype, in_features, out[t:t + n], native)
        else:
            native.tiles_pack(qtype, b.contiguous() if isinstance(b, torch.Tensor) else b, rows, in_features,
                              out[t:t + n])
        t += n
    return out, sum(sizes)


def kq_pack(blocks, qtype: int, in_features: int, *, native) -> KqPacked:
    """A weight's rows as GGUF stores them (uint8 [N, row bytes]) → lowbit's tiles, in C; a list: weights
    stacked along N (tiles_pack_rows says what each may be)."""
    group, hb, bb, _ = KQ_TYPES[qtype]
    size = tile_bytes(in_features // group, hb, group // 32 * bb)
    out, N = tiles_pack_rows(blocks if isinstance(blocks, list) else [blocks], qtype, in_features, size, native)
    return KqPacked(out, qtype, N, in_features, native)


def kq_mm(x: torch.Tensor, w: KqPacked, exact: bool | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype) → y fp32 [M, N]: exact when `exact` is True, else the C kernels."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"kq_mm: input {tuple(x.shape)} for K={w.in_features}")
    x = x.float()
    N = w.out_features
    if takes_exact(exact) or x.shape[0] == 0:
        return in_tiles(N, w.in_features, lambda a, b: exact_linear(x, w.dequantize_rows(a, b)))
    y = w.native.linear_mm(x, w.c_desc())
    return y[:, :N] if y.shape[1] != N else y


# ---- the spec: the layout from the file's blocks, and the fast path's arithmetic ----

def _bits(b: torch.Tensor, shifts, mask: int) -> torch.Tensor:
    """uint8 [..., n] → [..., len(shifts), n]: (b >> s) & mask for each shift."""
    return torch.stack([(b >> s) & mask for s in shifts], dim=-2)


def kq_fields(blocks: torch.Tensor, qtype: int, K: int) -> dict[str, torch.Tensor]:
    """The file's rows → per row: codes `u` uint8 [N, K] (unsigned) and, per group [N, G]: `d` (fp16 bytes
    [N, G, 2]) and by type `dmin` and `scales` (Q4_K, Q5_K: [N, G, 2], [N, G, 12] packed), `sc` (Q6_K:
    int8 bytes [N, G, 16]), `m` (Q5_1: [N, G, 2]); MXFP4 has no `d`, but `e` (the exponent bytes of the
    group's two blocks: [N, G, 2]), and its `u` are codebook indices."""
    group, (_, qk, nbytes) = KQ_TYPES[qtype][0], BLOCKS[qtype]
    N = blocks.shape[0]
    b = blocks.reshape(N * (K // group), group // qk * nbytes)  # [B, bytes]: one group each
    if qtype in (Q4_K, Q5_K):
        qs = b[:, 48:176] if qtype == Q5_K else b[:, 16:144]
        u = _bits(qs.reshape(-1, 4, 32), [0, 4], 0xF).reshape(-1, 8, 32)  # [B, chunk c x nibble, 32]
        if qtype == Q5_K:
            u = u | (_bits(b[:, 16:48], range(8), 1) << 4)  # bit 2c + h of qh[l]
        f = {"d": b[:, 0:2], "dmin": b[:, 2:4], "scales": b[:, 4:16]}
    elif qtype == Q6_K:
        lo = _bits(b[:, 0:128].reshape(-1, 2, 64), [0, 4], 0xF).reshape(-1, 8, 32)
        hi = _bits(b[:, 128:192].reshape(-1, 2, 32), [0, 2, 4, 6], 3).reshape(-1, 8, 32)
        u = lo | (hi << 4)
        f = {"d": b[:, 208:210], "sc": b[:, 192:208]}
    elif qtype == MXFP4:  # two blocks of e, qs[16] (element j low nibble, j + 16 high)
        u = _bits(b.reshape(-1, 2, 17)[:, :, 1:], [0, 4], 0xF).reshape(-1, 64)  # [B, block x nibble x 16]
        f = {"e": b[:, [0, 17]]}
    else:
        off = 2 if qtype == Q5_0 else 4
        hi = _bits(b[:, off:off + 4], range(8), 1).transpose(1, 2).reshape(-1, 32)  # bit i of the LE u32
        u = _bits(b[:, None, off + 4:off + 20], [0, 4], 0xF).reshape(-1, 32) | (hi << 4)
        f = {"d": b[:, 0:2]} | ({"m": b[:, 2:4]} if qtype == Q5_1 else {})
    G = K // group
    out = {k: v.reshape(N, G, -1) for k, v in f.items()}
    out["u"] = u.reshape(N, K)
    return out


def kq_pack_ref(blocks: torch.Tensor, qtype: int, K: int) -> torch.Tensor:
    """The layout's spec: the file's rows uint8 [N, row bytes] → uint8 [ceil(N / 16), tile bytes], what
    the C repack (cpu_kq.c lowbit_kq_pack) writes, byte for byte."""
    check_rows(blocks, qtype, K)
    group, hb, bb, bits = KQ_TYPES[qtype]
    N = blocks.shape[0]
    Np, G, nb = -(-N // TILE) * TILE, K // group, group // 32
    T = Np // TILE
    f = {k: F.pad(v, [0, 0] * (v.dim() - 1) + [0, Np - N]) for k, v in kq_fields(blocks, qtype, K).items()}

    def by_row(t: torch.Tensor) -> torch.Tensor:  # [Np, G, n] → [T, G, n, 16]: byte n of the 16 rows together
        return t.reshape(T, TILE, G, -1).permute(0, 2, 3, 1)

    if qtype in (Q4_K, Q5_K):
        head = [by_row(f["d"]).transpose(2, 3), by_row(f["dmin"]).transpose(2, 3), by_row(f["scales"])]
    elif qtype == Q6_K:
        head = [by_row(f["d"]).transpose(2, 3), by_row(f["sc"]), torch.zeros(T, G, 32, dtype=torch.uint8)]
    elif qtype == MXFP4:
        head = [by_row(f["e"])]  # [T, G, block, 16]: byte 16 b + r
    else:
        head = [by_row(f["d"]).transpose(2, 3)] + ([by_row(f["m"]).transpose(2, 3)] if qtype == Q5_1 else [])
    header = torch.cat([h.reshape(T, G, -1) for h in head], dim=-1)  # [T, G, hb]
    u = f["u"].reshape(T, TILE, G, nb, 4, 2, 4).permute(0, 2, 3, 4, 1, 6, 5)  # [t, g, block, j, r, i, h]
    parts = [((u[..., 0] & 15) | ((u[..., 1] & 15) << 4)).reshape(T, G, nb, 256)]
    high = (u >> 4).permute(0, 1, 2, 4, 5, 3, 6).reshape(T, G, nb, TILE, 4, 8)  # [t, g, block, r, i, v = 2j + h]
    if bits == 5:
        parts.append((high.to(torch.int32) << torch.arange(8)).sum(-1).to(torch.uint8).reshape(T, G, nb, 64))
    elif bits == 6:
        planes = (high.to(torch.int32) << (2 * (torch.arange(8) % 4))).reshape(T, G, nb, TILE, 4, 2, 4).sum(-1)
        parts.append(planes.permute(0, 1, 2, 5, 3, 4).to(torch.uint8).reshape(T, G, nb, 128))
    codes = torch.cat(parts, dim=-1).reshape(T, G, nb * bb)
    assert header.shape[-1] == hb
    return pack_tiles(header.contiguous(), codes.contiguous())


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] → fp32 [...] (little-endian fp16)."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes [N, G, 12] → 6-bit scales and mins [N, G, 8] (GGUF's get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def kq_mm_fast_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """The fast path's spec, bit for bit: x [M, K] and the file's rows → y fp32 [M, N].

    Per row and block b of 32: q, s = act_quant_ref(x); T = sum u q (exact; per half of 16 for Q6_K),
    S = sum q, sS = s * (float)S; then in k order (a = d sc and b = dmin m per sub-block, exact fp32):
    Q4_K, Q5_K: y = y + (float)T * (a * s); y = y - b * sS. Q5_0: y = y + (float)(T - 16 S) * (d * s).
    Q5_1: y = y + (float)T * (d * s); y = y + m * sS. Q6_K: per half h, y = y + (float)(T_h - 32 S_h) * (a_h * s).
    MXFP4: y = y + (float)T * (a * s), T = sum KVM[u] q (the C kernels' sum (KVM[u] + 16) q - 16 S)."""
    M, K = x.shape
    f = kq_fields(blocks, qtype, K)
    N, group = blocks.shape[0], KQ_TYPES[qtype][0]
    q, s = act_quant_ref(x.float())  # [M, K], [M, B]
    B = K // BLOCK
    per = group // BLOCK
    u = f["u"].long()
    if qtype == MXFP4:  # the codebook's signed codes
        u = torch.tensor(KVALUES_MXFP4, dtype=torch.int64)[u]
    halves = 2 if qtype == Q6_K else 1
    n = BLOCK // halves
    qh = q.view(M, B * halves, n).long()
    T = torch.einsum("mbk,nbk->mnb", qh, u.view(N, B * halves, n))  # [M, N, B * halves]
    S = qh.sum(-1)  # [M, B * halves]
    d = _f16(f["d"]) if "d" in f else None  # [N, G]
    if qtype == MXFP4:
        a = e8m0_half(f["e"]).reshape(N, B)  # [N, B]: 2^(e - 128) per block of 32
    elif qtype in (Q4_K, Q5_K):
        sc, mn = _scale_min(f["scales"])  # [N, G, 8]
        a = (d[..., None] * sc.float()).reshape(N, B)  # [N, B]: per block of 32
        bm = (_f16(f["dmin"])[..., None] * mn.float()).reshape(N, B)
    elif qtype == Q6_K:
        a = (d[..., None] * f["sc"].contiguous().view(torch.int8).float()).reshape(N, 2 * B)  # per 16
    y = torch.zeros(M, N)
    for b in range(B):
        sb = s[:, b:b + 1]  # [M, 1]
        if qtype == Q6_K:
            for h in range(2):
                i = 2 * b + h
                y = y + (T[:, :, i] - 32 * S[:, i:i + 1]).float() * (a[None, :, i] * sb)
            continue
        Sf = S[:, b:b + 1].float()
        if qtype == MXFP4:
            y = y + T[:, :, b].float() * (a[None, :, b] * sb)
        elif qtype in (Q4_K, Q5_K):
            y = y + T[:, :, b].float() * (a[None, :, b] * sb)
            y = y - bm[None, :, b] * (sb * Sf)
        elif qtype == Q5_0:
            y = y + (T[:, :, b] - 16 * S[:, b:b + 1]).float() * (d[None, :, b // per] * sb)
        else:
            y = y + T[:, :, b].float() * (d[None, :, b // per] * sb)
            y = y + _f16(f["m"])[None, :, b // per] * (sb * Sf)
    return y


def kq_dequant_ref(blocks: torch.Tensor, qtype: int, K: int) -> torch.Tensor:
    """The weights' spec: gguf's arithmetic (kernels/ggml_blocks.py)."""
    return ggml_dequant_ref(blocks, qtype, K)
