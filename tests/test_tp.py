"""Tensor parallelism on CPU over gloo (runtime/engine/tp.py, models/sharding.py): ranks started as users
start them, checked against the same model in one process.

The oracle is the single-process model: each engine step's logits (recorded at forward_paged) must
match it within the differences fp32 summation order makes, and greedy replies must be the same
tokens. The row-parallel projections add N partial sums where one process adds one run, so the
residual stream differs in its last bits; the KV cache then rounds those values, and a rounding
that falls the other way moves logits further. These tests use the f16 cache (rounding steps of
2^-11); with k8v4 a flipped int4 code of V moves logits by percents (measured 3% on the default
model, and greedy replies part at a near-tie), as with any change of summation order (docs/tp.md).
The ranks are real processes (torch.multiprocessing spawn); each test class holds one group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.load.loader import load
from lowbit.runtime.engine.sampler import SamplingParams
from lowbit.runtime.engine.speculative import SpecConfig
from lowbit.runtime.engine.tp import load_tp
from lowbit.runtime.ports import free_port
from tests.test_cli import LOWBIT, N_HEADS, N_KV_HEADS, assert_one_line_error, write_tiny_gguf

pytestmark = pytest.mark.slow


def recorded(model) -> list[torch.Tensor]:
    """Every forward_paged's logits, in step order (an instance attribute shadows the method)."""
    steps, run = [], model.forward_paged

    def forward_paged(*args, **kwargs):
        steps.append(run(*args, **kwargs).clone())
        return steps[-1]

    model.forward_paged = forward_paged
    return steps


def generate(model, tok, prompts: list[list[int]], max_tokens: int, **engine_kw) -> tuple[list[list[int]], Engine]:
    """The prompts as concurrent greedy requests through one engine → each reply's token ids."""
    engine = Engine(model, tok, EngineConfig(kv_format="f16", kv_memory=4 << 20, page_size=4, **engine_kw))
    rids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            for p in prompts]
    out = {r: [] for r in rids}
    while engine.has_work():
        for d in engine.step():
            out[d.request_id] += d.token_ids
    return [out[r] for r in rids], engine


def assert_same_run(tp_model, one_model, tok, prompts, max_tokens, rtol: float, **engine_kw):
    """Greedy replies identical; then every step's logits within rtol of the largest logit."""
    a_steps, b_steps = recorded(tp_model), recorded(one_model)
    try:
        a, engine = generate(tp_model, tok, prompts, max_tokens, **engine_kw)
        b, _ = generate(one_model, tok, prompts, max_tokens, **engine_kw)
    finally:  # the shared models get their own method back
        del one_model.forward_paged, tp_model.forward_paged
    assert a == b
    assert len(a_steps) == len(b_steps) > 1
    for x, y in zip(a_steps, b_steps):
        assert x.shape == y.shape
        err = (x - y).abs().max() / y.abs().max()
        assert err <= rtol, float(err)
    return engine


