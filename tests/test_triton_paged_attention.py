"""The KV cache's Triton kernels — quantize-on-write (kernels/kv_write.py) and paged attention over
the quantized pages (kernels/paged_attention.py) — against their `_ref` specs, and the specs against
the pool and attention the engine runs today (runtime/engine/kv_cache.py, models/attention.py) and an
independent oracle (SDPA over contiguous K/V).

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without
CUDA); on a GPU machine the `cuda` cases run and the `cpu` ones skip. Shapes are small and odd:
pages of 16 and 4 tokens, D = 64 and 16, 4 heads / 2 KV heads and 9 / 3 (SmolLM2's ratio, padded to
4 rows per token in the tile), contexts of 1, 5 and 37 tokens (partial last pages), decodes and
prefill chunks in one batch, pages scattered out of order over the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

from lowbit.kernels.kv_quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from lowbit.kernels.kv_side import KVSide
from lowbit.kernels.kv_write import kv_write, kv_write_ref
from lowbit.kernels.paged_attention import batch_tensors, paged_attention, paged_attention_ref, split_rows
from lowbit.kernels.triton_import import interpreting
from lowbit.models.attention import PagedAttention, PagedBatch
from lowbit.models.backend import torch_backend
from lowbit.quant.kv import KV_FORMATS, KVFormat
from lowbit.runtime.engine.kv_cache import KVPool

# (atol, rtol) of paged_attention's fp32 output against paged_attention_ref, by q's dtype. q of any
# dtype is exact in fp32 and both sides widen it first, so the dtype changes the inputs, not the
# arithmetic: both are fp32 throughout (IEEE fp32 dots) and differ by the online softmax's order of
# operations and, on the GPU, the approximate exp and fused multiply-adds — a few fp32 ulps. Measured
# under the interpreter: at most 2.3e-6 on outputs of magnitude up to 3 (2^-24 * 3 = 1.8e-7 an ulp).
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-5, 1e-5),
    torch.bfloat16: (1e-5, 1e-5),
}
DTYPES = list(TOL)
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreting(),
                                                 reason="CPU runs kernels only under TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
FORMATS = [KV_FORMATS[name] for name in ("f32", "f16", "k8v8", "k8v4", "k4v4")]
# (page_size, D, H, Hkv)
SHAPES = [(16, 64, 4, 2), (4, 16, 9, 3)]
# (context_len, query_len): decodes over 1, 5 and 37 cached tokens (37 = a partial last page of 16
# and of 4), a 6-token prefill chunk continuing 31 cached tokens, a fresh 5-token prefill.
SEQS = [(1, 1), (5, 1), (37, 1), (37, 6), (5, 5)]


def alloc_side(P: int, Hkv: int, page: int, D: int, bits: int, group: int, gen: torch.Generator,
               device) -> KVSide:
    """One pool side in runtime/engine/kv_cache.py's layout, filled with garbage — NaN scales and data, random
    codes — so that a kernel reading a slot it should not shows up as NaN or a wrong value."""
    nan = lambda *s, dtype=torch.float16: torch.full(s, float("nan"), dtype=dtype, device=device)  # noqa: E731
    if bits in (32, 16):
        return KVSide(bits, D, data=nan(P, Hkv, page, D, dtype=torch.float32 if bits == 32 else torch.float16))
    G = D // group
    scales = nan(P, Hkv, page, G)
    if bits == 8:
        codes = torch.randint(-128, 128, (P, Hkv, page, D), generator=gen, dtype=torch.int8).to(device)
        return KVSide(8, group, codes=codes, scales=scales)
    codes = torch.randint(0, 256, (P, Hkv, page, D // 2), generator=gen, dtype=torch.uint8).to(device)
    return KVSide(4, group, codes=codes, scales=scales, mins=nan(P, Hkv, page, G))


def copy_side(side: KVSide, device) -> KVSide:
    """The side with every tensor copied to `device` (a copy also where it is already there)."""
    return replace(side, **{name: t.to(device, copy=True) for name, t in side.tensors().items()})


# ---- kv_write -------------------------------------------------------------------------------------

# (bits, group before the cap at D): the float sides, one group per head, several groups, int4's pairs
WRITE_FORMATS = [(32, 0), (16, 0), (8, 64), (8, 16), (4, 32), (4, 8)]


def write_inputs(M, Hkv, D, page, P, *, gen, dtype):
    """x [M, Hkv, D] as a column slice of a wider buffer (strides ((Hkv + 1) D, D, 1)), scattered slots.
    Row 0 is all zeros (scale 0) and row 1 constant (int4: hi = lo, so hi - fp16(lo) may be < 0)."""
    wide = torch.randn(M, Hkv + 1, D, generator=gen) * 3
    wide[:, :, 5] *= 20  # an outlier channel sets its group's scale
    wide[0] = 0
    wide[1] = 0.1
    slots = torch.randperm(P * page, generator=gen)[:M]
    return wide.to(dtype)[:, 1:], slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("bits", "group"), WRITE_FORMATS)
@pytest.mark.parametrize(("page", "D", "H", "Hkv"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_matches_ref_bit_for_bit(device, bits, group, page, D, H, Hkv, dtype):
    group = D if bits >= 16 else min(group, D)
    gen = torch.Generator().manual_seed(bits * 100 + group + D)
    P, M = 7, 11
    x, slots = write_inputs(M, Hkv, D, page, P, gen=gen, dtype=dtype)
    want = alloc_side(P, Hkv, page, D, bits, group, gen, "cpu")
    got = copy_side(want, device)  # a copy, also on the CPU
    # The spec is the CPU's: torch on CUDA divides by a Python scalar as a multiply by its reciprocal
    # (kernels/kv_write.py), so the reference runs here whatever the kernel's device.
    kv_write_ref(x, slots, want, page)
    kv_write(x.to(device), slots.to(device), got, page)
    for name, t in want.tensors().items():  # every slot, bytewise: the written ones equal, the others untouched
        assert torch.equal(getattr(got, name).cpu().view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("device", DEVICES)
def test_kv_write_rounds_half_to_even(device):
    """Independent oracle, hand values: scale 1 (int8: amax 127; int4: lo 0, hi 15) puts the codes
    at x itself, and the halves round to even as torch.round does."""
    x8 = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    x4 = torch.tensor([0.0, 15.0, 0.5, 1.5, 2.5, 13.5, 14.5, 7.5])
    side8 = KVSide(8, 8, codes=torch.zeros(1, 1, 1, 8, dtype=torch.int8, device=device),
                   scales=torch.zeros(1, 1, 1, 1, dtype=torch.float16, device=device))
    side4 = KVSide(4, 8, codes=torch.zeros(1, 1, 1, 4, dtype=torch.uint8, device=device),
                   scales=torch.zeros(1, 1, 1, 1, dtype=torch.float16, device=device),
                   mins=torch.ones(1, 1, 1, 1, dtype=torch.float16, device=device))
    slot = torch.zeros(1, dtype=torch.int64, device=device)
    kv_write(x8.view(1, 1, 8).to(device), slot, side8, 1)
    kv_write(x4.view(1, 1, 8).to(device), slot, side4, 1)
    assert side8.codes.flatten().tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    assert side8.scales.item() == 1.0
    u = [0, 15, 0, 2, 2, 14, 14, 8]
    assert side4.codes.flatten().tolist() == [u[i] | u[i + 1] << 4 for i in range(0, 8, 2)]
    assert side4.scales.item() == 1.0 and side4.mins.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 4])
def test_kv_write_near_ties(device, bits):
    """Values on and a hair from the halfway points (k + 0.5) * d, d an fp16 scale that the group's
    amax reproduces exactly. Where d is not a power of 2, x * fl(1/d) lands an ulp or two from
    k + 0.5 and the reciprocal's and the product's roundings decide; where it is (every fourth
    group), x * (1/d) is an exact tie and half-to-even decides. 1024 values, codes equal to the spec's."""
    gen = torch.Generator().manual_seed(bits)
    M, Hkv, D, group = 16, 2, 32, 32
    scale = (torch.rand(M, Hkv, 1, generator=gen) * 0.1 + 0.01).half().float()
    scale[::4] = 2.0 ** -torch.randint(3, 7, scale[::4].shape, generator=gen).float()  # exact ties: 1/d exact
    levels = torch.randint(-126, 126, (M, Hkv, D), generator=gen) if bits == 8 else \
        torch.randint(0, 15, (M, Hkv, D), generator=gen)
    hair = (torch.rand(M, Hkv, D, generator=gen) - 0.5) * 4e-6 * (torch.rand(M, Hkv, D, generator=gen) < 0.5)
    x = (levels + 0.5 + hair) * scale
    x[..., 0] = (127 if bits == 8 else 0) * scale[..., 0]
    x[..., 1] = (-127 if bits == 8 else 15) * scale[..., 0]
    want = alloc_side(M, Hkv, 1, D, bits, group, gen, "cpu")
    got = copy_side(want, device)  # a copy, also on the CPU
    slots = torch.arange(M)
    kv_write_ref(x, slots, want, 1)
    kv_write(x.to(device), slots.to(device), got, 1)
    for name, t in want.tensors().items():
        assert torch.equal(getattr(got, name).cpu(), t), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_kv_write_is_kvpool_write(device, fmt):
    """Wired as KVPool.write would use it: rotate (x @ rot, fp32) when the format does, then kv_write
    per side with the format's capped group — the same bytes as the pool's own write."""
    gen = torch.Generator().manual_seed(11)
    D, Hkv, M = 64, 3, 9
    pool = KVPool(fmt, n_layers=1, n_kv_heads=Hkv, head_dim=D, num_pages=5, page_size=4)
    k, v = torch.randn(M, Hkv, D, generator=gen), torch.randn(M, Hkv, D, generator=gen)
    slots = torch.randperm(20, generator=gen)[:M]
    sides = {name: copy_side(pool.side(0, name), device) for name in ("k", "v")}
    pool.write(0, k, v, slots)
    for name, x in (("k", k), ("v", v)):
        if sides[name].bits < 16 and pool.rot is not None:
            x = x.float() @ pool.rot
        kv_write(x.to(device), slots.to(device), sides[name], pool.page_size)
        for key, t in sides[name].tensors().items():
            assert torch.equal(t.cpu(), getattr(pool.side(0, name), key)), (name, key)


