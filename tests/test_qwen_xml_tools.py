"""Qwen3-Coder's XML tool calls (Qwen3.5, Qwen3-Coder; runtime/server/qwen_xml.py), judged by three
oracles: hand-written replies (whole and a character at a time), the real templates (llama.cpp's
models/templates/ copies) rendered by transformers, and the `openai` client against the server over a
tiny model that either writes a scripted reply token by token or, random, is held by the grammar.

The template is also the oracle of the grammar: what it writes for a call in the history is what the
grammar of a required call must accept, and what the parser must read back into the same arguments.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import openai
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import AsyncEngine, Engine
from lowbit.runtime.engine.grammar import GrammarCompiler
from lowbit.runtime.load.chat_template import ChatTemplate
from lowbit.runtime.server.app import Served, build_app
from lowbit.runtime.server.qwen_xml import call_body, calls_grammar, parse_call
from lowbit.runtime.server.reply import THINK_TAGS, ReplyParser, think_tags
from lowbit.runtime.server.tools import history_message, template_format
from tests import llama_cpp_source
from tests.helpers import serving, streamed_chat
from tests.test_harmony import ScriptedModel
from tests.test_server import CFG, ByteTokenizer

CTX = 4096  # Qwen3.5's tool prompt with two tools and a call in the history: ~2,600 byte tokens
NL, EOS = 95, 100  # the newline this file's tokenizer adds (ByteTokenizer's 95-99 repeat 32-36); its end token
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}, "dst": {"type": "boolean"}},
        "required": ["zone"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": s}}
         for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "weather in Paris?"}]
# every kind of value the template writes: a string that looks like a number, lines, JSON, a bool, None
KINDS = {"type": "object", "properties": {
    "code": {"type": "string"}, "text": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"},
    "flag": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
    "opts": {"type": "object"}, "none": {"type": ["string", "null"]}}}
KIND_ARGS = {"code": "007", "text": "two\nlines\n", "n": 3, "x": 2.5, "flag": True, "tags": ["a", "b"],
             "opts": {"k": [1, {"z": None}]}, "none": None}


def template(name: str) -> str:
    return (llama_cpp_source.converter_dir() / "models" / "templates" / name).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def qwen35() -> str:
    return template("Qwen3.5-4B.jinja")


def test_templates_name_the_xml_format(qwen35):
    assert template_format(qwen35) == "qwen3_xml" and think_tags(qwen35) == THINK_TAGS[0]
    assert template_format(template("Qwen3-Coder.jinja")) == "qwen3_xml"
    assert template_format(template("Qwen-Qwen3-0.6B.jinja")) == "hermes"  # JSON inside <tool_call>


# ---- hand-written replies -------------------------------------------------------------------------

def parse(text: str, step: int | None = None, **kw) -> tuple[str, str, list]:
    """(content, reasoning, calls) of `text` fed whole, or `step` characters at a time."""
    p = ReplyParser("qwen3_xml", THINK_TAGS[0], tools=SCHEMAS | {"kinds": KINDS}, **kw)
    pieces = []
    for i in range(0, len(text), step or max(len(text), 1)):
        pieces += p.feed(text[i:i + (step or len(text))])
    pieces += p.finish()
    content = "".join(v for k, v in pieces if k == "content")
    reasoning = "".join(v for k, v in pieces if k == "reasoning")
    return content, reasoning, [(n, json.loads(a)) for k, (n, a) in ((k, v) for k, v in pieces if k == "call")]


def block(name: str, **params: str) -> str:
    """A call as the template writes it, each value's text given as is."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CASES = [
    # reply, in_think, content, reasoning, calls
    ("Plain answer, no call.", False, "Plain answer, no call.", "", []),
    ("a <tool and <tool_c", False, "a <tool and <tool_c", "", []),  # marker prefixes released at the end
    ("Let me look.\n\n" + block("get_weather", city="Paris", unit="c", days="3"), False,
     "Let me look.", "", [("get_weather", {"city": "Paris", "unit": "c", "days": 3})]),
    # the prompt opened the think block (Qwen3.5's default); two calls one newline apart
    ("I need both.\n</think>\n\n" + block("get_weather", city="Oslo", unit="f") + "\n"
     + block("get_time", zone="cet", dst="True"), True,
     "", "I need both.\n",
     [("get_weather", {"city": "Oslo", "unit": "f"}), ("get_time", {"zone": "cet", "dst": True})]),
    # every kind: strings stay text (one newline taken off each end), the rest is JSON or Python's spelling
    (block("kinds", code="007", text="two\nlines\n", n="3", x="2.5", flag="false", tags='["a", "b"]',
           opts='{"k": [1]}', none="None"), False, "",
     "", [("kinds", {"code": "007", "text": "two\nlines\n", "n": 3, "x": 2.5, "flag": False, "tags": ["a", "b"],
                     "opts": {"k": [1]}, "none": None})]),
    # a value that is not of its type falls back to the text; undeclared parameters and unknown functions
    # are read as JSON when they are JSON, else as text
    (block("kinds", n="three", flag="yes", extra="[1, 2]", other="word"), False, "",
     "", [("kinds", {"n": "three", "flag": "yes", "extra": [1, 2], "other": "word"})]),
    (block("no_such_tool", q="42"), False, "", "", [("no_such_tool", {"q": 42})]),
    # no newlines around the value, no </function>, the reply ended before </tool_call>: still a call
    ("<tool_call><function=get_weather><parameter=city>Rome</parameter><parameter=unit>c</parameter>", False,
     "", "", [("get_weather", {"city": "Rome", "unit": "c"})]),
    # not a call: stays content whole, and text after it too
    ("<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call> ok", False,
     "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call> ok", "", []),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>", False,
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>", "", []),
    ("<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>", False,
     "<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>", "", []),
]


