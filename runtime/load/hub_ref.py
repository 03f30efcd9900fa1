"""`hf:ORG/REPO[:QUANT]` references and which files of a repo they name: pure functions over a file
list, no network (runtime/load/hub.py fetches what these pick).

A GGUF repo holds one file per quantization (`SmolLM2-135M-Instruct-Q4_K_M.gguf`, `model.q8_0.gguf`):
the ref's QUANT (default Q4_K_M) picks one by the quant token in its name. A repo with no GGUF but
config.json + *.safetensors is an HF directory: its config, tokenizer files and shards.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from lowbit.runtime.errors import LowbitError

PREFIX = "hf:"
DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's usual default: ~4.8 bits per weight, small loss
REF_SYNTAX = "hf:ORG/REPO[:QUANT]"
# A GGUF file name's quant token: Q4_0, Q4_K_M, IQ2_XXS, TQ1_0, Q4_0_4_4, F16, BF16, MXFP4 … bounded by
# a non-alphanumeric character (`-`, `.`, `_`) or the end, so `135M` or `Qwen2` never match.
QUANT_TOKEN = re.compile(
    r"(?<![A-Za-z0-9])((?:I?Q|TQ)\d(?:_(?:\d+|K|NL|XXS|XS|S|M|L|XL))*|BF16|F16|F32|MXFP4(?:_MOE)?)(?![A-Za-z0-9])",
    re.IGNORECASE)
SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)  # llama.cpp's gguf-split naming
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What lowbit's HF-directory loader reads besides the weights (runtime/load/safetensors.py, tokenizer.py).
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "chat_template.json")
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    quant: str | None  # None: Q4_K_M, else the repo's only GGUF
    revision: str = "main"

    def __str__(self) -> str:
        return f"{PREFIX}{self.repo_id}" + (f":{self.quant}" if self.quant else "")


def parse_ref(ref: str) -> HubRef:
    repo_id, colon, quant = ref.removeprefix(PREFIX).partition(":")
    if not REPO_ID.fullmatch(repo_id) or (colon and not quant):
        raise LowbitError(f"bad model reference {ref!r}: expected {REF_SYNTAX}, e.g. "
                          "hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M")
    return HubRef(repo_id, quant or None)



def quant_of(filename: str) -> str | None:
    """The quant token of a GGUF file name (the last one: `Llama-3-8B-Q4_K_M` → Q4_K_M), upper case."""
    found = QUANT_TOKEN.findall(Path(filename).name.removesuffix(".gguf").removesuffix(".GGUF"))
    return found[-1].upper() if found else None


def gguf_files(files: list[str]) -> list[str]:
    # mmproj-*.gguf are vision projectors shipped next to the language model, never the model itself
    return sorted(f for f in files if f.lower().endswith(".gguf") and not Path(f).name.lower().startswith("mmproj"))


def pick_gguf(files: list[str], ref: HubRef, where: str, only_fallback: bool = True) -> str:
    """The GGUF file `ref` names among `files`; `where` says whose list it is, for the error."""
    ggufs = gguf_files(files)
    want = ref.quant or DEFAULT_QUANT
    if want.lower().endswith(".gguf"):  # a file name, for repos whose names carry no quant token
        hits = [f for f in ggufs if f == want or Path(f).name == want]
    else:
        hits = [f for f in ggufs if quant_of(f) == want.upper()]
        if not hits:  # a token QUANT_TOKEN does not parse, bounded by `-`, `.` or `_`; or a prefix of
            # one (Q4_K matches Q4_K_M and Q4_K_S: ambiguous, and the error below says so)
            bounded = re.compile(rf"(?:^|[-._]){re.escape(want)}(?:[-._]|$)", re.IGNORECASE)
            hits = [f for f in ggufs if bounded.search(Path(f).name.removesuffix(".gguf"))]
    if not hits and ref.quant is None and only_fallback and len(ggufs) == 1:
        hits = ggufs
    parts = [f for f in hits if SPLIT_PART.search(f)]
    if parts and len(parts) == len(hits):
        n = int(SPLIT_PART.search(parts[0]).group(2))
        raise LowbitError(f"{ref}: {Path(parts[0]).name} is split into {n} files; lowbit loads single-file GGUFs "
                          "only (merge them with llama.cpp's `llama-gguf-split --merge`)")
    hits = [f for f in hits if f not in parts]
    if len(hits) > 1:
        raise LowbitError(f"{ref}: {len(hits)} GGUF files match {want} {where} ({', '.join(hits)}); "
                          f"name one as {PREFIX}{ref.repo_id}:FILE.gguf")
    if not hits:
        quants = sorted({quant_of(f) or Path(f).name for f in ggufs})
        raise LowbitError(f"{ref}: no {want} GGUF {where}; there: {', '.join(quants) or 'no GGUF files'} "
                          f"(pick one as {PREFIX}{ref.repo_id}:QUANT)")
    return hits[0]


def is_hf_dir(files: list[str]) -> bool:
    return "config.json" in files and any(f.endswith(".safetensors") and "/" not in f for f in files)


def shard_names(files: list[str], index: Path | None) -> list[str]:
    """The safetensors files to fetch: those the index names, else every top-level one (Mistral's
    own-format consolidated.safetensors skipped when HF-format files sit next to it)."""
    if index is not None:
        try:
            return sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise LowbitError(f"{index}: unreadable shard index ({type(e).__name__}: {e})") from None
    top = sorted(f for f in files if f.endswith(".safetensors") and "/" not in f)
    return [f for f in top if not f.startswith("consolidated")] or top
