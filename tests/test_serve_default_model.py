"""Acceptance of `lowbit serve` as users start it: the real command in a subprocess, the default
model, a free loopback port, the official `openai` client (sync and async) as the judge, and
`jsonschema` as the oracle of structured output."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

KEY = "sk-acceptance"  # tests/conftest.py's lowbit_server sets it
MSGS = [{"role": "user", "content": "Give me a JSON object describing a cat with a name and an age."}]
CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
       "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served(lowbit_server):
    """(base URL, /health status codes seen while it started, log path)."""
    return lowbit_server


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def test_starts_loading_then_ready_and_logs_its_url(served, model_id):
    base, codes, log = served
    assert 503 in codes and codes[-1] == 200  # bound first, loaded meanwhile
    text = log.read_text()
    assert f"export OPENAI_BASE_URL={base}/v1" in text
    assert model_id == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_chat_non_streamed_and_streamed(client, model_id):
    kw = dict(model=model_id, messages=[{"role": "user", "content": "What is the capital of France?"}],
              temperature=0, max_tokens=24)
    r = client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    assert "Paris" in text and r.id.startswith("chatcmpl-")
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.usage is None and c.choices for c in plain)  # no usage chunk unless asked


def test_completions_non_streamed_and_streamed(client, model_id):
    kw = dict(model=model_id, prompt="The capital of France is", temperature=0, max_tokens=8)
    r = client.completions.create(**kw)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and "Paris" in r.choices[0].text
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_seeded_stream_usage_equals_non_stream_usage(client, model_id):
    kw = dict(model=model_id, messages=MSGS, temperature=0.8, top_p=0.9, seed=1234, max_tokens=40)
    r = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed_usage = chunks[-1].usage
    assert streamed_usage.prompt_tokens == r.usage.prompt_tokens
    assert streamed_usage.completion_tokens == r.usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


def test_n_two_returns_two_choices(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=MSGS, temperature=0.8, seed=3, max_tokens=16, n=2)
    assert [c.index for c in r.choices] == [0, 1] and all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens == sum(
        client.chat.completions.create(model=model_id, messages=MSGS, temperature=0.8, seed=3 + i,
                                       max_tokens=16).usage.completion_tokens for i in range(2))


def test_json_object_parses_and_json_schema_validates(client, model_id):
    for temperature in (0, 0.8):
        r = client.chat.completions.create(model=model_id, messages=MSGS, temperature=temperature, seed=5,
                                           max_tokens=200, response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)
        fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT}}
        r = client.chat.completions.create(model=model_id, messages=MSGS, temperature=temperature, seed=5,
                                           max_tokens=200, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), CAT)


def test_async_client_concurrent_streams(served, model_id):
    questions = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hello."]

    async def one(client: openai.AsyncOpenAI, q: str) -> str:
        stream = await client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": q}],
                                                      temperature=0, max_tokens=16, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        async with openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            together = await asyncio.gather(*(one(c, q) for q in questions))
            alone = [await one(c, q) for q in questions]
        return together, alone

    together, alone = asyncio.run(main())
    assert len(set(together)) == len(questions) and "Paris" in together[0] and "4" in together[2]
    assert together == alone  # the kernel path is chosen per token, not by the batch (runtime/engine/engine.py)


def test_embeddings_of_the_default_model(client, model_id):
    """`client.embeddings.create`: a text's embedding batched with others equals it alone, and its
    cosine with itself is 1 within 1e-5; related sentences sit closer than unrelated ones."""
    import numpy as np

    texts = ["The cat sat on the mat.", "A cat is sitting on a mat.", "Quarterly revenue rose by 4 percent."]
    batch = np.array([d.embedding for d in client.embeddings.create(model=model_id, input=texts + texts[:1]).data])
    alone = np.array([client.embeddings.create(model=model_id, input=t).data[0].embedding for t in texts])
    assert batch.shape == (4, 576)
    np.testing.assert_allclose(batch[:3], alone, atol=1e-6)
    assert float(batch[0] @ batch[3]) == pytest.approx(1.0, abs=1e-5)
    assert float(batch[0] @ batch[1]) > float(batch[0] @ batch[2])


def test_cors_preflight_and_tokenize_on_the_real_command(served, model_id):
    import httpx

    base = served[0]
    pre = httpx.options(base + "/v1/chat/completions", headers={"Origin": "http://localhost:3000",
                                                                "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(base + "/tokenize", json={"model": model_id, "prompt": "Hello world"}, headers=auth).json()
    back = httpx.post(base + "/detokenize", json={"tokens": r["tokens"]}, headers=auth).json()
    assert r["count"] == len(r["tokens"]) > 0 and back["prompt"].endswith("Hello world")


def test_echo_logprobs_are_the_exact_models(client, model_id, default_model):
    """What lm-eval's loglikelihood requests (`echo=True, logprobs=1, max_tokens=0`): every prompt
    token's logprob equals the exact model's (one exact pass in this process) within 1e-4."""
    import torch

    from tests.helpers import forward

    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    r = client.completions.create(model=model_id, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    got = r.choices[0].logprobs.token_logprobs
    ids = default_model.tokenizer.encode(prompt, add_special=True)
    with torch.inference_mode():
        ref = forward(default_model.model, torch.tensor([ids]), exact=True)[0].log_softmax(-1)
    assert len(got) == len(ids) and got[0] is None
    assert max(abs(g - float(ref[j - 1, ids[j]])) for j, g in enumerate(got) if j) <= 1e-4
