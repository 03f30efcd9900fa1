"""The Responses API (runtime/server/responses_api.py) on a tiny random model, judged by the official
`openai` client, by the SDK's own pydantic models validating every object and every stream event
strictly, by `jsonschema` for the arguments of calls, and by /v1/chat/completions on the same
conversation: the same prompt (its token count) and, greedy, the same text."""

from __future__ import annotations

import dataclasses
import json
import typing

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import AsyncEngine, Engine
from lowbit.runtime.server.app import Served, build_app
from lowbit.runtime.server.responses_api import Output
from tests.helpers import serving
from tests.test_server import CFG, KEY, NAME, NO_EOS, ByteTokenizer, assert_error_shape, error_of

CTX = 1024  # the generic tool format's system message describes the tools: a few hundred byte tokens
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": TIME, "strict": True}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# each stream event's model by its type (the SDK's union, validated as a whole, reports every member's errors)
EVENT_MODELS = {typing.get_args(m.model_fields["type"].annotation)[0]: m
                for m in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


def check_event(e: dict) -> None:
    EVENT_MODELS[e["type"]].model_validate(e)


@pytest.fixture(scope="module")
def base():
    cfg = dataclasses.replace(CFG, max_seq_len=CTX)
    model = Llama(cfg, random_weights(cfg, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    engine = Engine(model, ByteTokenizer(), EngineConfig(kv_memory=8 << 20, max_num_seqs=8, exact=True))
    with serving(build_app(Served(AsyncEngine(engine), ByteTokenizer(), NAME, CTX), api_key=KEY)) as url:
        yield url + "/v1"


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60)


def raw(base: str, **body) -> dict:
    """The non-streamed reply as JSON, strictly validated as the SDK's Response."""
    r = httpx.post(base + "/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())  # every field present and of its type: the client builds without checking
    return r.json()


def streamed(base: str, **body) -> list[dict]:
    """Every event of a streamed reply, each validated as the SDK's stream event of its type."""
    events = []
    with httpx.stream("POST", base + "/responses", json={**body, "stream": True}, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                e = json.loads(line[len("data: "):])
                assert e["type"] == name
                check_event(e)
                events.append(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    return events


def text_of(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def test_text_non_streamed_and_streamed_agree_with_chat(base, client):
    kw = dict(model=NAME, input="hello there", temperature=0, max_output_tokens=12, extra_body={"logit_bias": NO_EOS})
    r = client.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.status == "incomplete" and msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert len(r.output_text) == 12 and r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.temperature == 0 and r.max_output_tokens == 12 and r.tools == [] and r.tool_choice == "auto"

    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hello there"}],
                                          temperature=0, max_completion_tokens=12, logit_bias=NO_EOS)
    assert chat.choices[0].message.content == r.output_text
    assert chat.usage.prompt_tokens == r.usage.input_tokens

    events = list(client.responses.create(**kw, stream=True))  # the SDK parses every event
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text

    ev = streamed(base, **{k: v for k, v in kw.items() if k != "extra_body"}, logit_bias=NO_EOS)
    kinds = [e["type"] for e in ev]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert text_of(ev) == r.output_text == ev[-4]["text"]
    assert {e["item_id"] for e in ev if "item_id" in e} == {ev[2]["item"]["id"]}
    final = ev[-1]["response"]
    assert final["usage"]["output_tokens"] == 12 and final["output"][0]["content"][0]["text"] == r.output_text


def test_a_finished_reply_is_completed(base):
    kw = dict(model=NAME, input="hi", temperature=0, max_output_tokens=12, logit_bias=NO_EOS)
    full = raw(base, **kw)["output"][0]["content"][0]["text"]
    stop = full[5]  # greedy: the same text again, ended at that character's first place
    r = raw(base, **kw, stop=[stop])
    assert r["status"] == "completed" and r["incomplete_details"] is None and isinstance(r["completed_at"], int)
    assert r["output"][0]["status"] == "completed" and r["output"][0]["content"][0]["text"] == full[:full.index(stop)]
    ev = streamed(base, **kw, stop=[stop])
    assert ev[-1]["type"] == "response.completed" and text_of(ev) == full[:full.index(stop)]
    # a reply that ends at once is an empty message
    r = raw(base, model=NAME, input="hi", max_output_tokens=12, logit_bias={"100": 100})
    assert r["status"] == "completed" and r["usage"]["output_tokens"] <= 1  # the end token, counted or not
    assert [(o["type"], o["content"][0]["text"]) for o in r["output"]] == [("message", "")]


def test_instructions_and_message_items(base, client):
    kw = dict(model=NAME, temperature=0, max_output_tokens=8, extra_body={"logit_bias": NO_EOS})
    r = client.responses.create(instructions="be brief", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "hi "}, {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"role": "developer", "content": "answer in French"},
        {"role": "user", "content": "and now?"}], **kw)
    chat = client.chat.completions.create(model=NAME, temperature=0, max_completion_tokens=8, logit_bias=NO_EOS,
                                          messages=[{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": "hi there"},
                                                    {"role": "assistant", "content": "hello"},
                                                    {"role": "system", "content": "answer in French"},
                                                    {"role": "user", "content": "and now?"}])
    assert r.instructions == "be brief"
    assert (r.usage.input_tokens, r.output_text) == (chat.usage.prompt_tokens, chat.choices[0].message.content)


def _calls(output: list) -> list:
    calls = [o for o in output if o["type"] == "function_call"]
    assert calls, output
    for c in calls:
        assert c["id"].startswith("fc_") and c["call_id"].startswith("call_") and c["status"] == "completed"
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    return calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}], ids=["required", "named"])
def test_function_calls_validate_streamed_or_not(base, client, choice):
    for seed in range(4):
        # one call per reply: a random model would go on adding parallel calls until the limit
        kw = dict(model=NAME, input="weather in Paris?", tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                  max_output_tokens=200, seed=seed, logit_bias=NO_EOS)
        r = raw(base, **kw)
        assert r["status"] == "completed" and r["tool_choice"] == choice and r["parallel_tool_calls"] is False
        assert [t["name"] for t in r["tools"]] == ["get_weather", "get_time"] and r["tools"][1]["strict"] is True
        calls = _calls(r["output"])
        if isinstance(choice, dict):
            assert [c["name"] for c in calls] == ["get_time"]
        ev = streamed(base, **kw)
        done = [e for e in ev if e["type"] == "response.function_call_arguments.done"]
        deltas = {e["item_id"]: "" for e in done}
        for e in ev:
            if e["type"] == "response.function_call_arguments.delta":
                deltas[e["item_id"]] += e["delta"]
        # the seeded stream calls as the seeded reply did, and its deltas add up to the arguments
        assert [e["arguments"] for e in done] == [c["arguments"] for c in calls] == list(deltas.values())
        final = _calls(ev[-1]["response"]["output"])
        assert [(c["name"], c["arguments"]) for c in final] == [(c["name"], c["arguments"]) for c in calls]
        assert ev[-1]["type"] == "response.completed"
    # the SDK reads them too
    r = client.responses.create(model=NAME, input="time?", tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=200, extra_body={"logit_bias": NO_EOS})
    call = next(o for o in r.output if o.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_allowed_tools_and_auto(base):
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    for seed in range(3):
        r = raw(base, model=NAME, input="time?", tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                max_output_tokens=200, seed=seed, logit_bias=NO_EOS)
        assert {c["name"] for c in _calls(r["output"])} == {"get_time"}
        # auto in the generic format: an answer or calls, each well formed
        r = raw(base, model=NAME, input="time?", tools=TOOLS, max_output_tokens=200, seed=seed, logit_bias=NO_EOS,
                parallel_tool_calls=False)
        kinds = {o["type"] for o in r["output"]}
        assert kinds in ({"message"}, {"function_call"}), r["output"]
        if "function_call" in kinds:
            _calls(r["output"])


def test_function_call_history_matches_chat(base, client):
    args = '{"city": "Paris", "unit": "c"}'
    r = client.responses.create(model=NAME, tools=TOOLS, tool_choice="none", temperature=0, max_output_tokens=10,
                                extra_body={"logit_bias": NO_EOS}, input=[
                                    {"role": "user", "content": "weather in Paris?"},
                                    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                     "arguments": args},
                                    {"type": "function_call", "call_id": "call_2", "name": "get_time",
                                     "arguments": '{"zone": "cet"}'},
                                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                                    {"type": "function_call_output", "call_id": "call_2",
                                     "output": [{"type": "input_text", "text": "noon"}]}])
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k not in ("type", "strict")}}
                  for t in TOOLS]
    chat = client.chat.completions.create(
        model=NAME, tools=chat_tools, tool_choice="none", temperature=0, max_completion_tokens=10, logit_bias=NO_EOS,
        messages=[{"role": "user", "content": "weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}},
                      {"id": "call_2", "type": "function",
                       "function": {"name": "get_time", "arguments": '{"zone": "cet"}'}}]},
                  # the function's name goes with its output, known from the call with that call_id
                  {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
                  {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "noon"}])
    assert r.output[0].type == "message"
    assert (r.usage.input_tokens, r.output_text) == (chat.usage.prompt_tokens, chat.choices[0].message.content)


