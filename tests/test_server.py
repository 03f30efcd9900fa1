"""The OpenAI-compatible server (runtime/server/openai.py, frontend.py), judged by the official `openai`
client against a real uvicorn server on a free loopback port, over a tiny random model and a byte
tokenizer."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from lowbit.models.config import LlamaConfig
from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import AsyncEngine, Engine
from lowbit.runtime.server.app import Served, build_app
from tests.helpers import serving

VOCAB = 101
CTX = 128
CFG = LlamaConfig(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                  vocab_size=VOCAB, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=CTX, tie_embeddings=False)
NAME = "tiny"
KEY = "sk-test-key"
NO_EOS = {"100": -100}  # keep the random model from ending early


class ByteTokenizer:
    """Token i < 100 is a printable ASCII byte (32 + i % 95); 100 is the end token."""

    vocab_size = VOCAB
    special_ids = frozenset({100})
    eos_ids = frozenset({100})

    def token_bytes(self, i: int) -> bytes:
        return b"" if i == 100 else bytes([32 + i % 95])

    def encode(self, text: str, add_special: bool = True, limit=None) -> list[int]:
        return [min(max(ord(ch) - 32, 0), 94) for ch in text]

    def encode_chat(self, messages, add_generation_prompt=True, limit=None) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return self.encode(text)

    def decode(self, ids, skip_special: bool = False) -> str:
        return "".join(self.token_bytes(i).decode() for i in ids)


def slow_tiny_engine(step_s: float = 0.005) -> Engine:
    """The tiny model's engine, a few ms per step, so that a dropped stream is still running when it
    drops."""
    model = Llama(CFG, random_weights(CFG, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    # exact matmuls: the default CPU path picks its kernel per row (prompt rows exact, generated rows
    # the fast kernel); all exact keeps these server tests independent of that choice, as they compare
    # concurrent replies with solo ones
    engine = Engine(model, ByteTokenizer(), EngineConfig(kv_memory=4 << 20, max_num_seqs=8, exact=True))
    run = engine._run

    def slow_run(scheduled):
        time.sleep(step_s)
        return run(scheduled)

    engine._run = slow_run
    return engine


@pytest.fixture(scope="module")
def server():
    engine = slow_tiny_engine()
    app = build_app(Served(AsyncEngine(engine), ByteTokenizer(), NAME, CTX), api_key=KEY)
    with serving(app) as base:
        yield engine, base + "/v1"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1], api_key=KEY, max_retries=0, timeout=30)


MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi there"}]}]


def test_health_and_models(server, client):
    assert httpx.get(server[1].removesuffix("/v1") + "/health").status_code == 200
    metrics = httpx.get(server[1].removesuffix("/v1") + "/metrics")
    assert metrics.status_code == 200
    for name in ("lowbit_time_to_first_token_seconds", "lowbit_time_per_output_token_seconds",
                 "lowbit_e2e_request_latency_seconds", "lowbit_prompt_tokens_total", "lowbit_generation_tokens_total",
                 "lowbit_requests_running", "lowbit_requests_waiting", "lowbit_kv_pages_used",
                 "lowbit_prefix_cache_hit_rate", "lowbit_preemptions_total"):
        assert name in metrics.text, name
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    m = models[0].model_dump()
    assert m["object"] == "model" and m["owned_by"] == "lowbit" and m["root"] == NAME and m["max_model_len"] == CTX
    assert isinstance(m["created"], int)


def test_chat_non_streamed_and_streamed_agree(client):
    kw = dict(model=NAME, messages=MSGS, temperature=0, max_tokens=12, logit_bias=NO_EOS)
    r = client.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == NAME
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length" and len(c.message.content) > 0
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content

    plain = list(client.chat.completions.create(**kw, stream=True))  # no usage chunk unless asked
    assert all(ch.choices for ch in plain) and all(ch.usage is None for ch in plain)


def test_max_completion_tokens_and_logprobs(client):
    r = client.chat.completions.create(model=NAME, messages=MSGS, temperature=0, max_completion_tokens=4,
                                       logit_bias=NO_EOS, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    assert r.usage.completion_tokens == 4 and c.finish_reason == "length"
    lps = c.logprobs.content
    assert len(lps) == 4 and "".join(t.token for t in lps) == c.message.content
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lps)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in lps)  # greedy takes the top


def test_completions(client):
    r = client.completions.create(model=NAME, prompt="once upon", temperature=0, max_tokens=6, logit_bias=NO_EOS)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len("once upon") and r.usage.completion_tokens == 6
    chunks = list(client.completions.create(model=NAME, prompt="once upon", temperature=0, max_tokens=6,
                                            logit_bias=NO_EOS, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text


def test_seeded_sampling_reproducible_and_stop(client):
    kw = dict(model=NAME, messages=MSGS, temperature=1.0, top_p=0.9, max_tokens=10, seed=7, logit_bias=NO_EOS)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b and len(a) == 10
    stop = a[4:6]
    cut = client.chat.completions.create(**kw, stop=[stop, "\x00never"]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == a[:a.index(stop)]


def test_penalties_and_min_p_accepted(client):
    r = client.chat.completions.create(model=NAME, messages=MSGS, temperature=0.5, max_tokens=3, seed=1,
                                       presence_penalty=0.5, frequency_penalty=0.5, stop="zzz",
                                       extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                                                   "unknown_field": 1})
    assert r.choices[0].finish_reason in ("stop", "length")


def error_of(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as ei:
        call()
    return ei.value


def assert_error_shape(e: openai.APIStatusError, status: int, param=None, code=None, kind=None):
    assert e.status_code == status
    body = e.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    if kind is not None:
        assert body["error"]["type"] == kind


def test_errors(server, client):
    chat = client.chat.completions.create
    e = error_of(lambda: chat(model=NAME, messages=MSGS, temperature=-1))
    assert_error_shape(e, 400, "temperature", kind="invalid_request_error")
    assert_error_shape(error_of(lambda: chat(model=NAME, messages=MSGS, n=0)), 400, "n")
    assert_error_shape(error_of(lambda: chat(model=NAME, messages=MSGS, n=129)), 400, "n")
    assert_error_shape(error_of(lambda: chat(model=NAME, messages=MSGS, top_p=0)), 400, "top_p")
    assert_error_shape(error_of(lambda: chat(model="gpt-nope", messages=MSGS)), 404, "model", "model_not_found")
    assert_error_shape(error_of(lambda: chat(model=NAME, messages=[{"role": "user", "content": "x" * 200}])),
                       400, "messages", "context_length_exceeded")
    assert_error_shape(error_of(lambda: chat(model=NAME, messages=MSGS, max_tokens=CTX)),
                       400, "max_tokens", "context_length_exceeded")
    assert_error_shape(error_of(lambda: chat(model=NAME, messages=MSGS, response_format={"type": "xml"})),
                       400, "response_format")
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    assert_error_shape(error_of(lambda: chat(model=NAME, messages=MSGS, response_format=bad_schema)),
                       400, "response_format")
    bad_key = openai.OpenAI(base_url=server[1], api_key="wrong", max_retries=0)
    assert_error_shape(error_of(lambda: bad_key.chat.completions.create(model=NAME, messages=MSGS)), 401,
                       code="invalid_api_key")
    assert_error_shape(error_of(lambda: bad_key.models.list()), 401, code="invalid_api_key")
    r = httpx.post(server[1] + "/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(server[1] + "/nowhere")
    assert r.status_code == 404 and "error" in r.json()


def test_abandoned_stream_frees_pages(server, client):
    engine = server[0]
    aborted, abort = [], engine.abort

    def record_abort(rid):
        aborted.append(rid)
        abort(rid)

    engine.abort = record_abort
    stream = client.chat.completions.create(model=NAME, messages=MSGS, temperature=0, max_tokens=80,
                                            logit_bias=NO_EOS, stream=True)
    got = 0
    for ch in stream:
        got += 1
        if got == 4:
            break
    stream.close()
    deadline = time.time() + 5
    while (engine.blocks.num_used_pages or engine.requests) and time.time() < deadline:
        time.sleep(0.02)
    engine.abort = abort
    assert engine.blocks.num_used_pages == 0 and not engine.requests
    assert len(aborted) == 1 and aborted[0].startswith("chatcmpl-")  # aborted, not run to its end
    metrics = httpx.get(server[1].removesuffix("/v1") + "/metrics").text
    assert 'lowbit_requests_finished_total{finish_reason="abort"} 1.0' in metrics
    assert "lowbit_kv_pages_used 0.0" in metrics
    # the engine still serves afterwards
    assert client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2).choices[0].finish_reason


def test_queue_full_is_429_with_retry_after(server, client):
    engine = server[0]
    old, engine.scheduler.max_waiting = engine.scheduler.max_waiting, 0
    try:
        e = error_of(lambda: client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2))
    finally:
        engine.scheduler.max_waiting = old
    assert_error_shape(e, 429, code="server_overloaded", kind="server_overloaded")
    assert e.response.headers["retry-after"] == "1"


def test_async_client_concurrent_streams(server):
    import asyncio

    async def main():
        c = openai.AsyncOpenAI(base_url=server[1], api_key=KEY, max_retries=0, timeout=30)
        prompts = [f"prompt number {i}" for i in range(16)]

        async def one(p):
            s = await c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}],
                                                temperature=0, max_tokens=8, logit_bias=NO_EOS, stream=True)
            return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])

        streamed = await asyncio.gather(*(one(p) for p in prompts))
        single = [(await c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}],
                                                   temperature=0, max_tokens=8, logit_bias=NO_EOS))
                  .choices[0].message.content for p in prompts]
        await c.close()
        return streamed, single

    streamed, single = asyncio.run(main())
    assert streamed == single and all(len(t) == 8 for t in streamed)


def test_eight_streams_four_dropped(server):
    """8 streams open at once, 4 dropped after a few chunks: the other 4 complete with their solo
    text, the KV pool ends fully free, and /metrics counts the 4 aborts."""
    import asyncio

    engine, base = server
    metrics_url = base.removesuffix("/v1") + "/metrics"

    def aborts() -> float:
        for line in httpx.get(metrics_url).text.splitlines():
            if line.startswith('lowbit_requests_finished_total{finish_reason="abort"}'):
                return float(line.split()[-1])
        return 0.0

    before = aborts()

    async def main():
        c = openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=30)

        async def one(i: int):
            msgs = [{"role": "user", "content": f"stream {i}"}]
            s = await c.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=40,
                                                logit_bias=NO_EOS, stream=True)
            text, n = "", 0
            async for ch in s:
                n += 1
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                if i % 2 and n == 3:
                    await s.close()  # drop it
                    return None
            return text

        got = await asyncio.gather(*(one(i) for i in range(8)))
        solo = [(await c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": f"stream {i}"}],
                                                 temperature=0, max_tokens=40, logit_bias=NO_EOS))
                .choices[0].message.content for i in range(0, 8, 2)]
        await c.close()
        return got, solo

    got, solo = asyncio.run(main())
    assert got[1::2] == [None] * 4 and got[0::2] == solo
    deadline = time.time() + 5
    while (engine.blocks.num_used_pages or engine.requests) and time.time() < deadline:
        time.sleep(0.02)
    assert engine.blocks.num_used_pages == 0 and not engine.requests
    assert aborts() - before == 4


def test_serve_help_lists_its_flags():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "lowbit.runtime.cli", "serve", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    for flag in ("MODEL", "--host", "--port", "--api-key", "LOWBIT_API_KEY", "--served-model-name", "--kv-cache",
                 "--kv-memory", "--max-num-seqs", "--ctx-size", "--log-level", "--weights", "--device", "--dtype"):
        assert flag in r.stdout, flag


def test_n_choices_streamed_and_not(client):
    """n = 3 seeded: three choices (seed, seed + 1, seed + 2), the stream's fold equals the reply,
    and the prompt is counted once in the usage."""
    kw = dict(model=NAME, messages=MSGS, temperature=1.0, max_tokens=6, seed=7, n=3, logit_bias=NO_EOS)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # different seeds, different draws
    solo = client.chat.completions.create(**{**kw, "n": 1, "seed": 8})
    assert solo.choices[0].message.content == texts[1]  # choice i draws from seed + i
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == solo.usage.prompt_tokens
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = ["", "", ""]
    for ch in chunks:
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts
    assert sum(1 for ch in chunks for c in ch.choices if c.finish_reason == "length") == 3
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "digit": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 9}},
          "required": ["ok", "digit"], "additionalProperties": False}


def test_json_schema_constrains_a_random_model(client):
    """Even a random model's reply matches the schema: the grammar masks every step's logits."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for seed in range(3):
        r = client.chat.completions.create(model=NAME, messages=MSGS, temperature=1.0, seed=seed, max_tokens=40,
                                           response_format=fmt, logprobs=True, top_logprobs=5)
        c = r.choices[0]
        obj = json.loads(c.message.content)
        assert c.finish_reason == "stop" and set(obj) == {"ok", "digit"}
        assert isinstance(obj["ok"], bool) and obj["digit"] in range(10)
        # where the grammar allows fewer than 5 tokens, the -inf alternatives are left out, not sent
        assert all(len(t.top_logprobs) <= 5 for t in c.logprobs.content)
    # unconstrained, the same random model does not write JSON
    r = client.chat.completions.create(model=NAME, messages=MSGS, temperature=1.0, seed=0, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


def test_health_is_503_until_the_model_is_ready():
    app = build_app(None, api_key=None)
    with serving(app) as base:
        assert httpx.get(base + "/health").status_code == 503
        r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading" and "retry-after" in r.headers
        assert httpx.get(base + "/metrics").status_code == 200
        model = Llama(CFG, random_weights(CFG, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
        app.state.lowbit.ready(Served(AsyncEngine(Engine(model, ByteTokenizer(), EngineConfig(kv_memory=1 << 20))),
                                      ByteTokenizer(), NAME, CTX))
        assert httpx.get(base + "/health").status_code == 200
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_failure_after_the_stream_began_is_an_error_event(server, client):
    """A step that fails mid-reply: the stream already sent its role and some text, so the failure
    arrives as one `data: {"error": ...}` event and the stream closes (no [DONE]); a non-streamed
    request failing the same way is a 500 with the error body. Afterwards the server serves again."""
    engine = server[0]
    run, calls = engine._run, []

    def failing(scheduled):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("simulated kernel failure")
        return run(scheduled)

    engine._run = failing
    try:
        with httpx.stream("POST", server[1] + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"messages": MSGS, "max_tokens": 20, "stream": True, "logit_bias": NO_EOS},
                          timeout=30) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200
        first, last = json.loads(events[0]), json.loads(events[-1])
        assert first["choices"][0]["delta"]["role"] == "assistant"
        assert any(json.loads(e)["choices"][0]["delta"].get("content") for e in events[1:-1])
        assert set(last) == {"error"} and "simulated kernel failure" in last["error"]["message"]
        assert "[DONE]" not in events
        calls.clear()
        e = error_of(lambda: client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20,
                                                            logit_bias=NO_EOS))
        assert e.status_code == 500 and "simulated kernel failure" in e.response.json()["error"]["message"]
    finally:
        engine._run = run
    assert client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2).choices
    assert engine.blocks.num_used_pages == 0


