"""KV number formats (kernels/kv_quant.py) and the pool's write/read (runtime/engine/kv_cache.py)."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.kv_quant import dequantize_int4, dequantize_int8, hadamard, quantize_int4, quantize_int8, rotation
from lowbit.quant.kv import KV_FORMATS, parse_kv_format
from lowbit.runtime.engine.kv_cache import KVPool


def test_hadamard_is_orthonormal_and_needs_a_power_of_two():
    H = hadamard(64)
    torch.testing.assert_close(H @ H.T, torch.eye(64), atol=1e-6, rtol=0)
    assert set(H.abs().unique().tolist()) == {0.125}  # every entry is ±1/sqrt(64)
    with pytest.raises(ValueError, match="power-of-2"):
        hadamard(80)
    R = rotation(64)
    torch.testing.assert_close(R @ R.T, torch.eye(64), atol=1e-6, rtol=0)
    assert torch.equal(R, rotation(64)) and not torch.equal(R.abs(), R)  # fixed, and signs are mixed


def test_int8_hand_example():
    x = torch.tensor([[1.27, -0.635, 0.0, 0.01]])
    codes, scales = quantize_int8(x, group=4)
    assert scales.item() == pytest.approx(0.01, rel=1e-3)  # amax / 127, in fp16
    # the scale kept is fp16(0.01) = 0.010002136: -0.635 / it = -63.49 → -63; 0.01 / it = 0.9998 → 1
    assert codes.tolist() == [[127, -63, 0, 1]]
    torch.testing.assert_close(dequantize_int8(codes, scales), codes.float() * scales.float())


def test_int4_hand_example():
    x = torch.tensor([[-1.0, 0.0, 0.5, 2.0]])
    codes, scales, mins = quantize_int4(x, group=4)
    assert mins.item() == -1.0 and scales.item() == pytest.approx(0.2, rel=1e-3)  # (2 - -1) / 15
    u = torch.stack((codes & 0xF, codes >> 4), -1).flatten(-2)
    # the scale kept is fp16(0.2) = 0.19995: (x - min) / it = 0, 5.0007, 7.5018, 15.004 → 0, 5, 8, 15
    assert u.tolist() == [[0, 5, 8, 15]]
    back = dequantize_int4(codes, scales, mins)
    assert back[0, 0] == -1.0 and abs(back[0, 3] - 2.0) < 1e-3


@pytest.mark.parametrize("group", [16, 32, 64])
def test_round_trip_error_is_half_a_step(group):
    """Every value comes back within half a quantization step of its group (plus fp16 rounding)."""
    x = torch.randn(50, 3, 64) * torch.linspace(0.1, 5, 64)  # channels of very different size
    codes, scales = quantize_int8(x, group)
    err = (dequantize_int8(codes, scales) - x).unflatten(-1, (-1, group)).abs()
    assert (err <= scales.float().unsqueeze(-1) * 0.5 * (1 + 1e-3) + 1e-6).all()
    codes, scales, mins = quantize_int4(x, group)
    err = (dequantize_int4(codes, scales, mins) - x).unflatten(-1, (-1, group)).abs()
    assert (err <= scales.float().unsqueeze(-1) * 0.5 * (1 + 1e-2) + 1e-3).all()


@pytest.mark.parametrize("name", list(KV_FORMATS))
def test_pool_reads_back_what_it_wrote(name):
    """Tokens written to scattered slots come back in sequence order, within the format's error
    (f32 exactly; f16 to 2^-11 relative; rotated int8 to ~1%, int4 to ~10% of the vector's scale)."""
    fmt = parse_kv_format(name)
    pool = KVPool(fmt, n_layers=2, n_kv_heads=3, head_dim=64, num_pages=8, page_size=4)
    k, v = torch.randn(10, 3, 64), torch.randn(10, 3, 64)
    pages = torch.tensor([5, 1, 7])
    slots = pages[torch.arange(10) // 4] * 4 + torch.arange(10) % 4
    pool.write(1, k, v, slots)
    kk, vv = pool.gather(1, pages, 10)  # [Hkv, 10, D]
    tol = {16: 1e-3, 8: 0.05, 4: 0.35}
    for got, want, bits in ((kk, k, fmt.k_bits), (vv, v, fmt.v_bits)):
        assert got.shape == (3, 10, 64)
        if bits == 32:  # the exact reference cache: the values written, bit for bit
            assert torch.equal(got, want.transpose(0, 1))
            continue
        assert (got - want.transpose(0, 1)).abs().max() < tol[bits] * want.abs().max()
    assert pool.gather(0, pages, 10)[0].abs().max() == 0  # another layer untouched


def test_pool_sides_carry_the_formats_bits_and_capped_groups():
    """KVPool.side hands out one KVSide per layer and side, the same object each call, with the
    format's bits and its group capped at the head dim (the f16 side: one group of D, no scales)."""
    pool = KVPool(KV_FORMATS["k8v4"], n_layers=2, n_kv_heads=3, head_dim=16, num_pages=2, page_size=4)
    k, v = pool.side(1, "k"), pool.side(1, "v")
    assert pool.side(1, "k") is k and pool.side(0, "k") is not k
    assert (k.bits, k.group, v.bits, v.group) == (8, 16, 4, 16)  # groups of 64 and 32, capped at 16
    assert set(k.tensors()) == {"codes", "scales"} and set(v.tensors()) == {"codes", "scales", "mins"}
    assert v.codes.shape == (2, 3, 4, 8) and v.mins.shape == (2, 3, 4, 1) and k.n_kv_heads == 3
    f16 = KV_FORMATS["f16"]
    assert (f16.side_bits("v"), f16.side_group("v", 64)) == (16, 64)
    assert KV_FORMATS["k8v4"].side_group("v", 64) == 32
    with pytest.raises(ValueError, match="'k' or 'v'"):
        f16.side_bits("q")
    f32 = KVPool(KV_FORMATS["f32"], n_layers=1, n_kv_heads=3, head_dim=16, num_pages=2, page_size=4).side(0, "k")
    assert (f32.bits, f32.group, set(f32.tensors())) == (32, 16, {"data"})
    assert f32.data.dtype == torch.float32 and f32.data.shape == (2, 3, 4, 16)


def test_f32_costs_twice_f16():
    """f32 stores 4 D bytes per token, head and side: the default model (30 layers, 3 KV heads, D 64)
    46,080 bytes a token, 2x f16's 23,040; it is never rotated (nothing to quantize)."""
    f32, f16 = KV_FORMATS["f32"], KV_FORMATS["f16"]
    assert f32.side_bytes("k", 64) == f32.side_bytes("v", 64) == 4 * 64
    assert f32.bytes_per_token(30, 3, 64) == 46080 == 2 * f16.bytes_per_token(30, 3, 64)
    assert not f32.rotates(64) and KVPool(f32, 1, 3, 64, num_pages=1).rot is None


def test_unknown_format_and_empty_budget_are_clear_errors():
    with pytest.raises(ValueError, match="unknown KV cache format 'q3'"):
        parse_kv_format("q3")
    with pytest.raises(ValueError, match="holds no page"):
        KVPool.from_budget(KV_FORMATS["k8v4"], 30, 3, 64, budget_bytes=1000)


@pytest.mark.parametrize("name", ["f32", "f16", "k8v4", "k4v4"])
def test_sequences_read_together_attend_as_they_do_alone(name, monkeypatch, decode_kernel):
    """PagedAttention reads several sequences' pages in one gather (up to GATHER_PAGES pages): each
    sequence's output equals, bit for bit, a step that holds that sequence alone — with the page
    budget set so that reads split between sequences (2 and 3 of them), and with one sequence larger
    than the budget on its own. With the C kernels, the one-token rows are attended in C straight
    from the pages and the others are read as before; without them, all are read."""
    _paged_step_case(name, monkeypatch, decode_kernel, together=True)


def _paged_step_case(name, monkeypatch, backend, together: bool, window=None, one_by_one=None):
    from lowbit.models import attention
    from lowbit.models.attention import PagedAttention, PagedBatch

    H, Hkv, D, P = 6, 2, 64, 4
    g = torch.Generator().manual_seed(1)
    pool = KVPool(KV_FORMATS[name], 1, Hkv, D, num_pages=40, page_size=P)
    ctxs, news = [9, 3, 14, 5, 7], [1, 2, 1, 3, 1]  # tokens in the cache once the step's are written
    perm = torch.randperm(40, generator=g)
    tables, start = [], 0
    for c in ctxs:  # scattered pages
        tables.append(perm[start:start + -(-c // P)])
        start += len(tables[-1])
    for t, c in zip(tables, ctxs):  # fill the cache
        pos = torch.arange(c)
        pool.write(0, torch.randn(c, Hkv, D, generator=g), torch.randn(c, Hkv, D, generator=g),
                   t[pos // P] * P + pos % P, backend.native)
    q = torch.randn(sum(news), H, D, generator=g)
    k, v = torch.randn(sum(news), Hkv, D, generator=g), torch.randn(sum(news), Hkv, D, generator=g)
    pos = torch.cat([torch.arange(c - n, c) for c, n in zip(ctxs, news)])
    slots = torch.cat([t[p // P] * P + p % P for t, p in zip(tables, pos.split(news))])

    def step(seqs):
        rows = [r for s in seqs for r in range(sum(news[:s]), sum(news[:s + 1]))]
        b = PagedBatch(pos[rows], slots[rows], [news[s] for s in seqs], [ctxs[s] for s in seqs],
                       [tables[s] for s in seqs], torch.arange(len(rows)),
                       None if one_by_one is None else [one_by_one[s] for s in seqs])
        return PagedAttention(pool, b, window, backend)(0, q[rows], k[rows], v[rows])

    if not together:
        return step(list(range(len(ctxs))))
    alone = [step([s]) for s in range(len(ctxs))]
    for budget in (1024, 5, 3):
        monkeypatch.setattr(attention, "GATHER_PAGES", budget)
        together = step(list(range(len(ctxs))))
        assert torch.equal(together, torch.cat(alone)), budget


@pytest.mark.parametrize("name", ["f32", "f16", "k8v8", "k8v4", "k4v4"])
@pytest.mark.parametrize("window,one_by_one", [(None, None), (4, None), (None, [False, True, False, True, False])],
                         ids=["plain", "window", "speculative-rows"])
def test_c_paged_attention_matches_dequantize_and_sdpa(name, window, one_by_one, monkeypatch, c_kernels):
    """The C kernel that attends one-token rows straight from the quantized pages (rotated q and
    output for k8v8/k8v4/k4v4) against the plain-torch path (pages gathered, dequantized, SDPA) on
    the same pool: decode rows, a sliding window, and speculative rows attended one by one."""
    from lowbit.models.backend import torch_backend

    got = _paged_step_case(name, monkeypatch, torch_backend(c_kernels.native()), together=False, window=window,
                           one_by_one=one_by_one)
    want = _paged_step_case(name, monkeypatch, torch_backend(native=None), together=False, window=window,
                            one_by_one=one_by_one)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("name,rotate", [("f32", False), ("f16", False)]
                         + [(n, r) for n in ("k8v8", "k8v4", "k4v4") for r in (False, True)])
def test_c_quantize_on_write_matches_the_specs(name, rotate, monkeypatch, c_kernels):
    """KVPool.write through the C kernel against the plain-torch specs (kernels/kv_quant.py) on the
    same tokens, K/V as strided views of one QKV row: without the rotation every code, scale and min
    is bit-identical (the same fp32 arithmetic, fp16 scales, round half to even); with it the rotation
    is a 64-term sum in another order, so a code may move by one step — the dequantized vectors agree
    to within one quantization step and almost all codes are equal."""
    from dataclasses import replace

    fmt = KV_FORMATS[name] if rotate else replace(KV_FORMATS[name], rotate=False)
    Hkv, D, P, M = 2, 64, 4, 11
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(M, (3 + 2 * Hkv) * D, generator=g) * torch.linspace(0.1, 8, (3 + 2 * Hkv) * D)  # outliers
    qkv[3, 3 * D:] = 0.0  # an all-zero vector: scale 0
    k, v = qkv[:, 3 * D:(3 + Hkv) * D].view(M, Hkv, D), qkv[:, (3 + Hkv) * D:].view(M, Hkv, D)
    slots = torch.randperm(8 * P, generator=g)[:M]
    pools = []
    for kernels in (c_kernels.native(), None):
        pools.append(KVPool(fmt, 1, Hkv, D, num_pages=8, page_size=P))
        pools[-1].write(0, k, v, slots, kernels)
    c, ref = pools
    for side in ("k", "v"):
        for key, got in c.side(0, side).tensors().items():
            want = getattr(ref.side(0, side), key)
            if not rotate:
                assert torch.equal(got, want), (side, key)
            elif key == "codes":
                assert (got != want).float().mean() < 0.02, (side, key)
    pages = torch.arange(8)
    for a, b in zip(c.gather(0, pages, 8 * P), ref.gather(0, pages, 8 * P)):
        step = (b.abs().amax() / 127) if fmt.k_bits == 8 and fmt.v_bits == 8 else (b.amax() - b.amin()) / 15
        assert (a - b).abs().max() <= step * 1.01


@pytest.mark.parametrize("name", ["k8v4", "k4v4"])
@pytest.mark.parametrize("H,Hkv,D", [(4, 4, 64), (6, 2, 64), (10, 2, 64), (4, 4, 128), (10, 2, 128)])
def test_c_paged_attention_over_long_contexts_matches_sdpa_in_float64(name, H, Hkv, D, c_kernels):
    """The C paged attention at head dims 64 and 128 and 1, 3 and 5 query heads per KV head, rows of 1
    to 300 tokens (odd lengths; 130 and 300 are cut into chunks merged in order), scattered pages,
    against SDPA in float64 over the same pool dequantized."""
    import torch.nn.functional as F

    P, ctxs = 16, [1, 7, 130, 300]
    pool = KVPool(KV_FORMATS[name], 1, Hkv, D, num_pages=sum(-(-c // P) for c in ctxs) + 3, page_size=P)
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(pool.num_pages, generator=g)
    tables, start = [], 0
    for c in ctxs:
        tables.append(perm[start:start + -(-c // P)])
        start += len(tables[-1])
        pos = torch.arange(c)
        pool.write(0, torch.randn(c, Hkv, D, generator=g), torch.randn(c, Hkv, D, generator=g),
                   tables[-1][pos // P] * P + pos % P)
    q = torch.randn(len(ctxs), H, D, generator=g)
    got = c_kernels.native().paged_decode_attention(
        q, torch.tensor(ctxs), torch.cat(tables).to(torch.int64), torch.tensor([0, *map(len, tables[:-1])]).cumsum(0),
        P, pool.side(0, "k"), pool.side(0, "v"), pool.rot, None)
    # the kernel's fp32 sums of exp-scores times group mins over up to 300 tokens, and the rotation there
    # and back, leave up to 3.2e-6 here (fp32 SDPA: 4e-7); a wrong scale, min, page or head is off by 1e-2
    for r, (c, t) in enumerate(zip(ctxs, tables)):
        keys, values = pool.gather(0, t, c)  # [Hkv, c, D], un-rotated
        want = F.scaled_dot_product_attention(q[r][None, :, None].double(), keys[None].double(),
                                              values[None].double(), enable_gqa=H != Hkv)[0, :, 0]
        torch.testing.assert_close(got[r].double(), want, rtol=1e-5, atol=5e-6)
