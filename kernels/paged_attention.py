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

Prefill (any step with a query run longer than 1), flash-style: one program per (sequence, block
of BLOCK_M query rows, KV head). Its tile holds the BLOCK_M rows of every query head sharing that KV
head (GQA, H / Hkv of them, padded to a power of 2) as BLOCK_M x QPK_P tile rows, so a page is read
and dequantized once for all of them — SmolLM2's 9 / 3 heads: 3 rows per token, 4 with padding; the
tile is at least 16 rows. Keys come BLOCK_N at a time; each key finds its page through the block
table, so BLOCK_N need not be a page (page_size 4 works as well as 16). Scores, the online softmax and P @ V are fp32 (the CUDA
precision policy keeps attention in fp32, docs/formats.md), with IEEE fp32 dots: the result matches
the plain-torch spec to a few fp32 ulps whatever q's dtype. No dequantized page is ever written to
memory.

Rows that attend alone — a decode's one row, every row of a speculative (one_by_one) chunk — go
split-KV (flash-decoding) instead: on the prefill grid a batch-1 SmolLM2 step would be 3 programs for
the whole GPU, each over the whole context, so the context is split as well. The keys a row sees,
[lo, hi), are cut from lo rounded down to BLOCK_N (64) into splits of 256 keys, larger (by multiples
of BLOCK_N) when a span needs more than max_splits (32) of them. The cut depends on the row's own
sequence context, position and window only, so its result is the same bits alone, in any batch, in a
mixed step, or as a row of a speculative chunk (which then matches decoding that token alone). Stage
1's grid is (M rows, Hkv, max_splits): each program attends its row's QPK query heads over one split
and writes the unnormalized acc [QPK, D], running max and sum to fp32 workspaces
[M, H, max_splits, D] and [M, H, max_splits, 2]; programs past a row's splits, or of a row the
prefill kernel takes, return at once. Stage 2, one program per (row, query head), merges the
partials in split order 0, 1, ... (the max, then the weighted sums) into the fp32 output. The grids
and workspaces follow from shapes and constants, never from the batch's values: no host read, so a
CUDA graph can capture a decode step. In the decode loop each token's scales (and mins) are loaded
once per group and folded, K's into the scores and V's into p.

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
def _paged_attention_kernel(q_ptr, o_ptr, pos_ptr, cu_ptr, ctx_ptr, bt_ptr, rs_ptr, sink_ptr,
                            kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr,
                            stride_qm, stride_qh, stride_bt, H, HKV, PAGE, window, scale,
                            K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                            V_GROUP: tl.constexpr, D: tl.constexpr, QPK: tl.constexpr, QPK_P: tl.constexpr,
                            SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq)
    n_q = tl.load(cu_ptr + seq + 1) - q_start
    first = tl.program_id(1) * BLOCK_M
    if first >= n_q:  # the grid covers the longest query run; shorter ones stop here
        return
    if tl.load(rs_ptr + q_start) >= 0:  # a sequence whose rows attend alone: the split-KV kernels'
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
    if HAS_SINKS:  # each query head's sink joins the max and the sum once, after every key; it adds no value
        sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0)  # [R]
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (tok[:, None] * H + head[:, None]) * D + d[None, :], out,
             mask=row_ok[:, None] & d_ok[None, :])


# ---- decode: split-KV (flash-decoding) --------------------------------------------------------------

# Decode tile: 64 keys a step, 4 warps. A program's tile is one token's QPK_P query heads (SmolLM2:
# 4 rows, 3 real), so the work per key is small and the loop is bound by its gathers: 64 keys of k8v4
# at D = 64 are 64 x (64 + 2) B of K and 64 x (32 + 4) B of V, 6.5 KB a step in flight per program.
# Compiled for sm_90 (k8v4, 9 / 3 heads) it takes 192 registers a thread and spills none: 2 programs
# of 4 warps an SM. 32 keys take 126 (4 an SM) but half the bytes in flight, which a one-sequence
# decode (3 x n_splits programs on 132 SMs) needs more than residency; 128 keys, 196 registers for
# no more programs an SM. 2 warps at 32 keys spill.
DECODE_BLOCK_N = 64
DECODE_WARPS = 4
MERGE_WARPS = 1  # a merge program reads n_splits x (D + 2) floats and writes D: 64 of them, 2 a thread
# Keys per split: 256 (4 steps of 64), growing in steps of BLOCK_N once a span passes MAX_SPLITS x 256
# tokens. At 256 a split reads ~26 KB of k8v4 pages against 1 KB of partial written (QPK_P x D fp32), so
# the merge adds < 5% of the traffic; 32 splits put a one-sequence decode of 8192 tokens on 96 SMs (3
# KV heads), and the workspace is M x H x 32 x (D + 2) fp32 (a 64-sequence SmolLM2 step: 4.9 MB).
DECODE_KV_SPLIT = 256
DECODE_MAX_SPLITS = 32


