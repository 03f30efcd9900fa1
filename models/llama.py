"""The one forward pass of every family in models/families.py (Llama 2/3, Mistral, Qwen2/3, SmolLM2/3,
Ministral 3, Phi-3/4, Gemma 3): RMSNorm, RoPE, GQA attention, a gated MLP — with every projection a
QuantLinear, so weights stay int4/int8 — and the family's variants switched on by its config: per-head
q/k norms, Gemma's four norms a block, GeGLU, embeddings times sqrt(dim), its own attention scale,
layers without rotary or with a local rotary base and a sliding window, Ministral's query temperature.

The kernels come from the model's Backend (models/backend.py), chosen once from its device. A
forward pass is one engine step (`forward_paged`): the tokens of several sequences, their K/V
written to and read from the paged pool (models/attention.py).
Precision: the residual stream is fp32 (its add is fused into the next norm), attention is fp32.
Between kernels, activations are fp32 on CPU and fp16/bf16 on CUDA. The weight-only matmuls on
CPU go through the C kernels' 16-bit activation codes (kernels/cpu_native.py); `exact=True` forces
exact fp32 everywhere, on CUDA too (see kernels/int4_mm.py, kernels/wq_mm.py and
runtime/engine/speculative.py's verified greedy), and `ExactRows` chooses per row. On CPU decode a block
runs as two fused C calls (kernels/cpu_block.c: q/k norms, Gemma's norms and GeGLU, its layer's rotary
table and window included; config.fused_decode) and a step of them as one; a block with its own softmax
scale (Gemma 3 27B) or Ministral's query temperature runs op by op, the same arithmetic call by call.

Activations run token-major, [M, dim] with M the step's tokens, which is the shape every kernel takes.

Under tensor parallelism (`--tp N`, runtime/engine/tp.py) each process builds this model from its slices of
the weights (models/sharding.py): its blocks compute its heads and MLP columns, `wo` and `w_down`
are all-reduced, the embedding rows are summed over ranks and the logits gathered on rank 0.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from lowbit.kernels.cpu_block import FusedLayers
from lowbit.kernels.swiglu_clamped import swiglu_clamped_cpu
from lowbit.models.attention import PagedAttention, PagedBatch
from lowbit.models.backend import Backend, torch_backend
from lowbit.models.config import LlamaConfig
from lowbit.models.deltanet import GatedDeltaNet
from lowbit.models.moe import Experts
from lowbit.models.rope import inv_frequencies, rope_tables
from lowbit.models.sharding import TPGroup
from lowbit.quant.linear import ExactRows, QuantEmbedding, QuantLinear, all_fast, fuse_rows


class Projections(nn.Module):
    """Several linears reading the same input (QKV, gate+up): one fused kernel call when their
    layouts match, separate calls otherwise. Returns the outputs split back apart (views of one
    [M, sum N] buffer when fused)."""

    def __init__(self, weights, biases, backend: Backend):
        super().__init__()
        self.sizes = [w.shape[0] for w in weights]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(n) for b, n in zip(biases, self.sizes)])
        packed = backend.linear.pack_rows(weights)  # each packed straight into the stack (CPU tiles)
        fused = fuse_rows(weights) if packed is None else None
        if packed is not None:
            self.parts = nn.ModuleList([QuantLinear(packed, backend.linear, bias, weights[0].spec.name, packed=True)])
        elif fused is not None:
            self.parts = nn.ModuleList([QuantLinear(fused, backend.linear, bias)])
        else:
            self.parts = nn.ModuleList([QuantLinear(w, backend.linear, b) for w, b in zip(weights, biases)])

    def forward(self, x: torch.Tensor, exact: bool | None) -> list[torch.Tensor]:
        if len(self.parts) == 1:
            return list(self.parts[0](x, exact).split(self.sizes, dim=-1))
        return [p(x, exact) for p in self.parts]


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, w: dict, prefix: str, backend: Backend, tp: TPGroup | None = None,
                 layer: int = 0, rope_index: int = 0):
        """config: the shapes this process computes (under tensor parallelism, one rank's heads and
        MLP slice: models/sharding.py); tp: the group whose partial sums wo and w_down all-reduce;
        rope_index: this layer's rotary kind among the model's (a one-call step's table index)."""
        super().__init__()
        c = config
        fam = c.family
        self.c = c
        self.ops = backend
        self.tp = tp
        vec = lambda name: w[prefix + name].float().to(backend.device)  # noqa: E731
        self.register_buffer("attn_norm", vec("attn_norm"), persistent=False)
        self.register_buffer("ffn_norm", vec("ffn_norm"), persistent=False)
        # the family's variants (models/families.py); None where the block has no such norm
        recurrent = c.is_recurrent(layer)  # q/k norms: [head_dim], over each head; sandwich norms: [dim]
        for name, there in (("q_norm", fam.qk_norm and not recurrent), ("k_norm", fam.qk_norm and not recurrent),
                            ("attn_post_norm", fam.sandwich_norms), ("ffn_post_norm", fam.sandwich_norms)):
            self.register_buffer(name, vec(name) if there else None, persistent=False)
        self.act = {"silu": backend.silu_mul, "gelu_tanh": backend.gelu_tanh_mul}.get(fam.activation) or \
            partial(swiglu_clamped_cpu, alpha=c.swiglu_clamp[0], limit=c.swiglu_clamp[1], native=backend.native)  # gpt-oss
        # gpt-oss: each head's learned logit in its softmax (models/attention.py), fp32 [H]
        self.register_buffer("sinks", vec("sinks") if fam.sinks and not recurrent else None, persistent=False)
        self.rope, self.rope_index = c.rope_of(layer), rope_index  # "global" | "local" | "none" (identity)
        self.window = c.window_of(layer)
        # q times this before attention, so that the kernels' 1/sqrt(D) makes it the family's scale
        self.q_scale = None if c.attn_scale is None else c.attn_scale * math.sqrt(c.head_dim)
        self.kv_layer = None if recurrent else c.attention_layers.index(layer)  # its layer in the KV pool
        self.deltanet = None  # a hybrid model's recurrent layer: Gated DeltaNet instead of attention
        if recurrent:
            self.deltanet = GatedDeltaNet(c, w, prefix, backend, Projections, c.recurrent_layers[:layer].count(True))
        else:  # Qwen3.5's output gate (wq_gate: [H * D, dim]) is one more projection of the same input
            names = ("wq", "wk", "wv", "wq_gate") if fam.gated_attention else ("wq", "wk", "wv")
            self.qkv = Projections([w[prefix + n] for n in names], [w.get(prefix + "b" + n[1:]) for n in names],
                                   backend)
            self.wo = QuantLinear(w[prefix + "wo"], backend.linear, w.get(prefix + "bo"))  # bias: gpt-oss
        if c.n_experts:  # a mixture of experts in place of the one MLP (models/moe.py)
            self.moe = Experts(c, w, prefix, backend, Projections, self.act)
        else:
            self.moe = None
            self.gate_up = Projections([w[prefix + "w_gate"], w[prefix + "w_up"]], [None, None], backend)
            self.w_down = QuantLinear(w[prefix + "w_down"], backend.linear)
        self.fused = self._fused_block(backend) if c.fused_decode else None

    def _fused_block(self, backend: Backend):
        """The backend's two-call form of this block (CPU decode), when its weights allow one (not
        under tensor parallelism: the all-reduce falls between its O projection and the residual)."""
        moe = self.moe  # a mixture of experts runs inside the block when its router and experts are in C
        if self.tp is not None or backend.fused_block is None or len(self.qkv.parts) != 1 or (
                moe is None and len(self.gate_up.parts) != 1) or (moe is not None and (
                moe.fused is None or moe.shared is not None)):
            return None
        c = self.c
        qkv = self.qkv.parts[0]
        if moe is None:
            gate_up, down, hidden = (self.gate_up.parts[0].w, self.gate_up.parts[0].bias), (self.w_down.w, self.w_down.bias), \
                c.hidden_dim
        else:
            gate_up, down, hidden = (None, None), (None, None), c.expert_hidden_dim
        return backend.fused_block((c.dim, c.n_heads, c.n_kv_heads, c.head_dim, hidden), c.norm_eps,
                                   self.attn_norm, self.ffn_norm, (qkv.w, qkv.bias), (self.wo.w, self.wo.bias),
                                   gate_up, down, None if self.q_norm is None else (self.q_norm, self.k_norm),
                                   None if self.attn_post_norm is None else (self.attn_post_norm, self.ffn_post_norm),
                                   c.family.activation == "gelu_tanh", self.rope_index, self.window,
                                   moe=None if moe is None else moe.fused,
                                   **({} if self.sinks is None else {"sinks": self.sinks}))  # gpt-oss

    def _attention(self, h, ropes: dict, attend, exact, dtype: torch.dtype, q_temp) -> torch.Tensor:
        """The normed residual h [M, dim] → wo(attention over the paged K/V) [M, dim], op by op."""
        c, ops = self.c, self.ops
        M = h.shape[0]
        q, k, v, *gate = self.qkv(h, exact)  # gate: [M, H*D] where the family gates attention's output
        q, k = q.reshape(M, c.n_heads, c.head_dim), k.reshape(M, c.n_kv_heads, c.head_dim)
        if self.q_norm is not None:  # each head normed on its own: [M * heads, D] rows
            q = ops.add_rms_norm(q.reshape(-1, c.head_dim), None, self.q_norm, c.norm_eps, dtype)[0].view_as(q)
            k = ops.add_rms_norm(k.reshape(-1, c.head_dim), None, self.k_norm, c.norm_eps, dtype)[0].view_as(k)
        q, k = ops.rotary(q, k, *ropes[self.rope])  # "none": the identity table (cos 1, sin 0), as fused
        if self.q_scale is not None:
            q = q * self.q_scale
        if q_temp is not None:
            q = q * q_temp.to(q.dtype)
        attn = attend(self.kv_layer, q, k, v.view(M, c.n_kv_heads, c.head_dim))  # fp32 [M, H*D]
        if gate:  # Qwen3.5: each head's output times sigmoid of its gate, in fp32 as transformers does
            attn = attn * torch.sigmoid(gate[0].float())
        return self.wo(attn.to(dtype), exact)  # [M, dim]

    def forward(self, delta, residual, layer: int, ropes: dict, attend, exact: bool | None,
                dtype: torch.dtype, q_temp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """delta: the previous block's output [M, dim] (the embeddings for layer 0), not yet added to
        the fp32 residual [M, dim] (None for layer 0). `ropes`: cos, sin [M, D] per rotary kind
        (models/rope.py); `attend` is the cache's attention (models/attention.py); `q_temp` [M, 1, 1]
        multiplies the queries (Ministral 3). Returns (this block's output, residual)."""
        c, ops = self.c, self.ops
        M = delta.shape[0]
        if self.fused is not None and all_fast(exact, M):
            # every matmul on the fast kernel: the same arithmetic in two C calls (kernels/cpu_block.py)
            cos, sin = ropes[self.rope]
            qkv, residual = self.fused.pre(delta, residual, cos, sin)  # [M, (H + 2 Hkv) D]
            q, k, v = qkv.split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim], -1)
            attn = attend(self.kv_layer, q.view(M, c.n_heads, c.head_dim), k.view(M, c.n_kv_heads, c.head_dim),
                          v.view(M, c.n_kv_heads, c.head_dim))  # fp32 [M, H*D]
            return self.fused.post(attn.contiguous(), residual), residual
        h, residual = ops.add_rms_norm(delta, residual, self.attn_norm, c.norm_eps, dtype)
        if self.deltanet is not None:  # its sequences' recurrent states (PagedBatch.state_slots), no K/V
            o = self.deltanet(h, attend.pool.states, attend.batch, exact, dtype)  # [M, dim]
        else:
            o = self._attention(h, ropes, attend, exact, dtype, q_temp)  # [M, dim]
        if self.tp is not None:  # each rank multiplied its heads' columns: sum the partial products
            o = self.tp.all_reduce(o)
        if self.attn_post_norm is not None:
            o = ops.add_rms_norm(o, None, self.attn_post_norm, c.norm_eps, dtype)[0]
        h, residual = ops.add_rms_norm(o, residual, self.ffn_norm, c.norm_eps, dtype)
        if self.moe is not None:
            out = self.moe(h, exact, dtype)  # [M, dim]
        else:
            gate, up = self.gate_up(h, exact)
            out = self.w_down(self.act(gate, up), exact)  # [M, dim]
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.ffn_post_norm is not None:
            out = ops.add_rms_norm(out, None, self.ffn_post_norm, c.norm_eps, dtype)[0]
        return out, residual


