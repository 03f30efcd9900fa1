"""Speculative decoding (runtime/engine/speculative.py) inside the engine, on tiny random models.

Oracles: the same engine without speculation (greedy: the same tokens, exactly), the target's own
next-token distributions computed directly (sampled: chi-square on first and second tokens), and
the page pools' bookkeeping (every page free again, invariants hold)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowbit.models.config import LlamaConfig
from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sampler import SamplingParams
from lowbit.runtime.engine.speculative import SpecConfig, lookup
from tests.helpers import forward

CFG = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                  vocab_size=101, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=256, tie_embeddings=False)


def tiny(weights: str = "int8", seed: int = 0) -> Llama:
    # same seed → the same N(0, 0.1^2) matrices in another layout (the self-draft case)
    return Llama(CFG, random_weights(CFG, weights, "int8", seed=seed, scale=0.1)).eval()


@pytest.fixture(scope="module")
def target() -> Llama:
    return tiny("int8")


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(0, 100, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        out.append(p * 2 if i % 2 else p)  # half repeat themselves: prompt lookup finds runs
    return out


def run(engine: Engine, reqs: list[tuple[list[int], SamplingParams, int | None]]):
    ids = [engine.add_request(p, sp, spec_k=k) for p, sp, k in reqs]
    toks, finish, usage = {i: [] for i in ids}, {}, {}
    while engine.has_work():
        for d in engine.step():
            toks[d.request_id] += d.token_ids
            if d.finish_reason:
                finish[d.request_id], usage[d.request_id] = d.finish_reason, d.usage
    return [toks[i] for i in ids], [finish[i] for i in ids], [usage[i] for i in ids]


def assert_all_free(engine: Engine) -> None:
    engine.blocks.check_invariants()
    assert engine.stats()["pages_used"] == 0 and not engine.requests
    if hasattr(engine.proposer, "blocks"):
        engine.proposer.blocks.check_invariants()
        assert engine.proposer.blocks.num_used_pages == 0 and not engine.proposer.seen


def test_parse():
    assert SpecConfig.parse("ngram,k=3") == SpecConfig("ngram", 3)
    assert SpecConfig.parse("ngram,n=2") == SpecConfig("ngram", 4, ngram_max=2)
    assert SpecConfig.parse("draft=self:int4-g128,k=5") == SpecConfig("draft", 5, draft="self:int4-g128")
    assert SpecConfig.parse("draft=/m/x.gguf") == SpecConfig("draft", 4, draft="/m/x.gguf")
    for bad in ("", "ngram,k=0", "ngram,k=17", "ngram,k=x", "draft=", "medusa", "ngram,q=1", "draft=a,n=2"):
        with pytest.raises(ValueError, match="speculative"):
            SpecConfig.parse(bad)


def test_lookup_by_hand():
    assert lookup([1, 2, 3, 9, 8, 1, 2], k=3, max_n=3) == [3, 9, 8]  # suffix [1 2] seen at 0
    assert lookup([1, 2, 3, 1, 2, 4, 1, 2], k=2, max_n=2) == [4, 1]  # the latest occurrence wins
    assert lookup([5, 6, 7, 6, 0, 7], k=4, max_n=3) == [6, 0, 7]  # only [7] recurs
    assert lookup([1, 2, 3], k=4, max_n=3) == []


@pytest.mark.parametrize("kv", ["f16", "k8v4"])
def test_greedy_tokens_equal_plain_decoding(target, byte_tokenizer, kv):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ps = prompts(6)
    plain, _, _ = run(Engine(target, byte_tokenizer, EngineConfig(kv_format=kv, kv_memory=1 << 20)),
                      [(p, greedy, None) for p in ps])
    specs = [("ngram,k=2", None), ("ngram,k=5", None), ("draft=x,k=3", tiny("int4-g32", seed=1)),
             ("draft=self,k=4", tiny("int4-g128"))]
    rate = {}
    for spec, draft in specs:
        engine = Engine(target, byte_tokenizer,
                        EngineConfig(kv_format=kv, kv_memory=1 << 20, speculative=SpecConfig.parse(spec)),
                        draft_model=draft)
        got, _, usage = run(engine, [(p, greedy, None) for p in ps])
        assert got == plain, spec
        assert all(u.completion_tokens == 24 for u in usage)
        stats = engine.stats()
        rate[spec] = stats["spec_acceptance_rate"]
        assert stats["spec_passes"] > 0 and 0 <= stats["spec_accepted"] <= stats["spec_drafted"], spec
        assert_all_free(engine)
    # the self-draft shares the target's matrices (int4 instead of int8): on this random model's flat
    # distributions int4 noise still flips many argmaxes (measured 0.50 with f16, 0.33 with k8v4), but
    # an unrelated draft agrees by chance only (0.017, 0.011)
    assert rate["draft=self,k=4"] > 10 * rate["draft=x,k=3"]


def test_mixed_batch_per_request_k_and_stops_inside_accepted_runs(target, byte_tokenizer):
    """One batch: requests without speculation, with k 1..6, a stop token and a stop string that
    fall inside accepted runs, and small max_tokens. Each equals its plain run alone."""
    ps = prompts(8, seed=3)
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain_engine = Engine(target, byte_tokenizer, EngineConfig(kv_memory=1 << 20))
    solo, _, _ = run(plain_engine, [(p, base, None) for p in ps])
    # a stop token and a stop string taken from the middle of two greedy replies
    stop_tok = solo[1][9]
    stop_str = "".join(chr(t + 32) for t in solo[3][12:14])
    params = [base, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=(stop_tok,)),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), base.__class__(**{**base.__dict__,
                                                                                             "stop": (stop_str,)}),
              base, base, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), base]
    ks = [0, 4, 6, None, 1, 2, 3, 5]
    want, want_finish, want_usage = [], [], []
    for p, sp in zip(ps, params):
        t, f, u = run(Engine(target, byte_tokenizer, EngineConfig(kv_memory=1 << 20)), [(p, sp, None)])
        want, want_finish, want_usage = want + t, want_finish + f, want_usage + u
    config = EngineConfig(kv_memory=1 << 20, speculative=SpecConfig.parse("draft=self,k=4"))
    engine = Engine(target, byte_tokenizer, config, draft_model=tiny("int4-g128"))
    got, finish, usage = run(engine, list(zip(ps, params, ks)))
    assert got == want and finish == want_finish
    assert [u.completion_tokens for u in usage] == [u.completion_tokens for u in want_usage]
    assert finish[1] == "stop" and finish[3] == "stop" and finish[2] == "length"
    assert usage[0].spec is None and usage[1].spec.passes > 0  # k=0 never speculated
    assert_all_free(engine)


def test_preemption_and_abort_with_drafts_in_flight(target, byte_tokenizer):
    """A pool too small for every request: speculating sequences get preempted (their drafts
    dropped) and recomputed; an abort mid-run frees everything. Tokens still equal plain decoding."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ps = prompts(6, seed=5)
    small = CFG.n_layers * 2 * CFG.n_kv_heads * CFG.head_dim * 2 * 16 * 12  # 12 pages of 16 f16 tokens
    plain, _, _ = run(Engine(target, byte_tokenizer, EngineConfig(kv_format="f16", kv_memory=1 << 20)),
                      [(p, greedy, None) for p in ps])
    engine = Engine(target, byte_tokenizer,
                    EngineConfig(kv_format="f16", kv_memory=small, speculative=SpecConfig.parse("ngram,k=4")))
    got, _, _ = run(engine, [(p, greedy, None) for p in ps])
    assert got == plain and engine.stats()["preemptions"] > 0
    assert_all_free(engine)
    rid = engine.add_request(ps[0], greedy)
    for _ in range(4):
        engine.step()
    engine.abort(rid)
    assert_all_free(engine)


