"""The model and engine flags, and the flags into an engine: sizes (`--kv-memory 512MiB`), `--speculative` and its draft model,
and the loaded model + engine that `lowbit serve` and `lowbit chat` serve."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lowbit.quant.kv import KV_FORMATS
from lowbit.runtime.engine.config import DEFAULT_KV_MEMORY, EngineConfig
from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.registry import DEFAULT_MODEL

DEFAULTS = EngineConfig()
WEIGHTS_HELP = ("weight layout: auto (GGUF: every common type held losslessly at the file's size — Q4_0, Q4_1, "
                "Q8_0, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS, MXFP4; safetensors: int4-g32, GPTQ/AWQ as stored), int4-g32, int4-g64, int4-g128, int4-sym-g32/64/128, int8, "
                "int8-g32/64/128, bf16, f16, f32, and on CPU bitsandbytes' bnb-nf4, bnb-int8")
SPECULATIVE_HELP = ("speculative decoding: 'ngram,k=4' (prompt lookup: drafts copied from the request's own "
                    "context, n=3 longest suffix), 'draft=MODEL,k=4' (a small model with the same vocabulary) or "
                    "'draft=self:int4-g128,k=4' (a low-bit copy of this model's own weights); greedy replies stay "
                    "exactly the same, sampled ones keep the model's distribution (default: off)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"alias, path to a .gguf, a Hugging Face model directory, or hf:ORG/REPO[:QUANT] "
                        f"(downloaded into the hub cache on first use; default quant Q4_K_M) (default: {DEFAULT_MODEL})")
    p.add_argument("--weights", default="auto", help=WEIGHTS_HELP)
    p.add_argument("--recipe", default=None, metavar="FILE",
                   help="a recipe written by `lowbit fit`: each matrix's layout and each layer's K and V bits, in "
                        "place of --weights and --kv-cache")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--device", default="auto",
                   help="auto (cuda when a GPU and Triton are there, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"),
                   help="activation dtype on CUDA (default float16; the CPU path computes in fp32)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: run the model as N processes, each holding a slice of every layer "
                        "(CPU, gloo; the threads are split among them; see docs/tp.md). Default 1")


# --flag → SamplingParams field, for the sampling defaults `run` and `serve` take
SAMPLING_FLAGS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}


def add_sampling_args(p: argparse.ArgumentParser, fallback: str) -> None:
    """--temperature/--top-p/--top-k/--min-p/--repetition-penalty, unset by default: the model's own defaults
    (generation_config.json, GGUF general.sampling.*) apply, else `fallback`'s."""
    g = p.add_argument_group("sampling defaults", f"Each unset flag takes the model's own value "
                                                   f"(generation_config.json or GGUF general.sampling.*), else {fallback}.")
    g.add_argument("--temperature", type=float, default=None, metavar="T", help="0 = greedy")
    g.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling mass; 1 = off")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="keep the k most likely tokens; 0 = off")
    g.add_argument("--min-p", type=float, default=None, metavar="P", help="drop tokens under p x the top one's; 0 = off")
    g.add_argument("--repetition-penalty", type=float, default=None, metavar="R", help="1 = off")


def sampling_defaults(args, model: dict, fallback: dict) -> dict:
    """{field: value}: the flags given, over the model's own defaults, over `fallback`."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name, None) is not None}
    return {**fallback, **model, **given}


def add_kv_args(p: argparse.ArgumentParser, speculative_help: str = SPECULATIVE_HELP) -> None:
    """The KV-cache and speculation flags, which `run` takes too; choices and defaults are the
    engine's own (quant/kv.py, engine/config.py)."""
    floor = f"{DEFAULT_KV_MEMORY >> 20}MiB"
    p.add_argument("--kv-cache", default=DEFAULTS.kv_format, choices=tuple(KV_FORMATS),
                   help=f"KV cache format of the paged engine (default {DEFAULTS.kv_format}; see docs/engine.md)")
    p.add_argument("--kv-memory", default="auto",
                   help="memory for the KV cache pool: bytes, a size like 512MiB or 2GiB, on CUDA a share of the "
                        "free GPU memory like 90%%, or auto (the default): one whole context of the model, at "
                        f"least {floor}, at most half the memory free once the model is loaded")
    p.add_argument("--speculative", default=None, metavar="SPEC", help=speculative_help)
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every decode step eagerly on CUDA (default: pure decode steps are replayed as CUDA "
                        "graphs, one per batch-size bucket; see docs/engine.md)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every engine flag: the KV and speculation flags plus batching and context limits."""
    add_kv_args(p)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs,
                   help=f"most requests decoded together (default {DEFAULTS.max_num_seqs})")
    p.add_argument("--ctx-size", type=int, default=None,
                   help="most tokens per request, prompt and reply together (default: the model's context)")


