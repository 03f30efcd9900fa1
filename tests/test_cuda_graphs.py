"""Graphed decode steps (runtime/engine/cuda_graphs.py): padding, static buffers, eligibility, wiring.

Without a GPU the Triton backend runs on the CPU under Triton's interpreter (tests/conftest.py), and
the CUDA capture is replaced by `RerunCapture`: "capture" runs the step once and keeps it, "replay"
runs it again on whatever the static buffers hold and writes the result into the captured output
tensor, as a CUDA graph replay rewrites its output's memory. Both run under `no_host_reads`, so a
step that reads device data to the host, or builds its attention tensors from the batch's lists
(what a replay would never see), fails here. The `gpu` cases capture real CUDA graphs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

import pytest
import torch

import lowbit.models.attention as attention
from lowbit.kernels.paged_attention import paged_attention
from lowbit.kernels.triton_import import interpreting
from lowbit.models.backend import torch_backend, triton_backend
from lowbit.models.config import LlamaConfig
from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.quant.kv import KV_FORMATS
from lowbit.quant.linear import ExactRows
from lowbit.runtime.cli.engine_args import add_kv_args, engine_config
from lowbit.runtime.engine import cuda_graphs
from lowbit.runtime.engine import engine as engine_module
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.cuda_graphs import DecodeGraphs, buckets, decode_graphs, why_eager
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.kv_cache import KVPool
from lowbit.runtime.engine.pages import PageManager
from lowbit.runtime.engine.runner import Chunk, Runner
from lowbit.runtime.engine.sampler import SamplingParams
from tests.helpers import ByteTokenizer

CFG = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                  vocab_size=101, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64, tie_embeddings=True)
PAGE = 4


def _model(device: str = "cpu") -> Llama:
    if device == "cpu" and not interpreting():
        pytest.skip("the Triton backend on CPU needs TRITON_INTERPRET=1")
    w = random_weights(CFG, "int4-g32", "int8-g32", seed=0, scale=0.1)
    return Llama(CFG, w, triton_backend(device)).eval()


# ---- the stand-in capture and the host-read guard ---------------------------------------------

_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__", "__array__")


def _in_triton() -> bool:
    """Whether Triton is on the call stack: its interpreter is the GPU here, and reads its arguments."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_globals.get("__name__", "").split(".")[0] == "triton":
            return True
        f = f.f_back
    return False


@contextlib.contextmanager
def no_host_reads():
    """Every way a tensor's data reaches Python raises (outside Triton's interpreter), and so does
    building the attention's tensors from the batch's Python lists."""
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def guard(name, original):
        @functools.wraps(original)
        def read(self, *args, **kwargs):
            if _in_triton():
                return original(self, *args, **kwargs)
            raise AssertionError(f"Tensor.{name}: a host read inside a captured step")
        return read

    def lists(*_args, **_kwargs):
        raise AssertionError("batch_tensors: a captured step built its tensors from host lists")

    try:
        for name, original in saved.items():
            setattr(torch.Tensor, name, guard(name, original))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attention, "batch_tensors", lists)
            yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


class RerunCapture:
    """The CPU stand-in for cuda_graphs.CUDAGraphCapture (see the module docstring)."""

    def __init__(self):
        self.steps = []  # the captured callables, in capture order
        self.replays = 0

    def __call__(self, fn):
        with no_host_reads():
            out = fn()
        self.steps.append(fn)

        def replay():
            with no_host_reads():
                new = fn()
            assert new.shape == out.shape and new.dtype == out.dtype
            out.copy_(new)
            self.replays += 1

        return replay, out


def _sides(pool: KVPool):
    return [t for layer in range(pool.n_layers) for name in ("k", "v")
            for t in pool.side(layer, name).tensors().values()]  # each [P, Hkv, page, ...]


def test_buckets():
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert buckets(1) == [1] and buckets(2) == [1, 2] and buckets(3) == [1, 2, 3]


def test_guard_catches_a_host_read():
    """no_host_reads is not vacuous: the attention kernel asked to find max_query_len itself reads it
    from the device (one sync), and that raises; the same call given max_query_len=1 passes."""
    _model()  # skips without the interpreter
    pool = KVPool(KV_FORMATS["k8v4"], 1, 2, 16, num_pages=2, page_size=PAGE)
    q = torch.randn(2, 4, 16)
    args = (q, pool.side(0, "k"), pool.side(0, "v"), torch.tensor([0, 1, 2], dtype=torch.int32),
            torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1]), torch.zeros(2, 1, dtype=torch.int32), PAGE)
    with no_host_reads():
        with pytest.raises(AssertionError, match="host read"):
            paged_attention(*args)
        with pytest.raises(AssertionError, match="host read"):
            torch.arange(3).tolist()
        paged_attention(*args, max_query_len=1)