@pytest.mark.parametrize("reply,in_think,content,reasoning,calls", CASES)
def test_transcripts_whole_and_streamed(reply, in_think, content, reasoning, calls):
    whole = parse(reply, in_think=in_think)
    assert whole == (content, reasoning, calls)
    assert parse(reply, 1, in_think=in_think) == whole
    assert parse(reply, 7, in_think=in_think) == whole


# ---- the real template: history rendered as transformers renders it, and read back -----------------

def history(args: dict) -> list[dict]:
    """A conversation with a call whose arguments come as a client sends them (a JSON string) and its
    result, checked by the server's history_message as the request path does."""
    call = {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "kinds", "arguments": json.dumps(args)}}]}
    msgs = ASK + [call, {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    return [{"role": m["role"], "content": m["content"], **history_message(i, m)} for i, m in enumerate(msgs)]


@pytest.mark.parametrize("name", ["Qwen3.5-4B.jinja", "Qwen3-Coder.jinja"])
def test_history_renders_as_transformers_and_reads_back(name):
    source = template(name)
    tools = TOOLS + [{"type": "function", "function": {"name": "kinds", "parameters": KINDS}}]
    msgs = history(KIND_ARGS)
    ours = ChatTemplate(source).render(msgs, True, tools=tools)
    want = render_jinja_template([[*ASK, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "kinds", "arguments": KIND_ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]], tools=tools, chat_template=source,
        add_generation_prompt=True)[0][0]
    assert ours == want
    blocks = re.findall(r"<tool_call>(.*?)</tool_call>", ours.split("<|im_start|>assistant")[1], re.DOTALL)
    assert len(blocks) == 1 and "<parameter=flag>\nTrue\n</parameter>" in blocks[0]  # Jinja's spelling
    assert parse_call(blocks[0], {"kinds": KINDS}) == ("kinds", json.dumps(KIND_ARGS))


# ---- the grammar: it accepts what the template writes, and nothing outside the schema ----------------

class LineTokenizer(ByteTokenizer):
    """The byte tokenizer with a newline token (the XML format is made of lines), behind a real template;
    remembers the last prompt it rendered and its length (ScriptedModel reads it)."""

    def __init__(self, source: str | None = None):
        self.chat_template, self.last, self.prompt_len = source, None, 0
        self.template = ChatTemplate(source) if source else None

    def token_bytes(self, i: int) -> bytes:
        return b"\n" if i == NL else super().token_bytes(i)

    def encode(self, text: str, add_special: bool = True, limit=None) -> list[int]:
        return [NL if ch == "\n" else min(max(ord(ch) - 32, 0), 94) for ch in text]

    def encode_chat(self, messages, add_generation_prompt=True, limit=None, **kw):
        self.last = self.template.render(messages, add_generation_prompt, **kw)
        ids = self.encode(self.last)
        self.prompt_len = len(ids)
        return ids


def accepts(lark: str, text: str) -> bool:
    """Whether the grammar lets the model write exactly `text` and then end."""
    g = GrammarCompiler(LineTokenizer()).compile_lark(lark)
    for t in LineTokenizer().encode(text):
        if not g.allowed()[t]:
            return False
        g.accept(t)
    return bool(g.allowed()[EOS])


def rendered_call(source: str, name: str, args: dict) -> str:
    """The call block(s) the template writes for `args` in an assistant turn, from <tool_call> on."""
    msgs = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}}]}]
    turn = ChatTemplate(source).render(msgs, False).split("<|im_start|>assistant\n")[1]
    return turn[turn.index("<tool_call>"):turn.rindex("</tool_call>") + len("</tool_call>")]