@torch.inference_mode()
def _marginals(model: Llama, prompt: list[int], temperature: float, n: int = 3) -> list[torch.Tensor]:
    """The model's own distributions of the first n (2 or 3) sampled tokens, marginalized over the
    earlier ones, computed directly (fresh f32 pools, every continuation in one batch)."""
    V = CFG.vocab_size

    def next_probs(seqs: torch.Tensor) -> torch.Tensor:  # [B, T] → [B, V]
        x = forward(model, seqs, exact=True)[:, -1]
        return torch.softmax(x.double() / temperature, -1)

    base = torch.tensor([prompt])
    p1 = next_probs(base)[0]  # [V]
    one = torch.cat([base.expand(V, -1), torch.arange(V)[:, None]], 1)  # [V, T + 1]: prompt + t1
    p12 = p1[:, None] * next_probs(one)  # [V, V] joint of (t1, t2)
    if n == 2:
        return [p1, p12.sum(0)]
    two = torch.cat([one.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)  # [V * V, T + 2]
    p3 = (p12.reshape(-1, 1) * next_probs(two)).sum(0)
    return [p1, p12.sum(0), p3]


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; bins expected below 5 are pooled into one."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    obs, exp = counts[~small], exp[~small]
    if small.any():
        obs, exp = torch.cat([obs, counts[small].sum()[None]]), torch.cat([exp, (probs[small] * n).sum()[None]])
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("spec", ["draft", "ngram"])
def test_sampled_outputs_follow_the_targets_distribution(target, byte_tokenizer, spec):
    """2,000 seeded requests at temperature 1, k = 2. Token 1 comes from the prompt's pass, the
    next from a verifying pass over two drafts (accepted, drawn from the residual, or the bonus
    token). The drafts: another random model, whose distribution differs from the target's, or
    prompt lookup, a point mass (the prompt holds every token once, so every token 1 finds a
    continuation). Each checked token passes a chi-square test against the target's own marginal,
    which the proposals alone would fail."""
    g = torch.Generator().manual_seed(0)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8] if spec == "draft" else torch.randperm(100, generator=g).tolist()
    n_checked = 3 if spec == "draft" else 2
    want = _marginals(target, prompt, 1.0, n_checked)
    draft = tiny("int4-g32", seed=1)
    config = EngineConfig(kv_format="f16", kv_memory=4 << 20, max_num_seqs=64, max_waiting=4096,
                          speculative=SpecConfig.parse("draft=x,k=2" if spec == "draft" else "ngram,k=2,n=1"))
    engine = Engine(target, byte_tokenizer, config, draft_model=draft if spec == "draft" else None)
    N = 2000
    sp = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4, ignore_eos=True, seed=s) for s in range(N)]
    got, _, _ = run(engine, [(prompt, p, None) for p in sp])
    for i in range(n_checked):
        counts = torch.bincount(torch.tensor([t[i] for t in got]), minlength=101).double()
        assert _chi2_pvalue(counts, want[i]) > 1e-3, f"token {i + 1}"
    stats = engine.stats()
    assert stats["spec_passes"] > 0.9 * N and 0 < stats["spec_accepted"] < stats["spec_drafted"]
    # power: the proposals alone are far from the target (a verifier accepting everything fails)
    if spec == "draft":
        q = _marginals(draft, prompt, 1.0)[1]
    else:  # prompt lookup proposes, after t1, the token that followed t1 in the prompt
        after = {a: b for a, b in zip(prompt, prompt[1:])}
        q = torch.zeros(101, dtype=torch.float64)
        for t1, p in enumerate(want[0].tolist()):
            q[after.get(t1, 0)] += p
    assert _chi2_pvalue((q * N).round(), want[1]) < 1e-6
    assert_all_free(engine)


