"""The model config: one frozen dataclass, built from GGUF metadata or an HF config.json dict, for
every family of models/families.py (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM3, Ministral 3, Phi-3/4,
Gemma 3, Qwen3-MoE, gpt-oss, Qwen3.5 and Qwen3.5-MoE). The family's row says which variants the block has; the numbers come from the file. The
model never reads files: callers pass the parsed dict in.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from lowbit.models.families import FAMILIES, HF_WRAPPERS, Family, family_of_gguf, family_of_hf


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "llama3" | "linear" | "yarn" | "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    truncate: bool = True
    # cos and sin are multiplied by this (yarn's mscale, LongRoPE's sqrt(1 + ln s / ln L)), as transformers'
    # attention_scaling and llama.cpp's attn_factor do
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] | None = None  # longrope: per-frequency divisors within the original context


# gpt-oss's (alpha, limit): llama.cpp fixes them per architecture, as its GGUF carries neither
SWIGLU_CLAMP = (1.702, 7.0)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


@dataclass(frozen=True)
class DeltaNetShape:
    """A Gated DeltaNet layer's shapes (Qwen3.5-4B: 16 key heads, 32 value heads, both 128 wide, 4 conv taps:
    a state of 32 x 128 x 128 fp32 = 2 MiB a layer and sequence, plus a conv state of 3 x 8192 values)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_taps: int
    # the order of the value heads: grouped by key head (HF: value head j reads key head j // (Hv / Hk)) or tiled
    # (llama.cpp's converter reorders them so that value head j reads key head j % Hk)
    v_tiled: bool = False

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: q, k and v side by side."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def state_floats(self) -> int:
        """fp32 values of one sequence's state in one layer: the recurrence's [Hv, Dk, Dv] and the conv's [C, K - 1]."""
        return self.v_heads * self.k_dim * self.v_dim + self.conv_dim * (self.conv_taps - 1)


