"""Anthropic's Messages API (runtime/server/anthropic_api.py, anthropic_reply.py), judged by the official
`anthropic` client and by the SDK's own pydantic models validating the Message and every stream event,
against a model that writes a scripted reply behind Qwen3's real chat template (think tags, Hermes tool
calls, enable_thinking), so that every block, stop reason, count and rendered prompt is exact."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import anthropic
import httpx
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent

from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import AsyncEngine, Engine
from lowbit.runtime.server.app import Served, build_app
from tests.helpers import serving
from tests.test_harmony import ScriptedModel
from tests.test_qwen_xml_tools import EOS, LineTokenizer, template
from tests.test_server import CFG, KEY

CTX = 4096  # Qwen3's tool prompt with three tools: ~1,500 byte tokens
MODEL = "qwen"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": TIME, "cache_control": {"type": "ephemeral"}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = ('<think>\nNeed weather.\n</think>\n\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>')
EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def s():
    """The scripted model behind Qwen3's template, served with an API key, and an `anthropic` client."""
    tok = LineTokenizer(template("Qwen-Qwen3-0.6B.jinja"))
    cfg = dataclasses.replace(CFG, max_seq_len=CTX)
    model = ScriptedModel(cfg, random_weights(cfg, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    model.tok = tok
    engine = Engine(model, tok, EngineConfig(kv_memory=16 << 20, max_num_seqs=2, exact=True))
    with serving(build_app(Served(AsyncEngine(engine), tok, MODEL, CTX), api_key=KEY)) as base:
        client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=120)
        yield SimpleNamespace(model=model, tok=tok, base=base, client=client, engine=engine)


def say(s, reply: str) -> None:
    """The model will write `reply`, then its end token."""
    s.model.script = s.tok.encode(reply) + [EOS]


def create(s, **ask) -> Message:
    return s.client.messages.create(**{"model": MODEL, "max_tokens": 200, "messages": ASK, **ask})


def streamed(s, **ask) -> Message:
    with s.client.messages.stream(**{"model": MODEL, "max_tokens": 200, "messages": ASK, **ask}) as st:
        return st.get_final_message()


def events(s, body: dict, **headers) -> list[dict]:
    """A streamed reply's events, each named by its `event:` line as its data's type, validated by the
    SDK's models, and in Anthropic's order: message_start, blocks opened, written and closed one at a
    time by index, message_delta, message_stop."""
    out, name = [], None
    with httpx.stream("POST", s.base + "/v1/messages", json={**body, "stream": True}, timeout=120,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01", **headers}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                e = json.loads(line[len("data: "):])
                assert e["type"] == name
                if name != "ping":
                    EVENT.validate_python(e)
                out.append(e)
    kinds = [e["type"] for e in out if e["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    index, open_ = -1, False
    for e in out[1:-2]:
        if e["type"] == "content_block_start":
            assert e["index"] == index + 1
            index, open_ = e["index"], True
        elif e["type"] in ("content_block_delta", "content_block_stop"):
            assert e["index"] == index and open_
            open_ = e["type"] == "content_block_delta"
    return out


def blocks(m: Message) -> list[tuple]:
    """The content, less the ids and signatures each reply makes anew."""
    return [(b.type, b.text) if b.type == "text" else (b.type, b.thinking) if b.type == "thinking"
            else (b.type, b.name, b.input) for b in m.content]


def test_text_reply_streamed_and_not(s):
    say(s, "Hello there!")
    m = create(s, system="Be brief.", messages=[{"role": "user", "content": "hi"}])
    assert s.tok.last == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                          "<|im_start|>assistant\n")
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert blocks(m) == [("text", "Hello there!")] and (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    assert m.usage.output_tokens == 12 and m.usage.input_tokens + m.usage.cache_read_input_tokens == s.tok.prompt_len
    raw = httpx.post(s.base + "/v1/messages", headers={"x-api-key": KEY}, timeout=120, json={
        "model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    Message.model_validate(raw.json())  # strictly: every field present and of its type
    with s.client.messages.stream(model=MODEL, max_tokens=200, system="Be brief.",
                                  messages=[{"role": "user", "content": "hi"}]) as st:
        text, final = "".join(st.text_stream), st.get_final_message()
    assert text == "Hello there!" and blocks(final) == blocks(m) and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 12
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == s.tok.prompt_len


def test_thinking_blocks_streamed_and_not(s):
    say(s, "<think>\nUser greets.\n</think>\n\nHello!")
    ask = {"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 64}}
    m = create(s, **ask)
    assert s.tok.last.endswith("<|im_start|>assistant\n")  # thinking on: the template leaves the block to the model
    assert blocks(m) == [("thinking", "\nUser greets.\n"), ("text", "Hello!")] and m.content[0].signature
    assert blocks(streamed(s, **ask)) == blocks(m)
    ev = events(s, {"model": MODEL, "max_tokens": 200, **ask})
    deltas = [e["delta"] for e in ev if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "\nUser greets.\n"
    assert "".join(d.get("text", "") for d in deltas) == "Hello!"
    starts = [e["content_block"] for e in ev if e["type"] == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""}]
    signed = [i for i, d in enumerate(deltas) if d["type"] == "signature_delta"]
    assert len(signed) == 1 and deltas[signed[0] - 1]["type"] == "thinking_delta"  # last, before the block's stop
    say(s, "Hello!")
    m = create(s, messages=[{"role": "user", "content": "hi"}], thinking={"type": "disabled"})
    assert s.tok.last.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and blocks(m) == [("text", "Hello!")]


def test_thinking_budget_closes_the_block(s):
    """budget_tokens is the chat endpoint's thinking budget: after that many reasoning tokens `</think>` is
    forced, and the reply goes on as an answer."""
    say(s, "<think>\n" + "x" * 40 + "\n</think>\n\nDone.")
    m = create(s, messages=[{"role": "user", "content": "hi"}], thinking={"type": "enabled", "budget_tokens": 5})
    assert m.content[0].type == "thinking" and m.content[0].thinking == "\nxxxx"
    assert m.content[1].type == "text" and m.stop_reason == "end_turn"


def test_tool_use_round_trip(s):
    say(s, CALL)
    m = create(s, tools=TOOLS)
    assert '{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city"' in s.tok.last
    assert m.stop_reason == "tool_use"
    assert blocks(m) == [("thinking", "\nNeed weather.\n"), ("tool_use", "get_weather", {"city": "Paris", "unit": "c"})]
    call = m.content[1]
    assert call.id.startswith("toolu_")
    final = streamed(s, tools=TOOLS)
    assert blocks(final) == blocks(m) and final.stop_reason == "tool_use"
    ev = events(s, {"model": MODEL, "max_tokens": 200, "messages": ASK, "tools": TOOLS})
    [start] = [e["content_block"] for e in ev if e["type"] == "content_block_start" and e["index"] == 1]
    assert start["type"] == "tool_use" and start["input"] == {} and start["name"] == "get_weather"
    parts = [e["delta"]["partial_json"] for e in ev if e["type"] == "content_block_delta" and e["index"] == 1]
    assert json.loads("".join(parts)) == {"city": "Paris", "unit": "c"}
    # the call and its result sent back: the thinking, the call and the result reach the template
    history = ASK + [{"role": "assistant", "content": [b.to_dict() for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": [{"type": "text", "text": "18 C"}]}]}]
    say(s, "It is 18 C in Paris.")
    again = create(s, tools=TOOLS, messages=history)
    assert blocks(again) == [("text", "It is 18 C in Paris.")] and again.stop_reason == "end_turn"
    assert s.tok.last.endswith(
        '<|im_start|>assistant\n<think>\nNeed weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "c"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n'
        '</tool_response><|im_end|>\n<|im_start|>assistant\n')
    # a failed tool says so in its result; text after the results is the user's own turn
    history[-1]["content"] = [{"type": "tool_result", "tool_use_id": call.id, "content": "boom", "is_error": True},
                              {"type": "text", "text": "Try again."}]
    create(s, tools=TOOLS, messages=history)
    assert s.tok.last.endswith("<tool_response>\nError: boom\n</tool_response><|im_end|>\n"
                               "<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n")


def test_tool_choice_any_tool_and_none(s):
    say(s, '[{"name": "get_time", "arguments": {"zone": "cet"}}]')  # `any`: a JSON list of calls, held to it
    m = create(s, tools=TOOLS, tool_choice={"type": "any"})
    assert blocks(m) == [("tool_use", "get_time", {"zone": "cet"})] and m.stop_reason == "tool_use"
    assert blocks(streamed(s, tools=TOOLS, tool_choice={"type": "any"})) == blocks(m)
    say(s, '{"zone": "utc"}')  # a named tool: its input object
    m = create(s, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True})
    assert blocks(m) == [("tool_use", "get_time", {"zone": "utc"})] and m.stop_reason == "tool_use"
    say(s, "No tools.")
    m = create(s, tools=TOOLS, tool_choice={"type": "none"})
    assert "<tools>" not in s.tok.last and blocks(m) == [("text", "No tools.")] and m.stop_reason == "end_turn"


def test_stop_reasons_and_counts(s):
    say(s, "Hello there! Bye.")
    m = create(s, max_tokens=5)
    assert blocks(m) == [("text", "Hello")] and m.stop_reason == "max_tokens" and m.usage.output_tokens == 5
    for get in (create, streamed):
        m = get(s, stop_sequences=["Bye", "there"])
        assert blocks(m) == [("text", "Hello ")] and (m.stop_reason, m.stop_sequence) == ("stop_sequence", "there")
    m = create(s, stop_sequences=["zzz"])
    assert blocks(m) == [("text", "Hello there! Bye.")] and (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    # max_tokens past the context: the reply runs until the context is full
    n = s.client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    long = [{"role": "user", "content": "Weather in Paris?" + "!" * (CTX - n - 4)}]
    m = create(s, max_tokens=32000, messages=long)
    assert m.stop_reason == "model_context_window_exceeded" and blocks(m) == [("text", "Hell")]


def test_count_tokens_is_the_prompt_length(s):
    ask = {"model": MODEL, "system": [{"type": "text", "text": "Be brief."}], "messages": ASK, "tools": TOOLS,
               "thinking": {"type": "enabled", "budget_tokens": 64}}
    n = s.client.messages.count_tokens(**ask).input_tokens
    assert n == s.tok.prompt_len and n > 300  # the tools are in the prompt
    say(s, "Sunny.")
    m = s.client.messages.create(**ask, max_tokens=20)
    assert s.tok.prompt_len == n and m.usage.input_tokens + m.usage.cache_read_input_tokens == n
    r = httpx.post(s.base + "/v1/messages/count_tokens", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 7})  # a stray max_tokens is no error
    assert r.status_code == 200 and r.json() == {"input_tokens": s.client.messages.count_tokens(
        model=MODEL, messages=ASK).input_tokens}


def anthropic_error(r: httpx.Response, status: int, kind: str, *words: str) -> None:
    body = r.json()
    assert r.status_code == status and body["type"] == "error" and body["error"]["type"] == kind, body
    assert set(body["error"]) == {"type", "message"} and all(w in body["error"]["message"] for w in words), body


def test_keys_and_errors_in_anthropic_shape(s):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=s.base, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=ASK)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    post = lambda body, **h: httpx.post(s.base + "/v1/messages", json=body, headers=h, timeout=60)
    anthropic_error(post({"model": MODEL, "max_tokens": 5, "messages": ASK}), 401, "authentication_error", "x-api-key")
    say(s, "Hi.")  # the bearer token (Claude Code's ANTHROPIC_AUTH_TOKEN) is a key too
    bearer = anthropic.Anthropic(base_url=s.base, api_key=None, auth_token=KEY, max_retries=0, timeout=120)
    assert blocks(bearer.messages.create(model=MODEL, max_tokens=5, messages=ASK)) == [("text", "Hi.")]
    key = {"x-api-key": KEY}
    anthropic_error(post({"model": MODEL, "messages": ASK}, **key), 400, "invalid_request_error", "max_tokens")
    anthropic_error(httpx.post(s.base + "/v1/messages", content=b"{", headers=key), 400, "invalid_request_error")
    anthropic_error(post({"model": "claude-x", "max_tokens": 5, "messages": ASK}, **key), 404, "not_found_error",
                    "claude-x")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    for body, words in [
        ({"messages": [{"role": "user", "content": [image]}]}, ("'image'", "text only")),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, ("server tool",)),
        ({"stop_sequences": [1]}, ("stop_sequences",)),
        ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, ("tools[0].name",)),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, ("nope",)),
        ({"messages": ASK + [{"role": "assistant", "content": "Sure"}]}, ("prefill",)),
        ({"thinking": {"type": "enabled", "budget_tokens": -1}}, ("thinking.budget_tokens",)),
        ({"max_tokens": 0}, ("max_tokens",)),
    ]:
        anthropic_error(post({"model": MODEL, "max_tokens": 5, "messages": ASK, **body}, **key), 400,
                        "invalid_request_error", *words)
    with pytest.raises(anthropic.BadRequestError):
        s.client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [image]}])


def test_failure_after_the_reply_began(s):
    """A step that fails mid-reply: streamed, an `error` event in Anthropic's shape ends the stream (the SDK
    raises it); not streamed, a 500 api_error. Afterwards the server serves again."""
    run, calls = s.engine._run, []

    def failing(scheduled):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("simulated kernel failure")
        return run(scheduled)

    say(s, "Hello there, and a long reply.")
    s.engine._run = failing
    seen = []
    try:
        with pytest.raises(anthropic.APIStatusError) as e, s.client.messages.stream(
                model=MODEL, max_tokens=50, messages=ASK) as st:
            for event in st:
                seen.append(event.type)
        assert seen[0] == "message_start" and "content_block_delta" in seen  # the reply had begun
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
        assert "simulated kernel failure" in e.value.body["error"]["message"]
        calls.clear()
        with pytest.raises(anthropic.InternalServerError) as e:
            create(s)
        assert e.value.status_code == 500 and e.value.body["error"]["type"] == "api_error"
    finally:
        s.engine._run = run
    assert blocks(create(s)) == [("text", "Hello there, and a long reply.")]
    assert s.engine.blocks.num_used_pages == 0


# A request as Claude Code sends it: its system prompt as text blocks (a billing header first, whose cch
# changes every request), cache_control marks, tools with draft-07 input schemas, thinking with a budget,
# metadata.user_id, 32,000 max_tokens and the beta headers
CLAUDE_CODE = {
    "model": MODEL, "max_tokens": 32000, "stream": True, "temperature": 1,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0.14.a1b; cc_entrypoint=cli; cch=a5145;"},
               {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": "\nYou are an interactive CLI tool that helps users with software "
                                        "engineering tasks.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nAs you answer, use the tools.\n</system-reminder>"},
        {"type": "text", "text": "list the files here", "cache_control": {"type": "ephemeral"}}]}],
    "tools": [
        {"name": "Bash", "description": "Executes a given bash command.", "input_schema": {
            "type": "object", "properties": {
                "command": {"type": "string", "description": "The command to execute"},
                "timeout": {"type": "number", "description": "Optional timeout in milliseconds (max 600000)"},
                "description": {"type": "string", "description": "What this command does in 5-10 words"},
                "run_in_background": {"type": "boolean"}},
            "required": ["command"], "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#"}},
        {"name": "Read", "description": "Reads a file from the local filesystem.", "input_schema": {
            "type": "object", "properties": {"file_path": {"type": "string"}, "offset": {"type": "number"},
                                             "limit": {"type": "number"}},
            "required": ["file_path"], "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#"}},
        {"name": "Glob", "description": "Fast file pattern matching.", "input_schema": {
            "type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
            "required": ["pattern"], "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#"}, "cache_control": {"type": "ephemeral"}}],
    "metadata": {"user_id": "user_2f1c_account__session_8d0a"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
}


