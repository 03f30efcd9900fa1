"""The GPU matmul's operand tile (kernels/wq_tile.py): its memory order, and its PTX decode.

The PTX only runs on an NVIDIA GPU (the interpreter decodes with integer ops instead), so here it
runs on a small emulator of the few instructions it uses — PTX ISA semantics, written from the ISA
manual: prmt's byte select, lop3's truth table, f16x2 arithmetic and the bf16x2 conversion rounded
once — over every byte value in every position of the register, against the codes the tile's
docstring defines.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from lowbit.kernels import wq_tile
from lowbit.kernels.wq_tile import int4_offsets, int8_offsets, tile_codes, tile_pack_int4, tile_pack_int8

M32 = 0xFFFFFFFF


def _f16(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def _to_f16(v: float) -> int:
    return int(np.array([v], dtype=np.float16).view(np.uint16)[0])


def _bf16(bits: int) -> float:
    return _f32(bits << 16)


def _to_bf16(v: float) -> int:  # round to nearest even, as the .rn instructions do
    return int(torch.tensor([v], dtype=torch.float64).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF


def _f32(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def _to_f32(v: float) -> int:
    return int(np.array([v], dtype=np.float32).view(np.uint32)[0])


def _pairs(op, *regs, get, put):
    lo = put(op(*(get(r & 0xFFFF) for r in regs)))
    hi = put(op(*(get(r >> 16) for r in regs)))
    return lo | hi << 16


def run_ptx(asm: str, inputs: dict[int, int]) -> dict[int, int]:
    """Run `asm` (one { } block) with $N registers preset → every $N register after it."""
    regs: dict[str, int] = {f"${k}": v for k, v in inputs.items()}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) & M32 if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok) else regs[tok]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *args = [a.strip() for a in rest.split(",")]
        a = [val(t) for t in args]
        if op == "mov.b32":
            r = a[0]
        elif op == "prmt.b32":
            pool = [(a[0] >> 8 * i) & 0xFF for i in range(4)] + [(a[1] >> 8 * i) & 0xFF for i in range(4)]
            r = sum(pool[(a[2] >> 4 * i) & 7] << 8 * i for i in range(4))
        elif op == "lop3.b32":
            r = 0
            for i in range(8):
                if a[3] >> i & 1:
                    r |= (a[0] if i & 4 else ~a[0]) & (a[1] if i & 2 else ~a[1]) & (a[2] if i & 1 else ~a[2])
        elif op == "shr.u32":
            r = a[0] >> a[1]
        elif op == "xor.b32":
            r = a[0] ^ a[1]
        elif op == "sub.f16x2":
            r = _pairs(lambda x, y: x - y, a[0], a[1], get=_f16, put=_to_f16)
        elif op == "fma.rn.f16x2":
            r = _pairs(lambda x, y, z: x * y + z, *a, get=_f16, put=_to_f16)
        elif op == "add.f32":
            r = _to_f32(_f32(a[0]) + _f32(a[1]))
        elif op == "cvt.rn.bf16x2.f32":  # d.hi from the first source, d.lo from the second
            r = _to_bf16(_f32(a[0])) << 16 | _to_bf16(_f32(a[1]))
        else:
            raise AssertionError(f"the emulator does not know {op}")
        regs[dst] = r & M32
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


def _registers() -> list[int]:
    """Every byte value in every byte of the register (1024 registers), their neighbours random."""
    g = torch.Generator().manual_seed(0)
    out = []
    for pos in range(4):
        for v in range(256):
            r = int(torch.randint(0, 2**32, (1,), generator=g, dtype=torch.int64))
            out.append((r & ~(0xFF << 8 * pos) | v << 8 * pos) & M32)
    return out


@pytest.mark.parametrize("dtype,sym", [("f16", False), ("f16", True), ("bf16", False)])
def test_int4_ptx_decodes_each_nibble_alone(dtype, sym):
    """A register holds two 16-bit words of four codes each; output j is the pair (nibble j of the
    low word, nibble j of the high word): fp16 the code (minus 8 when symmetric), bf16 the code plus
    128 in either case (the matmul takes the bias off)."""
    asm = getattr(wq_tile, f"INT4_{dtype.upper()}{'_SYM' if sym else ''}").value
    get = _f16 if dtype == "f16" else _bf16
    off = 8 if sym else (-128 if dtype == "bf16" else 0)
    for r in _registers():
        out = run_ptx(asm, {4: r})
        word = [r & 0xFFFF, r >> 16]
        got = [get((out[j] >> 16 * h) & 0xFFFF) for j in range(4) for h in range(2)]
        want = [((word[h] >> 4 * j) & 0xF) - off for j in range(4) for h in range(2)]
        assert got == want, (hex(r), got, want)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_int8_ptx_decodes_each_byte_alone(dtype):
    asm = getattr(wq_tile, f"INT8_{dtype.upper()}").value
    get = _f16 if dtype == "f16" else _bf16
    for r in _registers():
        out = run_ptx(asm, {2: r})
        q = [((r >> 8 * i) & 0xFF) - (256 if (r >> 8 * i) & 0x80 else 0) for i in range(4)]
        got = [get((out[j] >> 16 * h) & 0xFFFF) for j in range(2) for h in range(2)]
        assert got == q, (hex(r), got, q)


def test_the_emulator_itself():
    """Hand-computed cases of each instruction, so the emulator cannot agree with a wrong PTX by
    being wrong the same way."""
    assert run_ptx("prmt.b32 $0, $1, $2, 0x7170;", {1: 0x44332211, 2: 0x88776655})[0] == 0x88228811
    assert run_ptx("lop3.b32 $0, $1, 0x000f000f, 0x64006400, 0xea;", {1: 0x12345678})[0] == 0x64046408
    assert run_ptx("sub.f16x2 $0, $1, $2;", {1: 0x64056400, 2: 0x64006400})[0] == 0x45000000  # (0, 5)
    assert run_ptx("shr.u32 $0, $1, 12;", {1: 0x12345678})[0] == 0x00012345
    assert run_ptx("cvt.rn.bf16x2.f32 $0, $1, $2;", {1: 0x40000000, 2: 0x3F800000})[0] == 0x40003F80


def test_tiles_hold_the_documented_order():
    """Every code sits where the docstring puts it: nibble j of 16-bit word u of a tile row holds
    column 32 u3 + 16 j1 + 8 j0 + (u & 7), row T and word R of the loaded [128, 16] block being
    T = (k2, n0, n1, n2, n4, n5, n6), R = (k0, n3, k5, k1); and back again, for any rows, and int8
    likewise with T = (n0, n1, n2, n4, n5, k5, n6), R = (k0, n3, k3, k4, k1, k2)."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (256, 192), dtype=torch.uint8, generator=g)
    q = torch.randint(-128, 128, (256, 192), dtype=torch.int8, generator=g)
    tiles, q8 = tile_pack_int4(codes), tile_pack_int8(q)
    assert tiles.shape == (2, 3, 4096) and q8.shape == (2, 3, 8192)
    words = tiles.flatten().view(torch.int16).to(torch.int32) & 0xFFFF  # little-endian 16-bit words
    bit = lambda x, i: (x >> i) & 1  # noqa: E731
    num = lambda bits: sum(v << i for i, v in enumerate(bits))  # noqa: E731
    for n, k in [(0, 0), (5, 9), (127, 63), (128, 64), (200, 150), (255, 191), (77, 44)]:
        nl, kl = n % 128, k % 64
        block = (n // 128) * 3 + k // 64
        t = num([bit(kl, 2), *(bit(nl, i) for i in (0, 1, 2, 4, 5, 6))])
        r = num([bit(kl, 0), bit(nl, 3), bit(kl, 5), bit(kl, 1)])
        u = num([bit(kl, 0), bit(kl, 1), bit(kl, 2), bit(kl, 5)])  # the word's column bits
        j = num([bit(kl, 3), bit(kl, 4)])
        assert 32 * (u >> 3) + 16 * (j >> 1) + 8 * (j & 1) + (u & 7) == kl
        word = int(words[block * 2048 + t * 16 + r])
        assert (word >> 4 * j) & 0xF == int(codes[n, k]), (n, k)
        off, shift = int4_offsets(torch.tensor(n), torch.tensor(k), 3)
        assert (int(tiles.flatten()[off]) >> int(shift)) & 0xF == int(codes[n, k])
        t8 = num([*(bit(nl, i) for i in (0, 1, 2, 4, 5)), bit(kl, 5), bit(nl, 6)])
        r8 = num([bit(kl, 0), bit(nl, 3), bit(kl, 3), bit(kl, 4), bit(kl, 1), bit(kl, 2)])
        assert int(q8.flatten()[block * 8192 + t8 * 64 + r8]) == int(q[n, k]), (n, k)
    rows = torch.tensor([255, 0, 130, 130])
    n, k = torch.arange(256)[:, None], torch.arange(192)[None, :]
    assert torch.equal(tile_codes(tiles, 4), codes)
    assert torch.equal(tile_codes(tiles, 4, rows), codes[rows])
    off, shift = int4_offsets(n, k, 3)
    assert len(set((2 * off + shift // 4).flatten().tolist())) == 256 * 192  # every nibble once
    assert torch.equal(tile_codes(q8, 8), q) and torch.equal(tile_codes(q8, 8, rows), q[rows])
    assert len(set(int8_offsets(n, k, 3).flatten().tolist())) == 256 * 192