def parse_size(text: str) -> int | float | None:
    """'1000000', '512MiB', '2GiB', '1.5G' → bytes (K/M/G are taken as binary units); '90%' → 0.9
    (a share of free GPU memory); 'auto' → None (the engine sizes the pool to the model: engine.kv_budget)."""
    if text.strip().lower() == "auto":
        return None
    if text.strip().endswith("%"):
        try:
            share = float(text.strip()[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 < share < 1:
            raise LowbitError(f"a memory share must be between 0% and 100%, got {text!r}")
        return share
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = float(num) * units[unit]
    except ValueError:
        raise LowbitError(f"cannot read the size {text!r} (examples: 268435456, 256MiB, 2GiB)") from None
    if value <= 0:
        raise LowbitError(f"a size must be positive, got {text!r}")
    return int(value)


def parse_speculative(text: str | None):
    """--speculative → SpecConfig or None (a one-line error for a bad value)."""
    if text is None:
        return None
    from lowbit.runtime.engine.speculative import SpecConfig

    try:
        return SpecConfig.parse(text)
    except ValueError as e:
        raise LowbitError(str(e)) from None


def load_draft(spec, lm, device: str, dtype: str):
    """The draft model a `draft=` spec names: `self:<weights>` (`self` alone: int4-g128) loads the
    target's own file again in that layout; anything else is a model reference, which must share
    the target's vocabulary (same token strings), or drafts would mean other tokens."""
    if spec is None or spec.method != "draft":
        return None
    from lowbit.runtime.load.loader import load

    ref, weights = spec.draft, "auto"
    if ref == "self" or ref.startswith("self:"):
        ref, weights = str(lm.path), ref.partition(":")[2] or "int4-g128"
    draft = load(ref, weights, progress=False, device=device, dtype=dtype)
    a, b = lm.tokenizer, draft.tokenizer
    same = a.vocab_size == b.vocab_size and all(a.token_bytes(i) == b.token_bytes(i)
                                                for i in range(0, a.vocab_size, max(1, a.vocab_size // 512)))
    if not same or draft.config.vocab_size != lm.config.vocab_size:
        raise LowbitError(f"draft model {spec.draft}: its vocabulary differs from the target's; a draft must use "
                          "the same tokenizer")
    return draft.model


def check_engine_args(args) -> None:
    if args.max_num_seqs < 1:
        raise LowbitError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")


def read_recipe(args):
    """The `--recipe` file's Recipe (runtime/load/recipe.py), or None."""
    if getattr(args, "recipe", None) is None:
        return None
    from lowbit.runtime.load.recipe import read

    return read(args.recipe)


def engine_config(args, kv_memory: int | float, spec) -> EngineConfig:
    """The flags' engine: `--kv-memory` already read by parse_size, `--speculative` by
    parse_speculative; flags a command does not take keep the defaults. A `--recipe` names each layer's KV
    format."""
    recipe = read_recipe(args)
    return EngineConfig(kv_format=args.kv_cache, kv_memory=kv_memory, speculative=spec,
                        kv_layers=tuple(recipe.kv) if recipe is not None and recipe.kv else None,
                        max_num_seqs=getattr(args, "max_num_seqs", DEFAULTS.max_num_seqs),
                        max_model_len=getattr(args, "ctx_size", None),
                        cuda_graphs=False if getattr(args, "no_cuda_graphs", False) else None)


def load_model(ref, args, progress: bool | None = None):
    """The model the flags name: one process, or `--tp N` ranks (runtime/engine/tp.py)."""
    recipe = read_recipe(args)
    if getattr(args, "tp", 1) != 1:
        if recipe is not None:
            raise LowbitError("--recipe runs in one process: leave out --tp")
        from lowbit.runtime.engine.tp import load_tp

        return load_tp(ref, args.weights, args.tp, progress, args.device, args.dtype, args.threads)
    from lowbit.runtime.load.loader import load

    return load(ref, args.weights, progress=progress, device=args.device, dtype=args.dtype, recipe=recipe)


def load_served(args, kv_memory, progress: bool | None = None):
    """Load the model and build its engine → what the server serves (`lowbit serve`, `lowbit chat`)."""
    from lowbit.runtime.engine.engine import AsyncEngine, Engine
    from lowbit.runtime.engine.sampler import SamplingParams
    from lowbit.runtime.server.app import Served

    spec = parse_speculative(args.speculative)
    model_ref = args.model_pos or args.model
    lm = load_model(model_ref, args, progress)
    draft = load_draft(spec, lm, args.device, args.dtype)
    engine = Engine(lm.model, lm.tokenizer, engine_config(args, kv_memory, spec), draft_model=draft)
    if progress is not False:
        print(f"lowbit: {engine.describe_pool()}", file=sys.stderr, flush=True)
    names = getattr(args, "served_model_name", None) or [lm.path.name]
    sampling = sampling_defaults(args, lm.sampling, {})
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise LowbitError(f"sampling defaults: {e}") from None
    return Served(AsyncEngine(engine), lm.tokenizer, names[0], engine.max_model_len,
                  {"weights": lm.weights, "kv_cache": f"recipe {Path(args.recipe).name}" if getattr(args, "recipe", None)
                   else args.kv_cache, "device": str(lm.model.device),
                   "speculative": args.speculative}, tuple(names[1:]), getattr(args, "pooling", "mean"), sampling)
