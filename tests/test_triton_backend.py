"""The CUDA path of the model: the Triton backend end to end, through the engine.

Without a GPU the Triton backend runs on the CPU under Triton's interpreter (tests/conftest.py),
so the whole CUDA forward pass — every kernel, the layout conversion, the fused residual — is
checked here against the CPU (torch) backend, whose exact path matches transformers
(tests/test_exactness.py, tests/test_safetensors_models.py). The `gpu` cases repeat the checks
compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.triton_import import interpreting
from lowbit.models.backend import select_backend, torch_backend, triton_backend
from lowbit.models.config import LlamaConfig
from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sampler import SamplingParams
from lowbit.runtime.engine.speculative import VERIFIED_GREEDY
from tests.helpers import forward

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
    ref = forward(ref_model, tokens, exact=True)
    fast = forward(model, tokens.to(device)).cpu()
    assert fast.shape == ref.shape == (2, 9, VOCAB)
    assert _kl(ref, fast).max() < max_kl
    exact = forward(model, tokens.to(device), exact=True).cpu()
    torch.testing.assert_close(exact, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("device, seed", [
    pytest.param("cpu", 0, id="0-interp"),  # one seed under the interpreter: 37 s each on 2 cores
    pytest.param("cuda", 0, id="0-cuda", marks=pytest.mark.gpu), pytest.param("cuda", 1, id="1-cuda", marks=pytest.mark.gpu)])
def test_verified_greedy_on_the_triton_backend(seed, device):
    """Verified greedy through the engine on the Triton backend (fp16 drafts, the kernel's fp32
    path verifying) gives the exact model's greedy tokens, recomputed from scratch on the torch
    backend's exact path; sampling with a seed is reproducible."""
    ref_model, model = _models(device, seed=seed)
    tok = _ByteTokenizer()
    prompt = torch.randint(0, 100, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
    ids, want = list(prompt), []
    with torch.inference_mode():
        for _ in range(12):
            want.append(int(forward(ref_model, torch.tensor([ids]), exact=True)[0, -1].argmax()))
            ids.append(want[-1])
    want = want[:next((i for i, t in enumerate(want) if t in tok.eos_ids), len(want))]

    def reply(config: EngineConfig, params: SamplingParams) -> list[int]:
        engine = Engine(model, tok, config)
        engine.add_request(prompt, params)
        out = []
        while engine.has_work():
            out += [t for d in engine.step() for t in d.token_ids]
        return out

    verified = EngineConfig(kv_format="f32", kv_memory=1 << 20, speculative=VERIFIED_GREEDY)
    assert reply(verified, SamplingParams(temperature=0, max_tokens=12)) == want
    # beside a sampled request in the same steps: its rows are fast, the verified ones still exact
    engine = Engine(model, tok, verified)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12))
    engine.add_request(prompt[::-1], SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True))
    together = []
    while engine.has_work():
        together += [t for d in engine.step() if d.request_id == rid for t in d.token_ids]
    assert together == want
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=8)
    a, b = (reply(EngineConfig(kv_memory=1 << 20), sampled) for _ in range(2))
    assert a == b and len(a) > 0


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

    ref_model, model = _models(device)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(10, 31)), [42] * 9]

    def tokens(m):
        eng = Engine(m, _ByteTokenizer(), EngineConfig(kv_format="k8v4", kv_memory=1 << 20, page_size=4, exact=True))
        for i, p in enumerate(prompts):
            eng.add_request(p, params, f"r{i}")
        out = {f"r{i}": [] for i in range(len(prompts))}
        while eng.has_work():
            for d in eng.step():
                out[d.request_id] += d.token_ids
        return out

    assert tokens(model) == tokens(ref_model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["qwen3", "smollm3", "gemma3", "phi3", "ministral3", "qwen3moe", "gpt-oss"])
@torch.inference_mode()
def test_every_family_on_the_triton_backend(family, device, tmp_path):
    """Each family's variants (tests/family_models.py: q/k norms, Gemma's four norms and GeGLU, local
    layers and windows, NoPE layers, partial rotary, query temperature) through the Triton kernels,
    fp16 activations against the CPU's exact fp32 pass on the same int4 weights: measured max KL 5e-6
    (gemma3) to 3.2e-5 (qwen3) over 2 x 24 tokens, which pass Gemma's window of 16 and Ministral's
    temperature onset; fp16 rounding on these unit-gain models (logits of std 3, where the other tests
    here scale weights down to 0.1). A missing variant moves logits by O(1)."""
    from lowbit.quant import parse_weights
    from lowbit.runtime.load.safetensors import load_hf_dir
    from tests.family_models import build

    build(family, VOCAB, seed=5).save_pretrained(tmp_path, safe_serialization=True)
    config, w, _ = load_hf_dir(tmp_path, parse_weights("int4-g32"))
    ref_model, model = Llama(config, w, torch_backend()).eval(), Llama(config, w, _triton(device)).eval()
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    ref = forward(ref_model, tokens, exact=True)
    fast = forward(model, tokens.to(device)).cpu()
    assert _kl(ref, fast).max() < 1e-4, _kl(ref, fast).max()
