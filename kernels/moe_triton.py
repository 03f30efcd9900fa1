"""Grouped expert matmul on the GPU (Triton): every expert a step uses, in one launch per projection.

The per-expert loop (models/moe.py `_per_expert`) launches one matmul per chosen expert and
projection and reads the routing on the host (`ids.tolist()`): a Qwen3-30B-A3B decode token is 48
layers x 8 experts x 2 projections = 768 launches and 48 host syncs, and the sync forbids a CUDA
graph. Here a step's (token, expert) pairs are sorted by expert on the device, each expert's run
padded to whole BLOCK_M-row tiles, and one launch per projection multiplies every tile by its own
expert's weights (vLLM's fused_moe groups tokens the same way): no host sync, 2 launches a layer.

The experts' weights are GGUF's blocks as the file holds them (kernels/ggml_triton.py decodes them
in registers), stacked [E, N, row bytes] so a tile finds its expert by offset; each expert's
QuantLinear keeps a view of the stack, so the bytes are held once. A tile is the per-expert kernel's
tile: the same rows (the expert's tokens in ascending order, zero rows after them), the same chunk
order and the same dot, so an expert's outputs are the loop's bit for bit, and the weighted sum adds
each token's k outputs in ascending expert order as the loop does (tests/test_moe_triton.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.kernels.ggml_blocks import BLOCKS
from lowbit.kernels.ggml_triton import SUB16, GgmlTritonPacked, _chunk
from lowbit.kernels.triton_import import check_device, tl, triton

BLOCK_M, BLOCK_N = 16, 32  # ggml_triton_mm's tile, so a tile's arithmetic is the loop's


@dataclass
class GroupedRun:
    data: torch.Tensor  # uint8 [E, n, row bytes]: every expert's rows of one GGML type
    qtype: int


@dataclass
class GroupedGgml:
    """One projection (gate+up, or down) of all E experts: up to two runs along N, as a fused
    GgmlTritonPacked has (gate and up of different types)."""

    runs: list[GroupedRun]
    in_features: int  # K
    kvalues: torch.Tensor  # int32 [32]: the codebooks ggml_triton's kernel reads
    bias: torch.Tensor | None  # fp32 [E, N] (gpt-oss) or None

    @property
    def out_features(self) -> int:
        return sum(r.data.shape[1] for r in self.runs)


def stack_experts(packed: list[GgmlTritonPacked], biases: list) -> GroupedGgml | None:
    """The experts' packed weights stacked [E, n, row bytes], each expert's tensors then replaced by views of
    the stack (the caller re-registers them); None when their types or shapes differ (then the loop runs)."""
    first = packed[0]
    for p in packed:
        if not isinstance(p, GgmlTritonPacked) or (p.qtype, p.qtype2, p.in_features) != (
                first.qtype, first.qtype2, first.in_features) or p.data.shape != first.data.shape or (
                (p.data2 is None) != (first.data2 is None)) or (p.data2 is not None and p.data2.shape != first.data2.shape):
            return None
    if any((b is None) != (biases[0] is None) for b in biases):
        return None
    runs = [GroupedRun(torch.stack([p.data for p in packed]), first.qtype)]
    for p, view in zip(packed, runs[0].data):
        p.data = view
    if first.data2 is not None:
        runs.append(GroupedRun(torch.stack([p.data2 for p in packed]), first.qtype2))
        for p, view in zip(packed, runs[1].data):
            p.data2 = view
    bias = None if biases[0] is None else torch.stack([b.float() for b in biases])  # [E, N]
    return GroupedGgml(runs, first.in_features, first.kvalues, bias)


@dataclass
class Routing:
    """A step's (token, slot) pairs sorted by expert, each expert's run padded to whole tiles.

    rows [P] int32: the token of each padded position (-1: padding), P = blocks x BLOCK_M;
    block_expert [blocks] int64: each tile's expert (E: an unused tile, which exits);
    where [M, k] int64: the padded position of each token's slot."""

    rows: torch.Tensor
    block_expert: torch.Tensor
    where: torch.Tensor

    @property
    def blocks(self) -> int:
        return self.block_expert.shape[0]