# ---- graphed steps against eager ones ---------------------------------------------------------

def test_graphed_decode_equals_eager():
    """Decode steps of 1, 3 (padded to 4), 4, 5 (padded to 8), 3 and 2 sequences at different
    positions and context lengths, sequences joining (prefilled eagerly in between) and leaving:
    the graphed step's logits are torch.equal to the eager step's, and after every step the two pools
    are equal outside the scratch page, so no padding row wrote to a page anyone can own, while the
    padded steps did write the scratch page. Nothing in a captured step reads the device (RerunCapture).
    In k8v4, the default: rotated, quantized pages (the unrotated f16 path is test_eligibility's)."""
    model = _model()
    num_pages = 24  # 23 for sequences, the last one the graphs' scratch page
    pools = [KVPool(KV_FORMATS["k8v4"], CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_pages, PAGE) for _ in range(2)]
    capture = RerunCapture()
    graphs = DecodeGraphs(model, pools[1], max_num_seqs=8, max_pages=num_pages - 1, capture=capture)
    eager, graphed = Runner(model, pools[0]), Runner(model, pools[1], graphs)
    pm = PageManager(num_pages - 1, PAGE, prefix_caching=False)
    gen = torch.Generator().manual_seed(3)
    pending: dict[str, int] = {}  # seq → its next token

    def join(sid: str, n: int) -> None:
        prompt = torch.randint(0, 100, (n,), generator=gen).tolist()
        pm.match_prefix(sid, prompt)
        chunk = Chunk(prompt, 0, pm.append_slots(sid, n), pm.block_table(sid))
        a, b = eager.run([chunk], False), graphed.run([chunk], False)  # a prefill: eager on both
        assert torch.equal(a, b)
        pending[sid] = int(a[0].argmax())

    def step() -> None:
        chunks = []
        for sid, tok in pending.items():
            start = pm.seq_len(sid)
            chunks.append(Chunk([tok], start, pm.append_slots(sid, 1), pm.block_table(sid)))
        assert graphs.eligible(chunks, False)
        a, b = eager.run(chunks, False), graphed.run(chunks, False)
        assert a.shape == b.shape == (len(chunks), CFG.vocab_size)
        assert torch.equal(a, b), (a - b).abs().max()
        for ta, tb in zip(_sides(pools[0]), _sides(pools[1])):
            assert torch.equal(ta[:-1], tb[:-1])
        for sid, row in zip(pending, a.argmax(-1).tolist()):
            pending[sid] = row

    join("a", 3)
    step()  # 1 sequence: bucket 1
    join("b", 9)
    join("c", 5)
    step()  # 3: bucket 4, one padding row
    join("d", 2)
    step()  # 4: bucket 4, no padding
    join("e", 14)
    step()  # 5: bucket 8, three padding rows
    for sid in ("b", "d"):  # two leave; their pages go back and "f" reuses them
        pm.free(sid)
        del pending[sid]
    join("f", 7)
    step()  # 4 again, "f" on "b"'s and "d"'s old pages
    pm.free("a"), pm.free("c")
    del pending["a"], pending["c"]
    step()  # 2: bucket 2
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and len(capture.steps) == 4
    assert capture.replays == 6
    assert all(t[-1].any() for t in _sides(pools[1]))  # the padding rows wrote the scratch page
    assert not any(t[-1].any() for t in _sides(pools[0]))  # eager steps never touch the scratch page


