"""Tool calling on the OpenAI port (runtime/server/tools.py, reply.py), judged by the official `openai`
client and `jsonschema` against a tiny random model: whatever the model would write, a constrained
call parses and its arguments match the function's schema; the history's tool messages and the
tools reach the model's template; every mistake is a 400 naming its param."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import openai
import pytest
import torch

from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import AsyncEngine, Engine
from lowbit.runtime.engine.grammar import GrammarCompiler, LazyGrammar
from lowbit.runtime.load.chat_template import ChatTemplate
from lowbit.runtime.server.app import Served, build_app
from lowbit.runtime.server.tools import lazy_grammar, parse_tools
from tests.helpers import serving
from tests.test_server import CFG, ByteTokenizer

CTX = 2048  # the tools are described in the prompt (~900 byte tokens with the Hermes template)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "weather in Paris?"}]

# a template in the Hermes format, as Qwen2.5's renders tools, calls and tool results
HERMES = """{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};\
{% endfor %}</tools>{% endif %}\
{%- for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>{% endfor %}\
{% else %}{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"""


class TemplateTokenizer(ByteTokenizer):
    """The byte tokenizer behind a real chat template; remembers the last prompt it rendered."""

    def __init__(self, source: str = HERMES):
        self.chat_template, self.template, self.last = source, ChatTemplate(source), None

    def encode_chat(self, messages, add_generation_prompt=True, limit=None, **kw):
        self.last = self.template.render(messages, add_generation_prompt, **kw)
        return self.encode(self.last)


def tiny_app(tok, ctx: int = CTX, **app_kw):
    """The app over the tiny random model with `tok`, served as "tiny" (`app_kw`: build_app's)."""
    cfg = dataclasses.replace(CFG, max_seq_len=ctx)
    model = Llama(cfg, random_weights(cfg, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    engine = Engine(model, tok, EngineConfig(kv_memory=8 << 20, max_num_seqs=8, exact=True))
    return build_app(Served(AsyncEngine(engine), tok, "tiny", ctx), **app_kw)


@pytest.fixture(scope="module")
def generic():
    """A template without tool support (the byte tokenizer's): the generic JSON format."""
    with serving(tiny_app(ByteTokenizer())) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hermes():
    tok = TemplateTokenizer()
    with serving(tiny_app(tok)) as base:
        yield tok, openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)


def _check_calls(calls, names=SCHEMAS):
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), names[c.function.name])


def _streamed_calls(stream):
    """The tool calls and finish reason of a stream, assembled as clients do it (by index)."""
    calls, finish = {}, None
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return calls, finish


@pytest.mark.parametrize("fixture", ["generic", "hermes"])
def test_required_calls_always_validate(fixture, request):
    client = request.getfixturevalue(fixture)
    client = client[1] if isinstance(client, tuple) else client
    for seed in range(6):
        # one call per reply: a random model would go on adding parallel calls until max_tokens
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           seed=seed, max_tokens=200, logit_bias={"100": -100},
                                           parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        _check_calls(r.choices[0].message.tool_calls)
        calls, finish = _streamed_calls(client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=200,
            logit_bias={"100": -100}, parallel_tool_calls=False, stream=True))
        assert finish == "tool_calls" and sorted(calls) == list(range(len(calls)))
        # the seeded stream writes the same calls as the seeded fold
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]


def test_named_choice_and_parallel_off(generic):
    for seed in range(4):
        r = generic.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, seed=seed, max_tokens=200, logit_bias={"100": -100},
            tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_time"
        _check_calls(calls)
        r = generic.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                            seed=seed, max_tokens=200, parallel_tool_calls=False)
        assert len(r.choices[0].message.tool_calls) == 1  # maxItems 1 in the grammar


def test_auto_generic_reply_is_an_answer_or_calls(generic):
    for seed in range(4):
        r = generic.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, seed=seed, max_tokens=300,
                                            logit_bias={"100": -100})
        ch = r.choices[0]
        if ch.message.tool_calls:
            assert ch.finish_reason == "tool_calls"
            _check_calls(ch.message.tool_calls)
        else:  # an answer: the JSON's response string, not the JSON
            assert ch.finish_reason in ("stop", "length") and not ch.message.content.startswith('{"response"')


def test_none_never_calls(generic, hermes):
    for client in (generic, hermes[1]):
        for seed in range(3):
            r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                               seed=seed, max_tokens=24)
            assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"


def test_tools_and_history_reach_the_template(hermes):
    tok, client = hermes
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8)
    assert r.choices[0].message.role == "assistant"
    # the template saw the tools, the call with its arguments decoded, and the tool's result
    assert tok.last.startswith("<tools>get_weather:" + json.dumps(WEATHER) + ";get_time:")
    assert '<assistant><tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' \
           "</tool_call><tool>18 degrees<assistant>" in tok.last


def test_tool_mistakes_are_400s_naming_the_param(generic):
    bad = [({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
           ({"tools": [{"type": "function", "function": {"name": "get_weather\n"}}]}, "tools"),  # `$` passed it
           ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
           ({"tools": "f"}, "tools"),
           ({"tools": TOOLS + TOOLS[:1]}, "tools"),
           ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tool_choice": "required"}, "tool_choice"),
           ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
           ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]}, "messages"),
           ({"messages": ASK + [{"role": "assistant", "tool_calls": [
               {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages"),
           ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format")]
    for extra, param in bad:
        body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            generic.chat.completions.create(**body)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (extra, e.value.body)


def test_lazy_grammar_holds_only_an_opened_call():
    """`auto` in a native format: text is free until the model writes `<tool_call>`, then the call is
    held to the tools' schemas (llguidance as the matcher) until `</tool_call>`, then free again."""
    tok = ByteTokenizer()
    trigger, lark = lazy_grammar(parse_tools({"tools": TOOLS}, HERMES))
    g = LazyGrammar(trigger, GrammarCompiler(tok).compile_lark(lark), tok)

    def allowed() -> set[int]:
        logits = torch.zeros(tok.vocab_size)
        g.mask(logits)
        return set(torch.nonzero(logits == 0).flatten().tolist())

    everything = set(range(tok.vocab_size))
    for t in tok.encode("Let me check. <tool_call>"):
        assert allowed() == everything
        g.accept(t)
    opened = allowed()
    assert tok.encode("{")[0] in opened and tok.encode("x")[0] not in opened
    for t in tok.encode('{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'):
        assert t in allowed()
        g.accept(t)
    assert allowed() == everything  # closed: free text again
    for t in tok.encode(" and <tool_call>"):
        g.accept(t)
    # a second call opens the grammar afresh: a name outside the tools is refused
    for t in tok.encode('{"name": "get_'):
        g.accept(t)
    assert tok.encode("x")[0] not in allowed() and tok.encode("t")[0] in allowed()
