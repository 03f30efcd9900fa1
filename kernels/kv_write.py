"""KV quantize-on-write (Triton): each new token's K or V vectors, one per KV head, quantized and
stored in its cache slot — the GPU form of runtime/engine/kv_cache.py's `KVPool.write` for one side.

The number formats are kernels/kv_quant.py's (the spec); the pool layout is a `KVSide`'s
(kernels/kv_side.py), as runtime/engine/kv_cache.py allocates it:

    f32   data   fp32  [P, Hkv, page, D]     (stored as is: the exact reference cache)
    f16   data   fp16  [P, Hkv, page, D]
    int8  codes  int8  [P, Hkv, page, D]     scales fp16 [P, Hkv, page, G]
    int4  codes  uint8 [P, Hkv, page, D/2]   scales, mins fp16 [P, Hkv, page, G]

Token m goes to page slots[m] // page and offset slots[m] % page. x arrives already rotated (the
caller applies the Hadamard rotation; it is a matmul, not this kernel's business).

One program per (token, KV head): a vector is at most D = 256 values, a [G, group] tile in registers
(SmolLM2, D = 64: int8 keys one group of 64, int4 values two groups of 32). The write is a small
part of a decode step — 2 Hkv D bytes read per token per layer — so nothing is gained by tiling
several tokens into one program.

The codes are bit-identical to the spec run on the CPU (torch's true IEEE division), step by step:
    int8  d = fp16(amax / 127)                 q = clamp(rne(x * (1 / fp32(d))), -127, 127)
    int4  m = fp16(lo), d = fp16((hi - m) / 15) u = clamp(rne((x - m) * (1 / fp32(d))), 0, 15)
- Divisions use `tl.math.div_rn`: a plain `/` may lower to an approximate fp32 division on the GPU,
  and one ulp of amax / 127 can move the fp16 scale. (torch on CUDA divides by a Python scalar as a
  multiply by its reciprocal, so the spec run on CUDA tensors may differ in a rare scale; the CPU's
  result is the spec, and the GPU test compares with it.)
- rne (round half to even, torch.round) is built from floor on |y|: fl = floor(a), f = a - fl is
  exact (Sterbenz: fl >= a/2 when a >= 1; f = a when a < 1), round up when f > 0.5 or f == 0.5 with
  fl odd. Going through |y| also keeps y = x * inv from being contracted into an FMA with the next
  subtraction, which would round the exact product instead of the rounded one the spec rounds.
"""

from __future__ import annotations

import torch

from lowbit.kernels.kv_quant import quantize_int4, quantize_int8
from lowbit.kernels.kv_side import KVSide
from lowbit.kernels.triton_import import check_device, tl, triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _round_half_even(y):
    """torch.round for fp32 |y| < 2^23: round half to even, sign kept."""
    a = tl.abs(y)
    fl = tl.floor(a)
    f = a - fl  # exact, see the module docstring
    odd = (fl.to(tl.int32) & 1) == 1
    r = fl + tl.where((f > 0.5) | ((f == 0.5) & odd), 1.0, 0.0)
    return tl.where(y < 0, -r, r)


@triton.jit
def _inverse(d):
    """1 / d rounded to nearest, 0 where d == 0 (a group of zeros, or all-equal values for int4)."""
    ok = d > 0
    return tl.where(ok, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(ok, d, 1.0)), 0.0)