@dataclass(frozen=True)
class LlamaConfig:
    arch: str  # the family's name (models/families.py)
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    tie_embeddings: bool
    qkv_bias: bool = False
    sliding_window: int | None = None
    rope_scaling: RopeScaling | None = None
    # per layer: whether it attends over the sliding window (None: every layer, when sliding_window is set)
    window_layers: tuple[bool, ...] | None = None
    # per layer: "global" rotary, "local" (rope_local_theta, unscaled: Gemma 3's windowed layers) or "none"
    # (SmolLM3's NoPE layers); None = global everywhere
    rope_layers: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    rotary_dim: int | None = None  # dims of a head that rotate (Phi-4-mini: 3/4 of them); None = all
    attn_scale: float | None = None  # softmax scale; None = 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-1/2)
    attn_temperature: tuple[float, int] | None = None  # (beta, original context): Ministral 3's query scaling
    # mixture of experts (models/moe.py; the family's `experts` says how tokens are routed): every layer's MLP is
    # n_experts gated MLPs of expert_hidden_dim columns, each token through n_experts_used of them
    n_experts: int = 0
    n_experts_used: int = 0
    expert_hidden_dim: int = 0
    norm_topk: bool = True  # the k chosen weights renormalised to sum 1 (Qwen3-MoE's norm_topk_prob)
    # Qwen3.5-MoE: one more gated MLP of this many columns that every token runs, its output scaled by
    # sigmoid(shared gate . x) (models/moe.py); 0 = none
    shared_expert_hidden_dim: int = 0
    swiglu_clamp: tuple[float, float] | None = None  # (alpha, limit) of gpt-oss's clamped SwiGLU
    # hybrid (the family's `recurrent`, Qwen3.5): per layer whether it is a Gated DeltaNet layer (models/deltanet.py)
    # in place of attention; None = every layer attends. Only the other layers hold KV pages
    recurrent_layers: tuple[bool, ...] | None = None
    deltanet: DeltaNetShape | None = None

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if bool(self.family.experts) != (self.n_experts > 0):
            raise ValueError(f"{self.arch}: expected {'an expert count' if self.family.experts else 'no experts'}")
        if self.n_experts and not 0 < self.n_experts_used <= self.n_experts:
            raise ValueError(f"{self.arch}: {self.n_experts_used} experts used per token out of {self.n_experts}")

    @property
    def family(self) -> Family:
        return FAMILIES[self.arch]

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends over, or None (every earlier key)."""
        if self.sliding_window is None or (self.window_layers is not None and not self.window_layers[layer]):
            return None
        return self.sliding_window

    def rope_of(self, layer: int) -> str:
        return "global" if self.rope_layers is None else self.rope_layers[layer]

    def is_recurrent(self, layer: int) -> bool:
        return self.recurrent_layers is not None and self.recurrent_layers[layer]

    @property
    def attention_layers(self) -> list[int]:
        """The layers that attend (and hold KV pages), in order: a layer's index among them is its KV layer."""
        return [i for i in range(self.n_layers) if not self.is_recurrent(i)]

    @property
    def n_kv_layers(self) -> int:
        return len(self.attention_layers)

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state over all DeltaNet layers (0 for a model without them):
        Qwen3.5-4B's 24 of 32 layers hold 24 x (2 MiB + 96 KiB) = 50.25 MiB, whatever the context."""
        return 4 * self.deltanet.state_floats * (self.n_layers - self.n_kv_layers) if self.deltanet else 0

    @property
    def fused_decode(self) -> bool:
        """Whether every block is one the fused C kernels compute (kernels/cpu_block.c): the Llama block with
        any of q/k norms, Gemma's four norms and GeGLU, a rotary table per layer (local, global, none;
        partial rotary is a table too) and a window per layer, attention sinks and biases (gpt-oss), a mixture
        of experts in place of the MLP (kernels/cpu_moe.c: router and experts) — everything but a softmax scale
        other than 1/sqrt(D), Ministral's per-position query temperature and a shared expert, which run op by op."""
        return self.attn_scale is None and self.attn_temperature is None and not self.shared_expert_hidden_dim \
            and self.recurrent_layers is None and not self.family.gated_attention

    def parameters(self) -> tuple[int, int]:
        """(total, active): the weights the model has, and those one token multiplies — a mixture of
        experts counts its k chosen experts of E (Qwen3-30B-A3B: 30.5B and 3.3B) and its shared expert, the
        embedding table its one row unless it is also the LM head. A hybrid model's DeltaNet layers count
        their own weights in place of attention's; Qwen3.5's multi-token-prediction block is not counted
        (lowbit does not run it)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        norms = 2 * self.dim + (2 * self.dim if self.family.sandwich_norms else 0)  # every layer's, whatever its mixer
        attn = self.dim * (q + 2 * kv) + q * self.dim + (q + 2 * kv if self.qkv_bias else 0)
        attn += 2 * self.head_dim if self.family.qk_norm else 0
        attn += self.dim * q if self.family.gated_attention else 0  # Qwen3.5: a gate row for every query row
        biased = self.family.o_bias  # gpt-oss: biases on O, the router and every expert's projections
        attn += (self.dim if biased else 0) + (self.n_heads if self.family.sinks else 0)
        recurrent = 0
        if self.deltanet is not None:  # in projections qkv [C, dim], z [Hv Dv, dim], b and a [Hv, dim]; out
            d = self.deltanet  # [dim, Hv Dv]; conv [C, K]; dt_bias, A [Hv]; the gated norm [Dv]
            vd = d.v_heads * d.v_dim
            recurrent = self.dim * (d.conv_dim + vd + 2 * d.v_heads) + vd * self.dim + d.conv_dim * d.conv_taps \
                + 2 * d.v_heads + d.v_dim
        mixers = self.n_kv_layers * attn + (self.n_layers - self.n_kv_layers) * recurrent
        if self.n_experts:
            expert = 3 * self.dim * self.expert_hidden_dim + (2 * self.expert_hidden_dim + self.dim if biased else 0)
            # the shared expert's gated MLP and its gate [dim], which every token runs
            shared = 3 * self.dim * self.shared_expert_hidden_dim + self.dim if self.shared_expert_hidden_dim else 0
            router = self.n_experts * (self.dim + (1 if biased else 0))
            mlp, mlp_active = self.n_experts * expert + router + shared, self.n_experts_used * expert + router + shared
        else:
            mlp = mlp_active = 3 * self.dim * self.hidden_dim
        table = self.vocab_size * self.dim
        total = table * (1 if self.tie_embeddings else 2) + mixers + self.n_layers * (norms + mlp) + self.dim
        active = (table if self.tie_embeddings else table + self.dim) + mixers + self.n_layers * (norms + mlp_active) \
            + self.dim
        return total, active

    def variants(self) -> list[str]:
        """The block's variant switches in words (`lowbit info`), empty for a plain Llama block."""
        f, out = self.family, []
        out += ["Q/K/V biases"] if self.qkv_bias else []
        out += ["per-head q/k norms"] if f.qk_norm else []
        out += ["norms after attention and MLP"] if f.sandwich_norms else []
        out += ["GeGLU"] if f.activation == "gelu_tanh" else []
        out += ["embeddings x sqrt(dim)"] if f.embed_scale else []
        if self.n_experts:
            out.append(f"{self.n_experts} experts of {self.expert_hidden_dim} columns, {self.n_experts_used} "
                       f"per token ({f.experts} router{', renormalised' if self.norm_topk else ''})")
            if self.shared_expert_hidden_dim:
                out.append(f"a shared expert of {self.shared_expert_hidden_dim} columns, gated")
        if self.deltanet is not None:
            d = self.deltanet
            out.append(f"Gated DeltaNet on {self.n_layers - self.n_kv_layers} of {self.n_layers} layers ({d.k_heads}/"
                       f"{d.v_heads} heads of {d.k_dim}/{d.v_dim}, conv {d.conv_taps})")
        if self.family.gated_attention:
            out.append("attention output gated")
        if self.attn_scale is not None:
            out.append(f"attention scale {self.attn_scale:.4g}")
        if self.rotary_dim is not None:
            out.append(f"rotary on {self.rotary_dim} of {self.head_dim} dims")
        if self.rope_scaling is not None:
            s = self.rope_scaling
            out.append(f"rope {s.kind}" + (f" x{s.factor:g}" if s.kind != "longrope" else "")
                       + (f" from {s.original_max_position}" if s.kind in ("yarn", "longrope") else ""))
        if self.rope_layers is not None:
            kinds = {k: self.rope_layers.count(k) for k in ("global", "local", "none") if k in self.rope_layers}
            notes = {"local": f" (rope base {self.rope_local_theta:g})", "none": " (no rope)"}
            out.append("layers: " + ", ".join(f"{n} {k}{notes.get(k, '')}" for k, n in kinds.items()))
        if self.sliding_window is not None:
            n = self.n_layers if self.window_layers is None else sum(self.window_layers)
            out.append(f"sliding window {self.sliding_window} on {n} of {self.n_layers} layers")
        if self.attn_temperature is not None:
            out.append(f"query temperature beta {self.attn_temperature[0]:g} past {self.attn_temperature[1]}")
        return out

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], vocab_size: int, tie_embeddings: bool) -> "LlamaConfig":
        """GGUF `<arch>.*` keys. vocab_size and tying come from the tensors (token_embd rows,
        whether output.weight exists), which are the truth when metadata disagrees."""
        arch = meta.get("general.architecture")
        fam = family_of_gguf(arch)

        def get(key, default=None):
            v = meta.get(f"{arch}.{key}", default)
            if v is None:
                raise ValueError(f"{fam.name}: missing metadata key {arch}.{key}")
            return v

        dim, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
        # multi-token prediction layers the converter appends (Qwen3.5: nextn_predict_layers 1): not run here
        n_layers = int(get("block_count")) - int(meta.get(f"{arch}.nextn_predict_layers") or 0)
        head_dim = int(meta.get(f"{arch}.attention.key_length") or dim // n_heads)
        rotary = meta.get(f"{arch}.rope.dimension_count")
        ctx = int(get("context_length", 4096))
        scaling = _gguf_rope_scaling(meta, arch, get)
        window = meta.get(f"{arch}.attention.sliding_window")
        window = int(window) if window else None
        window_layers = rope_layers = local_theta = attn_scale = temperature = None
        if fam.swa_every and window:  # llama.cpp fixes the pattern per architecture (gemma3: 5 local, 1 global)
            window_layers = tuple((i + 1) % fam.swa_every != 0 for i in range(n_layers))
        if fam.local_rope and window_layers:
            rope_layers = tuple("local" if w else "global" for w in window_layers)
            local_theta = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
        if fam.sinks and scaling is not None and scaling.kind == "yarn":
            # gpt-oss's YaRN ramp is not truncated to whole dims (config.json truncate: false; transformers
            # and OpenAI's reference); the file carries no key for it
            scaling = dataclasses.replace(scaling, truncate=False)
        if fam.nope_every:
            rope_layers = tuple("none" if (i + 1) % fam.nope_every == 0 else "global" for i in range(n_layers))
        if fam.name == "gemma3":
            # llama.cpp's rule (gemma3.cpp): the file carries no query_pre_attn_scalar; 27B (62 layers)
            # scales by dim / heads, the others by head_dim, which is 1/sqrt(head_dim) unless 62 layers
            attn_scale = 1 / math.sqrt(dim // n_heads) if n_layers == 62 else None
        n_experts = int(meta.get(f"{arch}.expert_count") or 0) if fam.experts else 0
        beta = meta.get(f"{arch}.attention.temperature_scale")
        if fam.attn_temperature and beta:
            temperature = (float(beta), int(scaling.original_max_position if scaling else ctx))
        return cls(
            arch=fam.name, dim=dim, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)), head_dim=head_dim,
            hidden_dim=int(meta.get(f"{arch}.feed_forward_length") or 0) if fam.experts else int(get("feed_forward_length")),
            vocab_size=vocab_size,
            norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)), max_seq_len=ctx,
            tie_embeddings=tie_embeddings, qkv_bias=fam.qkv_bias, sliding_window=window, rope_scaling=scaling,
            window_layers=window_layers, rope_layers=rope_layers, rope_local_theta=local_theta,
            rotary_dim=int(rotary) if rotary and int(rotary) != head_dim else None, attn_scale=attn_scale,
            attn_temperature=temperature, n_experts=n_experts, **_gguf_deltanet(meta, arch, fam, n_layers),
            n_experts_used=int(get("expert_used_count")) if n_experts else 0,
            expert_hidden_dim=int(get("expert_feed_forward_length")) if n_experts else 0,
            shared_expert_hidden_dim=int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0)
            if n_experts else 0,
            swiglu_clamp=SWIGLU_CLAMP if fam.activation == "swiglu_clamped" else None,
        )

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "LlamaConfig":
        mt = cfg.get("model_type")
        if mt in HF_WRAPPERS and isinstance(cfg.get("text_config"), Mapping):  # multimodal: its language model
            tie = cfg.get("tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings"))  # the wrapper's ties
            cfg = {**cfg["text_config"], "model_type": HF_WRAPPERS[mt], "tie_word_embeddings": tie}
            mt = cfg["model_type"]
        fam = family_of_hf(mt)
        n_heads, n_layers = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
        dim = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or dim // n_heads)
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(key):
                raise ValueError(f"{fam.name}: {key} is not supported")
        if cfg.get("mlp_bias"):
            raise ValueError(f"{fam.name}: mlp_bias is not supported")
        n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if fam.experts else 0
        if n_experts and (cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1):
            raise ValueError(f"{fam.name}: dense MLP layers among the expert layers (mlp_only_layers, "
                             "decoder_sparse_step) are not supported")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        by_type = isinstance(rope.get("full_attention"), Mapping)  # Gemma 3: one set per layer type
        main = rope.get("full_attention", {}) if by_type else rope
        rope_theta = float(main.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        scaling = _hf_rope_scaling(main, cfg, max_pos)
        partial = float(main.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
        rotary = int(head_dim * partial)

        layer_types = cfg.get("layer_types")
        sliding = cfg.get("sliding_window")
        if mt in ("qwen2", "qwen3", "smollm3") and not cfg.get("use_sliding_window", False):
            sliding, layer_types = None, None
        window_layers = rope_layers = local_theta = None
        if sliding and layer_types:
            window_layers = tuple(t == "sliding_attention" for t in layer_types)
            if all(window_layers):
                window_layers = None
        if fam.name == "gemma3":
            local = rope.get("sliding_attention", {}) if by_type else {}
            local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0)
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"{fam.name}: unsupported rope type {local['rope_type']!r} on the local layers")
            types = layer_types or ["full_attention"] * n_layers
            rope_layers = tuple("local" if t == "sliding_attention" else "global" for t in types)
        if fam.nope_every:
            flags = cfg.get("no_rope_layers")  # 1 = the layer uses rotary
            if flags is None:
                every = int(cfg.get("no_rope_layer_interval") or fam.nope_every)
                flags = [int((i + 1) % every != 0) for i in range(n_layers)]
            rope_layers = tuple("global" if f else "none" for f in flags)
        attn_scale = None
        if cfg.get("query_pre_attn_scalar") is not None and float(cfg["query_pre_attn_scalar"]) != head_dim:
            attn_scale = float(cfg["query_pre_attn_scalar"]) ** -0.5
        temperature = None
        if fam.attn_temperature and main.get("llama_4_scaling_beta"):
            temperature = (float(main["llama_4_scaling_beta"]), int(main["original_max_position_embeddings"]))
        return cls(
            arch=fam.name, dim=dim, n_layers=n_layers,
            n_heads=n_heads, n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads), head_dim=head_dim,
            hidden_dim=int(cfg.get("intermediate_size") or 0) if n_experts else int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta, max_seq_len=max_pos,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=fam.qkv_bias or bool(cfg.get("attention_bias", False)),
            sliding_window=int(sliding) if sliding else None, rope_scaling=scaling,
            window_layers=window_layers, rope_layers=rope_layers, rope_local_theta=local_theta,
            rotary_dim=rotary if rotary != head_dim else None, attn_scale=attn_scale, attn_temperature=temperature,
            **_hf_deltanet(cfg, fam, n_layers),
            n_experts=n_experts, n_experts_used=int(cfg["num_experts_per_tok"]) if n_experts else 0,
            expert_hidden_dim=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")) if n_experts else 0,
            norm_topk=bool(cfg.get("norm_topk_prob", True)),
            shared_expert_hidden_dim=int(cfg.get("shared_expert_intermediate_size") or 0) if n_experts else 0,
            swiglu_clamp=(float(cfg.get("swiglu_alpha", SWIGLU_CLAMP[0])), float(cfg.get("swiglu_limit", SWIGLU_CLAMP[1])))
            if fam.activation == "swiglu_clamped" else None,
        )