def test_served_with_speculation_reports_it_on_metrics(target, byte_tokenizer):
    """`lowbit serve --speculative ...`'s engine behind the OpenAI port: a greedy completion equals
    the non-speculative engine's, and /metrics carries the speculative counters."""
    import httpx

    from lowbit.runtime.engine.engine import AsyncEngine
    from lowbit.runtime.server.app import Served, build_app
    from tests.helpers import serving

    class Tok(type(byte_tokenizer)):  # printable text for every id, as the server streams text
        def token_bytes(self, i: int) -> bytes:
            return b"" if i == 100 else bytes([32 + i % 95])

        def encode(self, text: str, add_special: bool = True, limit=None) -> list[int]:
            return [min(max(ord(ch) - 32, 0), 99) for ch in text]

    prompt = "abcabcabcabc"
    want, _, _ = run(Engine(target, Tok(), EngineConfig(kv_memory=1 << 20)),
                     [(Tok().encode(prompt), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), None)])
    engine = Engine(target, Tok(), EngineConfig(kv_memory=1 << 20, speculative=SpecConfig.parse("ngram,k=3")))
    app = build_app(Served(AsyncEngine(engine), Tok(), "tiny", CFG.max_seq_len), api_key=None)
    with serving(app) as base:
        r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 20,
                                                       "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "".join(chr(32 + t % 95) for t in want[0])
        metrics = httpx.get(base + "/metrics").text
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("lowbit_spec")}
        assert values["lowbit_spec_draft_tokens_total"] > 0 and values["lowbit_spec_decode_passes_total"] > 0
        assert 0 <= values["lowbit_spec_accepted_tokens_total"] <= values["lowbit_spec_draft_tokens_total"]
        assert "lowbit_spec_acceptance_rate" in values and "lowbit_spec_tokens_per_pass" in values