@triton.jit
def _kv_write_kernel(x_ptr, slot_ptr, c_ptr, s_ptr, m_ptr, stride_xm, stride_xh, HKV, PAGE,
                     BITS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)  # int64: pool offsets pass 2^31 in large pools
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok)
    row = ((slot // PAGE) * HKV + head) * PAGE + slot % PAGE  # (page, head, offset) as one row index
    G: tl.constexpr = D // GROUP
    g = tl.arange(0, BLOCK_G)[:, None]  # [BLOCK_G, 1] group
    w = tl.arange(0, BLOCK_W)[None, :]  # [1, BLOCK_W] column in the group (int4: byte in the group)
    x_row = x_ptr + tok * stride_xm + head * stride_xh
    if BITS == 4:
        # Two tiles, the even and the odd values of each group: byte k of the group packs value 2k
        # (low nibble) and 2k + 1 (high nibble), so the packing needs no shuffle.
        mask = (g < G) & (w < GROUP // 2)
        e = g * GROUP + 2 * w  # [BLOCK_G, BLOCK_W] index of the even value
        x0 = tl.load(x_row + e, mask=mask, other=0.0).to(tl.float32)  # widen at once (interpreter bf16)
        x1 = tl.load(x_row + e + 1, mask=mask, other=0.0).to(tl.float32)
        lo = tl.min(tl.minimum(tl.where(mask, x0, float("inf")), tl.where(mask, x1, float("inf"))), axis=1)
        hi = tl.max(tl.maximum(tl.where(mask, x0, -float("inf")), tl.where(mask, x1, -float("inf"))), axis=1)
        g_ok = tl.arange(0, BLOCK_G) < G  # padding groups (BLOCK_G > G) get 0, not inf - inf
        m16 = tl.where(g_ok, lo, 0.0).to(tl.float16)  # [BLOCK_G]
        m = m16.to(tl.float32)
        d16 = tl.math.div_rn(tl.where(g_ok, hi, 0.0) - m, 15.0).to(tl.float16)
        inv = _inverse(d16.to(tl.float32))[:, None]
        u0 = tl.minimum(tl.maximum(_round_half_even((x0 - m[:, None]) * inv), 0.0), 15.0).to(tl.int32)
        u1 = tl.minimum(tl.maximum(_round_half_even((x1 - m[:, None]) * inv), 0.0), 15.0).to(tl.int32)
        tl.store(c_ptr + row * (D // 2) + g * (GROUP // 2) + w, (u0 | (u1 << 4)).to(tl.uint8), mask=mask)
        gs = tl.arange(0, BLOCK_G)
        tl.store(s_ptr + row * G + gs, d16, mask=gs < G)
        tl.store(m_ptr + row * G + gs, m16, mask=gs < G)
    else:
        mask = (g < G) & (w < GROUP)
        x = tl.load(x_row + g * GROUP + w, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_G, BLOCK_W]
        if BITS == 32:  # the fp32 value as is (x came in fp32, or widened exactly from fp16/bf16)
            tl.store(c_ptr + row * D + g * GROUP + w, x, mask=mask)
        elif BITS == 16:
            tl.store(c_ptr + row * D + g * GROUP + w, x.to(tl.float16), mask=mask)
        else:
            d16 = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0).to(tl.float16)  # [BLOCK_G]
            inv = _inverse(d16.to(tl.float32))[:, None]
            q = tl.minimum(tl.maximum(_round_half_even(x * inv), -127.0), 127.0)
            tl.store(c_ptr + row * D + g * GROUP + w, q.to(tl.int8), mask=mask)
            gs = tl.arange(0, BLOCK_G)
            tl.store(s_ptr + row * G + gs, d16, mask=gs < G)


def kv_write(x: torch.Tensor, slots: torch.Tensor, side: KVSide, page_size: int) -> None:
    """x [M, Hkv, D] fp16/bf16/fp32 (already rotated; last dim contiguous, any other strides),
    slots int64 [M] (each in [0, P * page_size), distinct) → quantized into the side's tensors in place."""
    if x.dim() != 3 or x.dtype not in _FLOATS:
        raise ValueError(f"kv_write: x must be fp16/bf16/fp32 [M, Hkv, D], got {x.dtype} {tuple(x.shape)}")
    M, Hkv, D = x.shape
    if D > 1 and x.stride(2) != 1:
        raise ValueError(f"kv_write: x's last dim must be contiguous, got strides {x.stride()}")
    if slots.shape != (M,) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"kv_write: slots must be contiguous int64 [{M}], got {slots.dtype} {tuple(slots.shape)}")
    bits, group = side.bits, D if side.bits >= 16 else side.group  # 32 and 16 bits: one tile of D copied
    side.check(D, page_size, Hkv, "kv_write")
    held = tuple(side.tensors().values())
    check_device(x, slots, *held)
    if any(t.device != x.device for t in (slots, *held)):
        raise ValueError("kv_write: x, slots and the buffers must be on one device")
    if M == 0 or Hkv == 0:
        return
    codes, scales, mins = side.kernel_tensors()
    block_w = triton.next_power_of_2(group // 2 if bits == 4 else group)
    _kv_write_kernel[(M, Hkv)](x, slots, codes, scales, mins, x.stride(0), x.stride(1), Hkv, page_size,
                               BITS=bits, D=D, GROUP=group, BLOCK_G=triton.next_power_of_2(D // group),
                               BLOCK_W=block_w)


def kv_write_ref(x: torch.Tensor, slots: torch.Tensor, side: KVSide, page_size: int) -> None:
    """The spec: kernels/kv_quant.py's formats stored by index assignment, as KVPool.write does."""
    page, off = slots // page_size, slots % page_size
    if side.bits >= 16:
        side.data[page, :, off] = x.to(side.data.dtype)  # [M, Hkv, D] at (page, :, off)
    elif side.bits == 8:
        side.codes[page, :, off], side.scales[page, :, off] = quantize_int8(x.float(), side.group)
    else:
        side.codes[page, :, off], side.scales[page, :, off], side.mins[page, :, off] = \
            quantize_int4(x.float(), side.group)
