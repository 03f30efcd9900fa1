"""The Llama-family forward pass (Llama 2/3, Mistral, Qwen2, SmolLM2): RMSNorm, RoPE, GQA
attention, SwiGLU — with every projection a QuantLinear, so weights stay int4/int8.

Precision: the residual stream, norms, rotary and attention run in fp32. The weight-only matmuls
return fp32: exact for 16+ rows (prefill), through bf16 fused kernels for fewer (decode) unless
`exact=True` is passed (see kernels/int4_mm.py and runtime/generate.py's verified greedy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.models.config import LlamaConfig
from lowbit.models.rope import apply_rope, inv_frequencies, rope_tables
from lowbit.quant.linear import QuantEmbedding, QuantLinear, fuse_rows


@dataclass
class KVCache:
    """Contiguous fp32 cache for one batch of sequences that advance together (`lowbit run`,
    evaluation). The paged, quantized cache is the engine's."""

    k: torch.Tensor  # [n_layers, B, Hkv, S, D]
    v: torch.Tensor  # [n_layers, B, Hkv, S, D]

    @classmethod
    def empty(cls, config: LlamaConfig, batch: int, max_len: int) -> "KVCache":
        shape = (config.n_layers, batch, config.n_kv_heads, max_len, config.head_dim)
        return cls(torch.zeros(shape), torch.zeros(shape))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight.float(), persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Projections(nn.Module):
    """Several linears reading the same input (QKV, gate+up): one fused kernel call when their
    layouts match, separate calls otherwise. Returns the outputs split back apart."""

    def __init__(self, weights, biases):
        super().__init__()
        self.sizes = [w.shape[0] for w in weights]
        fused = fuse_rows(weights)
        if fused is not None:
            bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else torch.zeros(n) for b, n in zip(biases, self.sizes)])
            self.parts = nn.ModuleList([QuantLinear(fused, bias)])
        else:
            self.parts = nn.ModuleList([QuantLinear(w, b) for w, b in zip(weights, biases)])

    def forward(self, x: torch.Tensor, exact: bool | None) -> list[torch.Tensor]:
        if len(self.parts) == 1:
            return list(self.parts[0](x, exact).split(self.sizes, dim=-1))
        return [p(x, exact) for p in self.parts]


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, w: dict, prefix: str):
        super().__init__()
        c = config
        self.c = c
        self.attn_norm = RMSNorm(w[prefix + "attn_norm"], c.norm_eps)
        self.ffn_norm = RMSNorm(w[prefix + "ffn_norm"], c.norm_eps)
        self.qkv = Projections([w[prefix + n] for n in ("wq", "wk", "wv")],
                               [w.get(prefix + n) for n in ("bq", "bk", "bv")])
        self.wo = QuantLinear(w[prefix + "wo"])
        self.gate_up = Projections([w[prefix + "w_gate"], w[prefix + "w_up"]], [None, None])
        self.w_down = QuantLinear(w[prefix + "w_down"])

    def forward(self, x, layer: int, cos, sin, cache: KVCache, start: int, mask, exact: bool | None) -> torch.Tensor:
        c = self.c
        B, T, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x), exact)
        q = q.view(B, T, c.n_heads, c.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.k[layer, :, :, start:start + T] = k
        cache.v[layer, :, :, start:start + T] = v
        keys = cache.k[layer, :, :, : start + T]  # [B, Hkv, S, D]
        values = cache.v[layer, :, :, : start + T]
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None and T > 1,
                                              enable_gqa=c.n_heads != c.n_kv_heads)
        x = x + self.wo(attn.transpose(1, 2).reshape(B, T, c.n_heads * c.head_dim), exact)  # [B, T, H*D]
        gate, up = self.gate_up(self.ffn_norm(x), exact)
        return x + self.w_down(F.silu(gate) * up, exact)


class Llama(nn.Module):
    """Built from a config and a dict of weight layouts (names as runtime/gguf_loader.py gives)."""

    def __init__(self, config: LlamaConfig, weights: dict):
        super().__init__()
        self.config = config
        self.embed = QuantEmbedding(weights["embed"])
        self.layers = nn.ModuleList(Block(config, weights, f"layers.{i}.") for i in range(config.n_layers))
        self.norm = RMSNorm(weights["norm"], config.norm_eps)
        if "output" in weights:
            self.output = QuantLinear(weights["output"])
        else:
            # Tied: the LM head reads the embedding table itself when its layout has a kernel
            # (int8 tables are group-major and serve both); an int4 table gets a packed copy.
            shared = self.embed.w if not hasattr(self.embed.w, "codes") else weights["embed"]
            self.output = QuantLinear(shared, spec_name=weights["embed"].spec.name)
        self.register_buffer("inv_freq", inv_frequencies(config, weights.get("rope_freqs")), persistent=False)

    def forward(self, tokens: torch.Tensor, cache: KVCache, start: int, last_only: bool = False,
                exact: bool | None = None) -> torch.Tensor:
        """tokens int [B, T] at positions start..start+T-1 → logits fp32 [B, T, V] ([B, 1, V] if last_only).

        exact: True runs every matmul in fp32 on exactly dequantized weights, False through the fused
        bf16 kernels; None (default) lets each matmul choose by its row count — so prefill of 16+
        tokens is exact and single-token decode is fast."""
        B, T = tokens.shape
        if start + T > cache.max_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds the cache ({cache.max_len})")
        cos, sin = rope_tables(self.inv_freq, torch.arange(start, start + T))
        mask = self._mask(T, start)
        x = self.embed(tokens)  # [B, T, dim]
        for i, layer in enumerate(self.layers):
            x = layer(x, i, cos, sin, cache, start, mask, exact)
        if last_only:
            x = x[:, -1:]
        return self.output(self.norm(x), exact)

    def _mask(self, T: int, start: int) -> torch.Tensor | None:
        """bool [T, S] (True = attend), or None when plain causal attention is exact."""
        w = self.config.sliding_window
        if T == 1 and (w is None or start < w):
            return None  # one new token sees the whole (unmasked) prefix
        if start == 0 and (w is None or T <= w):
            return None
        q_pos = torch.arange(start, start + T)[:, None]
        k_pos = torch.arange(start + T)[None, :]
        mask = k_pos <= q_pos
        if w is not None:
            mask &= k_pos > q_pos - w
        return mask
