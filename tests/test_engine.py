"""The engine over the paged KV pool: exactness against full recompute, batch invariance, finish
reasons, prefix caching, page accounting, the async API, and the KV formats' bytes and quality.

Oracle for the tiny random model: greedy decoding recomputed from scratch at every step, one pass
into a fresh f32 pool with exact fp32 matmuls (tests/helpers.py forward; as in tests/test_verified_greedy.py).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from lowbit.models.attention import PagedBatch
from lowbit.models.config import LlamaConfig
from lowbit.models.llama import Llama
from lowbit.models.synthetic import SMOLLM2_135M, random_weights
from lowbit.quant.kv import KV_FORMATS
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import AsyncEngine, Engine
from lowbit.runtime.engine.kv_cache import KVPool
from lowbit.runtime.engine.sampler import SamplingParams
from tests.helpers import ByteTokenizer, forward

VOCAB = 101
CFG = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                  vocab_size=VOCAB, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=128, tie_embeddings=False)
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama(CFG, random_weights(CFG, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@torch.inference_mode()
def exact_greedy(model: Llama, prompt: list[int], n: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        t = int(forward(model, torch.tensor([ids]), exact=True)[0, -1].argmax())
        if t == 100:
            break
        out.append(t)
        ids.append(t)
    return out


def run_all(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for rid, (p, params) in requests.items():
        engine.add_request(p, params, rid)
    out: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_work():
        for d in engine.step():
            out[d.request_id].append(d)
    return out


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def assert_all_pages_free(engine: Engine) -> None:
    engine.blocks.check_invariants()
    assert engine.blocks.num_used_pages == 0 and engine.blocks.num_free_pages == engine.pool.num_pages


@torch.inference_mode()
def test_paged_f16_logits_equal_full_recompute(model):
    """Two sequences prefilled in chunks through the paged f16 pool (non-contiguous pages), then one
    step with a decode token of each: every logit row equals the no-cache full recompute."""
    pool = KVPool(KV_FORMATS["f16"], CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_pages=16, page_size=4)
    seqs = prompts(2, seed=1)
    tables = [torch.tensor([9, 2, 14, 5, 0, 11, 7, 3, 12, 1]), torch.tensor([4, 15, 8, 6, 10, 13])]
    done = [0, 0]
    for chunk in (5, 7, 100):  # three steps: chunks of 5, then 7, then the rest
        q_lens = [min(chunk, len(s) - d) for s, d in zip(seqs, done)]
        toks = torch.tensor([t for s, d, n in zip(seqs, done, q_lens) for t in s[d:d + n]])
        pos = torch.tensor([p for d, n in zip(done, q_lens) for p in range(d, d + n)])
        slots = torch.cat([tab[pp // 4] * 4 + pp % 4 for tab, pp in
                           zip(tables, torch.split(pos, q_lens))])
        ctx = [d + n for d, n in zip(done, q_lens)]
        rows = torch.arange(int(sum(q_lens)))
        got = model.forward_paged(toks, PagedBatch(pos, slots, q_lens, ctx, tables, rows), pool, exact=True)
        row = 0
        for s, d, n in zip(seqs, done, q_lens):
            full = forward(model, torch.tensor([s[:d + n]]), exact=True)[0, d:]
            # f16 storage rounds each K/V value by up to 2^-11 of itself: measured <= 1.7e-3 on
            # logits up to 3.1; a wrong slot, page or position moves them by O(1)
            torch.testing.assert_close(got[row:row + n], full, atol=4e-3, rtol=0)
            row += n
        done = ctx


@pytest.mark.parametrize("kv", ["f16", "k8v4"])
def test_engine_greedy_is_batch_invariant(model, kv):
    """8 different prompts generated together give each one's tokens generated alone; with f16 KV
    those are also the exact recomputed greedy tokens."""
    ps = prompts(8, seed=2)
    make = lambda: Engine(model, ByteTokenizer(),  # noqa: E731
                          EngineConfig(kv_format=kv, kv_memory=1 << 20, page_size=4, max_step_tokens=48, exact=True))
    together_engine = make()
    together = run_all(together_engine, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    assert_all_pages_free(together_engine)
    for i, p in enumerate(ps):
        alone = run_all(make(), {"x": (p, GREEDY)})
        assert tokens_of(together[f"r{i}"]) == tokens_of(alone["x"])
        if kv == "f16":
            assert tokens_of(alone["x"]) == exact_greedy(model, p, 12)


def test_default_kernels_reply_independent_of_batch_and_prefix_cache(decode_kernel):
    """With the default CPU kernels (exact=None: the fast decode kernel — lowbit's C kernel, or the
    exact path where it is not built — for generated tokens, exact fp32 for prompt tokens) a seeded
    reply is the same alone, repeated (the prefix cache then holds most of its prompt, so only a short
    tail is computed), and among 7 other requests — the path is chosen per token, not by how many
    rows a step happens to have."""
    model = Llama(CFG, random_weights(CFG, "int4-g32", "int8-g32", seed=0, scale=0.1), decode_kernel).eval()
    ps = prompts(8, seed=5)
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=16, logit_bias={100: -100}, logprobs=0)

    def reply(deltas) -> tuple[list[int], list[float]]:
        return tokens_of(deltas), [lp for d in deltas for lp, _ in d.logprobs]

    engine = Engine(model, ByteTokenizer(), EngineConfig(kv_memory=1 << 20, page_size=4, max_step_tokens=48))
    first = tokens_of(run_all(engine, {"a": (ps[0], params)})["a"])
    again = run_all(engine, {"b": (ps[0], params)})["b"]
    assert again[-1].usage.cached_tokens > 0 and tokens_of(again) == first
    together = run_all(engine, {f"r{i}": (p, params) for i, p in enumerate(ps)})
    assert tokens_of(together["r0"]) == first
    assert_all_pages_free(engine)
    # not vacuous: the fast and the exact path give other numbers for the same requests (the C kernel
    # rounds activations to 16-bit codes, too finely to flip a sampled token of these 8 replies;
    # without it, both are the exact path)
    if decode_kernel.native is not None:
        forced = [[reply(run_all(Engine(model, ByteTokenizer(), EngineConfig(kv_memory=1 << 20, page_size=4, exact=e)),
                                 {"c": (p, params)})["c"])[1] for p in ps] for e in (True, False)]
        assert forced[0] != forced[1]


def test_preemption_under_page_pressure_completes_everything(model):
    """A pool too small for all requests at once: sequences are preempted and recomputed, every
    request still finishes with the tokens it gets alone, and all pages come back."""
    ps = prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    per_page = KV_FORMATS["f16"].bytes_per_token(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim) * 4
    small = Engine(model, ByteTokenizer(),
                   EngineConfig(kv_format="f16", kv_memory=per_page * 24, page_size=4, exact=True))
    out = run_all(small, {f"r{i}": (p, params) for i, p in enumerate(ps)})
    assert small.scheduler.num_preemptions > 0
    assert_all_pages_free(small)
    for i, p in enumerate(ps):
        alone = run_all(Engine(model, ByteTokenizer(), EngineConfig(kv_format="f16", page_size=4, exact=True)),
                        {"x": (p, params)})
        assert tokens_of(out[f"r{i}"]) == tokens_of(alone["x"])
        assert out[f"r{i}"][-1].finish_reason == "length" and len(tokens_of(out[f"r{i}"])) == 20


def test_finish_reasons_text_and_usage(model):
    eng = Engine(model, ByteTokenizer(), EngineConfig(kv_format="f16", page_size=4))
    p = prompts(1, seed=4)[0]
    free = run_all(eng, {"a": (p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))})["a"]
    text = "".join(d.text for d in free)
    assert free[-1].finish_reason == "length" and free[-1].usage.completion_tokens == 10
    assert text == bytes(t + 32 for t in tokens_of(free) if t != 100).decode(errors="replace")  # 100: no text
    stop = text[3:5]  # a stop string the reply will produce, spanning two tokens
    cut = run_all(eng, {"b": (p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=(stop,)))})["b"]
    assert cut[-1].finish_reason == "stop" and "".join(d.text for d in cut) == text[:text.index(stop)]
    by_id = run_all(eng, {"c": (p, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(tokens_of(free)[2],)))})
    assert by_id["c"][-1].finish_reason == "stop" and tokens_of(by_id["c"]) == tokens_of(free)[:2]
    assert_all_pages_free(eng)


def test_context_size_caps_prompt_and_reply(model):
    """--ctx-size: prompt + reply never exceed it; a prompt that fills it is refused; it cannot
    exceed the model's own context."""
    eng = Engine(model, ByteTokenizer(), EngineConfig(page_size=4, max_model_len=20))
    out = run_all(eng, {"a": (list(range(1, 11)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))})
    assert out["a"][-1].finish_reason == "length" and len(tokens_of(out["a"])) == 10
    with pytest.raises(ValueError, match="context limit is 20"):
        eng.add_request(list(range(1, 21)), GREEDY)
    with pytest.raises(ValueError, match="context size must be in 1..128"):
        Engine(model, ByteTokenizer(), EngineConfig(max_model_len=129))
    assert_all_pages_free(eng)


