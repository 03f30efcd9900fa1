"""lowbit's C kernels for the CPU path, built on first use into one library and called through ctypes:
the decode-sized matmul over lowbit's packed int4/int8 layouts and the exact path's weight tiles
(kernels/cpu_wq_mm.c, with the integer inner loops of kernels/cpu_wq_tiles.c compiled once per
instruction set); the small per-row ops of a block, its two fused halves, and a whole decode step
in one call over the paged pool (kernels/cpu_block.c, driven by kernels/cpu_block.py); attention
straight from the paged quantized pool, and quantize-on-write (kernels/cpu_attention.c); a mixture of
experts' router and experts in one call, alone or inside the fused block (kernels/cpu_moe.c, cpu_router.c,
driven by kernels/cpu_moe.py). The files
share their structs through kernels/cpu_kernels.h, which also declares every export.

The ABI: ctypes trusts whatever it is told, so a struct field added on one side only would corrupt
memory silently. `load` therefore checks the library against this module before binding it — its
LOWBIT_ABI_VERSION against ABI_VERSION (the exports' signatures, which ctypes cannot see), and the
sizeof of each struct in ABI_STRUCTS and every field's offset and size against the C compiler's
(lowbit_abi_layout) — and raises AbiMismatch, one line naming what differs, where they disagree.

Why C, in a package otherwise made of torch and Triton: torch's CPU weight-only kernels take bf16
activations, cost more with every row (speculative verification and batched decoding feed them 1 + k
and 16 rows), and read a private packed layout that differs between torch's AVX2 and AVX-512 builds.
lowbit's kernels read its own layouts (kernels/int4_mm.py, int8_mm.py), round activations to 16-bit
codes per block of 32 (kernels/act_quant.py: decode within mean KL ~5e-8 of the exact pass) and sum
each block exactly in integers, so a row's result does not depend on the other rows of a call nor on
the instruction set (tests/test_cpu_native.py checks both bit for bit). Everything but the matmul
exists because, once the matmul was in C, a single-token step spent most of its time on ~130 small
torch ops per layer and their Python; docs/perf.md has each piece's measured effect.

Instruction sets (`ISAS`): AVX2 + FMA + F16C (every x86-64 CPU lowbit runs on), 256-bit VNNI
(AVX-VNNI, or AVX-512 VL's encoding), AVX-512 VNNI. The build compiles the ones this CPU has and the
library picks the best at run time; `NativeKernels.with_isa` (and LOWBIT_NATIVE=avx2 | vnni256 |
avx512) runs another. No -march=native: a file built for AVX2 must not pick up AVX-512.

Building: `cc -O3 -mavx2 -mfma -mf16c -fopenmp` (plus each instruction set's flags for its copy of
cpu_wq_tiles.c) into the user cache directory (platformdirs), keyed by the sources, the compiler and
the CPU's flags, so a new source or another CPU rebuilds (~5 s on this project's 2-core machine,
once; the copies compile side by side). OpenMP: torch's wheel ships `libgomp.so.1` and has loaded it
before this library is opened, so both share one OpenMP runtime and its thread pool (two runtimes
would spin against each other on 2 cores).

Without a C compiler, without AVX2/FMA/F16C, or with LOWBIT_NATIVE=0 (side-by-side benchmarks),
`native()` returns None and every matmul takes the plain-torch exact path: the reference's numbers,
much slower (~0.4 s a token on the default model, 2 cores).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.kernels.kv_side import KVSide

SOURCES = [Path(__file__).with_name(n) for n in ("cpu_wq_mm.c", "cpu_kq.c", "cpu_ggml.c", "cpu_block.c",
                                                 "cpu_attention.c", "cpu_moe.c", "cpu_router.c",
                                                 "cpu_gated_delta.c")]
# compiled once per instruction set (ISAS): the int4/int8 tiles and the GGML blocks in tiles
TILES = [Path(__file__).with_name(n) for n in ("cpu_wq_tiles.c", "cpu_kq_tiles.c")]
HEADER = Path(__file__).with_name("cpu_kernels.h")  # the structs and every export's prototype
TILES_HEADER = Path(__file__).with_name("cpu_tiles.h")  # what the tile files share
# x86-64-v3's vector sets for everything; the tile kernels add their own. No -march=native: a file
# compiled for AVX2 must not pick up AVX-512 from the compiler, so the AVX2 kernels are the ones an
# AVX2-only machine runs, and every variant gives the same bits (tests/test_cpu_native.py).
# -Werror=missing-prototypes: every export needs its prototype in cpu_kernels.h, the one header.
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-mbmi2", "-mtune=native", "-fopenmp", "-fPIC", "-std=c11",
          "-Werror=missing-prototypes"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]


@dataclass(frozen=True)
class Isa:
    """One build of cpu_wq_tiles.c: its number in cpu_kernels.h, the CPU flags (/proc/cpuinfo) it
    needs, and its compiler flags."""

    name: str
    number: int
    needs: tuple[tuple[str, ...], ...]  # any one of these sets of flags
    flags: tuple[tuple[str, ...], ...]  # the compiler flags for the matching set


ISAS = (
    Isa("avx2", 1, (("avx2", "fma", "f16c", "bmi2"),), ((),)),
    # VNNI on 256-bit vectors: AVX-VNNI (VEX) where the CPU has it, else AVX-512 VL's encoding of it
    Isa("vnni256", 2, (("avx_vnni",), ("avx512_vnni", "avx512vl", "avx512bw", "avx512f")),
        (("-mavxvnni",), tuple(_AVX512))),
    Isa("avx512", 3, (("avx512_vnni", "avx512vl", "avx512bw", "avx512f"),), (tuple(_AVX512),)),
)


class _Linear(ctypes.Structure):
    """cpu_kernels.h's lowbit_linear: one weight in lowbit's packed CPU layout; `next` the rows after its
    own in another layout (kernels/segments.py)."""


_Linear._fields_ = [("kind", ctypes.c_int64), ("N", ctypes.c_int64), ("K", ctypes.c_int64),
                    ("group", ctypes.c_int64), ("P", ctypes.c_int64), ("data", ctypes.c_void_p),
                    ("bias", ctypes.c_void_p), ("split", ctypes.c_int64), ("P2", ctypes.c_int64),
                    ("data2", ctypes.c_void_p), ("next", ctypes.POINTER(_Linear))]


class _Ctx(ctypes.Structure):
    """cpu_kernels.h's lowbit_ctx: a call's instruction set and thread count."""
    _fields_ = [("isa", ctypes.c_int64), ("nthreads", ctypes.c_int64)]


class _Moe(ctypes.Structure):
    """cpu_moe.c's lowbit_moe: a mixture of experts' shapes, activation, per-expert weights (arrays of E) and
    router (cpu_router.c)."""
    _fields_ = [("n_experts", ctypes.c_int64), ("dim", ctypes.c_int64), ("hidden", ctypes.c_int64),
                ("act", ctypes.c_int64), ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
                ("gate_up", ctypes.POINTER(_Linear)), ("down", ctypes.POINTER(_Linear)),
                ("router", ctypes.c_void_p), ("router_bias", ctypes.c_void_p), ("k", ctypes.c_int64),
                ("rule", ctypes.c_int64), ("norm_topk", ctypes.c_int64)]


class _Block(ctypes.Structure):
    """cpu_block.c's lowbit_block: one block's shapes, norms and weights, its attention sinks (gpt-oss) and
    its mixture of experts (NULL for a dense MLP)."""
    _fields_ = [("dim", ctypes.c_int64), ("n_heads", ctypes.c_int64), ("n_kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("hidden", ctypes.c_int64), ("eps", ctypes.c_float),
                ("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("attn_post_norm", ctypes.c_void_p), ("ffn_post_norm", ctypes.c_void_p), ("act", ctypes.c_int64),
                ("rope", ctypes.c_int64), ("window", ctypes.c_int64), ("sinks", ctypes.c_void_p),
                ("moe", ctypes.POINTER(_Moe))]


class _KVSide(ctypes.Structure):
    """cpu_attention.c's lowbit_kv_side: one side of one layer of the paged pool."""
    _fields_ = [("bits", ctypes.c_int64), ("group", ctypes.c_int64), ("codes", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p)]


