"""GGML's block formats as GGUF stores them, and their dequantization in plain torch: the spec that
kernels/cpu_ggml.c (and kernels/ggml_mm.py's exact path) must match bit for bit.

A matrix [N, K] is N rows of K / QK blocks, each row's blocks contiguous (`bytes` per block). Every
type decodes to w = a * c + b per sub-block of 16 or 32 values, with integer codes c, and a, b the
product of an fp16 super-scale and a small integer — exact in fp32 (at most 11 + 8 bits), so the
only rounding is the one GGUF's reference does too (`gguf.quants.dequantize`, numpy fp32):

    type    QK  bytes  per block                                           w
    Q4_0    32   18    d fp16, qs[16]                                      d * (q - 8), q = 4 bits
    Q4_1    32   20    d, m fp16, qs[16]                                   d * q + m
    Q8_0    32   34    d fp16, qs[32] int8                                 d * q
    Q5_0    32   22    d fp16, qh[4], qs[16]                               d * (q - 16), q = 5 bits
    Q5_1    32   24    d, m fp16, qh[4], qs[16]                            d * q + m
    IQ4_NL  32   18    d fp16, qs[16]                                      d * KV[q], q = 4 bits
    Q2_K   256   84    scales[16] (4-bit sc | 4-bit m << 4), qs[64], d, dmin  (d sc) q - (dmin m), q = 2 bits, per 16
    Q3_K   256  110    hmask[32], qs[64], scales[12] (6-bit), d            (d (sc - 32)) q, q = 3 bits - 4, per 16
    Q4_K   256  144    d, dmin, scales[12] (6-bit sc, m per 32), qs[128]   (d sc) q - (dmin m), q = 4 bits, per 32
    Q5_K   256  176    d, dmin, scales[12], qh[32], qs[128]                (d sc) q - (dmin m), q = 5 bits, per 32
    Q6_K   256  210    ql[128], qh[64], scales[16] int8, d                 (d sc) (q - 32), q = 6 bits, per 16
    IQ4_XS 256  136    d, scales_h u16, scales_l[4], qs[128]               (d (ls - 32)) KV[q], per 32
    MXFP4   32   17    e u8 (E8M0), qs[16]                                 2^(e - 128) * KVM[q], q = 4 bits

KV is IQ4_NL's 16-value codebook; KVM is MXFP4's, E2M1's values doubled (so integers: 0 1 2 3 4 6 8 12 and their
negatives), its scale therefore half the E8M0 exponent's 2^(e - 127): a power of two from 2^-128 (e 0 and 1 give
fp32 subnormals) to 2^127 (e = 255: no NaN, as ggml's ggml_e8m0_to_fp32_half), exact in fp32 but not in fp16 — held
as the exponent byte, and d * KVM[q] is one exact product unless it overflows (2 * 2^127 > fp32's max: inf, as gguf).
Q4_0, Q4_1 and Q8_0 are lowbit's own int4/int8 layouts too
(quant/ggml.py moves them there); they are here for weights fused with rows of another type (a QKV of
Q5_0 Q and K rows and Q8_0 V rows, in llama.cpp's Q4_K_M mix). Codes of a sub-block of 32 sit in one run of 16 bytes (Q5_0,
Q5_1, IQ4_NL, IQ4_XS, MXFP4: element j low nibble, j + 16 high) or of 32 bytes shared by 64 elements
(Q4_K, Q5_K, Q6_K's ql: j low, j + 32 high); Q2_K/Q3_K/Q6_K spread 2-bit planes over 128 elements.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

# qtype number (GGML's, as gguf.GGMLQuantizationType) → (name, values per block, bytes per block)
BLOCKS = MappingProxyType({2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
                           12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
                           20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136), 39: ("MXFP4", 32, 17)})
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4 = 39
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # E2M1 x 2 (gguf.quants.MXFP4.kvalues)


def row_bytes(qtype: int, K: int) -> int:
    _, qk, nb = BLOCKS[qtype]
    return K // qk * nb


def check_rows(data: torch.Tensor | None, qtype: int, K: int) -> None:
    """A ValueError unless data (or None) is uint8 [N, row_bytes(qtype, K)] of whole blocks: what the
    kernels read."""
    if data is None:
        return
    name, qk, nb = BLOCKS[qtype]
    if K % qk or data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != K // qk * nb:
        raise ValueError(f"{name} layout: rows of {K} values need {K // qk * nb} bytes of whole {qk}-value "
                         f"blocks, got {tuple(data.shape)} {data.dtype}")


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] → fp32 [..., 1] (little-endian fp16)."""
    return b.contiguous().view(torch.float16).float()


