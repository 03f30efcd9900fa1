"""The model's own sampling defaults: what its authors tuned it to sample with, for requests that omit them.

Small models loop at OpenAI's temperature 1.0 where their cards say 0.6-0.7 (Qwen3: 0.6, top_p 0.95,
top_k 20); vLLM, Ollama and tabbyAPI apply these values (tabbyAPI #316, mlx-vlm #1331). They come from
the HF directory's generation_config.json, or GGUF's general.sampling.* keys (llama.cpp's converter
writes them from the same file). vLLM's reading is followed: the values are taken whatever `do_sample`
says, since a client that omits temperature asks for the model's behaviour, not for greedy decoding.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

# generation_config.json's names → SamplingParams' (runtime/engine/sampler.py)
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty"}
# GGUF's general.sampling.* → SamplingParams'
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
# what each may hold to be used (a value outside is dropped, not an error: the model still loads)
VALID = {"temperature": lambda v: 0 <= v < math.inf, "top_p": lambda v: 0 < v <= 1,
         "top_k": lambda v: v >= 0 and float(v).is_integer(), "min_p": lambda v: 0 <= v < 1,
         "repetition_penalty": lambda v: 0 < v < math.inf}


def _valid(name: str, value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and VALID[name](value)


def _kept(pairs) -> dict:
    out = {name: value for name, value in pairs if _valid(name, value)}
    if "top_k" in out:
        out["top_k"] = int(out["top_k"])
    return out


def hf_defaults(model_dir: Path) -> dict:
    """{SamplingParams field: value} from model_dir/generation_config.json ({} without one)."""
    try:
        cfg = json.loads((Path(model_dir) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    return _kept((name, cfg.get(key)) for key, name in HF_KEYS.items())


def gguf_defaults(metadata: dict) -> dict:
    """{SamplingParams field: value} from a GGUF's general.sampling.* keys ({} without them). GGUF holds them
    as float32 (0.6 reads 0.6000000238): 7 significant digits give back the value that was written."""
    def value(v):
        return float(f"{v:.7g}") if isinstance(v, float) else v

    return _kept((name, value(metadata.get(key))) for key, name in GGUF_KEYS.items())
