"""Attention over the two caches a forward pass can be given.

- `ContiguousAttention`: the contiguous fp32 KVCache of models/llama.py (one batch of sequences
  that advance together: `lowbit run`'s loop, CUDA-graph decode).
- `PagedAttention`: the engine's paged, quantized pool (runtime/kv_cache.py). A step's batch is any
  mix of sequences, each bringing some new tokens (a prefill chunk, one decode token, or several
  speculative tokens) at its own positions; `PagedBatch` carries everything attention needs, as
  DESIGN.md asks: one dataclass, never a global. New K/V are written first, then every query
  attends over keys and values read back from the cache — its own included — so what a token sees
  is exactly what a later token will see (llama.cpp's convention; the quality test relies on it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PagedBatch:
    positions: torch.Tensor  # int64 [M]: position of each new token, sequences concatenated
    slots: torch.Tensor  # int64 [M]: cache slot each new token's K/V goes to
    query_lens: list[int]  # new tokens per sequence (sum = M)
    context_lens: list[int]  # tokens in the cache per sequence once this step's are written
    block_tables: list[torch.Tensor]  # int64 page ids per sequence, covering context_lens
    logits_rows: torch.Tensor  # int64 [R]: rows of M whose logits are wanted

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


class ContiguousAttention:
    def __init__(self, cache, start, mask, n_heads: int):
        self.cache, self.start, self.mask, self.n_heads = cache, start, mask, n_heads

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [M, H, D], k/v [M, Hkv, D] (M = B*T) → attention output fp32 [M, H*D]."""
        cache, start = self.cache, self.start
        B = cache.k.shape[1]
        M, H, D = q.shape
        T = M // B
        q = q.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, -1, D).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(B, T, -1, D).transpose(1, 2)  # [B, Hkv, T, D]
        if isinstance(start, int):
            cache.k[layer, :, :, start:start + T] = k
            cache.v[layer, :, :, start:start + T] = v
            keys = cache.k[layer, :, :, : start + T]  # [B, Hkv, S, D]
            values = cache.v[layer, :, :, : start + T]
        else:  # one token per sequence at its own position `start[b]`: static shapes (CUDA graphs)
            rows = torch.arange(B, device=start.device)
            cache.k[layer, rows, :, start] = k[:, :, 0].to(cache.k.dtype)  # [B, Hkv, D] into [B, Hkv, S, D]
            cache.v[layer, rows, :, start] = v[:, :, 0].to(cache.v.dtype)
            keys, values = cache.k[layer], cache.v[layer]  # [B, Hkv, S, D]: whole cache, masked
        attn = F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=self.mask,
                                              is_causal=self.mask is None and T > 1,
                                              enable_gqa=H != keys.shape[1])
        return attn.transpose(1, 2).reshape(M, H * D)  # [M, H*D]


class PagedAttention:
    def __init__(self, pool, batch: PagedBatch, sliding_window: int | None):
        self.pool, self.batch, self.window = pool, batch, sliding_window

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [M, H, D], k/v [M, Hkv, D] → fp32 [M, H*D]. The plain-torch path: per sequence, gather
        and dequantize its pages, then masked SDPA (kernels/ will read the pages directly)."""
        b = self.batch
        self.pool.write(layer, k, v, b.slots)
        M, H, D = q.shape
        out = torch.empty(M, H, D, dtype=torch.float32, device=q.device)
        row = 0
        for n, ctx, pages in zip(b.query_lens, b.context_lens, b.block_tables):
            keys, values = self.pool.gather(layer, pages, ctx)  # [Hkv, ctx, D]
            pos = b.positions[row:row + n]
            k_pos = torch.arange(ctx, device=q.device)
            mask = k_pos[None, :] <= pos[:, None]  # [n, ctx]
            if self.window is not None:
                mask &= k_pos[None, :] > pos[:, None] - self.window
            qs = q[row:row + n].float().transpose(0, 1)  # [H, n, D]
            o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=H != keys.shape[0])
            out[row:row + n] = o.transpose(0, 1)  # [n, H, D]
            row += n
        return out.reshape(M, H * D)
