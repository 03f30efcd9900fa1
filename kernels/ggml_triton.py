"""GGML-block weight matmul on the GPU (Triton): y[M, N] = x[M, K] @ dequant(W)[N, K]^T, W in a GGML
block type exactly as GGUF stores it (kernels/ggml_blocks.py is the spec; the CPU's kernels are
kernels/cpu_ggml.c).

The kernel reads each row's blocks as bytes and decodes them in registers, one chunk of 16 or 32
values at a time — the sub-block a scale covers (16: Q2_K, Q3_K, Q6_K; 32: the rest) — into integer
codes c (|c| <= 127, exact in fp16/bf16) and the row's scale a and min b for that chunk, so the
chunk's product factors as in kernels/wq_mm.py:

    acc += (x @ c^T) * a + rowsum(x) * b

with the dot on tensor cores over exact integers and fp32 accumulation; fp32 x (the exact path)
takes an IEEE fp32 dot. Codes and scales are gathered byte by byte (each type's bit layout as
pointer arithmetic), which is correct for every type but not tuned: the decode-sized launch has one
program per 32 output rows and no split over K. Checked against the spec under Triton's interpreter
(tests/test_triton_ggml.py); never timed on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.kernels.ggml_blocks import BLOCKS, KVALUES, KVALUES_MXFP4, check_rows, ggml_dequant_ref
from lowbit.kernels.triton_import import check_device, tl, triton

SUB16 = (10, 11, 14)  # Q2_K, Q3_K, Q6_K: a scale per 16 values


@dataclass
class GgmlTritonPacked:
    data: torch.Tensor  # uint8 [split, row bytes]: the file's blocks, rows of type qtype
    qtype: int
    in_features: int  # K
    kvalues: torch.Tensor  # int32 [32]: IQ4's codebook, then MXFP4's, on the weight's device
    data2: torch.Tensor | None = None  # uint8 [N - split, row bytes]: rows of type qtype2 (a fused QKV)
    qtype2: int = 0

    @property
    def out_features(self) -> int:
        return self.data.shape[0] + (0 if self.data2 is None else self.data2.shape[0])

    def to(self, device) -> "GgmlTritonPacked":
        return GgmlTritonPacked(self.data.to(device), self.qtype, self.in_features, self.kvalues.to(device),
                                None if self.data2 is None else self.data2.to(device), self.qtype2)


def ggml_triton_pack(data: torch.Tensor, qtype: int, in_features: int, data2: torch.Tensor | None = None,
                     qtype2: int = 0) -> GgmlTritonPacked:
    check_rows(data, qtype, in_features)
    check_rows(data2, qtype2, in_features)
    codebooks = torch.tensor(KVALUES + KVALUES_MXFP4, dtype=torch.int32)
    return GgmlTritonPacked(data.contiguous(), qtype, in_features, codebooks,
                            None if data2 is None else data2.contiguous(), qtype2)


@triton.jit
def _byte(p, off):
    """Byte `off` of each row's block (p: [BN] pointers) as int32; off [BN] or [BN, CK]."""
    return tl.load(p + off).to(tl.int32)