@triton.jit
def _decode_span(ctx, qpos, window, SLIDING: tl.constexpr, KV_SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The keys a decode row sees, [lo, hi), and how they are split: from base (lo rounded down to
    BLOCK_N) in chunks of `chunk` keys (KV_SPLIT, or more so that MAX_SPLITS cover the span), n_splits
    of them. Only this sequence's context length and position enter: its splits are the same in any
    batch. Stage 1 and the merge both call it, so they agree on n_splits without a shared array."""
    hi = tl.minimum(ctx, qpos + 1)  # the min keeps a short block table safe if positions ran past it
    lo = hi * 0  # int64 like hi: the two branches must give lo one type
    if SLIDING:
        lo = tl.maximum(qpos - window + 1, 0)
    base = lo - lo % BLOCK_N
    span = tl.maximum(hi - base, 0)
    chunk = tl.maximum(KV_SPLIT, tl.cdiv(tl.cdiv(span, MAX_SPLITS), BLOCK_N) * BLOCK_N)
    return lo, hi, base, chunk, tl.cdiv(span, chunk)


@triton.jit
def _load_codes(c_ptr, rows, d, ok, BITS: tl.constexpr, D: tl.constexpr):
    """The raw values at pool rows `rows`, columns d (broadcastable) → fp32: the data of a float side,
    the codes (int8 q, int4 u) of a quantized one, 0 where not ok. Scales are the caller's."""
    if BITS >= 16:
        x = tl.load(c_ptr + rows * D + d, mask=ok, other=0.0).to(tl.float32)
    elif BITS == 8:
        x = tl.load(c_ptr + rows * D + d, mask=ok, other=0).to(tl.float32)
    else:
        byte = tl.load(c_ptr + rows * (D // 2) + d // 2, mask=ok, other=0).to(tl.int32)
        x = ((byte >> ((d % 2) * 4)) & 0xF).to(tl.float32)  # value 2k in the low nibble, 2k + 1 in the high
    return x


@triton.jit
def _paged_decode_split_kernel(q_ptr, acc_ptr, ml_ptr, pos_ptr, rs_ptr, ctx_ptr, bt_ptr,
                               kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr,
                               stride_qm, stride_qh, stride_bt, H, HKV, PAGE, window, scale,
                               K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                               V_GROUP: tl.constexpr, D: tl.constexpr, QPK: tl.constexpr, QPK_P: tl.constexpr,
                               GK_P: tl.constexpr, KG_P: tl.constexpr, GV_P: tl.constexpr, VG_P: tl.constexpr,
                               SLIDING: tl.constexpr, KV_SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr,
                               BLOCK_N: tl.constexpr):
    """Stage 1: program (query row, KV head, split) attends one query row of its sequence
    (rs_ptr[row]; -1: a row of the prefill kernel's), all QPK query heads of the KV head, over one
    chunk of the keys that row sees → unnormalized acc [QPK, D], running max m and sum l.
    Tiles are [group, row, column]: a quantized side's scales d (and mins m) are loaded once per token
    and group and folded, K's into the scores and V's into p, so no dequantized key or value is formed:
    for codes c, s = sum_g d_g (q_g . c_g) (+ m_g sum(q_g)) and o = sum_g (p d_g) @ c_g (+ p @ m_g)."""
    tok = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(rs_ptr + tok)
    if seq < 0:
        return
    qpos = tl.load(pos_ptr + tok)
    lo, hi, base, chunk, n_splits = _decode_span(tl.load(ctx_ptr + seq), qpos, window, SLIDING, KV_SPLIT,
                                                 MAX_SPLITS, BLOCK_N)
    if split >= n_splits:  # the grid has MAX_SPLITS; the merge reads only the first n_splits
        return
    start = base + split * chunk
    stop = tl.minimum(start + chunk, hi)
    tok = tok.to(tl.int64)

    r = tl.arange(0, QPK_P)  # tile row r: query head kvh * QPK + r
    head = kvh * QPK + r
    row_ok = r < QPK
    # K's groups: GK of K_GROUP columns each (one of D for a float side), padded to GK_P of KG_P
    GK: tl.constexpr = D // K_GROUP
    gk = tl.arange(0, GK_P)
    ek = tl.arange(0, KG_P)
    dk = gk[:, None] * K_GROUP + ek[None, :]  # [GK_P, KG_P] column of group g, element e
    dk_ok = (gk[:, None] < GK) & (ek[None, :] < K_GROUP)
    q = tl.load(q_ptr + tok * stride_qm + head[None, :, None] * stride_qh + dk[:, None, :],
                mask=row_ok[None, :, None] & dk_ok[:, None, :], other=0.0).to(tl.float32)  # [GK_P, R, KG_P]
    if K_BITS == 4:
        q_sum = tl.sum(q, axis=2)[:, :, None]  # [GK_P, R, 1]: what each group's min multiplies
    GV: tl.constexpr = D // V_GROUP
    gv = tl.arange(0, GV_P)
    ev = tl.arange(0, VG_P)
    dv = gv[:, None] * V_GROUP + ev[None, :]  # [GV_P, VG_P]
    dv_ok = (gv[:, None] < GV) & (ev[None, :] < V_GROUP)

    m_i = tl.full((QPK_P,), -1e30, tl.float32)  # finite: a padded row's p is 0, not nan
    l_i = tl.zeros((QPK_P,), tl.float32)
    acc = tl.zeros((GV_P, QPK_P, VG_P), tl.float32)
    for blk in range(start, stop, BLOCK_N):
        j = blk + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        j_ok = (j >= lo) & (j < stop)
        page = tl.load(bt_ptr + seq * stride_bt + j // PAGE, mask=j_ok, other=0).to(tl.int64)
        rows = (page * HKV + kvh) * PAGE + j % PAGE  # [BLOCK_N] pool row (page, head, offset)
        k_ok = dk_ok[:, :, None] & j_ok[None, None, :]
        kq = _load_codes(kc_ptr, rows[None, None, :], dk[:, :, None], k_ok, K_BITS, D)  # [GK_P, KG_P, BLOCK_N]
        s = tl.dot(q, kq, input_precision="ieee")  # [GK_P, R, BLOCK_N]
        if K_BITS < 16:
            g_ok = (gk[:, None, None] < GK) & j_ok[None, None, :]
            sc_ptr = rows[None, None, :] * GK + gk[:, None, None]  # [GK_P, 1, BLOCK_N]
            s = s * tl.load(ks_ptr + sc_ptr, mask=g_ok, other=0.0).to(tl.float32)
            if K_BITS == 4:
                s += q_sum * tl.load(km_ptr + sc_ptr, mask=g_ok, other=0.0).to(tl.float32)
        s = tl.sum(s, axis=0) * scale  # [R, BLOCK_N]
        s = tl.where(row_ok[:, None] & j_ok[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [R, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ok = j_ok[None, :, None] & dv_ok[:, None, :]
        vq = _load_codes(vc_ptr, rows[None, :, None], dv[:, None, :], v_ok, V_BITS, D)  # [GV_P, BLOCK_N, VG_P]
        pg = p[None, :, :]  # [1, R, BLOCK_N]
        if V_BITS < 16:
            g_ok = (gv[:, None, None] < GV) & j_ok[None, None, :]
            sc_ptr = rows[None, None, :] * GV + gv[:, None, None]  # [GV_P, 1, BLOCK_N]
            pg = pg * tl.load(vs_ptr + sc_ptr, mask=g_ok, other=0.0).to(tl.float32)  # [GV_P, R, BLOCK_N]
        pv = tl.dot(pg, vq, input_precision="ieee")  # [GV_P, R, VG_P]
        if V_BITS == 4:
            mn = tl.load(vm_ptr + sc_ptr, mask=g_ok, other=0.0).to(tl.float32)  # [GV_P, 1, BLOCK_N]
            pv += tl.sum(p[None, :, :] * mn, axis=2)[:, :, None]  # sum_n p m_g: the mins' share
        acc = acc * alpha[None, :, None] + pv
        m_i = m_new
    part = (tok * H + head) * MAX_SPLITS + split  # [R] workspace row (query row, head, split)
    tl.store(acc_ptr + part[None, :, None] * D + dv[:, None, :], acc, mask=row_ok[None, :, None] & dv_ok[:, None, :])
    tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _paged_decode_merge_kernel(acc_ptr, ml_ptr, o_ptr, pos_ptr, rs_ptr, ctx_ptr, sink_ptr, H, window,
                               SLIDING: tl.constexpr, KV_SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr,
                               BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                               HAS_SINKS: tl.constexpr):
    """Stage 2: program (query row, query head) merges its n_splits partials in split order 0, 1, ...
    (max first, then one weighted sum: the same additions in the same order in any batch) → o [D]. The
    head's sink, if any, joins the max and the sum here, once a row, whatever its number of splits."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(rs_ptr + tok)
    if seq < 0:
        return
    qpos = tl.load(pos_ptr + tok)
    n_splits = _decode_span(tl.load(ctx_ptr + seq), qpos, window, SLIDING, KV_SPLIT, MAX_SPLITS, BLOCK_N)[4]
    row = (tok.to(tl.int64) * H + head) * MAX_SPLITS  # the first of this (query row, head)'s partials
    m = tl.full([], -1e30, tl.float32)
    if HAS_SINKS:
        sink = tl.load(sink_ptr + head)
        m = tl.maximum(m, sink)  # a sink of -inf leaves m finite: its share below is then 0
    for i in range(0, n_splits):
        m = tl.maximum(m, tl.load(ml_ptr + (row + i) * 2))
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    l_sum = tl.full([], 0.0, tl.float32)
    for i in range(0, n_splits):
        w = tl.exp(tl.load(ml_ptr + (row + i) * 2) - m)
        l_sum += w * tl.load(ml_ptr + (row + i) * 2 + 1)
        acc += w * tl.load(acc_ptr + (row + i) * D + d, mask=d < D, other=0.0)
    if HAS_SINKS:
        l_sum += tl.exp(sink - m)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)  # l = 0 (no key visible): 0, as the prefill kernel gives
    tl.store(o_ptr + (tok.to(tl.int64) * H + head) * D + d, out, mask=d < D)


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


def split_rows(query_lens: list[int], one_by_one: list[bool] | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (split_rows int32 [M], alone int64 [R]). split_rows: for each query row, its sequence if the
    row attends alone through the split-KV kernels — every row of a one-row sequence (a decode) and
    of a one_by_one sequence (a speculative chunk: each row then computes exactly what decoding that
    token alone would) — else -1 (a prefill chunk's rows, tiled together by the prefill kernel).
    alone: the R rows that attend alone, so a mixed step runs the split-KV kernels over those rows
    only (their workspace is R rows, not M; none at all in a prefill step)."""
    rows = []
    for s, n in enumerate(query_lens):
        alone = n == 1 or bool(one_by_one and one_by_one[s])
        rows += [s if alone else -1] * n
    alone = [i for i, s in enumerate(rows) if s >= 0]
    return torch.tensor(rows, dtype=torch.int32).to(device), torch.tensor(alone, dtype=torch.long).to(device)


def _rows_of(cu_query_lens: torch.Tensor, M: int) -> torch.Tensor:
    """split_rows computed on the device from cu_query_lens alone (no one_by_one): the sequence of
    every row of a one-row sequence, -1 for the rest. A few small kernels; no host read."""
    seq = torch.searchsorted(cu_query_lens[1:], torch.arange(M, device=cu_query_lens.device, dtype=torch.int32),
                             right=True)  # [M] sequence of each row
    n = (cu_query_lens[1:] - cu_query_lens[:-1])[seq]
    return torch.where(n == 1, seq, -1).to(torch.int32)


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
                    block_n: int | None = None, kv_split: int | None = None,
                    max_splits: int | None = None, split_rows: torch.Tensor | None = None,
                    alone: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
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
    split_rows int32 [M] (`split_rows()`; default: the rows of one-row sequences, found on the device)
    says which rows attend alone through the split-KV kernels — keys in splits of `kv_split` tokens
    (default 256, a multiple of block_n), at most `max_splits` (default 32) a row, the split growing
    past that — whatever company they keep: a decode row gives the same bits in a decode step, in a
    mixed step and as a row of a one_by_one chunk. The other rows take the prefill kernel, which
    max_query_len 1 skips; then there is no host read, and the launch can be captured in a CUDA graph.
    alone int64 [R]: the rows split_rows marks, if the caller knows them (`split_rows()` gives both):
    with max_query_len > 1 the split-KV kernels then run over those R rows only.
    sinks fp32 [H] (gpt-oss's attention sinks: a logit per query head in every row's softmax, with no
    value) or None.
    block_m / block_n / kv_split / max_splits override the tile and the split (tests)."""
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
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (H,) or not sinks.is_contiguous()):
        raise ValueError(f"paged_attention: sinks must be contiguous fp32 [{H}], got {sinks.dtype} {tuple(sinks.shape)}")
    tensors = (q, cu_query_lens, context_lens, positions, block_tables, *k_side.tensors().values(),
               *v_side.tensors().values(), *(() if sinks is None else (sinks,)))
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
    scale = float(scale if scale is not None else 1.0 / math.sqrt(D))
    if split_rows is None:
        split_rows = _rows_of(cu_query_lens, M)
    elif split_rows.dtype != torch.int32 or tuple(split_rows.shape) != (M,) or split_rows.device != q.device:
        raise ValueError(f"paged_attention: split_rows must be int32 [{M}] on {q.device}, got {split_rows.dtype} "
                         f"{tuple(split_rows.shape)}")
    sink_ptr = out if sinks is None else sinks  # without sinks: a pointer the kernels never read (HAS_SINKS off)
    decode = (k_side, v_side, context_lens, block_tables, page_size, sliding_window, scale, block_n, kv_split,
              max_splits, sinks, sink_ptr)
    if max_query_len == 1 or alone is None:
        _decode(q, out, split_rows, positions, *decode)
    elif alone.numel():  # a mixed step: the alone rows gathered, attended, put back
        part = torch.empty((alone.numel(), H, D), dtype=torch.float32, device=q.device)
        _decode(q[alone], part, split_rows[alone], positions[alone], *decode)
        out[alone] = part
    if max_query_len == 1:
        return out
    if block_m is None:
        # 64 tile rows for a prefill chunk; at least 16 (a decode step: one token, padded).
        block_m = max(1, min(triton.next_power_of_2(max(max_query_len, 1)), 64 // qpk_p), 16 // qpk_p)
    block_n = block_n or 32
    grid = (S, triton.cdiv(max(max_query_len, 1), block_m), Hkv)
    _paged_attention_kernel[grid](
        q, out, positions, cu_query_lens, context_lens, block_tables, split_rows, sink_ptr,
        *k_side.kernel_tensors(), *v_side.kernel_tensors(),
        q.stride(0), q.stride(1), block_tables.stride(0), H, Hkv, page_size,
        sliding_window or 0, scale,
        K_BITS=k_side.bits, V_BITS=v_side.bits, K_GROUP=k_group, V_GROUP=v_group, D=D, QPK=qpk, QPK_P=qpk_p,
        SLIDING=sliding_window is not None, HAS_SINKS=sinks is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(D),
        **({} if interpreting() else {"num_warps": 4 if block_m * qpk_p <= 16 else 8}))
    return out


def decode_constexprs(D: int, qpk: int, k_bits: int, k_group: int, v_bits: int, v_group: int, sliding: bool,
                      block_n: int | None = None, kv_split: int | None = None,
                      max_splits: int | None = None, sinks: bool = False) -> tuple[dict, dict]:
    """The decode kernels' compile-time constants (stage 1's, the merge's) for one layer's shapes: what
    the launcher passes, and what a test compiles ahead for a GPU target. Groups are the sides'
    (D for a float side); sinks: whether the merge adds attention sinks."""
    block_n = block_n or DECODE_BLOCK_N
    kv_split = kv_split or DECODE_KV_SPLIT
    max_splits = max_splits or DECODE_MAX_SPLITS
    if kv_split % block_n or max_splits < 1:
        raise ValueError(f"paged_attention: kv_split ({kv_split}) must be a multiple of block_n ({block_n}) "
                         f"and max_splits ({max_splits}) >= 1")
    np2 = triton.next_power_of_2
    split = dict(SLIDING=sliding, KV_SPLIT=kv_split, MAX_SPLITS=max_splits, BLOCK_N=block_n)
    stage1 = dict(K_BITS=k_bits, V_BITS=v_bits, K_GROUP=k_group, V_GROUP=v_group, D=D, QPK=qpk, QPK_P=np2(qpk),
                  GK_P=np2(D // k_group), KG_P=np2(k_group), GV_P=np2(D // v_group), VG_P=np2(v_group), **split)
    return stage1, dict(**split, D=D, BLOCK_D=np2(D), HAS_SINKS=sinks)


def _decode(q, out, split_rows, positions, k_side, v_side, context_lens, block_tables, page_size,
            sliding_window, scale, block_n, kv_split, max_splits, sinks, sink_ptr) -> None:
    """paged_attention for the rows that attend alone (split_rows >= 0): split-KV stage 1 into an
    fp32 workspace, then the merge into out. The grid and the workspace depend on shapes and
    constants only, never on the batch's values: no host read, and a CUDA graph can capture the
    launch. (Rows of the prefill kernel's exit at once.)"""
    M, H, D = q.shape
    Hkv = k_side.n_kv_heads
    k_group, v_group = (D if s.bits >= 16 else s.group for s in (k_side, v_side))
    stage1, stage2 = decode_constexprs(D, H // Hkv, k_side.bits, k_group, v_side.bits, v_group,
                                       sliding_window is not None, block_n, kv_split, max_splits, sinks is not None)
    n = stage1["MAX_SPLITS"]
    acc = torch.empty((M, H, n, D), dtype=torch.float32, device=q.device)  # unnormalized P @ V of each split
    ml = torch.empty((M, H, n, 2), dtype=torch.float32, device=q.device)  # (running max, sum of p) of each split
    _paged_decode_split_kernel[(M, Hkv, n)](
        q, acc, ml, positions, split_rows, context_lens, block_tables,
        *k_side.kernel_tensors(), *v_side.kernel_tensors(),
        q.stride(0), q.stride(1), block_tables.stride(0), H, Hkv, page_size, sliding_window or 0, scale,
        **stage1, **({} if interpreting() else {"num_warps": DECODE_WARPS}))
    _paged_decode_merge_kernel[(M, H)](
        acc, ml, out, positions, split_rows, context_lens, sink_ptr, H, sliding_window or 0,
        **stage2, **({} if interpreting() else {"num_warps": MERGE_WARPS}))

def paged_attention_ref(q: torch.Tensor, k_side: KVSide, v_side: KVSide, cu_query_lens: torch.Tensor,
                        context_lens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                        page_size: int, sliding_window: int | None = None, scale: float | None = None,
                        sinks: torch.Tensor | None = None, **_launch) -> torch.Tensor:
    """The spec, in fp32: per sequence, gather its pages, dequantize, masked softmax attention —
    models/attention.py's PagedAttention without the rotation. Groups come from the buffers' shapes.
    sinks [H]: one more logit per query head in every row's softmax, whose probability is then dropped."""
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
        scores = scores.masked_fill(~see, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(H, b - a, 1)  # [H, n, 1]
            p = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            p = scores.softmax(dim=-1)
        out[a:b] = (p @ kv[1]).transpose(0, 1)  # [n, H, D]
    return out