def test_eligibility():
    """Only pure decode steps run graphed: prefill, a chunk wanting no logits, mixed, speculative
    (attended one by one), exact rows, an exact step, too many sequences or pages go eager."""
    model = _model()
    pool = KVPool(KV_FORMATS["f16"], CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, 10, PAGE)
    capture = RerunCapture()
    graphs = DecodeGraphs(model, pool, max_num_seqs=4, max_pages=3, capture=capture)
    dec = Chunk([5], 6, [10], [1, 2])
    assert graphs.eligible([dec], False) and graphs.eligible([dec] * 4, None)
    ineligible = {
        "prefill": [Chunk([1, 2], 0, [0, 1], [0])],
        "mid-prompt piece": [Chunk([1], 0, [0], [0], logits=0)],
        "mixed": [dec, Chunk([1, 2], 0, [0, 1], [0])],
        "speculative": [dec, Chunk([3, 4], 5, [5, 6], [1, 3], logits=2, one_by_one=True)],
        "speculative, one token": [Chunk([3], 5, [5], [1, 3], one_by_one=True)],
        "exact row": [dec, Chunk([3], 5, [5], [1, 3], exact=1)],
        "too many sequences": [dec] * 5,
        "too many pages": [Chunk([3], 13, [13], [0, 1, 2, 3])],
        "empty": [],
    }
    for why, chunks in ineligible.items():
        assert not graphs.eligible(chunks, False), why
    assert not graphs.eligible([dec], True)
    assert not graphs.eligible([dec, dec], ExactRows(torch.tensor([True, False])))
    # through the runner: an ineligible step runs eagerly, captures nothing, replays nothing
    runner = Runner(model, pool, graphs)
    prefill = Chunk([1, 2, 3], 0, [0, 1, 2], [0])
    assert torch.equal(runner.run([prefill], False), Runner(model, pool).run([prefill], False))
    runner.run([Chunk([4], 3, [3], [0]), Chunk([7, 8], 0, [4, 5], [1])], False)  # mixed
    assert capture.steps == [] and capture.replays == 0 and graphs.graphs == {}
    runner.run([Chunk([4], 2, [6], [1])], False)  # the second sequence's next token
    assert capture.replays == 1 and list(graphs.graphs) == [1]


# ---- the engine ---------------------------------------------------------------------------------

def _replies(model, config: EngineConfig) -> tuple[dict[str, list[int]], Engine]:
    """Greedy replies to four prompts of different lengths, with replies of 3, 4, 5 and 2 tokens; the
    last joins after two steps, so sequences join and leave between decode steps."""
    eng = Engine(model, ByteTokenizer(), config)
    prompts = {"r0": [5, 6, 7], "r1": list(range(10, 21)), "r2": [42] * 6, "r3": [8, 9, 10, 11, 12]}
    out = {rid: [] for rid in prompts}
    for rid in ("r0", "r1", "r2"):
        eng.add_request(prompts[rid], SamplingParams(temperature=0, max_tokens=3 + int(rid[1]), ignore_eos=True), rid)
    steps = 0
    while eng.has_work():
        if steps == 2:
            eng.add_request(prompts["r3"], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), "r3")
        for d in eng.step():
            out[d.request_id] += d.token_ids
        steps += 1
    return out, eng


def test_engine_decodes_through_the_graphs(monkeypatch):
    """The engine builds its runner's graphs from its config, keeps the pool's last page from the
    page manager for them, and replies exactly as with cuda_graphs=False."""
    model = _model()
    capture = RerunCapture()
    monkeypatch.setattr(engine_module, "decode_graphs", functools.partial(decode_graphs, capture=capture))
    config = EngineConfig(kv_format="k8v4", kv_memory=1 << 20, page_size=PAGE, max_num_seqs=4)
    graphed, eng = _replies(model, config)
    assert eng.runner.graphs is not None and eng.runner.graphs.scratch_page == eng.pool.num_pages - 1
    assert eng.blocks.num_pages == eng.pool.num_pages - 1 == eng.stats()["pages_total"]
    # decode steps of 3 sequences (bucket 4) twice, and of the last one alone; the prefill and the
    # step where r3 joins (prefill beside decodes) ran eagerly
    assert sorted(eng.runner.graphs.graphs) == [1, 4] and capture.replays == 3
    eager, eng = _replies(model, EngineConfig(kv_format="k8v4", kv_memory=1 << 20, page_size=PAGE, max_num_seqs=4,
                                              cuda_graphs=False))
    assert eng.runner.graphs is None and eng.blocks.num_pages == eng.pool.num_pages
    assert graphed == eager and {rid: len(v) for rid, v in graphed.items()} == {"r0": 3, "r1": 4, "r2": 5, "r3": 2}