@triton.jit
def _f16(p, off):
    """The fp16 at byte `off` of each row's block → fp32 [BN]."""
    h = (_byte(p, off) | (_byte(p, off + 1) << 8)).to(tl.int16)
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _chunk(p, c0, kv_ptr, QTYPE: tl.constexpr, CK: tl.constexpr, BN: tl.constexpr):
    """Values c0 .. c0 + CK - 1 of each row's block (p: uint8 pointers [BN, 1]) → codes fp32 [BN, CK],
    scale a [BN, 1] and min b [BN, 1]: w = a c + b, as kernels/ggml_blocks.py decodes them."""
    k = c0 + tl.arange(0, CK)[None, :]  # [1, CK]: index inside the block
    z = tl.zeros((BN, 1), dtype=tl.int32)  # byte offsets of per-row scalars
    b = tl.zeros((BN, 1), dtype=tl.float32)
    if QTYPE == 2 or QTYPE == 3 or QTYPE == 20:  # Q4_0, Q4_1, IQ4_NL: d (, m), nibbles
        if QTYPE == 3:
            u = (_byte(p, 4 + k % 16) >> (4 * (k // 16))) & 15
        else:
            u = (_byte(p, 2 + k % 16) >> (4 * (k // 16))) & 15
        a = _f16(p, z)
        if QTYPE == 2:
            c = u - 8
        elif QTYPE == 20:
            c = tl.load(kv_ptr + u)
        else:
            c = u
            b = _f16(p, z + 2)
    elif QTYPE == 8:  # Q8_0: d, int8 codes
        c = _byte(p, 2 + k).to(tl.int8).to(tl.int32)
        a = _f16(p, z)
    elif QTYPE == 6 or QTYPE == 7:  # Q5_0, Q5_1: d (, m), qh[4], nibbles
        if QTYPE == 6:
            hq = 2
        else:
            hq = 4
        u = ((_byte(p, hq + 4 + k % 16) >> (4 * (k // 16))) & 15) | (((_byte(p, hq + k // 8) >> (k % 8)) & 1) << 4)
        a = _f16(p, z)
        if QTYPE == 6:
            c = u - 16
        else:
            c = u
            b = _f16(p, z + 2)
    elif QTYPE == 10:  # Q2_K: scales[16], qs[64], d, dmin; a scale per 16
        j = c0 // 16
        sc = _byte(p, z + j)
        a = _f16(p, z + 80) * (sc & 15).to(tl.float32)
        b = -(_f16(p, z + 82) * (sc >> 4).to(tl.float32))
        c = (_byte(p, 16 + 32 * (k // 128) + k % 32) >> (2 * ((k % 128) // 32))) & 3
    elif QTYPE == 11:  # Q3_K: hmask[32], qs[64], scales[12], d; a scale per 16
        j = c0 // 16
        lo = (_byte(p, z + 96 + j % 8) >> (4 * (j // 8))) & 15
        hi = (_byte(p, z + 104 + j % 4) >> (2 * (j // 4))) & 3
        a = _f16(p, z + 108) * ((lo | (hi << 4)) - 32).to(tl.float32)
        h, s, i = k // 128, (k % 128) // 32, k % 32
        c = ((_byte(p, 32 + 32 * h + i) >> (2 * s)) & 3) - 4 + 4 * ((_byte(p, i) >> (4 * h + s)) & 1)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: d, dmin, scales[12] (6-bit scale and min per 32)
        j = c0 // 32
        if j < 4:
            sc = _byte(p, z + 4 + j) & 63
            mn = _byte(p, z + 8 + j) & 63
        else:
            sc = (_byte(p, z + 8 + j) & 15) | ((_byte(p, z + j) >> 6) << 4)
            mn = (_byte(p, z + 8 + j) >> 4) | ((_byte(p, z + 4 + j) >> 6) << 4)
        a = _f16(p, z) * sc.to(tl.float32)
        b = -(_f16(p, z + 2) * mn.to(tl.float32))
        g, half, i = k // 64, (k // 32) % 2, k % 32
        if QTYPE == 13:
            c = ((_byte(p, 48 + 32 * g + i) >> (4 * half)) & 15) | (((_byte(p, 16 + i) >> (2 * g + half)) & 1) << 4)
        else:
            c = (_byte(p, 16 + 32 * g + i) >> (4 * half)) & 15
    elif QTYPE == 14:  # Q6_K: ql[128], qh[64], int8 scales[16], d; a scale per 16
        j = c0 // 16
        a = _f16(p, z + 208) * _byte(p, z + 192 + j).to(tl.int8).to(tl.float32)
        h, s, i = k // 128, (k % 128) // 32, k % 32
        lo = (_byte(p, 64 * h + 32 * (s % 2) + i) >> (4 * (s // 2))) & 15
        hi = (_byte(p, 128 + 32 * h + i) >> (2 * s)) & 3
        c = (lo | (hi << 4)) - 32
    elif QTYPE == 39:  # MXFP4: e (E8M0), nibbles indexing its codebook (kv_ptr[16:]); a = 2^(e - 128)
        c = tl.load(kv_ptr + 16 + ((_byte(p, 1 + k % 16) >> (4 * (k // 16))) & 15))
        e = _byte(p, z)
        # the fp32 power of two from its bits (ggml's e8m0_to_fp32_half): e 0 and 1 are subnormals
        a = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    else:  # IQ4_XS (23): d, scales_h u16, scales_l[4], qs[128]; 6-bit scale per 32, codebook
        j = c0 // 32
        sh = _byte(p, z + 2) | (_byte(p, z + 3) << 8)
        ls = ((_byte(p, z + 4 + j // 2) >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)
        a = _f16(p, z) * (ls - 32).to(tl.float32)
        i = k % 32
        c = tl.load(kv_ptr + ((_byte(p, 8 + 16 * j + i % 16) >> (4 * (i // 16))) & 15))
    return c.to(tl.float32), a, b


@triton.jit
def _ggml_mm_kernel(x_ptr, w_ptr, kv_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
                    QTYPE: tl.constexpr, QK: tl.constexpr, NB: tl.constexpr, CK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows = w_ptr + tl.where(n_ok, offs_n, 0).to(tl.int64)[:, None] * row_bytes  # [BN, 1]: row starts
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, CK):
        p = rows + (k0 // QK) * NB  # [BN, 1]: the block holding this chunk
        c, a, b = _chunk(p, k0 % QK, kv_ptr, QTYPE, CK, BLOCK_N)  # [BN, CK], [BN, 1], [BN, 1]
        offs_k = k0 + tl.arange(0, CK)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None], other=0.0)
        if IEEE:
            t = tl.dot(x, tl.trans(c), input_precision="ieee")
        else:
            t = tl.dot(x, tl.trans(c.to(x.dtype)))
        acc += t * tl.trans(a) + tl.sum(x.to(tl.float32), axis=1)[:, None] * tl.trans(b)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def ggml_triton_mm(x: torch.Tensor, w: GgmlTritonPacked, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (fp16 / bf16, or fp32 for the exact path) → y [M, N] in out_dtype (default x's): one launch
    per row segment, each writing its columns of y."""
    M, K = x.shape
    if K != w.in_features:
        raise ValueError(f"ggml_triton_mm: input {tuple(x.shape)} for K={w.in_features}")
    check_device(x, w.data)
    x = x.contiguous()
    y = torch.empty(M, w.out_features, dtype=out_dtype or x.dtype, device=x.device)
    split = w.data.shape[0]
    for data, qtype, out in ((w.data, w.qtype, y[:, :split]), (w.data2, w.qtype2, y[:, split:])):
        if data is None:
            continue
        _, qk, nb = BLOCKS[qtype]
        BM, BN = 16, 32
        grid = (triton.cdiv(M, BM), triton.cdiv(data.shape[0], BN))
        _ggml_mm_kernel[grid](x, data, w.kvalues, out, M, data.shape[0], K, data.shape[1], x.stride(0), out.stride(0),
                              QTYPE=qtype, QK=qk, NB=nb, CK=16 if qtype in SUB16 else 32, BLOCK_M=BM, BLOCK_N=BN,
                              IEEE=x.dtype == torch.float32)
    return y


def ggml_triton_rows(w: GgmlTritonPacked, ids: torch.Tensor) -> torch.Tensor:
    """fp32 [n, K] of rows ids (the embedding lookup: a table has one type), decoded by the spec on the
    weight's device."""
    return ggml_dequant_ref(w.data[ids.to(torch.int64)], w.qtype, w.in_features)
