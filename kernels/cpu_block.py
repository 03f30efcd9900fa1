"""One Llama block of a decode-sized step in two C calls (kernels/cpu_block.c), around attention:

    pre:  residual += delta; h = rms_norm(residual); qkv = h @ Wqkv^T (+ b); rotary on q, k
    post: residual += attn @ Wo^T; h = rms_norm(residual); delta = (silu(h Wg^T) * (h Wu^T)) @ Wd^T

Why: on CPU a single-token step of the default model ran ~130 small torch ops per layer, and their
dispatch and Python took ~24 of the ~38 ms a token cost — more than the matmuls (~16 ms). The two
calls run the same C functions as the CPU backend's standalone ops (kernels/rms_norm.py, rotary.py,
silu_mul.py `*_cpu`) and the same matmul kernel as a fast QuantLinear, so a row computed here equals,
bit for bit, the row the unfused path computes; the model uses this form only for steps whose
matmuls are all on the fast kernel (models/llama.py).

Taken only where the C kernels build and every weight of the block is in one of lowbit's tile layouts
(int4, int8, GGML blocks in tiles, or runs of them: kernels/segments.py) or the file's GGML blocks, with
no padding rows or columns and no input permutation (act-order GPTQ), QKV and gate/up each fused into
one matrix (what the default model's GGUF gives); otherwise `fused_block` returns None and the block
runs op by op.
"""

from __future__ import annotations

import ctypes

import torch

from lowbit.kernels import cpu_native
from lowbit.kernels.ggml_mm import GgmlPacked
from lowbit.kernels.int4_mm import Int4Packed
from lowbit.kernels.int8_mm import Int8Packed
from lowbit.kernels.kq_mm import KqPacked
from lowbit.kernels.segments import Segments


def _linear(w, bias: torch.Tensor | None, native) -> "cpu_native._Linear | None":
    if getattr(w, "in_perm", None) is not None:  # input columns permuted (act-order GPTQ): the C block reads x
        return None  # in order, so such a layer runs through QuantLinear.forward (quant/linear.py)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    if isinstance(w, GgmlPacked) and w.native is native:  # GGML blocks as the file has them (kernels/cpu_ggml.c)
        d = w.c_desc()
        return cpu_native._Linear(d.kind, d.N, d.K, d.group, d.P, d.data, bias.data_ptr() if bias is not None else None,
                                  d.split, d.P2, d.data2)
    if not isinstance(w, (Int4Packed, Int8Packed, KqPacked, Segments)) or w.native is not native:
        return None  # one set of kernels per block
    Np, Kp = w.padded_shape
    if Np != w.out_features or Kp != w.in_features:
        return None
    d = w.c_desc()  # a chain's head points at the Segments' own copies, which the block holds through w
    return cpu_native._Linear(d.kind, d.N, d.K, d.group, d.P, d.data, bias.data_ptr() if bias is not None else None,
                              0, 0, None, d.next)


def _rows(d: "cpu_native._Linear") -> int:
    """Output rows of a descriptor and the runs chained after it (kernels/segments.py)."""
    n = d.N
    while d.next:
        d = d.next.contents
        n += d.N
    return n