def test_grammar_accepts_the_templates_calls_and_holds_the_schema(qwen35):
    tools = [(n, s) for n, s in SCHEMAS.items()]
    weather = rendered_call(qwen35, "get_weather", {"city": "Paris", "unit": "c", "days": 3})
    time_ = rendered_call(qwen35, "get_time", {"zone": "utc", "dst": False})  # the template writes False
    required, one = calls_grammar(tools, True, False), calls_grammar(tools, False, False)
    for g in (required, one):
        assert accepts(g, weather) and accepts(g, time_)
        assert accepts(g, weather.replace("<parameter=days>\n3\n</parameter>\n", ""))  # optional
        for bad in (weather.replace("\nc\n", "\nk\n"),  # not in the enum
                    weather.replace("Paris", "Llanfairpwllgwyngyll"),  # over maxLength 12
                    weather.replace("\n3\n", "\n30\n"),  # over the maximum
                    weather.replace("<parameter=unit>\nc\n</parameter>\n", ""),  # a required one missing
                    weather.replace("get_weather", "get_rain"),  # not a tool
                    "Sure! " + weather,  # a required call leaves no room for text
                    ""):
            assert not accepts(g, bad), bad
    assert accepts(required, weather + "\n" + time_) and not accepts(one, weather + "\n" + time_)
    # the prompt opened a think block: reasoning up to </think>, then the calls
    thought = calls_grammar(tools, True, True)
    assert accepts(thought, "Paris, so weather.\n</think>\n\n" + weather) and not accepts(thought, weather)
    # tool_choice auto: after the trigger <tool_call>, one call and its close
    assert accepts(call_body(tools), weather.removeprefix("<tool_call>"))
    assert not accepts(call_body(tools), weather.removeprefix("<tool_call>") + "\n")



def test_grammar_follows_a_parameters_ref_into_the_functions_defs():
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
             "additionalProperties": False}
    params = {"type": "object", "$defs": {"pt": point}, "properties": {"at": {"$ref": "#/$defs/pt"}},
              "required": ["at"]}
    g = calls_grammar([("move", params)], False, False)
    call = "<tool_call>\n<function=move>\n<parameter=at>\n{}\n</parameter>\n</function>\n</tool_call>"
    assert accepts(g, call.format('{"x": 3}')) and not accepts(g, call.format('{"x": "a"}'))
    assert parse_call(call.format('{"x": 3}')[len("<tool_call>"):-len("</tool_call>")], {"move": params}) == \
        ("move", '{"at": {"x": 3}}')  # a $ref says no type: JSON, since the text is JSON


# ---- the server, through the openai client -------------------------------------------------------

def app_for(model, tok):
    engine = Engine(model, tok, EngineConfig(kv_memory=16 << 20, max_num_seqs=2, exact=True))
    return build_app(Served(AsyncEngine(engine), tok, "qwen", CTX))


