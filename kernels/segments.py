"""A weight whose output rows come in runs of different layouts, multiplied as one: a fused QKV whose V
rows have another GGML type (llama.cpp's Q4_K_M gives attn_v Q6_K in some layers, Q4_K for Q and K),
or a gate+up of two types. Each run is packed as its type's tiles (kernels/int4_mm.py, int8_mm.py,
kq_mm.py) and the C kernels chain their descriptors (cpu_kernels.h lowbit_linear `next`), so the fused
decode block still makes one call per matmul and a thread's share of the tiles runs straight across
the runs. Every run but the last holds a whole number of 16-row tiles, so the runs' outputs are
adjacent in y.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from lowbit.kernels import cpu_native
from lowbit.kernels.tile_layout import TILE


@dataclass
class Segments:
    parts: list  # packed runs in row order (Int4Packed, Int8Packed, KqPacked), each holding `native`
    matmuls: list  # each run's (x, packed, exact) → y fp32 [M, its N]
    native: object = field(default=None, repr=False, compare=False)
    desc: object = field(default=None, repr=False, compare=False)  # the head of the chain, built once
    _chain: list = field(default_factory=list, repr=False, compare=False)  # the descriptors it links

    def __post_init__(self):
        for p in self.parts[:-1]:
            if p.out_features % TILE or p.padded_shape[0] != p.out_features:
                raise ValueError(f"segments: a run of {p.out_features} rows before the last one is not whole "
                                 f"{TILE}-row tiles")

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def padded_shape(self) -> tuple[int, int]:
        return sum(p.padded_shape[0] for p in self.parts), self.parts[0].padded_shape[1]

    def c_desc(self) -> "cpu_native._Linear":
        """Copies of the runs' descriptors, each pointing at the next."""
        if self.desc is None:
            chain = [cpu_native._Linear() for _ in self.parts]
            for c, p in zip(chain, self.parts):
                ctypes.pointer(c)[0] = p.c_desc()  # a copy: the run's own descriptor stays unchained
            for c, nxt in zip(chain, chain[1:]):
                c.next = ctypes.pointer(nxt)
            self._chain, self.desc = chain, chain[0]
        return self.desc

    def matmul(self, x: torch.Tensor, exact: bool | None) -> torch.Tensor:
        """x [M, K] → y fp32 [M, N]: the C kernels over the chain, or each run's own exact path."""
        if exact or x.shape[0] == 0:
            return torch.cat([mm(x, p, True) for mm, p in zip(self.matmuls, self.parts)], dim=-1)
        y = self.native.linear_mm(x.float().contiguous(), self.c_desc())
        return y[:, :self.out_features] if y.shape[1] != self.out_features else y
