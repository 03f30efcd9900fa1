"""The mixture-of-experts MLP (Qwen3-MoE, gpt-oss, Qwen3.5-MoE): a router picks each token's k experts out of E
and weighs them; each expert is a gated MLP like the dense block's, held in the file's own layout (QuantLinear:
Q4_K / Q6_K tiles, MXFP4 blocks), with biases where the family has them (gpt-oss), and a shared expert where
the weights have one (Qwen3.5-MoE: every token's row also gets sigmoid(shared_gate . x) x one more gated MLP,
added after the routed sum).

Only the experts a step's tokens chose are read: a decode token multiplies its k experts' rows and no
others (Qwen3-30B-A3B: 8 of 128, so ~6% of the expert bytes per token), and a prompt step groups its
tokens by expert, one pass over each used expert's weights for all the tokens that chose it.

Rows do not depend on their company: the router's logits are fp32 dots in a fixed order per row (on CPU
lowbit's C router, kernels/cpu_router.c; elsewhere the exact path, kernels/exact_mm.py), so the same
token chooses the same experts alone or in a prompt; every expert matmul is a kernel whose rows are the
same at any M; and each token's k outputs are added in ascending expert order whatever the grouping — so
a token's row is bit-identical at any M and any mix of sequences (tests/test_moe.py), as the dense
block's is. On CPU a fast step's experts run in one C call (kernels/cpu_moe.c), and a decode step's MoE
blocks inside the one-call fused decode (kernels/cpu_block.c); on CUDA GGUF experts run in one grouped
Triton launch per projection (kernels/moe_triton.py) — each the per-expert loop's rows bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.kernels.cpu_moe import fused_experts
from lowbit.kernels.moe_triton import GroupedGgml, grouped_mm, sort_by_expert, stack_experts
from lowbit.models.backend import Backend
from lowbit.quant import FloatWeight, parse_weights
from lowbit.quant.dense import to_float
from lowbit.quant.linear import ExactRows, QuantLinear, all_fast


class Expert(nn.Module):
    """One gated MLP: w_down(act(w_gate x) * w_up x), its gate and up in one kernel call where they fuse."""

    def __init__(self, w: dict, prefix: str, backend: Backend, projections):
        super().__init__()
        self.gate_up = projections([w[prefix + "w_gate"], w[prefix + "w_up"]],
                                   [w.get(prefix + "b_gate"), w.get(prefix + "b_up")], backend)
        self.w_down = QuantLinear(w[prefix + "w_down"], backend.linear, w.get(prefix + "b_down"))


class Experts(nn.Module):
    def __init__(self, config, w: dict, prefix: str, backend: Backend, projections, act):
        """w: the layer's weights by name: `router` [E, dim] and `experts.{e}.{w_gate,w_up,w_down}`
        (runtime/load/gguf.py, safetensors.py); `projections` builds a fused gate+up (models/llama.py);
        `act` is the block's gated activation (gate, up [M, I]) → [M, I]."""
        super().__init__()
        c = config
        self.k, self.norm_topk, self.act, self.rule = c.n_experts_used, c.norm_topk, act, c.family.experts
        # [E, dim] (+ bias [E], gpt-oss), F32 in llama.cpp's files
        self.router = QuantLinear(w[prefix + "router"], backend.linear, w.get(prefix + "router_bias"))
        self.experts = nn.ModuleList(Expert(w, f"{prefix}experts.{e}.", backend, projections)
                                     for e in range(c.n_experts))
        # CPU with the C kernels: every expert of a fast step in one C call (kernels/cpu_moe.py), the per-expert
        # loop's rows bit for bit; None where a weight's layout is not one it reads (then the loop runs)
        # (the router too: cpu_router.c, which `route` then runs, so the fused decode block picks alike)
        self.fused = None
        router = self.router.w.weight if isinstance(self.router.w, FloatWeight) else None  # F32 in GGUF files
        if backend.native is not None and router is not None and all(len(x.gate_up.parts) == 1 for x in self.experts):
            self.fused = fused_experts(c.dim, c.expert_hidden_dim, c.family.activation, c.swiglu_clamp,
                                       [((x.gate_up.parts[0].w, x.gate_up.parts[0].bias), (x.w_down.w, x.w_down.bias))
                                        for x in self.experts],
                                       (router.float().contiguous(), self.router.bias, self.k, self.rule,
                                        self.norm_topk), native=backend.native)
        self.grouped = _grouped(self.experts)  # CUDA: the experts' GGUF blocks stacked for one launch, or None
        # Qwen3.5-MoE: a shared expert `shared.{w_gate,w_up,w_down}` that every token runs, and its gate
        # `shared_gate` [dim] (F32 in llama.cpp's files), a [1, dim] matrix here so it takes the exact path
        self.shared = self.shared_gate = None
        if c.shared_expert_hidden_dim:
            self.shared = Expert(w, prefix + "shared.", backend, projections)
            gate = w[prefix + "shared_gate"].float().reshape(1, c.dim)
            self.shared_gate = QuantLinear(to_float(gate, parse_weights("f32")), backend.linear)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [M, dim] → (expert ids int64 [M, k], weights fp32 [M, k]), as transformers computes them.
        "softmax" (Qwen3-MoE): softmax over all E in fp32, the k largest, divided by their sum (norm_topk);
        "topk_softmax" (gpt-oss): the k largest logits, softmax over those k.
        With the C experts (CPU), their router computes it (cpu_router.c: fp32 dots in a fixed order, ties to the
        lower id), as the fused decode block does, so both paths choose alike; the largest first either way."""
        if self.fused is not None and h.dtype == torch.float32 and h.device.type == "cpu":
            return self.fused.route(h)
        logits = self.router(h, True, torch.float32)  # [M, E], exact: the same choice at any M
        if self.rule == "topk_softmax":
            top, ids = torch.topk(logits, self.k, dim=-1)  # [M, k]
            return ids, torch.softmax(top, dim=-1)
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.k, dim=-1)  # [M, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, h: torch.Tensor, exact, dtype: torch.dtype) -> torch.Tensor:
        """h [M, dim] (the normed residual) → the weighted sum of each token's k experts, fp32 [M, dim]."""
        ids, weights = self.route(h)
        M = h.shape[0]
        if self.fused is not None and all_fast(exact, M) and h.dtype == torch.float32:
            out = self.fused(h, ids, weights)  # [M, dim]: the loop below in one C call
        elif self.grouped is not None and not isinstance(exact, ExactRows):
            out = self._grouped(h, ids, weights, exact)
        else:
            out = self._per_expert(h, ids, weights, exact)
        if self.shared is not None:
            out += self.shared_expert(h, exact)
        return out.to(dtype)

    def _per_expert(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, exact) -> torch.Tensor:
        """The routed experts expert by expert (exact rows, CUDA, layouts the C call does not read) → fp32
        [M, dim]: each expert's kernel calls on the rows that chose it."""
        M = h.shape[0]
        out = torch.zeros(M, h.shape[1], dtype=torch.float32, device=h.device)
        # the (token, slot) pairs that chose each expert, grouped on the host: a decode step's k experts cost
        # k matmul calls and no index ops (Qwen3-30B-A3B: 48 layers x 8 experts a token)
        chose: dict[int, list[tuple[int, int]]] = {}
        for t, row in enumerate(ids.tolist()):
            for j, e in enumerate(row):
                chose.setdefault(e, []).append((t, j))
        for e in sorted(chose):  # ascending: each token adds its experts in the same order at any M
            expert = self.experts[e]
            if M == 1:
                x, ex, w = h, exact, weights[0, chose[e][0][1]]
            else:
                rows = torch.tensor([t for t, _ in chose[e]], device=h.device)
                x, ex = h[rows], exact.take(rows) if isinstance(exact, ExactRows) else exact
                w = weights[rows, torch.tensor([j for _, j in chose[e]], device=h.device)][:, None]  # [n, 1]
            gate, up = expert.gate_up(x, ex)
            y = expert.w_down(self.act(gate, up), ex, torch.float32) * w  # [n, dim]
            if M == 1:
                out += y
            else:
                out.index_add_(0, rows, y)
        return out

    def _grouped(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, exact) -> torch.Tensor:
        """The per-expert loop in two grouped launches (kernels/moe_triton.py), with no host sync → fp32 [M, dim].
        x is what the Triton backend's matmul multiplies (fp32 on the exact path), the activation runs over
        the padded positions, and each token adds its k weighted outputs in ascending expert order."""
        gate_up, down = self.grouped
        routing = sort_by_expert(ids, len(self.experts))
        x = h.float() if exact else h
        y = grouped_mm(x, gate_up, routing, gather=True)  # [P, 2I] at padded positions
        gate, up = y.split(self.experts[0].gate_up.sizes, dim=-1)
        y = grouped_mm(self.act(gate, up), down, routing, gather=False, out_dtype=torch.float32)  # [P, dim]
        y = y[routing.where] * weights[..., None]  # [M, k, dim]: each slot's weighted output
        by_expert = ids.argsort(dim=1)[..., None].expand_as(y)  # [M, k, dim]
        y = y.gather(1, by_expert)
        out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        for j in range(self.k):
            out += y[:, j]
        return out

    def shared_expert(self, h: torch.Tensor, exact) -> torch.Tensor:
        """h [M, dim] → sigmoid(shared_gate . h) x the shared gated MLP of h, fp32 [M, dim] (Qwen3.5-MoE), which
        forward adds to the routed experts' sum as transformers does (expert_output + shared_expert_output).
        Every row runs it whatever it chose, so it is one batched call; the gate's dot product takes the exact
        path, like the router's, so a row's scale is the same at any M."""
        gate, up = self.shared.gate_up(h, exact)
        y = self.shared.w_down(self.act(gate, up), exact, torch.float32)  # [M, dim]
        return torch.sigmoid(self.shared_gate(h, True, torch.float32)) * y  # [M, 1] scales


def _grouped(experts: nn.ModuleList) -> tuple[GroupedGgml, GroupedGgml] | None:
    """(gate+up, down) of every expert stacked for kernels/moe_triton.py when each is one Triton GGML-block
    weight of the same types (GGUF files on CUDA); each expert's buffers become views of the stacks, so
    the bytes are held (and counted) once. None otherwise: the per-expert loop runs."""
    if any(len(x.gate_up.parts) != 1 for x in experts):
        return None
    stacks = []
    for layers in ([x.gate_up.parts[0] for x in experts], [x.w_down for x in experts]):
        stack = stack_experts([q.w for q in layers], [q.bias for q in layers])
        if stack is None:
            return None
        for q in layers:  # the buffers now hold views of the stack
            q.data = q.w.data
            if q.w.data2 is not None:
                q.data2 = q.w.data2
        stacks.append(stack)
    return stacks[0], stacks[1]
