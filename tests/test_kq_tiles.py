"""GGML's K-quant and 5-bit blocks repacked at load into lowbit's 16-row tiles (kernels/kq_mm.py, kind 4
of kernels/cpu_kernels.h; kernels/cpu_kq.c packs, cpu_kq_tiles.c multiplies), and Q4_0 / Q4_1 / Q8_0
packed by the same C repack into the int4 / int8 tiles.

Oracles: gguf.quants.dequantize for every weight (bit for bit), the torch spec of the layout
(kq_pack_ref, byte for byte) and of the integer arithmetic (kq_mm_fast_ref, bit for bit at every M and
on every instruction set), and kernels/int4_mm.py / int8_mm.py's own packers for the int4 / int8 tiles.
Blocks are random bytes with sane fp16 scales: every bit pattern of codes and sub-scales is a valid
block, and random ones reach corners (6-bit scales of 63, int8 scales of -128) a quantizer rarely
writes. The test of real files, made by llama.cpp's quantizer, is tests/test_ggml_kquants.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from lowbit.kernels.ggml_blocks import BLOCKS
from lowbit.kernels.int4_mm import int4_pack
from lowbit.kernels.int8_mm import int8_mm, int8_pack
from lowbit.kernels.kq_mm import KQ_TYPES, kq_mm, kq_mm_fast_ref, kq_pack, kq_pack_ref
from lowbit.kernels.segments import Segments
from lowbit.quant.ggml import relayout
from tests.helpers import Sequences

KQ = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1]


def _kernels():
    from lowbit.kernels.cpu_native import native

    k = native()
    if k is None:
        pytest.skip("the C kernels do not build here (tests/test_cpu_native.py says whether they must)")
    return k


def random_blocks(qtype: int, N: int, K: int, seed: int = 0) -> torch.Tensor:
    """uint8 [N, row bytes] of random blocks whose fp16 super-scales are finite and small."""
    g = torch.Generator().manual_seed(seed + 100 * qtype)
    _, qk, nb = BLOCKS[qtype]
    b = torch.randint(0, 256, (N, K // qk, nb), dtype=torch.uint8, generator=g)
    size = (N, K // qk)

    def f16(at: int, scale: float, signed: bool = False):
        v = (torch.randn(size, generator=g) if signed else torch.rand(size, generator=g)) * scale
        b[..., at:at + 2] = v.half().contiguous().view(torch.uint8).view(*size, 2)

    if qtype in (T.Q4_K, T.Q5_K):
        f16(0, 0.01), f16(2, 0.01)
    elif qtype == T.Q6_K:
        f16(208, 0.001)
    else:
        f16(0, 0.02)
        if qtype in (T.Q5_1, T.Q4_1):
            f16(2, 0.05, signed=True)
    return b.reshape(N, -1).contiguous()


def _gguf(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(blocks.numpy(), T(qtype)).astype(np.float32))


@pytest.mark.parametrize("qtype", KQ)
@pytest.mark.parametrize("N", [48, 37])
def test_tiles_are_the_layouts_bytes_and_hold_ggufs_weights(qtype, N):
    """The C repack writes kq_pack_ref's bytes (N = 37: a last tile padded to 16 rows; Q5_0 with three
    groups: an odd last unit), holds the file's bytes (Q6_K: its header padded to a 64-byte line), and
    every row it gives back — the exact path's ranges and the embedding's lookups — is gguf's, bit for bit."""
    k = _kernels()
    K = 768 if KQ_TYPES[qtype][0] == 256 else 96
    blocks = random_blocks(qtype, N, K)
    w = kq_pack(blocks, qtype, K, native=k)
    assert torch.equal(w.data, kq_pack_ref(blocks, qtype, K))
    if N % 16 == 0 and qtype != T.Q5_0:  # Q5_0's three groups: the odd one takes a line of its own
        assert w.data.numel() == blocks.numel() * ((32 + 256 + 32 + 8 * 384) / (16 * 210) if qtype == T.Q6_K else 1)
    want = _gguf(blocks, qtype)
    assert torch.equal(w.dequantize_rows(0, N), want)
    assert torch.equal(w.dequantize_rows(5, 21), want[5:21])
    ids = torch.tensor([N - 1, 0, 17, 17])
    assert torch.equal(w.rows(ids), want[ids])
    with pytest.raises(ValueError, match="outside"):
        w.rows(torch.tensor([N + 16]))


