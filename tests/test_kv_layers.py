"""Per-layer KV formats in the serving engine (EngineConfig.kv_layers, as `lowbit fit` chooses them): the pool's
bytes and pages, the refusals, the tensor-parallel ranks' pools, attention over a pool whose layers differ
(f16 keys with int4 values, int4 keys with f16 values, both quantized, neither) on every path, and the engine's
fast CPU path on the default model against the exact path.

Oracles: byte counts written out from quant/kv.py's documented side sizes; attention against SDPA in float64
over the pool's own un-rotated, dequantized K/V (KVPool.gather, torch), and the C kernel against the plain-torch
path at test_kv_quant.py's tolerance; on the default model, one exact fp32 pass (exact matmuls, SDPA) over
the very cache the fast path wrote, at test_cpu_native.py's 1e-6 mean-KL bound, and the exact path's own pool
(runtime/eval/evaluate.py window_logprobs) for the greedy tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lowbit.models.attention import PagedAttention, PagedBatch
from lowbit.models.config import LlamaConfig
from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.quant.kv import KV_FORMATS, parse_kv_format
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.kv_cache import KVPool
from lowbit.runtime.engine.runner import Chunk, Runner
from lowbit.runtime.engine.sampler import SamplingParams
from tests.helpers import ByteTokenizer, paged_backend

# a recipe of every kind of layer: f16 keys with int4 values, int8 both, int4 keys with f16 values, k8v4
CYCLE = ("k16v4", "k8v8", "k4v16", "k8v4")


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


# ---- bytes and pages --------------------------------------------------------------------------------------

def test_from_budget_counts_each_layers_own_bytes():
    """Per head and token at D = 64 (quant/kv.py: codes plus fp16 scales, and mins for int4):
    f16 side 64 x 2 = 128 B; int8, one scale per 64: 64 + 2 = 66 B; int4, scale and min per 32: 32 + 2 x (2 + 2)
    = 40 B. So k16v4 128 + 40 = 168, k8v8 66 + 66 = 132, k4v16 40 + 128 = 168, k8v4 66 + 40 = 106 (the table's
    132 and 106); the four layers at 3 KV heads: 3 x (168 + 132 + 168 + 106) = 1,722 B a token, 27,552 B a
    16-token page."""
    formats = [parse_kv_format(n) for n in CYCLE]
    per_page = 3 * (168 + 132 + 168 + 106) * 16
    assert per_page == 27_552
    pool = KVPool.from_budget(KV_FORMATS["k8v4"], 4, 3, 64, 10 * per_page + per_page - 1, 16, layer_formats=formats)
    assert pool.num_pages == 10 and pool.nbytes == 10 * per_page  # the tensors held are the bytes counted
    assert [(pool.side(i, "k").bits, pool.side(i, "v").bits) for i in range(4)] == [(16, 4), (8, 8), (4, 16), (8, 4)]
    uniform = KVPool.from_budget(KV_FORMATS["k8v4"], 4, 3, 64, 10 * per_page, 16)  # 4 x 3 x 106 x 16 = 20,352 B a page
    assert uniform.num_pages == 10 * per_page // 20_352 == 13
    with pytest.raises(ValueError, match="holds no page") as e:
        KVPool.from_budget(KV_FORMATS["k8v4"], 4, 3, 64, per_page - 1, 16, layer_formats=formats)
    assert "27552 bytes each in per-layer formats" in one_line(e)
    with pytest.raises(ValueError, match="3 layer formats for 4 layers"):
        KVPool.from_budget(KV_FORMATS["k8v4"], 4, 3, 64, 10 * per_page, 16, layer_formats=formats[:3])


# ---- the engine's refusals and description on a tiny model -------------------------------------------------

CFG = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                  vocab_size=101, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=128, tie_embeddings=False)


@pytest.fixture(scope="module")
def tiny() -> Llama:
    return Llama(CFG, random_weights(CFG, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()


def test_bad_kv_layers_are_one_line_errors(tiny):
    with pytest.raises(ValueError, match=r"kv_layers\[1\]: unknown KV cache format 'k2v4'") as e:
        EngineConfig(kv_layers=("k8v4", "k2v4"))
    one_line(e)
    with pytest.raises(ValueError, match="non-empty sequence") as e:
        EngineConfig(kv_layers="k8v4")  # a string is not one name per layer
    one_line(e)
    with pytest.raises(ValueError, match="3 KV formats; the model has 2 KV layers") as e:
        Engine(tiny, ByteTokenizer(), EngineConfig(kv_layers=("k8v4", "k4v4", "f16"), kv_memory=1 << 20))
    one_line(e)


def test_describe_pool_names_each_layers_format(tiny):
    config = EngineConfig(kv_layers=["k4v4", "k16v4"], kv_memory=1 << 20, page_size=4)
    assert config.kv_layers == ("k4v4", "k16v4")  # a recipe's list, kept as a tuple (the record is frozen)
    eng = Engine(tiny, ByteTokenizer(), config)
    assert eng.describe_pool().startswith("KV cache per layer (k4v4 x1, k16v4 x1): ")
    assert [f.name for f in eng.pool.formats] == ["k4v4", "k16v4"] and eng.pool.fmt.name == "k8v4"
    same = Engine(tiny, ByteTokenizer(), EngineConfig(kv_format="f16", kv_layers=("k4v4",) * 2, kv_memory=1 << 20))
    assert same.describe_pool().startswith("KV cache k4v4: ")  # what the layers hold, not the pool's name


def test_tensor_parallel_ranks_build_the_same_per_layer_pool():
    from lowbit.runtime.engine.tp import _pool_key, _rank_pool

    formats = [parse_kv_format(n) for n in CYCLE]
    rank = SimpleNamespace(config=SimpleNamespace(n_kv_layers=4, head_dim=64), kv_heads=1)  # one of 3 heads
    for pool in (KVPool(KV_FORMATS["k8v4"], 4, 3, 64, 5, 16, layer_formats=formats),
                 KVPool(KV_FORMATS["k4v4"], 4, 3, 64, 5, 16)):
        key = _pool_key(pool)
        theirs = _rank_pool(rank, key)
        assert theirs.formats == pool.formats and (theirs.num_pages, theirs.page_size) == (5, 16)
        assert theirs.n_kv_heads == 1 and (theirs.rot is None) == (pool.rot is None)
    assert _pool_key(KVPool(KV_FORMATS["k4v4"], 4, 3, 64, 5, 16))[1] is None  # a uniform pool sends no list


# ---- attention over a pool whose layers differ ---------------------------------------------------------------

H, Hkv, D, P = 6, 2, 64, 4  # 3 query heads per KV head, pages of 4 tokens
LAYERS = ("k16v4", "k4v16", "k8v4", "f16")  # f16 K + int4 V, int4 K + f16 V, both rotated, none
# (context once the step's tokens are written, new tokens): decodes, a 2-token chunk (C rows on CPU, split-KV
# in Triton) and a 36-token prompt chunk (past C_ROWS_MAX = 32: SDPA on CPU, the prefill kernel in Triton)
SEQS = [(9, 1), (3, 2), (21, 1), (40, 36)]


def mixed_step(backend) -> tuple[KVPool, list[torch.Tensor], list[torch.Tensor], dict]:
    """A pool of LAYERS over SEQS (scattered pages; each layer's cache drawn alike for every backend), one step
    through each layer → (pool, outputs [M, H*D] per layer, the K/V written per layer [ctx, Hkv, D] per
    sequence, the step)."""
    g = torch.Generator().manual_seed(4)
    n_pages = [-(-c // P) for c, _ in SEQS]
    pool = KVPool(KV_FORMATS["k8v4"], len(LAYERS), Hkv, D, num_pages=sum(n_pages) + 2, page_size=P,
                  layer_formats=[parse_kv_format(n) for n in LAYERS])
    perm = torch.randperm(pool.num_pages, generator=g)
    tables = list(perm[:sum(n_pages)].split(n_pages))
    pos = torch.cat([torch.arange(c - n, c) for c, n in SEQS])
    slots = torch.cat([t[p // P] * P + p % P for t, p in zip(tables, pos.split([n for _, n in SEQS]))])
    batch = PagedBatch(pos, slots, [n for _, n in SEQS], [c for c, _ in SEQS], tables, torch.arange(len(pos)))
    attend = PagedAttention(pool, batch, None, backend)
    outs, written = [], []
    for layer in range(len(LAYERS)):
        ks = [torch.randn(c, Hkv, D, generator=g) for c, _ in SEQS]
        vs = [torch.randn(c, Hkv, D, generator=g) for c, _ in SEQS]
        for t, (c, n), k, v in zip(tables, SEQS, ks, vs):  # the cache before the step
            p = torch.arange(c - n)
            pool.write(layer, k[:c - n], v[:c - n], t[p // P] * P + p % P, backend.native)
        q = torch.randn(len(pos), H, D, generator=g)
        new_k = torch.cat([k[c - n:] for (c, n), k in zip(SEQS, ks)])
        new_v = torch.cat([v[c - n:] for (c, n), v in zip(SEQS, vs)])
        outs.append((q, attend(layer, q, new_k, new_v)))
        written.append((ks, vs))
    return pool, outs, written, {"pos": pos, "tables": tables}


@pytest.mark.parametrize("path", ["c", "torch", "triton"])
def test_attention_reads_each_layers_sides_as_they_are_stored(path):
    """Every path attends each layer of the mixed pool as SDPA in float64 over that layer's un-rotated,
    dequantized K/V (rtol 1e-5, atol 5e-6: test_kv_quant.py's C-against-float64 bound); the C kernel also
    matches the plain-torch path at test_kv_quant.py's 1e-5 / 2e-6. Each side holds what was written: a float
    side its values exactly (never rotated), a quantized one within its bits' error (a side rotated on write
    but not back on read is off by ~1.4 x its norm)."""
    pool, outs, written, step = mixed_step(paged_backend(path, cuda=False))
    assert pool.rot is not None
    for layer, ((q, got), (ks, vs)) in enumerate(zip(outs, written)):
        row = 0
        for i, (c, n) in enumerate(SEQS):
            keys, values = pool.gather(layer, step["tables"][i], c)  # [Hkv, c, D]
            for name, side, x in (("k", keys, ks[i]), ("v", values, vs[i])):
                x = x.transpose(0, 1)  # [Hkv, c, D]
                bits = pool.side(layer, name).bits
                if bits == 16:
                    assert torch.equal(side, x.half().float()), (layer, name)
                else:  # int4: ~8% of the norm measured, int8: ~0.5%
                    assert (side - x).norm() / x.norm() < (0.15 if bits == 4 else 0.02), (layer, name)
            k_pos = torch.arange(c)
            p = step["pos"][row:row + n]
            mask = k_pos[None, :] <= p[:, None]  # [n, c]
            want = F.scaled_dot_product_attention(q[row:row + n].double().transpose(0, 1)[None], keys[None].double(),
                                                  values[None].double(), attn_mask=mask, enable_gqa=True)
            want = want[0].transpose(0, 1).reshape(n, H * D)
            torch.testing.assert_close(got[row:row + n].double(), want, rtol=1e-5, atol=5e-6)
            row += n
    if path == "c":
        _, plain, _, _ = mixed_step(paged_backend("torch", cuda=False))
        for layer, ((_, got), (_, want)) in enumerate(zip(outs, plain)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


# ---- the default model: the engine's fast path against the exact path --------------------------------------

PROMPT, NEW = 40, 16  # 40 prompt tokens: past C_ROWS_MAX, so the exact passes below attend with SDPA


def generate(lm, config: EngineConfig, ids: list[int]) -> dict:
    """Greedy NEW tokens through an engine → its tokens, the logits of every step it sampled from [NEW, V], the
    engine, and the last step's chunk (the sequence's pages)."""
    eng = Engine(lm.model, lm.tokenizer, config)
    rows, chunks, run = [], [], eng.runner.run

    def recorded(step_chunks, exact):
        out = run(step_chunks, exact)
        rows.append(out.clone())
        chunks.append(step_chunks[0])
        return out

    eng.runner.run = recorded
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), "r")
    tokens = []
    while eng.has_work():
        for d in eng.step():
            tokens += d.token_ids
    return {"tokens": tokens, "logits": torch.cat(rows), "engine": eng, "last": chunks[-1]}


def kl(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(ref || got) per row, in float64 (fp32 log-softmaxes disagree by ~1e-7 by themselves)."""
    a, b = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    return (a.exp() * (a - b)).sum(-1)