@pytest.mark.parametrize("device", DEVICES)
def test_kv_write_bad_inputs(device):
    side = alloc_side(2, 2, 4, 64, 8, 64, torch.Generator(), device)
    x, slots = torch.zeros(3, 2, 64, device=device), torch.arange(3, device=device)
    with pytest.raises(ValueError, match="x must be"):
        kv_write(x[0], slots, side, 4)
    with pytest.raises(ValueError, match="slots"):
        kv_write(x, slots.int(), side, 4)
    with pytest.raises(ValueError, match="page_size"):
        kv_write(x, slots, side, 16)
    with pytest.raises(ValueError, match="KV heads"):
        kv_write(torch.zeros(3, 3, 64, device=device), slots, side, 4)
    with pytest.raises(ValueError, match="holds"):
        kv_write(x, slots, replace(side, bits=4), 4)  # an int8 side written as int4
    with pytest.raises(ValueError, match="scales must be"):
        kv_write(x, slots, replace(side, group=32), 4)  # scales [.., 1] do not make groups of 32
    with pytest.raises(ValueError, match="divide"):
        kv_write(x, slots, replace(side, group=48), 4)
    with pytest.raises(ValueError, match="contiguous"):
        kv_write(torch.zeros(3, 64, 2, device=device).transpose(1, 2), slots, side, 4)
    f16 = alloc_side(2, 2, 4, 64, 16, 64, torch.Generator(), device)
    with pytest.raises(ValueError, match="data must be contiguous torch.float32"):
        kv_write(x, slots, replace(f16, bits=32), 4)  # fp16 data taken for an f32 side


