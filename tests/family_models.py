"""Tiny random models of each family of models/families.py, built by transformers with the family's
quirks switched on (tests/test_families.py says which), and saved as users' checkpoints are."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import torch

transformers = importlib.import_module("transformers")

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
GEMMA_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
FAMILIES = {
    # name: (config class, model class, extra config, GGUF architecture enum name)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        head_dim=64, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0)),
        "QWEN3"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(tie_word_embeddings=True), "SMOLLM3"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        # untied here (Gemma ties): a tied table times sqrt(dim) in the residual makes a random model predict
        # its input token with probability 1, where no error shows; smollm3 covers tied tables
        tie_word_embeddings=False,
        num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=16, rope_parameters=GEMMA_ROPE), "GEMMA3"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=64, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]), "QWEN3MOE"),
    # gpt-oss: sinks, biases everywhere, window-16 layers alternating with full ones, YaRN (factor 32 over an
    # original 32 positions), clamped SwiGLU, the router's softmax over its top 2 of 8 experts
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=64, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, intermediate_size=256,
        sliding_window=16, rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                                truncate=False, original_max_position_embeddings=32,
                                                rope_theta=150000.0)), "GPT_OSS"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        tie_word_embeddings=False, max_position_embeddings=65536, original_max_position_embeddings=2048,
        partial_rotary_factor=0.75, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
            short_factor=[1.0 + 0.1 * i for i in range(24)], long_factor=[2.0 + 0.1 * i for i in range(24)])), "PHI3"),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(
        head_dim=64, tie_word_embeddings=False, rope_parameters=dict(
            rope_type="yarn", factor=16.0, original_max_position_embeddings=16, rope_theta=1e6, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1, max_position_embeddings=4096)),
        "MISTRAL3"),
}
# safetensors only: llama.cpp's GGUF has no key for it (it infers 27B's scale from the layer count)
SAFETENSORS_ONLY = {"gemma3-scale": ("gemma3", dict(query_pre_attn_scalar=96))}
LOGIT_STD = 3.0


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Real values everywhere (norms 1 ± 0.2 — Gemma's stored w - 1 then ±0.2 — unit-gain projections,
    logits of std ≈ 3): HF's init gives near-uniform logits, against which no loader bug shows. Gemma's
    embeddings times sqrt(dim) then enter with std 3: the first norm takes any scale."""
    g = torch.Generator().manual_seed(seed)
    gemma = model.config.model_type.startswith("gemma")
    dim = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):  # gpt-oss: one logit per head, beside scores of std ~1
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(LOGIT_STD / math.sqrt(dim) * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def build(name: str, vocab: int, seed: int = 0, **overrides):
    """The family's tiny model (`overrides`: config values changed for one test), randomized."""
    base, changes = SAFETENSORS_ONLY.get(name, (name, {}))
    cfg_cls, model_cls, extra, _ = FAMILIES[base]
    config = getattr(transformers, cfg_cls)(**{**SMALL, **extra, **changes, **overrides, "vocab_size": vocab})
    model = getattr(transformers, model_cls)(config).float().eval()
    randomize(model, seed)
    return model


def save(model, tokenizer_dir: Path, d: Path, name: str) -> Path:
    model.save_pretrained(d, safe_serialization=True)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(d)
    if name == "phi3":  # Phi-4's tokenizer is GPT-2 BPE, and the converter reads it that way
        p = d / "tokenizer_config.json"
        p.write_text(json.dumps({**json.loads(p.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    return d