def test_json_schema_text_format(base, client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
              "required": ["answer", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}
    for seed in range(3):
        r = raw(base, model=NAME, input="yes?", text={"format": fmt}, max_output_tokens=60, seed=seed,
                logit_bias=NO_EOS)
        assert r["text"]["format"]["name"] == "verdict"
        if r["status"] == "completed":  # a random model may write digits until the limit
            jsonschema.validate(json.loads(r["output"][0]["content"][0]["text"]), schema)
    r = client.responses.create(model=NAME, input="{?", text={"format": {"type": "json_object"}},
                                max_output_tokens=60, extra_body={"logit_bias": NO_EOS, "seed": 1})
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_logprobs_when_included(base):
    r = raw(base, model=NAME, input="hi", temperature=0, max_output_tokens=6, logit_bias=NO_EOS,
            include=["message.output_text.logprobs"], top_logprobs=2)
    part = r["output"][0]["content"][0]
    assert len(part["logprobs"]) == 6 and "".join(t["token"] for t in part["logprobs"]) == part["text"]
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in part["logprobs"])
    ev = streamed(base, model=NAME, input="hi", temperature=0, max_output_tokens=6, logit_bias=NO_EOS,
                  include=["message.output_text.logprobs"], top_logprobs=2)
    lps = [t for e in ev if e["type"] == "response.output_text.delta" for t in e["logprobs"]]
    assert [t["token"] for t in lps] == [t["token"] for t in part["logprobs"]]


