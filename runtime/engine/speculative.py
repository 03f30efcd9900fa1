"""Speculative decoding: cheap proposals of the next k tokens, checked by the target model in one pass.

Per step, for each running sequence ready to decode (its last sampled token pending) that speculates:

1. a proposer guesses up to k drafts d1..dm: `NgramProposer` looks the last n tokens up in the
   sequence's own context (prompt lookup, no model), `DraftProposer` runs a small model (or a
   low-bit copy of the target's own weights: `draft=self:int4-g128`) m times on its own paged cache;
2. the engine runs the pending token and the drafts as one chunk of m + 1 positions;
3. `verify` walks the m + 1 target distributions (each processed with the sampler's penalties over
   the outputs as they would be had the earlier drafts been accepted):
   - greedy requests keep drafts while they equal the target's argmax, then add the target's own
     token there (or after all m: the bonus token) — the tokens of plain greedy decoding, exactly;
   - sampled requests accept draft d with probability min(1, p(d)/q(d)) and, at the first
     rejection, draw from the residual max(0, p - q) renormalized (an n-gram proposal is a point
     mass: q(d) = 1); after m acceptances, from p itself. The output distribution is then the
     target's (Leviathan et al. 2023, Chen et al. 2023), whatever q is;
4. the engine rolls back the rejected drafts' KV (scheduler.resolve_drafts).

So each target pass yields between 1 and m + 1 tokens. It pays when a pass over m + 1 positions costs
little more than over one — the case in decode, where the weights are read once per pass either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowbit.runtime.engine.kv_cache import KVPool
from lowbit.runtime.engine.pages import PageManager
from lowbit.runtime.engine.runner import Chunk, Runner
from lowbit.runtime.engine.sampler import SamplingState, draw, mask_padding, process_logits, truncated_probs

MAX_K = 16  # drafts per pass: a target pass over 17 positions is still a decode-sized GEMM


@dataclass(frozen=True)
class SpecConfig:
    """`--speculative ngram,k=4` or `--speculative draft=MODEL,k=4` (MODEL `self:<weights>`: the
    target's own weights in that layout), or `VERIFIED_GREEDY`: the fast kernels draft and the exact
    pass verifies (`lowbit run --temperature 0`)."""

    method: str  # "ngram" | "draft" | "verify"
    k: int = 4
    draft: str | None = None  # model reference, or "self:<weights>"
    ngram_max: int = 3  # longest suffix looked up (prompt lookup's max_ngram_size)
    # shortest: a single repeated token predicts little (default model, grounded prompts, k=4: 15% of
    # drafts accepted with 1-token matches, 31% with 2; decode 0.96x against 1.12x plain decoding)
    ngram_min: int = 2

    @staticmethod
    def parse(text: str) -> "SpecConfig":
        """'ngram,k=4' | 'draft=self:int4-g128,k=5' | 'draft=path.gguf' (k=4) → SpecConfig;
        ValueError with the accepted forms otherwise."""
        usage = "expected ngram[,k=N][,n=MAX] or draft=MODEL[,k=N] (MODEL: alias, path, or self:<weights>)"
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise ValueError(f"--speculative is empty; {usage}")
        head, opts = parts[0], {}
        for p in parts[1:]:
            key, eq, value = p.partition("=")
            if not eq or key not in ("k", "n"):
                raise ValueError(f"--speculative: unknown option {p!r}; {usage}")
            try:
                opts[key] = int(value)
            except ValueError:
                raise ValueError(f"--speculative: {key} must be an integer, got {value!r}") from None
        k = opts.get("k", 4)
        if not 1 <= k <= MAX_K:
            raise ValueError(f"--speculative: k must be in 1..{MAX_K}, got {k}")
        if head == "ngram":
            n = opts.get("n", 3)
            if not 1 <= n <= 8:
                raise ValueError(f"--speculative: n must be in 1..8, got {n}")
            return SpecConfig("ngram", k, ngram_max=n, ngram_min=min(2, n))
        if head.startswith("draft=") and head[6:] and "n" not in opts:
            return SpecConfig("draft", k, draft=head[6:])
        raise ValueError(f"--speculative {text!r}: {usage}")


# greedy drafted by the fast kernels, 15 at a time, each block verified by one exact pass over 16
# rows, which costs about one exact dequantization of the weights (kernels/exact_mm.py)
VERIFIED_GREEDY = SpecConfig("verify", k=15)


@dataclass
class Proposal:
    """m drafts for one sequence; q: fp32 [m, V] the distributions they were drawn from (None: each
    draft is a point mass, as for n-gram lookup and greedy drafting)."""

    drafts: list[int]
    q: torch.Tensor | None = None


@dataclass
class SpecStats:
    """Counts over a request's life (or the engine's)."""

    passes: int = 0  # target passes that verified drafts
    drafted: int = 0
    accepted: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.passes, self.drafted, self.accepted = self.passes + 1, self.drafted + drafted, self.accepted + accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens a verifying target pass produced: accepted drafts + the target's own token."""
        return (self.accepted + self.passes) / self.passes if self.passes else 0.0

    def as_dict(self) -> dict:
        return {"spec_passes": self.passes, "spec_drafted": self.drafted, "spec_accepted": self.accepted,
                "spec_acceptance_rate": self.acceptance_rate, "spec_tokens_per_pass": self.tokens_per_pass}


