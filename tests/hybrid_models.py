"""Tiny random Qwen3.5 models, dense and MoE (hybrid: Gated DeltaNet layers beside gated full attention), built by
transformers with the family's quirks switched on, for tests/test_hybrid.py and tests/bench/."""

from __future__ import annotations

import importlib
import math

import torch

transformers = importlib.import_module("transformers")

# 2 key heads serving 4 value heads (grouped in HF's order, tiled in llama.cpp's GGUF), 64-dim heads: the
# DeltaNet's out projection reads 4 x 64 = 256 columns, a whole Q4_K super-block; layers 0-2 linear, 3 full
# and again (full_attention_interval 4 over 8 layers); partial rotary 1/4 of 64-dim attention heads
QWEN35 = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                   mrope_section=[4, 2, 2], mrope_interleaved=True),
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Qwen3.5-MoE: the same hybrid block with 8 experts of 128 columns, 2 per token, and a shared expert of 192
# columns (a size of its own, so a loader that swaps the two sizes fails on shapes)
QWEN35_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=192)
LOGIT_STD = 3.0


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Real values everywhere: the (1 + w) norms' w ± 0.2, the DeltaNet's gated norm (a plain w) 1 ± 0.2,
    unit-gain projections, logits of std ≈ 3, and decays that keep ~10-100 tokens in the state
    (A = exp(A_log) in [0.01, 0.3], dt_bias ± 0.5: exp(g) ≈ 0.9-0.99 a token), so a state carried
    wrongly across a chunk boundary shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    dim = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.3, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.weight"):  # [C, 1, K]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(LOGIT_STD / math.sqrt(dim) * torch.randn(p.shape, generator=g))
            else:
                # [.., N, K] (the experts' stacked [E, N, K] too): unit gain over the K inputs
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def build(vocab: int, seed: int = 0, moe: bool = False, **overrides):
    """A tiny Qwen3.5 (Qwen3_5ForCausalLM, text only), or with moe its mixture-of-experts sibling
    (Qwen3_5MoeForCausalLM: every layer's MLP routed experts plus a gated shared expert), randomized."""
    if moe:
        config = transformers.Qwen3_5MoeTextConfig(**{**QWEN35, **QWEN35_MOE, **overrides, "vocab_size": vocab})
        model = transformers.Qwen3_5MoeForCausalLM(config).float().eval()
    else:
        config = transformers.Qwen3_5TextConfig(**{**QWEN35, **overrides, "vocab_size": vocab})
        model = transformers.Qwen3_5ForCausalLM(config).float().eval()
    randomize(model, seed)
    return model


def save(model, tokenizer_dir, d, mtp: bool = True):
    """The checkpoint as Qwen's are shipped: transformers' files, the tokenizer (if given), and (mtp) a multi-token
    prediction block under `mtp.*` — one full-attention layer, its fc [dim, 2 dim] and three norms (random
    here: no one runs it) — which llama.cpp's converter appends as layer n_layers with
    `nextn_predict_layers`, and which the loaders must leave alone."""
    from pathlib import Path

    from safetensors.torch import save_file

    d = Path(d)
    model.save_pretrained(d, safe_serialization=True)
    if tokenizer_dir is not None:
        transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(d)
        if model.config.model_type == "qwen3_5_moe_text":
            # transformers 5 loads a qwen3_5_moe_text checkpoint's tokenizer as Qwen3_5Tokenizer whatever its
            # files say, rebuilding Qwen's pre-tokenizer around the borrowed (SmolLM2) vocabulary, which the
            # converter then cannot identify; the dense type keeps the files' tokenizer. The converter picks its
            # class from `architectures` (Qwen3_5MoeForCausalLM) and reads every MoE key as before
            import json

            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_5_text"}, indent=2))
    if mtp:
        c, sd = model.config, model.state_dict()
        full = c.layer_types.index("full_attention")
        src = f"model.layers.{full}."
        extra = {"mtp.layers.0." + k[len(src):]: v.clone() for k, v in sd.items() if k.startswith(src)}
        dim, g = c.hidden_size, torch.Generator().manual_seed(99)
        extra["mtp.fc.weight"] = torch.randn(dim, 2 * dim, generator=g) / math.sqrt(2 * dim)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            extra[f"mtp.{n}.weight"] = 0.1 * torch.randn(dim, generator=g)
        save_file(extra, str(d / "model-mtp.safetensors"), metadata={"format": "pt"})
    return d
