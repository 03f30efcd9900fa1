"""MXFP4 (GGML type 39: gpt-oss's experts) held losslessly at the file's size and multiplied by lowbit's
kernels: repacked into the CPU's 16-row tiles (kernels/kq_mm.py, cpu_kq.c, cpu_kq_tiles.c) where K is
whole 64-value groups, kept as the file's blocks otherwise (kernels/ggml_mm.py, cpu_ggml.c), decoded in
the Triton kernel on a GPU (kernels/ggml_triton.py).

Oracles: gguf.quants.dequantize for every weight, bit for bit, at every exponent byte (0 and 1 give fp32
subnormal scales, 255 overflows to inf as gguf does); gguf.quants.quantize for blocks a quantizer writes;
kq_pack_ref (byte for byte) and kq_mm_fast_ref (bit for bit, every M, every instruction set) for the tiles;
an fp64 product of gguf's weights for the tolerance of 16-bit activation codes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from lowbit.kernels.ggml_blocks import ggml_dequant_ref
from lowbit.kernels.ggml_mm import GgmlPacked, ggml_mm, ggml_pack
from lowbit.kernels.kq_mm import KqPacked, kq_mm, kq_mm_fast_ref, kq_pack, kq_pack_ref
from lowbit.quant.ggml import LOSSLESS, REQUANTIZED, load_matrix
from lowbit.quant.ggml_block import GgmlWeight

MX = int(T.MXFP4)


def blocks_of(N: int, K: int, seed: int, exps: tuple[int, int] = (117, 127)) -> torch.Tensor:
    """uint8 [N, K / 32 * 17] of random blocks: every nibble, exponents drawn from [exps[0], exps[1]) (the
    default gives scales 2^-11..2^-2, a trained layer's range)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(N, K // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(*exps, size=(N, K // 32))
    return torch.from_numpy(raw.reshape(N, -1))


def gguf_weights(blocks: torch.Tensor) -> torch.Tensor:
    N = blocks.shape[0]
    with np.errstate(over="ignore"):  # exponent 255 times a code of 2 or more: inf, as in gguf
        return torch.from_numpy(quants.dequantize(blocks.numpy().reshape(-1), T.MXFP4).astype(np.float32)).view(N, -1)


def test_it_is_kept_losslessly_not_requantized():
    assert T.MXFP4 in LOSSLESS and T.MXFP4 not in REQUANTIZED and LOSSLESS[T.MXFP4].name == "MXFP4"


def test_every_exponent_decodes_as_gguf_in_every_decoder(c_kernels):
    """All 256 exponent bytes with every code: the torch spec, the blocks' C rows and the tiles' C rows (the
    exact path's ranges and the embedding's lookups) equal gguf bit for bit — subnormal scales and inf too."""
    native = c_kernels.native()
    N, K = 64, 128  # 256 blocks: block i has exponent i
    b = blocks_of(N, K, seed=0)
    b.view(N, K // 32, 17)[..., 0] = torch.arange(256, dtype=torch.uint8).view(N, K // 32)
    want = gguf_weights(b)
    assert torch.isinf(want).any() and (want[want != 0].abs().min() < 2.0 ** -126)  # both ends reached
    w = load_matrix(b.numpy(), T.MXFP4, N, K, None)
    assert isinstance(w, GgmlWeight) and w.spec.name == "MXFP4" and w.nbytes == N * K // 32 * 17
    assert torch.equal(w.dequantize(), want) and torch.equal(ggml_dequant_ref(b, MX, K), want)
    assert torch.equal(ggml_pack(b, MX, K, native=native).dequantize_rows(0, N), want)
    t = kq_pack(b, MX, K, native=native)
    assert torch.equal(t.dequantize_rows(0, N), want) and torch.equal(t.dequantize_rows(9, 40), want[9:40])
    ids = torch.tensor([63, 0, 17, 17])
    assert torch.equal(t.rows(ids), want[ids])


def test_a_quantizers_blocks_decode_as_gguf():
    """What gguf.quants.quantize writes (its exponent from each block's max): the spec is gguf's decoding of it."""
    x = (np.random.default_rng(1).standard_normal((8, 320)) * 0.02).astype(np.float32)
    raw = quants.quantize(x, T.MXFP4)
    assert raw.shape == (8, 320 // 32 * 17) and raw.dtype == np.uint8
    got = load_matrix(raw, T.MXFP4, 8, 320, None).dequantize()
    assert torch.equal(got, gguf_weights(torch.from_numpy(raw)))
    assert (got - torch.from_numpy(x)).norm() / np.linalg.norm(x) < 0.2  # 4-bit E2M1: a real quantization


@pytest.mark.parametrize("N,K", [(48, 256), (37, 192), (16, 2880)])
def test_tiles_are_the_layouts_bytes_at_the_files_size(N, K, c_kernels):
    """The C repack writes kq_pack_ref's bytes; they hold the file's 17 bytes per 32 weights (4.25 bits), plus
    32 bytes per 16 rows where K / 64 is odd (K = 192; gpt-oss's K = 2880: 1.0013x) and zero rows to 16."""
    b = blocks_of(N, K, seed=2)
    w = kq_pack(b, MX, K, native=c_kernels.native())
    assert torch.equal(w.data, kq_pack_ref(b, MX, K))
    tiles, odd = -(-N // 16), (K // 64) % 2
    assert w.data.numel() == tiles * 16 * K // 32 * 17 + tiles * 32 * odd


def _x(M: int, K: int, seed: int) -> torch.Tensor:
    """Activations with a zero row, a zero block and a row of tiny values among them; from 10 rows, two that
    fill the AVX2 kernel's int16 pair sums most: every code 32512 (plane h = 127), and codes 32384 (h = 127,
    l = -128) but one 32512 per block."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed)) * 3
    x[2], x[5, :32], x[7] = 0, 0, x[7] * 1e-30
    if M >= 10:
        x[8], x[9] = 1.0, 32384 / 32512
        x[9, ::32] = 1.0
    return x


def test_tiles_rows_are_the_integer_spec_at_every_M_on_every_isa(c_kernels):
    """Every instruction set the library runs here gives kq_mm_fast_ref's bits at M = 1..17 and 64 (8-row
    prompt passes and their remainders), so a row does not depend on its company; rows 0-3 hold the
    extreme exponents (0, 1: subnormal scales; 2; 200: 2^72), the rest a trained layer's, within the
    16-bit activation codes' rounding of the fp64 product."""
    k = c_kernels.native()
    N, K = 37, 192  # a last tile of 5 rows, an odd last group
    b = blocks_of(N, K, seed=3)
    for row, e in enumerate((0, 1, 2, 200)):
        b.view(N, K // 32, 17)[row, :, 0] = e
    b.view(N, K // 32, 17)[4:6, :, 1:] = torch.tensor([0x77, 0xFF], dtype=torch.uint8)[:, None, None]  # c = 12, -12
    w = kq_pack(b, MX, K, native=k)
    x = _x(64, K, seed=4)
    want = kq_mm_fast_ref(x, b, MX)
    exact = x.double() @ gguf_weights(b).double().T
    live = exact[:, 4:]
    assert ((want[:, 4:] - live).norm() / live.norm()) < 1e-4  # ~2e-5: 16-bit activation codes
    assert torch.isfinite(want).all() and not torch.equal(want, exact.float())
    for name in k.isas:
        w.native, w.desc = k.with_isa(name), None
        for M in [*range(1, 18), 64]:
            assert torch.equal(kq_mm(x[:M], w, False), want[:M]), (name, M)
    assert torch.equal(kq_mm(x[:3], w, True), torch.nn.functional.linear(
        torch.nn.functional.pad(x[:3], (0, 0, 0, 13)), gguf_weights(b))[:3])  # exact: fp32 GEMM, 16 rows


def test_a_decode_shaped_matmul_of_quantized_weights(c_kernels):
    """gpt-oss's K = 2880 (45 groups of 64), weights from gguf's quantizer: the spec's bits at M = 1..5 on each
    instruction set, within 1e-4 of the fp64 product."""
    k = c_kernels.native()
    N, K = 40, 2880
    raw = quants.quantize((np.random.default_rng(5).standard_normal((N, K)) * 0.02).astype(np.float32), T.MXFP4)
    b = torch.from_numpy(raw)
    x = _x(8, K, seed=6)[[0, 2, 3, 5, 7]]  # with a zero row, a zero block, tiny values
    want = kq_mm_fast_ref(x, b, MX)
    exact = x.double() @ gguf_weights(b).double().T
    assert (want - exact).norm() / exact.norm() < 1e-4
    for name in k.isas:
        w = kq_pack(b, MX, K, native=k.with_isa(name))
        for M in range(1, 6):
            assert torch.equal(kq_mm(x[:M], w, False), want[:M]), (name, M)


def test_k_not_whole_groups_of_64_multiplies_the_files_blocks(c_kernels):
    """K = 96 (three blocks): no tiles, the file's blocks (kind 3, cpu_ggml.c) — each row the same bits at every
    M and on every instruction set, within 1e-4 of the fp64 product; K = 192 packs into tiles."""
    from lowbit.quant.linear import cpu_kernels

    k = c_kernels.native()
    kernels = cpu_kernels(k)
    b = blocks_of(37, 96, seed=7)
    w = GgmlWeight(LOSSLESS[T.MXFP4], 96, b)
    p = kernels.pack(w)
    assert isinstance(p, GgmlPacked) and isinstance(kernels.pack(GgmlWeight(w.spec, 192, blocks_of(37, 192, 8))),
                                                    KqPacked)
    assert torch.equal(p.dequantize_rows(0, 37), gguf_weights(b))
    x = _x(17, 96, seed=9)
    y = ggml_mm(x, p, exact=False)
    exact = x.double() @ gguf_weights(b).double().T
    assert (y.double() - exact).norm() / exact.norm() < 1e-4
    for name in k.isas:
        q = ggml_pack(b, MX, 96, native=k.with_isa(name))
        for M in range(1, 18):
            assert torch.equal(ggml_mm(x[:M], q, exact=False), y[:M]), (name, M)


def test_triton_kernel_matches_the_spec(c_kernels):
    """The Triton kernel (under the interpreter without CUDA) against the spec: fp32 activations take the IEEE
    dot, per row within 1e-5 of the fp64 product — rows of subnormal scales (exponents 0, 1) and of 2^72
    included — and fp16 activations the same on x rounded to fp16."""
    pytest.importorskip("triton")
    from lowbit.kernels.ggml_triton import ggml_triton_mm, ggml_triton_pack, ggml_triton_rows
    from lowbit.kernels.triton_import import interpreting

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not interpreting():
        pytest.skip("no GPU, and TRITON_INTERPRET=0 (conftest sets it)")
    N, K = 40, 96
    b = blocks_of(N, K, seed=10)
    for row, e in enumerate((0, 1, 2, 127, 200)):
        b.view(N, K // 32, 17)[row, :, 0] = e
    ref = ggml_dequant_ref(b, MX, K).to(device)
    w = ggml_triton_pack(b, MX, K).to(device)
    x = torch.randn(3, K, device=device) * 8
    for xin in (x, x.half()):
        want = xin.double() @ ref.double().T  # [3, N]
        got = ggml_triton_mm(xin, w, out_dtype=torch.float32).double()
        assert ((got - want).abs().amax(0) <= 1e-5 * want.abs().amax(0)).all(), xin.dtype
    ids = torch.tensor([0, 1, 39, 1], device=device)
    assert torch.equal(ggml_triton_rows(w, ids), ref[ids])


def test_a_gguf_with_mxfp4_matrices_loads_them_losslessly(tmp_path, c_kernels):
    """A file written by gguf's writer whose FFN matrices are MXFP4 (gguf's quantizer): no "requantized" note;
    each matrix stays in the file until packed, holds the file's bytes and gguf's values; any rows of it — an
    expert's range, 16-row aligned or not — pack from the file into tiles of exactly those rows; and the whole
    model loads at the file's size, every block fused on the C path, its fast logits within 1e-5 KL of exact."""
    import torch.nn.functional as F

    from lowbit.models.backend import torch_backend
    from lowbit.quant.ggml_tiles import cpu_pack_rows
    from lowbit.runtime.load.gguf import gguf_tensor_bytes, load_gguf
    from lowbit.runtime.load.loader import load
    from tests.helpers import forward
    from tests.test_cli import tiny_tensors, write_tiny_gguf

    native = c_kernels.native()
    tensors, raw = tiny_tensors(), {}
    rng = np.random.default_rng(11)
    for name in [n for n in tensors if "ffn_" in n and n.endswith("weight") and "norm" not in n]:
        shape = tensors[name][0].shape[0], (64 if "down" not in name else 128)
        raw[name] = quants.quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), T.MXFP4)
        tensors[name] = raw[name], T.MXFP4
    path = write_tiny_gguf(tmp_path / "mxfp4.gguf", tensors=tensors)
    notes: list[str] = []
    _, weights, _ = load_gguf(path, None, note=notes.append)
    assert notes == []
    w = weights["layers.1.w_up"]  # [128, 64]
    want = gguf_weights(torch.from_numpy(raw["blk.1.ffn_up.weight"]))
    assert w.spec.name == "MXFP4" and w.unread and w.nbytes == raw["blk.1.ffn_up.weight"].nbytes
    for rows in (torch.arange(32, 64), torch.arange(5, 40)):  # an expert's rows, in file order
        part = w.rows(rows)
        packed = cpu_pack_rows([part], native)
        assert isinstance(packed, KqPacked) and part.unread  # read by C from the file
        assert torch.equal(packed.dequantize_rows(0, len(rows)), want[rows])
    assert torch.equal(w.dequantize(), want)
    lm = load(str(path), "auto", progress=False, backend=torch_backend(native))
    assert lm.weight_bytes <= 1.05 * gguf_tensor_bytes(path) and lm.model.fused_layers is not None
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        exact, fast = forward(lm.model, ids, exact=True)[0], forward(lm.model, ids)[0]
    kl = F.kl_div(F.log_softmax(fast.double(), -1), F.log_softmax(exact.double(), -1), log_target=True,
                  reduction="none").sum(-1)
    assert kl.mean() < 1e-5 and not torch.equal(fast, exact), float(kl.mean())
