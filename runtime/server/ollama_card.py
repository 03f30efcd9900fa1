"""The served model described as Ollama describes its models: the entries of /api/tags and /api/ps
and the card of /api/show (size, digest, details, model_info, capabilities), computed once per
served model (`Frontend.memo`): walking the tensors for their bytes is not per-request work."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone

from lowbit.runtime.server.frontend import Frontend, Served
from lowbit.runtime.server.harmony import is_harmony
from lowbit.runtime.server.reply import think_tags

# lowbit's weight layouts as the GGUF quantization names Ollama's clients show
_QUANT_NAMES = {"int4-g32": "Q4_1", "int4-sym-g32": "Q4_0", "int8-g32": "Q8_0", "f16": "F16", "bf16": "BF16",
                "f32": "F32"}


def iso_time(t: float) -> str:
    """Ollama's timestamps: UTC, microseconds, a Z."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Card:
    """What /api/tags, /api/show and /api/ps say about the served model (computed once)."""

    size: int
    digest: str
    details: dict
    model_info: dict
    modified_at: str


def card(fe: Frontend, served: Served) -> Card:
    return fe.memo("ollama card", served, lambda: _card(served, iso_time(fe.started)))


def entries(fe: Frontend, served: Served) -> list[dict]:
    """The served model under each of its names, as /api/tags and /api/ps list models."""
    c = card(fe, served)
    return [{"name": n, "model": n, "modified_at": c.modified_at, "size": c.size, "digest": c.digest,
             "details": c.details} for n in (served.model_name, *served.aliases)]


def capabilities(served: Served) -> list[str]:
    caps = ["completion", "tools", "embedding"]
    template = getattr(served.tokenizer, "chat_template", None)
    if think_tags(template) is not None or is_harmony(template):  # harmony: its analysis channel
        caps.append("thinking")
    return caps


def model(served: Served):
    return served.engine.engine.model


def _card(served: Served, since: str) -> Card:
    m = model(served)
    c = getattr(m, "config", None)
    arch = getattr(c, "arch", "llama")
    size = _weight_bytes(m)
    info = {"general.architecture": arch, f"{arch}.context_length": served.max_model_len}
    details = {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
               "parameter_size": "", "quantization_level": _quantization(m)}
    if c is not None:
        n = _parameter_count(c)
        details["parameter_size"] = _human_number(n)
        info.update({"general.parameter_count": n, f"{arch}.embedding_length": c.dim,
                     f"{arch}.block_count": c.n_layers, f"{arch}.feed_forward_length": c.hidden_dim,
                     f"{arch}.attention.head_count": c.n_heads, f"{arch}.attention.head_count_kv": c.n_kv_heads,
                     f"{arch}.attention.key_length": c.head_dim, f"{arch}.attention.value_length": c.head_dim,
                     f"{arch}.attention.layer_norm_rms_epsilon": c.norm_eps, f"{arch}.rope.freq_base": c.rope_theta,
                     f"{arch}.vocab_size": c.vocab_size})
        # what a token costs, beside what the model has: a mixture of experts reads k of its E experts
        info["lowbit.active_parameter_count"] = c.parameters()[1]
        if hasattr(m, "bytes_per_token"):
            info["lowbit.weight_bytes_per_token"] = m.bytes_per_token()
        if c.n_experts:
            info.update({f"{arch}.expert_count": c.n_experts, f"{arch}.expert_used_count": c.n_experts_used,
                         f"{arch}.expert_feed_forward_length": c.expert_hidden_dim})
    # not a file's hash (the server knows no file): an id of what is served, stable while it runs
    digest = hashlib.sha256(json.dumps([served.model_name, size, served.formats], sort_keys=True,
                                       default=str).encode()).hexdigest()
    return Card(size, digest, details, info, since)


def _weight_bytes(model) -> int:
    """Bytes held by the model's tensors (shared ones once), the `size` Ollama reports."""
    seen, total = set(), 0
    for b in list(model.buffers()) + list(model.parameters()):
        if b.data_ptr() not in seen:
            seen.add(b.data_ptr())
            total += b.numel() * b.element_size()
    return total


def _parameter_count(c) -> int:
    return c.parameters()[0]


def _human_number(n: int) -> str:
    """Ollama's parameter_size spelling: 8B, 7.6B, 134.52M, 30K."""
    for unit, scale, digits in (("B", 1e9, 1), ("M", 1e6, 2)):
        if n >= scale:
            x = n / scale
            return f"{x:.0f}{unit}" if x == int(x) else f"{x:.{digits}f}{unit}"
    return f"{n / 1e3:.0f}K" if n >= 1000 else str(n)


def _quantization(model) -> str:
    """The layout holding most of the weights' bytes, in GGUF's name where one matches."""
    held: Counter = Counter()
    for m in model.modules():
        name = getattr(m, "spec_name", None)
        if name:
            held[name] += sum(b.numel() * b.element_size() for b in m.buffers())
    if not held:
        return "unknown"
    name = held.most_common(1)[0][0]
    return _QUANT_NAMES.get(name, name)