@pytest.mark.parametrize("window", [None, 24])
def test_one_by_one_rows_attend_exactly_as_decode_steps(window):
    """A speculative chunk's attention (PagedBatch.one_by_one) equals, bit for bit, the same tokens
    attended one decode step at a time; the batched chunk is only close (SDPA's kernels differ in
    the last bits with the number of queries)."""
    from lowbit.models.attention import PagedAttention, PagedBatch
    from lowbit.models.backend import torch_backend
    from lowbit.quant.kv import KV_FORMATS
    from lowbit.runtime.engine.kv_cache import KVPool

    H, Hkv, D, P, ctx0, n = 9, 3, 64, 16, 37, 5
    g = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(ctx0 + n, Hkv, D, generator=g), torch.randn(ctx0 + n, Hkv, D, generator=g),
               torch.randn(ctx0 + n, H, D, generator=g))
    pages = torch.tensor([3, 0, 2, 1])

    def step(pool, start: int, count: int, one_by_one: bool) -> torch.Tensor:
        pos = torch.arange(start, start + count)
        b = PagedBatch(pos, pages[pos // P] * P + pos % P, [count], [start + count], [pages],
                       torch.arange(count), [one_by_one])
        return PagedAttention(pool, b, window, torch_backend())(0, q[start:start + count], k[start:start + count],
                                                v[start:start + count])

    pools = [KVPool(KV_FORMATS["k8v4"], 1, Hkv, D, num_pages=4, page_size=P) for _ in range(3)]
    for pool in pools:
        step(pool, 0, ctx0, False)  # the same prompt in every pool
    chunk = step(pools[0], ctx0, n, True)
    batched = step(pools[1], ctx0, n, False)
    single = torch.cat([step(pools[2], ctx0 + i, 1, False) for i in range(n)])
    assert torch.equal(chunk, single)
    assert torch.allclose(batched, single, atol=1e-5)


def _steps(engine: Engine, reqs) -> tuple[list, list, int]:
    ids = [engine.add_request(p, sp) for p, sp in reqs]
    toks, lps, usage, n = {i: [] for i in ids}, {i: [] for i in ids}, {}, 0
    while engine.has_work():
        n += 1
        for d in engine.step():
            toks[d.request_id] += d.token_ids
            lps[d.request_id] += d.logprobs
            if d.finish_reason:
                usage[d.request_id] = d.usage
    return [(toks[i], lps[i], usage[i].completion_tokens) for i in ids], n


PAGE_BYTES = CFG.n_layers * 2 * CFG.n_kv_heads * CFG.head_dim * 2 * 16  # one f16 page of 16 tokens


def test_drafts_never_cost_other_sequences_pages_or_budget(target, byte_tokenizer):
    """Drafts are dropped, not paid for: a pool sized for two replies without drafts preempts
    nobody, a step budget of one token per sequence still decodes every sequence each step, and a
    reply growing to the pool's end stops where plain decoding stops, its draft pages freed."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ps = [p * 2 for p in prompts(4, seed=9)[:2]]
    ps = [p[:10] * 2 for p in ps]  # repeating: the self-draft is right most of the time
    spec = SpecConfig.parse("draft=self,k=4")
    for kw in ({"kv_memory": 8 * PAGE_BYTES}, {"kv_memory": 1 << 20, "max_num_seqs": 2, "max_step_tokens": 2}):
        plain, n_plain = _steps(Engine(target, byte_tokenizer, EngineConfig(kv_format="f16", **kw)),
                                [(p, greedy) for p in ps])
        engine = Engine(target, byte_tokenizer, EngineConfig(kv_format="f16", speculative=spec, **kw),
                        draft_model=tiny("int4-g128"))
        got, n_spec = _steps(engine, [(p, greedy) for p in ps])
        assert got == plain and engine.stats()["preemptions"] == 0 and n_spec <= n_plain, kw
        assert_all_free(engine)
    # one reply to the end of a 3-page pool (48 tokens): "length" at the same token, and the draft's
    # pool (a 1-layer draft: 6 pages in the same bytes, so it is not the one that fills) freed
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    plain, _ = _steps(Engine(target, byte_tokenizer, EngineConfig(kv_format="f16", kv_memory=3 * PAGE_BYTES)),
                      [(ps[0], long)])
    one_layer = dataclasses.replace(CFG, n_layers=1)
    draft = Llama(one_layer, random_weights(one_layer, "int4-g32", "int8", seed=2, scale=0.1)).eval()
    engine = Engine(target, byte_tokenizer, EngineConfig(kv_format="f16", kv_memory=3 * PAGE_BYTES, speculative=spec),
                    draft_model=draft)
    got, _ = _steps(engine, [(ps[0], long)])
    pages = engine.pool.num_pages * 16
    assert got == plain and got[0][2] == pages - len(ps[0]) + 1  # the pool full, plus the token pending
    assert_all_free(engine)


def test_logprobs_of_verified_tokens_equal_plain_decodings(target, byte_tokenizer):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    p = prompts(2, seed=4)[1]
    plain, _ = _steps(Engine(target, byte_tokenizer, EngineConfig(kv_memory=1 << 20)), [(p, sp)])
    engine = Engine(target, byte_tokenizer, EngineConfig(kv_memory=1 << 20, speculative=SpecConfig.parse("ngram,k=3")))
    got, _ = _steps(engine, [(p, sp)])
    assert got == plain and len(got[0][1]) == 20 and engine.stats()["spec_accepted"] > 0


def test_a_bad_spec_k_leaves_nothing_behind(target, byte_tokenizer):
    engine = Engine(target, byte_tokenizer, EngineConfig(kv_memory=1 << 20, speculative=SpecConfig.parse("ngram,k=3")))
    with pytest.raises(ValueError, match="spec_k must be in 0..16"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), spec_k=17)
    assert not engine.has_work() and not engine.requests
