"""The Llama-family config: one frozen dataclass, built from GGUF metadata or an HF config.json dict.

Covers Llama 2/3 (llama3 rope scaling), Mistral (optional sliding window), Qwen2 (QKV bias) and
SmolLM2 (tied embeddings). The model never reads files: callers pass the parsed dict in.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

GGUF_ARCHS = ("llama", "qwen2", "mistral")
HF_ARCHS = MappingProxyType({"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"})


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    arch: str
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

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], vocab_size: int, tie_embeddings: bool) -> "LlamaConfig":
        """GGUF `<arch>.*` keys. vocab_size and tying come from the tensors (token_embd rows,
        whether output.weight exists), which are the truth when metadata disagrees."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHS:
            raise ValueError(f"unknown architecture {arch!r} (supported: {', '.join(GGUF_ARCHS)})")

        def get(key, default=None):
            v = meta.get(f"{arch}.{key}", default)
            if v is None:
                raise ValueError(f"missing metadata key {arch}.{key}")
            return v

        dim, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
        head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or dim // n_heads)
        scaling = None
        kind = meta.get(f"{arch}.rope.scaling.type")
        if kind == "linear":
            scaling = RopeScaling("linear", float(get("rope.scaling.factor")))
        elif kind not in (None, "none"):  # yarn & co. would silently give wrong long-context logits
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear; llama3 via rope_freqs)")
        return cls(
            arch=arch, dim=dim, n_layers=int(get("block_count")), n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)), head_dim=head_dim,
            hidden_dim=int(get("feed_forward_length")), vocab_size=vocab_size,
            norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)), max_seq_len=int(get("context_length", 4096)),
            tie_embeddings=tie_embeddings, qkv_bias=arch == "qwen2",
            sliding_window=meta.get(f"{arch}.attention.sliding_window"), rope_scaling=scaling,
        )

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "LlamaConfig":
        mt = cfg.get("model_type")
        if mt not in HF_ARCHS:
            raise ValueError(f"unknown model_type {mt!r} in config.json (supported: {', '.join(HF_ARCHS)})")
        n_heads = int(cfg["num_attention_heads"])
        scaling = None
        # transformers 5 writes rope settings under "rope_parameters"; older versions "rope_scaling".
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "llama3":
                scaling = RopeScaling("llama3", float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)),
                                      float(rs.get("high_freq_factor", 4.0)),
                                      int(rs.get("original_max_position_embeddings", 8192)))
            elif kind == "linear":
                scaling = RopeScaling("linear", float(rs["factor"]))
            elif kind not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}")
        sliding = cfg.get("sliding_window")
        if mt == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return cls(
            arch=HF_ARCHS[mt], dim=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads, n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
            hidden_dim=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
            max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or bool(cfg.get("attention_bias", False)),
            sliding_window=int(sliding) if sliding else None, rope_scaling=scaling,
        )
