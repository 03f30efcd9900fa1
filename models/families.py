"""Model families as data: one row per family, read by the config (models/config.py), the loaders
(runtime/load/gguf.py, safetensors.py) and the one forward pass (models/llama.py).

A row names the family's GGUF `general.architecture`s and HF `model_type`s, where its tensors differ
from Llama's, and which of the block's variants it switches on. Numbers that vary within a family
(window sizes, rope bases, which layers are local) come from the file into LlamaConfig; what llama.cpp
fixes per architecture instead of writing to the GGUF (Gemma 3's one global layer in 6, SmolLM3's
one layer in 4 without RoPE) is fixed here the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Family:
    name: str
    gguf_archs: tuple[str, ...]
    hf_types: tuple[str, ...]
    # llama.cpp's converter stores Q/K rows for its adjacent-pair rotary (LlamaModel.permute): the GGUF
    # loader un-permutes them to rotate-half. Families converted with NEOX rotary keep HF's order.
    gguf_permuted: bool = False
    qkv_bias: bool = False  # Q/K/V biases always there (Qwen2); others when config.json says attention_bias
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before rotary (Qwen3, Gemma 3)
    # Gemma: a norm on the attention output and on the MLP output before each residual add (four norms
    # a block: attn_norm, attn_post_norm, ffn_norm, ffn_post_norm)
    sandwich_norms: bool = False
    # Gemma's RMSNorm multiplies by (1 + w): HF checkpoints store w, llama.cpp's converter stores 1 + w;
    # the safetensors loader adds the 1 so the model always multiplies by the stored vector
    norm_plus_one: bool = False
    # the gated MLP's: "silu" (SwiGLU) | "gelu_tanh" (GeGLU, Gemma) | "swiglu_clamped" (gpt-oss: gate and up
    # clamped, gate * sigmoid(alpha gate) * (up + 1); kernels/swiglu_clamped.py)
    activation: str = "silu"
    embed_scale: bool = False  # embeddings times sqrt(dim) (Gemma)
    # Phi-3/4: one qkv_proj (GGUF attn_qkv) and one gate_up_proj (GGUF ffn_up, gate rows first); split
    # into lowbit's wq/wk/wv and w_gate/w_up by whole rows at load, losslessly
    fused_tensors: bool = False
    swa_every: int = 0  # GGUF: every swa_every-th layer global, the others sliding-window (Gemma 3: 6, gpt-oss: 2)
    local_rope: bool = False  # the sliding-window layers have their own rope base, unscaled (Gemma 3)
    # gpt-oss: a learned logit per head joins each query's softmax over its keys, carrying no value
    # (GGUF attn_sinks, HF self_attn.sinks)
    sinks: bool = False
    o_bias: bool = False  # a bias on attention's output projection (gpt-oss)
    # the GGUF name of the MLP's norm: llama.cpp calls it post_attention_norm in gpt-oss and its hybrid
    # families (qwen35, qwen35moe), ffn_norm elsewhere
    gguf_ffn_norm: str = "ffn_norm"
    nope_every: int = 0  # every nope_every-th layer without RoPE (SmolLM3: 4)
    # Ministral 3: queries scaled by 1 + beta * log(1 + floor(pos / original context)) (Llama 4's)
    attn_temperature: bool = False
    # mixture of experts: how the router turns its logits into each token's k experts and their weights
    # (models/moe.py): "softmax" = softmax over all experts, the k largest, renormalised to sum 1 when the
    # config says so (Qwen3-MoE's norm_topk_prob; llama.cpp's qwen3moe always renormalises); "" = a dense MLP
    # "topk_softmax" = the k largest logits (the router has a bias), softmax over those k (gpt-oss)
    experts: str = ""
    # Qwen3.5: q_proj's rows are, per head, the head's query then a gate of as many rows; attention's output
    # is multiplied by sigmoid(gate) before wo (the loaders split the rows into wq and wq_gate, losslessly)
    gated_attention: bool = False
    # hybrid: "gated_deltanet" = the layers the file marks recurrent are Gated DeltaNet linear attention
    # (models/deltanet.py) with a fixed-size state per sequence, not paged attention; "" = none
    recurrent: str = ""


FAMILIES = MappingProxyType({f.name: f for f in (
    Family("llama", ("llama",), ("llama",), gguf_permuted=True),
    Family("mistral", ("mistral",), ("mistral",), gguf_permuted=True),
    Family("qwen2", ("qwen2",), ("qwen2",), qkv_bias=True),
    Family("qwen3", ("qwen3",), ("qwen3",), qk_norm=True),
    Family("smollm3", ("smollm3",), ("smollm3",), gguf_permuted=True, nope_every=4),
    Family("mistral3", ("mistral3",), ("ministral3",), gguf_permuted=True, attn_temperature=True),
    Family("qwen3moe", ("qwen3moe",), ("qwen3_moe",), qk_norm=True, experts="softmax"),
    Family("phi3", ("phi3",), ("phi3",), fused_tensors=True),
    Family("qwen35", ("qwen35",), ("qwen3_5_text",), qk_norm=True, norm_plus_one=True, gated_attention=True,
           recurrent="gated_deltanet"),
    # Qwen3.5's hybrid block with a mixture of experts, plus a shared expert scaled by sigmoid(its gate) (models/moe.py)
    Family("qwen35moe", ("qwen35moe",), ("qwen3_5_moe_text",), qk_norm=True, norm_plus_one=True, gated_attention=True,
           recurrent="gated_deltanet", experts="softmax"),
    Family("gemma3", ("gemma3",), ("gemma3_text",), qk_norm=True, sandwich_norms=True, norm_plus_one=True,
           activation="gelu_tanh", embed_scale=True, swa_every=6, local_rope=True),
    # Q/K/V/O and expert biases (attention_bias); experts MXFP4 in its files (quant/ggml.py)
    Family("gpt-oss", ("gpt-oss",), ("gpt_oss",), qkv_bias=True, activation="swiglu_clamped", swa_every=2,
           sinks=True, o_bias=True, experts="topk_softmax", gguf_ffn_norm="post_attention_norm"),
)})
GGUF_ARCHS = MappingProxyType({a: f for f in FAMILIES.values() for a in f.gguf_archs})
HF_TYPES = MappingProxyType({t: f for f in FAMILIES.values() for t in f.hf_types})
# checkpoints whose text model sits under a multimodal wrapper: config.json's text_config is the model
HF_WRAPPERS = MappingProxyType({"gemma3": "gemma3_text", "mistral3": "ministral3", "qwen3_5": "qwen3_5_text",
                                 "qwen3_5_moe": "qwen3_5_moe_text"})


def family_of_gguf(arch) -> Family:
    if arch not in GGUF_ARCHS:
        raise ValueError(f"unknown architecture {arch!r} (supported: {', '.join(GGUF_ARCHS)})")
    return GGUF_ARCHS[arch]


def family_of_hf(model_type) -> Family:
    if model_type not in HF_TYPES:
        raise ValueError(f"unknown model_type {model_type!r} in config.json (supported: "
                         f"{', '.join([*HF_TYPES, *HF_WRAPPERS])})")
    return HF_TYPES[model_type]
