"""The Triton GGML-block matmul (kernels/ggml_triton.py) against the spec (kernels/ggml_blocks.py,
itself equal to gguf.quants.dequantize: tests/test_ggml_kquants.py), for every block type.

Without CUDA the kernel runs under Triton's interpreter (tests/conftest.py). Blocks are random bytes
with finite fp16 scales — every bit pattern of codes and sub-scales, not only what a quantizer writes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from lowbit.kernels.ggml_blocks import BLOCKS, ggml_dequant_ref
from lowbit.kernels.ggml_triton import ggml_triton_mm, ggml_triton_pack, ggml_triton_rows
from lowbit.kernels.triton_import import interpreting

pytest.importorskip("triton")


@pytest.fixture(params=[pytest.param("cpu", id="interp"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """Where the kernel runs: on the CPU under the interpreter, or compiled on CUDA (`gpu`, skipped
    without it; tests/bench/gpu_check.sh runs those)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if request.param == "cpu" and not interpreting():
        pytest.skip("no GPU, and TRITON_INTERPRET=0: the kernel runs on the CPU only under the interpreter (conftest sets it)")
    return request.param

# where each type's fp16 super-scales sit in its block (made finite below)
SCALES = {"Q2_K": [80, 82], "Q3_K": [108], "Q6_K": [208], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2],
          "Q5_K": [0, 2]}


def random_blocks(qtype: int, N: int, K: int, seed: int) -> torch.Tensor:
    name, qk, nb = BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(N * K // qk, nb), dtype=np.uint8)
    if name == "MXFP4":  # one exponent byte: scales 2^-11..2^-2, as the fp16 ones below
        raw[:, 0] = rng.integers(117, 127, raw.shape[0])
    for o in SCALES.get(name, [0] if name != "MXFP4" else []):
        raw[:, o:o + 2] = rng.uniform(-0.05, 0.05, raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(N, -1))


@pytest.mark.parametrize("qtype", list(BLOCKS), ids=lambda q: BLOCKS[q][0])
def test_matches_the_spec(qtype, device):
    name, qk, _ = BLOCKS[qtype]
    N, K = 40, 2 * qk if qk == 256 else 96  # N: a partial 32-row tile; K: two super-blocks or three blocks
    data = random_blocks(qtype, N, K, seed=qtype)
    ref = ggml_dequant_ref(data, qtype, K)
    # the spec is gguf's arithmetic on these bytes too
    expect = quants.dequantize(data.numpy().reshape(-1), T(qtype)).astype(np.float32).reshape(N, K)
    assert torch.equal(ref, torch.from_numpy(expect))
    w = ggml_triton_pack(data, qtype, K).to(device)
    torch.manual_seed(qtype)
    x = torch.randn(3, K, device=device)
    exact = (x.double() @ ref.to(device).double().t())
    y32 = ggml_triton_mm(x, w)  # fp32 x: an IEEE fp32 dot over exact codes
    scale = exact.abs().max()
    assert (y32.double() - exact).abs().max() <= 1e-5 * scale, name
    y16 = ggml_triton_mm(x.half(), w, out_dtype=torch.float32)  # fp16 x: exact codes, x rounded to fp16
    ref16 = x.half().double() @ ref.to(device).double().t()
    assert (y16.double() - ref16).abs().max() <= 1e-5 * scale, name
    ids = torch.tensor([0, 7, 39, 7], device=device)
    assert torch.equal(ggml_triton_rows(w, ids), ref.to(device)[ids])


def test_one_row_and_a_partial_tile(device):
    qtype = 12  # Q4_K
    data = random_blocks(qtype, 5, 256, seed=1)
    w = ggml_triton_pack(data, qtype, 256).to(device)
    x = torch.randn(1, 256, device=device)
    ref = ggml_dequant_ref(data, qtype, 256).to(device)
    assert torch.allclose(ggml_triton_mm(x, w), x @ ref.t(), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused(device):
    with pytest.raises(ValueError, match="Q4_K layout"):
        ggml_triton_pack(torch.zeros(4, 100, dtype=torch.uint8), 12, 256)
    w = ggml_triton_pack(random_blocks(12, 4, 256, 0), 12, 256).to(device)
    with pytest.raises(ValueError, match="K=256"):
        ggml_triton_mm(torch.zeros(2, 128, device=device), w)


@pytest.mark.parametrize("dtype, max_kl", [("float16", 2e-6), ("float32", 0)])
@torch.inference_mode()
def test_a_model_of_block_weights_on_the_triton_backend(dtype, max_kl, device):
    """A small Llama whose matrices are GGML blocks of several types (Q5_0 Q/K rows fused with Int8 V rows
    turned into Q8_0 blocks — two row segments —, Q4_0, IQ4_NL, Q5_1, a Q4_1 table): the Triton backend
    against the CPU's exact fp32 forward, and the exact path (fp32 activations) equal to fp32 rounding."""
    from lowbit.models.backend import torch_backend, triton_backend
    from lowbit.models.config import LlamaConfig
    from lowbit.models.llama import Llama
    from lowbit.models.synthetic import random_weights
    from lowbit.quant.ggml_block import GgmlWeight, block_spec
    from tests.helpers import forward

    cfg = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                      vocab_size=101, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64, tie_embeddings=True)
    w = random_weights(cfg, "int8-g32", "int8-g32", seed=3, scale=0.1)
    types = {"wq": 6, "wk": 6, "wo": 2, "w_gate": 20, "w_up": 20, "w_down": 7}
    for i in range(cfg.n_layers):
        for name, qtype in types.items():
            N, K = w[f"layers.{i}.{name}"].shape
            data = random_blocks(qtype, N, K, seed=17 * i + qtype)
            # scales kept small (the random codes are full range): a trained model's logit range
            fixed = data.view(N, K // 32, -1).clone()
            fixed[..., 0:2] = torch.from_numpy(np.full(fixed.shape[:2], 0.004, np.float16).view(np.uint8)
                                               .reshape(*fixed.shape[:2], 2))
            if qtype in (3, 7):  # the min as well
                fixed[..., 2:4] = torch.from_numpy(np.full(fixed.shape[:2], -0.01, np.float16).view(np.uint8)
                                                   .reshape(*fixed.shape[:2], 2))
            w[f"layers.{i}.{name}"] = GgmlWeight(block_spec(qtype), K, fixed.reshape(N, -1))
    ref_model = Llama(cfg, w, torch_backend(native=None)).eval()
    model = Llama(cfg, w, triton_backend(device, "float16")).eval()
    assert model.layers[0].qkv.parts[0].w.data2 is not None  # Q5_0 Q/K rows, Q8_0 V rows: one weight
    tokens = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(1))
    ref = forward(ref_model, tokens, exact=True)
    got = forward(model, tokens.to(device), exact=dtype == "float32").cpu().float()
    lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    if max_kl:
        assert kl.max() < max_kl, kl.max()
        assert ref.std(-1).min() > 0.05 and not torch.equal(got, ref)  # a live model, computed apart
    else:
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