class TestTinyTP2:
    """`--tp 2` on a tiny GGUF (4 heads, 2 KV heads, MLP 128, 266-token vocabulary, Q4_1/Q8_0)."""

    @pytest.fixture(scope="class")
    def models(self, tmp_path_factory):
        path = write_tiny_gguf(tmp_path_factory.mktemp("tp") / "tiny.gguf")
        threads = torch.get_num_threads()
        tp = load_tp(str(path), "auto", 2, progress=False, threads=2)
        yield tp, load(str(path), "auto", progress=False)
        tp.model.close()
        torch.set_num_threads(threads)

    def test_steps_and_greedy_replies_equal_one_process(self, models):
        tp, one = models
        prompts = [tp.tokenizer.encode(t, add_special=False) for t in ("the thing is", "this is a longer prompt")]
        # exact prompt rows and fast generated rows, two sequences batched. Fast rows round each block
        # of 32 activations to 16-bit codes (kernels/act_quant.py): an all-reduced sum that differs
        # from one process's in its last bit can land on the other side of a code boundary, a step of
        # 2^-15 of its block's largest value (3e-5). Measured max 2.2e-5 of the largest logit (4.2e-6
        # with fp32 activations); a wrong slice or a missing all-reduce moves them by O(1)
        engine = assert_same_run(tp.model, one.model, tp.tokenizer, prompts, 10, rtol=1e-4)
        info = tp.model.rank_info(engine.pool)
        assert [i["rank"] for i in info] == [0, 1]
        assert [i["kv_heads"] for i in info] == [N_KV_HEADS // 2] * 2
        assert info[0]["vocab_range"] == (0, 133) and info[1]["vocab_range"] == (133, 266)

    def test_speculative_decoding_is_unchanged(self, models):
        tp, one = models
        prompts = [tp.tokenizer.encode("the the the the the the", add_special=False)]
        # 12 tokens in 7 steps (drafts accepted); measured max 2.8e-5 of the largest logit (3.8e-7 with
        # fp32 activations): the bound of the test above, for the same reason (an activation code flips)
        assert_same_run(tp.model, one.model, tp.tokenizer, prompts, 12, rtol=1e-4,
                        speculative=SpecConfig.parse("ngram,k=3"))


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "smollm3", "phi3", "ministral3"])
def test_family_variants_split_over_tp2(family, default_gguf, tmp_path):
    """Each family's variants under `--tp 2`: Qwen3's q/k norms, Gemma 3's (four norms, GeGLU, embeddings x
    sqrt(dim), local and global layers with their windows), SmolLM3's NoPE layers and tied table, Phi's
    fused qkv/gate_up split by rows then by rank, Ministral's query temperature: the per-head and
    post-all-reduce norms are whole on every rank. A tiny safetensors checkpoint (tests/family_models.py; Gemma with 4/2 heads so they split),
    int8 weights. The reason for a bound is TestTinyTP2's (a 16-bit activation code flips when an
    all-reduced sum differs in its last bit); these unit-gain random models amplify a flip more:
    measured max 1.2e-4 of the largest logit (both families), bound 5e-4; a wrong slice or a norm
    applied to a partial sum moves logits by O(1)."""
    import transformers

    from tests.family_models import build, save

    tok_dir = tmp_path / "tok"
    tok = transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    tok.save_pretrained(tok_dir)
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2} if family == "gemma3" else {}
    hf = save(build(family, 49152, seed=3, **heads), tok_dir, tmp_path / "hf", family)
    threads = torch.get_num_threads()
    tp = load_tp(str(hf), "int8", 2, progress=False, threads=2)
    try:
        one = load(str(hf), "int8", progress=False)
        prompts = [tp.tokenizer.encode(t, add_special=False) for t in ("the thing is", "this is a longer prompt, "
                                                                          "longer than the window of sixteen")]
        assert_same_run(tp.model, one.model, tp.tokenizer, prompts, 8, rtol=5e-4)
    finally:
        tp.model.close()
        torch.set_num_threads(threads)


class TestDefaultModelTP3:
    """`--tp 3` on the default model (9 heads, 3 KV heads, tied Q8_0 embeddings)."""

    @pytest.fixture(scope="class")
    def models(self, default_gguf, default_model):
        threads = torch.get_num_threads()
        tp = load_tp(str(default_gguf), "auto", 3, progress=False, threads=2)
        yield tp, default_model
        tp.model.close()
        torch.set_num_threads(threads)

    def test_steps_and_greedy_replies_equal_one_process(self, models):
        tp, one = models
        tok = tp.tokenizer
        prompts = [tok.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
                   for q in ("What is the capital of France?", "Name three colours.")]
        # measured max 8.2e-4 of the largest logit over 12 steps (f16 roundings flipped, see the top)
        engine = assert_same_run(tp.model, one.model, tok, prompts, 12, rtol=2e-3)
        # each rank caches one of the 3 KV heads: a third of the bytes per page, so the same
        # --kv-memory (a per-rank budget) holds 3x the pages, the same number on every rank
        info = tp.model.rank_info(engine.pool)
        one_pool = Engine(one.model, tok, EngineConfig(kv_format="f16", kv_memory=4 << 20, page_size=4)).pool
        assert [i["kv_heads"] for i in info] == [1, 1, 1] and len({i["pid"] for i in info}) == 3
        assert all(i["pool_bytes"] == engine.pool.nbytes <= 4 << 20 for i in info)
        assert 3 * engine.pool.nbytes // engine.pool.num_pages == one_pool.nbytes // one_pool.num_pages


