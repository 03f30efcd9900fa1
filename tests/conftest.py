"""Shared pytest fixtures."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from lowbit.runtime.ports import free_port
from tests.helpers import ByteTokenizer, fix_interpreter_bf16_dot

# Tests measure behaviour, not speed; two threads match the CI machine and keep runs comparable.
torch.set_num_threads(min(2, os.cpu_count() or 2))

# Without CUDA, Triton kernels are checked on the CPU through Triton's interpreter. It must be
# chosen before any kernel module is imported (triton.jit reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


fix_interpreter_bf16_dot()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped, with the reason, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run tests/bench/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF (SmolLM2-135M-Instruct Q4_1), fetched into the model cache by the
    same `lowbit pull` path users take (sha256-checked). LOWBIT_TEST_GGUF overrides it."""
    if os.environ.get("LOWBIT_TEST_GGUF"):
        return Path(os.environ["LOWBIT_TEST_GGUF"])
    from lowbit.runtime.load.registry import DEFAULT_MODEL, resolve

    return resolve(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_model(default_gguf):
    """The default model loaded once per session with `--weights auto` (lossless layouts)."""
    from lowbit.runtime.load.loader import load

    return load(str(default_gguf), "auto", progress=False)


@pytest.fixture(scope="session")
def wikitext_excerpt() -> bytes:
    return (Path(__file__).parent / "data" / "wikitext2_test_excerpt.txt").read_bytes()


@pytest.fixture(scope="session")
def lowbit_server(default_gguf, tmp_path_factory):
    """`lowbit serve` on the default model, started as users start it (a subprocess on a free
    loopback port, API key from $LOWBIT_API_KEY = "sk-acceptance"), shared by the acceptance tests
    of the server and of `lowbit bench`. Yields (base URL, /health codes seen until ready, log path)."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "LOWBIT_API_KEY": "sk-acceptance"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lowbit.runtime.cli", "serve", str(default_gguf),
                                 "--port", str(port), "--kv-memory", "64MiB", "--max-num-seqs", "8"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    codes = []
    deadline = time.time() + 120
    try:
        while not codes or codes[-1] != 200:
            assert proc.poll() is None, log.read_text()
            assert time.time() < deadline, "server not ready in 120 s:\n" + log.read_text()
            try:
                codes.append(httpx.get(base + "/health", timeout=2).status_code)
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        yield base, codes, log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


SERVE_KEY = "sk-acceptance"  # the key lowbit_server's $LOWBIT_API_KEY sets


@pytest.fixture(scope="session")
def serve_client(lowbit_server):
    """The official `openai` client on lowbit_server."""
    import openai

    return openai.OpenAI(base_url=lowbit_server[0] + "/v1", api_key=SERVE_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def serve_model_id(serve_client) -> str:
    return serve_client.models.list().data[0].id



@pytest.fixture
def c_kernels():
    """The module of lowbit's C kernels (kernels/cpu_native.py), skipping where they do not build:
    tests/test_cpu_native.py::test_builds_where_it_should fails on any machine where they must."""
    from lowbit.kernels import cpu_native

    if cpu_native.native() is None:
        pytest.skip("the C kernels do not build here (tests/test_cpu_native.py says whether they must)")
    return cpu_native


@pytest.fixture(params=["c", "torch"])
def decode_kernel(request):
    """The CPU backend to build with (models/backend.py): decode-sized matmuls, the small ops and the
    fused blocks on lowbit's C kernels (kernels/cpu_native.py; skipped where they do not build), or
    everything on the plain-torch exact path and ops (`.native` is None). A test taking this fixture
    runs with each."""
    from lowbit.models.backend import torch_backend

    if request.param == "c":
        return torch_backend(request.getfixturevalue("c_kernels").native())
    return torch_backend(native=None)


@pytest.fixture(scope="session")
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


# ---- mixture-of-experts GGUF files (tests/test_moe.py, tests/test_moe_triton.py) ----

@pytest.fixture(scope="session")
def moe_gguf(default_gguf, tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE (tests/family_models.py: 8 experts, 2 a token) through llama.cpp's converter and
    quantizer in Q4_K_M (the converter wants a real tokenizer: the default model's)."""
    import transformers

    from tests import llama_cpp_source
    from tests.family_models import build, save

    d = tmp_path_factory.mktemp("moe-gguf")
    tok = transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    tok.save_pretrained(d / "tok")
    model = build("qwen3moe", len(tok), seed=12)
    hf = save(model, d / "tok", d / "hf", "qwen3moe")
    tree = llama_cpp_source.converter_dir()
    f32 = llama_cpp_source.convert(tree, hf, d / "F32.gguf")
    return llama_cpp_source.quantize(f32, d / "Q4_K_M.gguf", "Q4_K_M")


@pytest.fixture(scope="session")
def oss_quants(default_gguf, tmp_path_factory) -> dict:
    """The tiny gpt-oss (biases in every expert, clamped SwiGLU) through llama.cpp's converter and quantizer:
    Q8_0 (int8 tiles), Q4_K_M (K-quant tiles), MXFP4_MOE (MXFP4 experts)."""
    import transformers

    from tests import llama_cpp_source
    from tests.family_models import build, save

    d = tmp_path_factory.mktemp("oss-quants")
    tok = transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    tok.save_pretrained(d / "tok")
    hf = save(build("gpt-oss", len(tok), seed=14), d / "tok", d / "hf", "gpt-oss")
    f32 = llama_cpp_source.convert(llama_cpp_source.converter_dir(), hf, d / "F32.gguf")
    return {t: llama_cpp_source.quantize(f32, d / f"{t}.gguf", t) for t in ("Q8_0", "Q4_K_M", "MXFP4_MOE")}