@pytest.fixture(scope="module")
def lm(default_model):
    """The default model on lowbit's C kernels (its one-call decode), skipping where they do not build."""
    if default_model.model.fused_layers is None:
        pytest.skip("the C kernels do not build here (tests/test_cpu_native.py says whether they must)")
    return default_model


@pytest.fixture(scope="module")
def prompt(lm, wikitext_excerpt) -> list[int]:
    ids = lm.tokenizer.encode(wikitext_excerpt.decode("utf-8"), add_special=False)[:PROMPT]
    assert len(ids) == PROMPT
    return ids


@pytest.fixture(scope="module")
def mixed(lm, prompt):
    """The CYCLE over every KV layer of the default model (30: k16v4 x8, k8v8 x8, k4v16 x7, k8v4 x7)."""
    layers = tuple(CYCLE[i % len(CYCLE)] for i in range(lm.config.n_kv_layers))
    one_calls, run_layers = [], PagedAttention.run_layers

    def counted(self, *args):  # a step run in one C call (models/llama.py takes it for a decode step)
        one_calls.append(1)
        return run_layers(self, *args)

    PagedAttention.run_layers = counted
    try:
        out = generate(lm, EngineConfig(kv_layers=layers, kv_memory=8 << 20, exact=False), prompt)
    finally:
        PagedAttention.run_layers = run_layers
    return out | {"layers": layers, "one_calls": len(one_calls)}