@pytest.mark.parametrize("qtype", KQ)
def test_rows_are_the_integer_spec_at_every_M_on_every_isa(qtype):
    """Each instruction set gives kq_mm_fast_ref's bits for every row at M = 1..20 and 64, and a row's
    result does not depend on M (prompt rows and decode rows run the same arithmetic); a zero row, a
    zero block and a row of tiny values among them."""
    k = _kernels()
    K = 512 if KQ_TYPES[qtype][0] == 256 else 96
    N = 48
    blocks = random_blocks(qtype, N, K, seed=1)
    w = kq_pack(blocks, qtype, K, native=k)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, K, generator=g) * 3
    x[2], x[5, :32], x[7] = 0, 0, x[7] * 1e-30
    want = kq_mm_fast_ref(x, blocks, qtype)
    exact = x @ _gguf(blocks, qtype).T
    assert ((want - exact).norm() / exact.norm()) < 1e-4  # 16-bit activation codes: ~2e-5 here
    for name in k.isas:
        w.native, w.desc = k.with_isa(name), None
        for M in [*range(1, 21), 64]:
            assert torch.equal(kq_mm(x[:M], w, False), want[:M]), (name, M)
    assert torch.equal(kq_mm(x[:3], w, True), torch.nn.functional.linear(
        torch.nn.functional.pad(x[:3], (0, 0, 0, 13)), _gguf(blocks, qtype))[:3])  # exact: fp32 GEMM, 16 rows


@pytest.mark.parametrize("qtype,N", [(T.Q4_0, 40), (T.Q4_1, 48), (T.Q8_0, 37)])
def test_q4_0_q4_1_q8_0_repack_into_the_int4_and_int8_tiles(qtype, N):
    """The C repack of Q4_0 / Q4_1 / Q8_0 blocks (what a load does, from the file) writes the bytes that
    relaying them into int4 / int8 and packing those gives (kernels/int4_mm.py int4_pack, int8_mm.py
    int8_pack), padding rows included."""
    from lowbit.quant.ggml_tiles import relaid_tiles

    k = _kernels()
    K = 96
    blocks = random_blocks(qtype, N, K, seed=3)
    got = relaid_tiles([blocks], int(qtype), K, k)
    r = relayout(blocks.numpy(), qtype, N, K)
    want = int8_pack(r.qweight, r.scales, K, native=k) if qtype == T.Q8_0 else \
        int4_pack(r.codes(), r.scales, r.mins, 32, K, native=k)
    assert torch.equal(got.data, want.data)
    assert (got.group_size if qtype != T.Q8_0 else got.group, got.out_features) == \
        (want.group_size if qtype != T.Q8_0 else want.group, want.out_features)


def test_a_repack_reads_the_rows_from_the_file_in_the_order_asked(tmp_path):
    """Rows still in the file (the loader's TensorRows: path, offset, row order) pack to the same tiles
    as the same rows permuted in memory — tiles whose rows lie within a window of the file (one read)
    and tiles whose rows lie far apart (a read each) — and a file cut short is an OSError, not garbage."""
    from lowbit.kernels.kq_mm import tiles_pack_rows
    from lowbit.kernels.tile_layout import tile_bytes

    k = _kernels()
    K, N = 512, 320  # a random order: most tiles span more than the C repack's 256-row window
    blocks = random_blocks(T.Q4_K, N, K, seed=4)
    path = tmp_path / "rows.bin"
    path.write_bytes(b"x" * 1000 + blocks.numpy().tobytes())
    shuffled = [r for r in torch.randperm(N, generator=torch.Generator().manual_seed(5)).tolist()
                if not 100 <= r < 116]
    perm = torch.tensor(shuffled[:16] + list(range(100, 116)) + shuffled[16:])  # tile 1: consecutive rows

    class Rows:  # what runtime/load/gguf.py TensorRows gives the packer
        def __init__(self, n, offset=1000):
            self.path, self.offset, self.N, self.perm = str(path), offset, n, perm[:n].contiguous()

    size = tile_bytes(K // 256, 256, 8 * 256)
    from_file, n = tiles_pack_rows([Rows(N)], int(T.Q4_K), K, size, k)
    in_memory, _ = tiles_pack_rows([blocks[perm].contiguous()], int(T.Q4_K), K, size, k)
    assert n == N and torch.equal(from_file, in_memory)
    path.write_bytes(path.read_bytes()[:1000 + 10 * blocks.shape[1]])
    with pytest.raises(OSError, match="short"):
        tiles_pack_rows([Rows(N)], int(T.Q4_K), K, size, k)


def test_runs_of_two_types_multiply_as_one():
    """A fused weight whose rows come in runs of different types (Q4_K, then Q6_K, then Q8_0 in the int8
    tiles) gives each run's own rows, bit for bit, on the fast path and on the exact one."""
    from lowbit.quant.ggml_tiles import relaid_tiles

    k = _kernels()
    K = 256
    parts = [kq_pack(random_blocks(T.Q4_K, 32, K, 6), int(T.Q4_K), K, native=k),
             kq_pack(random_blocks(T.Q6_K, 16, K, 7), int(T.Q6_K), K, native=k),
             relaid_tiles([random_blocks(T.Q8_0, 24, K, 8)], int(T.Q8_0), K, k)]
    seg = Segments(parts, [kq_mm, kq_mm, int8_mm], k)
    assert seg.out_features == 72
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(9))
    for exact in (False, True):
        want = torch.cat([mm(x, p, exact) for mm, p in zip(seg.matmuls, parts)], dim=-1)
        assert torch.equal(seg.matmul(x, exact), want)
    with pytest.raises(ValueError, match="whole 16-row tiles"):
        Segments([parts[2], parts[0]], [int8_mm, kq_mm], k)