def test_eager_where_graphs_cannot_run(monkeypatch):
    """cuda_graphs=False is eager everywhere; the CPU backend, a Triton model off CUDA and a
    tensor-parallel model are eager by default, an error with cuda_graphs=True; and without CUDA
    the CUDA capture is never touched, even while the engine decodes."""
    model = _model()
    pool = KVPool(KV_FORMATS["f16"], CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, 10, PAGE)
    assert decode_graphs(model, pool, EngineConfig(cuda_graphs=False), 64, capture=RerunCapture()) is None
    assert decode_graphs(model, pool, EngineConfig(), 64) is None  # on CPU
    with pytest.raises(ValueError, match="not CUDA"):
        decode_graphs(model, pool, EngineConfig(cuda_graphs=True), 64)
    cpu = Llama(CFG, random_weights(CFG, "int4-g32", "int8-g32", seed=0, scale=0.1), torch_backend()).eval()
    assert "fused Triton" in why_eager(cpu, pool, on_cuda=False)
    with pytest.raises(ValueError, match="fused Triton"):
        decode_graphs(cpu, pool, EngineConfig(cuda_graphs=True), 64, capture=RerunCapture())
    assert "tensor parallel" in why_eager(object(), pool)
    assert "no page to spare" in why_eager(model, KVPool(KV_FORMATS["f16"], 2, 2, 16, 1, PAGE), on_cuda=False)

    def untouchable(*_args, **_kwargs):
        raise AssertionError("the CUDA graph API was used without CUDA")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", untouchable)
    monkeypatch.setattr(torch.cuda, "graph", untouchable)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", untouchable)
    monkeypatch.setattr(cuda_graphs.CUDAGraphCapture, "__call__", untouchable)
    for m in (model, cpu):
        eng = Engine(m, ByteTokenizer(), EngineConfig(kv_memory=1 << 20, page_size=PAGE))
        assert eng.runner.graphs is None and eng.blocks.num_pages == eng.pool.num_pages
        eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        while eng.has_work():
            eng.step()


def test_no_cuda_graphs_flag():
    p = argparse.ArgumentParser()
    add_kv_args(p)
    assert "--no-cuda-graphs" in p.format_help()
    on, off = p.parse_args([]), p.parse_args(["--no-cuda-graphs"])
    assert engine_config(on, 1 << 20, None).cuda_graphs is None
    assert engine_config(off, 1 << 20, None).cuda_graphs is False


# ---- on a GPU: real graphs ----------------------------------------------------------------------

@pytest.mark.gpu
@torch.inference_mode()
def test_cuda_graphs_equal_eager_on_the_gpu():
    """Captured with torch.cuda.graph (a host sync inside the capture raises there): replays of
    buckets 1, 4 and 8 give the eager step's logits bit for bit and leave every page outside the
    scratch page as the eager steps do; the engine replies the same with and without graphs."""
    model = _model("cuda")
    num_pages = 16
    pools = [KVPool(KV_FORMATS["k8v4"], CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_pages, PAGE, "cuda")
             for _ in range(2)]
    graphs = decode_graphs(model, pools[1], EngineConfig(max_num_seqs=8), CFG.max_seq_len)
    assert isinstance(graphs.capture, cuda_graphs.CUDAGraphCapture)
    eager, graphed = Runner(model, pools[0]), Runner(model, pools[1], graphs)
    pm = PageManager(num_pages - 1, PAGE, prefix_caching=False)
    pending = {}
    for i, n in enumerate((3, 9, 5, 2, 6)):
        sid = f"s{i}"
        pm.match_prefix(sid, [])
        prompt = list(range(1 + i, 1 + i + n))
        chunk = Chunk(prompt, 0, pm.append_slots(sid, n), pm.block_table(sid))
        a = eager.run([chunk], False)
        graphed.run([chunk], False)
        pending[sid] = int(a[0].argmax())
    for live in (["s0"], ["s0", "s1", "s2"], ["s0", "s1", "s2", "s3", "s4"], ["s1", "s3", "s4"]):
        chunks = [Chunk([pending[s]], pm.seq_len(s), pm.append_slots(s, 1), pm.block_table(s)) for s in live]
        a, b = eager.run(chunks, False), graphed.run(chunks, False)
        assert torch.equal(a, b)
        for ta, tb in zip(_sides(pools[0]), _sides(pools[1])):
            assert torch.equal(ta[:-1], tb[:-1])
        for s, row in zip(live, a.argmax(-1).tolist()):
            pending[s] = row
    assert sorted(graphs.graphs) == [1, 4, 8]

    def replies(flag):
        eng = Engine(model, ByteTokenizer(), EngineConfig(kv_memory=1 << 22, page_size=PAGE, cuda_graphs=flag))
        assert (eng.runner.graphs is not None) == (flag is not False)
        for i in range(5):
            eng.add_request(list(range(5, 5 + 3 * i + 2)), SamplingParams(temperature=0, max_tokens=6 + i,
                                                                          ignore_eos=True), f"r{i}")
        out = {f"r{i}": [] for i in range(5)}
        while eng.has_work():
            for d in eng.step():
                out[d.request_id] += d.token_ids
        return out

    assert replies(None) == replies(False)
