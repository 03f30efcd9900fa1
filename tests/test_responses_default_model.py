"""Acceptance of the Responses API (POST /v1/responses) on `lowbit serve` with the default model,
judged by real clients: the `openai` package (its parsed objects and stream events, with `jsonschema`
as the oracle of a call's arguments) and the OpenAI Agents SDK, whose default model speaks this API."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.test_tools_default_model import WEATHER

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city",
          "parameters": WEATHER, "strict": True}]
ASK = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def base(lowbit_server) -> str:
    return lowbit_server[0]


def _valid_calls(output) -> list:
    calls = [o for o in output if o.type == "function_call"]
    assert calls, output
    for c in calls:
        assert c.name == "get_weather" and c.call_id and c.status == "completed"
        jsonschema.validate(json.loads(c.arguments), WEATHER)
    return calls


def test_text_streamed_and_not(serve_client, serve_model_id):
    kw = dict(model=serve_model_id, instructions="You are a helpful assistant. Answer briefly.",
              input="What is the capital of France?", temperature=0, max_output_tokens=24)
    r = serve_client.responses.create(**kw)
    assert r.object == "response" and r.model == serve_model_id and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text.strip()
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24
    events = list(serve_client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{r.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text  # greedy: the same reply
    # and its conversation goes on: the reply's output items sent back as input
    again = serve_client.responses.create(model=serve_model_id, temperature=0, max_output_tokens=16, input=[
        {"role": "user", "content": "What is the capital of France?"}, *[o.model_dump() for o in r.output],
        {"role": "user", "content": "And of Italy?"}])
    assert again.output_text.strip()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"])
def test_constrained_function_calls_validate(serve_client, serve_model_id, choice):
    for seed in range(3):
        kw = dict(model=serve_model_id, input=ASK, tools=TOOLS, tool_choice=choice, temperature=1.0, max_output_tokens=48,
                  extra_body={"seed": seed})
        r = serve_client.responses.create(**kw)
        assert r.status == "completed", r
        calls = _valid_calls(r.output)
        with serve_client.responses.stream(**kw) as stream:  # the SDK's own stream helper assembles the items
            for _ in stream:
                pass
            final = stream.get_final_response()
        assert [(c.name, c.arguments) for c in _valid_calls(final.output)] == [(c.name, c.arguments) for c in calls]


def test_auto_answers_or_calls_and_the_tool_result_is_read(serve_client, serve_model_id):
    for seed in range(3):
        r = serve_client.responses.create(model=serve_model_id, input=ASK, tools=TOOLS, tool_choice="auto", temperature=1.0,
                                    max_output_tokens=48, extra_body={"seed": seed})
        calls = [o for o in r.output if o.type == "function_call"]
        if calls:
            _valid_calls(r.output)
        elif r.status == "completed":
            assert r.output_text.strip()
    history = [{"role": "user", "content": ASK},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "celsius"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 degrees celsius."}]
    r = serve_client.responses.create(model=serve_model_id, input=history, tools=TOOLS, tool_choice="none", temperature=0,
                                max_output_tokens=32)
    assert [o.type for o in r.output] == ["message"] and r.output_text.strip()
    events = list(serve_client.responses.create(model=serve_model_id, input=history, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_output_tokens=32, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
