"""Paged attention over the quantized KV pool (Triton): every new query attends over its sequence's
cached keys and values, read from their pages and dequantized in registers.

Inputs are one engine step's batch (models/attention.py's PagedBatch) as tensors: S sequences, each
bringing n_s new query rows (a prefill chunk, one decode token, speculative tokens) whose K/V are
already in the pool (written first, kernels/kv_write.py), so every query attends over context_lens[s]
cached tokens, its own included. Key j of a sequence sits at position j; query row i at
positions[i]; the mask is j <= positions[i] (causal) and j > positions[i] - window (sliding).
The pool layout and number formats are kernels/kv_side.py's (a `KVSide` per layer and side, as
runtime/engine/kv_cache.py allocates them) and kernels/kv_quant.py's:

    f32   data   fp32  [P, Hkv, page, D]                                   k = data
    f16   data   fp16  [P, Hkv, page, D]                                   k = data
    int8  codes  int8  [P, Hkv, page, D]    scales fp16 [P, Hkv, page, G]  k = d * q
    int4  codes  uint8 [P, Hkv, page, D/2]  scales, mins fp16 [.., G]      k = d * u + m

Flash-style: one program per (sequence, block of BLOCK_M query rows, KV head). Its tile holds the
BLOCK_M rows of every query head sharing that KV head (GQA, H / Hkv of them, padded to a power of 2)
as BLOCK_M x QPK_P tile rows, so a page is read and dequantized once for all of them — SmolLM2's
9 / 3 heads: 3 rows per token, 4 with padding; a decode step's tile is 16 rows, 3 of them real.
Keys come BLOCK_N at a time; each key finds its page through the block table, so BLOCK_N need not
be a page (page_size 4 works as well as 16). Scores, the online softmax and P @ V are fp32 (the CUDA
precision policy keeps attention in fp32, docs/formats.md), with IEEE fp32 dots: the result matches
the plain-torch spec to a few fp32 ulps whatever q's dtype. No dequantized page is ever written to
memory.

Everything stays in the rotated space: q comes rotated like the keys (x @ R, kernels/kv_quant.py),
and the output is P @ (V R); the caller un-rotates it (@ R^T).
"""

from __future__ import annotations

import math

import torch

