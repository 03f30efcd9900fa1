"""Weight-only quantized matmul on the GPU (Triton): y[M, N] = x[M, K] @ dequant(W)[N, K]^T.

One kernel serves every lowbit layout — int4 symmetric (w = d * (u - 8)) and asymmetric
(w = d * u + m) with groups of 32/64/128, int8 per group (w = d * q) and per output channel —
for fp16/bf16 activations (and fp32, computed in IEEE fp32, for the exact path), with fp32
accumulation. Decode and small batches read the weights packed and dequantize in registers; only
the prefill form "dequant" (M >= DEQUANT_MIN_ROWS, 16-bit x and y) writes a dequantized copy of W,
for that call only (4096x4096 in bf16: 32 MiB, freed on return), and hands the product to cuBLAS.

Layout (`WQPacked`), built once at load time from the loader's row-major layout:

    int4  qweight int32 [Kp/8, N]  word (i, n) holds the codes of k = 8i .. 8i+7 of column n,
                                   code of k = 8i + j in bits 4j .. 4j+3
    int8  qweight int8  [Kp, N]
          scales  fp16  [G, N]     (fp32 [1, N] per channel), mins fp16 [G, N] (int4 asymmetric)

K-major with N contiguous: a tile of BLOCK_K/8 (int4) or BLOCK_K (int8) rows of BLOCK_N contiguous
words, so the loads along N coalesce, each packed word is loaded once, and a group's scales are
one contiguous row.

Arithmetic: a K tile never straddles a group (BLOCK_K divides the group size), so the scale factors
out of the tile's dot product: acc += (x @ u) * d  (+ rowsum(x) * m for the asymmetric layout).
The codes u (0..15, -8..7, -127..127) are exact in fp16/bf16, so the tensor-core dot multiplies
the activations by exact integers and only the fp32 accumulation rounds — more accurate than
dequantizing w to fp16/bf16 first, which rounds every weight (2^-11 / 2^-8 relative). The
"dequant" prefill form does round each weight once, to x's dtype (per-channel int8 excepted: it
multiplies by the exact codes and scales y). Measured on N(0, 1) x and weights, K = 256, as rms
error / rms(y): bf16 3.5e-3 against 1.7e-3 for y's own rounding alone (about what the fused forms
reach), fp16 2.8e-4 against 2.1e-4 — inside the tests' tolerances (test_dequant_form).

Forms of the K tile (LaunchConfig.form), chosen by `choose_config`:
- nib (int4, 128-wide groups): 8 dots over k = 8i + j, one per nibble j, each code a shift and a
  mask of the loaded word, turned into a float by OR-ing it into the mantissa of 128 (bf16) or
  1024 (fp16) and subtracting that: no [BK, BN] tile is rebuilt through shared memory;
- dot / swap: the codes unpacked to a [BK, BN] tile (swap: y^T = W x^T, the codes as the register
  A operand of Hopper's wgmma).

Launch shapes: decode, M <= 16: one row tile, split-K over the grid so that ~4 programs per SM
stream the weights once, each split writing its fp32 partial sums to its own slice of a workspace
that one small kernel sums in a fixed order (deterministic) and casts; prefill: tiled GEMM, 64-128
rows per tile, tiles ordered in groups along M so the weight columns a group reads stay in L2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lowbit.kernels.int4_mm import int4_dequant_ref
from lowbit.kernels.int8_mm import int8_dequant_ref
from lowbit.kernels.triton_import import OutOfResources, check_device, interpreting, tl, triton

DECODE_MAX_ROWS = 16  # up to this many rows: the split-K decode launch
DEQUANT_MIN_ROWS = 256  # from this many rows (16-bit x and y): dequantize, then cuBLAS


@dataclass
class WQPacked:
    qweight: torch.Tensor  # int4: int32 [Kp/8, N]; int8: int8 [Kp, N]
    scales: torch.Tensor  # fp16 [G, N] per group, or fp32 [1, N] per output channel
    mins: torch.Tensor | None  # fp16 [G, N] (int4 asymmetric) or None
    bits: int  # 4 | 8
    group_size: int  # K per scale; Kp when per channel
    in_features: int  # K before padding to a whole group

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def padded_in_features(self) -> int:
        return self.qweight.shape[0] * (8 if self.bits == 4 else 1)

    @property
    def per_channel(self) -> bool:
        return self.scales.shape[0] == 1 and self.bits == 8 and self.scales.dtype == torch.float32

    def to(self, device) -> "WQPacked":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return WQPacked(move(self.qweight), move(self.scales), move(self.mins), self.bits, self.group_size,
                        self.in_features)


def wq_pack_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                 in_features: int) -> WQPacked:
    """codes uint8 [N, Kp] (0..15), scales/mins fp16 [N, G] (quant/int4.py's layout) → WQPacked."""
    N, Kp = codes.shape
    if Kp % group_size or Kp % 8 or scales.shape != (N, Kp // group_size):
        raise ValueError(f"wq_pack_int4: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} "
                         f"do not form groups of {group_size}")
    c = codes.t().reshape(Kp // 8, 8, N).to(torch.int64)  # [Kp/8, 8, N]: the 8 codes of one word
    shifts = (torch.arange(8, dtype=torch.int64, device=codes.device) * 4).view(1, 8, 1)
    words = (c << shifts).sum(dim=1)  # [Kp/8, N], 0 .. 2^32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # same bits, as int32
    return WQPacked(words.contiguous(), scales.t().half().contiguous(),
                    None if mins is None else mins.t().half().contiguous(), 4, group_size, in_features)


def wq_pack_int8(qweight: torch.Tensor, scales: torch.Tensor, in_features: int) -> WQPacked:
    """qweight int8 [N, Kp], scales fp16 [N, G] or fp32 [N, 1] (quant/int8.py's layout) → WQPacked."""
    N, Kp = qweight.shape
    G = scales.shape[1]
    if scales.shape[0] != N or Kp % G:
        raise ValueError(f"wq_pack_int8: qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} disagree")
    per_channel = G == 1 and scales.dtype == torch.float32
    s = scales.t().contiguous() if per_channel else scales.t().half().contiguous()
    return WQPacked(qweight.t().contiguous(), s, None, 8, Kp // G, in_features)


@triton.jit
def _codes(q_ptr, t, offs_n, n_ok, N, Kp, BITS: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, TRANS: tl.constexpr):
    """The integer codes of K tile t, [BK, BN] (TRANS: [BN, BK]); each packed word is loaded once."""
    if BITS == 4:
        offs_w = t * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)  # word rows: k = 8i .. 8i+7
        shifts = tl.arange(0, 8) * 4
        if TRANS:
            words = tl.load(q_ptr + offs_w[None, :] * N + offs_n[:, None],
                            mask=n_ok[:, None] & (offs_w[None, :] < Kp // 8), other=0)  # [BN, BK/8]
            u = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [BN, BK/8, 8]
            u = tl.reshape(u, (BLOCK_N, BLOCK_K))  # [BN, BK]: column 8i + j = nibble j of word i
        else:
            words = tl.load(q_ptr + offs_w[:, None] * N + offs_n[None, :],
                            mask=(offs_w[:, None] < Kp // 8) & n_ok[None, :], other=0)  # [BK/8, BN]
            u = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK/8, 8, BN]
            u = tl.reshape(u, (BLOCK_K, BLOCK_N))  # [BK, BN]: row 8i + j = nibble j of word i
        if not HAS_MIN:
            u = u - 8
    else:
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        if TRANS:
            u = tl.load(q_ptr + offs_k[None, :] * N + offs_n[:, None],
                        mask=n_ok[:, None] & (offs_k[None, :] < Kp), other=0)  # [BN, BK] int8
        else:
            u = tl.load(q_ptr + offs_k[:, None] * N + offs_n[None, :],
                        mask=(offs_k[:, None] < Kp) & n_ok[None, :], other=0)  # [BK, BN] int8
    return u


@triton.jit
def _nibble_dots(x_ptr, q_ptr, t, offs_m, m_ok, offs_n, n_ok, N, K, Kp, stride_xm, HAS_MIN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                 SWAP: tl.constexpr, INTERP: tl.constexpr):
    """int4 K tile t as 8 dots, one per nibble j over k = 8i + j (the sum over k in another order):
    every code is a shift and a mask of the loaded word in the word's own register layout, so no
    [BK, BN] tile is rebuilt through shared memory. For 16-bit x the code c becomes a float by OR-ing
    its bits into the mantissa of 128 (bf16 0x4300) or 1024 (fp16 0x6400) and subtracting that
    (and 8 more for symmetric codes) in x's dtype: exact, two instructions per pair of codes.
    Returns x @ codes in fp32 ([BM, BN], SWAP: [BN, BM])."""
    BK8: tl.constexpr = BLOCK_K // 8
    BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    offs_i = t * BLOCK_K + 8 * tl.arange(0, BK8)  # k of nibble 0 of each word row
    w_i = t * BK8 + tl.arange(0, BK8)
    if SWAP:
        words = tl.load(q_ptr + w_i[None, :] * N + offs_n[:, None], mask=n_ok[:, None] & (w_i[None, :] < Kp // 8),
                        other=0)  # [BN, BK/8]
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        words = tl.load(q_ptr + w_i[:, None] * N + offs_n[None, :], mask=(w_i[:, None] < Kp // 8) & n_ok[None, :],
                        other=0)  # [BK/8, BN]
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(8):
        if SWAP:
            x = tl.load(x_ptr + offs_m[None, :] * stride_xm + (offs_i + j)[:, None],
                        mask=m_ok[None, :] & ((offs_i + j) < K)[:, None], other=0.0)  # [BK/8, BM] = x[:, 8i + j]^T
        else:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (offs_i + j)[None, :],
                        mask=m_ok[:, None] & ((offs_i + j) < K)[None, :], other=0.0)  # [BM, BK/8] = x[:, 8i + j]
        c = (words >> (4 * j)) & 0xF
        if IEEE:
            c = c.to(tl.float32) - (0.0 if HAS_MIN else 8.0)
        elif BF16 and INTERP:  # the interpreter keeps bf16 as raw uint16 bits: no bf16 arithmetic there
            c = (c.to(tl.float32) - (0.0 if HAS_MIN else 8.0)).to(tl.bfloat16)
        elif BF16:
            c = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (128.0 if HAS_MIN else 136.0)
        else:
            c = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 if HAS_MIN else 1032.0)
        if SWAP:
            part += tl.dot(c, x, input_precision="ieee" if IEEE else None)
        else:
            part += tl.dot(x, c, input_precision="ieee" if IEEE else None)
    return part


@triton.jit
def _wq_mm_kernel(x_ptr, q_ptr, s_ptr, m_ptr, y_ptr, M, N, K, Kp, stride_xm, stride_ym, stride_ys,
                  BITS: tl.constexpr, HAS_MIN: tl.constexpr, PER_CHANNEL: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr, FORM: tl.constexpr,
                  INTERP: tl.constexpr):
    # Tile order: GROUP_M row tiles sweep the same column tiles before moving on (L2 reuse).
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    SWAP: tl.constexpr = FORM == 1 or FORM == 4  # y^T = W x^T: the codes are the dot's register operand A
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K tiles of this program: pid_k, pid_k + SPLIT_K, ... (each tile lies inside one group)
    for t in range(tl.program_id(1), tl.cdiv(Kp, BLOCK_K), SPLIT_K):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        if FORM >= 3:
            part = _nibble_dots(x_ptr, q_ptr, t, offs_m, m_ok, offs_n, n_ok, N, K, Kp, stride_xm,
                                HAS_MIN, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, SWAP, INTERP)
            if HAS_MIN:  # one contiguous reload of the tile (L1) for its row sums
                if SWAP:
                    xsum = tl.sum(tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                                          mask=m_ok[None, :] & (offs_k[:, None] < K), other=0.0).to(tl.float32),
                                  axis=0)[None, :]  # [1, BM]
                else:
                    xsum = tl.sum(tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                                          mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32),
                                  axis=1)[:, None]  # [BM, 1]
        elif SWAP:
            x = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                        mask=m_ok[None, :] & (offs_k[:, None] < K), other=0.0)  # [BK, BM] = x^T
            u = _codes(q_ptr, t, offs_n, n_ok, N, Kp, BITS, HAS_MIN, BLOCK_N, BLOCK_K, True)  # [BN, BK]
            xsum = tl.sum(x.to(tl.float32), axis=0)[None, :]  # [1, BM]
        else:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0)  # [BM, BK]
            xsum = tl.sum(x.to(tl.float32), axis=1)[:, None]  # [BM, 1]
            u = _codes(q_ptr, t, offs_n, n_ok, N, Kp, BITS, HAS_MIN, BLOCK_N, BLOCK_K, False)  # [BK, BN]
        # The codes (|u| <= 127) are exact in fp16/bf16/fp32, so only the fp32 accumulation rounds.
        if FORM >= 3:
            pass
        elif SWAP:
            u = u.to(tl.float32).to(x.dtype)  # via fp32: Triton's interpreter casts int -> bf16 wrongly
            if IEEE:
                part = tl.dot(u, x, input_precision="ieee")  # [BN, BM]
            else:
                part = tl.dot(u, x)
        else:
            u = u.to(tl.float32).to(x.dtype)
            if IEEE:
                part = tl.dot(x, u, input_precision="ieee")  # [BM, BN]
            else:
                part = tl.dot(x, u)
        if PER_CHANNEL:
            acc += part
        else:
            g = (t * BLOCK_K) // GROUP
            d = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
            dd = d[:, None] if SWAP else d[None, :]
            acc += part * dd
            if HAS_MIN:
                mn = tl.load(m_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
                acc += xsum * (mn[:, None] if SWAP else mn[None, :])
    if PER_CHANNEL:
        d = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)  # fp32 [BN]
        acc = acc * (d[:, None] if SWAP else d[None, :])
    # SPLIT_K > 1: y is an fp32 workspace [SPLIT_K, M, N], one slice per split, summed by _wq_reduce_kernel
    y_ptr += tl.program_id(1) * stride_ys
    if SWAP:
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[None, :] & n_ok[:, None])
    else:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _wq_reduce_kernel(ws_ptr, y_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum of the SPLIT_K fp32 partial sums in a fixed order (deterministic, unlike atomics),
    cast to y's dtype: one small kernel in place of a zero-fill, atomics and a cast."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _wq_dequant_kernel(q_ptr, s_ptr, m_ptr, w_ptr, N, Kp, BITS: tl.constexpr, HAS_MIN: tl.constexpr,
                       PER_CHANNEL: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """W^T [Kp, N] in w's dtype for the prefill path: d * u (+ m) in fp32, rounded once; per channel
    the bare codes (exact), whose scale the caller applies to y."""
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
    u = _codes(q_ptr, t, offs_n, n_ok, N, Kp, BITS, HAS_MIN, BLOCK_N, BLOCK_K, False).to(tl.float32)  # [BK, BN]
    if not PER_CHANNEL:
        g = (t * BLOCK_K) // GROUP
        u = u * tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_MIN:
            u = u + tl.load(m_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(w_ptr + offs_k[:, None] * N + offs_n[None, :], u.to(w_ptr.dtype.element_ty),
             mask=(offs_k[:, None] < Kp) & n_ok[None, :])


FORMS = ("dot", "swap", "dequant", "nib", "nibswap")  # index = the kernel's FORM (swap 1, nib forms >= 3)


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    group_m: int
    num_warps: int
    num_stages: int
    # how a tile is computed: "dot" y = x @ codes; "swap" y^T = codes^T @ x^T (the codes stay in
    # registers as the tensor-core A operand); "dequant" a W^T copy in x's dtype, then torch.matmul
    # (cuBLAS); "nib" / "nibswap" 8 dots per K tile, one per nibble (int4, BLOCK_K a multiple of 128)
    form: str = "dot"


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _smem_limit(device: torch.device) -> int | None:
    """Shared memory one program may use (H200: 232,448 bytes); None off CUDA (the interpreter has no limit)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def smem_estimate(cfg: LaunchConfig, x_bytes: int, bits: int) -> int:
    """Bytes of shared memory a launch needs, on the safe side: each pipeline stage holds the x tile
    and the packed weight tile, plus one [BK, BN] operand in x's dtype and an fp32 [BM, BN] epilogue
    tile."""
    x_tile = cfg.block_m * cfg.block_k * x_bytes
    operand = cfg.block_k * cfg.block_n * x_bytes
    if cfg.form == "dequant":
        return 0
    stage = x_tile + cfg.block_k * cfg.block_n * bits // 8
    return cfg.num_stages * stage + operand + cfg.block_m * cfg.block_n * 4


def shrink(cfg: LaunchConfig) -> LaunchConfig | None:
    """The next smaller config: fewer stages down to 2, then narrower N tiles down to 64, then one
    stage, then shorter M tiles; None when nothing is left to give."""
    if cfg.num_stages > 2:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_n > 64:
        return replace(cfg, block_n=cfg.block_n // 2)
    if cfg.num_stages > 1:
        return replace(cfg, num_stages=1)
    if cfg.block_m > 16:
        return replace(cfg, block_m=cfg.block_m // 2)
    return None


def choose_config(M: int, w: WQPacked, device: torch.device, x_dtype: torch.dtype = torch.float16,
                  out_dtype: torch.dtype | None = None) -> LaunchConfig:
    """Tile shapes and form by problem shape (form choice from sm_90 SASS of one 128x64 int4 tile per
    program, bf16, instructions in the loop per packed int32 word: dot 59, swap 66,
    nib 46 (symmetric) / 59 (with mins); streaming 4.8 TB/s over 132 SMs leaves ~28). Decode: nib for
    128-wide groups, dot for narrower ones, split-K so the grid holds ~4 programs of 64 columns per SM.
    (A CUDA-core "gemv" form was tried and dropped: wrong on the H200, right under the interpreter.) Prefill: 64- or 128-row tiles; from DEQUANT_MIN_ROWS rows (16-bit x and y) the
    dequantize-then-cuBLAS form. Then shrunk until `smem_estimate` fits the device's shared memory."""
    N, Kp = w.out_features, w.padded_in_features
    bk = w.group_size if not w.per_channel else 128
    k_tiles = triton.cdiv(Kp, bk)
    sixteen_bit = x_dtype != torch.float32 and (out_dtype or x_dtype) == x_dtype
    if M <= DECODE_MAX_ROWS:
        # H200 sweep, int4-g128 4096x4096 (Triton 3.6, bf16, explicit configs): M = 1 best nib bn64
        # split 8 w8 0.041 ms (w4: 0.095); M = 16 best nib bn128 split 8 0.038 ms (bn64: 0.115)
        if w.bits == 4 and bk % 128 == 0:
            bm, bn, form = 16, 64 if M == 1 else 128, "nib"  # 8 dots of K = bk/8 >= 16
        else:
            bm, bn, form = 16, 64, "dot"
        tiles = triton.cdiv(N, bn)
        per_sm = 4 if bn == 64 else 2  # the same weight bytes per program either way
        split = max(1, min(k_tiles, (per_sm * _sm_count(device)) // tiles))
        cfg = LaunchConfig(bm, bn, bk, split, 1, 8 if form == "nib" else 4, 3, form)
    elif M >= DEQUANT_MIN_ROWS and sixteen_bit:
        cfg = LaunchConfig(16, 128, bk, 1, 1, 4, 1, "dequant")
    elif M <= 128:
        cfg = LaunchConfig(64, 128, bk, 1, 8, 4, 3, "dot")  # sm_90: 255 registers, no spill to speak of
    else:
        cfg = LaunchConfig(128, 128, bk, 1, 8, 8, 3, "swap")  # "dot" spills at 128x128 with 8 warps
    limit = _smem_limit(device)
    x_bytes = x_dtype.itemsize
    while limit is not None and smem_estimate(cfg, x_bytes, w.bits) > limit and (smaller := shrink(cfg)):
        cfg = smaller
    return cfg


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
    cfg = config or choose_config(M, w, x.device, x.dtype, out_dtype)
    if cfg.form not in FORMS:
        raise ValueError(f"wq_mm: unknown form {cfg.form!r}, expected one of {FORMS}")
    if cfg.form.startswith("nib") and (w.bits != 4 or cfg.block_k % 128):
        raise ValueError(f"wq_mm: the {cfg.form} form needs int4 weights and BLOCK_K a multiple of 128 "
                         f"(8 dots of K >= 16), got {w.bits}-bit, BLOCK_K={cfg.block_k}")
    if not w.per_channel and w.group_size % cfg.block_k:
        raise ValueError(f"wq_mm: BLOCK_K={cfg.block_k} must divide the group size {w.group_size}")
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
    return y


def _launch(x: torch.Tensor, w: WQPacked, y: torch.Tensor, cfg: LaunchConfig) -> None:
    M, N = x.shape[0], w.out_features
    tune = {} if interpreting() else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.form == "dequant":
        # prefill: a per-call W^T copy [Kp, N] in x's dtype (4096x4096 bf16: 32 MiB, freed on return)
        wt = torch.empty((w.padded_in_features, N), device=x.device, dtype=x.dtype)
        _wq_dequant_kernel[(triton.cdiv(wt.shape[0], cfg.block_k), triton.cdiv(N, cfg.block_n))](
            w.qweight, w.scales, w.scales if w.mins is None else w.mins, wt, N, wt.shape[0],
            BITS=w.bits, HAS_MIN=w.mins is not None, PER_CHANNEL=w.per_channel, GROUP=w.group_size,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **tune)
        out = torch.matmul(x, wt[:w.in_features])  # cuBLAS, fp32 accumulation
        y.copy_(out if not w.per_channel else out * w.scales)  # per channel: y = (x @ q^T) * s
        return
    # split-K: each split writes its fp32 partial sums to its own slice, then one reduction kernel
    ws = y if cfg.split_k == 1 else torch.empty((cfg.split_k, M, N), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), cfg.split_k)
    _wq_mm_kernel[grid](
        x, w.qweight, w.scales, w.scales if w.mins is None else w.mins, ws,
        M, N, w.in_features, w.padded_in_features, x.stride(0), N if cfg.split_k > 1 else y.stride(0), M * N,
        BITS=w.bits, HAS_MIN=w.mins is not None, PER_CHANNEL=w.per_channel, GROUP=w.group_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        GROUP_M=cfg.group_m, IEEE=x.dtype == torch.float32, FORM=FORMS.index(cfg.form), INTERP=interpreting(),
        **tune)
    if cfg.split_k > 1:
        _wq_reduce_kernel[(triton.cdiv(M * N, 1024),)](ws, y, M * N, SPLIT_K=cfg.split_k, BLOCK=1024)


def wq_dequant_ref(w: WQPacked, cols: torch.Tensor | None = None) -> torch.Tensor:
    """The layout's spec: fp32 [N, K] (or [len(cols), K]: some output rows only), through the loader
    layouts' own dequantization (kernels/int4_mm.py, kernels/int8_mm.py), so both describe one set
    of weights."""
    K = w.in_features
    pick = (lambda t: t) if cols is None else (lambda t: t[:, cols])  # noqa: E731
    if w.bits == 4:
        words = pick(w.qweight).to(torch.int64) & 0xFFFFFFFF  # [Kp/8, n]
        shifts = (torch.arange(8, device=words.device) * 4).view(1, 8, 1)
        codes = ((words[:, None, :] >> shifts) & 0xF).reshape(-1, words.shape[1])  # [Kp, n] via [Kp/8, 8, n]
        return int4_dequant_ref(codes.t().contiguous(), pick(w.scales).t(),
                                None if w.mins is None else pick(w.mins).t(), w.group_size)[:, :K]
    return int8_dequant_ref(pick(w.qweight).t().contiguous(), pick(w.scales).t())[:, :K]


def wq_rows(w: WQPacked, ids: torch.Tensor) -> torch.Tensor:
    """Embedding lookup from the packed table (tied embeddings share it with the LM head):
    fp32 [len(ids), K]. A gather of a few columns; no kernel needed."""
    return wq_dequant_ref(w, ids)


def wq_mm_ref(x: torch.Tensor, w: WQPacked) -> torch.Tensor:
    """The matmul's spec in fp32: dequantize, then multiply."""
    return x.float() @ wq_dequant_ref(w).t()
