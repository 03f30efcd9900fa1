"""Weight-only quantized matmul on the GPU (Triton): y[M, N] = x[M, K] @ dequant(W)[N, K]^T.

One kernel serves every lowbit layout — int4 symmetric (w = d * (u - 8)) and asymmetric
(w = d * u + m) with groups of 32/64/128, int8 per group (w = d * q) and per output channel —
for fp16/bf16 activations (and fp32, computed in IEEE fp32, for the exact path), with fp32
accumulation. The weights are read packed and dequantized in registers; no dequantized weight is
ever written to memory.

Layout (`WQPacked`), built once at load time from the loader's row-major layout:

    int4  qweight int32 [Kp/8, N]  word (i, n) holds the codes of k = 8i .. 8i+7 of column n,
                                   code of k = 8i + j in bits 4j .. 4j+3
    int8  qweight int8  [Kp, N]
          scales  fp16  [G, N]     (fp32 [1, N] per channel), mins fp16 [G, N] (int4 asymmetric)

K-major with N contiguous: a tile [BLOCK_K, BLOCK_N] is BLOCK_K/8 (int4) or BLOCK_K (int8) runs
of BLOCK_N contiguous words, so the loads along N coalesce into 128-bit vectors (4 int32 words or
16 int8 codes per thread), and a group's scales are one contiguous row.

Arithmetic: a K tile never straddles a group (BLOCK_K = group size), so the scale factors out
of the tile's dot product: acc += (x @ u) * d  (+ rowsum(x) * m for the asymmetric layout).
The codes u (0..15, -8..7, -127..127) are exact in fp16/bf16, so the tensor-core dot multiplies
the activations by exact integers and only the fp32 accumulation rounds — more accurate than
dequantizing w to fp16/bf16 first, which would round every weight (2^-11 / 2^-8 relative).

Two launch shapes of the same kernel:
- decode, M <= 16: one 16-row tile, split-K over the grid so that ~2 programs per SM stream the
  weights exactly once, partial sums combined with fp32 atomics;
- prefill: tiled GEMM, 64-128 rows per tile, tiles ordered in groups along M so the weight
  columns a group reads stay in L2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lowbit.kernels.int4_mm import int4_dequant_ref
from lowbit.kernels.int8_mm import int8_dequant_ref
from lowbit.kernels.triton_import import OutOfResources, check_device, interpreting, tl, triton

DECODE_MAX_ROWS = 16  # up to this many rows: the split-K decode launch


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
def _wq_mm_kernel(x_ptr, q_ptr, s_ptr, m_ptr, y_ptr, M, N, K, Kp, stride_xm, stride_ym,
                  BITS: tl.constexpr, HAS_MIN: tl.constexpr, PER_CHANNEL: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr):
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K tiles of this program: pid_k, pid_k + SPLIT_K, ... (each tile lies inside one group)
    for t in range(tl.program_id(1), tl.cdiv(Kp, BLOCK_K), SPLIT_K):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0)  # [BM, BK]
        w_ok = (offs_k[:, None] < Kp) & n_ok[None, :]
        if BITS == 4:
            words = tl.load(q_ptr + (offs_k // 8)[:, None] * N + offs_n[None, :], mask=w_ok, other=0)
            u = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF  # [BK, BN] codes 0..15
            if not HAS_MIN:
                u = u - 8
        else:
            u = tl.load(q_ptr + offs_k[:, None] * N + offs_n[None, :], mask=w_ok, other=0)  # [BK, BN] int8
        # integers -> fp32 -> the activation dtype: exact either way (|u| <= 127)
        b = u.to(tl.float32).to(x.dtype)
        if IEEE:
            part = tl.dot(x, b, input_precision="ieee")
        else:
            part = tl.dot(x, b)
        if PER_CHANNEL:
            acc += part
        else:
            g = (t * BLOCK_K) // GROUP
            d = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
            acc += part * d[None, :]
            if HAS_MIN:
                mn = tl.load(m_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * mn[None, :]
    if PER_CHANNEL:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.atomic_add(y_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    group_m: int
    num_warps: int
    num_stages: int


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _smem_limit(device: torch.device) -> int | None:
    """Shared memory one program may use (H200: 232,448 bytes); None off CUDA (the interpreter has no limit)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def smem_estimate(cfg: LaunchConfig, x_bytes: int, bits: int) -> int:
    """Bytes of shared memory a launch needs, on the safe side: each pipeline stage holds the x tile,
    the weight codes and their converted [BK, BN] operand (both in x's dtype), and the epilogue an
    fp32 [BM, BN] tile. Checked on an H200 (Triton 3.6): int4 g128, fp16, 128x128x128 with 3 stages
    asked for 241,664 bytes (estimate 286,720) and did not fit its 232,448."""
    stage = (cfg.block_m * cfg.block_k + cfg.block_k * cfg.block_n) * x_bytes + cfg.block_k * cfg.block_n * bits // 8
    return cfg.num_stages * stage + cfg.block_m * cfg.block_n * 4


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


