"""Seeded random weights for a config, in any lowbit layout.

Speed depends only on shapes and layouts, so benchmarks that cannot carry a real checkpoint (a GPU
machine reached through a 64 MiB transfer limit) run a model with the real model's config and
layouts and these weights; the tests build tiny models the same way. Norm weights are ones.
"""

from __future__ import annotations

import torch

from lowbit.models.config import LlamaConfig
from lowbit.quant import Weight, parse_weights, quantize_weight

# SmolLM2-135M-Instruct as its GGUF describes it (the default model): Q4_1 blocks, Q8_0 tied table.
SMOLLM2_135M = LlamaConfig(arch="llama", dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                           hidden_dim=1536, vocab_size=49152, norm_eps=1e-5, rope_theta=100000.0,
                           max_seq_len=8192, tie_embeddings=True)


def random_weights(config: LlamaConfig, weights: str = "int4-g32", embed: str = "int8-g32", seed: int = 0,
                   scale: float = 0.4) -> dict[str, Weight | torch.Tensor]:
    """A weight dict named as runtime/load/gguf.py names it: N(0, scale^2) matrices quantized to
    `weights` (blocks) and `embed` (the embedding table, and the LM head unless tied)."""
    c = config
    g = torch.Generator().manual_seed(seed)
    block, table = parse_weights(weights), parse_weights(embed)

    def m(n: int, k: int, spec=block) -> Weight:
        return quantize_weight(torch.randn(n, k, generator=g) * scale, spec)

    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    w: dict = {"embed": m(c.vocab_size, c.dim, table), "norm": torch.ones(c.dim)}
    if not c.tie_embeddings:
        w["output"] = m(c.vocab_size, c.dim, table)
    for i in range(c.n_layers):
        p = f"layers.{i}."
        w |= {p + "attn_norm": torch.ones(c.dim), p + "ffn_norm": torch.ones(c.dim),
              p + "wq": m(q, c.dim), p + "wk": m(kv, c.dim), p + "wv": m(kv, c.dim), p + "wo": m(c.dim, q),
              p + "w_gate": m(c.hidden_dim, c.dim), p + "w_up": m(c.hidden_dim, c.dim),
              p + "w_down": m(c.dim, c.hidden_dim)}
    return w