def _kquant_model():
    """A tiny Llama whose matrices are GGML blocks (random), Q and K in Q4_K, V in Q6_K (a fused QKV of two
    runs), gate Q4_K and up Q5_K, O Q5_K, down Q6_K: every type of the tiles in a block, as a CPU model."""
    from lowbit.models.backend import torch_backend
    from lowbit.models.config import LlamaConfig
    from lowbit.models.llama import Llama
    from lowbit.quant.ggml_block import GgmlWeight, block_spec

    cfg = LlamaConfig(arch="llama", dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, hidden_dim=512,
                      vocab_size=80, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64, tie_embeddings=False)
    seed = iter(range(1000))

    def m(qtype, n, kk):
        return GgmlWeight(block_spec(int(qtype)), kk, random_blocks(qtype, n, kk, next(seed)))

    w = {"embed": m(T.Q4_K, 80, 256), "output": m(T.Q6_K, 80, 256), "norm": torch.ones(256)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        w |= {p + "attn_norm": torch.ones(256), p + "ffn_norm": torch.ones(256), p + "wq": m(T.Q4_K, 256, 256),
              p + "wk": m(T.Q4_K, 128, 256), p + "wv": m(T.Q6_K, 128, 256), p + "wo": m(T.Q5_K, 256, 256),
              p + "w_gate": m(T.Q4_K, 512, 256), p + "w_up": m(T.Q5_K, 512, 256), p + "w_down": m(T.Q6_K, 256, 512)}
    return Llama(cfg, w, torch_backend()).eval()


def test_a_kquant_model_runs_fused_blocks_and_prompt_rows_do_not_depend_on_their_company():
    """Every block of a K-quant model takes the fused C path (mixed-type QKV and gate+up as chains), and
    its logits are the same whether its tokens run one at a time, as a 9-token prompt, or beside another
    sequence's rows — the integer kernels' rows do not depend on M — and close to the exact path's."""
    _kernels()
    model = _kquant_model()
    assert all(b.fused is not None for b in model.layers) and model.fused_layers is not None
    ids = torch.randint(0, 80, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        one = Sequences(model, 1, 12)
        alone = torch.cat([one.step(ids[:1, t:t + 1]) for t in range(9)], 1)  # decode steps: one C call each
        prompt = Sequences(model, 1, 12).step(ids[:1])  # a prompt: every block fused, M = 9
        both = Sequences(model, 2, 12).step(ids)
        exact = Sequences(model, 1, 12).step(ids[:1], exact=True)
    assert torch.equal(prompt, alone) and torch.equal(both[:1], alone)
    lp, lq = exact.double().log_softmax(-1), alone.double().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)  # per token, KL(exact || fast): 16-bit activation codes' rounding
    assert kl.mean() < 1e-5 and torch.isfinite(alone).all() and alone.std() > 0.1