# ---- paged_attention ------------------------------------------------------------------------------


@dataclass
class Batch:
    q: torch.Tensor  # [M, H, D]
    k: list[torch.Tensor]  # per sequence fp32 [ctx, Hkv, D] as written (before quantizing)
    v: list[torch.Tensor]
    k_side: KVSide
    v_side: KVSide
    tables: list[torch.Tensor]  # int64 page ids per sequence
    positions: torch.Tensor  # int64 [M]
    seqs: list[tuple[int, int]]

    def args(self, fmt: KVFormat, page: int) -> dict:
        D, device = self.q.shape[2], self.q.device
        cu, ctx, bt = batch_tensors([n for _, n in self.seqs], [c for c, _ in self.seqs], self.tables, device)
        return {"q": self.q, "k_side": self.k_side, "v_side": self.v_side, "cu_query_lens": cu,
                "context_lens": ctx, "positions": self.positions, "block_tables": bt, "page_size": page}


def make_batch(fmt: KVFormat, page: int, D: int, H: int, Hkv: int, seqs, *, gen, device,
               dtype=torch.float32, strided_q=False) -> Batch:
    """Every sequence's K/V already in the pool (this step's included), written by the spec through
    a block table that is a slice of a random permutation of the pool's pages (plus 3 spare pages
    left as garbage); q [M, H, D] for the positions ctx - n .. ctx - 1."""
    n_pages = [-(-c // page) for c, _ in seqs]
    P = sum(n_pages) + 3
    order = torch.randperm(P, generator=gen)
    tables = [order[sum(n_pages[:s]): sum(n_pages[: s + 1])] for s in range(len(seqs))]
    k_side = alloc_side(P, Hkv, page, D, fmt.k_bits, fmt.side_group("k", D), gen, "cpu")
    v_side = alloc_side(P, Hkv, page, D, fmt.v_bits, fmt.side_group("v", D), gen, "cpu")
    ks, vs = [], []
    for (ctx, _), table in zip(seqs, tables):
        k = torch.randn(ctx, Hkv, D, generator=gen) * 2
        k[:, :, 3] += 4  # a key channel with an offset: peaked softmax rows, as real keys give
        v = torch.randn(ctx, Hkv, D, generator=gen)
        slots = table.repeat_interleave(page) * page + torch.arange(page).repeat(len(table))  # [pages * page]
        kv_write_ref(k, slots[:ctx], k_side, page)
        kv_write_ref(v, slots[:ctx], v_side, page)
        ks.append(k)
        vs.append(v)
    M = sum(n for _, n in seqs)
    if strided_q:  # q as the first H heads of a fused [M, (H + 2 Hkv) D] projection output
        q = torch.randn(M, H + 2 * Hkv, D, generator=gen)[:, :H]
    else:
        q = torch.randn(M, H, D, generator=gen)
    positions = torch.cat([torch.arange(c - n, c) for c, n in seqs])
    return Batch(q.to(device, dtype), ks, vs, copy_side(k_side, device), copy_side(v_side, device), tables,
                 positions.to(device), list(seqs))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype == torch.float32 and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(("page", "D", "H", "Hkv"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_matches_ref(device, fmt, page, D, H, Hkv, dtype):
    gen = torch.Generator().manual_seed(page + D + H)
    b = make_batch(fmt, page, D, H, Hkv, SEQS, gen=gen, device=device, dtype=dtype, strided_q=dtype == torch.float16)
    args = b.args(fmt, page)
    got = paged_attention(**args)
    assert_close(got, paged_attention_ref(**args), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(("page", "D", "H", "Hkv"), SHAPES)
def test_paged_attention_sliding_window_small_tiles(device, fmt, page, D, H, Hkv):
    """A window of 7 (the 37-token rows see 7 keys, the first key tile starts mid-page), 2 query
    tokens per tile (the 6-token chunk takes 3 programs, the decodes' second and third stop at
    once), 16 keys per tile, and a scale that is not 1/sqrt(D)."""
    gen = torch.Generator().manual_seed(7 * D + page)
    b = make_batch(fmt, page, D, H, Hkv, SEQS, gen=gen, device=device)
    args = b.args(fmt, page) | {"sliding_window": 7, "scale": 0.3}
    got = paged_attention(**args, block_m=2, block_n=16)
    assert_close(got, paged_attention_ref(**args), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 1])
def test_paged_attention_decode_batch(device, window):
    """A CUDA-graph style decode step: max_query_len given, one sequence bringing no query (its
    programs stop at once), bf16 q; window 1 leaves each query its own key only: out = v_self."""
    fmt, page, D, H, Hkv = KV_FORMATS["k8v4"], 16, 64, 9, 3
    gen = torch.Generator().manual_seed(3)
    seqs = [(20, 1), (5, 0), (33, 1), (1, 1)]
    b = make_batch(fmt, page, D, H, Hkv, seqs, gen=gen, device=device, dtype=torch.bfloat16)
    args = b.args(fmt, page) | {"sliding_window": window}
    got = paged_attention(**args, max_query_len=1)
    want = paged_attention_ref(**args)
    assert_close(got, want, torch.bfloat16)
    if window == 1:
        v_self = torch.stack([dequantize_int4(*quantize_int4(v[-1], 32)) for v in b.v[:1] + b.v[2:]])  # [3, Hkv, D]
        torch.testing.assert_close(got.cpu(), v_self.repeat_interleave(H // Hkv, dim=1), atol=1e-6, rtol=1e-6)


# ---- paged_attention, decode steps: split-KV -------------------------------------------------------

# One query row a sequence (max_query_len=1 takes the split-KV kernels): contexts of 1 token, 5 and 37
# (inside one split) and 300 (several splits at every split size below).
DECODE_SEQS = [(1, 1), (5, 1), (37, 1), (300, 1)]
# (kv_split, block_n, max_splits) launch overrides. grown: 300 keys need more than 8 splits of 32, so
# the split grows to 48 (cdiv(300, 8) = 38 rounded up to 16): 7 splits, 2 of 32 for the 37 tokens.
# default: the launcher's (2 splits of 256 for the 300). one: a single split, the whole context.
# many: 19 splits of 16 for the 300, 3 for the 37.
SPLITS = {"grown": (32, 16, 8), "default": (None, None, None), "one": (16, 16, 1), "many": (16, 16, 32)}


def split_args(name: str) -> dict:
    kv_split, block_n, max_splits = SPLITS[name]
    return {"kv_split": kv_split, "block_n": block_n, "max_splits": max_splits, "max_query_len": 1}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(("page", "D", "H", "Hkv"), SHAPES)
def test_paged_attention_decode_matches_ref(device, fmt, page, D, H, Hkv):
    """Every format and shape through the split-KV kernels, 7 splits for the longest context. q is
    fp32 at 4 / 2 heads and a strided fp16 slice at 9 / 3 (the 9 / 3 shape has D = 16, where the K
    and V groups cap at one a head)."""
    dtype = torch.float16 if H == 9 else torch.float32
    gen = torch.Generator().manual_seed(page + D + H + 1)
    b = make_batch(fmt, page, D, H, Hkv, DECODE_SEQS, gen=gen, device=device, dtype=dtype,
                   strided_q=dtype == torch.float16)
    args = b.args(fmt, page)
    assert_close(paged_attention(**args, **split_args("grown")), paged_attention_ref(**args), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", list(SPLITS))
def test_paged_attention_decode_split_sizes(device, split):
    """SmolLM2's shape and default format (9 / 3 heads, D = 64, k8v4) at every split size: one split,
    the defaults, a split grown past max_splits, 19 small ones — all within TOL of the spec."""
    fmt, page, D, H, Hkv = KV_FORMATS["k8v4"], 16, 64, 9, 3
    b = make_batch(fmt, page, D, H, Hkv, DECODE_SEQS, gen=torch.Generator().manual_seed(21), device=device)
    args = b.args(fmt, page)
    assert_close(paged_attention(**args, **split_args(split)), paged_attention_ref(**args), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [KV_FORMATS[name] for name in ("f16", "k8v4", "k4v4")], ids=lambda f: f.name)
def test_paged_attention_decode_sliding_window(device, fmt):
    """Window 7: the 300-token row sees keys 293..299, its one split starting at 288 (a multiple of
    16) with 5 keys masked; the 37-token row's first split begins mid-page. Window 100: keys
    200..299, 4 splits of 32 from 192. A scale that is not 1/sqrt(D)."""
    page, D, H, Hkv = 4, 16, 9, 3
    b = make_batch(fmt, page, D, H, Hkv, DECODE_SEQS, gen=torch.Generator().manual_seed(17), device=device)
    for window in (7, 100):
        args = b.args(fmt, page) | {"sliding_window": window, "scale": 0.3}
        assert_close(paged_attention(**args, **split_args("grown")), paged_attention_ref(**args), torch.float32)


def subset(args: dict, seqs: list[int], pages: int | None = None) -> dict:
    """The batch of sequences `seqs` (indices into args' batch, in that order) over the same pool,
    their block table cut to `pages` columns if given."""
    cu = args["cu_query_lens"]
    rows = torch.cat([torch.arange(int(cu[s]), int(cu[s + 1])) for s in seqs]).to(cu.device)
    n = torch.tensor([int(cu[s + 1] - cu[s]) for s in seqs], dtype=torch.int32)
    index = torch.tensor(seqs, device=cu.device)
    table = args["block_tables"][index][:, :pages].contiguous()
    return args | {"q": args["q"][rows], "positions": args["positions"][rows], "block_tables": table,
                   "context_lens": args["context_lens"][index].contiguous(),
                   "cu_query_lens": torch.cat([n.new_zeros(1), n.cumsum(0)]).int().to(cu.device)}


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_decode_batch_invariant(device):
    """A sequence's rows are the same bits alone (its block table cut to its own pages) as in a batch
    of other contexts, in any place: the split of a sequence depends on its own context only (300
    tokens: 7 splits, 120: 4, 37: 2), and the merge adds its partials in split order."""
    split = "grown"
    fmt, page, D, H, Hkv = KV_FORMATS["k8v4"], 16, 64, 9, 3
    seqs = [(300, 1), (37, 1), (5, 0), (120, 1), (1, 1)]
    b = make_batch(fmt, page, D, H, Hkv, seqs, gen=torch.Generator().manual_seed(13), device=device)
    args = b.args(fmt, page)
    batched = paged_attention(**args, **split_args(split))
    shuffled = paged_attention(**subset(args, [3, 2, 0]), **split_args(split))
    assert torch.equal(shuffled[1], batched[0]) and torch.equal(shuffled[0], batched[2])
    for s, row in ((0, 0), (1, 1), (3, 2), (4, 3)):
        alone = paged_attention(**subset(args, [s], -(-seqs[s][0] // page)), **split_args(split))
        assert torch.equal(alone[0], batched[row]), s
    assert_close(batched, paged_attention_ref(**args), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_that_attend_alone_are_the_same_bits_in_any_step(device):
    """A decode row gives the same bits in a decode step and in a mixed step beside a prefill chunk
    (split_rows found on the device, or from the lists); every row of a one_by_one chunk (a
    speculative chunk: 3 tokens at 297..299 of a 300-token context) gives what decoding that token
    alone would, its context cut at itself. The prefill chunk's rows still match the spec."""
    fmt, page, D, H, Hkv = KV_FORMATS["k8v4"], 16, 64, 9, 3
    seqs = [(300, 3), (37, 1), (40, 6), (120, 1)]
    b = make_batch(fmt, page, D, H, Hkv, seqs, gen=torch.Generator().manual_seed(5), device=device)
    args = b.args(fmt, page)
    mixed = paged_attention(**args)
    by_row, alone = split_rows([3, 1, 6, 1], None, device)
    assert alone.tolist() == [3, 10]
    assert torch.equal(mixed, paged_attention(**args, split_rows=by_row))
    assert torch.equal(mixed, paged_attention(**args, split_rows=by_row, alone=alone))  # those rows only
    assert_close(mixed, paged_attention_ref(**args), torch.float32)
    spec = paged_attention(**args, split_rows=split_rows([3, 1, 6, 1], [True, False, False, False], device)[0])
    assert torch.equal(spec, paged_attention(**args, **dict(zip(("split_rows", "alone"), split_rows(
        [3, 1, 6, 1], [True, False, False, False], device)))))
    assert torch.equal(spec[3:], mixed[3:])
    assert_close(spec, paged_attention_ref(**args), torch.float32)
    for s, row in ((1, 3), (3, 10)):  # decode rows, alone
        alone = paged_attention(**subset(args, [s], -(-seqs[s][0] // page)), max_query_len=1)
        assert torch.equal(alone[0], mixed[row]), s
    for i in range(3):  # the speculative chunk's rows, each decoded alone at its own context
        one = subset(args, [0], -(-300 // page))
        pos = 297 + i
        one |= {"q": args["q"][i:i + 1], "positions": args["positions"][i:i + 1],
                "cu_query_lens": torch.tensor([0, 1], dtype=torch.int32, device=device),
                "context_lens": torch.tensor([pos + 1], dtype=torch.int32, device=device)}
        assert torch.equal(paged_attention(**one, max_query_len=1)[0], spec[i]), i


# What would read a device tensor's values on the host (a sync on CUDA, and no CUDA graph)
HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_decode_reads_nothing_on_the_host(device, monkeypatch):
    """With max_query_len=1 the launch never reads a tensor's values (each way to is made to raise),
    and two batches of the same shapes but other contexts (1 split against 19) launch the same grids
    with the same workspace."""
    import lowbit.kernels.paged_attention as pa

    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):  # the grid and the first three tensors' shapes (workspace included)
                launches.append((tuple(grid), [tuple(t.shape) for t in args[:3]]))
                return self.kernel[grid](*args, **kwargs)
            return launch

    def host_read(*_, **__):
        raise AssertionError("paged_attention read a tensor on the host")

    fmt, page, D, H, Hkv = KV_FORMATS["k8v4"], 4, 16, 4, 2
    monkeypatch.setattr(pa, "_paged_decode_split_kernel", Recorder(pa._paged_decode_split_kernel))
    monkeypatch.setattr(pa, "_paged_decode_merge_kernel", Recorder(pa._paged_decode_merge_kernel))
    outs, refs = [], []
    for n, seqs in enumerate(([(5, 1), (3, 1)], [(300, 1), (1, 1)])):
        b = make_batch(fmt, page, D, H, Hkv, seqs, gen=torch.Generator().manual_seed(n), device=device)
        args = b.args(fmt, page)
        with monkeypatch.context() as m:
            for name in HOST_READS:
                m.setattr(torch.Tensor, name, host_read)
            outs.append(paged_attention(**args, **split_args("many")))
        refs.append(paged_attention_ref(**args))
    assert launches[:2] == launches[2:] and len(launches) == 4
    for got, want in zip(outs, refs):
        assert_close(got, want, torch.float32)


@pytest.mark.gpu
def test_paged_attention_decode_in_a_cuda_graph():
    """Captured at short contexts, replayed after the batch tensors were overwritten in place with
    longer ones (5 splits for 1200 tokens): the replay is the eager call's bits."""
    fmt, page, D, H, Hkv = KV_FORMATS["k8v4"], 16, 64, 9, 3
    seqs = [(300, 1), (1200, 1), (5, 1)]
    b = make_batch(fmt, page, D, H, Hkv, seqs, gen=torch.Generator().manual_seed(2), device="cuda")
    args = b.args(fmt, page)
    want = paged_attention(**args, max_query_len=1)
    long_ctx, long_pos = args["context_lens"].clone(), args["positions"].clone()
    args["context_lens"].copy_(torch.tensor([10, 20, 5], dtype=torch.int32))
    args["positions"].copy_(args["context_lens"].long() - 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) off the capturing stream, as torch.cuda.graph asks
        paged_attention(**args, max_query_len=1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(**args, max_query_len=1)
    args["context_lens"].copy_(long_ctx)
    args["positions"].copy_(long_pos)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert_close(out, paged_attention_ref(**args), torch.float32)


# Compiles the decode kernels for sm_90 with the launcher's constants and warps: Triton's CUDA backend
# and its ptxas run on the CPU, so a kernel that only the interpreter accepts fails here.
COMPILE_SM90 = r"""
import os
os.environ["TRITON_INTERPRET"] = "0"
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from lowbit.kernels import paged_attention as pa

PTR = {32: "*fp32", 16: "*fp16", 8: "*i8", 4: "*u8"}
for fmt, k_bits, k_group, v_bits, v_group, q_type, sliding in (("k8v4", 8, 64, 4, 32, "*fp32", False),
                                                                  ("f16", 16, 64, 16, 64, "*fp16", True)):
    stage1, stage2 = pa.decode_constexprs(64, 3, k_bits, k_group, v_bits, v_group, sliding, sinks=sliding)  # gpt-oss's
    # kernel_tensors(): a side without scales or mins passes its codes (data) in their place
    types = {"q_ptr": q_type, "pos_ptr": "*i64", "rs_ptr": "*i32", "ctx_ptr": "*i32", "bt_ptr": "*i32",
             "scale": "fp32", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "o_ptr": "*fp32", "sink_ptr": "*fp32"}
    for side, bits in (("k", k_bits), ("v", v_bits)):
        types.update({side + "c_ptr": PTR[bits], side + "s_ptr": "*fp16" if bits < 16 else PTR[bits],
                      side + "m_ptr": "*fp16" if bits == 4 else PTR[bits]})
    for kernel, const, warps in ((pa._paged_decode_split_kernel, stage1, pa.DECODE_WARPS),
                                 (pa._paged_decode_merge_kernel, stage2, pa.MERGE_WARPS)):
        sig = {name: "constexpr" if name in const else types.get(name, "i32") for name in kernel.arg_names}
        k = triton.compile(ASTSource(kernel, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps})
        assert k.asm["cubin"], (fmt, kernel.__name__)
        print(fmt, kernel.__name__, "compiled")
"""


def test_paged_attention_decode_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = os.environ | {"TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", COMPILE_SM90], capture_output=True, text=True, timeout=600, env=env,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("compiled") == 4, r.stdout


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("window", [None, 7])
def test_paged_attention_ref_is_models_paged_attention(fmt, window):
    """The spec is what the engine computes today: models/attention.py's PagedAttention over the
    KVPool, with the format's rotation switched off (rotating q and un-rotating out is the caller's)."""
    plain = KVFormat(fmt.name, fmt.k_bits, fmt.v_bits, fmt.k_group, fmt.v_group, rotate=False)
    page, D, H, Hkv = 4, 64, 9, 3
    gen = torch.Generator().manual_seed(5)
    n_pages = [-(-c // page) for c, _ in SEQS]
    pool = KVPool(plain, n_layers=2, n_kv_heads=Hkv, head_dim=D, num_pages=sum(n_pages) + 2, page_size=page)
    order = torch.randperm(pool.num_pages, generator=gen)
    tables = [order[sum(n_pages[:s]): sum(n_pages[: s + 1])] for s in range(len(SEQS))]
    new_slots = []
    for (ctx, n), table in zip(SEQS, tables):  # the cached part of each context, as earlier steps wrote it
        slots = (table.repeat_interleave(page) * page + torch.arange(page).repeat(len(table)))[:ctx]
        pool.write(1, torch.randn(ctx - n, Hkv, D, generator=gen), torch.randn(ctx - n, Hkv, D, generator=gen),
                   slots[: ctx - n])
        new_slots.append(slots[ctx - n:])
    M = sum(n for _, n in SEQS)
    q, k, v = (torch.randn(M, h, D, generator=gen) for h in (H, Hkv, Hkv))
    positions = torch.cat([torch.arange(c - n, c) for c, n in SEQS])
    batch = PagedBatch(positions, torch.cat(new_slots), [n for _, n in SEQS], [c for c, _ in SEQS], tables,
                       torch.arange(M))
    want = PagedAttention(pool, batch, window, torch_backend())(1, q, k, v).view(M, H, D)  # writes k, v, attends
    cu, ctx, bt = batch_tensors(batch.query_lens, batch.context_lens, tables, "cpu")
    got = paged_attention_ref(q, pool.side(1, "k"), pool.side(1, "v"), cu, ctx, positions, bt, page, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # explicit softmax against SDPA's


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_paged_attention_ref_against_sdpa(fmt):
    """Independent oracle: per sequence, K/V quantized and dequantized as contiguous [ctx, Hkv, D]
    tensors (no pages, no block tables), then F.scaled_dot_product_attention with GQA and an explicit
    causal mask by position."""
    page, D, H, Hkv = 4, 16, 9, 3
    gen = torch.Generator().manual_seed(9)
    b = make_batch(fmt, page, D, H, Hkv, SEQS, gen=gen, device="cpu")
    got = paged_attention_ref(**b.args(fmt, page))
    kg, vg = fmt.side_group("k", D), fmt.side_group("v", D)
    roundtrip = {32: lambda x, g: x,
                 16: lambda x, g: x.half().float(),
                 8: lambda x, g: dequantize_int8(*quantize_int8(x, g)),
                 4: lambda x, g: dequantize_int4(*quantize_int4(x, g))}
    row = 0
    for (ctx, n), k, v in zip(SEQS, b.k, b.v):
        kd = roundtrip[fmt.k_bits](k, kg).transpose(0, 1)  # [Hkv, ctx, D]
        vd = roundtrip[fmt.v_bits](v, vg).transpose(0, 1)
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]  # [n, ctx]
        want = F.scaled_dot_product_attention(b.q[row:row + n].transpose(0, 1), kd, vd, attn_mask=mask,
                                              enable_gqa=True).transpose(0, 1)  # [n, H, D]
        torch.testing.assert_close(got[row:row + n], want, atol=1e-5, rtol=1e-5)
        row += n


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_bad_inputs_and_empty_batch(device):
    fmt, page, D, H, Hkv = KV_FORMATS["k8v4"], 4, 16, 4, 2
    b = make_batch(fmt, page, D, H, Hkv, [(5, 2)], gen=torch.Generator().manual_seed(0), device=device)
    args = b.args(fmt, page)
    with pytest.raises(ValueError, match="q must be"):
        paged_attention(**(args | {"q": b.q[0]}))
    with pytest.raises(ValueError, match="evenly"):
        paged_attention(**(args | {"q": torch.zeros(2, 3, D, device=device)}))
    with pytest.raises(ValueError, match="page_size"):
        paged_attention(**(args | {"page_size": 16}))
    with pytest.raises(ValueError, match="positions"):
        paged_attention(**(args | {"positions": b.positions.int()}))
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(**(args | {"block_tables": args["block_tables"].long()}))
    with pytest.raises(ValueError, match="cu_query_lens"):
        paged_attention(**(args | {"cu_query_lens": args["cu_query_lens"][:1]}))
    with pytest.raises(ValueError, match="holds"):
        paged_attention(**(args | {"k_side": replace(b.k_side, bits=4)}))
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(**(args | {"sliding_window": 0}))
    empty = args | {"q": b.q[:0], "positions": b.positions[:0],
                    "cu_query_lens": torch.zeros(2, dtype=torch.int32, device=device)}
    assert paged_attention(**empty).shape == (0, H, D)


def test_launchers_refuse_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fmt, page = KV_FORMATS["k8v4"], 4
    b = make_batch(fmt, page, 16, 4, 2, [(5, 2)], gen=torch.Generator().manual_seed(0), device="cpu")
    with pytest.raises(ValueError, match="CUDA"):
        paged_attention(**b.args(fmt, page))
    with pytest.raises(ValueError, match="CUDA"):
        kv_write(torch.zeros(2, 2, 16), torch.arange(2), b.k_side, page)


def test_batch_tensors_from_paged_batch_lists():
    cu, ctx, bt = batch_tensors([3, 1], [7, 2], [torch.tensor([4, 1]), torch.tensor([0])], "cpu")
    assert cu.tolist() == [0, 3, 4] and ctx.tolist() == [7, 2] and bt.tolist() == [[4, 1], [0, 0]]
    assert cu.dtype == ctx.dtype == bt.dtype == torch.int32
    assert math.prod(batch_tensors([], [], [], "cpu")[2].shape) == 0
