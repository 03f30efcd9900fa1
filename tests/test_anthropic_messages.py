"""Anthropic's Messages API (runtime/server/anthropic_api.py, anthropic_reply.py), judged by the official
`anthropic` client and by the SDK's own pydantic models validating the Message and every stream event,
against a model that writes a scripted reply behind Qwen3's real chat template (think tags, Hermes tool
calls, enable_thinking), so that every block, stop reason, count and rendered prompt is exact."""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent

from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import AsyncEngine, Engine
from lowbit.runtime.engine.grammar import closed
from lowbit.runtime.server.anthropic_api import chat_body
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


@contextmanager
def scripted_server(ctx: int, kv_memory: int):
    """The scripted model behind Qwen3's template with a `ctx`-token context, served with an API key, and
    an `anthropic` client."""
    tok = LineTokenizer(template("Qwen-Qwen3-0.6B.jinja"))
    cfg = dataclasses.replace(CFG, max_seq_len=ctx)
    model = ScriptedModel(cfg, random_weights(cfg, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    model.tok = tok
    engine = Engine(model, tok, EngineConfig(kv_memory=kv_memory, max_num_seqs=2, exact=True))
    with serving(build_app(Served(AsyncEngine(engine), tok, MODEL, ctx), api_key=KEY)) as base:
        client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=120)
        yield SimpleNamespace(model=model, tok=tok, base=base, client=client, engine=engine)


@pytest.fixture(scope="module")
def s():
    with scripted_server(CTX, 16 << 20) as server:
        yield server


def say(s, reply: str) -> None:
    """The model will write `reply`, then its end token."""
    s.model.script = s.tok.encode(reply) + [EOS]


def create(s, **ask) -> Message:
    return s.client.messages.create(**{"model": MODEL, "max_tokens": 200, "messages": ASK, **ask})


def streamed(s, **ask) -> Message:
    with s.client.messages.stream(**{"model": MODEL, "max_tokens": 200, "messages": ASK, **ask}) as st:
        return st.get_final_message()


def events(s, body: dict, path: str = "/v1/messages", **headers) -> list[dict]:
    """A streamed reply's events, each named by its `event:` line as its data's type, validated by the
    SDK's models, and in Anthropic's order: message_start, blocks opened, written and closed one at a
    time by index, message_delta, message_stop."""
    out, name = [], None
    with httpx.stream("POST", s.base + path, json={**body, "stream": True}, timeout=120,
                      headers={"anthropic-version": "2023-06-01", **headers, "x-api-key": KEY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
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


# ---- Claude Code's own requests ----------------------------------------------------------------------
#
# Recorded from Claude Code 2.1.197 against a stand-in server, its long prose cut (tests/data/claude_code/
# README.md): three text blocks of system prompt (a billing header first) under cache_control, 24 tools
# with draft 2020-12 input schemas, adaptive thinking, `output_config` and `context_management`, a
# `system` message after the user's turn (the mid-conversation-system beta), 32,000 max_tokens, seven
# anthropic-beta values and POST /v1/messages?beta=true.

RECORDED = Path(__file__).parent / "data" / "claude_code"
CC_CTX = 24576  # the recorded prompt, its prose cut, is ~19,000 byte tokens under Qwen3's template


@pytest.fixture(scope="module")
def cc():
    with scripted_server(CC_CTX, 64 << 20) as server:
        yield server


def recorded(name: str) -> tuple[dict, str, dict]:
    """A recorded request: its body (`model` set to the served id: Claude Code sends its own model names,
    claude-opus-4-8 out of the box, so a user sets ANTHROPIC_MODEL to lowbit's model id, as the recording
    of request.json and tool_result.json did), its path with its query, and its headers (the key ours)."""
    r = json.loads((RECORDED / f"{name}.json").read_text())
    path = r["path"] + (f"?{r['query']}" if r["query"] else "")
    return {**r["body"], "model": MODEL}, path, {k: v for k, v in r["headers"].items() if k != "x-api-key"}


def texts(content) -> str:
    return content if isinstance(content, str) else "".join(b["text"] for b in content)


def replay(s, name: str, reply: str):
    """The recorded request `name` with the model writing `reply`: streamed as recorded (its body, path
    and headers), its events checked as `events` checks them, then again through the SDK's beta client
    (Claude Code's: ?beta=true), whose stream builds the Message. → the body, the events, the Message."""
    body, path, headers = recorded(name)
    say(s, reply)
    ev = events(s, body, path, **headers)
    usage = ev[-2]["usage"]
    assert ev[0]["message"]["usage"]["input_tokens"] == s.tok.prompt_len  # before the engine's count
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == s.tok.prompt_len
    assert usage["output_tokens"] == len(s.model.script) - 1  # the end token is not counted
    first = {k: body[k] for k in ("model", "max_tokens", "messages")}
    rest = {k: v for k, v in body.items() if k not in first and k != "stream"}
    with s.client.beta.messages.stream(**first, extra_body=rest, extra_headers=headers) as st:
        final = st.get_final_message()
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == s.tok.prompt_len
    assert (final.stop_reason, final.usage.output_tokens) == (ev[-2]["delta"]["stop_reason"], usage["output_tokens"])
    return body, ev, final


def test_claude_code_request(cc):
    body, ev, m = replay(cc, "request", '<think>\nList them.\n</think>\n\nI will list the files.\n<tool_call>\n'
                                        '{"name": "Bash", "arguments": {"command": "ls", "description": "List '
                                        'files"}}\n</tool_call>')
    assert body["thinking"] == {"type": "adaptive"} and [t["role"] for t in body["messages"]] == ["user", "system"]
    # the prompt: the system blocks joined, the tools in their order, the user's text blocks joined, the
    # mid-conversation system message in its place, and the turn left open for thinking
    [user, system] = body["messages"]
    prompt = cc.tok.last
    assert prompt.startswith(f"<|im_start|>system\n{texts(body['system'])}\n\n# Tools\n")
    assert prompt.endswith(f"</tool_call><|im_end|>\n<|im_start|>user\n{texts(user['content'])}<|im_end|>\n"
                           f"<|im_start|>system\n{system['content']}<|im_end|>\n<|im_start|>assistant\n")
    at = [prompt.index(f'{{"type": "function", "function": {{"name": "{t["name"]}", "description": '
                       f'{json.dumps(t["description"], ensure_ascii=False)}, "parameters": {{"type": "object", ')
          for t in body["tools"]]
    assert at == sorted(at) and len(at) == 24
    assert blocks(m) == [("thinking", "\nList them.\n"), ("text", "I will list the files.\n"),
                         ("tool_use", "Bash", {"command": "ls", "description": "List files"})]
    assert m.content[0].signature and m.content[2].id.startswith("toolu_") and m.stop_reason == "tool_use"
    assert [e["content_block"]["type"] for e in ev if e["type"] == "content_block_start"] == \
        ["thinking", "text", "tool_use"]
    assert ev[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    # count_tokens (which Claude Code 2.1.197 did not call) counts the same prompt
    n = cc.client.messages.count_tokens(**{k: v for k, v in body.items() if k in ("model", "messages", "system",
                                                                                 "tools", "thinking")})
    assert n.input_tokens == cc.tok.prompt_len


def test_claude_code_tool_result(cc):
    """The follow-up: Claude Code ran the call and sends its tool_result (is_error false, under
    cache_control); the turn before it is read from the cache the first request left."""
    replay(cc, "request", "I will list the files.")
    body, ev, m = replay(cc, "tool_result", "The only file is notes.txt.")
    [call] = [b for b in body["messages"][2]["content"] if b["type"] == "tool_use"]
    [result] = body["messages"][3]["content"]
    assert result == {"tool_use_id": call["id"], "type": "tool_result", "content": "notes.txt", "is_error": False,
                      "cache_control": {"type": "ephemeral"}}
    assert cc.tok.last.endswith(
        '<|im_start|>assistant\nI will list the files.\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls", '
        '"description": "List files"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nnotes.txt\n'
        '</tool_response><|im_end|>\n<|im_start|>assistant\n')
    assert blocks(m) == [("text", "The only file is notes.txt.")] and m.stop_reason == "end_turn"
    assert ev[-2]["usage"]["cache_read_input_tokens"] > 18000  # all but the new turns


def test_claude_code_thinking_budget(cc):
    """Claude Code with a model it knows takes no adaptive thinking (claude-sonnet-4-5, recorded with
    MAX_THINKING_TOKENS=1024): thinking enabled with that budget, no mid-conversation system message (its
    agent list a system-reminder in the user's turn), no output_config."""
    body, _, m = replay(cc, "budget_request", "<think>\nThe user wants ls.\n</think>\n\nRunning ls.")
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 1024} and "output_config" not in body
    assert [t["role"] for t in body["messages"]] == ["user"]
    assert cc.tok.last.endswith(f"<|im_start|>user\n{texts(body['messages'][0]['content'])}<|im_end|>\n"
                                "<|im_start|>assistant\n")
    assert blocks(m) == [("thinking", "\nThe user wants ls.\n"), ("text", "Running ls.")]
    assert m.stop_reason == "end_turn"


def test_what_claude_code_sends_that_lowbit_adapts():
    """A `system` message among the turns is one in its place; `propertyNames: {"type": "string"}` (which
    says nothing, and which the grammar library cannot compile: Claude Code's TaskCreate and TaskUpdate
    carry it) leaves the schema, a property of that name and data (enum, const) staying; a billing
    header's `cch=`, which changes every request (Claude Code sends it logged in to claude.ai or on
    Vertex), is fixed, so that one conversation's requests share their prompt prefix."""
    body, _, _ = recorded("request")
    chat = chat_body(body)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "system"]
    assert chat["messages"][2]["content"] == body["messages"][1]["content"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in chat["tools"]}
    assert "propertyNames" in json.dumps(schemas["TaskCreate"])  # as sent; the grammar drops it (any dialect's)
    assert "propertyNames" not in json.dumps(closed(schemas["TaskCreate"]))
    odd = {"type": "object", "properties": {"propertyNames": {"type": "string"}, "m": {
        "type": "object", "propertyNames": {"type": "string", "pattern": "^x"}, "enum": [{"propertyNames": {
            "type": "string"}}]}}, "propertyNames": {"type": "string"}}
    got = closed(odd)
    assert "propertyNames" not in got and got["properties"]["propertyNames"] == {"type": "string"}
    assert got["properties"]["m"]["propertyNames"] == {"type": "string", "pattern": "^x"}
    assert got["properties"]["m"]["enum"] == odd["properties"]["m"]["enum"]
    header = "x-anthropic-billing-header: cc_version=2.1.197.8a5; cc_entrypoint=cli; cch={};"
    first, again = (chat_body({**body, "system": [{"type": "text", "text": header.format(cch)}, *body["system"][1:]]})
                    ["messages"][0]["content"] for cch in ("a5145", "0c1d2"))
    assert first == again and first.startswith("x-anthropic-billing-header: cc_version=2.1.197.8a5; "
                                               "cc_entrypoint=cli; cch=fffff;You are a Claude agent")


def test_loading_is_a_503_overloaded_error():
    with serving(build_app()) as base:
        r = httpx.post(base + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": ASK}, timeout=30)
    anthropic_error(r, 503, "overloaded_error", "loading")
    assert r.headers["retry-after"] == "2"
