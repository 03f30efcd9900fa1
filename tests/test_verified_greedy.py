"""Verified greedy (`lowbit run --temperature 0`) inside the engine, the sampler and the streaming
detokenizer, on a tiny random model (no files).

The oracle for verified greedy decoding is step-by-step greedy decoding with every matmul exact
(`exact=True`), recomputed from scratch each step: the two must give the same tokens, although the
fast kernels that draft them disagree with the exact pass now and then on a random model.
"""

import math

import pytest
import torch

from lowbit.models.config import LlamaConfig
from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.quant.kv import KV_FORMATS
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.detokenizer import StreamDetokenizer
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sampler import SamplingParams, SamplingState, sample_batch
from lowbit.runtime.engine.speculative import VERIFIED_GREEDY
from tests.helpers import forward

VOCAB = 101
CTX = 64


def tiny_model(seed: int = 0) -> Llama:
    cfg = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                      vocab_size=VOCAB, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=CTX, tie_embeddings=False)
    return Llama(cfg, random_weights(cfg, "int4-g32", "int8-g32", seed=seed)).eval()


class ByteTokenizer:
    """Token i < 100 is the byte i + 32 (printable ASCII); 100 is the end token."""

    vocab_size = VOCAB
    special_ids = frozenset({100})

    def __init__(self, eos=(100,)):
        self.eos_ids = frozenset(eos)

    def token_bytes(self, i: int) -> bytes:
        return b"" if i == 100 else bytes([i + 32])


@torch.inference_mode()
def exact_greedy(model: Llama, prompt: list[int], n: int, eos: frozenset[int]) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        t = int(forward(model, torch.tensor([ids]), exact=True)[0, -1].argmax())
        if t in eos:
            break
        out.append(t)
        ids.append(t)
    return out


def verified_engine(model, tok, kv_memory: int = 1 << 20) -> Engine:
    return Engine(model, tok, EngineConfig(kv_format="f32", kv_memory=kv_memory, speculative=VERIFIED_GREEDY))


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], str, str]]:
    """The prompts as concurrent requests → (token ids, text, finish reason) of each."""
    rids = [engine.add_request(p, params) for p in prompts]
    got = {rid: ([], [], None) for rid in rids}
    while engine.has_work():
        for d in engine.step():
            ids, text, _ = got[d.request_id]
            got[d.request_id] = (ids + d.token_ids, text + [d.text], d.finish_reason or got[d.request_id][2])
    assert engine.blocks.num_free_pages == engine.pool.num_pages  # drafting's reserved slots all given back
    engine.blocks.check_invariants()
    return [(ids, "".join(text), why) for ids, text, why in (got[r] for r in rids)]


GREEDY = SamplingParams(temperature=0, max_tokens=CTX)


@pytest.mark.parametrize("seed, prompt_len, max_tokens", [(0, 3, 40), (1, 17, 25), (2, 5, 1), (3, 30, 60)])
def test_verified_greedy_equals_exact_greedy(seed, prompt_len, max_tokens):
    model = tiny_model(seed)
    prompt = torch.randint(0, 100, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    tok = ByteTokenizer()
    engine = verified_engine(model, tok)
    [(ids, _, _)] = run(engine, [prompt], SamplingParams(temperature=0, max_tokens=max_tokens))
    want = exact_greedy(model, prompt, min(max_tokens, CTX - prompt_len), tok.eos_ids)
    assert ids == want
    assert len(ids) <= max_tokens and len(prompt) + len(ids) <= CTX  # context limit 64
    if max_tokens > 1:
        assert engine.spec.drafted > 0  # the fast kernels drafted what the exact pass kept


class NoisyRunner:
    """The drafter's runner with noise on its logits: drafts often wrong, on purpose."""

    def __init__(self, runner, seed: int):
        self.runner, self.g = runner, torch.Generator().manual_seed(seed)

    def run(self, chunks, exact):
        x = self.runner.run(chunks, exact)
        return x + 2 * torch.randn(x.shape, generator=self.g)


@pytest.mark.parametrize("noisy", [False, True], ids=["fast-drafts", "wrong-drafts"])
def test_verified_greedy_requests_together_equal_each_alone(noisy):
    """Six requests drafting in the same steps, in a pool of 8 pages that cannot hold them all (some
    wait, some steps find no room for drafts and decode without), each give the exact greedy tokens
    — also when most drafts are wrong and get rolled back."""
    model, tok = tiny_model(4), ByteTokenizer()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 100, (int(n),), generator=g).tolist() for n in (3, 9, 14, 20, 5, 11)]
    c = model.config
    page_bytes = KV_FORMATS["f32"].bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim) * 16
    engine = verified_engine(model, tok, kv_memory=8 * page_bytes)
    assert engine.pool.num_pages == 8
    if noisy:
        engine.proposer.runner = NoisyRunner(engine.proposer.runner, seed=5)
    got = run(engine, prompts, SamplingParams(temperature=0, max_tokens=30))
    assert [ids for ids, _, _ in got] == [exact_greedy(model, p, 30, tok.eos_ids) for p in prompts]
    s = engine.spec
    assert s.passes > 0 and (s.accepted < s.drafted / 2 if noisy else s.accepted > 0.9 * s.drafted), s