def test_chat_messages_are_rendered_by_the_template(model):
    eng = Engine(model, ByteTokenizer(), EngineConfig(page_size=4))
    msgs = [{"role": "user", "content": "hi"}]
    by_msgs = run_all(eng, {"m": (msgs, GREEDY)})["m"]
    by_ids = run_all(eng, {"i": (ByteTokenizer().encode_chat(msgs), GREEDY)})["i"]
    assert tokens_of(by_msgs) == tokens_of(by_ids) and by_msgs[-1].usage.prompt_tokens == len("<user>hi<assistant>")


def test_prefix_cache_hit_is_reported(model):
    eng = Engine(model, ByteTokenizer(), EngineConfig(kv_format="k8v4", page_size=4))
    system = list(range(1, 30))
    a = run_all(eng, {"a": (system + [40, 41], GREEDY)})["a"]
    b = run_all(eng, {"b": (system + [50, 51, 52], GREEDY)})["b"]
    assert a[-1].usage.cached_tokens == 0
    assert b[-1].usage.cached_tokens == 28  # the 7 full pages of 4 tokens inside the shared 29
    assert eng.stats()["prefix_hit_rate"] > 0
    assert_all_pages_free(eng)


def test_async_engine_streams_and_aborts(model):
    eng = Engine(model, ByteTokenizer(), EngineConfig(kv_format="k8v4", page_size=4))
    aeng = AsyncEngine(eng)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        async def collect(p):
            return [d async for d in aeng.generate(p, params)]

        async def abort_early(p):
            seen = 0
            async for d in aeng.generate(p, params, request_id="gone"):
                seen += 1
                if seen == 3:
                    aeng.abort("gone")
            return seen

        return await asyncio.gather(collect(prompts(1, 5)[0]), abort_early(prompts(1, 6)[0]))

    full, seen = asyncio.run(main())
    assert full[-1].finish_reason == "length" and len(tokens_of(full)) == 40
    assert seen >= 3
    assert aeng.stats()["running"] == 0
    assert_all_pages_free(eng)