# ---- the port beyond chat: CORS, model aliases, /tokenize and /detokenize ------------------------------


@pytest.fixture(scope="module")
def port(server):
    """A second app on the same model: two aliases, the default CORS origins, the same key."""
    engine = Engine(server[0].model, ByteTokenizer(), EngineConfig(kv_memory=1 << 20, exact=True))
    app = build_app(Served(AsyncEngine(engine), ByteTokenizer(), NAME, CTX, None, ("tiny-a", "tiny-b")), api_key=KEY)
    with serving(app) as base:
        yield base


def _preflight(base: str, origin: str) -> httpx.Response:
    return httpx.options(base + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:8080", "https://localhost"])
def test_cors_lets_this_machines_pages_call_the_port(port, origin):
    pre = _preflight(port, origin)  # no key: a browser sends none with a preflight
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    keyless = httpx.post(port + "/v1/chat/completions", json=body, headers={"Origin": origin})
    assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == origin
    ok = httpx.post(port + "/v1/chat/completions", json=body,
                    headers={"Origin": origin, "Authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("origin", ["http://evil.example", "http://localhost.evil.example:80", "null"])
def test_cors_refuses_other_origins(port, origin):
    pre = _preflight(port, origin)
    assert pre.status_code == 400 and "access-control-allow-origin" not in pre.headers


def test_cors_origins_given_replace_the_default(server):
    engine = server[0]
    for origins, allowed, refused in ((["https://chat.example.com"], "https://chat.example.com", "http://localhost:3000"),
                                      (["*"], "http://anything.example", None)):
        app = build_app(Served(AsyncEngine(Engine(engine.model, ByteTokenizer(), EngineConfig(kv_memory=1 << 20))),
                               ByteTokenizer(), NAME, CTX), cors_origins=origins)
        with serving(app) as base:
            assert _preflight(base, allowed).headers.get("access-control-allow-origin") in (allowed, "*")
            if refused:
                assert _preflight(base, refused).status_code == 400


def test_cors_origins_flag_is_checked():
    from lowbit.runtime.cli.serve import cors_origins
    from lowbit.runtime.errors import LowbitError

    assert cors_origins(None) is None and cors_origins("*") == ["*"]
    assert cors_origins("http://a.example:8080/, https://b.example") == ["http://a.example:8080", "https://b.example"]
    for bad in ("a.example", "http://a.example/path", " , "):
        with pytest.raises(LowbitError, match="--cors-origins"):
            cors_origins(bad)


def test_model_aliases_are_served_and_listed(port):
    c = openai.OpenAI(base_url=port + "/v1", api_key=KEY, max_retries=0, timeout=30)
    assert [m.id for m in c.models.list().data] == [NAME, "tiny-a", "tiny-b"]
    assert c.models.retrieve("tiny-b").id == "tiny-b"
    for name in (NAME, "tiny-a"):
        r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="tiny-c", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "tiny-c" in str(e.value) and "tiny-a" in str(e.value)


def test_tokenize_and_detokenize(port):
    tok, auth = ByteTokenizer(), {"Authorization": f"Bearer {KEY}"}

    def post(path, body):
        return httpx.post(port + path, json=body, headers=auth)

    r = post("/tokenize", {"model": "tiny-a", "prompt": "Hello"}).json()
    assert r == {"tokens": tok.encode("Hello"), "count": 5, "max_model_len": CTX}
    assert post("/tokenize", {"content": "Hello"}).json()["tokens"] == tok.encode("Hello")  # llama-server's key
    msgs = [{"role": "user", "content": "hi"}]
    assert post("/tokenize", {"messages": msgs}).json()["tokens"] == tok.encode_chat(msgs)
    assert post("/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()["tokens"] == \
        tok.encode_chat(msgs, add_generation_prompt=False)
    back = post("/detokenize", {"tokens": tok.encode("Hello")}).json()
    assert back == {"prompt": "Hello", "content": "Hello"}
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "content"),
                              ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
                              ("/tokenize", {"messages": []}, "messages"),
                              ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
                              ("/detokenize", {"tokens": [VOCAB]}, "tokens")):
        bad = post(path, body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (path, body, bad.text)
    assert httpx.post(port + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert post("/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404


def test_embeddings_through_the_openai_client(port):
    """Unit vectors of the model's hidden size; a text's embedding is the same alone and batched with
    others (cosine 1 within 1e-5, here bit for bit: the exact prefill's rows are independent), token
    arrays embed as their text does, base64 carries the same floats, and usage counts the tokens."""
    import base64

    import numpy as np

    c = openai.OpenAI(base_url=port + "/v1", api_key=KEY, max_retries=0, timeout=30)
    texts = ["the quick brown fox", "jumps over", "the lazy dog, twice: the lazy dog"]
    batch = c.embeddings.create(model="tiny-a", input=texts + [texts[0]])
    vecs = np.array([d.embedding for d in batch.data])
    assert vecs.shape == (4, CFG.dim) and [d.index for d in batch.data] == [0, 1, 2, 3]
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-6)
    assert float(vecs[0] @ vecs[3]) == pytest.approx(1.0, abs=1e-5)
    assert abs(float(vecs[0] @ vecs[1])) < 0.999  # different texts, different vectors
    alone = [c.embeddings.create(model=NAME, input=t).data[0].embedding for t in texts]
    np.testing.assert_array_equal(np.array(alone), vecs[:3])
    tok = ByteTokenizer()
    ids = c.embeddings.create(model=NAME, input=[tok.encode(texts[1])]).data[0].embedding
    np.testing.assert_array_equal(np.array(ids), vecs[1])
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(len(t) for t in texts) + len(texts[0])
    raw = httpx.post(port + "/v1/embeddings", json={"input": texts[1], "encoding_format": "base64"},
                     headers={"Authorization": f"Bearer {KEY}"}).json()
    got = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(got, vecs[1].astype(np.float32))


def test_embeddings_pool_the_last_token_when_asked(server, port):
    """--pooling last: the last token's state — for a one-token text the same vector as the mean,
    for a longer one another (the mean app is `port`'s)."""
    engine = Engine(server[0].model, ByteTokenizer(), EngineConfig(kv_memory=1 << 20))
    app = build_app(Served(AsyncEngine(engine), ByteTokenizer(), NAME, CTX, pooling="last"))
    mean = openai.OpenAI(base_url=port + "/v1", api_key=KEY, max_retries=0, timeout=30)
    with serving(app) as base:
        last = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=30)
        one, many = (last.embeddings.create(model=NAME, input=t).data[0].embedding for t in ("q", "abc xyz q"))
    assert one == mean.embeddings.create(model=NAME, input="q").data[0].embedding
    assert many != mean.embeddings.create(model=NAME, input="abc xyz q").data[0].embedding and len(many) == CFG.dim


@pytest.mark.parametrize("body, param", [({"input": ""}, "input"), ({"input": []}, "input"), ({"input": 5}, "input"),
                                         ({"input": [[1, VOCAB]]}, "input"), ({"input": "x" * (CTX + 1)}, "input"),
                                         ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                                         ({"input": "x", "dimensions": 8}, "dimensions")])
def test_embeddings_bad_input_is_a_400_naming_the_param(port, body, param):
    r = httpx.post(port + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- echo: the prompt's own logprobs (lm-evaluation-harness's loglikelihood) ---------------------------


def test_echo_with_max_tokens_0_scores_the_prompt_as_the_exact_model(server, client):
    import numpy as np
    import torch

    from tests.helpers import forward

    tok, prompt = ByteTokenizer(), "the cat sat on the mat"
    ids = tok.encode(prompt)
    r = client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.inference_mode():
        ref = forward(server[0].model, torch.tensor([ids]), exact=True)[0].log_softmax(-1)  # [T, V]
    np.testing.assert_allclose(lp.token_logprobs[1:], [float(ref[j - 1, ids[j]]) for j in range(1, len(ids))],
                               atol=1e-4)
    for j in range(1, len(ids)):  # the best alternative there is the exact model's argmax
        assert max(lp.top_logprobs[j].values()) == pytest.approx(float(ref[j - 1].max()), abs=1e-4)
    streamed = list(client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=0, max_tokens=0,
                                              stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == prompt


def test_echo_leads_a_generated_completion(client):
    prompt = "abc"
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                                      logit_bias=NO_EOS)
    echoed = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                                       logit_bias=NO_EOS, echo=True)
    c = echoed.choices[0]
    assert c.text == prompt + plain.choices[0].text
    assert c.logprobs.tokens[len(prompt):] == plain.choices[0].logprobs.tokens
    assert c.logprobs.token_logprobs[0] is None and all(isinstance(x, float) for x in c.logprobs.token_logprobs[1:])
    chunks = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logit_bias=NO_EOS,
                                       echo=True, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text


def test_max_tokens_0_needs_echo(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="abc", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="abc", max_tokens=1, extra_body={"echo": "yes"})
    assert e.value.body["param"] == "echo"