@pytest.mark.slow
def test_fast_path_over_a_per_layer_pool_matches_the_exact_pass_over_its_cache(lm, prompt, mixed):
    """Every decode step ran in one C call (cpu_block.c over 30 layers of 4 kinds); one exact fp32 pass (exact
    matmuls, SDPA over the gathered, un-rotated pages) over the very K/V the fast path wrote gives its logits
    within test_cpu_native.py's bound for the fast kernels: mean KL <= 1e-6 (measured: 2.8e-8), the same top-1
    but at a tie the exact pass itself cannot call (its top two within 1e-3; measured: one, 1e-4 apart). A layer
    attended in the wrong space is off by O(1)."""
    eng, tokens = mixed["engine"], mixed["tokens"]
    assert mixed["one_calls"] == NEW - 1 and len(tokens) == NEW
    assert eng.describe_pool().startswith("KV cache per layer (k16v4 x8, k8v8 x8, k4v16 x7, k8v4 x7): ")
    pages = mixed["last"].pages  # every position the sequence wrote, each step's cache as it saw it (causal)
    T = PROMPT + NEW - 1
    free = [p for p in range(eng.pool.num_pages) if p not in pages]
    ps = eng.pool.page_size
    scratch = [free[i // ps] * ps + i % ps for i in range(T)]  # the exact pass writes its own K/V elsewhere
    exact = Runner(lm.model, eng.pool).run([Chunk(prompt + tokens[:-1], 0, scratch, pages, logits=T)],
                                           exact=True)[PROMPT - 1:]
    fast = mixed["logits"]
    k = kl(exact, fast)
    assert 1e-10 < k.mean() <= 1e-6, float(k.mean())
    top = exact.topk(2)
    for i in (exact.argmax(-1) != fast.argmax(-1)).nonzero().flatten().tolist():
        assert top.values[i, 0] - top.values[i, 1] < 1e-3, (i, top.values[i].tolist())


@pytest.mark.slow
def test_fast_greedy_over_a_per_layer_pool_is_the_exact_paths(lm, prompt, mixed):
    """The exact path with its own pool of the same formats (window_logprobs: one exact pass, its K/V quantized
    as computed) chooses the fast path's tokens, but at near-ties (test_quantize.py's 0.25 of log-prob; the
    quantized cache turns the fast kernels' last bits into whole code steps, so the two caches differ: mean KL
    2.4e-3 measured, 2.5e-3 for a uniform k8v4 cache the same way)."""
    from lowbit.runtime.eval.evaluate import window_logprobs

    tokens = mixed["tokens"]
    lp = window_logprobs(lm.model, prompt + tokens[:-1], [parse_kv_format(n) for n in mixed["layers"]])[PROMPT - 1:]
    chosen = lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    regret = lp.max(-1).values - chosen
    assert int((regret == 0).sum()) >= NEW - 1 and float(regret.max()) <= 0.25, regret.tolist()
    assert float(kl(lp, mixed["logits"]).mean()) < 5e-3  # k8v4's own quality bar against f16 (quant/kv.py)


@pytest.mark.slow
def test_one_call_decode_equals_block_by_block_over_a_per_layer_pool(lm, prompt, mixed, monkeypatch):
    """The one-call decode (cpu_block.c) and the per-block path (a C attention call per layer) over the same
    per-layer pool: the same tokens and logits, bit for bit."""
    monkeypatch.setattr(lm.model, "fused_layers", None)
    alone = generate(lm, EngineConfig(kv_layers=mixed["layers"], kv_memory=8 << 20, exact=False), prompt)
    assert alone["tokens"] == mixed["tokens"] and torch.equal(alone["logits"], mixed["logits"])


@pytest.mark.slow
def test_every_layer_at_k8v4_is_the_uniform_k8v4_engine(lm, prompt):
    """A per-layer list of one format is that format, bit for bit: the same pool size, tokens and logits."""
    uniform = generate(lm, EngineConfig(kv_format="k8v4", kv_memory=8 << 20, exact=False), prompt)
    listed = generate(lm, EngineConfig(kv_format="f16", kv_layers=("k8v4",) * lm.config.n_kv_layers,
                                       kv_memory=8 << 20, exact=False), prompt)
    assert listed["engine"].pool.num_pages == uniform["engine"].pool.num_pages
    assert listed["engine"].describe_pool() == uniform["engine"].describe_pool()
    assert listed["tokens"] == uniform["tokens"] and torch.equal(listed["logits"], uniform["logits"])
