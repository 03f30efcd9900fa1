"""The model runner: chunks laid out as the batch the kernels take, and run through a paged pool."""

from __future__ import annotations

import pytest
import torch

from lowbit.models.config import LlamaConfig
from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.quant.kv import KV_FORMATS
from lowbit.quant.linear import ExactRows
from lowbit.runtime.engine.kv_cache import KVPool
from lowbit.runtime.engine.runner import Chunk, Runner, prepare, exact_rows

CFG = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                  vocab_size=101, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=128, tie_embeddings=False)
PAGE = 4


def test_prepare_lays_chunks_end_to_end():
    # a prefill piece of 3 tokens at positions 4..6 wanting no logits, a decode token at 9, and a
    # speculating chunk (pending token + 2 drafts at 2..4) wanting all three rows
    chunks = [Chunk([5, 6, 7], 4, [20, 21, 22], [3, 5], logits=0, exact=3),
              Chunk([8], 9, [41], [0, 7, 10]),
              Chunk([1, 2, 3], 2, [10, 11, 12], [2, 1], logits=3, one_by_one=True, exact=1)]
    tokens, b = prepare(chunks, "cpu")
    assert tokens.tolist() == [5, 6, 7, 8, 1, 2, 3]
    assert b.positions.tolist() == [4, 5, 6, 9, 2, 3, 4]
    assert b.slots.tolist() == [20, 21, 22, 41, 10, 11, 12]
    assert b.query_lens == [3, 1, 3] and b.context_lens == [7, 10, 5]
    assert [t.tolist() for t in b.block_tables] == [[3, 5], [0, 7, 10], [2, 1]]
    assert b.logits_rows.tolist() == [3, 4, 5, 6]
    assert b.one_by_one == [False, False, True]
    assert exact_rows(chunks, "cpu").mask.tolist() == [True, True, True, False, True, False, False]
    assert exact_rows(chunks[:1], "cpu") is True and exact_rows(chunks[1:2], "cpu") is False
    assert isinstance(exact_rows(chunks, "cpu"), ExactRows)


@pytest.mark.parametrize("kv", ["f32", "f16", "k8v4"])
def test_runner_steps_equal_one_pass(kv):
    """Two sequences prefilled in pieces and decoded through the runner, sharing steps and with
    their pages out of order, give the logits one pass over each whole sequence gives in a fresh
    pool: a wrong position, slot or page table changes them."""
    torch.manual_seed(0)
    model = Llama(CFG, random_weights(CFG, "int4-g32", "int8-g32", seed=1, scale=0.1)).eval()
    a, b = torch.randint(0, 100, (11,)).tolist(), torch.randint(0, 100, (7,)).tolist()
    fmt = KV_FORMATS[kv]

    def slots(pages, start, n):
        return [pages[p // PAGE] * PAGE + p % PAGE for p in range(start, start + n)]

    pa, pb = [7, 2, 5], [6, 0]  # pages of a (11 tokens) and b (7), interleaved and reversed
    runner = Runner(model, KVPool(fmt, CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_pages=8, page_size=PAGE))
    step1 = runner.run([Chunk(a[:5], 0, slots(pa, 0, 5), pa, logits=1), Chunk(b[:6], 0, slots(pb, 0, 6), pb)], True)
    step2 = runner.run([Chunk(b[6:], 6, slots(pb, 6, 1), pb), Chunk(a[5:], 5, slots(pa, 5, 6), pa, logits=6)], True)
    assert step1.shape == (2, CFG.vocab_size) and step2.shape == (7, CFG.vocab_size)

    def one_pass(ids):
        pages = list(range(-(-len(ids) // PAGE)))
        fresh = Runner(model, KVPool(fmt, CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_pages=len(pages),
                                     page_size=PAGE))
        return fresh.run([Chunk(ids, 0, slots(pages, 0, len(ids)), pages, logits=len(ids))], True)

    whole_a, whole_b = one_pass(a), one_pass(b)
    torch.testing.assert_close(step1[0], whole_a[4], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step1[1], whole_b[5], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step2[0], whole_b[6], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step2[1:], whole_a[5:], rtol=1e-4, atol=1e-4)
