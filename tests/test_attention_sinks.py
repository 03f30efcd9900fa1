"""Attention sinks (gpt-oss): a learned logit per query head, sink_h, that joins every query's softmax
over its keys and carries no value — p_j = e^(s_j) / (e^(sink_h) + sum_i e^(s_i)), out = sum_j p_j v_j —
in every path of models/attention.py's PagedAttention: the C kernel straight from the quantized pages
(kernels/cpu_attention.c, a row's context cut into chunks of 128: the sink must count once a row), SDPA
over gathered pages (rotated k8v4 and not), and the Triton kernels (kernels/paged_attention.py, under
TRITON_INTERPRET=1 on CPU: the prefill kernel, and split-KV decode with up to 19 splits a row).

Oracles: transformers' gpt-oss `eager_attention_forward` called directly (its module's `sinks`), and a
float64 loop written from the definition above; each path is checked against both, over the pool's own
dequantized K/V, with sequences of different lengths in one step and windows shorter than the context
(gpt-oss alternates window-128 layers and full ones). The one-call C decode step with sinks is checked
against the block-by-block step in tests/test_cpu_native.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from lowbit.kernels.triton_import import interpreting
from lowbit.models.attention import PagedAttention, PagedBatch
from lowbit.models.backend import torch_backend
from lowbit.quant.kv import KV_FORMATS
from lowbit.runtime.engine.kv_cache import KVPool
from tests.helpers import paged_backend

H, Hkv, D, P = 6, 2, 64, 4  # 3 query heads per KV head; pages of 4 tokens
# (context once the step's tokens are written, new tokens): decodes over 1, 9 and 300 tokens (300: 3 chunks
# in C, 2 splits in Triton), a 2-token chunk, and a 40-token prompt chunk (past C_ROWS_MAX = 32: SDPA on CPU,
# the prefill kernel in Triton)
SEQS = [(9, 1), (3, 2), (300, 1), (45, 40), (1, 1)]
# rtol/atol of an fp32 path against the float64 oracles: fp32 sums of exp-scores over up to 300 tokens, and
# k8v4's rotation there and back, leave up to ~3e-6 (tests/test_kv_quant.py measures the same without
# sinks); a sink counted twice or not at all is off by > 1e-2 here (checked below)
TOL = {"rtol": 1e-5, "atol": 5e-6}


def oracle(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, window: int | None,
           sinks: torch.Tensor) -> torch.Tensor:
    """transformers' gpt-oss eager attention in float64: q [n, H, D] at positions pos [n] over keys/values
    [Hkv, ctx, D] (causal, the last `window` keys) → [n, H, D]."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    n, ctx = q.shape[0], keys.shape[1]
    j = torch.arange(ctx)
    see = j[None, :] <= pos[:, None]  # [n, ctx]
    if window is not None:
        see &= j[None, :] > pos[:, None] - window
    mask = torch.zeros(n, ctx, dtype=torch.float64).masked_fill(~see, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // keys.shape[0], sinks=sinks.double(), training=False)
    out, _ = eager_attention_forward(module, q.double().transpose(0, 1)[None], keys.double()[None],
                                     values.double()[None], mask, q.shape[2] ** -0.5)
    return out[0]  # [n, H, D]


def definition(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, window: int | None,
               sinks: torch.Tensor) -> torch.Tensor:
    """The same from the definition, row by row and head by head, float64."""
    n, heads, d = q.shape
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for i, p in enumerate(pos.tolist()):
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(heads):
            kv = h // (heads // keys.shape[0])
            s = keys[kv, lo:p + 1].double() @ q[i, h].double() * d ** -0.5  # [keys seen]
            sink = float(sinks[h])
            m = max(float(s.max()), sink)
            e = torch.exp(s - m)
            out[i, h] = e @ values[kv, lo:p + 1].double() / (e.sum() + math.exp(sink - m))
    return out


def test_the_definition_is_transformers_gpt_oss_attention():
    """The two oracles agree (GQA 6 / 2, windows of 1, 3 and none, sinks from -30 to +30: a sink that
    takes nearly all of a row's weight, and one that takes none), and a sink changes the output."""
    g = torch.Generator().manual_seed(0)
    q, keys, values = torch.randn(5, H, D, generator=g), torch.randn(Hkv, 12, D, generator=g), torch.randn(Hkv, 12, D,
                                                                                                            generator=g)
    pos = torch.tensor([0, 3, 7, 10, 11])
    sinks = torch.tensor([-30.0, -1.0, 0.0, 0.5, 2.0, 30.0])
    for window in (None, 3, 1):
        got = oracle(q, keys, values, pos, window, sinks)
        torch.testing.assert_close(definition(q, keys, values, pos, window, sinks), got, rtol=1e-12, atol=1e-12)
        plain = oracle(q, keys, values, pos, window, torch.full((H,), -torch.inf))
        assert (got - plain).abs().amax() > 0.1
        assert got[:, 5].abs().max() < 1e-9  # sink 30: every key's weight < e^-20


@dataclass
class Case:
    """One layer's pool holding each sequence's first ctx - n tokens, and a step's new tokens (q, k, v at
    positions pos, slots) for n more per sequence."""

    pool: KVPool
    seqs: list[tuple[int, int]]
    tables: list[torch.Tensor]
    q: torch.Tensor  # [M, H, D]
    k: torch.Tensor  # [M, Hkv, D]
    v: torch.Tensor
    pos: torch.Tensor  # int64 [M]
    slots: torch.Tensor  # int64 [M]


def case(fmt: str, backend, seqs=SEQS, select=None, seed=1) -> Case:
    """Everything drawn from `seed` for all of `seqs`, then the sequences `select` kept (in that order):
    a selection sees the same tokens as the whole."""
    g, dev = torch.Generator().manual_seed(seed), backend.device
    n_pages = [-(-c // P) for c, _ in seqs]
    pool = KVPool(KV_FORMATS[fmt], 1, Hkv, D, num_pages=sum(n_pages) + 2, page_size=P, device=dev)
    perm = torch.randperm(pool.num_pages, generator=g)  # scattered pages
    tables = [perm[sum(n_pages[:s]):sum(n_pages[:s + 1])] for s in range(len(seqs))]
    news = [n for _, n in seqs]
    q, k, v = (torch.randn(sum(news), h, D, generator=g) * a for h, a in ((H, 1.5), (Hkv, 1.0), (Hkv, 1.0)))
    pos = torch.cat([torch.arange(c - n, c) for c, n in seqs])
    slots = torch.cat([t[p // P] * P + p % P for t, p in zip(tables, pos.split(news))])
    cached = [(torch.randn(c - n, Hkv, D, generator=g), torch.randn(c - n, Hkv, D, generator=g)) for c, n in seqs]
    select = list(range(len(seqs))) if select is None else select
    for s in select:
        p = torch.arange(seqs[s][0] - seqs[s][1])
        pool.write(0, *(x.to(dev) for x in cached[s]), (tables[s][p // P] * P + p % P).to(dev), backend.native)
    rows = [r for s in select for r in range(sum(news[:s]), sum(news[:s + 1]))]
    return Case(pool, [seqs[s] for s in select], [tables[s] for s in select],
                *(x[rows].to(dev) for x in (q, k, v, pos, slots)))


def attend(c: Case, backend, sinks, window, one_by_one=None) -> torch.Tensor:
    """The step through PagedAttention (its K/V written, then every row attended) → fp32 [M, H, D]."""
    batch = PagedBatch(c.pos, c.slots, [n for _, n in c.seqs], [ctx for ctx, _ in c.seqs], c.tables,
                       torch.arange(len(c.pos)), one_by_one)
    attention = PagedAttention(c.pool, batch, [window], backend, None if sinks is None else [sinks])
    return attention(0, c.q, c.k, c.v).view(-1, H, D)


def expected(c: Case, window, sinks) -> torch.Tensor:
    """Both oracles over the pool's dequantized (un-rotated) K/V, per sequence → float64 [M, H, D]."""
    out, row = [], 0
    for (ctx, n), table in zip(c.seqs, c.tables):
        keys, values = c.pool.gather(0, table.to(c.q.device), ctx)  # [Hkv, ctx, D]
        a = (c.q[row:row + n].cpu(), keys.cpu(), values.cpu(), c.pos[row:row + n].cpu(), window, sinks.cpu())
        want = oracle(*a)
        torch.testing.assert_close(definition(*a), want, rtol=1e-12, atol=1e-12)
        out.append(want)
        row += n
    return torch.cat(out)


SINKS = torch.tensor([-1.0, 0.0, 1.5, 3.0, -4.0, 2.0])  # large enough to matter against 1 to 300 keys


@pytest.mark.parametrize("path", ["c", "torch", "triton"])
@pytest.mark.parametrize("fmt", ["k8v4", "f16", "f32"])
@pytest.mark.parametrize("window", [None, 5, 128])
def test_every_path_matches_the_oracle(path, fmt, window):
    """A step of decodes over 1 to 300 tokens, a 2-token chunk and a 40-token prompt chunk, through each
    path, against transformers' gpt-oss attention: rows within TOL, and each off by far more without the
    sinks (so a path that ignores them, or counts one per chunk or split, fails)."""
    backend = paged_backend(path)
    c = case(fmt, backend)
    got = attend(c, backend, SINKS.to(backend.device), window).double().cpu()
    torch.testing.assert_close(got, expected(c, window, SINKS), **TOL)
    plain = expected(c, window, torch.full((H,), -torch.inf))
    assert ((got - plain).abs().amax(dim=(1, 2)) > 1e-3).all()


@pytest.mark.parametrize("path", ["c", "torch", "triton"])
@pytest.mark.parametrize("fmt", ["k8v4", "f32"])
def test_sinks_of_minus_infinity_are_no_sinks_bit_for_bit(path, fmt):
    """A sink of -inf has no weight: every path gives the rows it gives without sinks, bit for bit (the
    C merge's max starts at the sink, SDPA's rows are scaled by sigmoid(+inf) = 1, the Triton merges
    start from a finite -1e30)."""
    backend = paged_backend(path)
    minus_inf = torch.full((H,), -torch.inf, device=backend.device)
    rows = [attend(case(fmt, backend), backend, sinks, 5) for sinks in (minus_inf, None)]
    assert torch.equal(*rows)


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("window", [None, 5])
def test_a_sequence_attends_alone_as_in_any_batch(path, window):
    """With sinks, a sequence's rows are the same bits alone and among the others, in any order: the C
    kernel's chunks and the sink's merge depend on the row alone, SDPA runs per sequence."""
    backend = paged_backend(path)
    together = attend(case("k8v4", backend), backend, SINKS, window)
    starts = torch.tensor([0] + [n for _, n in SEQS]).cumsum(0).tolist()
    for order in ([4, 2], [3], [1, 0]):
        got = attend(case("k8v4", backend, select=order), backend, SINKS, window)
        assert torch.equal(got, torch.cat([together[starts[s]:starts[s + 1]] for s in order])), order


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_rows_and_prompt_rows(path, window):
    """A 40-token chunk attended as a prompt (SDPA), as speculative rows one by one (the C kernel on the
    C backend), and token by token as 40 decode steps: the one-by-one rows are the decode rows bit for
    bit, the prompt rows equal them within TOL, and all match the oracle."""
    backend = paged_backend(path)
    c = case("k8v4", backend, [(45, 40)])
    prompt = attend(c, backend, SINKS, window)
    spec = attend(c, backend, SINKS, window, one_by_one=[True])  # rewrites the same K/V bytes
    decode = torch.cat([attend(Case(c.pool, [(5 + j + 1, 1)], c.tables, c.q[j:j + 1], c.k[j:j + 1], c.v[j:j + 1],
                                    c.pos[j:j + 1], c.slots[j:j + 1]), backend, SINKS, window) for j in range(40)])
    assert torch.equal(spec, decode)
    torch.testing.assert_close(prompt, decode, **TOL)
    torch.testing.assert_close(prompt.double(), expected(c, window, SINKS), **TOL)


def test_bad_sinks_are_refused():
    """Sinks the kernels cannot read are an error where they are given, never silently dropped."""
    from lowbit.kernels.paged_attention import batch_tensors, paged_attention

    backend = torch_backend()
    c = case("f32", backend, [(5, 1)])
    with pytest.raises(ValueError, match="2 layers of sinks for a pool of 1"):
        PagedAttention(c.pool, PagedBatch(c.pos, c.slots, [1], [5], c.tables, torch.arange(1)), None, backend,
                       [SINKS, SINKS])
    if backend.native is not None:
        for bad in (SINKS.double(), SINKS[:4], torch.zeros(H, 2)[:, 0]):
            with pytest.raises(ValueError, match="sinks must be contiguous fp32"):
                backend.native.paged_decode_attention(c.q, torch.tensor([5]), c.tables[0], torch.tensor([0]), P,
                                                      c.pool.side(0, "k"), c.pool.side(0, "v"), None, None, bad)
    if interpreting():
        cu, ctx, bt = batch_tensors([1], [5], c.tables, "cpu")
        with pytest.raises(ValueError, match="sinks must be contiguous fp32"):
            paged_attention(c.q, c.pool.side(0, "k"), c.pool.side(0, "v"), cu, ctx, c.pos, bt, P, sinks=SINKS.half())


@pytest.mark.parametrize("window", [None, 100])
def test_triton_decode_counts_the_sink_once_over_many_splits(window):
    """The split-KV decode with 16-key splits — 19 for the 300-token row (7 in its window of 100), 3 for
    the 37-token one, 1 for a lone token — merges the sink once a row: the launch against its spec
    (paged_attention_ref, with sinks), and the spec against transformers' gpt-oss attention."""
    from lowbit.kernels.paged_attention import batch_tensors, paged_attention, paged_attention_ref

    backend = paged_backend("triton")
    c = case("f16", backend, [(300, 1), (37, 1), (1, 1)])
    c.pool.write(0, c.k, c.v, c.slots)  # the step's own K/V, as PagedAttention writes them first
    cu, ctx, bt = batch_tensors([1, 1, 1], [300, 37, 1], c.tables, backend.device)
    args = (c.q, c.pool.side(0, "k"), c.pool.side(0, "v"), cu, ctx, c.pos, bt, P, window)
    sinks = SINKS.to(backend.device)
    got = paged_attention(*args, kv_split=16, block_n=16, max_splits=32, max_query_len=1, sinks=sinks)
    spec = paged_attention_ref(*args, sinks=sinks)
    torch.testing.assert_close(got, spec, rtol=1e-5, atol=1e-5)  # tests/test_triton_paged_attention.py's TOL
    torch.testing.assert_close(spec.double().cpu(), expected(c, window, SINKS), **TOL)
