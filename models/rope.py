"""Rotary position embedding tables, rotate-half convention (HF's). GGUF llama files are un-permuted
at load time to this convention, so there is one rotary code path (kernels/rotary.py applies it)."""

from __future__ import annotations

import math

import torch

from lowbit.models.config import LlamaConfig


def inv_frequencies(config: LlamaConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [D/2]. `freq_factors` is GGUF's rope_freqs tensor (llama3 files carry their scaling
    as per-frequency divisors); otherwise config.rope_scaling is applied as HF does."""
    D = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    if freq_factors is not None:
        return (inv / freq_factors.double()).float()
    s = config.rope_scaling
    if s is None:
        return inv.float()
    if s.kind == "linear":
        return (inv / s.factor).float()
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled).float()


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int [T] → cos, sin fp32 [T, D] (each frequency repeated for both halves)."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [T, D]
    return angles.cos().float(), angles.sin().float()
