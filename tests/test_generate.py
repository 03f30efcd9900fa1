"""Generation loop, sampler and streaming detokenizer on a tiny random model (no files).

The oracle for verified greedy decoding is step-by-step greedy decoding with every matmul exact
(`exact=True`), recomputed from scratch each step: the two must give the same tokens.
"""

import math

import pytest
import torch

from lowbit.models.config import LlamaConfig
from lowbit.models.llama import KVCache, Llama
from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.detokenizer import StreamDetokenizer
from lowbit.runtime.engine.generate import generate
from lowbit.runtime.engine.sampler import Sampler, SamplingParams

VOCAB = 101


def tiny_model(seed: int = 0) -> Llama:
    cfg = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                      vocab_size=VOCAB, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64, tie_embeddings=False)
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
        logits = model(torch.tensor([ids]), KVCache.empty(model.config, 1, len(ids)), 0, exact=True)[0, -1]
        t = int(logits.argmax())
        if t in eos:
            break
        out.append(t)
        ids.append(t)
    return out


@pytest.mark.parametrize("seed, prompt_len, max_tokens", [(0, 3, 40), (1, 17, 25), (2, 5, 1), (3, 30, 60)])
def test_verified_greedy_equals_exact_greedy(seed, prompt_len, max_tokens):
    model = tiny_model(seed)
    prompt = torch.randint(0, 100, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    tok = ByteTokenizer()
    res = generate(model, tok, prompt, max_tokens, Sampler(SamplingParams(temperature=0)))
    want = exact_greedy(model, prompt, min(max_tokens, 64 - prompt_len), tok.eos_ids)
    assert res.token_ids == want
    assert len(res.token_ids) <= max_tokens and len(prompt) + len(res.token_ids) <= 64  # context limit 64


def test_generation_stops_at_end_token_and_counts_output():
    model = tiny_model(0)
    prompt = [5, 6, 7]
    free = generate(model, ByteTokenizer(eos=()), prompt, 12, Sampler(SamplingParams(temperature=0)))
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    res = generate(model, ByteTokenizer(eos=(stop_at,)), prompt, 12, Sampler(SamplingParams(temperature=0)))
    assert res.token_ids == free.token_ids[:first] and res.finish_reason == "stop"
    assert res.text == "".join(ByteTokenizer().token_bytes(t).decode() for t in res.token_ids)
    assert free.finish_reason == "length" and len(free.token_ids) == 12


def test_prompt_at_context_limit_is_refused():
    with pytest.raises(ValueError, match="context limit"):
        generate(tiny_model(0), ByteTokenizer(), list(range(64)), 4, Sampler(SamplingParams(temperature=0)))


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    model = tiny_model(1)

    def run(seed):
        return generate(model, ByteTokenizer(), [1, 2, 3], 20, Sampler(SamplingParams(temperature=1.5, seed=seed))).token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sampler_edges():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    assert Sampler(SamplingParams(temperature=0))(logits) == 1
    # top_k = 1 and a tiny top_p both leave only the most likely token
    assert {Sampler(SamplingParams(temperature=2.0, top_k=1, seed=s))(logits) for s in range(20)} == {1}
    assert {Sampler(SamplingParams(temperature=2.0, top_p=1e-6, seed=s))(logits) for s in range(20)} == {1}
    # top_p = 0.9 keeps the smallest set reaching 90%: softmax [.08,.60,.22,.05] → {1, 2, 0}
    seen = {Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=s))(logits) for s in range(300)}
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