# The structs that cross into C, by their names in cpu_kernels.h (`check_abi` compares each with C).
ABI_STRUCTS = (("lowbit_linear", _Linear), ("lowbit_ctx", _Ctx), ("lowbit_block", _Block), ("lowbit_kv_side", _KVSide),
               ("lowbit_moe", _Moe))
ABI_VERSION = 8  # cpu_kernels.h's LOWBIT_ABI_VERSION: the exports as NativeKernels binds them


class AbiMismatch(Exception):
    """The library and this module disagree on the ABI (cpu_kernels.h against the mirrors and
    argtypes here). Deliberately not a RuntimeError, OSError or ValueError: `native()` turns those
    into the plain-torch fallback (a machine without a compiler, a failed build), but a mismatch is a
    bug in the sources — the cache key covers them, so no stale library causes it — and falling back
    would hide it behind one warning and a slower decode."""


class NativeKernels:
    """The loaded library and the instruction set its matmuls run on (the best the CPU has, unless
    `with_isa` chose another); methods check shapes, allocate the output and call in."""

    def __init__(self, lib: ctypes.CDLL, isa: str | None = None, sides: dict | None = None):
        self.lib = lib
        self._sides = {} if sides is None else sides  # a pool side's descriptor, built once (~4 us each)
        self._rot_signs: dict = {}  # a KV rotation's signs, checked once (`_signs`)
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        lib.lowbit_isa_available.argtypes, lib.lowbit_isa_available.restype = [i64], ctypes.c_int
        lib.lowbit_isa_best.restype = i64
        self.isas = [i.name for i in ISAS if lib.lowbit_isa_available(i.number)]  # built and runnable here
        number = lib.lowbit_isa_best() if isa is None else next((i.number for i in ISAS if i.name == isa), 0)
        if not lib.lowbit_isa_available(number):
            raise ValueError(f"instruction set {isa!r} is not in this build of lowbit's C kernels "
                             f"(it has: {', '.join(self.isas)})")
        self.isa = next(i.name for i in ISAS if i.number == number)
        self.ctx = _Ctx(number, 1)
        ctxp, lin = ctypes.POINTER(_Ctx), ctypes.POINTER(_Linear)
        lib.lowbit_linear_mm.argtypes = [ctxp, lin, ptr, i64, ptr]
        lib.lowbit_linear_rows.argtypes, lib.lowbit_linear_rows.restype = [lin], i64
        lib.lowbit_int4_dequant_t.argtypes = [lin, i64, i64, ptr, ctypes.c_int]
        lib.lowbit_int8_dequant.argtypes = [lin, i64, i64, ptr, ctypes.c_int]
        lib.lowbit_int8_rows.argtypes = [lin, ptr, i64, ptr]
        lib.lowbit_ggml_dequant.argtypes = [lin, i64, i64, ptr, ctypes.c_int]
        lib.lowbit_tiles_pack.argtypes = [i64, ptr, ctypes.c_int, i64, ptr, i64, i64, ptr, ctypes.c_int]
        lib.lowbit_kq_rows.argtypes = [lin, ptr, i64, ptr]
        lib.lowbit_kq_dequant.argtypes = [lin, i64, i64, ptr, ctypes.c_int]
        lib.lowbit_add_rms_norm.argtypes = [ptr, i64, ptr, ctypes.c_int, ptr, f32, i64, i64, ptr]
        lib.lowbit_rotary.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr]
        lib.lowbit_silu_mul.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr]
        lib.lowbit_gelu_tanh_mul.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr]
        lib.lowbit_swiglu_clamped.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, f32, f32]
        lib.lowbit_gated_delta_prep.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_int, f32, ptr,
                                                ptr, ptr]
        lib.lowbit_gated_delta_rule.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr, ptr]
        moe = ctypes.POINTER(_Moe)
        lib.lowbit_moe_check.argtypes = [ctxp, moe]
        lib.lowbit_moe_experts.argtypes = [ctxp, moe, i64, ptr, i64, ptr, ptr, ptr]
        lib.lowbit_moe_route.argtypes = [ctxp, moe, i64, ptr, ptr, ptr]
        blk = ctypes.POINTER(_Block)
        lib.lowbit_block_pre.argtypes = [ctxp, blk, i64, ptr, ptr, ctypes.c_int, ptr, ptr, ptr]
        lib.lowbit_block_post.argtypes = [ctxp, blk, i64, ptr, ptr, ptr]
        side = ctypes.POINTER(_KVSide)
        lib.lowbit_kv_write.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, side, ptr]
        lib.lowbit_decode_paged_layers.argtypes = [ctxp, blk, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, side, side,
                                                   ptr, ptr, ptr, ptr, ptr, f32]
        lib.lowbit_paged_decode_attention.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, side, side,
                                                      ptr, ptr, i64, f32, ptr, ctypes.c_int]

    def with_isa(self, isa: str) -> "NativeKernels":
        """The same library with its matmuls on another instruction set (tests and benchmarks: every
        one gives the same bits)."""
        return NativeKernels(self.lib, isa, self._sides)

    def _ctx(self) -> ctypes.Structure:
        self.ctx.nthreads = torch.get_num_threads()
        return ctypes.byref(self.ctx)

    # The matmul over lowbit's packed layouts (cpu_wq_mm.c); `desc` is a _Linear
    # (kernels/int4_mm.py, int8_mm.py build it from their packed forms and keep it).

    def linear_mm(self, x: torch.Tensor, desc: _Linear) -> torch.Tensor:
        """x fp32 [M, K] → y fp32 [M, N] = x @ W^T (+ bias), activations rounded per block of 32 to
        16-bit codes (kernels/act_quant.py), integer dot products, fp32 epilogue; N every row of the
        descriptor's chain (kernels/segments.py)."""
        M = x.shape[0]
        if M < 1 or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] != desc.K:
            raise ValueError(f"cpu native matmul: unsupported input {tuple(x.shape)} {x.dtype} for K={desc.K}")
        x = x.contiguous()
        y = torch.empty(M, self.lib.lowbit_linear_rows(ctypes.byref(desc)))  # a chain's runs together
        rc = self.lib.lowbit_linear_mm(self._ctx(), ctypes.byref(desc), x.data_ptr(), M, y.data_ptr())
        if rc:
            raise ValueError(f"cpu native matmul refused kind={desc.kind} N={desc.N} K={desc.K} "
                             f"group={desc.group} (status {rc})")
        return y

    # The exact path's weight tiles, bit-identical to the torch specs (kernels/int4_mm.py
    # dequantize_packed_t, int8_mm.py Int8Packed.dequantize): one pass instead of ~10 torch ops over
    # the tile (one exact pass over the default model's weights: ~0.4 s of dequantizing in torch).

    def int4_dequant_t(self, desc: _Linear, start: int, stop: int) -> torch.Tensor:
        """An int4 weight's rows start..stop-1 (whole tiles of 16) → their W^T fp32 [K, stop - start]."""
        out = torch.empty(desc.K, max(0, stop - start))
        if self.lib.lowbit_int4_dequant_t(ctypes.byref(desc), start, stop, out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"cpu int4 dequantize refused rows {start}:{stop} of N={desc.N} K={desc.K} "
                             f"group={desc.group}")
        return out

    def int8_dequant(self, desc: _Linear, start: int, stop: int) -> torch.Tensor:
        """An int8 weight → its rows start..stop-1, fp32 [n, K]."""
        out = torch.empty(max(0, stop - start), desc.K)
        if self.lib.lowbit_int8_dequant(ctypes.byref(desc), start, stop, out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"cpu int8 dequantize refused rows {start}:{stop} of N={desc.N}")
        return out

    def ggml_dequant(self, desc: _Linear, start: int, stop: int) -> torch.Tensor:
        """A GGML-block weight (kind 3, cpu_ggml.c) → its rows start..stop-1, fp32 [n, K], bit for bit
        kernels/ggml_blocks.py's."""
        out = torch.empty(max(0, stop - start), desc.K)
        if self.lib.lowbit_ggml_dequant(ctypes.byref(desc), start, stop, out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"cpu ggml dequantize refused rows {start}:{stop} of N={desc.N} K={desc.K} type={desc.P}")
        return out

    def tiles_pack(self, qtype: int, rows, N: int, K: int, out: torch.Tensor) -> None:
        """A GGML-block weight's N rows → lowbit's tiles in `out` (uint8 [ceil(N / 16), tile bytes]:
        kernels/kq_mm.py for K-quant and 5-bit types, int4_mm.py / int8_mm.py for Q4_0, Q4_1, Q8_0), in
        one C pass over the threads. rows: uint8 [N, row bytes] as GGUF stores them, or rows still in a
        file (`path`, `offset` of the tensor's data, `perm` int64 [N] or None: output row n is the file's
        row perm[n]), which the C code reads itself, so nothing but the tiles is held."""
        if not (out.dtype == torch.uint8 and out.is_contiguous()):
            raise ValueError("cpu tiles pack: a contiguous uint8 output expected")
        if isinstance(rows, torch.Tensor):
            if not (rows.dtype == torch.uint8 and rows.is_contiguous() and rows.shape[0] == N):
                raise ValueError("cpu tiles pack: contiguous uint8 [N, row bytes] rows expected")
            rc = self.lib.lowbit_tiles_pack(qtype, rows.data_ptr(), -1, 0, None, N, K, out.data_ptr(),
                                            torch.get_num_threads())
        else:
            perm = rows.perm
            if perm is not None and (perm.dtype != torch.int64 or not perm.is_contiguous() or perm.shape != (N,)):
                raise ValueError("cpu tiles pack: an int64 [N] row order expected")
            fd = os.open(rows.path, os.O_RDONLY)
            try:
                rc = self.lib.lowbit_tiles_pack(qtype, None, fd, rows.offset, None if perm is None else perm.data_ptr(),
                                                N, K, out.data_ptr(), torch.get_num_threads())
            finally:
                os.close(fd)
            if rc == -2:
                raise OSError(f"{rows.path}: a read of tensor data failed or came back short")
        if rc:
            raise ValueError(f"cpu tiles pack refused GGML type {qtype} for {N}x{K}")

    def kq_dequant(self, desc: _Linear, start: int, stop: int) -> torch.Tensor:
        """A kind-4 weight's rows start..stop-1 → fp32 [n, K], bit for bit kernels/ggml_blocks.py's."""
        out = torch.empty(max(0, stop - start), desc.K)
        if self.lib.lowbit_kq_dequant(ctypes.byref(desc), start, stop, out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"cpu kq dequantize refused rows {start}:{stop} of N={desc.N} type={desc.P}")
        return out

    def kq_rows(self, desc: _Linear, ids: torch.Tensor) -> torch.Tensor:
        """A kind-4 weight's rows ids (int64 [n]) → fp32 [n, K]: the embedding lookup."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), desc.K)
        if self.lib.lowbit_kq_rows(ctypes.byref(desc), ids.data_ptr(), ids.numel(), out.data_ptr()):
            raise ValueError(f"cpu kq rows: an id outside 0..{desc.N - 1}")
        return out

    def int8_rows(self, desc: _Linear, ids: torch.Tensor) -> torch.Tensor:
        """An int8 weight's rows ids (int64 [n], each in 0..N-1) → fp32 [n, K]: the embedding lookup."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), desc.K)
        if self.lib.lowbit_int8_rows(ctypes.byref(desc), ids.data_ptr(), ids.numel(), out.data_ptr()):
            raise ValueError(f"cpu int8 rows: an id outside 0..{desc.N - 1}")
        return out

    # The small per-row ops (kernels/cpu_block.c). Each takes fp32 rows whose last dim is contiguous
    # and returns what the plain-torch spec returns (kernels/rms_norm.py, rotary.py, silu_mul.py), the
    # residual and the rotated q/k updated in place, as the Triton kernels do.

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, D], residual fp32 [M, D] or None → (normed [M, D], residual): residual += x in place
        (a new fp32 residual when None)."""
        M, D = x.shape
        if x.dtype != torch.float32 or x.stride(1) != 1 or weight.dtype != torch.float32 or weight.shape != (D,) \
                or not weight.is_contiguous() or (residual is not None and (
                    residual.dtype != torch.float32 or residual.shape != (M, D) or not residual.is_contiguous())):
            raise ValueError(f"cpu add_rms_norm: unsupported input {tuple(x.shape)} {x.dtype} strides {x.stride()}")
        has_res = residual is not None
        if residual is None:
            residual = torch.empty(M, D)
        out = torch.empty(M, D)
        self.lib.lowbit_add_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), int(has_res), weight.data_ptr(),
                                     eps, M, D, out.data_ptr())
        return (out if out_dtype in (None, torch.float32) else out.to(out_dtype)), residual

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [M, H, D], k [M, Hkv, D] (fp32, last dim contiguous) rotated in place; cos/sin fp32 [M, D]."""
        for x in (q, k):
            M, H, D = x.shape
            if x.dtype != torch.float32 or x.stride(2) != 1 or cos.shape != (M, D) or not cos.is_contiguous() \
                    or not sin.is_contiguous():
                raise ValueError(f"cpu rotary: unsupported input {tuple(x.shape)} {x.dtype} strides {x.stride()}")
            self.lib.lowbit_rotary(x.data_ptr(), M, H, x.stride(0), x.stride(1), D, cos.data_ptr(), sin.data_ptr())
        return q, k

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up fp32 [M, I] (last dim contiguous) → silu(gate) * up, fp32 [M, I]."""
        return self._gated(self.lib.lowbit_silu_mul, "silu_mul", gate, up)

    def gelu_tanh_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up fp32 [M, I] (last dim contiguous) → gelu_tanh(gate) * up, fp32 [M, I] (Gemma's GeGLU)."""
        return self._gated(self.lib.lowbit_gelu_tanh_mul, "gelu_tanh_mul", gate, up)

    def swiglu_clamped(self, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gate, up fp32 [M, I] (last dim contiguous) → gpt-oss's clamped SwiGLU, fp32 [M, I] (cpu_moe.c)."""
        return self._gated(self.lib.lowbit_swiglu_clamped, "swiglu_clamped", gate, up, alpha, limit)

    def _gated(self, fn, name: str, gate: torch.Tensor, up: torch.Tensor, *args) -> torch.Tensor:
        M, n = gate.shape
        if gate.dtype != torch.float32 or up.dtype != torch.float32 or up.shape != gate.shape \
                or gate.stride(1) != 1 or up.stride(1) != 1:
            raise ValueError(f"cpu {name}: unsupported input {tuple(gate.shape)} {gate.dtype}")
        out = torch.empty(M, n)
        fn(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), M, n, out.data_ptr(), *args)
        return out

    # Gated DeltaNet's token-by-token step (cpu_gated_delta.c; the spec is kernels/gated_delta.py's
    # causal_conv_ref + prepare_qk, and delta_rule_ref), for one sequence's T tokens.

    def gated_delta_prep(self, raw: torch.Tensor, conv: torch.Tensor, conv_w: torch.Tensor, heads: tuple,
                         l2_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """raw fp32 [T, C], conv fp32 [C, K - 1] (updated in place), conv_w fp32 [C, K], heads (Hk, Hv, Dk, Dv,
        tiled) → q, k [T, Hv, Dk], v [T, Hv, Dv]."""
        Hk, Hv, Dk, Dv, tiled = heads
        T, C = raw.shape
        K = conv_w.shape[1]
        if any(x.dtype != torch.float32 or not x.is_contiguous() for x in (raw, conv, conv_w)) \
                or C != 2 * Hk * Dk + Hv * Dv or conv.shape != (C, K - 1) or conv_w.shape != (C, K):
            raise ValueError(f"cpu gated_delta_prep: unsupported input {tuple(raw.shape)} {tuple(conv.shape)}")
        q, k, v = torch.empty(T, Hv, Dk), torch.empty(T, Hv, Dk), torch.empty(T, Hv, Dv)
        if self.lib.lowbit_gated_delta_prep(raw.data_ptr(), T, conv.data_ptr(), conv_w.data_ptr(), K, Hk, Hv, Dk, Dv,
                                            int(tiled), l2_eps, q.data_ptr(), k.data_ptr(), v.data_ptr()):
            raise ValueError(f"cpu gated_delta_prep: unsupported heads {heads} or conv width {K}")
        return q, k, v

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """delta_rule_ref's arguments (q, k fp32 [T, H, Dk], v [T, H, Dv], g, beta [T, H], state [H, Dk, Dv]
        updated in place) → o fp32 [T, H, Dv]."""
        T, H, Dk = q.shape
        Dv = v.shape[2]
        if any(x.dtype != torch.float32 or not x.is_contiguous() for x in (q, k, v, g, beta, state)) \
                or k.shape != q.shape or v.shape != (T, H, Dv) or g.shape != (T, H) or beta.shape != (T, H) \
                or state.shape != (H, Dk, Dv):
            raise ValueError(f"cpu gated_delta_rule: unsupported input {tuple(q.shape)} {tuple(state.shape)}")
        out = torch.empty(T, H, Dv)
        if self.lib.lowbit_gated_delta_rule(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                            T, H, Dk, Dv, state.data_ptr(), out.data_ptr()):
            raise ValueError(f"cpu gated_delta_rule: heads of {Dk} x {Dv} are too wide")
        return out

    # A mixture of experts' experts in one call (cpu_moe.c; kernels/cpu_moe.py builds the descriptor).

    def moe_check(self, moe: _Moe) -> int:
        return self.lib.lowbit_moe_check(self._ctx(), ctypes.byref(moe))

    def moe_experts(self, moe: _Moe, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    out: torch.Tensor) -> int:
        """x fp32 [M, dim], ids int64 [M, k], weights fp32 [M, k] (contiguous, checked by the caller) → out
        fp32 [M, dim]. Returns the C status."""
        M, k = ids.shape
        return self.lib.lowbit_moe_experts(self._ctx(), ctypes.byref(moe), M, x.data_ptr(), k, ids.data_ptr(),
                                           weights.data_ptr(), out.data_ptr())

    def moe_route(self, moe: _Moe, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> int:
        """x fp32 [M, dim] (contiguous) → ids int64 [M, k], weights fp32 [M, k] (cpu_router.c). The C status."""
        return self.lib.lowbit_moe_route(self._ctx(), ctypes.byref(moe), x.shape[0], x.data_ptr(), ids.data_ptr(),
                                         weights.data_ptr())

    # The fused halves of a block (cpu_block.c; kernels/cpu_block.py builds the descriptor and checks
    # shapes). Both return the C code's status: 0, or non-zero for a refused shape / failed allocation.

    def block_pre(self, block: _Block, M: int, delta: torch.Tensor, residual: torch.Tensor, has_res: bool,
                  cos: torch.Tensor, sin: torch.Tensor, qkv: torch.Tensor) -> int:
        return self.lib.lowbit_block_pre(self._ctx(), ctypes.byref(block), M, delta.data_ptr(), residual.data_ptr(),
                                         int(has_res), cos.data_ptr(), sin.data_ptr(), qkv.data_ptr())

    def block_post(self, block: _Block, M: int, attn: torch.Tensor, residual: torch.Tensor,
                   delta: torch.Tensor) -> int:
        return self.lib.lowbit_block_post(self._ctx(), ctypes.byref(block), M, attn.data_ptr(), residual.data_ptr(),
                                          delta.data_ptr())

    def decode_paged_layers(self, blocks, M: int, delta: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, slots: torch.Tensor, page_size: int, k_sides: list, v_sides: list,
                            write_rot: torch.Tensor | None, attn_rot: torch.Tensor | None, ctx: torch.Tensor,
                            tables: torch.Tensor, toff: torch.Tensor, D: int) -> int:
        """Every block of a decode step over the paged pool (cpu_block.c): blocks a ctypes array of
        _Block (each naming its rotary table and window); cos/sin fp32 [K, M, D], the K rotary tables;
        k_sides/v_sides one KVSide per layer, or their `side_array`s. Returns the C status."""
        ks = k_sides if isinstance(k_sides, ctypes.Array) else self.side_array(k_sides, D)
        vs = v_sides if isinstance(v_sides, ctypes.Array) else self.side_array(v_sides, D)
        return self.lib.lowbit_decode_paged_layers(
            self._ctx(), blocks, len(blocks), M, delta.data_ptr(), residual.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            cos.shape[0], slots.data_ptr(), page_size, ks, vs, self._signs(write_rot), self._signs(attn_rot),
            ctx.data_ptr(), tables.data_ptr(), toff.data_ptr(), D ** -0.5)

    def paged_decode_attention(self, q: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor, toff: torch.Tensor,
                               page_size: int, k_side: KVSide, v_side: KVSide,
                               rot: torch.Tensor | None, window: int | None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One query token per row over the paged pool (cpu_attention.c): q fp32 [R, H, D] (heads
        contiguous), ctx int64 [R] keys seen per row, row r's page ids at tables[toff[r]:] (int64),
        k_side/v_side one layer's keys and values in the pool (kernels/kv_side.py),
        rot fp32 [D, D] (kernels/kv_quant.py rotation) when the pool rotates: its quantized sides are stored
        rotated, so q is rotated where the keys are quantized and the output rotated back where the values
        are (a float side is never rotated; one layer may hold f16 keys and int4 values), sinks fp32 [H]
        (gpt-oss: a logit per head in each row's softmax, with no value) or None → fp32 [R, H, D]."""
        R, H, D = q.shape
        check_sinks(sinks, H, "cpu paged decode attention")
        sides = [self._side(s, D) for s in (k_side, v_side)]
        Hkv = k_side.n_kv_heads
        ok = q.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == D and H % Hkv == 0 and D % 8 == 0 \
            and all(t.dtype == torch.int64 and t.is_contiguous() for t in (ctx, tables, toff)) \
            and ctx.shape == toff.shape == (R,) and (rot is None or (rot.shape == (D, D) and rot.is_contiguous()
                                                                     and rot.dtype == torch.float32))
        if not ok:
            raise ValueError(f"cpu paged decode attention: unsupported input q {tuple(q.shape)} {q.dtype}")
        out = torch.empty(R, H, D)
        rc = self.lib.lowbit_paged_decode_attention(
            q.data_ptr(), q.stride(0), R, H, Hkv, D, ctx.data_ptr(), tables.data_ptr(), toff.data_ptr(), page_size,
            ctypes.byref(sides[0]), ctypes.byref(sides[1]), self._signs(rot),
            None if sinks is None else sinks.data_ptr(), window or 0, D ** -0.5, out.data_ptr(), torch.get_num_threads())
        if rc:
            raise ValueError(f"cpu paged decode attention failed (status {rc})")
        return out

    def kv_write(self, x: torch.Tensor, slots: torch.Tensor, page_size: int, side: KVSide,
                 rot: torch.Tensor | None) -> None:
        """Quantize-on-write (cpu_attention.c): x fp32 [M, Hkv, D] (heads contiguous) → the slots
        (int64 [M]) of one side of one layer of the pool (kernels/kv_side.py), rotated by rot first."""
        M, Hkv, D = x.shape
        ok = x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == D and slots.dtype == torch.int64 \
            and slots.is_contiguous() and slots.shape == (M,) and (rot is None or rot.is_contiguous())
        if not ok:
            raise ValueError(f"cpu kv write: unsupported input {tuple(x.shape)} {x.dtype} strides {x.stride()}")
        rc = self.lib.lowbit_kv_write(x.data_ptr(), x.stride(0), M, Hkv, D, slots.data_ptr(), page_size,
                                      ctypes.byref(self._side(side, D)), self._signs(rot))
        if rc:
            raise ValueError(f"cpu kv write: unsupported {side.bits}-bit side with group {side.group}")

    def _signs(self, rot: torch.Tensor | None) -> int | None:
        """The KV rotation fp32 [D, D] → a pointer to its D signs, which is what the C kernels take:
        they apply it as a fast Walsh-Hadamard transform (cpu_attention.c `rotate`), so it must be
        diag(s) H / sqrt(D) (kernels/kv_quant.py rotation) — checked once per matrix."""
        if rot is None:
            return None
        key = (rot.data_ptr(), tuple(rot.shape))
        hit = self._rot_signs.get(key)
        if hit is None or hit[0] is not rot:
            from lowbit.kernels.kv_quant import hadamard

            D = rot.shape[0]
            signs = (rot[:, 0] * D ** 0.5).round().contiguous()
            if rot.dtype != torch.float32 or rot.shape != (D, D) or not torch.allclose(
                    signs[:, None] * hadamard(D), rot, atol=1e-6, rtol=0):
                raise ValueError("cpu kernels: the KV rotation is not a signed Hadamard matrix")
            if len(self._rot_signs) > 64:
                self._rot_signs.clear()
            hit = self._rot_signs[key] = (rot, signs)
        return hit[1].data_ptr()

    def side_array(self, sides: list[KVSide], D: int) -> ctypes.Array:
        """One ctypes descriptor per side, a layer's each (built in ~5 us a side: callers that step over
        one pool keep the array)."""
        return (_KVSide * len(sides))(*[self._side(s, D) for s in sides])

    def _side(self, s: KVSide, D: int) -> _KVSide:
        t = s.tensors()
        key = (s.bits, s.group, D, *(x.data_ptr() for x in t.values()), next(iter(t.values())).shape)
        side = self._sides.get(key)
        if side is None:
            if len(self._sides) > 4096:  # pools come and go (tests, evaluation): forget old ones
                self._sides.clear()
            side = self._sides[key] = self._new_side(s, D)
        return side

    @staticmethod
    def _new_side(s: KVSide, D: int) -> _KVSide:
        bits, group = s.bits, s.group
        if bits in (32, 16):  # fp32 / fp16 values: the data pointer in `codes` (cpu_kernels.h)
            ok = s.data.dtype == (torch.float32 if bits == 32 else torch.float16) and s.data.is_contiguous()
            side = _KVSide(bits, D, s.data.data_ptr(), None, None)
        else:
            ok = all(x.is_contiguous() for x in s.tensors().values()) and s.scales.dtype == torch.float16 \
                and s.scales.shape[-1] * group == D and group % (16 if bits == 4 else 8) == 0  # vector steps
            side = _KVSide(bits, group, s.codes.data_ptr(), s.scales.data_ptr(),
                           s.mins.data_ptr() if bits == 4 else None)
        if not ok or bits not in (4, 8, 16, 32):
            raise ValueError(f"cpu paged decode attention: unsupported {bits}-bit cache side")
        return side


def check_sinks(sinks: torch.Tensor | None, H: int, who: str) -> None:
    """Attention sinks as the C kernels read them: None, or contiguous fp32 [H] on the CPU (a model whose
    file stores them in bf16 converts them once at load, not per step)."""
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (H,) or not sinks.is_contiguous()
                              or sinks.device.type != "cpu"):
        raise ValueError(f"{who}: sinks must be contiguous fp32 [{H}] on CPU, got {sinks.dtype} "
                         f"{tuple(sinks.shape)} on {sinks.device}")


@functools.lru_cache(maxsize=1)
def native() -> NativeKernels | None:
    """The built kernels, or None (no compiler, a failed build, a CPU without AVX2/FMA/F16C,
    LOWBIT_NATIVE=0). LOWBIT_NATIVE=avx2 | vnni256 | avx512 runs the matmuls on that instruction set
    instead of the best one (side-by-side benchmarks; every one gives the same bits). Built once per
    process; the .so is reused across processes."""
    choice = os.environ.get("LOWBIT_NATIVE", "1")
    if choice == "0":
        return None
    try:
        kernels = load(_build())
        return kernels.with_isa(choice) if kernels is not None and choice != "1" else kernels
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as e:
        warnings.warn(f"lowbit's C decode kernels are unavailable ({e}); using the plain-torch exact path",
                      RuntimeWarning, stacklevel=2)
        return None


def load(path: Path) -> NativeKernels | None:
    """A built library (from `_build`) → its kernels, or None where the CPU lacks AVX2/FMA/F16C;
    AbiMismatch where it and this module disagree (`check_abi`)."""
    lib = ctypes.CDLL(str(path))
    if not lib.lowbit_native_ok():
        return None
    check_abi(lib, path)  # after lowbit_native_ok: the whole library, its ABI exports too, is AVX2 code
    return NativeKernels(lib)


def check_abi(lib: ctypes.CDLL, path: Path | str = "the library") -> None:
    """Raise AbiMismatch unless `lib` has this module's ABI_VERSION and lays out every struct of
    ABI_STRUCTS exactly as its ctypes mirror does: the sizeof, and each field's offset and size,
    matched by name (equal sizes alone would miss two fields of one size swapped)."""
    try:
        version = lib.lowbit_abi_version
    except AttributeError:
        raise AbiMismatch(f"lowbit's C kernels at {path} export no ABI (lowbit_abi_version): "
                          "not built from these sources") from None
    if (v := version()) != ABI_VERSION:
        raise AbiMismatch(f"lowbit's C kernels at {path} have ABI version {v}, kernels/cpu_native.py "
                          f"binds version {ABI_VERSION}: cpu_kernels.h and cpu_native.py must change together")
    in_c, mirrored = _c_layout(lib), _mirror_layout()
    problems = []
    for key in [*in_c, *(k for k in mirrored if k not in in_c)]:
        c, py = in_c.get(key), mirrored.get(key)
        if c != py:
            problems.append(f"{key}: only in ctypes" if c is None else f"{key}: only in C" if py is None else
                            f"{key}: sizeof {c[1]} in C, {py[1]} in ctypes" if "." not in key else
                            f"{key}: offset {c[0]} size {c[1]} in C, offset {py[0]} size {py[1]} in ctypes")
    if problems:
        raise AbiMismatch(f"lowbit's C kernels at {path} and the ctypes mirrors in kernels/cpu_native.py disagree "
                          f"(fix the side that is out of date): {'; '.join(problems)}")


def _c_layout(lib: ctypes.CDLL) -> dict[str, tuple[int, int]]:
    """The library's lowbit_abi_layout: "struct" → (0, sizeof), "struct.field" → (offset, size)."""
    f = lib.lowbit_abi_layout
    f.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
                  ctypes.c_int64]
    f.restype = ctypes.c_int64
    n = f(None, None, None, 0)
    names, offsets, sizes = (ctypes.c_char_p * n)(), (ctypes.c_int64 * n)(), (ctypes.c_int64 * n)()
    f(names, offsets, sizes, n)
    return {names[i].decode(): (offsets[i], sizes[i]) for i in range(n)}


def _mirror_layout() -> dict[str, tuple[int, int]]:
    """The same entries for the ctypes mirrors of ABI_STRUCTS."""
    out = {}
    for name, mirror in ABI_STRUCTS:
        out[name] = (0, ctypes.sizeof(mirror))
        for field, *_ in mirror._fields_:
            out[f"{name}.{field}"] = (getattr(mirror, field).offset, getattr(mirror, field).size)
    return out


def variants(flags: set[str]) -> list[tuple[Isa, tuple[str, ...]]]:
    """The tile kernels a CPU with these /proc/cpuinfo flags gets: (Isa, compiler flags) each."""
    out = []
    for isa in ISAS:
        for needs, cflags in zip(isa.needs, isa.flags):
            if set(needs) <= flags:
                out.append((isa, cflags))
                break
    return out


def _build(cpu_flags: set[str] | None = None) -> Path:
    """Compile the library for a CPU with `cpu_flags` (default: this one's), once per set of sources,
    compiler and flags, into the user cache directory. Tests pass a smaller set to build what an
    AVX2-only machine builds."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    flags = _cpu_flags() if cpu_flags is None else set(cpu_flags)
    wanted = variants(flags)
    key = _build_key(cc, flags, wanted)
    import platformdirs  # here, not at import: kernels stay importable without it

    out = Path(platformdirs.user_cache_dir("lowbit")) / "native" / f"cpu_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if sys.stderr.isatty():  # a first run pauses here: say why (measured 4.4 s on 2 cores)
        print("lowbit: building the C kernels for this CPU (once, a few seconds)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # build aside, then rename: concurrent builds are safe
        tmp = Path(tmp)
        jobs = {(isa.name, src.stem): ([cc, *_FLAGS, *cflags, f"-DLB_ISA={isa.number}", "-c", str(src), "-o",
                                        str(tmp / f"{src.stem}_{isa.name}.o")], isa.name == "avx2")
                for isa, cflags in wanted for src in TILES}
        ok = _compile_all(jobs)
        # a compiler without -mavxvnni drops that set (every tile file of it)
        built = [isa.name for isa, _ in wanted if all(ok[(isa.name, src.stem)] for src in TILES)]
        have = [f"-DLB_HAVE_{n.upper()}=1" for n in built if n != "avx2"]
        so = tmp / out.name
        _run([cc, *_FLAGS, *have, "-shared", "-Wl,-Bsymbolic", *map(str, SOURCES),
              *(str(tmp / f"{src.stem}_{n}.o") for n in built for src in TILES), "-o", str(so), "-lm"])
        os.replace(so, out)
    return out


def _build_key(cc: str, flags: set[str], wanted: list[tuple[Isa, tuple[str, ...]]]) -> str:
    """The build's cache key: a hash of the sources and the header, the compiler's version, the
    compiler flags and the CPU's flags — any change to one of them builds a new library."""
    src = b"".join(s.read_bytes() for s in (*SOURCES, *TILES, HEADER, TILES_HEADER))
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    plan = " ".join(_FLAGS) + "|" + ";".join(f"{i.name}:{' '.join(f)}" for i, f in wanted)
    return hashlib.sha256(src + version.encode() + plan.encode() + " ".join(sorted(flags)).encode()).hexdigest()[:16]


def _compile_all(jobs: dict) -> dict:
    """Run the compile commands side by side → which succeeded; a required one failing raises."""
    procs = {name: (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), required)
             for name, (cmd, required) in jobs.items()}
    ok = {}
    for name, (p, required) in procs.items():
        _, err = p.communicate(timeout=120)
        ok[name] = p.returncode == 0
        if not ok[name] and required:
            raise RuntimeError(f"the C compiler failed: {_first_error(err, p.returncode)}")
    return ok


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if r.returncode:
        raise RuntimeError(f"the C compiler failed: {_first_error(r.stderr, r.returncode)}")


def _first_error(stderr: str, rc: int) -> str:
    """The compiler's first error line (its last line can be a summary such as "some warnings being
    treated as errors", which names nothing), else its last line, else the exit status."""
    lines = stderr.strip().splitlines()
    return next((ln for ln in lines if "error:" in ln), lines[-1] if lines else str(rc))


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo on Linux); empty where there is none to read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
