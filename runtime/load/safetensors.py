"""Hugging Face checkpoint directory (config.json + *.safetensors) → (config, lowbit weights, config dict).

Every family of models/families.py (its model_types; a multimodal wrapper's language model). Tensors
are read one at a time (float ones by plain file reads at the offsets in each file's header, into memory
of their own: `read_tensor`; the rest through `safetensors.safe_open`'s map) and quantized to the target
layout as they arrive, so the peak is the final weights plus one source tensor in fp32, never a
full-precision copy of the model.
Every tensor's name and shape is checked against config.json before anything is converted, so a
wrong or truncated checkpoint fails at once with one line naming file and tensor.

HF keeps Q/K rows in rotate-half order, which is the model's own convention: no permutation here
(GGUF `llama` files need one; see runtime/load/gguf.py), except partial rotary's reorder within each
head (models/rope.py). Fused tensors (Phi-3's qkv_proj, gate_up_proj) are split by whole rows, and
Gemma's norms stored as w - 1 get their 1 back.

Pre-quantized 4-bit GPTQ and AWQ checkpoints (config.json `quantization_config`, quant/gptq.py): each
quantized linear is a module's qweight / qzeros / scales (/ g_idx) instead of its `.weight`, checked
against config.json like any tensor and relayed into the lowbit layout that holds it exactly, whatever
the target (a float target other than f32 would round it: refused; f32 dequantizes it exactly).
Embeddings, LM head, norms and biases load as in a full-precision checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open

from lowbit.models.config import LlamaConfig
from lowbit.models.rope import head_rows, rotary_row_order
from lowbit.quant import WeightSpec, parse_weights, quantize_weight
from lowbit.quant.dense import to_float
from lowbit.quant.gptq import PackedSpec, dequantize, parse_quantization_config, to_lowbit
from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.gguf import LazyWeights

INDEX_NAME = "model.safetensors.index.json"
# lowbit name → HF name inside `model.layers.{i}.`
LAYER_MATRICES = MappingProxyType({
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
})
LAYER_VECTORS = MappingProxyType({"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight"})
LAYER_BIASES = MappingProxyType({"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
                                 "bv": "self_attn.v_proj.bias"})
QK_NORMS = MappingProxyType({"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"})
# Gemma: four norms a block, and the one after attention is the post-attention one
SANDWICH_NORMS = MappingProxyType({"attn_norm": "input_layernorm.weight",
                                   "attn_post_norm": "post_attention_layernorm.weight",
                                   "ffn_norm": "pre_feedforward_layernorm.weight",
                                   "ffn_post_norm": "post_feedforward_layernorm.weight"})
# Phi-3: one tensor for q, k, v and one for gate, up; lowbit names → (HF name, its part)
FUSED = MappingProxyType({"wq": ("self_attn.qkv_proj.weight", 0), "wk": ("self_attn.qkv_proj.weight", 1),
                          "wv": ("self_attn.qkv_proj.weight", 2), "w_gate": ("mlp.gate_up_proj.weight", 0),
                          "w_up": ("mlp.gate_up_proj.weight", 1)})
# Multimodal wrappers (Gemma 3 4B+, Mistral 3): the language model's tensors sit under one of these, and the
# vision tower's are not the language model's
TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.",
                   "model.visual.",  # Qwen3.5's
                   "mtp.")  # not vision: Qwen3.5's multi-token-prediction block, which lowbit does not run
# Qwen3.5's Gated DeltaNet layers (models/deltanet.py): lowbit name → HF name inside `model.layers.{i}.`
DELTANET = MappingProxyType({"ssm_qkv": "linear_attn.in_proj_qkv.weight", "ssm_z": "linear_attn.in_proj_z.weight",
                             "ssm_beta": "linear_attn.in_proj_b.weight", "ssm_alpha": "linear_attn.in_proj_a.weight",
                             "ssm_out": "linear_attn.out_proj.weight", "ssm_conv": "linear_attn.conv1d.weight",
                             "ssm_dt": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
                             "ssm_norm": "linear_attn.norm.weight"})
# Buffers some older checkpoints saved alongside the weights; recomputed from config, never read.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = MappingProxyType({"I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
                           "F32": torch.float32})  # safetensors' names of the dtypes packed tensors come in
DTYPE_BYTES = MappingProxyType({"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                                "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1})  # bytes per element, `lowbit info`


def read_config(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise LowbitError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LowbitError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LowbitError(f"{cfg_path}: expected a JSON object")
    return cfg


def shard_files(path: Path) -> list[Path]:
    """The safetensors files holding the checkpoint: those the index names, else every *.safetensors."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise LowbitError(f"{index}: unreadable shard index ({type(e).__name__}: {e})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise LowbitError(f"{index}: names shard {f.name}, which is missing from {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    # Mistral's repositories ship their own-format consolidated.safetensors next to the HF files.
    files = [f for f in files if not f.name.startswith("consolidated")] or files
    if not files:
        raise LowbitError(f"{path}: no *.safetensors files (lowbit reads safetensors checkpoints, not .bin/.pt)")
    return files


def safetensors_tensor_types(path: Path) -> dict[str, tuple[int, int]]:
    """Each dtype in the checkpoint's shards (safetensors' names: BF16, I32, …) → (tensor count, bytes of
    tensor data), largest first, read from the headers only."""
    out: dict[str, list[int]] = {}
    for f in shard_files(Path(path)):
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                dtype = str(sl.get_dtype())
                entry = out.setdefault(dtype, [0, 0])
                entry[0] += 1
                entry[1] += math.prod(int(d) for d in sl.get_shape()) * DTYPE_BYTES.get(dtype, 0)
    return {k: (n, b) for k, (n, b) in sorted(out.items(), key=lambda kv: -kv[1][1])}


def _open_all(path: Path, files: list[Path], stack: ExitStack) -> dict[str, Any]:
    """Tensor name → open safe_open handle of the file that holds it."""
    where: dict[str, Any] = {}
    for f in files:
        try:
            handle = stack.enter_context(safe_open(str(f), framework="pt"))
        except (SafetensorError, OSError) as e:
            raise LowbitError(f"{f}: unreadable safetensors file ({e})") from None
        for name in handle.keys():
            where[name] = (f, handle)
    return where


READ_DTYPES = MappingProxyType({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16})


def _entry(f: Path, name: str, headers: dict[Path, tuple[int, dict]]) -> tuple[int, dict]:
    """(where file `f`'s tensor data starts, tensor `name`'s header entry: dtype, shape, data_offsets)."""
    if f not in headers:
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                headers[f] = (8 + n, json.loads(fh.read(n)))
        except (OSError, ValueError) as e:
            raise LowbitError(f"{f}: cannot read the safetensors header: {e}") from None
    return headers[f][0], headers[f][1][name]


def read_tensor(f: Path, name: str, headers: dict[Path, tuple[int, dict]]) -> torch.Tensor | None:
    """A F32 / F16 / BF16 tensor of file `f`, read into memory of its own (None for another dtype: then
    safe_open's). Not through safe_open's map: its tensors are views of the file mapped whole, and every page
    a load reads stays in the process's resident memory while any tensor of that file is held — a BF16 8B
    (16.06 GB of tensors) showed 9.3 GB of file pages beside 9.3 GB of its own after the load, q/k/v and
    gate/up read from the map and fused into copies, the rest held on the map, and 19.9 GB of peak RSS for
    `lowbit eval reference` (tests/bench/reference_rss.py). `headers`: each file's (data start, header),
    read once."""
    start, entry = _entry(f, name, headers)
    dtype = READ_DTYPES.get(entry["dtype"])
    if dtype is None:
        return None
    begin, end = entry["data_offsets"]
    out = torch.empty(end - begin, dtype=torch.uint8)
    view, got = memoryview(out.numpy()), 0
    try:
        with open(f, "rb", buffering=0) as fh:
            fh.seek(start + begin)
            while got < end - begin:
                n = fh.readinto(view[got:])
                if not n:
                    raise LowbitError(f"{f}: truncated file: tensor {name} ends at byte {start + end}")
                got += n
    except OSError as e:
        raise LowbitError(f"{f}: cannot read tensor {name}: {e.strerror or e}") from None
    return out.view(dtype).reshape(entry["shape"])  # safetensors is little-endian, as the CPUs lowbit runs on


def load_hf_dir(path: Path, target: WeightSpec,
                progress: Callable[[int], None] | None = None) -> tuple[LlamaConfig, dict, dict]:
    """→ (LlamaConfig, weights dict, config.json dict). Weight names as runtime/load/gguf.py:
    embed, output (absent when tied), norm, and `layers.{i}.{attn_norm, ffn_norm, wq, wk, wv, wo,
    w_gate, w_up, w_down}` plus `bq, bk, bv` when the checkpoint has Q/K/V biases (Qwen2)."""
    path = Path(path)
    if not path.is_dir():
        raise LowbitError(f"{path}: not a directory (expected a Hugging Face checkpoint: config.json + *.safetensors)")
    cfg = read_config(path)
    packed = _packed_spec(path, cfg)
    if packed is not None and not target.quantized and target.float_dtype != "float32":
        raise LowbitError(f"{path}: --weights {target.name} would round this {packed.method} checkpoint's weights; "
                          "use auto (its own 4-bit layout) or f32 (dequantized exactly)")
    try:
        config = LlamaConfig.from_hf(cfg)
    except KeyError as e:
        raise LowbitError(f"{path}: config.json has no key {e}") from None
    except (ValueError, TypeError) as e:  # unknown model_type / rope scaling; a value of the wrong type
        raise LowbitError(f"{path}: {e}") from None

    with ExitStack() as stack:
        where = _open_all(path, shard_files(path), stack)
        prefix = next((t for t in TEXT_PREFIXES if t + "embed_tokens.weight" in where), None)
        if prefix is None:
            nested = any(k.startswith("model.layers.") or k == "model.embed_tokens.weight" for k in where)
            prefix = "model." if nested else ""
        embed_name = prefix + "embed_tokens.weight"
        if embed_name not in where:
            raise LowbitError(f"{path}: missing tensor {embed_name}")
        vocab = int(where[embed_name][1].get_slice(embed_name).get_shape()[0])
        if vocab != config.vocab_size:  # padded tables: the tensor is the truth, as for GGUF
            config = dataclasses.replace(config, vocab_size=vocab)
        if packed is not None and (config.family.fused_tensors or config.rotary_dim is not None):
            raise LowbitError(f"{path}: {packed.method} checkpoints of {config.arch} (fused or partially rotated "
                              "projections) are not supported; use its safetensors in 16 bits or a GGUF")
        plan = _plan(config, prefix, packed, where)
        _check(path, plan, where, packed, config.arch)
        weights = _convert(config, plan, where, target, progress, packed)
    return config, weights, cfg


def _packed_spec(path: Path, cfg: dict) -> PackedSpec | None:
    """config.json's quantization_config → its spec (quant/gptq.py); None for a full-precision checkpoint."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise LowbitError(f"{path / 'config.json'}: quantization_config is not a JSON object")
    try:
        return parse_quantization_config(qc)
    except ValueError as e:
        raise LowbitError(f"{path / 'config.json'}: {e}") from None


def _plan(c: LlamaConfig, prefix: str, packed: PackedSpec | None = None,
          where: dict | None = None) -> list[tuple[str, str, tuple[int, ...], str, torch.Tensor | None]]:
    """(lowbit name, HF name, expected shape, kind, rows) in load order; kind is matrix, head, norm or
    vector, or packed: a pre-quantized linear, named by its module (`….q_proj`), whose tensors `packed`
    lists; rows (int64, or None for all in order) are the rows of the HF tensor the lowbit one takes:
    a part of a fused tensor (Phi-3), or q/k rows reordered for partial rotary (models/rope.py)."""
    fam = c.family
    D, Dq, Dkv = c.dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    plan = [("embed", prefix + "embed_tokens.weight", (c.vocab_size, D), "head", None),
            ("norm", prefix + "norm.weight", (D,), "norm", None)]
    if not c.tie_embeddings:  # a multimodal wrapper saved by transformers 4 keeps it under its language model
        head = "language_model.lm_head.weight" if where and "language_model.lm_head.weight" in where else "lm_head.weight"
        plan.append(("output", head, (c.vocab_size, D), "head", None))
    mats = {"wq": (Dq, D), "wk": (Dkv, D), "wv": (Dkv, D), "wo": (D, Dq),
            "w_gate": (c.hidden_dim, D), "w_up": (c.hidden_dim, D), "w_down": (D, c.hidden_dim)}
    biases = {"bq": (Dq,), "bk": (Dkv,), "bv": (Dkv,)}
    order = rotary_row_order(c.head_dim, c.rotary_dim)
    own = {"wq": head_rows(order, c.n_heads), "wk": head_rows(order, c.n_kv_heads)}  # within each part
    own |= {"bq": own["wq"], "bk": own["wk"]}
    parts = {"self_attn.qkv_proj.weight": [Dq, Dkv, Dkv], "mlp.gate_up_proj.weight": [c.hidden_dim, c.hidden_dim]}
    for i in range(c.n_layers):
        hp, lp = f"{prefix}layers.{i}.", f"layers.{i}."
        norms = SANDWICH_NORMS if fam.sandwich_norms else LAYER_VECTORS
        plan += [(lp + n, hp + hf, (D,), "norm", None) for n, hf in norms.items()]
        if fam.qk_norm:  # the q/k rows' order within a head (partial rotary) is the norms' order too
            plan += [(lp + n, hp + hf, (c.head_dim,), "norm", order) for n, hf in QK_NORMS.items()]
        if fam.gated_attention:  # q_proj's rows per head: the query's head_dim rows, then its gate's
            q_rows = 2 * c.head_dim * torch.arange(c.n_heads)[:, None]  # [H, 1]
            query = (q_rows + (torch.arange(c.head_dim) if order is None else order)).reshape(-1)
            plan += [(lp + "wq", hp + LAYER_MATRICES["wq"], (2 * Dq, D), "matrix", query),
                     (lp + "wq_gate", hp + LAYER_MATRICES["wq"], (2 * Dq, D), "matrix",
                      (q_rows + c.head_dim + torch.arange(c.head_dim)).reshape(-1))]
        fused = fam.fused_tensors and where is not None and hp + FUSED["wq"][0] in where
        for n, hf in LAYER_MATRICES.items():
            module = hp + hf.removesuffix(".weight")
            if n == "wq" and fam.gated_attention:
                continue
            if fused and n in FUSED:
                name, part = FUSED[n]
                sizes = parts[name]
                start = sum(sizes[:part])
                rows = start + (torch.arange(sizes[part]) if own.get(n) is None else own[n])
                plan.append((lp + n, hp + name, (sum(sizes), D), "matrix", rows))
            # modules_to_not_convert: a substring of the module's name, as transformers matches them
            elif packed is not None and not any(m in module for m in packed.keep_float):
                plan.append((lp + n, module, mats[n], "packed", None))
            else:
                plan.append((lp + n, hp + hf, mats[n], "matrix", own.get(n)))
        if c.qkv_bias:
            plan += [(lp + n, hp + hf, biases[n], "vector", own.get(n)) for n, hf in LAYER_BIASES.items()]
        if fam.o_bias:
            plan.append((lp + "bo", hp + "self_attn.o_proj.bias", (D,), "vector", None))
        if fam.sinks:
            plan.append((lp + "sinks", hp + "self_attn.sinks", (c.n_heads,), "vector", None))
        if c.n_experts:
            plan = [p for p in plan if p[0] not in (lp + "w_gate", lp + "w_up", lp + "w_down")]
            plan += _expert_plan(c, hp, lp, where)
        if c.is_recurrent(i):  # Gated DeltaNet in place of attention: its own tensors; the norms and MLP stay
            attention = {lp + n for n in ("wq", "wk", "wv", "wo", "wq_gate", "q_norm", "k_norm", "bq", "bk", "bv")}
            plan = [p for p in plan if p[0] not in attention] + _deltanet_plan(c, hp, lp)
    return plan


def _deltanet_plan(c: LlamaConfig, hp: str, lp: str) -> list:
    """A Gated DeltaNet layer's tensors (its norms and MLP are the block's): the projections as matrices, the
    conv [C, 1, K], dt_bias and the gated norm's weight as stored (the norm multiplies by w, not 1 + w), and
    A_log as A = -exp(A_log) (kind "neg_exp"), which is what llama.cpp's converter stores and the layer uses."""
    d, D = c.deltanet, c.dim
    Vd = d.v_heads * d.v_dim
    shapes = {"ssm_qkv": (d.conv_dim, D), "ssm_z": (Vd, D), "ssm_beta": (d.v_heads, D), "ssm_alpha": (d.v_heads, D),
              "ssm_out": (D, Vd), "ssm_conv": (d.conv_dim, 1, d.conv_taps), "ssm_dt": (d.v_heads,),
              "ssm_a": (d.v_heads,), "ssm_norm": (d.v_dim,)}
    kinds = {"ssm_conv": "vector", "ssm_dt": "vector", "ssm_a": "neg_exp", "ssm_norm": "vector"}
    return [(lp + n, hp + hf, shapes[n], kinds.get(n, "matrix"), None) for n, hf in DELTANET.items()]


