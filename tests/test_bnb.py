"""bitsandbytes' layouts (quant/bnb.py) against bitsandbytes' own modules, configured as
transformers' BitsAndBytesConfig configures them: `bnb.nn.Linear4bit` (NF4, blocks of 64, fp32
compute, no double quantization) and `bnb.nn.Linear8bitLt` (LLM.int8(), outlier threshold 6.0,
inference mode) must give bit-identical outputs, so a `bnb-*` row of `lowbit eval` measures
exactly what those users run."""

from __future__ import annotations

import pytest
import torch

from lowbit.models.config import LlamaConfig
from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.quant import parse_weights, quantize_weight
from lowbit.quant.linear import QuantLinear, triton_kernels
from tests.helpers import forward

bnb = pytest.importorskip("bitsandbytes")  # a test extra; present in CI

N, K = 96, 192


def _data():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) * 0.1
    x = torch.randn(5, K, generator=g)
    x[:, 3] = 9.0  # an outlier column: LLM.int8() multiplies it in fp16
    return w, x


@torch.no_grad()
def test_nf4_equals_bitsandbytes_linear4bit():
    w, x = _data()
    lin = bnb.nn.Linear4bit(K, N, bias=False, compute_dtype=torch.float32, quant_type="nf4",
                            compress_statistics=False)
    lin.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4", blocksize=64,
                                   compress_statistics=False)
    lin = lin.to("cpu")
    ours = quantize_weight(w, parse_weights("bnb-nf4"))
    assert torch.equal(ours.matmul(x), lin(x))
    assert torch.equal(ours.dequantize(), bnb.functional.dequantize_4bit(lin.weight.data, lin.weight.quant_state))
    # 4 bits per weight + one fp32 absmax per 64 + the 16-entry NF4 table
    assert ours.nbytes == N * K // 2 + 4 * N * K // 64 + 16 * 4


@torch.no_grad()
def test_int8_equals_bitsandbytes_linear8bitlt():
    w, x = _data()
    lin = bnb.nn.Linear8bitLt(K, N, bias=False, has_fp16_weights=False, threshold=6.0)
    lin.weight = bnb.nn.Int8Params(w.half(), requires_grad=False, has_fp16_weights=False)
    lin = lin.to("cpu").eval()
    ours = quantize_weight(w, parse_weights("bnb-int8"))
    assert torch.equal(ours.matmul(x), lin(x.half()).float())
    assert ours.nbytes == N * K + 4 * N  # int8 codes + one fp32 absmax per row
    # the outlier column matters: without the fp16 path the answer moves
    plain = bnb.functional.int8_vectorwise_dequant(ours.CB, ours.SCB).float()
    assert (ours.matmul(x) - x @ plain.t()).abs().max() < 0.05 * (x @ plain.t()).abs().max()


@pytest.mark.parametrize("name", ["bnb-nf4", "bnb-int8"])
def test_rows_keep_the_codes_of_those_rows(name):
    w, _ = _data()
    q = quantize_weight(w, parse_weights(name))
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    assert torch.equal(q.rows(idx).dequantize(), q.dequantize()[idx])


def test_errors_are_clear():
    with pytest.raises(ValueError, match="whole blocks of 64"):
        quantize_weight(torch.randn(8, 96), parse_weights("bnb-nf4"))
    with pytest.raises(ValueError, match="CPU only"):
        triton_kernels(torch.device("cpu")).pack(quantize_weight(torch.randn(8, 64), parse_weights("bnb-int8")))
    assert parse_weights("bnb-nf4").name == "bnb-nf4" and parse_weights("BNB-INT8").name == "bnb-int8"


@torch.no_grad()
def test_a_model_in_bnb_layouts_runs_through_bitsandbytes():
    """Whole forward: every projection is bitsandbytes' matmul of its own quantization of the same
    matrices, so the logits equal a model built from the dequantized weights up to the activation
    arithmetic: NF4 multiplies in fp32 (equal to fp32 rounding: bitsandbytes' GEMM is not lowbit's, and
    on an AVX-512/AMX Xeon the two rounded 1.7e-6 apart where this AMD EPYC gives 0), LLM.int8()
    quantizes activations to int8 per row (measured 0.067 off on logits of magnitude 3.7, not 0: the int8
    path really ran)."""
    c = LlamaConfig(arch="llama", dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256,
                    vocab_size=101, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64, tie_embeddings=False)
    ids = torch.tensor([[1, 5, 9, 33, 2, 70, 11, 4]])
    for name, lo, hi in (("bnb-nf4", 0.0, 1e-4), ("bnb-int8", 1e-3, 0.1)):  # nf4: ~K u |logit| = 256 x 6e-8 x 4
        w = random_weights(c, name, "int8", seed=0, scale=0.1)
        model = Llama(c, w).eval()
        deq = {k: (quantize_weight(v.dequantize(), parse_weights("f32")) if hasattr(v, "spec") and v.spec.codec
                   else v) for k, v in w.items()}
        plain = Llama(c, deq).eval()
        a = forward(model, ids, exact=True)
        b = forward(plain, ids, exact=True)
        assert lo <= float((a - b).abs().max()) <= hi, name
        assert all(isinstance(m.w, type(w["layers.0.wq"])) for m in model.modules() if isinstance(m, QuantLinear)
                   and m is not model.output)