@pytest.mark.parametrize("name", list(KV_FORMATS))
def test_kv_bytes_per_token_match_the_formula(name):
    """Bytes actually held by the pool's tensors, per token, for the default model's shapes."""
    c = SMOLLM2_135M
    fmt = KV_FORMATS[name]
    pool = KVPool(fmt, c.n_layers, c.n_kv_heads, c.head_dim, num_pages=4, page_size=16)
    per_token = pool.nbytes / (4 * 16)
    f16 = KV_FORMATS["f16"].bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim)
    print(f"{name}: {per_token:.0f} bytes/token ({per_token / f16:.3f} x f16)")
    assert per_token == fmt.bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim)
    if name == "k8v4":
        assert per_token <= 0.42 * f16


def test_the_pool_follows_the_model_and_a_refused_prompt_names_the_flag(monkeypatch):
    """With no --kv-memory the pool holds one whole context of the model (SmolLM2-1.7B's shapes at 8,192
    tokens: ~650 MB in k8v4, where a fixed 256 MiB held 3,296 tokens) unless half the free memory is
    less, and never less than 256 MiB; the size is said in one line; a prompt longer than the pool is
    refused naming --kv-memory."""
    from lowbit.runtime.engine import engine as engine_mod
    from lowbit.runtime.engine.config import DEFAULT_KV_MEMORY

    big = LlamaConfig(arch="llama", dim=2048, n_layers=24, n_heads=32, n_kv_heads=32, head_dim=64, hidden_dim=8192,
                      vocab_size=49152, norm_eps=1e-5, rope_theta=1e5, max_seq_len=8192, tie_embeddings=True)
    per_token = KV_FORMATS["k8v4"].bytes_per_token(big.n_layers, big.n_kv_heads, big.head_dim)
    cpu = torch.device("cpu")
    monkeypatch.setattr(engine_mod, "free_memory", lambda device: 64 << 30)
    whole = engine_mod.kv_budget(None, cpu, per_token, 8192)
    assert whole >= per_token * 8192 and whole > DEFAULT_KV_MEMORY
    monkeypatch.setattr(engine_mod, "free_memory", lambda device: 600 << 20)  # half of it: less than a context
    assert engine_mod.kv_budget(None, cpu, per_token, 8192) == 300 << 20
    monkeypatch.setattr(engine_mod, "free_memory", lambda device: 100 << 20)
    assert engine_mod.kv_budget(None, cpu, per_token, 8192) == DEFAULT_KV_MEMORY
    assert engine_mod.kv_budget(None, cpu, 10, 128) == DEFAULT_KV_MEMORY  # a tiny model: the floor
    assert engine_mod.kv_budget(1 << 20, cpu, per_token, 8192) == 1 << 20  # a size given is kept

    tiny = Llama(CFG, random_weights(CFG, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    eng = Engine(tiny, ByteTokenizer(), EngineConfig(kv_memory=4 * KV_FORMATS["k8v4"].bytes_per_token(
        CFG.n_layers, CFG.n_kv_heads, CFG.head_dim) * 16))  # 4 pages: 64 tokens
    assert eng.describe_pool().startswith("KV cache k8v4: ") and "64 tokens" in eng.describe_pool()
    assert "--kv-memory" in eng.describe_pool()
    with pytest.raises(ValueError, match="--kv-memory"):
        eng.add_request(list(range(1, 100)), GREEDY)
