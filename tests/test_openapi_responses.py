"""The 200 replies GET /openapi.json publishes (runtime/server/openapi.py) against real ones: one
successful, non-streamed request per JSON route of `lowbit serve` on the default model
(tests/conftest.py's server), its body validated by `jsonschema` against the schema published for
that path, method and media type; and the schemas refuse bodies that break the documented shape."""

from __future__ import annotations

import copy

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

KEY = "sk-acceptance"  # tests/conftest.py's lowbit_server sets it

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 8}

# name → (method, path as requested, path in the schema, body); "{name}" stands for the served model's name
CASES = {
    "health": ("GET", "/health", "/health", None),
    "models": ("GET", "/v1/models", "/v1/models", None),
    "model": ("GET", "/v1/models/{name}", "/v1/models/{model_id}", None),
    "chat": ("POST", "/v1/chat/completions", "/v1/chat/completions",
             {"model": "{name}", "messages": ASK, "max_tokens": 8, "temperature": 0}),
    "chat-logprobs": ("POST", "/v1/chat/completions", "/v1/chat/completions", {
        "model": "{name}", "messages": ASK, "max_tokens": 4, "logprobs": True, "top_logprobs": 2, "n": 2}),
    "completion": ("POST", "/v1/completions", "/v1/completions",
                   {"model": "{name}", "prompt": "Paris is", "max_tokens": 8}),
    "completion-echo": ("POST", "/v1/completions", "/v1/completions",
                        {"model": "{name}", "prompt": "Paris is", "max_tokens": 4, "logprobs": 2, "echo": True}),
    "embeddings": ("POST", "/v1/embeddings", "/v1/embeddings", {"model": "{name}", "input": ["Paris", "a cat"]}),
    "embeddings-base64": ("POST", "/v1/embeddings", "/v1/embeddings",
                          {"model": "{name}", "input": "Paris", "encoding_format": "base64"}),
    "tokenize": ("POST", "/tokenize", "/tokenize", {"model": "{name}", "prompt": "Paris"}),
    "tokenize-chat": ("POST", "/tokenize", "/tokenize", {"model": "{name}", "messages": ASK}),
    "detokenize": ("POST", "/detokenize", "/detokenize", {"model": "{name}", "tokens": [1, 2, 3]}),
    "response": ("POST", "/v1/responses", "/v1/responses", {"model": "{name}", "input": "Hi", "max_output_tokens": 8}),
    "response-logprobs": ("POST", "/v1/responses", "/v1/responses", {
        "model": "{name}", "input": [{"role": "user", "content": "Say OK."}], "instructions": "Be brief.",
        "temperature": 0, "max_output_tokens": 64, "include": ["message.output_text.logprobs"], "top_logprobs": 1}),
    "version": ("GET", "/api/version", "/api/version", None),
    "tags": ("GET", "/api/tags", "/api/tags", None),
    "ps": ("GET", "/api/ps", "/api/ps", None),
    "show": ("POST", "/api/show", "/api/show", {"model": "{name}"}),
    "ollama-chat": ("POST", "/api/chat", "/api/chat",
                    {"model": "{name}", "messages": ASK, "stream": False, "options": GREEDY}),
    "ollama-chat-logprobs": ("POST", "/api/chat", "/api/chat", {
        "model": "{name}", "messages": ASK, "stream": False, "options": GREEDY, "logprobs": True, "top_logprobs": 1}),
    "ollama-load": ("POST", "/api/chat", "/api/chat", {"model": "{name}", "stream": False}),  # no counts
    "generate": ("POST", "/api/generate", "/api/generate",
                 {"model": "{name}", "prompt": "Why is the sky blue?", "stream": False, "options": GREEDY}),
    "ollama-unload": ("POST", "/api/generate", "/api/generate", {"model": "{name}", "stream": False, "keep_alive": 0}),
    "embed": ("POST", "/api/embed", "/api/embed", {"model": "{name}", "input": ["Paris", "a cat"]}),
    "ollama-embeddings": ("POST", "/api/embeddings", "/api/embeddings", {"model": "{name}", "prompt": "Paris"}),
    "pull": ("POST", "/api/pull", "/api/pull", {"model": "{name}"}),
    "lowbit-version": ("GET", "/version", "/version", None),
    "rerank": ("POST", "/v1/rerank", "/v1/rerank", {"model": "{name}", "query": "Paris", "documents": ["a", "b"]}),
    "rerank-llama": ("POST", "/rerank", "/rerank", {"query": "Paris", "documents": [{"text": "a"}], "top_n": 1}),
    "messages": ("POST", "/v1/messages", "/v1/messages",
                 {"model": "{name}", "messages": ASK, "max_tokens": 8, "temperature": 0}),
    "count-tokens": ("POST", "/v1/messages/count_tokens", "/v1/messages/count_tokens",
                     {"model": "{name}", "messages": ASK, "system": "Be brief."}),
    # unloaded, then loaded again at once: the tests after these find the model as they left it
    "models-unload": ("POST", "/models/unload", "/models/unload", {"model": "{name}"}),
    "models-load": ("POST", "/models/load", "/models/load", {"model": "{name}"}),
}

def _named(value, name: str):
    if isinstance(value, str):
        return value.replace("{name}", name)
    if isinstance(value, dict):
        return {k: _named(v, name) for k, v in value.items()}
    if isinstance(value, list):
        return [_named(v, name) for v in value]
    return value