def _bits(b: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """uint8 [..., n] → [..., len(shifts), n]: (b >> s) & mask for each shift."""
    return torch.stack([(b >> s) & mask for s in shifts], dim=-2)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [B, S, n] → [B, S, 2 n]: the n low nibbles, then the n high ones."""
    return _bits(qs, [0, 4], 0xF).flatten(-2)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes [B, 12] → 6-bit scales and mins [B, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_0(b):
    d = _f16(b[:, 0:2])
    return d * (_nibbles(b[:, None, 2:18]).reshape(-1, 32).to(torch.int8) - 8).float()


def _q4_1(b):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return d * _nibbles(b[:, None, 4:20]).reshape(-1, 32).float() + m


def _q8_0(b):
    return _f16(b[:, 0:2]) * b[:, 2:34].contiguous().view(torch.int8).float()


def _q5_0(b):
    d, qh, qs = _f16(b[:, 0:2]), b[:, 2:6], b[:, 6:22]
    hi = _bits(qh, list(range(8)), 1).transpose(1, 2).reshape(-1, 32)  # [B, 32]: bit i of the little-endian u32
    q = _nibbles(qs[:, None, :]).reshape(-1, 32) | (hi << 4)
    return d * (q.to(torch.int8) - 16).float()


def _q5_1(b):
    d, m, qh, qs = _f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:8], b[:, 8:24]
    hi = _bits(qh, list(range(8)), 1).transpose(1, 2).reshape(-1, 32)
    q = (_nibbles(qs[:, None, :]).reshape(-1, 32) | (hi << 4)).float()
    return d * q + m


def _iq4_nl(b):
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, None, 2:18]).reshape(-1, 32).long()
    return d * torch.tensor(KVALUES, dtype=torch.int8)[q].float()


def _q2_k(b):
    scales, qs, d, dmin = b[:, 0:16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).float()).reshape(-1, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(-1, 16, 1)
    q = _bits(qs.reshape(-1, 2, 32), [0, 2, 4, 6], 3).reshape(-1, 16, 16).float()  # [B, 2 x 4 shifts, 32]
    return (dl * q - ml).reshape(-1, 256)


def _q3_k(b):
    hmask, qs, sb, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    lo = _bits(sb[:, 0:8], [0, 4], 0xF).reshape(-1, 16)
    hi = _bits(sb[:, 8:12], [0, 2, 4, 6], 3).reshape(-1, 16)
    sc = ((lo | (hi << 4)).to(torch.int8) - 32).float()
    dl = (d * sc).reshape(-1, 16, 1)
    ql = _bits(qs.reshape(-1, 2, 32), [0, 2, 4, 6], 3).reshape(-1, 16, 16)
    qh = _bits(hmask, list(range(8)), 1).reshape(-1, 16, 16) ^ 1  # the -4 applies where the mask bit is 0
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(-1, 256)


def _q45_k(b, five: bool):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.float()).reshape(-1, 8, 1)
    dm = (dmin * mn.float()).reshape(-1, 8, 1)
    qs = b[:, 48:176] if five else b[:, 16:144]
    q = _nibbles(qs.reshape(-1, 4, 32)).reshape(-1, 8, 32)
    if five:
        q = q | (_bits(b[:, 16:48], list(range(8)), 1).reshape(-1, 8, 32) << 4)
    return (dl * q.float() - dm).reshape(-1, 256)


def _q6_k(b):
    ql, qh, scales, d = b[:, 0:128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    dl = (d * scales.contiguous().view(torch.int8).float()).reshape(-1, 16, 1)
    lo = _nibbles(ql.reshape(-1, 2, 64)).reshape(-1, 8, 32)
    hi = _bits(qh.reshape(-1, 2, 32), [0, 2, 4, 6], 3).reshape(-1, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
    return (dl * q).reshape(-1, 256)


def _iq4_xs(b):
    d, sh, sl, qs = _f16(b[:, 0:2]), b[:, 2:4].contiguous().view(torch.int16).int() & 0xFFFF, b[:, 4:8], b[:, 8:136]
    lo = _bits(sl, [0, 4], 0xF).transpose(1, 2).reshape(-1, 8)  # sub-block 2i: low nibble of byte i
    hi = torch.stack([(sh[:, 0] >> (2 * i)) & 3 for i in range(8)], dim=-1).to(torch.uint8)
    ls = ((lo | (hi << 4)).to(torch.int8) - 32).float()
    dl = (d * ls).reshape(-1, 8, 1)
    q = _nibbles(qs.reshape(-1, 8, 16)).long()  # [B, 8, 32]
    return (dl * torch.tensor(KVALUES, dtype=torch.int8)[q].float()).reshape(-1, 256)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes (uint8, any shape) → fp32 2^(e - 128), built from its bits as ggml does: e >= 2 is
    the normal (e - 1) << 23, e = 1 and 0 the subnormals 2^-127 and 2^-128 (0x00200000 << e)."""
    e = e.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def _mxfp4(b):
    q = _nibbles(b[:, None, 1:17]).reshape(-1, 32).long()
    return e8m0_half(b[:, 0:1]) * torch.tensor(KVALUES_MXFP4, dtype=torch.int8)[q].float()


DECODERS = MappingProxyType({2: _q4_0, 3: _q4_1, 8: _q8_0, 6: _q5_0, 7: _q5_1, 10: _q2_k, 11: _q3_k, 12: lambda b: _q45_k(b, False),
                             13: lambda b: _q45_k(b, True), 14: _q6_k, 20: _iq4_nl, 23: _iq4_xs,
                             39: _mxfp4})


def ggml_dequant_ref(data: torch.Tensor, qtype: int, K: int) -> torch.Tensor:
    """uint8 [N, row_bytes(qtype, K)] → fp32 [N, K], computed as gguf.quants.dequantize computes it."""
    _, qk, nb = BLOCKS[qtype]
    N = data.shape[0]
    blocks = data.reshape(N * (K // qk), nb)  # [B, bytes]
    return DECODERS[qtype](blocks).reshape(N, K)