# ---- proposers -----------------------------------------------------------------------------------


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from
    ngram_max down to ngram_min) and propose the tokens that followed it. Input-grounded replies
    (summaries, edits, code rewrites) copy long runs of their prompt, so these are often right."""

    def __init__(self, config: SpecConfig):
        self.max_n, self.min_n = config.ngram_max, config.ngram_min

    def propose(self, items: list[tuple[str, list[int], int, SamplingState]]) -> dict[str, Proposal]:
        """items: (seq id, all token ids, most drafts, sampling state) → proposals (none when no match)."""
        out = {}
        for sid, ids, k, _ in items:
            drafts = lookup(ids, k, self.max_n, self.min_n)
            if drafts:
                out[sid] = Proposal(drafts)
        return out

    def release(self, seq_id: str) -> None:
        pass


def lookup(ids: list[int], k: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of ids' longest matching suffix
    (ids = [a b c x y a b] → suffix [a b] seen at 0 → propose [c x y ...])."""
    L = len(ids)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = ids[L - n:]
        for start in range(L - n - 1, -1, -1):  # latest occurrence first, not overlapping the suffix itself
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + k]
    return []


class DraftProposer:
    """A draft model with its own paged KV pool (same page bookkeeping as the engine's, no prefix
    cache). For each sequence it keeps KV for the tokens it has seen; a round first runs the tokens
    it has not (the prompt the first time, then the tokens accepted since), then one batched decode
    step per draft. Drafts are the argmax for greedy requests, else drawn from the draft's own
    distribution under the request's sampling parameters (that distribution is q)."""

    def __init__(self, model, vocab_size: int, kv_format, kv_bytes: int, page_size: int):
        c = model.config
        self.model, self.vocab = model, vocab_size
        self.pool = KVPool.from_budget(kv_format, c.n_layers, c.n_kv_heads, c.head_dim, kv_bytes, page_size,
                                       model.device)
        self.blocks = PageManager(self.pool.num_pages, page_size, prefix_caching=False)
        self.runner = Runner(model, self.pool)
        self.seen: dict[str, list[int]] = {}  # seq id → the tokens whose KV the draft pool holds
        self.generators: dict[str, torch.Generator] = {}

    def release(self, seq_id: str) -> None:
        self.blocks.free(seq_id)
        self.seen.pop(seq_id, None)
        self.generators.pop(seq_id, None)

    def _sync(self, sid: str, ids: list[int]) -> list[int] | None:
        """Cut the draft cache back to its common prefix with ids[:-1] and reserve slots for the rest
        of ids → the slots of the tokens to run, or None when the draft pool is out of pages."""
        seen = self.seen.get(sid, [])
        common = 0
        for a, b in zip(seen, ids[:-1]):
            if a != b:
                break
            common += 1
        if sid in self.blocks.tables:
            self.blocks.truncate(sid, common)
        else:
            self.blocks.match_prefix(sid, [])
        slots = self.blocks.append_slots(sid, len(ids) - common)
        if slots is None:
            self.release(sid)
            return None
        self.seen[sid] = list(ids)
        return slots

    def _forward(self, chunks: list[tuple[str, list[int], list[int]]]) -> torch.Tensor:
        """chunks: (seq id, tokens, slots), each the continuation of what the pool holds for that
        sequence → the draft's logits at each chunk's last token, fp32 [len(chunks), V]."""
        runs = []
        for sid, toks, sl in chunks:
            end = self.blocks.seq_len(sid)
            runs.append(Chunk(toks, end - len(toks), sl, self.blocks.block_table(sid)))
        # exact=None: the kernels pick by row count (CPU: exact fp32 tiles from 16 rows, faster there);
        # a draft's numbers only need to be good guesses
        return mask_padding(self.runner.run(runs, None), self.vocab)

    def _choose(self, sid: str, logits: torch.Tensor, state: SamplingState, drafts: list[int]):
        """→ (draft token, its distribution q [V] or None for a greedy request)."""
        st = SamplingState(state.params, state.prompt_ids, [*state.output_ids, *drafts], self._generator(sid, state))
        x = process_logits(logits[None], [st])
        if state.params.greedy:
            return int(x.argmax(-1)), None
        q = truncated_probs(x, [st])
        q = q / q.sum(-1, keepdim=True)
        return int(draw(q, [st])[0]), q[0]

    def _generator(self, sid: str, state: SamplingState) -> torch.Generator:
        """The draft's own random stream per request, seeded from the request's seed when it has one
        (so a seeded request drafts the same way every time); the request's generator is the
        verifier's alone."""
        if sid not in self.generators:
            g = torch.Generator()
            if state.params.seed is None:
                g.seed()
            else:
                g.manual_seed((state.params.seed ^ 0x5DEECE66D) % 2**63)
            self.generators[sid] = g
        return self.generators[sid]

    def propose(self, items: list[tuple[str, list[int], int, SamplingState]]) -> dict[str, Proposal]:
        want, chunks = {}, []
        for sid, ids, k, state in items:
            slots = self._sync(sid, ids)
            if slots is not None:
                want[sid] = (k, state)
                chunks.append((sid, ids[len(ids) - len(slots):], slots))
        drafts: dict[str, list[int]] = {sid: [] for sid in want}
        qs: dict[str, list[torch.Tensor]] = {sid: [] for sid in want}
        while chunks:  # round 0: catch up and draft 1; then one batched single-token step per draft
            logits = self._forward(chunks)  # [len(chunks), V]
            nxt = []
            for (sid, _, _), row in zip(chunks, logits):
                k, state = want[sid]
                tok, q = self._choose(sid, row, state, drafts[sid])
                drafts[sid].append(tok)
                if q is not None:
                    qs[sid].append(q)
                if len(drafts[sid]) < k and (slots := self.blocks.append_slots(sid, 1)) is not None:
                    self.seen[sid].append(tok)  # its KV is written by the next round
                    nxt.append((sid, [tok], slots))
            chunks = nxt
        return {sid: Proposal(d, torch.stack(qs[sid]) if qs[sid] else None) for sid, d in drafts.items()}