def test_default_model_refuses_tp2(default_gguf, tmp_path):
    r = subprocess.run([*LOWBIT, "run", "--tp", "2", "--model", str(default_gguf), "hi"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert_one_line_error(r, "--tp 2", "9 attention heads", "3 KV heads")


def test_bad_tp_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert N_HEADS % 3
    r = subprocess.run([*LOWBIT, "run", "--tp", "3", "--model", str(path), "hi"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert_one_line_error(r, "--tp 3", f"{N_HEADS} attention heads")
    r = subprocess.run([*LOWBIT, "run", "--tp", "0", "--model", str(path), "hi"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert_one_line_error(r, "--tp must be >= 1")


def _serve(model: str, tp: int, log):
    """`lowbit serve MODEL --tp N` on a free port → (process, base URL), once /health says 200."""
    port = free_port()
    proc = subprocess.Popen([*LOWBIT, "serve", model, "--tp", str(tp), "--port", str(port), "--kv-memory", "16MiB"],
                            stdout=log, stderr=subprocess.STDOUT)
    base, deadline = f"http://127.0.0.1:{port}", time.time() + 240
    while True:
        assert proc.poll() is None, f"server exited {proc.returncode}"
        assert time.time() < deadline, "server not ready in 240 s"
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def _ranks(pid: int) -> list[int]:
    """The server's rank processes (torch.multiprocessing spawn children, not its resource tracker)."""
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:  # a thread (uvicorn's, torch's) may end between the listing and the read
            kids += open(f"/proc/{pid}/task/{task}/children").read().split()
        except FileNotFoundError:
            pass
    ranks = []
    for k in kids:
        try:
            if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read():
                ranks.append(int(k))
        except FileNotFoundError:  # a short-lived child (the resource tracker's helper) already gone
            pass
    return ranks


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_server_with_tp3_passes_the_streaming_test(default_gguf, tmp_path):
    """The OpenAI server's streaming acceptance test (tests/test_serve_default_model.py), against
    `lowbit serve --tp 3`."""
    from tests.test_serve_default_model import test_chat_non_streamed_and_streamed

    with open(tmp_path / "serve.log", "w") as log:
        proc, base = _serve(str(default_gguf), 3, log)
        try:
            assert len(_ranks(proc.pid)) == 2
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
            test_chat_non_streamed_and_streamed(client, client.models.list().data[0].id)
        finally:
            _stop(proc)
    assert proc.returncode in (0, 130), (tmp_path / "serve.log").read_text()[-2000:]
    assert "died" not in (tmp_path / "serve.log").read_text()


def test_killed_rank_makes_the_server_exit_fast(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    with open(tmp_path / "serve.log", "w") as log:
        proc, _ = _serve(str(path), 2, log)
        try:
            (rank,) = _ranks(proc.pid)
            os.kill(rank, signal.SIGKILL)
            t0 = time.time()
            code = proc.wait(timeout=30)
        finally:
            _stop(proc)
    text = (tmp_path / "serve.log").read_text()
    assert code == 1 and time.time() - t0 < 10, text[-2000:]
    assert f"tensor-parallel rank 1 (pid {rank}) died (killed by SIGKILL)" in text, text[-2000:]


def test_ranks_start_when_stderr_is_not_a_file(tmp_path):
    """`lowbit chat` runs the model under Textual, whose sys.stderr has no file descriptor (fileno()
    -1); multiprocessing's resource tracker would pass that to its process and the spawn failed
    ("bad value(s) in fds_to_keep"). In a fresh process, where no tracker runs yet."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    script = tmp_path / "tui_stderr.py"
    script.write_text(f'''
import io, sys
from lowbit.runtime.engine.tp import load_tp

class NoFile(io.StringIO):
    def fileno(self):
        return -1

if __name__ == "__main__":
    sys.stderr = NoFile()
    lm = load_tp({str(path)!r}, "auto", 2, progress=False)
    print(len(lm.model.pids))
    lm.model.close()
''')
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr[-2000:]
