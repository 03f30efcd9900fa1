"""A prompt's own log-probabilities (`/v1/completions` with `echo` and `logprobs`: what
lm-evaluation-harness's loglikelihood tasks read).

One pass over the prompt on the exact path (fp32 on exactly dequantized weights) into a lossless f32
pool of its own, so the numbers are the exact model's — the weights' format alone, as `lowbit eval`'s
reference is — whatever KV format the engine serves with.
"""

from __future__ import annotations

import torch

from lowbit.runtime.engine.runner import Runner, fresh_pool
from lowbit.runtime.engine.sampler import mask_padding


@torch.inference_mode()
def prompt_logprobs(model, ids: list[int], top: int,
                    vocab_size: int) -> list[tuple[float | None, list[tuple[int, float]]]]:
    """→ per prompt token (logprob of it given the tokens before, its `top` most likely alternatives
    there); the first token has none: (None, [])."""
    if len(ids) < 2:
        return [(None, [])]
    pool, chunks = fresh_pool(model, [ids])
    # logits of positions 0..T-2 predict tokens 1..T-1; the last position's would predict the reply
    logits = Runner(model, pool).run(chunks, True)[:-1]  # [T-1, V]
    lp = mask_padding(logits, vocab_size).log_softmax(-1)  # [T - 1, V]
    target = torch.tensor(ids[1:], device=lp.device)
    chosen = lp.gather(1, target[:, None])[:, 0].tolist()
    vals, idx = lp.topk(top, dim=-1) if top > 0 else (None, None)
    out: list[tuple[float | None, list[tuple[int, float]]]] = [(None, [])]
    for j in range(len(ids) - 1):
        alts = list(zip(idx[j].tolist(), vals[j].tolist())) if top > 0 else []
        out.append((chosen[j], alts))
    return out
