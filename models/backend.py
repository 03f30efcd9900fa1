"""Which kernels a model runs, chosen once per model from its device (DESIGN.md, Backends).

    torch   CPU: lowbit's C kernels (kernels/cpu_native.py, chosen here once: `native`) on its own
            packed int4/int8 layouts, or the plain-torch exact path (each packed weight holds the
            kernels that multiply it; kernels/int4_mm.py, int8_mm.py); the small ops (norm, rotary, SiLU) are
            lowbit's C row loops where they build (kernels/cpu_block.c, within fp32 rounding of
            the `_ref` specs; rotary exactly), else the plain-torch `_ref` specs in fp32; decode
            steps run each block as two fused C calls around attention (kernels/cpu_block.py).
    triton  CUDA: the Triton kernels (kernels/wq_mm.py, rms_norm.py, rotary.py, silu_mul.py) with
            fp16 or bf16 activations. The tests also run it on CPU under Triton's interpreter.

Layers call `backend.<op>` and never look at the device or for the C library themselves; tests pick
kernels by building a backend (`torch_backend(native=None)`). The residual stream stays fp32 on both
(the add is fused into the norm), so the usual fp16 overflow point — a residual growing past
65504 — does not arise; fp16 is the CUDA default because its 10-bit mantissa rounds activations 8x
less than bf16's 7 bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from lowbit.kernels import cpu_block, cpu_native, gelu_mul, rms_norm, rotary, silu_mul
from lowbit.kernels.triton_import import HAVE_TRITON
from lowbit.quant.linear import LinearKernels, cpu_kernels, triton_kernels

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Backend:
    name: str  # "torch" | "triton"
    device: torch.device
    dtype: torch.dtype  # activations between kernels (fp32 on torch)
    linear: LinearKernels
    add_rms_norm: Callable  # (x, residual | None, weight, eps, out_dtype) → (normed, residual fp32)
    rotary: Callable  # (q [M, H, D], k [M, Hkv, D], cos, sin [M, D]) → (q, k)
    silu_mul: Callable  # (gate, up [M, I]) → [M, I]
    gelu_tanh_mul: Callable  # (gate, up [M, I]) → [M, I], Gemma's GeGLU
    fused_paged_attention: bool  # paged KV read by kernels (models/attention.py) or gathered by torch
    # (dims, eps, norms, (packed weight, bias) x 4) → a block in two fused calls around attention, or None
    # (kernels/cpu_block.py); used for steps whose matmuls all take the fast kernel
    fused_block: Callable | None = None
    # lowbit's C kernels (kernels/cpu_native.py) where this backend runs them: paged attention and the
    # KV write, besides what the callables above already hold; None on CUDA and where they do not build
    native: object | None = None
    # whether one step may run some rows on the exact path and the rest on the fast kernels (CPU: both
    # take fp32 activations, so a verified-greedy request's exact rows share a step with other
    # requests' fast ones); CUDA runs a step with any exact row exactly throughout
    per_row_exact: bool = False


def torch_backend(native="auto") -> Backend:
    """The CPU backend on lowbit's C kernels: "auto" the library built for this CPU
    (kernels/cpu_native.py, None where it does not build), or the NativeKernels given (another
    instruction set: `with_isa`); None runs everything on the plain-torch paths (the exact matmul,
    the ops' specs), as where no C compiler is found."""
    if native == "auto":
        native = cpu_native.native()
    return Backend("torch", torch.device("cpu"), torch.float32, cpu_kernels(native),
                   partial(rms_norm.add_rms_norm_cpu, native=native), partial(rotary.rotary_cpu, native=native),
                   partial(silu_mul.silu_mul_cpu, native=native), partial(gelu_mul.gelu_tanh_mul_cpu, native=native),
                   False,
                   partial(cpu_block.fused_block, native=native) if native is not None else None, native, True)


def triton_backend(device: str | torch.device = "cuda", dtype: str = "float16") -> Backend:
    if not HAVE_TRITON:
        raise RuntimeError("the CUDA path needs Triton (it comes with CUDA builds of torch; pip install triton)")
    device = torch.device(device)
    return Backend("triton", device, DTYPES[dtype], triton_kernels(device),
                   rms_norm.add_rms_norm, rotary.rotary_, silu_mul.silu_mul, gelu_mul.gelu_tanh_mul_ref, True)


def default_device() -> str:
    """cuda when a GPU and Triton are both there, else cpu."""
    return "cuda" if torch.cuda.is_available() and HAVE_TRITON else "cpu"


def select_backend(device: str = "auto", dtype: str = "float16") -> Backend:
    """device: auto | cpu | cuda | cuda:N. The one place a device turns into kernels."""
    device = default_device() if device == "auto" else device
    if device == "cpu":
        return torch_backend()
    if not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; expected auto, cpu or cuda[:N]")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU")
    if dtype not in DTYPES:
        raise ValueError(f"unknown activation dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return triton_backend(device, dtype)
