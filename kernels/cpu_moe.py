"""A mixture of experts' experts in one C call (kernels/cpu_moe.c lowbit_moe_experts): given the normed
rows x [M, dim] and each row's k expert ids and weights (models/moe.py Experts.route),

    out[t] = sum over t's experts e, ascending, of w[t, e] * down_e(act(gate_up_e(x[t])))

in one OpenMP team. Why: the per-expert path in models/moe.py makes ~6 kernel calls and their Python per
expert (Qwen3-30B-A3B: 8 experts x 48 layers a token), which held decode to 0.67x llama.cpp on the same
file; this call is the same arithmetic, bit for bit (cpu_moe.c says how), so models/moe.py takes it
whenever every expert's weights are in lowbit's tiles and every row of the step is on the fast kernels.

Taken only where every expert's fused gate+up and down are tile layouts the C kernels read whole
(kernels/cpu_block.py `_linear`: int4, int8, GGML blocks in tiles, or chains of them), never the file's
GGML blocks as they are (kind 3 splits its work by rows); `fused_experts` returns None otherwise.
"""

from __future__ import annotations

import torch

from lowbit.kernels import cpu_native
from lowbit.kernels.cpu_block import _linear, _rows

ACTS = {"silu": 0, "swiglu_clamped": 2}  # cpu_kernels.h lowbit_moe.act


class FusedExperts:
    """A layer's experts as one descriptor, the ctypes arrays it points into, the packed weights and biases
    those point into (held so the pointers stay valid), and the C kernels that run it."""

    def __init__(self, desc: "cpu_native._Moe", held: list, native: "cpu_native.NativeKernels"):
        self.desc, self.held, self.native = desc, held, native

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x fp32 [M, dim] → (ids int64 [M, k], weights fp32 [M, k]), the largest first (cpu_router.c: the rule
        of the family, ties to the lower id), the very routing the fused decode block computes."""
        d = self.desc
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != d.dim:
            raise ValueError(f"cpu router: x {x.dtype} {tuple(x.shape)} for dim {d.dim}")
        x = x.contiguous()
        ids, weights = torch.empty(x.shape[0], d.k, dtype=torch.int64), torch.empty(x.shape[0], d.k)
        rc = self.native.moe_route(d, x, ids, weights)
        if rc:
            raise ValueError(f"cpu router failed with status {rc}")
        return ids, weights

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x fp32 [M, dim], ids int [M, k] (distinct per row), weights fp32 [M, k] → fp32 [M, dim]."""
        M, k = ids.shape
        d = self.desc
        if x.dtype != torch.float32 or tuple(x.shape) != (M, d.dim) or weights.shape != ids.shape:
            raise ValueError(f"cpu experts: x {x.dtype} {tuple(x.shape)}, ids {tuple(ids.shape)}, weights "
                             f"{tuple(weights.shape)} for dim {d.dim}")
        x, ids = x.contiguous(), ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty(M, d.dim)
        rc = self.native.moe_experts(d, x, ids, weights, out)
        if rc:
            raise ValueError(f"cpu experts failed with status {rc} ({M} rows, k={k} of {d.n_experts})")
        return out


RULES = {"softmax": 0, "topk_softmax": 1}  # cpu_kernels.h lowbit_moe.rule: models/moe.py Experts.route's


def fused_experts(dim: int, hidden: int, act: str, clamp: tuple[float, float] | None, experts: list[tuple],
                  router: tuple, *, native) -> FusedExperts | None:
    """experts: per expert ((gate+up packed weight [2 hidden, dim], fp32 bias or None), (down packed
    [dim, hidden], bias or None)); act: "silu" or "swiglu_clamped" (clamp: its (alpha, limit)); router:
    (weight fp32 [E, dim], bias fp32 [E] or None, k, rule "softmax" | "topk_softmax", norm_topk) → the C
    descriptor, or None without the C kernels or where a weight is in a layout it does not take."""
    rw, rb, k, rule, norm_topk = router
    if native is None or act not in ACTS or rule not in RULES or not experts or rw.dtype != torch.float32 \
            or not rw.is_contiguous() or tuple(rw.shape) != (len(experts), dim) or (rb is not None and (
                rb.dtype != torch.float32 or not rb.is_contiguous() or tuple(rb.shape) != (len(experts),))):
        return None
    gate_ups, downs = [], []
    for (gu, gb), (dw, db) in experts:
        g, d = _linear(gu, gb, native), _linear(dw, db, native)
        if g is None or d is None or g.kind == 3 or d.kind == 3 or (_rows(g), g.K) != (2 * hidden, dim) \
                or (_rows(d), d.K) != (dim, hidden):
            return None
        gate_ups.append(g)
        downs.append(d)
    E = len(experts)
    gu_arr, dn_arr = (cpu_native._Linear * E)(*gate_ups), (cpu_native._Linear * E)(*downs)
    alpha, limit = clamp if clamp is not None else (0.0, 0.0)
    desc = cpu_native._Moe(E, dim, hidden, ACTS[act], alpha, limit, gu_arr, dn_arr, rw.data_ptr(),
                           None if rb is None else rb.data_ptr(), k, RULES[rule], int(bool(norm_topk)))
    # the arrays, and what each descriptor points into: packed tensors, Segments (a chain's own copies), biases
    held = [gu_arr, dn_arr, rw, rb] + [t for pair in experts for w, b in pair for t in (w, b, *vars(w).values())
                               if t is not None]
    if native.moe_check(desc):
        return None
    return FusedExperts(desc, held, native)