from lowbit.kernels.kv_side import KVSide
from lowbit.kernels.triton_import import check_device, interpreting, tl, triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _load_dequant(c_ptr, s_ptr, m_ptr, rows, d, ok, BITS: tl.constexpr, D: tl.constexpr,
                  GROUP: tl.constexpr):
    """Tokens `rows` (pool row indices [BLOCK_N, 1]) of one side, columns d [1, BLOCK_D] → fp32
    [BLOCK_N, BLOCK_D], dequantized as kernels/kv_quant.py's spec does (0 where not ok)."""
    if BITS >= 16:  # fp32 or fp16 data: the pointer's own dtype, widened (fp32: as is)
        x = tl.load(c_ptr + rows * D + d, mask=ok, other=0.0).to(tl.float32)
    else:
        G: tl.constexpr = D // GROUP
        # each value's group scale: a gather from one short row per token, served from L1
        sc = tl.load(s_ptr + rows * G + d // GROUP, mask=ok, other=0.0).to(tl.float32)
        if BITS == 8:
            x = tl.load(c_ptr + rows * D + d, mask=ok, other=0).to(tl.float32) * sc
        else:
            byte = tl.load(c_ptr + rows * (D // 2) + d // 2, mask=ok, other=0).to(tl.int32)
            u = (byte >> ((d % 2) * 4)) & 0xF  # value 2k in the low nibble, 2k + 1 in the high
            mn = tl.load(m_ptr + rows * G + d // GROUP, mask=ok, other=0.0).to(tl.float32)
            x = u.to(tl.float32) * sc + mn
    return x


@triton.jit
def _paged_attention_kernel(q_ptr, o_ptr, pos_ptr, cu_ptr, ctx_ptr, bt_ptr,
                            kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr,
                            stride_qm, stride_qh, stride_bt, H, HKV, PAGE, window, scale,
                            K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                            V_GROUP: tl.constexpr, D: tl.constexpr, QPK: tl.constexpr, QPK_P: tl.constexpr,
                            SLIDING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq)
    n_q = tl.load(cu_ptr + seq + 1) - q_start
    first = tl.program_id(1) * BLOCK_M
    if first >= n_q:  # the grid covers the longest query run; shorter ones stop here
        return
    ctx = tl.load(ctx_ptr + seq)

    # Tile rows: r = t * QPK_P + j is query token first + t, query head kvh * QPK + j.
    r = tl.arange(0, BLOCK_M * QPK_P)
    t = first + r // QPK_P
    head = kvh * QPK + r % QPK_P
    row_ok = (t < n_q) & (r % QPK_P < QPK)
    tok = (q_start + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + tok[:, None] * stride_qm + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [R, BLOCK_D]
    qpos = tl.load(pos_ptr + tok, mask=row_ok, other=0)  # [R] int64

    # Keys any row can see: [lo, hi). hi = ctx already (the queries' own keys are in the cache);
    # the min keeps a short block table safe if a caller's positions ran past it.
    hi = tl.minimum(ctx, tl.max(tl.where(row_ok, qpos, -1)) + 1)
    lo = 0
    if SLIDING:
        lo = tl.maximum(tl.min(tl.where(row_ok, qpos, 2**62)) - window + 1, 0)

    m_i = tl.full((BLOCK_M * QPK_P,), -1e30, tl.float32)  # finite: a fully masked block gives p = 0, not nan
    l_i = tl.zeros((BLOCK_M * QPK_P,), tl.float32)
    acc = tl.zeros((BLOCK_M * QPK_P, BLOCK_D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        j_ok = j < hi
        page = tl.load(bt_ptr + seq * stride_bt + j // PAGE, mask=j_ok, other=0).to(tl.int64)
        rows = ((page * HKV + kvh) * PAGE + j % PAGE)[:, None]  # [BLOCK_N, 1] pool row (page, head, offset)
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = _load_dequant(kc_ptr, ks_ptr, km_ptr, rows, d[None, :], kv_ok, K_BITS, D, K_GROUP)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [R, BLOCK_N]
        see = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= qpos[:, None])
        if SLIDING:
            see = see & (j[None, :] > qpos[:, None] - window)
        s = tl.where(see, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_dequant(vc_ptr, vs_ptr, vm_ptr, rows, d[None, :], kv_ok, V_BITS, D, V_GROUP)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (tok[:, None] * H + head[:, None]) * D + d[None, :], out,
             mask=row_ok[:, None] & d_ok[None, :])


def batch_tensors(query_lens: list[int], context_lens: list[int], block_tables: list[torch.Tensor],
                  device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """models/attention.py's PagedBatch lists → (cu_query_lens int32 [S + 1], context_lens int32 [S],
    block_tables int32 [S, max_pages], rows padded with page 0, never read past context_lens)."""
    S = len(query_lens)
    cu = torch.zeros(S + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    width = max([len(t) for t in block_tables] + [1])
    table = torch.zeros(S, width, dtype=torch.int32)
    for s, pages in enumerate(block_tables):
        table[s, : len(pages)] = pages.to("cpu", torch.int32)
    return (cu.to(device), torch.tensor(context_lens, dtype=torch.int32).to(device), table.to(device))


def _check_batch(q, cu_query_lens, context_lens, positions, block_tables) -> int:
    M = q.shape[0]
    S = context_lens.shape[0] if context_lens.dim() == 1 else -1
    for name, t, dtype, shape in (("cu_query_lens", cu_query_lens, torch.int32, (S + 1,)),
                                  ("context_lens", context_lens, torch.int32, (S,)),
                                  ("positions", positions, torch.int64, (M,))):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"paged_attention: {name} must be contiguous {dtype} {list(shape)}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != S \
            or (block_tables.shape[1] > 1 and block_tables.stride(1) != 1):
        raise ValueError(f"paged_attention: block_tables must be int32 [{S}, max_pages] with contiguous rows, "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    return S


def paged_attention(q: torch.Tensor, k_side: KVSide, v_side: KVSide, cu_query_lens: torch.Tensor,
                    context_lens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                    page_size: int, sliding_window: int | None = None, scale: float | None = None,
                    max_query_len: int | None = None, block_m: int | None = None,
                    block_n: int | None = None) -> torch.Tensor:
    """q [M, H, D] fp16/bf16/fp32 (rotated like the keys; last dim contiguous) attending over one
    layer's keys and values in the pool (runtime/engine/kv_cache.py's `KVPool.side`) → fp32 [M, H, D],
    still rotated.

    Batch (S sequences, queries concatenated in order):
      cu_query_lens int32 [S + 1]  query rows of sequence s are cu[s] .. cu[s+1] - 1; cu[S] = M
      context_lens  int32 [S]      cached tokens of s, this step's included (>= its positions + 1)
      positions     int64 [M]      each query row's position
      block_tables  int32 [S, max_pages]  page ids covering context_lens, any padding past them
    max_query_len: at least the longest n_s, if the caller knows it (a CUDA-graph decode does: 1);
    otherwise read from cu_query_lens, one device sync. Rows it leaves out are never written.
    block_m / block_n override the tile (tests)."""
    if q.dim() != 3 or q.dtype not in _FLOATS or (q.shape[2] > 1 and q.stride(2) != 1):
        raise ValueError(f"paged_attention: q must be fp16/bf16/fp32 [M, H, D] with a contiguous last dim, "
                         f"got {q.dtype} {tuple(q.shape)} strides {q.stride()}")
    M, H, D = q.shape
    k_group, v_group = (D if s.bits >= 16 else s.group for s in (k_side, v_side))  # 32, 16 bits: one tile of D
    Hkv = k_side.check(D, page_size, None, "paged_attention")[1]
    v_side.check(D, page_size, Hkv, "paged_attention")
    if H % Hkv:
        raise ValueError(f"paged_attention: {H} query heads do not share {Hkv} KV heads evenly")
    S = _check_batch(q, cu_query_lens, context_lens, positions, block_tables)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"paged_attention: sliding_window must be >= 1 or None, got {sliding_window}")
    tensors = (q, cu_query_lens, context_lens, positions, block_tables, *k_side.tensors().values(),
               *v_side.tensors().values())
    check_device(*tensors)
    if any(t.device != q.device for t in tensors):
        raise ValueError("paged_attention: q, the batch tensors and the pool must be on one device")
    out = torch.empty((M, H, D), dtype=torch.float32, device=q.device)
    if M == 0 or S == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max())
    qpk = H // Hkv
    qpk_p = triton.next_power_of_2(qpk)
    if block_m is None:
        # 64 tile rows for a prefill chunk; at least 16 (a decode step: one token, padded).
        block_m = max(1, min(triton.next_power_of_2(max(max_query_len, 1)), 64 // qpk_p), 16 // qpk_p)
    block_n = block_n or 32
    grid = (S, triton.cdiv(max(max_query_len, 1), block_m), Hkv)
    _paged_attention_kernel[grid](
        q, out, positions, cu_query_lens, context_lens, block_tables,
        *k_side.kernel_tensors(), *v_side.kernel_tensors(),
        q.stride(0), q.stride(1), block_tables.stride(0), H, Hkv, page_size,
        sliding_window or 0, float(scale if scale is not None else 1.0 / math.sqrt(D)),
        K_BITS=k_side.bits, V_BITS=v_side.bits, K_GROUP=k_group, V_GROUP=v_group, D=D, QPK=qpk, QPK_P=qpk_p,
        SLIDING=sliding_window is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(D),
        **({} if interpreting() else {"num_warps": 4 if block_m * qpk_p <= 16 else 8}))
    return out


def paged_attention_ref(q: torch.Tensor, k_side: KVSide, v_side: KVSide, cu_query_lens: torch.Tensor,
                        context_lens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                        page_size: int, sliding_window: int | None = None, scale: float | None = None,
                        **_launch) -> torch.Tensor:
    """The spec, in fp32: per sequence, gather its pages, dequantize, masked softmax attention —
    models/attention.py's PagedAttention without the rotation. Groups come from the buffers' shapes."""
    M, H, D = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out = torch.empty((M, H, D), dtype=torch.float32, device=q.device)
    cu, ctxs = cu_query_lens.tolist(), context_lens.tolist()
    for s, ctx in enumerate(ctxs):
        a, b = cu[s], cu[s + 1]
        if a == b:
            continue
        pages = block_tables[s, : -(-ctx // page_size)].long()
        kv = []
        for side in (k_side, v_side):
            x = side.pages(pages).dequantize()  # [n, Hkv, page, D]
            x = x.transpose(0, 1).flatten(1, 2)[:, :ctx]  # [Hkv, ctx, D]
            kv.append(x.repeat_interleave(H // x.shape[0], dim=0))  # [H, ctx, D]: query head h reads h // (H/Hkv)
        qs = q[a:b].float().transpose(0, 1)  # [H, n, D]
        scores = qs @ kv[0].transpose(1, 2) * scale  # [H, n, ctx]
        pos, j = positions[a:b], torch.arange(ctx, device=q.device)
        see = j[None, :] <= pos[:, None]  # [n, ctx]
        if sliding_window is not None:
            see &= j[None, :] > pos[:, None] - sliding_window
        p = scores.masked_fill(~see, float("-inf")).softmax(dim=-1)
        out[a:b] = (p @ kv[1]).transpose(0, 1)  # [n, H, D]
    return out
