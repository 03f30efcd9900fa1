"""One prompt → streamed reply, with the numbers `lowbit run` prints (TTFT, decode tok/s).

The simple single-sequence loop over the contiguous cache. `lowbit run` uses it for verified
greedy replies; everything else goes through the paged engine (runtime/engine/engine.py), until
speculative decoding moves verification there.

Greedy decoding is *verified*: the fast kernels (on CPU lowbit's C kernels, 16-bit activation
codes; on CUDA the Triton kernels with fp16/bf16 activations) draft
VERIFY_BLOCK - 1 tokens one at a time, then one exact fp32 pass over the block checks them (and
rewrites their cache entries with exact values), keeping the drafts up to the first disagreement
and the exact model's token there. The reply is therefore the exact model's greedy reply — rounding
activations flips near-ties (top-2 logit gaps of 0.003 were seen on the default model), and even fp32
sums in another order can — at about the speed of fast decoding, since nearly every draft is
accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from lowbit.models.llama import KVCache, Llama
from lowbit.runtime.engine.cuda_graphs import GraphedDecode
from lowbit.runtime.engine.detokenizer import StreamDetokenizer
from lowbit.runtime.engine.sampler import Sampler, mask_padding

VERIFY_BLOCK = 16  # = EXACT_MIN_ROWS: one verify pass costs about one exact dequantization of the weights


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    ttft_s: float  # prompt in → first token chosen
    decode_s: float  # first token chosen → last token kept
    finish_reason: str  # "stop" (end token) | "length"

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


Step = Callable[[int, int], torch.Tensor]  # (token, its position) → logits fp32 [V] for the next one


def decode_step(model: Llama, cache: KVCache) -> Step:
    """One fast-kernel decode step. On CUDA it is replayed from a CUDA graph (runtime/engine/cuda_graphs.py);
    on CPU it is a plain forward of one token."""
    if model.device.type == "cuda":
        graphed = GraphedDecode(model, cache, buckets=(1,))
        return lambda tok, pos: graphed(torch.tensor([tok], device=model.device),
                                        torch.tensor([pos], device=model.device))[0]
    return lambda tok, pos: model(torch.tensor([[tok]]), cache, pos, exact=False)[0, -1]


def sampled_tokens(model: Llama, prompt: list[int], cache: KVCache, sampler: Sampler, vocab: int) -> Iterator[int]:
    """Plain decoding: prefill (exact for 16+ tokens on CPU), then one fast-kernel step per token."""
    step = decode_step(model, cache)
    logits = model(torch.tensor([prompt], device=model.device), cache, 0, last_only=True)[0, -1]
    pos = len(prompt)
    while True:
        tok = sampler(mask_padding(logits, vocab))
        yield tok
        if pos >= cache.max_len:
            return
        logits = step(tok, pos)
        pos += 1


def verified_greedy_tokens(model: Llama, prompt: list[int], cache: KVCache, vocab: int, budget: int,
                           stop_ids: frozenset[int], block: int = VERIFY_BLOCK) -> Iterator[int]:
    """The exact model's greedy tokens, drafted by the fast kernels and verified in blocks.
    Drafting stops at an end token or when `budget` tokens have been drafted in all."""
    argmax = lambda logits: int(mask_padding(logits, vocab).argmax())  # noqa: E731
    step = decode_step(model, cache)
    nxt = argmax(model(torch.tensor([prompt], device=model.device), cache, 0, last_only=True, exact=True)[0, -1])
    pos = len(prompt)  # the position `nxt` occupies
    yield nxt
    while pos < cache.max_len:
        drafts, t, p = [], nxt, pos
        left = budget - (pos - len(prompt)) - 1  # tokens still wanted after `nxt`
        while len(drafts) < min(block - 1, left) and p + 1 < cache.max_len and t not in stop_ids:
            t = argmax(step(t, p))
            drafts.append(t)
            p += 1
        seq = [nxt, *drafts]
        logits = mask_padding(model(torch.tensor([seq], device=model.device), cache, pos, exact=True)[0], vocab)
        exact = logits.argmax(-1).tolist()  # [len(seq)]
        for j, d in enumerate(drafts):
            if exact[j] != d:  # first disagreement: the exact token replaces the draft
                nxt, pos = exact[j], pos + j + 1
                break
            yield d
        else:
            nxt, pos = exact[len(drafts)], pos + len(seq)
        yield nxt


@torch.inference_mode()
def generate(model: Llama, tokenizer, prompt_ids: list[int], max_tokens: int, sampler: Sampler,
             on_text: Callable[[str], None] | None = None, max_len: int | None = None,
             verify_greedy: bool = True) -> GenerationResult:
    """Generate until an end token or max_tokens; `on_text` receives text as soon as it forms
    complete characters."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    limit = max_len or model.config.max_seq_len
    if len(prompt_ids) >= limit:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context limit is {limit}")
    max_tokens = min(max_tokens, limit - len(prompt_ids))
    verify = verify_greedy and sampler.p.temperature == 0
    slack = VERIFY_BLOCK if verify else 0  # drafts may run a block past the last token kept
    cache = KVCache.empty(model.config, 1, min(limit, len(prompt_ids) + max_tokens + slack), model.device)
    detok = StreamDetokenizer(tokenizer)
    out: list[int] = []
    pieces: list[str] = []
    emit = on_text or (lambda s: None)
    t0 = time.perf_counter()
    t_first = None
    finish = "length"
    vocab = tokenizer.vocab_size
    source = (verified_greedy_tokens(model, prompt_ids, cache, vocab, max_tokens, frozenset(tokenizer.eos_ids))
              if verify else sampled_tokens(model, prompt_ids, cache, sampler, vocab))
    t_last = None
    for tok in source:
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        if tok in tokenizer.eos_ids:
            finish = "stop"
            break
        t_last = now
        out.append(tok)
        text = detok.push(tok)
        if text:
            pieces.append(text)
            emit(text)
        if len(out) >= max_tokens:
            break
    tail = detok.flush()
    if tail:
        pieces.append(tail)
        emit(tail)
    t_end = time.perf_counter()
    t_first = t_first or t_end
    # decode time ends at the last token kept: choosing an end token is not an output token
    return GenerationResult(out, "".join(pieces), len(prompt_ids), t_first - t0, (t_last or t_first) - t_first, finish)
