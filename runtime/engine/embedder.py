"""Embeddings: a batch of texts' final hidden states, pooled and L2-normalized (`/v1/embeddings`).

The texts run as one prefill step through the runner's batch layout into a pool of their own
(lossless f32, freed after the call), on the path the engine prefills with: on CPU exact fp32, whose
rows do not depend on their company, so a text's embedding is the same alone or in a batch. Pooling
over the model's final normed hidden states: `mean` over the text's tokens (the default), or `last`
(the last token's, as decoder embedding models trained for it use).
"""

from __future__ import annotations

import torch

from lowbit.runtime.engine.runner import fresh_pool, prepare

POOLINGS = ("mean", "last")


@torch.inference_mode()
def embed(model, texts: list[list[int]], pooling: str = "mean") -> torch.Tensor:
    """texts: token ids of each (non-empty) → fp32 [len(texts), dim], each row of unit length."""
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; expected one of {', '.join(POOLINGS)}")
    pool, chunks = fresh_pool(model, texts, [len(t) if pooling == "mean" else 1 for t in texts])
    tokens, batch = prepare(chunks, model.device)
    h = model.forward_paged(tokens, batch, pool, None, hidden=True)  # [R, dim]: each chunk's wanted rows
    rows = h.split([ch.logits for ch in chunks])
    pooled = torch.stack([r.mean(0) for r in rows])  # [len(texts), dim]; `last` wanted one row each
    return torch.nn.functional.normalize(pooled.double(), dim=-1).float()
