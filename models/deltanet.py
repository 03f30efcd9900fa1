"""A Gated DeltaNet layer (Qwen3.5's linear attention, three layers in four): the attention half of a hybrid
model's Block (models/llama.py) where the family marks the layer recurrent.

    qkv, z, b, a = in projections of the normed residual        (one fused QuantLinear call where layouts allow)
    q, k, v = silu(short causal conv of qkv)                    over the sequence's conv state [C, K - 1]
    g = A * softplus(a + dt_bias), beta = sigmoid(b)             per value head; A = -exp(A_log) < 0
    o = gated delta rule (kernels/gated_delta.py)                over the sequence's state [Hv, Dk, Dv]
    out = out_proj(rmsnorm(o) * w * silu(z))                     the norm over each value head's Dv values

Instead of K/V pages, each sequence has one slot of fixed-size state (runtime/engine/state_cache.py: conv and
recurrence tensors per DeltaNet layer), named by PagedBatch.state_slots. A chunk starting at position 0 starts
from zeros; any other continues from what the slot holds, so a prompt prefilled in chunks continues across
the chunk boundaries as one whole prefill would. A speculative chunk (one_by_one) runs token by token, as
decode steps would, and is journaled in the state cache so that the rejected drafts can be taken back out
of the state (`states.keep`): a recurrence cannot be truncated the way pages are.

Rows depend on their company only through their own sequence: each sequence's recurrence runs on its own.
Chunks of up to SEQUENTIAL_MAX tokens run the recurrence token by token (bit-equal to decoding them one at a
time): on the CPU in C (kernels/cpu_gated_delta.c: conv, q/k prep and the delta rule, 0.28 ms a layer and token
at Qwen3.5-4B's shapes against the torch spec's 0.69, one thread of an AMD EPYC; equal to the spec within fp32
rounding), else the torch spec; longer prefill chunks take the chunked closed form, equal within fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.kernels.gated_delta import L2_EPS, causal_conv_ref, delta_rule_chunked, delta_rule_ref, prepare_qk
from lowbit.models.backend import Backend
from lowbit.quant.linear import QuantLinear

# tokens of one sequence's chunk up to which the recurrence runs token by token: decode (1), speculative
# chunks (k + 1 <= 17) and short prompts; above, the chunked form is ~10x faster at Qwen3.5-4B's shapes
SEQUENTIAL_MAX = 16


class GatedDeltaNet(nn.Module):
    def __init__(self, config, w: dict, prefix: str, backend: Backend, projections, index: int):
        """w: the layer's weights: ssm_qkv [C, dim], ssm_z [Hv Dv, dim], ssm_beta, ssm_alpha [Hv, dim], ssm_out
        [dim, Hv Dv] (layouts), ssm_conv [C, K], ssm_dt [Hv], ssm_a [Hv] (= -exp(A_log)), ssm_norm [Dv]
        (runtime/load/gguf.py, safetensors.py); `projections` builds fused in-projections (models/llama.py);
        index: this layer's place among the model's DeltaNet layers (its tensors in the state cache)."""
        super().__init__()
        self.shape, self.eps, self.index, self.ops = config.deltanet, config.norm_eps, index, backend
        d = self.shape
        self.in_proj = projections([w[prefix + n] for n in ("ssm_qkv", "ssm_z", "ssm_beta", "ssm_alpha")],
                                   [None] * 4, backend)
        self.out_proj = QuantLinear(w[prefix + "ssm_out"], backend.linear)
        vec = lambda name: w[prefix + name].float().to(backend.device).contiguous()  # noqa: E731
        self.register_buffer("conv_w", vec("ssm_conv").view(d.conv_dim, d.conv_taps), persistent=False)
        for name in ("ssm_dt", "ssm_a", "ssm_norm"):
            self.register_buffer(name, vec(name), persistent=False)

    def forward(self, h: torch.Tensor, states, batch, exact, dtype: torch.dtype) -> torch.Tensor:
        """h [M, dim] (the normed residual of the step's tokens, sequences one after another as `batch`
        lays them out: models/attention.py PagedBatch) → [M, dim]. `states`: the state cache (conv[i]
        [S, C, K - 1], rec[i] [S, Hv, Dk, Dv] fp32 for DeltaNet layer i, `record` for speculative chunks)."""
        d, M = self.shape, h.shape[0]
        qkv, z, b, a = self.in_proj(h, exact)
        g = self.ssm_a * F.softplus(a.float() + self.ssm_dt)  # [M, Hv] log decay, <= 0
        beta = torch.sigmoid(b.float())  # [M, Hv]
        conv, rec = states.conv[self.index], states.rec[self.index]
        one_by_one = batch.one_by_one or [False] * len(batch.query_lens)
        # token-by-token chunks (conv, q/k prep, the rule) run in C where the backend has lowbit's C kernels (CPU)
        native = self.ops.native if h.device.type == "cpu" else None
        heads = (d.k_heads, d.v_heads, d.k_dim, d.v_dim, d.v_tiled)
        o = torch.empty(M, d.v_heads, d.v_dim, dtype=torch.float32, device=h.device)
        r0 = 0
        for n, ctx, slot, one in zip(batch.query_lens, batch.context_lens, batch.state_slots, one_by_one):
            rows = slice(r0, r0 + n)
            r0 += n
            if ctx == n:  # the chunk starts the sequence: from zeros, whatever the slot held before
                conv[slot].zero_()
                rec[slot].zero_()
            raw = qkv[rows].float().contiguous()  # [n, C]
            conv_before = conv[slot].clone() if one else None
            sequential = one or n <= SEQUENTIAL_MAX
            if sequential and native is not None:  # the same steps in C (kernels/cpu_gated_delta.c), 2.5x faster.
                # Prefill chunks keep torch's conv (0.2 ms a token and layer at Qwen3.5-4B's shapes, C's 0.04): C's
                # rounding moved one near-tied expert choice of the tiny Qwen3.5-MoE's Q4_K_M file, KL 9e-4 from the
                # file's exact model (tests/test_hybrid.py), where torch's conv keeps it at 6e-7
                q, k, v = native.gated_delta_prep(raw, conv[slot], self.conv_w, heads, L2_EPS)  # [n, Hv, D]
                rule = native.gated_delta_rule
            else:
                x = causal_conv_ref(raw, conv[slot], self.conv_w)
                q, k, v = x.split([d.k_heads * d.k_dim, d.k_heads * d.k_dim, d.v_heads * d.v_dim], dim=-1)
                q, k = prepare_qk(q.reshape(n, d.k_heads, d.k_dim), k.reshape(n, d.k_heads, d.k_dim), d.v_heads,
                                  d.v_tiled)  # [n, Hv, Dk]
                v = v.reshape(n, d.v_heads, d.v_dim).contiguous()
                rule = delta_rule_ref if sequential else delta_rule_chunked
            gr, br = g[rows].contiguous(), beta[rows].contiguous()  # [n, Hv]
            if one:  # a speculative chunk: its drafts may be taken back out of the state (states.keep, the same rule)
                states.record(self.index, slot, conv_before, raw, (q, k, v, gr, br), rule)
            o[rows] = rule(q, k, v, gr, br, rec[slot])
        # the gated norm: each value head's Dv outputs RMS-normed, times w, times silu(z)
        normed = self.ops.add_rms_norm(o.view(M * d.v_heads, d.v_dim), None, self.ssm_norm, self.eps,
                                       torch.float32)[0]  # [M Hv, Dv]
        y = self.ops.silu_mul(z.float().reshape(M * d.v_heads, d.v_dim).contiguous(), normed)
        return self.out_proj(y.view(M, d.v_heads * d.v_dim).to(dtype), exact)  # [M, dim]
