"""The exact path's fp32 GEMM, each row's result independent of how many rows share the call.

torch's CPU GEMM (MKL) chooses its kernel by the number of rows: measured on an AMD EPYC (Zen 4,
torch 2.13's MKL 2024.2), a row of x @ W came out different in its last bits when the call had
M = 1, 2 or 3 rows (1 thread), or M in {1, 2, 3, 5, 6, 7, 9, 10, 11} (2 threads), than when it had 12
or more — identical at every M tried from 12 to 512, for the default model's shapes and 2048x2048.
The engine computes prompt rows exactly in steps of any size (a prefix-cache hit leaves a short
tail, a step mixes several prompts), so without this a row's numbers, and a greedy reply, would
depend on its company. Calls of fewer than MIN_ROWS rows are padded with zero rows to MIN_ROWS: the
dequantized weight, not the rows, is what such a call costs (tests/test_quant.py checks the rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.kernels.tile_layout import TILE

MIN_ROWS = 16
# The exact path dequantizes a weight a range of output rows at a time, ~4M weights (16 MB fp32) each:
# under glibc's largest mmap threshold (32 MB), so the buffer is heap memory used again call after call.
# A whole 2048x8192 weight (64 MB) was mapped, faulted in and zeroed by the kernel on every call: a
# 20-token prefill at SmolLM2-1.7B's shapes took 3.4 s through the engine that way (885K page faults),
# 2.05 s in ranges (none).
TILE_ELEMS = 1 << 22


def takes_exact(exact: bool | None) -> bool:
    """Whether a matmul takes the exact path: only when asked (`exact` True). Left open (None), every
    M takes the C kernels where a weight has them: their integer sums run M-tiled over the packed weights
    (prompts too), and a row's result is the same at every M, so nothing is gained by switching paths by
    size (a 512-row call of the 1.7B shapes' 2048x8192 int4 weight: ~100 ms against ~250 for the exact
    path's dequantize + fp32 GEMM, AMD EPYC Zen 4, 2 threads)."""
    return bool(exact)


def _padded(x: torch.Tensor) -> torch.Tensor:
    M = x.shape[0]
    return F.pad(x, (0, 0, 0, MIN_ROWS - M)) if 0 < M < MIN_ROWS else x


def exact_mm(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """x fp32 [M, K] @ wt fp32 [K, N] → [M, N]."""
    return (_padded(x) @ wt)[: x.shape[0]]


def exact_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x fp32 [M, K] @ w fp32 [N, K]^T → [M, N]."""
    return F.linear(_padded(x), w)[: x.shape[0]]


def in_tiles(N: int, K: int, part) -> torch.Tensor:
    """y [M, N] from part(start, stop) → y[:, start:stop], over ranges of whole 16-row tiles of at most
    ~TILE_ELEMS weights (N rows of K). Each range is its own GEMM; a row's result still does not depend
    on M, as the ranges do not."""
    step = max(TILE, TILE_ELEMS // K // TILE * TILE)
    if step >= N:
        return part(0, N)
    return torch.cat([part(i, min(i + step, N)) for i in range(0, N, step)], dim=-1)
