"""Weight-only quantized matmul on the GPU (Triton): y[M, N] = x[M, K] @ dequant(W)[N, K]^T.

One kernel serves every lowbit layout — int4 symmetric (w = d * (u - 8)) and asymmetric
(w = d * u + m) with groups of any multiple of 32, int8 per group (w = d * q) and per output
channel — for fp16/bf16 activations (and fp32, computed in IEEE fp32, for the exact path), with
fp32 accumulation. From DEQUANT_MIN_ROWS rows (16-bit x and y) the prefill form "dequant" writes a
dequantized copy of W for that call only (4096x4096 in bf16: 32 MiB, freed on return) and hands the
product to cuBLAS.

Layout (`WQPacked`), built once at load time from the loader's row-major layout: the codes in
128 x 64 tiles laid out for the tensor-core operand (kernels/wq_tile.py), so a program's plain
16-byte loads put every code where the MMA reads it — no shared memory, no layout conversion:

    int4  qweight uint8 [Np/128, Kp/64, 4096]   (two codes a byte, four a 16-bit word)
    int8  qweight int8  [Np/128, Kp/64, 8192]
          scales  fp16  [Kp/g, Np] per group (fp32 [1, Np] per channel), mins fp16 [Kp/g, Np]

(Np, Kp: N and K rounded up to whole tiles and groups; the padding holds zero codes and scales.)

The product is swapped, y^T = W x^T: a program owns 128 output features and BLOCK_M rows of x
(16 for decode, all in one tile). Per 64-column tile the codes become fp16/bf16 in registers (two
per instruction, kernels/wq_tile.py) and one dot multiplies them, exact integers, by x; the group
scale factors out of the dot and is applied in fp32 once per group:
acc += (codes @ x^T) * d (+ m * sum(x over the group), for the asymmetric layout; bf16 tiles hold
u + 128, which one more k-step of each dot takes off) — more accurate than dequantizing w to
fp16/bf16 first, which rounds every weight (2^-11 / 2^-8 relative). Groups of 64k columns take
whole 64-column tiles; other multiples of 32 split each tile's dot by 32-column halves (x^T's rows
of each half in columns of their own), each half scaled by its group.

Decode (M <= 16) splits K over the grid so ~2 programs per SM stream the weights once. Each split
writes its fp32 partial sums to a workspace and takes a ticket; the last split of a column tile
adds the partials in split order (deterministic: a row's result does not depend on M or on which
program finished first), writes y and resets its counter for the next call — one launch. The
config, workspace and counters are kept with the weight per row count, so a call (and a CUDA graph
replay) reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from lowbit.kernels.int4_mm import int4_dequant_ref
from lowbit.kernels.int8_mm import int8_dequant_ref
from lowbit.kernels.triton_import import OutOfResources, check_device, interpreting, tl, triton
from lowbit.kernels.wq_tile import (
    TILE_K,
    TILE_N,
    TILE_WARPS,
    int4_tile_bias,
    load_int4_tile,
    load_int8_tile,
    padded,
    tile_codes,
    tile_pack_int4,
    tile_pack_int8,
)

DECODE_MAX_ROWS = 16  # up to this many rows: one row tile, K split over the grid
DEQUANT_MIN_ROWS = 256  # from this many rows (16-bit x and y): dequantize, then cuBLAS
XPREP_COLS = 2048  # columns of a row of x one pre-pass program sums: 64 halves, 2048 / g groups


@dataclass
class WQPacked:
    qweight: torch.Tensor  # int4: uint8 [Np/128, Kp/tk, 64 tk]; int8: int8 [Np/128, Kp/tk, 128 tk]
    scales: torch.Tensor  # fp16 [Kp/g, Np] per group, or fp32 [1, Np] per output channel
    mins: torch.Tensor | None  # fp16 [Kp/g, Np] (int4 asymmetric) or None
    bits: int  # 4 | 8
    group_size: int  # K per scale; Kp when per channel
    in_features: int  # K
    out_features: int  # N
    # per (device, row tile, split count): the fp32 split-K workspace and ticket counters, reused by
    # every call and captured by CUDA graphs (the counters return to 0 after each call)
    workspaces: dict = field(default_factory=dict, repr=False, compare=False)
    # per (device, row bucket, x dtype, y dtype): the LaunchConfig that launched, so a call does not
    # choose (or shrink) again; the buckets are choose_config's, every M <= 16 one of them
    configs: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def padded_in_features(self) -> int:
        return self.qweight.shape[1] * TILE_K

    @property
    def padded_out_features(self) -> int:
        return self.qweight.shape[0] * TILE_N

    @property
    def per_channel(self) -> bool:
        return self.scales.shape[0] == 1 and self.bits == 8 and self.scales.dtype == torch.float32

    def to(self, device) -> "WQPacked":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return WQPacked(move(self.qweight), move(self.scales), move(self.mins), self.bits, self.group_size,
                        self.in_features, self.out_features)


def _pad(t: torch.Tensor, rows: int, cols: int, fill=0) -> torch.Tensor:
    """t [r, c] → [rows, cols], the new entries `fill`."""
    if tuple(t.shape) == (rows, cols):
        return t.contiguous()
    out = torch.full((rows, cols), fill, dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _group_rows(scales: torch.Tensor, group_size: int, Kp: int, Np: int) -> torch.Tensor:
    """[N, G] per-group values → [Kp/g, Np] (g columns a row; the padding's groups 0)."""
    return _pad(scales.t(), triton.cdiv(Kp, group_size), Np)


def wq_pack_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                 in_features: int) -> WQPacked:
    """codes uint8 [N, Kg] (0..15, Kg a whole number of groups), scales/mins fp16 [N, Kg/g]
    (quant/int4.py's layout) → WQPacked."""
    N, Kg = codes.shape
    if Kg % group_size or group_size % 32 or scales.shape != (N, Kg // group_size):
        raise ValueError(f"wq_pack_int4: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} "
                         f"do not form groups of {group_size} (a multiple of 32)")
    Np, Kp = padded(N, Kg)  # groups of 64k: Kp = Kg; others: Kp/g groups rounded up, the last padding
    q = tile_pack_int4(_pad(codes, Np, Kp, 8 if mins is None else 0))  # padding: 0
    return WQPacked(q, _group_rows(scales.half(), group_size, Kp, Np),
                    None if mins is None else _group_rows(mins.half(), group_size, Kp, Np), 4, group_size,
                    in_features, N)


def wq_pack_int8(qweight: torch.Tensor, scales: torch.Tensor, in_features: int) -> WQPacked:
    """qweight int8 [N, Kg], scales fp16 [N, G] or fp32 [N, 1] (quant/int8.py's layout) → WQPacked."""
    N, Kg = qweight.shape
    G = scales.shape[1]
    if scales.shape[0] != N or Kg % G or (G > 1 and (Kg // G) % 32):
        raise ValueError(f"wq_pack_int8: qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} disagree")
    per_channel = G == 1 and scales.dtype == torch.float32
    group = Kg if per_channel else Kg // G
    Np, Kp = padded(N, Kg)
    q = tile_pack_int8(_pad(qweight, Np, Kp))
    s = _pad(scales.t().float(), 1, Np) if per_channel else _group_rows(scales.half(), group, Kp, Np)
    return WQPacked(q, s, None, 8, group, in_features, N)


@triton.jit
def _tile(q_ptr, t, BITS: tl.constexpr, HAS_MIN: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """Weight tile t (row block and K tile in one index) → [128, 64] values in DTYPE."""
    if BITS == 4:
        v = load_int4_tile(q_ptr, t, not HAS_MIN, DTYPE, ASM)
    else:
        v = load_int8_tile(q_ptr, t, DTYPE, ASM)
    return v


@triton.jit
def _x_tile(x_ptr, k0, offs_m, m_ok, K, stride_xm, ROWS: tl.constexpr, DTYPE: tl.constexpr):
    """x^T [ROWS, BM] for columns k0 .. k0 + ROWS - 1 (0 past K and past M)."""
    offs_k = k0 + tl.arange(0, ROWS)
    x = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_ok[None, :] & (offs_k[:, None] < K),
                other=0.0, eviction_policy="evict_last")
    return x.to(DTYPE)


@triton.jit
def _wq_mm_kernel(x_ptr, q_ptr, s_ptr, m_ptr, xs_ptr, xp_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, NP, KT, stride_xm,
                  stride_ym, stride_xs, stride_xp, BITS: tl.constexpr, HAS_MIN: tl.constexpr,
                  PER_CHANNEL: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
                  ASM: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    DTYPE: tl.constexpr = tl.float32 if IEEE else x_ptr.dtype.element_ty
    PREC: tl.constexpr = "ieee" if IEEE else None
    # what the tiles' values exceed the weight's integers by: bf16 int4 tiles hold u + 128, the
    # weight is d * u + m (d * (u - 8) symmetric). Each dot takes it off again inside the MMA, one
    # more k-step against x's sums over its 32-column halves (xp: each sum as three bf16 parts that
    # add up to it exactly): A = -BIAS in the parts' columns (a constant tile), B = the parts. The
    # ~BIAS x sum(x) terms it cancels meet only the MMA's fp32 accumulator, per group, never the
    # scaled sum across groups (tests/test_triton_wq_mm.py measures what that leaves).
    BIAS: tl.constexpr = int4_tile_bias(DTYPE, not HAS_MIN) if BITS == 4 else 0
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * 128 + tl.arange(0, 128)
    m_ok = offs_m < M
    # a chunk of the K loop: one group of 64k columns (its tiles summed before the scale), one
    # 64-column tile per channel, else four 64-column tiles whose 32-column halves are groups
    WHOLE: tl.constexpr = PER_CHANNEL or GROUP % 64 == 0
    TPC: tl.constexpr = GROUP // 64 if (WHOLE and not PER_CHANNEL) else 1  # 64-column tiles per chunk
    CH: tl.constexpr = 64 * TPC if WHOLE else 256  # columns per chunk
    n_chunks = tl.cdiv(K, CH)
    per_split = tl.cdiv(n_chunks, SPLIT_K)
    acc = tl.zeros((128, BLOCK_M), dtype=tl.float32)  # y^T tile
    if not WHOLE:  # x^T split by halves (below): column j is row j // 2 of x, rows of half j % 2 only
        j = tl.arange(0, 2 * BLOCK_M)
        mm = pid_m * BLOCK_M + j // 2
        upper = (tl.arange(0, 64) // 32)[:, None] == (j % 2)[None, :]
        n_rows = tl.cdiv(KT * 64, GROUP)  # scale rows
    if BIAS > 0:
        # the bias step's operands: B [16, columns] takes 4 rows per 32-column half (3 parts and a
        # 0) — a group's halves at once for groups of 64 and 128, else a tile's two (columns (m,
        # half) as x^T's for groups of 32 and odd multiples); A [128, 16] is -BIAS in every row
        PER_GROUP: tl.constexpr = WHOLE and TPC <= 2
        r = tl.arange(0, 16)
        neg_bias = tl.full((128, 16), -BIAS, DTYPE)
        if WHOLE:
            xp_rows = (r < (8 * TPC if PER_GROUP else 8))[:, None] & m_ok[None, :]
            xp_off = offs_m[None, :] * stride_xp + r[:, None]  # + the first half's index x 4
        else:
            xp_rows = (r < 4)[:, None] & (mm < M)[None, :]
            xp_off = mm[None, :] * stride_xp + (j % 2)[None, :] * 4 + r[:, None]  # + the tile's first half x 4
    for c in range(pid_s * per_split, tl.minimum((pid_s + 1) * per_split, n_chunks)):
        if PER_CHANNEL:  # one scale per row, applied at the end
            acc = tl.dot(_tile(q_ptr, pid_n * KT + c, BITS, HAS_MIN, DTYPE, ASM),
                         _x_tile(x_ptr, c * 64, offs_m, m_ok, K, stride_xm, 64, DTYPE), acc, input_precision=PREC)
        elif WHOLE:
            part = tl.zeros((128, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(TPC):
                t = c * TPC + s
                x = _x_tile(x_ptr, t * 64, offs_m, m_ok, K, stride_xm, 64, DTYPE)  # [64, BM]
                part = tl.dot(_tile(q_ptr, pid_n * KT + t, BITS, HAS_MIN, DTYPE, ASM), x, part,
                              input_precision=PREC)
                if BIAS > 0 and not PER_GROUP:  # this tile's two halves (halves past K hold sums of 0)
                    part = tl.dot(neg_bias, tl.load(xp_ptr + xp_off + t * 8, mask=xp_rows, other=0.0), part)
            if BIAS > 0 and PER_GROUP:  # the group's 2 or 4 halves
                part = tl.dot(neg_bias, tl.load(xp_ptr + xp_off + c * (8 * TPC), mask=xp_rows, other=0.0), part)
            acc += part * tl.load(s_ptr + c * NP + offs_n).to(tl.float32)[:, None]
        else:
            # groups of 32 (or an odd multiple): a 64-column tile holds two half-tiles of 32 columns,
            # each all in one group. One dot per tile against x^T split by halves, [64, (m, half)]:
            # column (m, 0) is x row m in the first 32 rows, 0 in the others, (m, 1) the other way
            # round, so the dot's columns are the two halves' sums apart, each then scaled by its
            # own group. A chunk is four tiles (8 halves, 256 columns), its 8 scales loaded at once:
            # longer loads in flight per iteration. Tiles of a last chunk past the final tile read
            # that tile again, against x^T of 0 (past K) and sums of 0: they add 0.
            g8 = tl.minimum((c * 256 + tl.arange(0, 8) * 32) // GROUP, n_rows - 1)
            s8 = tl.load(s_ptr + g8[None, :] * NP + offs_n[:, None]).to(tl.float32)  # [128, 8]: (tile, half)
            e, o = tl.split(s8.reshape(128, 2, 2, 2).permute(0, 3, 1, 2))  # [128, half, t1]
            s0, s2 = tl.split(e)
            s1, s3 = tl.split(o)
            for h in tl.static_range(4):
                kk = c * 256 + h * 64 + tl.arange(0, 64)
                xx = tl.load(x_ptr + mm[None, :] * stride_xm + kk[:, None],
                             mask=upper & (mm < M)[None, :] & (kk < K)[:, None], other=0.0,
                             eviction_policy="evict_last").to(DTYPE)  # [64, 2 BM]
                t = tl.minimum(4 * c + h, KT - 1)
                part = tl.dot(_tile(q_ptr, pid_n * KT + t, BITS, HAS_MIN, DTYPE, ASM), xx,
                              input_precision=PREC)  # [128, 2 BM]
                if BIAS > 0:
                    xp = tl.load(xp_ptr + xp_off + (8 * c + 2 * h) * 4, mask=xp_rows, other=0.0)  # [16, 2 BM]
                    part = tl.dot(neg_bias, xp, part)
                pa, pb = tl.split(part.reshape(128, BLOCK_M, 2))
                sa, sb = tl.split(s0 if h == 0 else (s1 if h == 1 else (s2 if h == 2 else s3)))
                acc += pa * sa[:, None]
                acc += pb * sb[:, None]
    if HAS_MIN:
        # the mins' term, sum over this split's groups g of m[n, g] * xs[g, m] (xs: x summed over
        # each group, once per call), as dots over 16 groups at a time: the fp16 mins are exact in
        # tf32 and the fp32 sums are split in three (tf32x3), so it stays fp32-accurate
        # each group belongs to the split holding its first column
        g_lo = tl.cdiv(pid_s * per_split * CH, GROUP)
        g_hi = tl.minimum(tl.cdiv(tl.minimum((pid_s + 1) * per_split, n_chunks) * CH, GROUP), tl.cdiv(K, GROUP))
        for g0 in range(g_lo, g_hi, 16):
            gs = g0 + tl.arange(0, 16)
            g_ok = gs < g_hi
            mn = tl.load(m_ptr + gs[None, :] * NP + offs_n[:, None], mask=g_ok[None, :], other=0.0)  # [128, 16]
            xs = tl.load(xs_ptr + offs_m[None, :] * stride_xs + gs[:, None], mask=g_ok[:, None] & m_ok[None, :],
                         other=0.0)  # [16, BM] fp32
            acc = tl.dot(mn.to(tl.float32), xs, acc, input_precision="ieee" if IEEE else "tf32x3")
    if PER_CHANNEL:
        acc = acc * tl.load(s_ptr + offs_n)[:, None]  # fp32 [128]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    y_ok = m_ok[None, :] & (offs_n < N)[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)
    else:
        # workspace fp32 [SPLIT_K, grid_m * BM, NP]: this split's partial, then a ticket; the last of
        # the tile's splits sums them in split order
        MP = tl.num_programs(1) * BLOCK_M
        tile_ws = ws_ptr + offs_m[None, :] * NP + offs_n[:, None]
        tl.store(tile_ws + pid_s * MP * NP, acc)
        tl.debug_barrier()  # every thread's partial stored before the ticket is taken
        ticket = tl.atomic_add(cnt_ptr + pid_m * tl.num_programs(0) + pid_n, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            total = tl.load(tile_ws, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(tile_ws + s * MP * NP, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_ok)
            tl.atomic_xchg(cnt_ptr + pid_m * tl.num_programs(0) + pid_n, 0)  # ready for the next call


@triton.jit
def _xprep_kernel(x_ptr, xs_ptr, xp_ptr, K, G, stride_xm, stride_xs, stride_xp, GROUP: tl.constexpr,
                  GROUP_P2: tl.constexpr, SUMS: tl.constexpr, PARTS: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_Q: tl.constexpr):
    """What the matmul needs of x beyond x itself, one launch per call; program (row m, block b):
    SUMS: xs[m, g] = the sum of x[m, k] over group g (fp32), groups b * BLOCK_G .. +BLOCK_G (the
    mins' term). PARTS: xp[m, q, :] = the sum s of x[m, 32 q .. 32 q + 31] (fp32) as three bf16
    parts hi + mid + lo == s exactly (each the rounding of what the ones before left) and a 0, halves
    b * BLOCK_Q .. +BLOCK_Q (the B operand of the bf16 bias step); halves past K get zeros. Every sum
    runs in one fixed order, so a row's values do not depend on how many rows there are."""
    m = tl.program_id(0)
    b = tl.program_id(1)
    if SUMS:
        gs = b * BLOCK_G + tl.arange(0, BLOCK_G)
        j = tl.arange(0, GROUP_P2)  # GROUP rounded up to a power of 2 (groups of 96: 128, 32 masked off)
        k = gs[:, None] * GROUP + j[None, :]  # [BLOCK_G, GROUP_P2]
        x = tl.load(x_ptr + m * stride_xm + k, mask=(j < GROUP)[None, :] & (k < K), other=0.0).to(tl.float32)
        tl.store(xs_ptr + m * stride_xs + gs, tl.sum(x, axis=1), mask=gs < G)
    if PARTS:
        qs = b * BLOCK_Q + tl.arange(0, BLOCK_Q)
        k = qs[:, None] * 32 + tl.arange(0, 32)[None, :]  # [BLOCK_Q, 32]
        s = tl.sum(tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32), axis=1)
        hi = s.to(tl.bfloat16)
        rest = s - hi.to(tl.float32)  # exact in fp32, as is what mid leaves of it
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)  # <= 8 significant bits: exact
        out = xp_ptr + m * stride_xp + qs * 4
        ok = qs * 4 < stride_xp
        tl.store(out, hi, mask=ok)
        tl.store(out + 1, mid, mask=ok)
        tl.store(out + 2, lo, mask=ok)
        tl.store(out + 3, tl.zeros_like(hi), mask=ok)


def xprep_constexprs(group_size: int, sums: bool, parts: bool) -> dict:
    """The pre-pass's compile-time arguments: a program sums XPREP_COLS columns of a row of x, its
    groups over a power-of-2 block masked to the group."""
    g2 = triton.next_power_of_2(group_size)
    return dict(GROUP=group_size, GROUP_P2=g2, SUMS=sums, PARTS=parts, BLOCK_G=max(1, XPREP_COLS // g2),
                BLOCK_Q=XPREP_COLS // 32)


@triton.jit
def _wq_dequant_kernel(q_ptr, s_ptr, m_ptr, w_ptr, NP, KT, BITS: tl.constexpr, HAS_MIN: tl.constexpr,
                       PER_CHANNEL: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr):
    """W^T [Kp, Np] in w's dtype for the prefill path: d * u (+ m) in fp32, rounded once; per channel
    the bare codes (exact), whose scale the caller applies to y. One program per tile of 64 columns."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    DTYPE: tl.constexpr = w_ptr.dtype.element_ty
    BIAS: tl.constexpr = int4_tile_bias(DTYPE, not HAS_MIN) if BITS == 4 else 0
    offs_n = pid_n * 128 + tl.arange(0, 128)
    offs_k = t * 64 + tl.arange(0, 64)
    u = _tile(q_ptr, pid_n * KT + t, BITS, HAS_MIN, DTYPE, ASM).to(tl.float32) - BIAS  # [128, 64]: u (u - 8), exact
    if not PER_CHANNEL:
        g = (offs_k // GROUP)[None, :]
        u = u * tl.load(s_ptr + g * NP + offs_n[:, None]).to(tl.float32)
        if HAS_MIN:
            u = u + tl.load(m_ptr + g * NP + offs_n[:, None]).to(tl.float32)
    tl.store(w_ptr + offs_k[None, :] * NP + offs_n[:, None], u.to(DTYPE))


FORMS = ("mma", "dequant")


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # rows of x per program
    split_k: int = 1  # programs along K (decode)
    num_stages: int = 1  # software pipelining of the K loop (1: direct loads, no shared-memory staging)
    form: str = "mma"  # "mma": the tiled kernel above; "dequant": a W^T copy in x's dtype, then cuBLAS
    block_n: int = TILE_N  # output features per program: the tile's (fixed)
    num_warps: int = TILE_WARPS  # the tile's operand layout is a 4-warp one (fixed)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _smem_limit(device: torch.device) -> int | None:
    """Shared memory one program may use (H200: 232,448 bytes); None off CUDA (the interpreter has no limit)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def smem_estimate(cfg: LaunchConfig, x_bytes: int, bits: int) -> int:
    """Bytes of shared memory a launch needs, on the safe side: the x^T operand tiles of one chunk
    (wgmma reads its B operand from shared memory) and bf16's bias-step operand per pipeline stage,
    two chunks of weight tiles when pipelined, and the fp32 epilogue tile. The weights themselves
    stay in registers."""
    if cfg.form == "dequant":
        return 0
    stage = 2 * TILE_K * cfg.block_m * x_bytes + (2 * TILE_N * TILE_K * bits // 8 if cfg.num_stages > 1 else 0)
    stage += 16 * 2 * cfg.block_m * 2  # bf16's bias step: its B operand, [16, 2 BM] bf16
    return cfg.num_stages * stage + TILE_N * cfg.block_m * 4


def shrink(cfg: LaunchConfig) -> LaunchConfig | None:
    """The next smaller config: fewer stages, then shorter row tiles; None when nothing is left."""
    if cfg.num_stages > 1:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_m > 16:
        return replace(cfg, block_m=cfg.block_m // 2)
    return None


def choose_config(M: int, w: WQPacked, device: torch.device, x_dtype: torch.dtype = torch.float16,
                  out_dtype: torch.dtype | None = None) -> LaunchConfig:
    """Decode (M <= 16): one 16-row tile, K split so that the grid holds ~2 programs per SM (4096x4096
    int4-g128 on 132 SMs: 32 column tiles x 8 splits, 32 KB of weights a program), direct loads
    (sm_90 SASS of the loop, int4-g128 fp16: 14 instructions per packed word with one stage, 20 with
    two, whose cp.async staging goes through shared memory). The split depends only on the weight's
    shape and the device, never on M, so a row's result is the same at every M <= 16. Prefill: 64-row
    tiles; from DEQUANT_MIN_ROWS rows (16-bit x and y) the dequantize-then-cuBLAS form."""
    sixteen_bit = x_dtype != torch.float32 and (out_dtype or x_dtype) == x_dtype
    if M <= DECODE_MAX_ROWS:
        tiles = w.padded_out_features // TILE_N
        chunk = w.group_size if (w.group_size % TILE_K == 0 and not w.per_channel) else TILE_K
        chunks = triton.cdiv(w.in_features, chunk)
        split = max(1, min(chunks, (2 * _sm_count(device)) // tiles))
        cfg = LaunchConfig(16, split)
    elif M >= DEQUANT_MIN_ROWS and sixteen_bit:
        cfg = LaunchConfig(16, form="dequant")
    else:
        cfg = LaunchConfig(64)
    limit = _smem_limit(device)
    while limit is not None and smem_estimate(cfg, x_dtype.itemsize, w.bits) > limit and (smaller := shrink(cfg)):
        cfg = smaller
    return cfg


def _use_asm(x: torch.Tensor) -> bool:
    """The PTX decode: compiled for an NVIDIA GPU with 16-bit activations."""
    return x.device.type == "cuda" and torch.version.hip is None and not interpreting() and x.dtype != torch.float32


def wq_mm(x: torch.Tensor, w: WQPacked, config: LaunchConfig | None = None,
          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] fp16/bf16/fp32 (rows may be strided, K contiguous) → y [M, N] in out_dtype (default:
    x's; the LM head asks for fp32 logits). fp32 x runs the dot in IEEE fp32 (the exact path);
    fp16/bf16 run on tensor cores with fp32 accumulation."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"wq_mm: x has shape {tuple(x.shape)}, expected [M, {w.in_features}]")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"wq_mm: activations must be fp16, bf16 or fp32, not {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    check_device(x, w.qweight, w.scales, w.mins)
    if x.device != w.qweight.device:
        raise ValueError(f"wq_mm: x is on {x.device}, the weight on {w.qweight.device}")
    M, N = x.shape[0], w.out_features
    out_dtype = out_dtype or x.dtype
    # choose_config's row buckets: decode, 64-row tiles, dequantize-then-cuBLAS
    key = (x.device, (M > DECODE_MAX_ROWS) + (M >= DEQUANT_MIN_ROWS), x.dtype, out_dtype)
    cfg = config or w.configs.get(key) or choose_config(M, w, x.device, x.dtype, out_dtype)
    if cfg.form not in FORMS:
        raise ValueError(f"wq_mm: unknown form {cfg.form!r}, expected one of {FORMS}")
    if (cfg.block_n, cfg.num_warps) != (TILE_N, TILE_WARPS) or cfg.block_m < 16 or cfg.split_k < 1:
        raise ValueError(f"wq_mm: a program covers one {TILE_N}-row tile with {TILE_WARPS} warps and at least "
                         f"16 rows of x, got {cfg}")
    y = torch.empty((M, N), device=x.device, dtype=out_dtype)
    if M == 0:
        return y
    while True:
        try:
            _launch(x, w, y, cfg)
            break
        except OutOfResources:
            # the estimate was short for this Triton version: the launch failed before running
            # (y is untouched), so a smaller config may retry; an explicit config is the caller's
            if config is not None or (cfg := shrink(cfg)) is None:
                raise
    if config is None:
        w.configs[key] = cfg  # what launched, shrunk if it had to be
    return y


def _workspace(w: WQPacked, device: torch.device, grid_m: int, cfg: LaunchConfig):
    """The split-K workspace fp32 [split, grid_m * BM, Np] and zeroed int32 counters [grid_m, tiles],
    made once per (device, row tiles, split) and kept with the weight."""
    key = (device, grid_m, cfg.block_m, cfg.split_k)
    if key not in w.workspaces:
        tiles = w.padded_out_features // TILE_N
        w.workspaces[key] = (
            torch.empty((cfg.split_k, grid_m * cfg.block_m, w.padded_out_features), device=device,
                        dtype=torch.float32),
            torch.zeros(grid_m * tiles, device=device, dtype=torch.int32))
    return w.workspaces[key]


def _launch(x: torch.Tensor, w: WQPacked, y: torch.Tensor, cfg: LaunchConfig) -> None:
    M = x.shape[0]
    NP, KT = w.padded_out_features, w.qweight.shape[1]
    tune = {} if interpreting() else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    mins = w.scales if w.mins is None else w.mins
    common = dict(BITS=w.bits, HAS_MIN=w.mins is not None, PER_CHANNEL=w.per_channel, GROUP=w.group_size,
                  ASM=_use_asm(x))
    if cfg.form == "dequant":
        # prefill: a per-call W^T copy [Kp, Np] in x's dtype (4096x4096 bf16: 32 MiB, freed on return)
        wt = torch.empty((w.padded_in_features, NP), device=x.device, dtype=x.dtype)
        _wq_dequant_kernel[(w.qweight.shape[0], KT)](w.qweight, w.scales, mins, wt, NP, KT, **common,
                                                       **tune)
        out = torch.matmul(x, wt[: w.in_features, : w.out_features])  # cuBLAS, fp32 accumulation
        y.copy_(out if not w.per_channel else out * w.scales[0, : w.out_features])  # per channel: y = (x @ q^T) * s
        return
    grid = (NP // TILE_N, triton.cdiv(M, cfg.block_m), cfg.split_k)
    ws, counters = _workspace(w, x.device, grid[1], cfg) if cfg.split_k > 1 else (y, y)
    # the pre-pass: x's group sums for the mins' term, x's 32-column sums in bf16 parts for the
    # bias step of bf16 int4 tiles — both in one launch when both are needed
    sums, parts = w.mins is not None, w.bits == 4 and x.dtype == torch.bfloat16
    xs = xp = y
    if sums or parts:
        G = triton.cdiv(w.in_features, w.group_size)
        chunk = w.group_size if w.group_size % TILE_K == 0 else 4 * TILE_K  # the kernel's K chunk
        halves = triton.cdiv(w.in_features, chunk) * chunk // 32  # whole chunks: the last one's tail holds 0
        if sums:
            xs = torch.empty((M, G), device=x.device, dtype=torch.float32)  # [M, G]
        if parts:
            xp = torch.empty((M, halves, 4), device=x.device, dtype=torch.bfloat16)  # [M, halves, 4]
        const = xprep_constexprs(w.group_size, sums, parts)
        blocks = max(triton.cdiv(G, const["BLOCK_G"]) if sums else 1,
                     triton.cdiv(halves, const["BLOCK_Q"]) if parts else 1)
        _xprep_kernel[(M, blocks)](x, xs, xp, w.in_features, G, x.stride(0), xs.stride(0), xp.stride(0), **const)
    _wq_mm_kernel[grid](
        x, w.qweight, w.scales, mins, xs, xp, y, ws, counters, M, w.out_features, w.in_features, NP, KT,
        x.stride(0), y.stride(0), xs.stride(0), xp.stride(0), BLOCK_M=cfg.block_m, SPLIT_K=cfg.split_k,
        IEEE=x.dtype == torch.float32, **common, **tune)


def wq_dequant_ref(w: WQPacked, cols: torch.Tensor | None = None) -> torch.Tensor:
    """The layout's spec: fp32 [N, K] (or [len(cols), K]: some output rows only), through the loader
    layouts' own dequantization (kernels/int4_mm.py, kernels/int8_mm.py), so both describe one set
    of weights."""
    K = w.in_features
    rows = torch.arange(w.out_features, device=w.qweight.device) if cols is None else cols.to(w.qweight.device)
    codes = tile_codes(w.qweight, w.bits, rows)  # [n, Kp]
    groups = w.scales.shape[0]
    Kg = groups * w.group_size if not w.per_channel else codes.shape[1]
    codes = _pad(codes, codes.shape[0], Kg, 8 if (w.bits == 4 and w.mins is None) else 0)[:, :Kg]
    pick = lambda t: t[:, rows].t()  # noqa: E731  [n, G]
    if w.bits == 4:
        return int4_dequant_ref(codes, pick(w.scales), None if w.mins is None else pick(w.mins), w.group_size)[:, :K]
    return int8_dequant_ref(codes, pick(w.scales))[:, :K]


def wq_rows(w: WQPacked, ids: torch.Tensor) -> torch.Tensor:
    """Embedding lookup from the packed table (tied embeddings share it with the LM head):
    fp32 [len(ids), K]. A gather of a few columns; no kernel needed."""
    return wq_dequant_ref(w, ids)


def wq_mm_ref(x: torch.Tensor, w: WQPacked) -> torch.Tensor:
    """The matmul's spec in fp32: dequantize, then multiply."""
    return x.float() @ wq_dequant_ref(w).t()