def _expert_plan(c: LlamaConfig, hp: str, lp: str, where: dict | None) -> list:
    """A mixture-of-experts layer's router (kept in float: kind "router"; gpt-oss's has a bias) and its
    experts' matrices and biases (kind "expert", rows = (expert, take): `take` turns that expert's slice of a
    3-D tensor into lowbit's [N, K] matrix or vector). transformers 5 saves a layer's experts as two 3-D
    tensors: Qwen3-MoE's gate_up_proj [E, 2I, D] (gate rows first) and down_proj [E, D, I]; gpt-oss's
    transposed, gate_up_proj [E, D, 2I] with gate and up columns alternating, down_proj [E, I, D], and a
    bias for each. The hub's Qwen3-MoE checkpoints (transformers 4) have one module per expert instead."""
    E, I, D = c.n_experts, c.expert_hidden_dim, c.dim
    router = hp + ("mlp.router." if where is not None and hp + "mlp.router.weight" in where else "mlp.gate.")
    plan = [(lp + "router", router + "weight", (E, D), "router", None)]
    if where is not None and router + "bias" in where:
        plan.append((lp + "router_bias", router + "bias", (E,), "vector", None))
    stacked = where is None or hp + "mlp.experts.gate_up_proj" in where
    gate_up, down = hp + "mlp.experts.gate_up_proj", hp + "mlp.experts.down_proj"
    biased = where is not None and gate_up + "_bias" in where
    for e in range(E):
        le = f"{lp}experts.{e}."
        if stacked and biased:  # gpt-oss: [D, 2I] per expert, columns gate, up, gate, up, …
            plan += [(le + "w_gate", gate_up, (E, D, 2 * I), "expert", (e, lambda t: t[:, 0::2].T)),
                     (le + "w_up", gate_up, (E, D, 2 * I), "expert", (e, lambda t: t[:, 1::2].T)),
                     (le + "w_down", down, (E, I, D), "expert", (e, lambda t: t.T)),
                     (le + "b_gate", gate_up + "_bias", (E, 2 * I), "expert", (e, lambda t: t[0::2])),
                     (le + "b_up", gate_up + "_bias", (E, 2 * I), "expert", (e, lambda t: t[1::2])),
                     (le + "b_down", down + "_bias", (E, D), "expert", (e, lambda t: t))]
        elif stacked:
            plan += [(le + "w_gate", gate_up, (E, 2 * I, D), "expert", (e, lambda t: t[:I])),
                     (le + "w_up", gate_up, (E, 2 * I, D), "expert", (e, lambda t: t[I:])),
                     (le + "w_down", down, (E, D, I), "expert", (e, lambda t: t))]
        else:
            he = f"{hp}mlp.experts.{e}."
            plan += [(le + "w_gate", he + "gate_proj.weight", (I, D), "matrix", None),
                     (le + "w_up", he + "up_proj.weight", (I, D), "matrix", None),
                     (le + "w_down", he + "down_proj.weight", (D, I), "matrix", None)]
    if c.shared_expert_hidden_dim:  # Qwen3.5-MoE: the shared expert's gated MLP and its gate [1, D], kept in fp32
        Is, sh = c.shared_expert_hidden_dim, hp + "mlp.shared_expert."
        plan += [(lp + "shared.w_gate", sh + "gate_proj.weight", (Is, D), "matrix", None),
                 (lp + "shared.w_up", sh + "up_proj.weight", (Is, D), "matrix", None),
                 (lp + "shared.w_down", sh + "down_proj.weight", (D, Is), "matrix", None),
                 (lp + "shared_gate", hp + "mlp.shared_expert_gate.weight", (1, D), "vector", None)]
    return plan


