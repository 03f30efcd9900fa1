"""`lowbit eval`'s measurements on a tiny random model: the noise floor is exactly zero, perplexity
is exp of the mean NLL (by hand, and against an independent full-precision pass), a finer format
diverges less, and bytes match their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from lowbit.models.config import LlamaConfig
from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.quant.kv import KV_FORMATS
from lowbit.quant.linear import QuantLinear
from lowbit.runtime.eval.evaluate import Variant, evaluate, window_logprobs, windows
from lowbit.runtime.engine.kv_cache import KVPool
from tests.helpers import forward

CFG = LlamaConfig(arch="llama", dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256,
                  vocab_size=101, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=256, tie_embeddings=False)
CTX = 64


def model(weights: str) -> Llama:
    # one seed: every layout quantizes the same N(0, 0.1^2) matrices
    return Llama(CFG, random_weights(CFG, weights, "f32" if weights == "f32" else "int8", seed=0, scale=0.1)).eval()


def nbytes(m) -> int:
    return sum(b.numel() * b.element_size() for b in m.buffers())


def test_reference_row_kl_ppl_and_a_finer_format_diverges_less():
    ids = torch.randint(0, 101, (3 * CTX + 5,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = model("f32")
    variants = [Variant("f32", "f16", ref, nbytes(ref))] + [
        Variant(w, kv, m, nbytes(m)) for w, m in (("int8", model("int8")), ("int4-g128", model("int4-g128")))
        for kv in ("f16",)] + [Variant("f32", "k4v4", ref, nbytes(ref))]
    base, rows = evaluate(ref, variants, ids, ctx=CTX)
    floor, int8, int4, k4v4 = rows
    assert floor.kl_mean == 0 and floor.kl_max == 0 and floor.dppl_pct == 0 and floor.top1_pct == 100
    assert floor.tokens == 3 * CTX // 2  # 3 windows, second halves
    assert int8.kl_mean < int4.kl_mean and 0 < k4v4.kl_mean
    # perplexity by hand from the same log-probabilities ...
    nll = []
    for w in windows(ids, CTX, None):
        lp = window_logprobs(ref, w, "f16")
        nll += [-float(lp[t - 1, w[t]]) for t in range(CTX // 2, CTX)]
    assert base["ppl"] == floor.ppl and math.isclose(floor.ppl, math.exp(sum(nll) / len(nll)), rel_tol=1e-12)
    # ... and against an independent pass: an f32 pool (f16 storage moves it a little)
    nll2 = []
    for w in windows(ids, CTX, None):
        lp = forward(ref, torch.tensor([w]), exact=True)[0].log_softmax(-1)
        nll2 += [-float(lp[t - 1, w[t]]) for t in range(CTX // 2, CTX)]
    assert math.isclose(floor.ppl, math.exp(sum(nll2) / len(nll2)), rel_tol=1e-3)
    assert rows[1].bits_per_weight < 32 and rows[2].bits_per_weight < rows[1].bits_per_weight


def test_bytes_match_their_formulas():
    # int4 asymmetric, groups of 128: 64 bytes of codes + fp16 scale + fp16 min per 128 weights = 4.25 bits
    w = random_weights(CFG, "int4-g128", "int8", seed=0)["layers.0.w_down"]
    layer = QuantLinear(w, Llama(CFG, random_weights(CFG, "int4-g128", "int8", seed=0)).backend.linear)
    assert nbytes(layer) * 8 / (CFG.dim * CFG.hidden_dim) == 4.25
    # KV: the bytes per token a row reports are what a pool of that format holds per token slot
    ids = [i % 101 for i in range(2 * CTX)]
    ref = model("f32")
    _, rows = evaluate(ref, [Variant("f32", kv, ref, nbytes(ref)) for kv in KV_FORMATS], ids, ctx=CTX)
    for r in rows:
        pool = KVPool(KV_FORMATS[r.kv], CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_pages=4, page_size=16)
        assert r.kv_bytes_per_token == pool.nbytes / 64, r.kv


def test_bitsandbytes_rows():
    """bnb-* rows come out of the same measurement: LLM.int8() (8-bit weights, int8 activations)
    diverges less than NF4 (4-bit weights), and both more than nothing."""
    pytest.importorskip("bitsandbytes")
    ids = torch.randint(0, 101, (2 * CTX,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = model("f32")
    variants = [Variant(w, "f16", m, nbytes(m)) for w, m in (("bnb-int8", model("bnb-int8")),
                                                              ("bnb-nf4", model("bnb-nf4")))]
    _, (int8, nf4) = evaluate(ref, variants, ids, ctx=CTX)
    assert 0 < int8.kl_mean < nf4.kl_mean
    assert nf4.bits_per_weight < int8.bits_per_weight < 32