class FastDrafter:
    """Verified greedy's proposer: the target model itself drafts on its fast kernels (on CPU the C
    kernels' 16-bit activation codes, on CUDA fp16/bf16), one batched single-token step per draft,
    over the target's own pool. The engine then runs the pending token and the drafts exactly as one
    chunk and keeps the drafts up to the first disagreement with the exact argmax, so the reply is
    the exact model's greedy reply at about the fast kernels' speed: rounding activations flips
    near-ties (top-2 logit gaps of 0.003 are seen on the default model), and nearly every draft is
    accepted.

    The drafts' K/V go to slots reserved past the sequence's end and released again before the
    engine schedules the step: the verifying chunk rewrites every one of those positions with
    exact values before anything reads them, and a page given back is private and unregistered
    (pages.py: `truncate` above the committed length), so no other sequence ever sees a draft's K/V."""

    def __init__(self, runner: Runner, pages: PageManager, vocab_size: int, eos_ids: frozenset[int], slots=None):
        """slots: a hybrid model's recurrent-state slots (runtime/engine/state_pool.py), or None."""
        self.runner, self.pages, self.vocab, self.eos_ids, self.slots = runner, pages, vocab_size, eos_ids, slots

    def release(self, seq_id: str) -> None:
        pass

    def propose(self, items: list[tuple[str, list[int], int, SamplingState]]) -> dict[str, Proposal]:
        """items: (seq id, all token ids with the pending one last, most drafts, sampling state)."""
        runs: dict[str, tuple[int, list[int], list[int], frozenset[int], list[int]]] = {}
        for sid, ids, k, state in items:
            end = self.pages.seq_len(sid)  # tokens with K/V: all but the pending one
            assert end == len(ids) - 1, (sid, end, len(ids))
            slots = self.pages.append_slots(sid, k) if k > 0 else None  # positions end .. end + k - 1
            if slots is None:  # the pool is short: this step decodes the pending token alone
                continue
            p = state.params
            stops = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
            runs[sid] = (end, slots, [ids[-1]], stops, self.pages.block_table(sid))  # pages fixed while drafting
        # a hybrid model's drafting steps run its recurrence over the drafts too: its state is put back after
        states = self.runner.pool.states if self.slots is not None else None
        held = [self.slots.slot(sid) for sid in runs] if states is not None else []
        saved = states.save(held) if held else None
        try:
            return {sid: Proposal(d) for sid, d in self._draft(runs).items()}
        finally:  # the reserved slots go back whatever happened
            for sid, (end, *_) in runs.items():
                self.pages.truncate(sid, end)
            if saved is not None:
                states.load(held, saved)

    def _draft(self, runs: dict) -> dict[str, list[int]]:
        """One batched fast single-token step per draft: runs[sid] = (its length, reserved slots, its
        tokens to run, stop ids, its pages) → each sequence's drafts."""
        drafts: dict[str, list[int]] = {sid: [] for sid in runs}
        live = list(runs)
        while live:
            chunks = []
            for sid in live:
                end, slots, toks, _, table = runs[sid]
                i = len(drafts[sid])
                chunks.append(Chunk([toks[i]], end + i, [slots[i]], table,
                                    state_slot=-1 if self.slots is None else self.slots.slot(sid)))
            logits = mask_padding(self.runner.run(chunks, False), self.vocab)  # [len(live), V]
            nxt = []
            for sid, tok in zip(live, logits.argmax(-1).tolist()):
                _, slots, toks, stops, _ = runs[sid]
                drafts[sid].append(tok)
                toks.append(tok)
                if len(drafts[sid]) < len(slots) and tok not in stops:
                    nxt.append(sid)
            live = nxt
        return drafts