def test_verified_greedy_stops_at_end_token_and_counts_output():
    model = tiny_model(0)
    prompt = [5, 6, 7]
    params = SamplingParams(temperature=0, max_tokens=12)
    [(free, _, why_free)] = run(verified_engine(model, ByteTokenizer(eos=())), [prompt], params)
    stop_at = free[3]
    first = free.index(stop_at)
    [(ids, text, why)] = run(verified_engine(model, ByteTokenizer(eos=(stop_at,))), [prompt], params)
    assert ids == free[:first] and why == "stop"
    assert text == "".join(ByteTokenizer().token_bytes(t).decode() for t in ids)
    assert why_free == "length" and len(free) == 12


def test_prompt_at_context_limit_is_refused():
    with pytest.raises(ValueError, match="context limit"):
        verified_engine(tiny_model(0), ByteTokenizer()).add_request(list(range(CTX)), GREEDY)


def test_sampled_requests_of_a_verifying_engine_are_seeded_and_not_verified():
    model = tiny_model(1)
    engine = verified_engine(model, ByteTokenizer())

    def reply(seed):
        return run(engine, [[1, 2, 3]], SamplingParams(temperature=1.5, seed=seed, max_tokens=20))[0][0]

    assert reply(7) == reply(7)
    assert reply(7) != reply(8)
    assert engine.spec.drafted == 0  # only greedy requests are verified


def test_sampler_edges():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])

    def pick(params):  # one token from logits [V]
        return lambda x: sample_batch(x[None], [SamplingState(params)])[0].token

    assert pick(SamplingParams(temperature=0))(logits) == 1
    # top_k = 1 and a tiny top_p both leave only the most likely token
    assert {pick(SamplingParams(temperature=2.0, top_k=1, seed=s))(logits) for s in range(20)} == {1}
    assert {pick(SamplingParams(temperature=2.0, top_p=1e-6, seed=s))(logits) for s in range(20)} == {1}
    # top_p = 0.9 keeps the smallest set reaching 90%: softmax [.08,.60,.22,.05] → {1, 2, 0}
    seen = {pick(SamplingParams(temperature=1.0, top_p=0.9, seed=s))(logits) for s in range(300)}
    assert seen == {0, 1, 2}
    for bad in (dict(temperature=-1), dict(temperature=math.nan), dict(temperature=math.inf),
                dict(top_p=0), dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_stream_detokenizer_releases_only_whole_characters():
    text = "héllo 🤖 世界"
    data = text.encode()

    class Bytes:
        special_ids = frozenset()

        def token_bytes(self, i):
            return data[i:i + 1]

    d = StreamDetokenizer(Bytes())
    pieces = [d.push(i) for i in range(len(data))] + [d.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[data.index("🤖".encode()) + 3] == "🤖"  # emitted with its 4th byte, not before


def test_a_verified_request_attaches_no_cached_pages():
    """A page another request's fast kernels computed is never read by a verified one: after a
    sampled request, a greedy one whose prompt extends that request's text recomputes it all (no
    cached tokens) and still gives the exact greedy tokens."""
    model, tok = tiny_model(2), ByteTokenizer()
    engine = verified_engine(model, tok)
    prompt = list(range(10, 42))  # 32 tokens: two full pages the prefix cache would keep
    rid = engine.add_request(prompt, SamplingParams(temperature=0.9, seed=1, max_tokens=16, ignore_eos=True))
    sampled = []
    while engine.has_work():
        sampled += [t for d in engine.step() if d.request_id == rid for t in d.token_ids]
    follow = prompt + sampled
    engine.add_request(follow, SamplingParams(temperature=0, max_tokens=8))
    out, usage = [], None
    while engine.has_work():
        for d in engine.step():
            out += d.token_ids
            usage = d.usage or usage
    assert usage.cached_tokens == 0 and out == exact_greedy(model, follow, 8, tok.eos_ids)


def test_verified_greedy_cannot_be_told_to_skip_the_exact_path():
    with pytest.raises(ValueError, match="exact=False"):
        EngineConfig(exact=False, speculative=VERIFIED_GREEDY)