def _hf_rope_scaling(rs: Mapping[str, Any], cfg: Mapping[str, Any], max_pos: int) -> RopeScaling | None:
    """config.json's rope_parameters (transformers 5) or rope_scaling (4.x) → RopeScaling, the way
    transformers' modeling_rope_utils reads them."""
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    original = int(rs.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or max_pos)
    if kind == "llama3":
        return RopeScaling("llama3", float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)),
                           float(rs.get("high_freq_factor", 4.0)),
                           int(rs.get("original_max_position_embeddings", 8192)))
    if kind == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    if kind == "yarn":
        factor = float(rs.get("factor") or max_pos / original)
        af = rs.get("attention_factor")
        if af is None:
            m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
            af = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
        return RopeScaling("yarn", factor, original_max_position=original,
                           beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
                           truncate=bool(rs.get("truncate", True)), attention_factor=float(af))
    if kind in ("longrope", "su"):
        factor = float(rs.get("factor") or max_pos / original)
        af = rs.get("attention_factor")
        if af is None:
            af = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        return RopeScaling("longrope", factor, original_max_position=original, attention_factor=float(af),
                           short_factor=tuple(float(x) for x in rs["short_factor"]))
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear, yarn, longrope)")


def _gguf_rope_scaling(meta: Mapping[str, Any], arch: str, get) -> RopeScaling | None:
    """GGUF `rope.scaling.*` → RopeScaling. llama3 files carry their scaling as the rope_freqs tensor and
    LongRoPE files as rope_factors_short/long (runtime/load/gguf.py reads those)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None and meta.get(f"{arch}.rope.scaling.attn_factor") is not None:
        kind = "longrope"  # llama.cpp's Phi-3 converter writes the factors and attn_factor, but no type
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(get("rope.scaling.factor")))
    if kind == "yarn":
        factor = float(get("rope.scaling.factor"))
        af = meta.get(f"{arch}.rope.scaling.yarn_attn_factor")
        log_mul = meta.get(f"{arch}.rope.scaling.yarn_log_multiplier")
        if af is None:  # transformers' rule; a log multiplier is mscale_all_dim, with mscale 1
            af = yarn_mscale(factor) / yarn_mscale(factor, float(log_mul)) if log_mul else yarn_mscale(factor)
        return RopeScaling("yarn", factor, original_max_position=int(get("rope.scaling.original_context_length")),
                           beta_fast=float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast") or 32),
                           beta_slow=float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow") or 1),
                           attention_factor=float(af))
    if kind in ("longrope", "su"):
        return RopeScaling("longrope", 1.0, attention_factor=float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
                           original_max_position=int(meta.get(f"{arch}.rope.scaling.original_context_length") or 0))
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, yarn, longrope; "
                     "llama3 via rope_freqs)")


def _gguf_deltanet(meta: Mapping[str, Any], arch: str, fam: Family, n_layers: int) -> dict:
    """A hybrid family's recurrent layers and DeltaNet shapes from llama.cpp's keys (conversion/qwen.py writes
    ssm.state_size = key head dim, group_count = key heads, time_step_rank = value heads, inner_size = value
    heads x value head dim, attention.recurrent_layers per block; older files only full_attention_interval)."""
    if not fam.recurrent:
        return {}
    flags = meta.get(f"{arch}.attention.recurrent_layers")
    if flags is not None:
        layers = tuple(bool(x) for x in list(flags)[:n_layers])
    else:
        every = int(meta.get(f"{arch}.full_attention_interval") or 4)
        layers = tuple((i + 1) % every != 0 for i in range(n_layers))
    key = lambda k: meta.get(f"{arch}.ssm.{k}")  # noqa: E731
    for k in ("state_size", "group_count", "time_step_rank", "inner_size", "conv_kernel"):
        if key(k) is None:
            raise ValueError(f"{fam.name}: missing metadata key {arch}.ssm.{k}")
    v_heads = int(key("time_step_rank"))
    return {"recurrent_layers": layers, "deltanet": DeltaNetShape(
        int(key("group_count")), v_heads, int(key("state_size")), int(key("inner_size")) // v_heads,
        int(key("conv_kernel")), v_tiled=True)}


def _hf_deltanet(cfg: Mapping[str, Any], fam: Family, n_layers: int) -> dict:
    """config.json's layer_types ("linear_attention" | "full_attention"; else every full_attention_interval-th
    layer full) and linear_* shapes."""
    if not fam.recurrent:
        return {}
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
    return {"recurrent_layers": tuple(t == "linear_attention" for t in types), "deltanet": DeltaNetShape(
        int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"]), int(cfg["linear_key_head_dim"]),
        int(cfg["linear_value_head_dim"]), int(cfg.get("linear_conv_kernel_dim") or 4))}