class Llama(nn.Module):
    """Built from a config and a dict of weight layouts (names as runtime/load/gguf.py gives),
    on the backend's device. With `tp`, the weights are one rank's slices (models/sharding.py) and
    forward passes all-reduce and gather across the group; `config` stays the whole model's."""

    def __init__(self, config: LlamaConfig, weights: dict, backend: Backend | None = None, tp: TPGroup | None = None):
        super().__init__()
        backend = backend or torch_backend()
        self.config = config
        self.backend = backend
        self.tp = tp
        local = config if tp is None else tp.shard.local_config(config)
        self.kv_heads = local.n_kv_heads  # KV heads this process caches
        # the token ids [v0, v1) whose embedding rows (and logits) this process holds
        self.vocab_range = (0, config.vocab_size) if tp is None else tp.shard.vocab_range(config.vocab_size)
        # Each weight is read once and dropped once packed: a loader's weights may be read from the file on
        # each access (runtime/load/gguf.py LazyWeights), and a load should hold one layer in transit.
        embed = weights["embed"]
        self.embed = QuantEmbedding(embed, backend.linear)
        if "output" in weights:
            self.output = QuantLinear(weights["output"], backend.linear)
        elif backend.linear.shares_head(self.embed.w):
            self.output = QuantLinear(self.embed.w, backend.linear, spec_name=embed.spec.name, packed=True)
        else:  # tied, but the table's lookup form has no matmul kernel here: a packed copy
            self.output = QuantLinear(embed, backend.linear)
        del embed
        # the rotary kinds the layers use, in a fixed order (a one-call step's tables [K, M, D] follow it)
        self.rope_kinds = sorted({config.rope_of(i) for i in range(config.n_layers)})
        self.layers = nn.ModuleList(Block(local, weights, f"layers.{i}.", backend, tp, i,
                                          self.rope_kinds.index(config.rope_of(i))) for i in range(config.n_layers))
        self.register_buffer("norm", weights["norm"].float().to(backend.device), persistent=False)
        # per kind: (inv_freq fp32 [D/2], cos/sin scale [D/2] or None); "none" (SmolLM3's NoPE layers) has
        # frequency 0 everywhere: cos 1, sin 0, which turns nothing (x * 1 - y * 0 = x)
        self.ropes = {}
        for kind in self.rope_kinds:
            if kind == "none":
                inv, scale = torch.zeros(config.head_dim // 2), torch.ones(config.head_dim // 2)
            else:
                inv, scale = inv_frequencies(config, weights.get("rope_freqs") if kind == "global" else None, kind)
            self.ropes[kind] = (inv.to(backend.device), None if bool((scale == 1).all()) else scale.to(backend.device))
        self.embed_scale = math.sqrt(config.dim) if config.family.embed_scale else None
        # every block fused (CPU, C kernels): a step whose rows are all single-token queries runs all of
        # them in one C call (kernels/cpu_block.py FusedLayers), the same arithmetic as block by block
        fused = [layer.fused for layer in self.layers]
        self.fused_layers = FusedLayers(fused) if fused and all(f is not None for f in fused) else None

    @property
    def device(self) -> torch.device:
        return self.backend.device

    def bytes_per_token(self) -> int:
        """Weight bytes one decode token reads: every tensor held (shared ones once), less the experts it
        does not choose (k of E: models/moe.py reads no others) and the embedding table but its one row
        when the table is not also the LM head. Decode speed is bounded by this over memory bandwidth."""
        def held(m: nn.Module, seen: set) -> int:
            total = 0
            for b in m.buffers():
                if b.data_ptr() not in seen:
                    seen.add(b.data_ptr())
                    total += b.numel() * b.element_size()
            return total

        seen: set = set()
        head = held(self.output, seen)
        table = held(self.embed, seen)  # 0 when tied: its bytes were counted as the head's
        total = held(self, seen) + head
        if table:
            total += table // self.config.vocab_size
        c = self.config
        for layer in self.layers:
            if layer.moe is not None:
                experts = held(layer.moe.experts, set())
                total -= experts - experts * c.n_experts_used // c.n_experts
        return total

    def forward_paged(self, tokens: torch.Tensor, batch: PagedBatch, pool,
                      exact: bool | None | ExactRows = None, hidden: bool = False) -> torch.Tensor:
        """The engine's step: tokens int [M] of several sequences (see PagedBatch), K/V written to
        and read from the paged pool (runtime/engine/kv_cache.py) → logits fp32 [R, V] for batch.logits_rows,
        or with `hidden` the final normed hidden states fp32 [R, dim] instead (embeddings)."""
        ropes = {kind: rope_tables(inv, batch.positions, scale) for kind, (inv, scale) in self.ropes.items()}  # [M, D]
        c = self.config
        sinks = [self.layers[i].sinks for i in c.attention_layers] if c.family.sinks else None  # per KV layer
        attend = PagedAttention(pool, batch, [c.window_of(i) for i in c.attention_layers], self.backend, sinks)
        return self._run(tokens, ropes, attend, batch.logits_rows, exact, hidden, self._temperature(batch.positions))

    def _temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Ministral 3's query scale per token [M, 1, 1]: 1 + beta * ln(1 + floor(pos / original context))."""
        if self.config.attn_temperature is None:
            return None
        beta, original = self.config.attn_temperature
        return (1 + beta * torch.log1p(torch.floor(positions.float() / original)))[:, None, None]

    def _run(self, tokens: torch.Tensor, ropes: dict, attend, rows: torch.Tensor | None,
             exact: bool | None | ExactRows, hidden: bool = False,
             q_temp: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [M] → logits fp32 [M, V], or [len(rows), V] for the rows asked for. `exact` may
        choose per row (ExactRows); activations are then in the backend's dtype (fp32 on CPU)."""
        dtype = torch.float32 if exact is True else self.backend.dtype
        delta, residual = self._embed(tokens), None  # [M, dim]
        if self.embed_scale is not None:  # Gemma: transformers multiplies in fp32 (its table's dtype here)
            delta = delta.float() * torch.tensor(self.embed_scale, dtype=torch.float32)
        delta = delta.to(dtype)
        M = delta.shape[0]
        if self.fused_layers is not None and all_fast(exact, M) and attend.all_rows_in_c(M):
            # every row one token's query on the C kernels: the whole step in one C call, the same
            # arithmetic as block by block (kernels/cpu_block.py)
            cos = torch.stack([ropes[k][0] for k in self.rope_kinds])  # [K, M, D], the blocks' `rope` indexes it
            sin = torch.stack([ropes[k][1] for k in self.rope_kinds])
            delta, residual = attend.run_layers(self.fused_layers, delta.contiguous(), cos, sin)
        else:
            for i, layer in enumerate(self.layers):
                delta, residual = layer(delta, residual, i, ropes, attend, exact, dtype, q_temp)
        if rows is not None and rows.numel() == 0:  # a step of prefill chunks that all end mid-prompt
            return torch.empty(0, self.config.vocab_size, device=tokens.device)
        if rows is not None:
            delta, residual = delta[rows].contiguous(), residual[rows].contiguous()  # [R, dim]
            if isinstance(exact, ExactRows):
                exact = exact.take(rows)
        h, _ = self.backend.add_rms_norm(delta, residual, self.norm, self.config.norm_eps, dtype)
        if hidden:  # the residual stream is the same on every tensor-parallel rank: no collective
            return h.float()
        logits = self.output(h, exact, torch.float32)  # fp32 logits: no fp16 rounding
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.config.vocab_size)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [M] → fp32 rows [M, dim]. Under tensor parallelism each rank holds a range of the
        table: it looks up the ids in its range, zeros for the rest, and the sum over ranks is the row."""
        if self.tp is None:
            return self.embed(tokens)
        v0, v1 = self.vocab_range
        local, n = tokens - v0, v1 - v0
        mine = (local >= 0) & (local < n)  # [M]
        rows = self.embed(local.clamp(0, n - 1)).float() * mine[:, None]
        return self.tp.all_reduce(rows)
