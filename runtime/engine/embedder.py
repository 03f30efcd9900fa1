"""Embeddings: a batch of texts' final hidden states, pooled and L2-normalized (`/v1/embeddings`).

The texts run as one prefill step through the runner's batch layout into a pool of their own
(lossless f32, freed after the call), on the path the engine prefills with: on CPU exact fp32, whose
rows do not depend on their company, so a text's embedding is the same alone or in a batch. Pooling
over the model's final normed hidden states: `mean` over the text's tokens (the default), or `last`
(the last token's, as decoder embedding models trained for it use).
"""

from __future__ import annotations

import torch

from lowbit.quant.kv import KV_FORMATS
from lowbit.runtime.engine.kv_cache import KVPool
from lowbit.runtime.engine.runner import Chunk, prepare

POOLINGS = ("mean", "last")


@torch.inference_mode()
def embed(model, texts: list[list[int]], pooling: str = "mean", page_size: int = 16) -> torch.Tensor:
    """texts: token ids of each (non-empty) → fp32 [len(texts), dim], each row of unit length."""
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; expected one of {', '.join(POOLINGS)}")
    c = model.config
    chunks, first = [], 0
    for ids in texts:
        n = -(-len(ids) // page_size)
        pages = list(range(first, first + n))
        slots = [pages[p // page_size] * page_size + p % page_size for p in range(len(ids))]
        chunks.append(Chunk(list(ids), 0, slots, pages, logits=len(ids) if pooling == "mean" else 1))
        first += n
    pool = KVPool(KV_FORMATS["f32"], c.n_layers, model.kv_heads, c.head_dim, num_pages=max(first, 1),
                  page_size=page_size, device=model.device)
    tokens, batch = prepare(chunks, model.device)
    exact = True if model.backend.exact_prompts else None
    h = model.forward_paged(tokens, batch, pool, exact, hidden=True)  # [R, dim]: each chunk's wanted rows
    rows = h.split([ch.logits for ch in chunks])
    pooled = torch.stack([r.mean(0) for r in rows])  # [len(texts), dim]; `last` wanted one row each
    return torch.nn.functional.normalize(pooled.double(), dim=-1).float()