class FusedBlock:
    """A block's descriptor, the tensors and packed weights it points into (held so the pointers stay
    valid: a chain's descriptors live in its Segments) and the C kernels that run it."""

    def __init__(self, desc: "cpu_native._Block", held: list, native: "cpu_native.NativeKernels",
                 sinks: torch.Tensor | None = None):
        self.desc, self.held, self.native = desc, held, native
        self.sinks = sinks  # fp32 [H] the descriptor points at (a one-call step's attention reads it), or None
        d = desc
        self.dim, self.width = d.dim, (d.n_heads + 2 * d.n_kv_heads) * d.head_dim

    def pre(self, delta: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """delta fp32 [M, dim], residual fp32 [M, dim] (updated in place) or None (first block), cos/sin
        fp32 [M, D] → (qkv fp32 [M, (H + 2 Hkv) D] with q and k rotated, residual)."""
        M = _check_rows(delta, cos, sin, self.dim, self.desc.head_dim)
        has_res = residual is not None
        if has_res:
            _check("residual", residual, (M, self.dim))
        else:
            residual = torch.empty(M, self.dim)
        qkv = torch.empty(M, self.width)
        rc = self.native.block_pre(self.desc, M, delta, residual, has_res, cos, sin, qkv)
        if rc:
            raise RuntimeError(f"cpu fused block (pre) failed with status {rc}")
        return qkv, residual

    def post(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn fp32 [M, H D], residual fp32 [M, dim] (updated in place) → delta fp32 [M, dim]."""
        M = attn.shape[0]
        _check("attn", attn, (M, self.desc.n_heads * self.desc.head_dim))
        _check("residual", residual, (M, self.dim))
        delta = torch.empty(M, self.dim)
        rc = self.native.block_post(self.desc, M, attn, residual, delta)
        if rc:
            raise RuntimeError(f"cpu fused block (post) failed with status {rc}")
        return delta


def _check_rows(delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int, head_dim: int) -> int:
    """A step's input rows: delta fp32 [M, dim], cos/sin fp32 [M, D] → M."""
    M = delta.shape[0]
    _check("delta", delta, (M, dim))
    for name, t in (("cos", cos), ("sin", sin)):
        _check(name, t, (M, head_dim))
    return M


def _check(name: str, t: torch.Tensor, shape: tuple) -> None:
    if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"cpu fused block: {name} must be contiguous fp32 {list(shape)} on CPU, got "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")


def fused_block(dims: tuple[int, int, int, int, int], eps: float, attn_norm: torch.Tensor, ffn_norm: torch.Tensor,
                qkv: tuple, o: tuple, gate_up: tuple, down: tuple, qk_norms: tuple | None = None,
                post_norms: tuple | None = None, gelu: bool = False, rope: int = 0, window: int | None = None,
                sinks: torch.Tensor | None = None, moe=None, *, native) -> FusedBlock | None:
    """dims = (dim, n_heads, n_kv_heads, head_dim, hidden); norms fp32 [dim]; each weight a (packed
    layout, fp32 bias or None) pair, QKV and gate/up already fused along N; qk_norms: (q, k) fp32
    [head_dim] norms over each head (Qwen3, Gemma) or None; post_norms: Gemma's (attention output,
    MLP output) norms fp32 [dim] or None; gelu: GeGLU instead of SwiGLU; rope, window: the block's
    rotary table (an index into a one-call step's tables) and sliding window; sinks: the layer's attention
    sinks, contiguous fp32 [n_heads] (gpt-oss), or None — the same tensor the step's PagedAttention is given
    for the layer; moe: a mixture of experts in place of the gated MLP (kernels/cpu_moe.py FusedExperts, whose
    router and experts the block runs; gate_up and down are then (None, None) and `hidden` the experts' own);
    native: the C kernels → a FusedBlock, or None without them or when a weight is in a layout they do not
    read whole."""
    if native is None:
        return None
    dim, H, Hkv, D, hidden = dims
    cpu_native.check_sinks(sinks, H, "cpu fused block")  # a bug in the caller, not a layout to decline
    if moe is not None and (moe.native is not native or moe.desc.dim != dim or moe.desc.hidden != hidden):
        return None
    mlp = (gate_up, down) if moe is None else ()
    linears = [_linear(*p, native) for p in (qkv, o, *mlp)]
    shapes = [((H + 2 * Hkv) * D, dim), (dim, H * D), (2 * hidden, dim), (dim, hidden)]
    if any(l is None or (_rows(l), l.K) != s for l, s in zip(linears, shapes)):
        return None
    linears += [cpu_native._Linear(), cpu_native._Linear()] if moe is not None else []  # unread: the block's moe
    for t in (attn_norm, ffn_norm, *(post_norms or ())):
        if t.dtype != torch.float32 or t.shape != (dim,) or not t.is_contiguous():
            return None
    qk = qk_norms or ()
    if any(t.dtype != torch.float32 or t.shape != (D,) or not t.is_contiguous() for t in qk) or D > 512:
        return None  # 512: cpu_block.c's LOWBIT_MAX_HEAD_DIM
    post = post_norms or ()
    desc = cpu_native._Block(dim, H, Hkv, D, hidden, eps, attn_norm.data_ptr(), ffn_norm.data_ptr(), *linears,
                             *((t.data_ptr() for t in qk) if qk else (None, None)),
                             *((t.data_ptr() for t in post) if post else (None, None)), int(gelu), rope, window or 0,
                             None if sinks is None else sinks.data_ptr(),
                             None if moe is None else ctypes.pointer(moe.desc))
    held = [attn_norm, ffn_norm, *qk, *post] + [t for w, b in (qkv, o, *mlp) for t in (*vars(w).values(), b)
                                                if isinstance(t, torch.Tensor)] + [w for w, _ in (qkv, o, *mlp)] + [moe]
    return FusedBlock(desc, held, native, sinks)


class FusedLayers:
    """Every block of a model as FusedBlocks, for a step whose rows are all single-token queries in one
    C call over the paged pool (cpu_block.c lowbit_decode_paged_layers: the per-block calls and the C
    paged decode attention, in the per-block path's order, so the logits are bit-identical to it)."""

    def __init__(self, blocks: list[FusedBlock]):
        self.blocks, self.native = blocks, blocks[0].native
        self.array = (cpu_native._Block * len(blocks))(*[b.desc for b in blocks])  # copies of the descriptors
        self.dim = blocks[0].dim
        self.sinks = [b.sinks for b in blocks]  # per layer fp32 [H] or None, as the descriptors point at them
        self._sides = None  # (k sides, v sides, their ctypes arrays) of the pool last stepped over

    def _side_arrays(self, k_sides: list, v_sides: list, D: int):
        """The pool's per-layer descriptors, built on the first step over a pool and kept while steps
        keep coming over the same one (60 sides took ~0.3 ms a step to describe). A pool hands out one
        KVSide object per layer and side for its lifetime, so the same objects mean the same tensors."""
        held = self._sides
        if held is None or len(held[0]) != len(k_sides) or any(
                a is not b for a, b in zip(held[0] + held[1], k_sides + v_sides)):
            held = self._sides = (list(k_sides), list(v_sides), self.native.side_array(k_sides, D),
                                  self.native.side_array(v_sides, D))
        return held[2], held[3]

    def decode_paged(self, delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                     page_size: int, k_sides: list, v_sides: list, write_rot: torch.Tensor | None,
                     attn_rot: torch.Tensor | None, c_args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step of one-token rows over the paged pool in one C call (cpu_block.c
        lowbit_decode_paged_layers): delta fp32 [M, dim] (the embeddings; overwritten), cos/sin fp32
        [K, M, D] (the K rotary tables the blocks index: `rope`), slots int64 [M], the pool's page size
        and its KVSides per layer, c_args = (ctx, tables, toff) int64 as models/attention.py plans them
        → (last block's output, residual). Each block's sliding window is in its descriptor."""
        d = self.blocks[0].desc
        if cos.dim() != 3 or cos.shape != sin.shape or max(b.desc.rope for b in self.blocks) >= cos.shape[0]:
            raise ValueError(f"cpu fused layers: rotary tables {tuple(cos.shape)} do not cover the blocks' kinds")
        M = _check_rows(delta, cos[0], sin[0], self.dim, d.head_dim)
        if not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("cpu fused layers: the rotary tables must be contiguous")
        ctx, tables, toff = c_args
        if not (slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (M,) and len(k_sides) ==
                len(v_sides) == len(self.blocks) and ctx.shape == toff.shape == (M,)):
            raise ValueError(f"cpu fused layers: unsupported paged step of {M} rows")
        residual = torch.empty(M, self.dim)
        ks, vs = self._side_arrays(k_sides, v_sides, d.head_dim)
        rc = self.native.decode_paged_layers(self.array, M, delta, residual, cos, sin, slots, page_size, ks, vs,
                                         write_rot, attn_rot, ctx, tables, toff, d.head_dim)
        if rc:
            raise ValueError(f"cpu fused layers (paged) failed with status {rc}")
        return delta, residual
