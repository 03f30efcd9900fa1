"""Gated DeltaNet's token-by-token step in C (kernels/cpu_gated_delta.c) against its torch spec
(kernels/gated_delta.py: causal_conv_ref + prepare_qk, delta_rule_ref), which tests/test_hybrid.py holds to
transformers' own functions:

  - the conv, q/k prep and the delta rule within fp32 rounding of the spec (≤ 1e-5 of the largest value over
    40 tokens from a nonzero state, grouped and tiled value heads; measured ≤ 2e-7);
  - bit for bit the same state and outputs whether the tokens come one call each (decode) or all in one call
    (a speculative chunk), which is what lets state_cache.keep replay a chunk's kept drafts exactly;
  - odd shapes (Dk != Dv, 3 value heads a key head) and a refusal, in one line, of heads wider than it holds.

The end-to-end oracles (logits within 1e-4 of transformers through decode steps, greedy tokens identical,
speculation's rollback) run through this step in tests/test_hybrid.py, wherever the C kernels build.
"""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels import cpu_native
from lowbit.kernels.gated_delta import L2_EPS, causal_conv_ref, delta_rule_ref, prepare_qk

native = cpu_native.native()
pytestmark = pytest.mark.skipif(native is None, reason="lowbit's C kernels do not build here")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def spec_prep(raw, conv, w, Hk, Hv, Dk, Dv, tiled):
    T = raw.shape[0]
    x = causal_conv_ref(raw, conv, w)
    q, k, v = x.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q, k = prepare_qk(q.reshape(T, Hk, Dk), k.reshape(T, Hk, Dk), Hv, tiled)
    return q.contiguous(), k.contiguous(), v.reshape(T, Hv, Dv).contiguous()


@pytest.mark.parametrize("shape", [(2, 4, 32, 48, 4), (1, 3, 40, 24, 3)], ids=["2-4-32x48", "1-3-40x24"])
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_c_step_equals_the_spec_within_fp32_rounding(shape, tiled):
    Hk, Hv, Dk, Dv, K = shape
    T, C = 40, 2 * Hk * Dk + Hv * Dv
    g0 = torch.Generator().manual_seed(1)
    raw, w = torch.randn(T, C, generator=g0), torch.randn(C, K, generator=g0)
    conv0 = torch.randn(C, K - 1, generator=g0)
    g, beta = -0.3 * torch.rand(T, Hv, generator=g0), torch.rand(T, Hv, generator=g0)
    s0 = 0.1 * torch.randn(Hv, Dk, Dv, generator=g0)

    conv_a, conv_b, s_a, s_b = conv0.clone(), conv0.clone(), s0.clone(), s0.clone()
    qa, ka, va = spec_prep(raw, conv_a, w, Hk, Hv, Dk, Dv, tiled)
    qb, kb, vb = native.gated_delta_prep(raw, conv_b, w, (Hk, Hv, Dk, Dv, tiled), L2_EPS)
    assert torch.equal(conv_a, conv_b)  # the carried inputs: copies
    assert rel(qb, qa) <= 1e-5 and rel(kb, ka) <= 1e-5 and rel(vb, va) <= 1e-5
    oa = delta_rule_ref(qa, ka, va, g, beta, s_a)
    ob = native.gated_delta_rule(qa, ka, va, g, beta, s_b)
    assert rel(ob, oa) <= 1e-5 and rel(s_b, s_a) <= 1e-5


def test_one_token_a_call_is_bit_identical_to_one_call():
    Hk, Hv, Dk, Dv, K, T = 2, 4, 32, 32, 4, 17
    C = 2 * Hk * Dk + Hv * Dv
    g0 = torch.Generator().manual_seed(2)
    raw, w = torch.randn(T, C, generator=g0), torch.randn(C, K, generator=g0)
    g, beta = -0.3 * torch.rand(T, Hv, generator=g0), torch.rand(T, Hv, generator=g0)
    heads = (Hk, Hv, Dk, Dv, True)

    conv, s = torch.zeros(C, K - 1), torch.zeros(Hv, Dk, Dv)
    whole = native.gated_delta_rule(*native.gated_delta_prep(raw, conv, w, heads, L2_EPS), g, beta, s)
    conv1, s1 = torch.zeros(C, K - 1), torch.zeros(Hv, Dk, Dv)
    steps = torch.cat([native.gated_delta_rule(*native.gated_delta_prep(raw[t:t + 1], conv1, w, heads, L2_EPS),
                                               g[t:t + 1], beta[t:t + 1], s1) for t in range(T)])
    assert torch.equal(steps, whole) and torch.equal(s1, s) and torch.equal(conv1, conv)


def test_heads_wider_than_the_kernel_holds_are_refused():
    q = torch.zeros(1, 1, 2048)
    with pytest.raises(ValueError, match="too wide"):
        native.gated_delta_rule(q, q, torch.zeros(1, 1, 8), torch.zeros(1, 1), torch.zeros(1, 1),
                                torch.zeros(1, 2048, 8))