@pytest.fixture(scope="module")
def http(lowbit_server):
    with httpx.Client(base_url=lowbit_server[0], headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def doc(http) -> dict:
    return http.get("/openapi.json").raise_for_status().json()


@pytest.fixture(scope="module")
def name(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def ok_schema(doc: dict, path: str, method: str = "POST", media: str = "application/json") -> dict:
    return doc["paths"][path][method.lower()]["responses"]["200"]["content"][media]["schema"]


def validator(doc: dict, path: str, method: str = "POST") -> jsonschema.Draft202012Validator:
    schema = ok_schema(doc, path, method)
    assert schema and "$ref" not in str(schema), path  # a real schema, all inline
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def replies(http, name) -> dict:
    """Each case's reply, requested once: (status, content type, body) by case name."""
    out = {}
    for case, (method, url, _, body) in CASES.items():
        r = http.request(method, _named(url, name), json=_named(body, name))
        out[case] = (r.status_code, r.headers.get("content-type", ""), r.json() if r.status_code == 200 else r.text)
    return out


@pytest.mark.parametrize("case", CASES)
def test_reply_matches_its_published_schema(case, doc, replies):
    method, _, path, _ = CASES[case]
    status, ctype, body = replies[case]
    assert status == 200 and ctype.startswith("application/json"), (status, ctype, body)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator(doc, path, method).iter_errors(body)]
    assert not errors, errors


def test_every_json_reply_schema_is_exercised_and_streams_stay_open(doc):
    described = {(m, p) for p, ops in doc["paths"].items() for m, op in ops.items()
                 if op["responses"]["200"]["content"].get("application/json", {}).get("schema")}
    # /infill answers 400 on the default model, which has no FIM tokens: tests/test_fim_rerank.py checks
    # its replies, JSON and streamed, against the schema on a model that has them
    assert described - {("post", "/infill")} == {(m.lower(), p) for m, _, p, _ in CASES.values()}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        assert ok_schema(doc, path, media="text/event-stream") == {}
    for path in ("/api/chat", "/api/generate"):
        assert ok_schema(doc, path, media="application/x-ndjson") == {}


def test_every_request_matches_its_published_body_schema(doc, name):
    """The requests above are what clients send; the request schemas a fuzzer draws from must take
    them (the legacy completions' `logprobs` is a count, the chat one a boolean)."""
    for case, (method, _, path, body) in CASES.items():
        if body is None:
            continue
        schema = doc["paths"][path][method.lower()]["requestBody"]["content"]["application/json"]["schema"]
        errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(_named(body, name))]
        assert not errors, (case, errors)
    completions = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert not jsonschema.Draft202012Validator(completions).is_valid({"prompt": "a", "logprobs": 6})


def _set(body: dict, where: str, value):
    """body with the field at `where` (dotted, list indices as numbers) set, or deleted when value is DEL."""
    body = copy.deepcopy(body)
    *parents, last = [int(k) if k.isdigit() else k for k in where.split(".")]
    node = body
    for k in parents:
        node = node[k]
    if value is DEL:
        del node[last]
    else:
        node[last] = value
    return body


class _Deleted:
    def __repr__(self) -> str:
        return "DEL"


DEL = _Deleted()  # in BROKEN: the field removed
BROKEN = [  # (case, field, value): each breaks the documented shape
    ("chat", "choices", DEL), ("chat", "choices", []), ("chat", "usage.prompt_tokens", "12"), ("chat", "usage", DEL),
    ("chat", "object", "chat.completion.chunk"), ("chat", "created", 1.5), ("chat", "choices.0.message.content", 5),
    ("chat", "choices.0.message.role", "user"), ("chat", "choices.0.finish_reason", "done"),
    ("chat", "choices.0.index", DEL), ("chat-logprobs", "choices.1.logprobs.content.0.logprob", "low"),
    ("chat-logprobs", "choices.0.logprobs.content.0.top_logprobs", None), ("completion", "choices.0.text", None),
    ("completion", "object", "chat.completion"), ("completion-echo", "choices.0.logprobs.text_offset.0", "0"),
    ("embeddings", "data.0.embedding.0", "x"), ("embeddings", "usage.total_tokens", -1),
    ("embeddings-base64", "data.0.embedding", None), ("tokenize", "tokens.0", "1"), ("detokenize", "prompt", DEL),
    ("models", "data.0.object", "list"), ("model", "created", "today"), ("health", "status", "loading"),
    ("response", "output.0.type", "image"), ("response", "usage.input_tokens", DEL),
    ("response", "object", "chat.completion"), ("response-logprobs", "output.0.content.0.text", 3),
    ("tags", "models.0.size", "big"), ("ps", "models.0.size_vram", DEL), ("show", "capabilities", "tools"),
    ("ollama-chat", "eval_count", DEL), ("ollama-chat", "message.content", None), ("ollama-chat", "done", False),
    ("ollama-chat-logprobs", "logprobs.0.token", 1), ("ollama-load", "done_reason", "stop"),
    ("generate", "context", DEL), ("generate", "response", 1), ("embed", "embeddings.0.0", "x"),
    ("ollama-embeddings", "embedding", "x"), ("version", "version", 12), ("pull", "status", "pulling"),
    ("messages", "type", "completion"), ("messages", "role", "user"), ("messages", "stop_reason", None),
    ("messages", "stop_reason", "stop"), ("messages", "stop_sequence", "x"), ("messages", "content.0.type", "image"),
    ("messages", "content.0.text", None), ("messages", "usage.output_tokens", DEL), ("messages", "id", DEL),
    ("count-tokens", "input_tokens", "3"), ("models-load", "success", "yes"), ("models-unload", "model", DEL),
]


@pytest.mark.parametrize("case, where, value", BROKEN, ids=[f"{c}-{w}-{v!r}" for c, w, v in BROKEN])
def test_schema_refuses_a_broken_reply(case, where, value, doc, replies):
    status, _, body = replies[case]
    assert status == 200, body
    v = validator(doc, CASES[case][2], CASES[case][0])
    assert v.is_valid(body)
    assert not v.is_valid(_set(body, where, value)), (where, value)
