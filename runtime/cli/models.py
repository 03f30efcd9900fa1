"""`lowbit pull`, `lowbit models` and `lowbit info`: the model cache and what a model holds."""

from __future__ import annotations

import sys

from lowbit.runtime.cli.engine_args import WEIGHTS_HELP
from lowbit.runtime.load.registry import DEFAULT_MODEL


def add_models_parsers(sub) -> None:
    pull = sub.add_parser("pull", help="download a model into the model cache",
                          description="Fetch a model by alias and verify its sha256 (the cache is $LOWBIT_MODELS "
                                      "or the user cache directory), or from the Hugging Face hub as "
                                      "hf:ORG/REPO[:QUANT]: a GGUF repo's file for QUANT (default Q4_K_M, or the "
                                      "only GGUF), or a safetensors repo's config, tokenizer and shards, into "
                                      "the huggingface_hub cache (HF_HOME / HF_HUB_CACHE; HF_TOKEN for gated or "
                                      "private repos). An interrupted download resumes; pulled models run "
                                      "offline. Prints the model's path.")
    pull.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                      help=f"alias (default: {DEFAULT_MODEL}) or hf:ORG/REPO[:QUANT], "
                           "e.g. hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M")

    sub.add_parser("models", help="list cached models with format and size",
                   description="List the models in the model cache ($LOWBIT_MODELS or the user cache dir) and "
                               "those in the huggingface_hub cache, named by the hf: reference that runs them.")

    info = sub.add_parser("info", help="show a model's config, layouts and memory",
                          description="Load a model and print its architecture, weight layouts and bytes held.")
    info.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                      help="alias, hf:ORG/REPO[:QUANT], .gguf path or HF directory")
    info.add_argument("--weights", default="auto", help=WEIGHTS_HELP)
    info.add_argument("--device", default="cpu", help="where to load it: cpu (default), cuda or cuda:N")
    info.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"), help="activation dtype on CUDA")


def cmd_pull(args) -> int:
    from lowbit.runtime.load.registry import pull

    path = pull(args.model, progress=lambda s: print(f"lowbit: {s}", file=sys.stderr))
    print(path)
    return 0


def cmd_models(args) -> int:
    from lowbit.runtime.load.registry import list_models, models_dir

    rows = list_models()
    if not rows:
        print(f"no models in {models_dir()} (run: lowbit pull)", file=sys.stderr)
        return 0
    width = max(24, *(len(m.name) for m in rows))  # hf:ORG/REPO:QUANT names run longer than aliases
    print(f"{'NAME':<{width}} {'FORMAT':<12} {'SIZE':>10}  PATH")
    for m in rows:
        print(f"{m.name:<{width}} {m.format:<12} {m.size / 1e6:>8.1f}MB  {m.path}")
    return 0


def cmd_info(args) -> int:
    from lowbit.runtime.load.loader import load

    lm = load(args.model, args.weights, device=args.device, dtype=args.dtype)
    c = lm.config
    layouts = sorted({m.spec_name for m in lm.model.modules() if hasattr(m, "spec_name")})
    variants = c.variants()
    print(f"path: {lm.path}\nformat: {lm.source}\nfamily: {c.arch} ({'; '.join(variants) or 'the Llama block'})\n"
          f"layers {c.n_layers}, dim {c.dim}, heads {c.n_heads}/{c.n_kv_heads} (q/kv), head_dim {c.head_dim}, "
          f"hidden {c.hidden_dim}, vocab {c.vocab_size}, context {c.max_seq_len}, tied embeddings {c.tie_embeddings}\n"
          f"weights: {lm.weights} (layouts: {', '.join(layouts)})\n"
          f"device: {lm.model.device} ({lm.model.backend.name} kernels)\n"
          f"bytes held by weight tensors: {lm.weight_bytes:,}\nload time: {lm.load_seconds:.2f} s")
    total, active = c.parameters()
    print(f"parameters: {total:,} total, {active:,} active per token"
          + (f" ({c.n_experts_used} of {c.n_experts} experts)" if c.n_experts else "")
          + f"\nweight bytes read per token: {lm.model.bytes_per_token():,}")
    if lm.source == "gguf":
        from lowbit.runtime.load.gguf import gguf_tensor_types as tensor_types
    else:
        from lowbit.runtime.load.safetensors import safetensors_tensor_types as tensor_types
    types = tensor_types(lm.path)
    file_bytes = sum(b for _, b in types.values())
    print("file tensors: " + ", ".join(f"{k} {n} ({b:,} bytes)" for k, (n, b) in types.items()))
    print(f"held / file tensor bytes: {lm.weight_bytes:,} / {file_bytes:,} = {lm.weight_bytes / file_bytes:.3f}x")
    return 0
