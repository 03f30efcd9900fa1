"""Helpers the tests import (the fixtures are in conftest.py, which builds some of them on these)."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from lowbit.runtime.ports import free_port

if TYPE_CHECKING:
    import torch

    from lowbit.runtime.load.gguf_file import GGUFFile


class ByteTokenizer:
    """For tiny random models with a vocabulary of 101: token i < 100 is the byte i + 32
    (printable ASCII); 100 is the end token."""

    vocab_size = 101
    special_ids = frozenset({100})
    eos_ids = frozenset({100})

    def token_bytes(self, i: int) -> bytes:
        return b"" if i == 100 else bytes([i + 32])

    def encode_chat(self, messages, add_generation_prompt=True, limit=None) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return [min(ord(ch) - 32, 99) for ch in text]


@contextlib.contextmanager
def serve_process(args: list[str], log, env: dict | None = None, ready_s: float = 120):
    """`lowbit serve ARGS --port P` as users start it, a subprocess logging to `log` → (base URL, the process)
    once /health answers 200; SIGINT (then kill) on exit."""
    import signal
    import subprocess
    import sys
    import time

    import httpx

    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lowbit.runtime.cli", "serve", *args, "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    base, deadline = f"http://127.0.0.1:{port}", time.time() + ready_s
    try:
        while True:
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield base, proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def serving(app):
    """An ASGI app on a free loopback port, uvicorn in a thread → its base URL (http://127.0.0.1:P);
    stopped on exit."""
    import threading
    import time

    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    try:
        deadline = time.time() + 20
        while not srv.started:
            assert time.time() < deadline and th.is_alive(), "server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{srv.config.port}"
    finally:
        srv.should_exit = True
        th.join(timeout=10)


class Sequences:
    """B sequences through one paged pool of their own, as the engine runs them (runtime/engine/runner.py):
    `step(tokens [B, T])` appends T tokens to every sequence in one forward pass → logits fp32
    [B, T, V]. The oracle's form of a cache: with the lossless f32 format, attention reads back
    exactly the K/V written."""

    def __init__(self, model, batch: int, max_len: int, kv: str = "f32", page_size: int = 16):
        from lowbit.quant.kv import KV_FORMATS
        from lowbit.runtime.engine.kv_cache import KVPool
        from lowbit.runtime.engine.runner import Runner
        from lowbit.runtime.engine.state_cache import StateCache

        c, per = model.config, -(-max_len // page_size)
        # a hybrid model (Qwen3.5): pages for its attention layers, a recurrent-state slot per sequence
        states = StateCache(c, batch, model.device) if c.deltanet is not None else None
        self.pool = KVPool(KV_FORMATS[kv], c.n_kv_layers, model.kv_heads, c.head_dim, num_pages=batch * per,
                           page_size=page_size, device=model.device, states=states)
        self.runner, self.max_len, self.page_size = Runner(model, self.pool), max_len, page_size
        self.pages = [list(range(b * per, (b + 1) * per)) for b in range(batch)]  # [B][per]
        self.lens = [0] * batch

    def step(self, tokens, exact=None):
        """tokens int [B, T] (or a list of B lists, one per sequence, of any lengths: logits [sum T, V])."""
        import torch

        from lowbit.runtime.engine.runner import Chunk

        rows = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
        chunks, ps = [], self.page_size
        for b, toks in enumerate(rows):
            start = self.lens[b]
            if start + len(toks) > self.max_len:
                raise ValueError(f"sequence {b}: {start + len(toks)} tokens exceed {self.max_len}")
            slots = [self.pages[b][p // ps] * ps + p % ps for p in range(start, start + len(toks))]
            chunks.append(Chunk(toks, start, slots, self.pages[b][:-(-(start + len(toks)) // ps)], logits=len(toks),
                                state_slot=b))
            self.lens[b] += len(toks)
        logits = self.runner.run(chunks, exact)
        return logits.view(len(rows), -1, logits.shape[-1]) if isinstance(tokens, torch.Tensor) else logits


def forward(model, tokens, exact=None, kv: str = "f32"):
    """tokens int [B, T], each row a whole sequence from position 0 → logits fp32 [B, T, V] (one pass,
    as the engine prefills a prompt)."""
    return Sequences(model, tokens.shape[0], tokens.shape[1], kv).step(tokens, exact)


def one_line(e, *needles: str) -> str:
    """An exception's message (pytest.ExceptionInfo e): one line holding every needle."""
    msg = str(e.value)
    assert msg and "\n" not in msg, repr(msg)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def fix_interpreter_bf16_dot() -> None:
    """Triton's interpreter (3.6-3.9) keeps bf16 tensors as raw uint16 bits and hands them to
    np.matmul as integers, so every bf16 `tl.dot` comes out as garbage (a 3x32 @ 32x64 product was
    off by 1e7). The GPU multiplies bf16 exactly into fp32; do the same: widen both sides to fp32.
    tests/conftest.py applies it to every test run, tests/bench/wq_precision.py to its own."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_lowbit_bf16", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            a = self.cast_impl(a, tl.float32) if a.dtype.scalar == tl.bfloat16 else a
            b = self.cast_impl(b, tl.float32) if b.dtype.scalar == tl.bfloat16 else b
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._lowbit_bf16 = True
    builder.create_dot = create_dot


def streamed_chat(client, **ask) -> dict:
    """A streamed chat completion from the `openai` client, assembled as clients do it: content, the
    reasoning_content extension, tool calls by index (name and argument pieces joined), the finish reason."""
    out = {"content": "", "reasoning_content": "", "calls": {}, "finish": None}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for ch in chunk.choices:
            out["content"] += ch.delta.content or ""
            out["reasoning_content"] += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            for tc in ch.delta.tool_calls or []:
                c = out["calls"].setdefault(tc.index, {"name": "", "arguments": ""})
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            out["finish"] = ch.finish_reason or out["finish"]
    return out


def kl(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) ‖ softmax(got)) per row [T], in float64."""
    import torch

    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def llama_cpp_logits(path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits [T, V] for `ids` on the GGUF at `path` (llama-cpp-python, 2 threads, one batch)."""
    import numpy as np
    import pytest
    import torch

    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), n_ctx=512, n_batch=512, logits_all=True, n_threads=2, verbose=False)
    try:
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    finally:
        llm.close()


def truncated(src: GGUFFile, dst, layers: int):
    """The first `layers` blocks of `src` (block_count rewritten), every tensor's bytes and every key as stored."""
    import numpy as np
    from gguf import GGUFWriter

    arch = src.metadata["general.architecture"]
    w = GGUFWriter(dst, arch)
    for key, value in src.metadata.items():
        if key != "general.architecture":
            vtype, item = src.value_types[key]
            w.add_key_value(key, layers if key == f"{arch}.block_count" else value, vtype, sub_type=item)
    keep = [t for t in src.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for t in keep:
        w.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(np.float32), t.n_bytes, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in keep:
        w.write_tensor_data(src.read(t))
    w.close()
    return dst


def paged_backend(name: str, cuda: bool = True):
    """What PagedAttention reads of a backend, by name. c: the C kernels (rows of sequences of <= 32 tokens
    straight from the pages, longer chunks by SDPA); torch: SDPA for every row; triton: the fused path's Triton
    kernels, under the interpreter on CPU (or on CUDA where `cuda` and a GPU are there). Skips where the C
    kernels do not build, or Triton cannot run here."""
    from types import SimpleNamespace

    import pytest
    import torch

    from lowbit.kernels.triton_import import interpreting
    from lowbit.models.backend import torch_backend

    if name == "c":
        native = torch_backend().native
        if native is None:
            pytest.skip("the C kernels do not build here")
        return torch_backend(native)
    if name == "torch":
        return torch_backend(native=None)
    if not (interpreting() or (cuda and torch.cuda.is_available())):
        pytest.skip("Triton runs on CPU only under TRITON_INTERPRET=1")
    return SimpleNamespace(fused_paged_attention=True, native=None,
                           device=torch.device("cpu" if interpreting() else "cuda"))