def _check(path: Path, plan, where: dict, packed: PackedSpec | None = None, family: str = "llama") -> None:
    """Every tensor present with the shape config.json implies, and nothing the model would ignore."""
    wanted, modules = set(), set()
    for _, name, shape, kind, _ in plan:
        if kind == "packed":
            modules.add(name)
            wanted |= _check_packed(path, name, shape, where, packed)
            continue
        wanted.add(name)
        if name not in where:
            raise LowbitError(f"{path}: missing tensor {name}")
        f, handle = where[name]
        got = tuple(int(s) for s in handle.get_slice(name).get_shape())
        if got != shape:
            raise LowbitError(f"{f}: tensor {name} has shape {list(got)}, config.json implies {list(shape)}")
    for name, (f, handle) in where.items():
        if name in wanted or name.endswith(IGNORED_SUFFIXES) or name == "lm_head.weight" \
                or name.startswith(VISION_PREFIXES):
            continue  # a multimodal checkpoint's vision tower: not the language model's  # lm_head.weight next to tie_word_embeddings=true: a duplicate of the table
        if name.removesuffix(".bias") in modules and not handle.get_tensor(name).any():
            continue  # GPTQ-for-LLaMa's QuantLinear saved a zero bias on every linear: adding 0 changes nothing
        # e.g. o_proj.bias / mlp biases (attention_bias, mlp_bias): silently dropping them would
        # give a model that loads and computes the wrong thing.
        raise LowbitError(f"{f}: tensor {name} is not part of a lowbit {family}-family model (unsupported variant)")