def choose_config(M: int, w: WQPacked, device: torch.device, x_dtype: torch.dtype = torch.float16) -> LaunchConfig:
    """Tile shapes by problem shape. Decode: BLOCK_N 128 and split-K so the grid holds ~2 programs
    per SM (4096x4096 on 132 SMs: 32 column tiles x 8 splits). Prefill: 64- or 128-row tiles.
    Then shrunk until `smem_estimate` fits the device's shared memory (fp32 x and 128-wide groups
    are what overflow it)."""
    N, Kp = w.out_features, w.padded_in_features
    bk = w.group_size if not w.per_channel else 128
    k_tiles = triton.cdiv(Kp, bk)
    if M <= DECODE_MAX_ROWS:
        bn = 128 if N >= 2048 else 64
        tiles = triton.cdiv(N, bn)
        split = max(1, min(k_tiles, (2 * _sm_count(device)) // tiles))
        cfg = LaunchConfig(16, bn, bk, split, 1, 4, 4)
    else:
        bm = 64 if M <= 128 else 128
        cfg = LaunchConfig(bm, 128, bk, 1, 8, 8 if bm == 128 else 4, 3)
    limit = _smem_limit(device)
    x_bytes = torch.empty((), dtype=x_dtype).element_size()
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
    cfg = config or choose_config(M, w, x.device, x.dtype)
    if not w.per_channel and w.group_size % cfg.block_k:
        raise ValueError(f"wq_mm: BLOCK_K={cfg.block_k} must divide the group size {w.group_size}")
    out_dtype = out_dtype or x.dtype
    if cfg.split_k > 1:
        y = torch.zeros((M, N), device=x.device, dtype=torch.float32)
    else:
        y = torch.empty((M, N), device=x.device, dtype=out_dtype)
    if M == 0:
        return y.to(out_dtype)
    while True:
        try:
            _launch(x, w, y, cfg)
            break
        except OutOfResources:
            # the estimate was short for this Triton version: the launch failed before running
            # (y is untouched), so a smaller config may retry; an explicit config is the caller's
            if config is not None or (cfg := shrink(cfg)) is None:
                raise
    return y if y.dtype == out_dtype else y.to(out_dtype)


def _launch(x: torch.Tensor, w: WQPacked, y: torch.Tensor, cfg: LaunchConfig) -> None:
    M, N = x.shape[0], w.out_features
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), cfg.split_k)
    _wq_mm_kernel[grid](
        x, w.qweight, w.scales, w.scales if w.mins is None else w.mins, y,
        M, N, w.in_features, w.padded_in_features, x.stride(0), y.stride(0),
        BITS=w.bits, HAS_MIN=w.mins is not None, PER_CHANNEL=w.per_channel, GROUP=w.group_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        GROUP_M=cfg.group_m, IEEE=x.dtype == torch.float32,
        **({} if interpreting() else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}))


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
