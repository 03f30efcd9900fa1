"""Rotary position embedding tables, rotate-half convention (HF's). GGUF llama files are un-permuted
at load time to this convention, so there is one rotary code path (kernels/rotary.py applies it).

Partial rotary (Phi-4-mini turns 3/4 of each head): transformers pairs (i, i + r/2) within the first r
dims and passes the rest through. The loaders reorder q/k rows within each head (`rotary_row_order`)
so those pairs sit at (j, j + D/2), the passed-through dims pair with each other there, and their
frequency is 0: cos 1, sin 0, which passes them through exactly. q·k is unchanged by reordering both.
"""

from __future__ import annotations

import math

import torch

from lowbit.models.config import LlamaConfig


def rotary_row_order(head_dim: int, rotary_dim: int | None) -> torch.Tensor | None:
    """int64 [head_dim]: row j of a head in lowbit's order is row order[j] in HF's; None when every dim
    rotates (the orders agree)."""
    D, r = head_dim, rotary_dim
    if r is None or r == D:
        return None
    if r % 2 or (D - r) % 2:
        raise ValueError(f"rotary dims {r} of head size {D}: both must be even")
    half, rest = r // 2, (D - r) // 2
    return torch.cat([torch.arange(half), r + torch.arange(rest),  # the pairs' first halves, then the rest's
                      half + torch.arange(half), r + rest + torch.arange(rest)])


def head_rows(order: torch.Tensor | None, n_heads: int) -> torch.Tensor | None:
    """A per-head order → rows of a [n_heads * head_dim, K] projection."""
    if order is None:
        return None
    D = order.numel()
    return (torch.arange(n_heads)[:, None] * D + order[None, :]).reshape(-1)


def inv_frequencies(config: LlamaConfig, freq_factors: torch.Tensor | None = None,
                    kind: str = "global") -> tuple[torch.Tensor, torch.Tensor]:
    """→ (inv_freq fp32 [D/2], cos/sin scale fp32 [D/2]) for the layers of one rotary kind: "global"
    (config.rope_theta and its scaling) or "local" (Gemma 3's windowed layers: rope_local_theta,
    unscaled). `freq_factors` is the file's per-frequency divisors (GGUF rope_freqs for llama3 files,
    rope_factors_short for LongRoPE); otherwise config.rope_scaling is applied as transformers does."""
    D = config.head_dim
    r = config.rotary_dim or D
    theta = config.rope_local_theta if kind == "local" else config.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r))  # [r/2]
    s = None if kind == "local" else config.rope_scaling
    if freq_factors is not None:
        inv = inv / freq_factors.double()
    elif s is not None and s.kind == "longrope":
        inv = inv / torch.tensor(s.short_factor, dtype=torch.float64)
    elif s is not None and s.kind == "linear":
        inv = inv / s.factor
    elif s is not None and s.kind == "llama3":
        inv = _llama3(inv, s)
    elif s is not None and s.kind == "yarn":
        inv = _yarn(inv, s, theta, r)
    scale = torch.full((D // 2,), s.attention_factor if s is not None else 1.0, dtype=torch.float32)
    out = torch.zeros(D // 2, dtype=torch.float64)
    out[: r // 2] = inv
    scale[r // 2:] = 1.0  # passed-through dims: angle 0, unscaled
    return out.float(), scale


def _llama3(inv: torch.Tensor, s) -> torch.Tensor:
    """Keep high frequencies, divide low ones by `factor`, blend in between."""
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(inv: torch.Tensor, s, theta: float, dim: int) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters): frequencies that turn more than beta_fast times
    over the original context keep their value, those under beta_slow are divided by `factor`, a linear
    ramp in between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by factor)
    return inv / s.factor * (1 - keep) + inv * keep


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor,
                scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int [T] → cos, sin fp32 [T, D] (each frequency repeated for both halves), times
    `scale` [D/2] (yarn's and LongRoPE's attention factor) where given."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, D/2]
    cos, sin = angles.cos(), angles.sin()
    if scale is not None:
        cos, sin = cos * scale.double(), sin * scale.double()
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # [T, D]
    return cos.float(), sin.float()
