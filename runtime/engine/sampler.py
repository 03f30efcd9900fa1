"""Next-token choice for a batch of requests, each with its own sampling parameters and generator.

Order of operations per row (vLLM's, with the logit bias moved last among the logit edits):

  1. raw logits → repetition penalty (prompt + output tokens) → presence/frequency penalties
     (output tokens only) → logit bias. The bias comes last so it is an exact additive offset
     on whatever the penalties left: a -100 ban stays a ban, whatever the sign of the logit.
  2. logprobs, if asked for, are log_softmax of THESE processed logits — before temperature and
     before top-k/top-p/min-p truncation (vLLM's `processed_logprobs`). Why this and not the
     truncated distribution actually sampled from: truncation puts -inf on most of the vocabulary
     (JSON cannot carry it, and a top-5 list would be padded with -inf), greedy rows would get a
     useless one-hot (logprob 0, every alternative -inf), and OpenAI's reported logprobs likewise
     do not move with temperature. So greedy and sampled rows report the same, finite numbers.
  3. greedy rows (temperature < 1e-5, vLLM's epsilon: there a logit gap of 0.001 is already 100
     nats, e^-100 ≈ 4e-44, so sampling is greedy in all but name) take the argmax; ties go to
     the lowest id.
  4. other rows: ÷ temperature → top-k (ties at the k-th value are all kept) → top-p (the
     smallest prefix of the sorted distribution whose mass reaches top_p, the token crossing it
     included, and any token tied with it) → min-p (drop tokens with p < min_p · max p) → one
     draw from the row's own CPU generator.

Reproducibility: each request owns a `torch.Generator` and every sampled token draws exactly one
uniform u from it, turned into a token by inverse CDF over the row's own probabilities. The token
therefore depends only on the row's logits, its parameters and how many tokens it drew before —
not on the batch's size, order or other members. Only B scalars cross to the logits' device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

import torch

GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
BIAS_LIMIT = 100.0  # OpenAI: logit_bias values lie in [-100, 100]


def mask_padding(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Checkpoints often pad the embedding beyond the tokenizer (Qwen2.5: 151936 rows for 151665
    tokens); ids past the tokenizer have no text, so they can never be chosen. In place; [..., V]."""
    if logits.shape[-1] > vocab:
        logits[..., vocab:] = float("-inf")
    return logits


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7  # 0 = greedy
    top_p: float = 0.95  # (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # [0, 1); 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off (HF/vLLM: over prompt + output tokens)
    presence_penalty: float = 0.0  # [-2, 2] (OpenAI: over output tokens)
    frequency_penalty: float = 0.0  # [-2, 2]
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)  # token id → added logit
    seed: int | None = None  # None = a random seed per request
    max_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings, cut from the output (runtime/engine/stop.py)
    stop_token_ids: tuple[int, ...] = ()  # checked by the engine, like the end tokens
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives (0..20); None = no logprobs
    # False: special tokens are written out as their text (vLLM's name). gpt-oss's harmony markers
    # (<|channel|>, <|message|>, ...) are control tokens the reply parser must see (server/harmony.py)
    skip_special_tokens: bool = True

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

        def number(name, ok, want):  # `ok` is False for nan, so nan fails every range check
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and ok(v)):
                bad(name, want)

        number("temperature", lambda v: 0 <= v < math.inf, "a finite number >= 0")
        number("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
        number("min_p", lambda v: 0 <= v < 1, "in [0, 1)")
        number("repetition_penalty", lambda v: 0 < v < math.inf, "a finite number > 0")
        number("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        number("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            bad("top_k", "an int >= 0 (0 = off)")
        if not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            bad("max_tokens", "an int >= 1")
        if self.seed is not None and not (_is_int(self.seed) and -2**63 <= self.seed < 2**64):
            bad("seed", "None or an int in [-2**63, 2**64)")  # the range torch.Generator accepts
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"None or an int in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "a bool")
        if not isinstance(self.skip_special_tokens, bool):
            bad("skip_special_tokens", "a bool")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop  # OpenAI allows one string
        if not (isinstance(stop, (tuple, list)) and all(isinstance(s, str) and s for s in stop)):
            bad("stop", "a tuple of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not (isinstance(ids, (tuple, list)) and all(_is_int(t) and t >= 0 for t in ids)):
            bad("stop_token_ids", "a tuple of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                bad("logit_bias", "None or a mapping token id → float")
            clipped = {}
            for tok, b in self.logit_bias.items():
                if not (_is_int(tok) and tok >= 0 and isinstance(b, (int, float)) and not math.isnan(b)):
                    raise ValueError(f"logit_bias entries must be token id (int >= 0) → number, got {tok!r}: {b!r}")
                clipped[tok] = min(max(float(b), -BIAS_LIMIT), BIAS_LIMIT)
            # a private copy: the caller mutating its dict later must not change a frozen request
            object.__setattr__(self, "logit_bias", MappingProxyType(clipped))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class SamplingState:
    """One request's sampling state. The engine appends each token it keeps to `output_ids`
    (sample_batch does not: a speculative step may reject a sampled token)."""
    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # CPU; made from params.seed when not given

    def __post_init__(self):
        if self.generator is None:
            self.generator = torch.Generator()
            if self.params.seed is None:
                self.generator.seed()  # nondeterministic
            else:
                self.generator.manual_seed(self.params.seed)


@dataclass(frozen=True)
class SampleResult:
    token: int
    logprob: float | None  # of `token`, under the processed distribution (see the module doc)
    top_logprobs: list[tuple[int, float]] | None  # (id, logprob), most likely first


def _index(states: Sequence[SamplingState], ids_of, keep, V: int, device) -> torch.Tensor | None:
    """Flat indices row * V + id over the rows `keep` selects, for one index_add_ into [B, V]."""
    rows, ids = [], []
    for i, s in enumerate(states):
        if keep(s.params):
            toks = ids_of(s)
            rows.extend([i] * len(toks))
            ids.extend(toks)
    if not ids:
        return None
    return (torch.tensor(rows, dtype=torch.long) * V + torch.tensor(ids, dtype=torch.long)).to(device)


def _row(values, like: torch.Tensor) -> torch.Tensor:
    """One per-row parameter as a [B, 1] column on the logits' device."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def process_logits(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """[B, V] raw logits → fp32 [B, V] with penalties and logit bias applied (step 1); a new
    tensor whenever anything applies, the input itself (never modified) otherwise."""
    B, V = logits.shape
    if B != len(states):
        raise ValueError(f"logits have {B} rows for {len(states)} requests")
    x = logits.float()  # every edit below is out of place: the caller's logits stay as they were
    ps = [s.params for s in states]
    flat = _index(states, lambda s: [*s.prompt_ids, *s.output_ids], lambda p: p.repetition_penalty != 1, V, x.device)
    if flat is not None:
        seen = torch.zeros(B * V, dtype=torch.bool, device=x.device).index_fill_(0, flat, True).view(B, V)
        rp = _row([p.repetition_penalty for p in ps], x)
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    flat = _index(states, lambda s: s.output_ids, lambda p: p.presence_penalty or p.frequency_penalty, V, x.device)
    if flat is not None:
        counts = torch.zeros(B * V, dtype=x.dtype, device=x.device)
        counts = counts.index_add_(0, flat, torch.ones_like(flat, dtype=x.dtype)).view(B, V)
        x = x - _row([p.frequency_penalty for p in ps], x) * counts
        x = x - _row([p.presence_penalty for p in ps], x) * (counts > 0)
    items = [(i, t, b) for i, p in enumerate(ps) for t, b in (p.logit_bias or {}).items()]
    if items:
        rows, toks, bias = zip(*items)
        if max(toks) >= V:
            raise ValueError(f"logit_bias names token {max(toks)}, but the vocabulary has {V} tokens")
        at = (torch.tensor(rows, device=x.device), torch.tensor(toks, device=x.device))
        x = x.index_put(at, torch.tensor(bias, dtype=x.dtype, device=x.device), accumulate=True)
    return x


def truncated_probs(x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Processed logits [B, V] → the unnormalized fp32 probabilities each row samples from
    (step 4 up to the draw; zeros are the tokens masked out). Greedy rows come back one-hot."""
    ps = [s.params for s in states]
    greedy = torch.tensor([p.greedy for p in ps], device=x.device)
    x = x / _row([1.0 if p.greedy else p.temperature for p in ps], x)
    ks = [min(p.top_k, x.shape[1]) if p.top_k and not p.greedy else 0 for p in ps]
    if any(ks):  # one topk at the largest k; rows with top-k off get a -inf threshold
        top = x.topk(max(ks), dim=-1).values  # [B, max k], descending
        kth = top.gather(1, torch.tensor([max(k - 1, 0) for k in ks], device=x.device).unsqueeze(1))
        kth = kth.masked_fill(_row(ks, x) == 0, -math.inf)  # [B, 1]
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, dim=-1)
    top_p = [p.top_p if not p.greedy else 1.0 for p in ps]
    if any(t < 1 for t in top_p):
        probs = probs.masked_fill(probs < _nucleus_floor(probs, top_p), 0.0)
    if any(p.min_p and not p.greedy for p in ps):
        floor = _row([p.min_p for p in ps], probs) * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


NUCLEUS_CANDIDATES = (256, 4096)  # topk sizes tried before a full sort of the vocabulary


def _nucleus_floor(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """[B, 1]: the probability of the token whose mass crosses top_p (0 for rows with top_p = 1).

    A full sort of 32 x 49152 probabilities takes 70-80 ms on 2 CPU threads (topk 256: 4 ms), and a
    model's nucleus is usually a few hundred tokens, so the top 256, then 4096, are tried first;
    a row is settled once its candidates' mass reaches top_p, the rest fall through to the full
    vocabulary. Keeping `p >= floor` rather than a sorted prefix means that tokens tied with the
    crossing token are all kept (as top-k keeps ties), so the answer needs no tie order."""
    floor = torch.zeros(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    need = torch.tensor(top_p, dtype=probs.dtype, device=probs.device)
    todo = torch.nonzero(need < 1).flatten()
    V = probs.shape[1]
    for k in (*(k for k in NUCLEUS_CANDIDATES if k < V), V):
        vals = probs[todo].topk(k, dim=-1).values  # [n, k], descending
        mass = vals.cumsum(-1)
        # a token is in the nucleus while the mass strictly before it is below top_p
        # >= 1: the first always, even for a top_p under fp32's least (1e-45), which is 0 here
        kept = (mass - vals < need[todo].unsqueeze(1)).sum(-1, keepdim=True).clamp_min(1)
        done = (mass[:, -1] >= need[todo]) | (k == V)
        floor[todo[done]] = vals[done].gather(1, kept[done] - 1)
        todo = todo[~done]
        if todo.numel() == 0:
            break
    return floor


def final_probs(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """The normalized distribution each row's token is drawn from, fp32 [B, V] (for tests/debug)."""
    probs = truncated_probs(process_logits(logits, states), states)
    return probs / probs.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """One uniform per row from the row's generator → token ids [B] by inverse CDF."""
    u = torch.cat([torch.rand(1, generator=s.generator, dtype=torch.float64) for s in states])
    cdf = probs.double().cumsum(-1)  # fp64: an fp32 sum of 49152 terms may drift by n·eps ≈ 3e-3
    target = (u.to(probs.device) * cdf[:, -1]).unsqueeze(1)  # [B, 1], in [0, total)
    # right=True: the first token whose cdf exceeds target, so a zero-probability token (cdf flat)
    # is never chosen; u·total rounding up to total would run past the end → last non-zero token
    tok = torch.searchsorted(cdf, target, right=True).squeeze(1)
    over = tok >= probs.shape[1]
    if bool(over.any()):  # last non-zero token: the first argmax of the flipped nonzero mask
        tok[over] = probs.shape[1] - 1 - (probs[over] > 0).flip(-1).int().argmax(-1)
    return tok


def sample_batch(logits: torch.Tensor, states: Sequence[SamplingState]) -> list[SampleResult]:
    """logits [B, V] (any device) and one SamplingState per row → one SampleResult per row."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if not states:
        return []
    x = process_logits(logits, states)
    tokens = x.argmax(-1)  # greedy rows' answer; ties → lowest id
    sampled = [i for i, s in enumerate(states) if not s.params.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=x.device)
        sub = [states[i] for i in sampled]
        tokens[rows] = draw(truncated_probs(x[rows], sub), sub)
    return results(x, tokens, [s.params.logprobs for s in states])


def results(x: torch.Tensor, tokens: torch.Tensor, want: list[int | None]) -> list[SampleResult]:
    """Processed logits [B, V] and the token chosen in each row [B] → SampleResults, with the
    logprobs each row asks for (`want`: None, or the number of alternatives)."""
    token_list = tokens.tolist()
    chosen_lp, top = [None] * len(want), [None] * len(want)
    if any(n is not None for n in want):
        lp = torch.log_softmax(x, dim=-1)
        chosen_lp = lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        n_max = max(n for n in want if n is not None)
        if n_max:
            vals, ids = lp.topk(min(n_max, lp.shape[1]), dim=-1)
            vals, ids = vals.tolist(), ids.tolist()
        for i, n in enumerate(want):
            if n is not None:
                top[i] = list(zip(ids[i][:n], vals[i][:n])) if n else []
    return [SampleResult(t, c if n is not None else None, alts)
            for t, c, alts, n in zip(token_list, chosen_lp, top, want)]