def test_claude_code_request(s):
    say(s, '<think>\nList them.\n</think>\n\nI will list the files.\n<tool_call>\n'
           '{"name": "Bash", "arguments": {"command": "ls", "description": "List files"}}\n</tool_call>')
    ev = events(s, CLAUDE_CODE, **{"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
                                   "user-agent": "claude-cli/2.0.14 (external, cli)"})
    assert s.tok.last.startswith("<|im_start|>system\nx-anthropic-billing-header: cc_version=2.0.14.a1b; "
                                 "cc_entrypoint=cli; cch=fffff;You are Claude Code")
    assert "<|im_start|>user\n<system-reminder>\nAs you answer, use the tools.\n</system-reminder>list the files here" \
        in s.tok.last
    start = ev[0]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["usage"]["input_tokens"] == s.tok.prompt_len
    assert [e["content_block"]["type"] for e in ev if e["type"] == "content_block_start"] == \
        ["thinking", "text", "tool_use"]
    call = json.loads("".join(e["delta"].get("partial_json", "") for e in ev if e["type"] == "content_block_delta"))
    assert call == {"command": "ls", "description": "List files"}
    assert ev[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert ev[-2]["usage"]["output_tokens"] == len(s.model.script) - 1


def test_loading_is_a_503_overloaded_error():
    with serving(build_app()) as base:
        r = httpx.post(base + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": ASK}, timeout=30)
    anthropic_error(r, 503, "overloaded_error", "loading")
    assert r.headers["retry-after"] == "2"