def _check_packed(path: Path, module: str, shape: tuple[int, int], where: dict, packed: PackedSpec) -> set[str]:
    """One pre-quantized linear's tensors, by shape and dtype → their names."""
    try:
        tensors = packed.tensors(*shape)
    except ValueError as e:
        raise LowbitError(f"{path}: {module}: {e}") from None
    names = set()
    for suffix, (want, dtypes) in tensors.items():
        name = f"{module}.{suffix}"
        if name not in where:
            if suffix in packed.optional:
                continue
            raise LowbitError(f"{path}: missing tensor {name} ({packed.method} checkpoint)")
        f, handle = where[name]
        sl = handle.get_slice(name)
        got = tuple(int(s) for s in sl.get_shape())
        if got != want:
            raise LowbitError(f"{f}: tensor {name} has shape {list(got)}, config.json implies {list(want)}")
        if DTYPES.get(sl.get_dtype()) not in dtypes:
            raise LowbitError(f"{f}: tensor {name} has dtype {sl.get_dtype()}, expected one of "
                              f"{', '.join(k for k, v in DTYPES.items() if v in dtypes)}")
        names.add(name)
    return names


def _convert(c: LlamaConfig, plan, where: dict, target: WeightSpec, progress,
             packed: PackedSpec | None = None) -> LazyWeights:
    """→ the weights by name. A float matrix under a float target is read only when the model asks for it
    (LazyWeights, as a GGUF's): the model fuses q/k/v and gate/up into copies of their own as it is built,
    and every tensor read up front beside them held a BF16 8B (16.06 GB) and 9 GB of fused copies at once.
    Everything else (quantized on arrival, vectors, experts, pre-quantized modules) is read and converted here."""
    # Embedding and LM head: int8-g32 when the target is quantized (int4 or int8) — they are a large
    # share of a small model's bytes but set the quality of every logit — else the float target.
    head_spec = parse_weights("int8-g32") if target.quantized else target
    weights: dict[str, Callable[[], Any]] = {}
    headers: dict[Path, tuple[int, dict]] = {}  # read_tensor's, per file
    layer_of = [int(n.split(".")[1]) if n.startswith("layers.") else None for n, _, _, _, _ in plan]
    plus_one = c.family.norm_plus_one  # Gemma's norms multiply by (1 + w): the model multiplies by what it holds
    for j, (lname, name, shape, kind, rows) in enumerate(plan):
        if kind == "packed":
            weights[lname] = _held(_relay(name, shape, where, target, packed))
            _progress(progress, layer_of, j)
            continue
        f, handle = where[name]
        spec = head_spec if kind == "head" else target
        if kind in ("matrix", "head") and not spec.quantized and _entry(f, name, headers)[1]["dtype"] in READ_DTYPES:
            weights[lname] = partial(_read_float, f, name, rows, spec, headers)
            _progress(progress, layer_of, j)
            continue
        if kind == "expert":  # one expert's matrix or bias, of a 3-D (2-D) tensor: read that slice only
            e, take = rows
            t, rows = take(handle.get_slice(name)[e]).contiguous(), None
            kind = "vector" if t.dim() == 1 else "matrix"
        else:  # source dtype (bf16/fp16/fp32); the quantizer takes it as is
            t = read_tensor(f, name, headers)
            t = handle.get_tensor(name) if t is None else t
        if not t.is_floating_point():
            raise LowbitError(f"{f}: tensor {name} has dtype {t.dtype}, expected a float tensor")
        if rows is not None:
            t = t[rows]
        if kind == "router":  # tiny (E x dim) and it decides which experts run: kept as stored
            value = to_float(t, parse_weights("f32"))
        elif kind == "norm" and plus_one:
            value = (1.0 + t.float()).contiguous()  # transformers: output * (1.0 + weight.float())
        elif kind in ("vector", "norm"):
            value = t.float().contiguous()
        elif kind == "neg_exp":  # transformers: -self.A_log.float().exp()
            value = -t.float().exp()
        else:
            value = quantize_weight(t, spec)
        weights[lname] = _held(value)
        del t, value
        _progress(progress, layer_of, j)
    return LazyWeights(weights, None)


