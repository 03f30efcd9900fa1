"""Ollama's native API (runtime/server/ollama.py), judged by the real `ollama` client against a uvicorn
server over a tiny random model and a byte tokenizer (tests/test_server.py's)."""

from __future__ import annotations

import dataclasses
import json
import time

import httpx
import numpy as np
import ollama
import pytest

from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import AsyncEngine, Engine
from lowbit.runtime.load.chat_template import ChatTemplate
from lowbit.runtime.server.app import Served, build_app
from tests.helpers import serving
from tests.test_server import CFG, CTX, NAME, ByteTokenizer, slow_tiny_engine

GREEDY = {"temperature": 0, "num_predict": 12}
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    """(engine, base URL): no API key, so the `ollama` client needs none."""
    engine = slow_tiny_engine(0.003)
    app = build_app(Served(AsyncEngine(engine), ByteTokenizer(), NAME, CTX, {"device": "cpu"}, ("tiny-b",)),
                    api_key=None)
    with serving(app) as url:
        yield engine, url


@pytest.fixture(scope="module")
def base(server) -> str:
    return server[1]


@pytest.fixture(scope="module")
def client(base) -> ollama.Client:
    return ollama.Client(host=base, timeout=60)


@pytest.fixture(scope="module")
def wide() -> str:
    """The tiny model with room for the generic tool format's system prompt → its base URL."""
    cfg = dataclasses.replace(CFG, max_seq_len=1024)
    model = Llama(cfg, random_weights(cfg, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    engine = Engine(model, ByteTokenizer(), EngineConfig(kv_memory=8 << 20, max_num_seqs=8, exact=True))
    with serving(build_app(Served(AsyncEngine(engine), ByteTokenizer(), NAME, 1024))) as url:
        yield url


THINK = """{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}\
{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant><think>
{% endif %}"""


class ThinkTokenizer(ByteTokenizer):
    """The byte tokenizer behind a template that opens a think block (as DeepSeek-R1's does)."""

    chat_template = THINK

    def __init__(self):
        self.template, self.last = ChatTemplate(THINK), None

    def encode_chat(self, messages, add_generation_prompt=True, limit=None, **kw):
        self.last = self.template.render(messages, add_generation_prompt, **kw)
        return self.encode(self.last)


@pytest.fixture(scope="module")
def thinking():
    """(its tokenizer, a client) of the tiny model behind THINK."""
    tok = ThinkTokenizer()
    cfg = dataclasses.replace(CFG, max_seq_len=256)
    model = Llama(cfg, random_weights(cfg, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    engine = Engine(model, tok, EngineConfig(kv_memory=4 << 20, max_num_seqs=8, exact=True))
    with serving(build_app(Served(AsyncEngine(engine), tok, NAME, 256))) as url:
        yield tok, ollama.Client(host=url, timeout=60)


def test_version_root_list_show_ps(base, client):
    v = httpx.get(base + "/api/version").json()["version"]
    assert all(p.isdigit() for p in v.split("."))  # clients compare it as x.y.z
    assert httpx.get(base + "/").text == "Ollama is running"
    models = client.list().models
    assert [m.model for m in models] == [NAME, "tiny-b"]
    m = models[0]
    assert m.size > 0 and len(m.digest) == 64 and m.modified_at is not None
    assert m.details.format == "gguf" and m.details.family == "llama" and m.details.parameter_size
    assert m.details.quantization_level == "Q4_1"  # int4-g32, GGUF's name for it
    show = client.show(NAME)
    assert show.modelinfo["general.architecture"] == "llama" and show.modelinfo["llama.context_length"] == CTX
    assert show.modelinfo["llama.embedding_length"] == CFG.dim
    assert {"completion", "tools", "embedding"} <= set(show.capabilities)
    assert "temperature" in show.parameters and show.details.family == "llama"
    assert client.show(NAME + ":latest").modelinfo["llama.block_count"] == CFG.n_layers
    ps = client.ps().models
    assert [p.model for p in ps] == [NAME, "tiny-b"]
    assert ps[0].size_vram == 0 and ps[0].context_length == CTX and ps[0].expires_at.year > 2100


def test_chat_streamed_equals_non_streamed(client):
    opts = {**GREEDY, "stop": ["never said"]}  # options pass through alike both ways
    r = client.chat(NAME, messages=MSGS, options=opts, stream=False)
    assert r.done and r.message.role == "assistant" and len(r.message.content) > 0
    assert r.eval_count > 0 and r.prompt_eval_count == len("<system>be brief<user>hi there<assistant>")
    assert r.done_reason in ("stop", "length") and r.total_duration > 0 and r.eval_duration > 0
    parts = list(client.chat(NAME, messages=MSGS, options=opts, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == r.message.content
    assert parts[-1].eval_count == r.eval_count and parts[-1].done_reason == r.done_reason
    assert parts[-1].model == NAME


def test_chat_num_predict_and_length(base, client):
    r = httpx.post(base + "/api/chat", json={"model": NAME, "messages": MSGS, "stream": False,
                                            "options": {"temperature": 0, "num_predict": 5}}).json()
    assert r["eval_count"] <= 5
    # a stream is Ollama's default: NDJSON lines
    with httpx.stream("POST", base + "/api/chat", json={"model": NAME, "messages": MSGS, "options": GREEDY}) as s:
        assert s.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in s.iter_lines() if x]
    assert len(lines) > 1 and lines[-1]["done"] is True and "eval_count" in lines[-1]
    # num_predict beyond the context: cut to the room left, not refused
    r = client.chat(NAME, messages=MSGS, options={"temperature": 0, "num_predict": 10 * CTX})
    assert r.done and r.prompt_eval_count + r.eval_count <= CTX


def test_generate(client):
    r = client.generate(NAME, "The sky is", options=GREEDY)
    assert r.done and isinstance(r.response, str) and r.context[:len("<user>")] == ByteTokenizer().encode("<user>")
    parts = list(client.generate(NAME, "The sky is", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == r.response and parts[-1].done
    raw = client.generate(NAME, "The sky is", raw=True, options=GREEDY)
    assert raw.prompt_eval_count == len("The sky is") and raw.context[:3] == ByteTokenizer().encode("The")
    with_system = client.generate(NAME, "x", system="be brief", options=GREEDY)
    assert with_system.prompt_eval_count == len("<system>be brief<user>x<assistant>")
    loaded = client.generate(NAME)  # an empty prompt loads the model
    assert loaded.done and loaded.response == "" and loaded.done_reason == "load"
    assert client.generate(NAME, keep_alive=0).done_reason == "unload"
    more = client.generate(NAME, "more", context=r.context, raw=True, options=GREEDY)
    assert more.prompt_eval_count == len(r.context) + len("more")


def test_embed(client):
    texts = ["the quick brown fox", "jumps over", "the lazy dog"]
    batch = np.array(client.embed(NAME, texts).embeddings)
    assert batch.shape == (3, CFG.dim)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    alone = np.array([client.embed(NAME, t).embeddings[0] for t in texts])
    np.testing.assert_allclose(alone, batch, atol=1e-5)
    r = client.embed(NAME, texts[0])
    assert r.prompt_eval_count == len(texts[0]) and r.model == NAME
    legacy = np.array(client.embeddings(NAME, texts[1]).embedding)
    np.testing.assert_allclose(legacy, batch[1], atol=1e-5)
    short = np.array(client.embed(NAME, texts[0], dimensions=8).embeddings[0])
    assert short.shape == (8,) and abs(np.linalg.norm(short) - 1) < 1e-5
    full = np.array(client.embed(NAME, texts[0], dimensions=10 * CFG.dim).embeddings[0])
    np.testing.assert_allclose(full, batch[0], atol=1e-6)  # more dimensions than the model has: all of them
    assert client.embed(NAME, "x" * (CTX + 10)).prompt_eval_count == CTX  # truncated, by default
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(NAME, "x" * (CTX + 10), truncate=False)
    assert e.value.status_code == 400


def test_format_json_and_schema(client):
    for fmt in ("json", ANSWER):
        for seed in range(2):
            r = client.chat(NAME, messages=MSGS, format=fmt, options={"seed": seed, "num_predict": 40})
            obj = json.loads(r.message.content)
            assert isinstance(obj, dict)
            if fmt is ANSWER:
                assert obj["answer"] in ("yes", "no")
    g = client.generate(NAME, "yes or no?", format=ANSWER, options={"seed": 0, "num_predict": 40})
    assert json.loads(g.response)["answer"] in ("yes", "no")


def test_tools_and_history(wide):
    """Tool calls come back with object arguments, streamed as folded (the generic format's grammar
    holds even a random model to calls or an answer); a history of calls (object arguments) and
    results (tool_name) is accepted. The tools go by httpx: the `ollama` client's Tool model drops
    `additionalProperties`, without which a random model writes arguments without end."""
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
            "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": city}}
    body = {"model": NAME, "messages": MSGS, "tools": [tool], "options": {"seed": 10, "num_predict": 200}}
    r = ollama.ChatResponse(**httpx.post(wide + "/api/chat", json={**body, "stream": False}, timeout=60).json())
    calls = r.message.tool_calls
    assert calls and r.done_reason == "stop"  # seed 10 calls once (seeds 4, 5 answer, 2, 3 call twice)
    assert calls[0].function.name == "get_weather" and calls[0].function.arguments["city"] in ("Paris", "Rome")
    with httpx.stream("POST", wide + "/api/chat", json=body, timeout=60) as s:
        parts = [ollama.ChatResponse(**json.loads(x)) for x in s.iter_lines() if x]
    streamed = [c for p in parts for c in p.message.tool_calls or []]
    assert [c.function.model_dump() for c in streamed] == [c.function.model_dump() for c in calls]
    history = MSGS + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    client = ollama.Client(host=wide, timeout=60)
    assert client.chat(NAME, messages=history, tools=[tool], options={"seed": 1, "num_predict": 30}).done


def test_thinking(thinking):
    """The reply inside the template's open think block is `thinking`, streamed and not; an
    assistant message's thinking reaches the template."""
    tok, client = thinking
    assert "thinking" in client.show(NAME).capabilities
    ask = [{"role": "user", "content": "hi"}]
    r = client.chat(NAME, messages=ask, think=True, options=GREEDY)
    assert r.message.thinking and not r.message.content  # the random model never closes the block
    parts = list(client.chat(NAME, messages=ask, think=True, options=GREEDY, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
    g = client.generate(NAME, "hi", options=GREEDY)
    assert g.thinking == r.message.thinking and g.response == ""
    client.chat(NAME, options={"num_predict": 1}, messages=ask + [
        {"role": "assistant", "content": "a", "thinking": "because"}, {"role": "user", "content": "q2"}])
    assert "<assistant>[because]a<user>q2" in tok.last


def test_logprobs(base):
    body = {"model": NAME, "messages": MSGS, "stream": False, "logprobs": True, "top_logprobs": 3,
            "options": {**GREEDY, "num_predict": 4}}
    r = httpx.post(base + "/api/chat", json=body).json()
    assert len(r["logprobs"]) == 4 and all(len(t["top_logprobs"]) == 3 for t in r["logprobs"])
    assert "".join(t["token"] for t in r["logprobs"]) == r["message"]["content"]


def test_errors(base, client):
    for call in (lambda: client.chat("nope", messages=MSGS), lambda: client.show("nope"),
                 lambda: client.embed("nope", "x"), lambda: client.generate("nope", "x")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and e.value.error == "model 'nope' not found"
    for body in ({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": NAME, "messages": MSGS, "format": "xml"},
                 {"model": NAME, "messages": MSGS, "options": {"temperature": -1}},
                 {"model": NAME, "messages": MSGS, "options": {"num_predict": "many"}},
                 {"model": NAME, "messages": MSGS, "options": "hot"},
                 {"model": NAME, "messages": MSGS, "stream": "yes"},
                 {"model": NAME, "messages": MSGS, "think": "very"},
                 {"model": NAME, "messages": MSGS, "logprobs": True, "top_logprobs": 99},
                 {"model": NAME, "messages": "hi"},
                 {"model": NAME, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
                 {"messages": MSGS}):
        r = httpx.post(base + "/api/chat", json=body)
        assert r.status_code == 400 and isinstance(r.json()["error"], str), (body, r.text)
    r = httpx.post(base + "/api/chat", json={"model": NAME, "messages": [{"role": "user", "content": "x" * CTX}]})
    assert r.status_code == 400 and "context length" in r.json()["error"]
    r = httpx.post(base + "/api/generate", content=b"{nope")
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    for body in ({"model": NAME, "prompt": "x", "suffix": "y"}, {"model": NAME, "prompt": "x", "context": [1, -1]},
                 {"model": NAME, "prompt": 5}):
        r = httpx.post(base + "/api/generate", json=body)
        assert r.status_code == 400 and isinstance(r.json()["error"], str), (body, r.text)
    r = httpx.post(base + "/api/create", json={"model": "x"})
    assert r.status_code == 400 and "not supported" in r.json()["error"]
    assert httpx.post(base + "/api/pull", json={"model": NAME}).json() == {"status": "success"}
    assert httpx.post(base + "/api/pull", json={"model": "other"}).status_code == 404


def test_api_key_applies_except_version():
    model = Llama(CFG, random_weights(CFG, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    engine = Engine(model, ByteTokenizer(), EngineConfig(kv_memory=1 << 20, exact=True))
    with serving(build_app(Served(AsyncEngine(engine), ByteTokenizer(), NAME, CTX), api_key="k")) as url:
        assert httpx.get(url + "/api/version").status_code == 200
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=url).list()
        assert e.value.status_code == 401 and isinstance(e.value.error, str)
        keyed = ollama.Client(host=url, headers={"Authorization": "Bearer k"})
        assert keyed.list().models[0].model == NAME
        assert keyed.chat(NAME, messages=MSGS, options={**GREEDY, "num_predict": 2}).eval_count <= 2


def test_loading_answers_503_in_ollama_shape():
    with serving(build_app(None, api_key=None)) as url:
        r = httpx.get(url + "/api/tags")
        assert r.status_code == 503 and isinstance(r.json()["error"], str) and "Retry-After" in r.headers
        assert httpx.get(url + "/api/ps").json() == {"models": []}
        assert httpx.get(url + "/api/version").status_code == 200


def test_dropped_stream_frees_its_request(server):
    """A client that stops reading mid-stream: its engine request is aborted and its pages freed."""
    engine, url = server

    def aborts() -> float:
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith('lowbit_requests_finished_total{finish_reason="abort"}'):
                return float(line.split()[-1])
        return 0.0

    before = aborts()
    body = {"model": NAME, "messages": MSGS, "options": {"temperature": 0, "num_predict": 100}}
    with httpx.stream("POST", url + "/api/chat", json=body) as s:
        first = json.loads(next(s.iter_lines()))
        assert first["done"] is False
    deadline = time.time() + 5
    while (engine.blocks.num_used_pages or engine.requests or aborts() == before) and time.time() < deadline:
        time.sleep(0.02)
    assert engine.blocks.num_used_pages == 0 and not engine.requests and aborts() - before == 1
