"""The CUDA path of the model: the Triton backend end to end, static-shape decode, CUDA graphs.

Without a GPU the Triton backend runs on the CPU under Triton's interpreter (tests/conftest.py),
so the whole CUDA forward pass — every kernel, the layout conversion, the fused residual — is
checked here against the CPU (torch) backend, whose exact path matches transformers
(tests/test_exactness.py, tests/test_safetensors_models.py). The `gpu` cases repeat the checks
compiled on CUDA and add graph capture.
"""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.triton_import import interpreting
from lowbit.models.backend import select_backend, torch_backend, triton_backend
from lowbit.models.config import LlamaConfig
from lowbit.models.llama import KVCache, Llama
from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.cuda_graphs import GraphedDecode
from lowbit.runtime.engine.generate import generate
from lowbit.runtime.engine.sampler import Sampler, SamplingParams

VOCAB = 101
CFG = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                  vocab_size=VOCAB, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64, tie_embeddings=True)
DEVICES = [pytest.param("cpu", id="interp"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _triton(device: str, dtype: str = "float16"):
    if device == "cpu" and not interpreting():
        pytest.skip("the Triton backend on CPU needs TRITON_INTERPRET=1")
    return triton_backend(device, dtype)


def _models(device: str, dtype: str = "float16", weights: str = "int4-g32", seed: int = 0):
    # scale 0.1 keeps logits in a trained model's range (|logit| < ~10); at 0.4 this random model
    # amplifies activations until bf16 rounding alone costs KL 2e-2 on the CPU's own bf16 kernels
    w = random_weights(CFG, weights, "int8-g32", seed=seed, scale=0.1)
    return Llama(CFG, w, torch_backend()).eval(), Llama(CFG, w, _triton(device, dtype)).eval()


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from logits [..., V]."""
    lp, lq = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, max_kl", [("float16", 2e-6), ("bfloat16", 2e-4)])
@pytest.mark.parametrize("weights", ["int4-g32", "int4-sym-g64", "int8", "f16"])
@torch.inference_mode()
def test_triton_forward_matches_the_reference(weights, dtype, max_kl, device):
    """Prefill of 2 sequences x 9 tokens: fp16/bf16 activations stay within a KL budget of the
    exact fp32 reference (measured max over tokens: fp16 3e-7..4e-7, bf16 5e-5 — the CPU's own
    bf16 decode kernels: 3e-5), and exact=True — the kernel's IEEE fp32 path — agrees with it to
    fp32 rounding."""
    ref_model, model = _models(device, dtype, weights)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = ref_model(tokens, KVCache.empty(CFG, 2, 16), 0, exact=True)
    fast = model(tokens.to(device), KVCache.empty(CFG, 2, 16, device), 0).cpu()
    assert fast.shape == ref.shape == (2, 9, VOCAB)
    assert _kl(ref, fast).max() < max_kl
    exact = model(tokens.to(device), KVCache.empty(CFG, 2, 16, device), 0, exact=True).cpu()
    torch.testing.assert_close(exact, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@torch.inference_mode()
def test_static_decode_equals_sliced_decode(backend):
    """`decode` (positions as a tensor, whole-cache masked attention: the CUDA-graph form) gives
    the logits of the ordinary one-token forward, for sequences at different positions."""
    ref_model, tri_model = _models("cpu") if backend == "triton" else (None, None)
    model = tri_model if backend == "triton" else Llama(CFG, random_weights(CFG), torch_backend()).eval()
    lens = [3, 11, 6]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=g) for n in lens]
    batch, single = KVCache.empty(CFG, 3, 20), [KVCache.empty(CFG, 1, 20) for _ in lens]
    for b, p in enumerate(prompts):
        model(p, KVCache(batch.k[:, b:b + 1], batch.v[:, b:b + 1]), 0)  # slot b's rows (views)
        model(p, single[b], 0)
    nxt = torch.tensor([7, 8, 9])
    got = model.decode(nxt, torch.tensor(lens), batch)  # [3, V]
    tol = 2e-3 if backend == "triton" else 1e-5  # fp16 activations: an ulp flip in attention's output
    for b, n in enumerate(lens):
        want = model(nxt[b].view(1, 1), single[b], n)[0, 0]
        torch.testing.assert_close(got[b], want, atol=tol, rtol=tol)
        torch.testing.assert_close(batch.k[:, b, :, : n + 1], single[b].k[:, 0, :, : n + 1])


@torch.inference_mode()
def test_graphed_decode_buckets_and_spare_slots():
    """Buckets: 3 sequences run in the 4-slot bucket; the spare slot decodes at position 0 of its
    own row, and the live rows' caches are written only at their own positions."""
    model = Llama(CFG, random_weights(CFG), torch_backend()).eval()
    cache = KVCache.empty(CFG, 4, 16)
    runner = GraphedDecode(model, cache, buckets=(1, 2, 4), use_graphs=False)
    assert [runner.bucket(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ValueError, match="exceeds"):
        runner.bucket(5)
    before = cache.k.clone()
    tokens, positions = torch.tensor([1, 2, 3]), torch.tensor([0, 5, 9])
    out = runner(tokens, positions)
    assert out.shape == (3, VOCAB)
    torch.testing.assert_close(out, model.decode(tokens, positions, KVCache.empty(CFG, 3, 16)))
    changed = (cache.k != before).any(dim=(0, 2, 4))  # [slots, S]: which (slot, position) got written
    assert changed.nonzero().tolist() == [[0, 0], [1, 5], [2, 9], [3, 0]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1])
def test_generate_on_the_triton_backend(seed, device):
    """Verified greedy on the Triton backend gives the exact model's greedy tokens (the torch
    backend's exact path), and sampling with a seed is reproducible."""
    ref_model, model = _models(device, seed=seed)
    tok = _ByteTokenizer()
    prompt = torch.randint(0, 100, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
    greedy = Sampler(SamplingParams(temperature=0))
    want = generate(ref_model, tok, prompt, 12, greedy)
    got = generate(model, tok, prompt, 12, greedy)
    assert got.token_ids == want.token_ids
    a = generate(model, tok, prompt, 8, Sampler(SamplingParams(temperature=0.8, seed=3)), verify_greedy=False)
    b = generate(model, tok, prompt, 8, Sampler(SamplingParams(temperature=0.8, seed=3)), verify_greedy=False)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


@pytest.mark.gpu
@torch.inference_mode()
def test_cuda_graph_replay_equals_eager():
    """Graph replay (captured per bucket) gives the eager step's logits, over several steps and
    batch sizes, and keeps writing the cache at the right positions."""
    _, model = _models("cuda")
    eager_cache, graph_cache = KVCache.empty(CFG, 4, 32, "cuda"), KVCache.empty(CFG, 4, 32, "cuda")
    eager = GraphedDecode(model, eager_cache, buckets=(1, 2, 4), use_graphs=False)
    graphed = GraphedDecode(model, graph_cache, buckets=(1, 2, 4), use_graphs=True)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        B = [1, 3, 4, 2, 4, 1][step]
        tokens = torch.randint(0, VOCAB, (B,), generator=g).cuda()
        positions = torch.full((B,), step, device="cuda")
        torch.testing.assert_close(graphed(tokens, positions), eager(tokens, positions), atol=1e-3, rtol=1e-3)
    assert sorted(graphed.graphs) == [1, 2, 4]
    torch.testing.assert_close(graph_cache.k, eager_cache.k, atol=1e-3, rtol=1e-3)


def test_backend_selection_errors():
    assert select_backend("cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown device"):
        select_backend("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            select_backend("cuda")
        assert select_backend("auto").name == "torch"


class _ByteTokenizer:
    """Token i < 100 is the byte i + 32; 100 is the end token."""

    vocab_size = VOCAB
    special_ids = frozenset({100})
    eos_ids = frozenset({100})

    def token_bytes(self, i: int) -> bytes:
        return b"" if i == 100 else bytes([i + 32])


@pytest.mark.parametrize("device", DEVICES)
def test_engine_on_the_triton_backend(device):
    """The paged engine runs on the Triton backend: with exact matmuls it gives the torch backend's
    greedy tokens for a batch of prompts, in k8v4."""
    from lowbit.runtime.engine.engine import Engine

    ref_model, model = _models(device)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(10, 31)), [42] * 9]

    def tokens(m):
        eng = Engine(m, _ByteTokenizer(), kv_format="k8v4", kv_memory=1 << 20, page_size=4, exact=True)
        for i, p in enumerate(prompts):
            eng.add_request(p, params, f"r{i}")
        out = {f"r{i}": [] for i in range(len(prompts))}
        while eng.has_work():
            for d in eng.step():
                out[d.request_id] += d.token_ids
        return out

    assert tokens(model) == tokens(ref_model)
