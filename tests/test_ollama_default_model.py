"""Acceptance of Ollama's native API on `lowbit serve` with the default model, judged by the real
`ollama` client (tests/conftest.py's server: a subprocess, as users start it, keyed "sk-acceptance")."""

from __future__ import annotations

import json

import numpy as np
import ollama
import pytest

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 24}
CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
       "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(lowbit_server) -> ollama.Client:
    return ollama.Client(host=lowbit_server[0], headers={"Authorization": "Bearer sk-acceptance"}, timeout=120)


@pytest.fixture(scope="module")
def name(client) -> str:
    return client.list().models[0].model


def test_list_show_ps(client, name):
    assert name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    m = client.list().models[0]
    assert m.size > 50e6 and m.details.family == "llama" and m.details.parameter_size.endswith("M")
    show = client.show(name)
    ctx = show.modelinfo["llama.context_length"]
    assert isinstance(ctx, int) and ctx >= 2048 and show.modelinfo["general.architecture"] == "llama"
    assert "{%" in show.template  # the model's own (jinja) chat template
    assert client.ps().models[0].context_length == ctx
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3.2")
    assert e.value.status_code == 404


def test_chat_streamed_and_not(client, name):
    r = client.chat(name, messages=ASK, options=GREEDY)
    assert "Paris" in r.message.content and r.done and r.eval_count > 0
    parts = list(client.chat(name, messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].done and parts[-1].eval_count == r.eval_count
    g = client.generate(name, "What is the capital of France?", options=GREEDY)
    assert g.response == r.message.content  # through the same chat template


def test_format_schema(client, name):
    r = client.chat(name, messages=[{"role": "user", "content": "Describe a cat as JSON with a name and an age."}],
                    format=CAT, options={"temperature": 0, "num_predict": 60})
    obj = json.loads(r.message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)


def test_tools_answer_or_call(client, name):
    """With tools (Ollama has no tool_choice: always auto) the reply is an answer or calls with object
    arguments (this small model mostly answers); a history with a call and its result is read."""
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    for seed in range(3):
        r = client.chat(name, messages=ask, tools=[WEATHER], options={"seed": seed, "num_predict": 40})
        assert r.done and (r.message.content or r.message.tool_calls)
        for c in r.message.tool_calls or []:
            assert c.function.name == "get_weather" and isinstance(c.function.arguments, dict)
    history = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 24 C", "tool_name": "get_weather"}]
    r = client.chat(name, messages=history, tools=[WEATHER], options=GREEDY)
    assert r.done and r.message.content


def test_embed(client, name):
    texts = ["The cat sat on the mat.", "A dog barked.", "Quantized caches save memory."]
    batch = np.array(client.embed(name, texts).embeddings)
    assert batch.shape[0] == 3 and batch.shape[1] >= 256
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    alone = np.array([client.embed(name, t).embeddings[0] for t in texts])
    np.testing.assert_allclose(alone, batch, atol=1e-5)
    assert float(batch[0] @ batch[1]) < 0.9999