def test_output_items_in_reply_order():
    """Reasoning, text, a call, the blank line after it: the items and their events as the SDK reads them."""
    out = Output()
    events = out.reasoning("let me think") + out.text("Sure", []) + out.text(", checking.", []) + \
        out.call("get_time", '{"zone": "utc"}') + out.text("\n", []) + out.finish("completed")
    for i, e in enumerate(events):
        check_event({**e, "sequence_number": i})
    assert [it["type"] for it in out.items] == ["reasoning", "message", "function_call"]
    assert out.items[0]["content"] == [{"type": "reasoning_text", "text": "let me think"}]
    assert out.items[1]["content"][0]["text"] == "Sure, checking." and out.items[1]["status"] == "completed"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    resp = {"id": "resp_x", "object": "response", "created_at": 0, "model": "m", "output": out.items,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    assert Response.model_validate(resp).output_text == "Sure, checking."

    empty = Output()  # nothing at all is still an (empty) message; a reply of whitespace is that message
    for e in empty.finish("completed"):
        check_event({**e, "sequence_number": 0})
    assert [it["type"] for it in empty.items] == ["message"] and empty.items[0]["content"][0]["text"] == ""
    blank = Output()
    blank.text("  ", [])
    blank.finish("completed")
    assert blank.items[0]["content"][0]["text"] == "  "
    cut = Output()  # cut off while reasoning: the reasoning alone
    cut.reasoning("hmm")
    cut.finish("incomplete")
    assert [(it["type"], it["status"]) for it in cut.items] == [("reasoning", "incomplete")]


def test_stateless_and_bad_requests_are_400s_naming_the_param(base, client):
    create = client.responses.create
    e = error_of(lambda: create(model=NAME, input="hi", previous_response_id="resp_123"))
    assert_error_shape(e, 400, "previous_response_id", kind="invalid_request_error")
    assert "stateless" in e.response.json()["error"]["message"]
    assert_error_shape(error_of(lambda: create(model=NAME, input="hi", conversation="conv_1")), 400, "conversation")
    assert_error_shape(error_of(lambda: create(model=NAME, input="hi", background=True)), 400, "background")
    for bad in (123, [], [{"role": "robot", "content": "x"}], [{"type": "item_reference", "id": "msg_1"}],
                [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}],
                [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}],
                [{"type": "web_search_call", "id": "ws_1"}]):
        assert_error_shape(error_of(lambda: create(model=NAME, input=bad)), 400, "input")
    assert_error_shape(error_of(lambda: create(model=NAME, input="x" * CTX)), 400, "input", "context_length_exceeded")
    assert_error_shape(error_of(lambda: create(model=NAME, input="hi", max_output_tokens=0)), 400, "max_output_tokens")
    assert_error_shape(error_of(lambda: create(model=NAME, input="hi", max_output_tokens=CTX)), 400,
                       "max_output_tokens", "context_length_exceeded")
    assert_error_shape(error_of(lambda: create(model=NAME, input="hi", temperature=-1)), 400, "temperature")
    assert_error_shape(error_of(lambda: create(model=NAME, input="hi", instructions=["x"])), 400, "instructions")
    assert_error_shape(error_of(lambda: create(model=NAME, input="hi", tools=[{"type": "web_search"}])), 400, "tools")
    assert_error_shape(error_of(lambda: create(model=NAME, input="hi", tools=[{"type": "function", "name": "a b"}])),
                       400, "tools")
    assert_error_shape(error_of(lambda: create(model=NAME, input="hi", tools=TOOLS,
                                               tool_choice={"type": "function", "name": "nope"})), 400, "tool_choice")
    assert_error_shape(error_of(lambda: create(model=NAME, input="hi", tool_choice="required")), 400, "tool_choice")
    assert_error_shape(error_of(lambda: create(model=NAME, input="hi", text={"format": {"type": "xml"}})),
                       400, "text")
    bad_schema = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}
    assert_error_shape(error_of(lambda: create(model=NAME, input="hi", text=bad_schema)), 400, "text")
    for name, bad in (("user", 7), ("safety_identifier", ["x"]), ("metadata", 3), ("metadata", {"k": 1}),
                      ("metadata", {f"k{i}": "v" for i in range(17)}), ("metadata", {"k" * 65: "v"}),
                      ("metadata", {"k": "v" * 513})):
        assert_error_shape(error_of(lambda: create(model=NAME, input="hi", **{name: bad})), 400, name)
    assert_error_shape(error_of(lambda: create(model="gpt-nope", input="hi")), 404, "model", "model_not_found")
    wrong = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
    assert_error_shape(error_of(lambda: wrong.responses.create(model=NAME, input="hi")), 401, code="invalid_api_key")
    # nothing is stored, so nothing is found
    assert_error_shape(error_of(lambda: client.responses.retrieve("resp_123")), 404, "response_id")
    assert_error_shape(error_of(lambda: client.responses.delete("resp_123")), 404, "response_id")
    # fields without effect here are accepted, unknown ones ignored
    r = raw(base, model=NAME, input="hi", max_output_tokens=2, store=True, metadata={"k": "v"}, user="u",
            reasoning={"effort": "low"}, truncation="auto", service_tier="auto", include=[], some_extension=1)
    assert r["metadata"] == {"k": "v"} and r["store"] is False and r["truncation"] == "auto"