def sort_by_expert(ids: torch.Tensor, n_experts: int) -> Routing:
    """ids int64 [M, k] → the Routing, on ids' device without a host sync (so a decode step can be a CUDA
    graph): at most cdiv(M k, BLOCK_M) + min(M k, E) tiles, a fixed count for a given M."""
    M, k = ids.shape
    A = M * k
    flat = ids.reshape(-1)  # [A]: pair a = token a // k, slot a % k
    order = torch.sort(flat, stable=True).indices  # [A]: by expert, ascending tokens within one
    counts = torch.bincount(flat, minlength=n_experts)  # [E]
    tiles = (counts + BLOCK_M - 1) // BLOCK_M  # [E]
    tiles_end = torch.cumsum(tiles, 0)
    first_row = (tiles_end - tiles) * BLOCK_M  # [E]: each expert's first padded position
    first_pair = torch.cumsum(counts, 0) - counts  # [E]: its first pair in `order`
    sorted_e = flat[order]
    pos = first_row[sorted_e] + torch.arange(A, device=ids.device) - first_pair[sorted_e]  # [A]
    blocks = triton.cdiv(A, BLOCK_M) + min(A, n_experts)
    rows = torch.full((blocks * BLOCK_M,), -1, dtype=torch.int32, device=ids.device)
    rows[pos] = (order // k).to(torch.int32)
    where = torch.empty(A, dtype=torch.int64, device=ids.device)
    where[order] = pos
    block_expert = torch.searchsorted(tiles_end, torch.arange(blocks, device=ids.device), right=True)
    return Routing(rows, block_expert, where.reshape(M, k))


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, kv_ptr, y_ptr, rows_ptr, expert_ptr, N, K, row_bytes, expert_bytes,
                    stride_xm, stride_ym, E,
                    QTYPE: tl.constexpr, QK: tl.constexpr, NB: tl.constexpr, CK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATHER: tl.constexpr, IEEE: tl.constexpr):
    """Tile pid_m of the sorted pairs (its expert from expert_ptr) x columns pid_n: ggml_triton's
    _ggml_mm_kernel with x's rows gathered (GATHER: row r of x is token rows[r]; else position r)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e < E:
        offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # padded positions
        token = tl.load(rows_ptr + offs_p)
        m_ok = token >= 0
        if GATHER:
            offs_m = tl.where(m_ok, token, 0)
        else:
            offs_m = offs_p
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        base = w_ptr + e.to(tl.int64) * expert_bytes
        rows = base + tl.where(n_ok, offs_n, 0).to(tl.int64)[:, None] * row_bytes  # [BN, 1]: row starts
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, CK):
            p = rows + (k0 // QK) * NB  # [BN, 1]: the block holding this chunk
            c, a, b = _chunk(p, k0 % QK, kv_ptr, QTYPE, CK, BLOCK_N)  # [BN, CK], [BN, 1], [BN, 1]
            offs_k = k0 + tl.arange(0, CK)
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=m_ok[:, None],
                        other=0.0)
            if IEEE:
                t = tl.dot(x, tl.trans(c), input_precision="ieee")
            else:
                t = tl.dot(x, tl.trans(c.to(x.dtype)))
            acc += t * tl.trans(a) + tl.sum(x.to(tl.float32), axis=1)[:, None] * tl.trans(b)
        tl.store(y_ptr + offs_p[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def grouped_mm(x: torch.Tensor, w: GroupedGgml, routing: Routing, gather: bool,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] tokens (gather) or [P, K] padded positions → y [P, N] at padded positions (padding rows 0),
    each tile times its expert's weights (+ its bias, rounded as QuantLinear adds one): one launch per run."""
    K = x.shape[1]
    if K != w.in_features:
        raise ValueError(f"grouped_mm: input {tuple(x.shape)} for K={w.in_features}")
    check_device(x, w.runs[0].data)
    x = x.contiguous()
    E, P = w.runs[0].data.shape[0], routing.rows.shape[0]
    y = torch.zeros(P, w.out_features, dtype=out_dtype or x.dtype, device=x.device)
    col = 0
    for run in w.runs:
        _, n, row_bytes = run.data.shape
        _, qk, nb = BLOCKS[run.qtype]
        out = y[:, col:col + n]
        grid = (routing.blocks, triton.cdiv(n, BLOCK_N))
        _grouped_kernel[grid](x, run.data, w.kvalues, out, routing.rows, routing.block_expert, n, K, row_bytes,
                              n * row_bytes, x.stride(0), out.stride(0), E,
                              QTYPE=run.qtype, QK=qk, NB=nb, CK=16 if run.qtype in SUB16 else 32,
                              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GATHER=gather, IEEE=x.dtype == torch.float32)
        col += n
    if w.bias is not None:  # QuantLinear's (y.float() + b).to(y.dtype), each row its expert's bias
        row_expert = routing.block_expert.clamp(max=E - 1).repeat_interleave(BLOCK_M)  # [P]
        y = (y.float() + w.bias[row_expert]).to(y.dtype)
    return y