# ---- verification ----------------------------------------------------------------------------------


@dataclass
class Verdict:
    accepted: int  # drafts kept
    tokens: list[int]  # the kept drafts, then the target's token
    processed: torch.Tensor = field(repr=False)  # fp32 [len(tokens), V] processed logits each was chosen under


def verify(logits: torch.Tensor, proposal: Proposal, state: SamplingState) -> Verdict:
    """logits fp32 [m + 1, V]: the target's raw logits at the pending token and at each of the m
    drafts. state: the request's (its generator draws the accept/reject coins and the final token)."""
    drafts = proposal.drafts
    m = len(drafts)
    rows = [SamplingState(state.params, state.prompt_ids, [*state.output_ids, *drafts[:i]], state.generator)
            for i in range(m + 1)]
    x = process_logits(logits, rows)  # [m + 1, V]
    if state.params.greedy:
        target = x.argmax(-1).tolist()
        a = 0
        while a < m and drafts[a] == target[a]:
            a += 1
        return Verdict(a, [*drafts[:a], target[a]], x[:a + 1])
    p = truncated_probs(x, rows)
    p = p / p.sum(-1, keepdim=True)  # [m + 1, V]
    for i, d in enumerate(drafts):
        q_d = 1.0 if proposal.q is None else float(proposal.q[i, d])
        u = float(torch.rand(1, generator=state.generator, dtype=torch.float64))
        if u * q_d < float(p[i, d]):  # accept with probability min(1, p(d) / q(d))
            continue
        if proposal.q is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - proposal.q[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0:  # p == q: rejection had probability 0; p is the residual's limit
            residual = p[i]
        tok = int(draw(residual[None], [state])[0])
        return Verdict(i, [*drafts[:i], tok], x[:i + 1])
    tok = int(draw(p[m:], [state])[0])
    return Verdict(m, [*drafts, tok], x)