@pytest.fixture(scope="module")
def scripted(qwen35):
    """A model that writes whatever reply the test scripts, token by token, behind Qwen3.5's template."""
    tok = LineTokenizer(qwen35)
    cfg = dataclasses.replace(CFG, max_seq_len=CTX)
    model = ScriptedModel(cfg, random_weights(cfg, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    model.tok = tok
    with serving(app_for(model, tok)) as base:
        yield model, tok, openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


streamed = streamed_chat  # tests/helpers.py


REPLY = ("The user wants weather.\n</think>\n\nLet me check.\n\n"
         + block("get_weather", city="Paris", unit="c", days="3") + "\n" + block("get_time", zone="cet"))


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_scripted_calls_come_out_as_tool_calls(scripted, choice):
    model, tok, client = scripted
    reply = REPLY if choice == "auto" else REPLY.replace("Let me check.\n\n", "")  # required: calls only
    model.script = tok.encode(reply) + [EOS]
    ask = {"model": "qwen", "messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 400,
           "temperature": 0}
    r = client.chat.completions.create(**ask)
    assert tok.last.endswith("<|im_start|>assistant\n<think>\n")  # Qwen3.5 opens the think block itself
    msg, want = r.choices[0].message, [("get_weather", {"city": "Paris", "unit": "c", "days": 3}),
                                       ("get_time", {"zone": "cet"})]
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == want
    assert msg.content == ("Let me check." if choice == "auto" else None)
    assert msg.model_extra["reasoning_content"] == "The user wants weather.\n"
    s = streamed(client, **ask)
    assert s["finish"] == "tool_calls" and s["content"] == (msg.content or "")
    assert s["reasoning_content"] == "The user wants weather.\n" and sorted(s["calls"]) == [0, 1]
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()] == want


def test_history_with_a_call_reaches_the_template_as_transformers_renders_it(scripted, qwen35):
    model, tok, client = scripted
    model.script = tok.encode("Answer it.\n</think>\n\nIt is 18 C.") + [EOS]
    args = {"city": "Paris", "unit": "c", "days": 2}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    r = client.chat.completions.create(model="qwen", messages=msgs, tools=TOOLS, max_tokens=40, temperature=0)
    assert r.choices[0].message.content == "It is 18 C." and not r.choices[0].message.tool_calls
    oracle = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {
        "name": "get_weather", "arguments": args}}]}, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    assert tok.last == render_jinja_template([oracle], tools=TOOLS, chat_template=qwen35,
                                             add_generation_prompt=True)[0][0]
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>" in tok.last


@pytest.fixture(scope="module")
def random_model(qwen35):
    """The tiny random model behind Qwen3.5's template: whatever it writes, the grammar holds it."""
    tok = LineTokenizer(qwen35)
    cfg = dataclasses.replace(CFG, max_seq_len=CTX)
    model = Llama(cfg, random_weights(cfg, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    with serving(app_for(model, tok)) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def test_required_and_named_calls_always_parse_and_validate(random_model):
    # thinking off: a random model's reasoning would run to max_tokens before any call
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for seed in range(4):
        ask = {"model": "qwen", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "seed": seed,
               "max_tokens": 300, "parallel_tool_calls": False, "extra_body": off, "logit_bias": {str(EOS): -100}}
        r = random_model.chat.completions.create(**ask)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r.choices[0]
        jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])
        s = streamed(random_model, **ask)  # the seeded stream writes the same call
        assert [(c["name"], c["arguments"]) for c in s["calls"].values()] == \
            [(calls[0].function.name, calls[0].function.arguments)]
        named = random_model.chat.completions.create(**{**ask, "tool_choice": {
            "type": "function", "function": {"name": "get_time"}}})
        calls = named.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_time"
        jsonschema.validate(json.loads(calls[0].function.arguments), TIME)
        with pytest.raises(openai.BadRequestError, match="response_format"):
            random_model.chat.completions.create(**ask, response_format={"type": "json_object"})


@pytest.mark.slow
def test_real_vocabulary_writes_parseable_xml_calls(default_gguf, qwen35):
    """The grammar over a real 49k-token BPE vocabulary (the default model's, behind Qwen3.5's template):
    llguidance must let multi-character tokens write the XML's lines, and the calls still parse."""
    from lowbit.runtime.load.loader import load

    lm = load(str(default_gguf), "auto", progress=False)
    tok = lm.tokenizer
    tok.chat_template, tok._template = qwen35, ChatTemplate(qwen35)  # the file's own template swapped out
    engine = Engine(lm.model, tok, EngineConfig(kv_memory=64 << 20, max_num_seqs=2))
    with serving(build_app(Served(AsyncEngine(engine), tok, "m", CTX))) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        for seed in range(2):
            for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
                r = client.chat.completions.create(
                    model="m", messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed, temperature=1.0,
                    max_tokens=120, parallel_tool_calls=False,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
                ch = r.choices[0]
                assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
                c = ch.message.tool_calls[0]
                assert isinstance(choice, str) or c.function.name == "get_time"
                jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
