"""Gated DeltaNet's two sequence ops (Qwen3.5's linear-attention layers), one sequence at a time, fp32.

The short causal convolution: each channel c of x [T, C] is convolved with its own K taps (K = 4 in every
Qwen3.5), over the previous K - 1 inputs carried in a per-sequence conv state [C, K - 1], then SiLU.

The gated delta rule, per value head, over a state S [Dk, Dv] that every token decays and then corrects:

    S <- exp(g_t) * S                      g_t <= 0: the head's log decay at token t
    u_t = beta_t * (v_t - S^T k_t)         the part of v_t the state does not yet predict, times the rate
    S <- S + k_t u_t^T                     written at key k_t (the delta rule)
    o_t = S^T q_t

q and k arrive L2-normalised and q scaled by Dk^-1/2 (`prepare_qk`). `delta_rule_ref` is the spec: the
recurrence token by token. `delta_rule_chunked` computes the same thing a chunk of L tokens at a time with
matmuls (the closed form below), which is what makes a prompt fast: at Qwen3.5-4B's shapes (32 value
heads of 128 x 128) the token loop costs 0.8 ms a token and layer on 2 cores (AMD EPYC), the chunked form 0.08 ms
(tests/test_hybrid.py measures both). Both agree within fp32 rounding, not bit for bit, so a prompt's
rows depend on how it was split into chunks at that level (measured ≤ 2e-6 of the largest logit).

The chunk's closed form (derived from the recurrence; G_t = the cumulative log decay within the chunk,
D[t, i] = exp(G_t - G_i) for i <= t, else 0; S0 the state entering the chunk):
    the corrections U [L, Dv] solve  (I + diag(beta) (D o K K^T)_strict) U = diag(beta) (V - diag(e^G) K S0)
    outputs                          O = diag(e^G) Q S0 + (D o Q K^T) U
    state leaving the chunk          S_L = e^{G_L} S0 + (e^{G_L - G} o K)^T U
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # inside the rsqrt of q's and k's L2 norms, as Qwen3.5 was trained (fla's l2norm)
CHUNK = 64  # tokens per chunk: the triangular solve is [H, 64, 64]; the state is read once per chunk


def causal_conv_ref(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x fp32 [T, C] (one sequence's new inputs), state fp32 [C, K - 1] (its previous K - 1 inputs, oldest
    first, zeros at the start; updated in place), weight fp32 [C, K] → silu(conv) fp32 [T, C]."""
    K = weight.shape[1]
    xx = torch.cat([state.t(), x], dim=0)  # [K - 1 + T, C]
    windows = xx.unfold(0, K, 1)  # [T, C, K]: window t is inputs t .. t + K - 1
    y = (windows * weight).sum(-1)
    state.copy_(xx[-(K - 1):].t())
    return F.silu(y)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, n_v_heads: int, tiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk] → L2-normalised, q times Dk^-1/2, each key head serving n_v_heads / Hk value heads:
    [T, Hv, Dk]. grouped (HF's order): value head j reads key head j // r; tiled (llama.cpp's GGUF order, its
    converter reorders the value heads): j reads key head j % Hk."""
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    r = n_v_heads // k.shape[1]
    if r > 1:
        q, k = (x.repeat(1, r, 1) if tiled else x.repeat_interleave(r, dim=1) for x in (q, k))
    return q, k


def delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """The spec, token by token. q, k [T, H, Dk] (prepared), v [T, H, Dv], g, beta [T, H], state fp32
    [H, Dk, Dv] (updated in place) → o fp32 [T, H, Dv]."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        state.mul_(g[t].exp()[:, None, None])
        kv = torch.bmm(k[t][:, None, :], state)[:, 0]  # S^T k [H, Dv]
        u = (v[t] - kv) * beta[t][:, None]
        state.baddbmm_(k[t][:, :, None], u[:, None, :])  # S + k u^T
        out[t] = torch.bmm(q[t][:, None, :], state)[:, 0]
    return out


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """delta_rule_ref's result (within fp32 rounding) a chunk at a time; same arguments."""
    T = q.shape[0]
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))  # [H, T, D]
    g, beta = g.t().float(), beta.t().float()  # [H, T]
    out = torch.empty_like(v)
    s = state
    for a in range(0, T, chunk):
        b = min(a + chunk, T)
        L = b - a
        qc, kc, vc, bc = q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b]
        G = g[:, a:b].cumsum(-1)  # [H, L]
        diff = G[:, :, None] - G[:, None, :]  # [H, L, L]: G_t - G_i
        lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        D = diff.masked_fill(~lower, float("-inf")).exp()  # exp(G_t - G_i) on and below the diagonal
        eG = G.exp()[:, :, None]  # [H, L, 1]
        A = (kc @ kc.transpose(1, 2)) * D * bc[:, :, None]
        system = A.tril(-1) + torch.eye(L, device=q.device)  # unit lower triangular [H, L, L]
        rhs = bc[:, :, None] * (vc - eG * (kc @ s))  # [H, L, Dv]
        U = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, a:b] = eG * (qc @ s) + ((qc @ kc.transpose(1, 2)) * D) @ U
        last = G[:, -1:]  # [H, 1]
        s = last.exp()[:, :, None] * s + ((last - G).exp()[:, :, None] * kc).transpose(1, 2) @ U
    state.copy_(s)
    return out.transpose(0, 1)