def _held(value: Any) -> Callable[[], Any]:
    return lambda: value


def _read_float(f: Path, name: str, rows: torch.Tensor | None, spec: WeightSpec,
                headers: dict[Path, tuple[int, dict]]):
    """A float matrix (its `rows`, None: all) of file `f` in float layout `spec`, read now."""
    t = read_tensor(f, name, headers)
    return quantize_weight(t if rows is None else t[rows], spec)


def _progress(progress, layer_of: list, j: int) -> None:
    i = layer_of[j]
    if progress and i is not None and (j + 1 == len(layer_of) or layer_of[j + 1] != i):
        progress(i + 1)  # after a layer's last tensor, 1-based like the GGUF loader


def _relay(module: str, shape: tuple[int, int], where: dict, target: WeightSpec, packed: PackedSpec):
    """One pre-quantized linear → the lowbit layout holding it exactly (quant/gptq.py), or its exact fp32
    dequantization for an f32 target."""
    names = [s for s in packed.tensors(*shape) if f"{module}.{s}" in where]
    tensors = {s: where[f"{module}.{s}"][1].get_tensor(f"{module}.{s}") for s in names}
    try:
        u = packed.unpack(**tensors)
        return to_lowbit(u) if target.quantized else to_float(dequantize(u), target)
    except ValueError as e:
        raise LowbitError(f"{where[f'{module}.qweight'][0]}: {module}: {e}") from None


__all__ = ["load_hf_dir", "read_config", "safetensors_tensor_types", "shard_files"]
