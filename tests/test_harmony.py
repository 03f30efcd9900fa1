"""gpt-oss's harmony format (runtime/server/harmony.py): replies parsed into reasoning, content and tool
calls, whole and a character at a time; the history rendered by gpt-oss's real template (llama.cpp's
copy) the way the format describes; and the whole route through the server, judged by the `openai`
client and Ollama's /api/chat, over a model that writes a scripted harmony reply token by token.

The oracle is hand-written transcripts from OpenAI's description of the format (the gpt-oss model card
and the `openai-harmony` package's docs). The `openai-harmony` package itself cannot serve: its
encoding downloads the o200k tiktoken vocabulary at load and checks its sha256, and this machine
cannot fetch it ("error downloading or loading vocab file").
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime

import httpx
import openai
import pytest
import torch

from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import AsyncEngine, Engine
from lowbit.runtime.load.tokenizer import Tokenizer, gpt2_byte_decoder
from lowbit.runtime.server.app import Served, build_app
from lowbit.runtime.server.harmony import HarmonyParser, is_harmony
from lowbit.runtime.server.request import RequestParser
from lowbit.runtime.server.tools import template_format
from tests import llama_cpp_source
from tests.helpers import serving, streamed_chat
from tests.test_server import CFG

# the harmony markers, special tokens of gpt-oss's tokenizer (o200k_harmony)
SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
            "<|endoftext|>")
CTX = 4096  # gpt-oss's system and developer messages with two tools: ~900 byte tokens

# ---- the reply parser on hand-written transcripts ---------------------------------------------------

REASONED = ("<|channel|>analysis<|message|>The user asks for 2+2. Simple.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
# the recipient after the channel, with <|constrain|> (the model card's example of a reply)
CALL = ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city":"Paris"}<|call|>')
# the recipient in the role part and a bare `json` (as gpt-oss's template writes calls into the history)
CALL_IN_ROLE = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Tokyo", "unit": "c"}<|call|>'
# several calls in one reply (the engine stops at <|call|>; with ignore_eos the model goes on), a preamble
# on the commentary channel before them, reasoning in between
SEVERAL = ("<|channel|>commentary<|message|>Checking both.<|end|>"
           '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
           '{"city":"Paris"}<|call|>'
           "<|start|>assistant<|channel|>analysis<|message|>Now the time.<|end|>"
           '<|start|>assistant to=functions.get_time<|channel|>commentary <|constrain|>json<|message|>'
           '{"zone":"cet"}<|call|>')

CASES = [
    # reply, tools offered, (content, reasoning, calls)
    (REASONED, False, ("2 + 2 = 4.", "The user asks for 2+2. Simple.", [])),
    (REASONED, True, ("2 + 2 = 4.", "The user asks for 2+2. Simple.", [])),
    (CALL, True, ("", "Need to use function get_weather.", [("get_weather", {"city": "Paris"})])),
    (CALL_IN_ROLE, True, ("", "", [("get_weather", {"city": "Tokyo", "unit": "c"})])),
    (SEVERAL, True, ("Checking both.", "Now the time.", [("get_weather", {"city": "Paris"}),
                                                         ("get_time", {"zone": "cet"})])),
    # no tools offered: a call is no call, its message is content, written out whole
    (CALL, False, (('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                    '{"city":"Paris"}'), "Need to use function get_weather.", [])),
    # arguments that are no JSON object: content, whole
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>[1, 2]<|call|>", True,
     ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>[1, 2]", "", [])),
    # a built-in tool this server does not run
    ("<|channel|>analysis to=python code<|message|>print(1)<|call|>", True,
     ("<|channel|>analysis to=python code<|message|>print(1)", "", [])),
    # cut off by max_tokens: inside the final body, and inside the next header (no message yet: nothing)
    ("<|channel|>final<|message|>It is 4 <|en", False, ("It is 4 <|en", "", [])),
    ("<|channel|>analysis<|message|>Sure.<|end|><|start|>assistant<|channel|>fin", False, ("", "Sure.", [])),
    # a reply in no harmony at all (a fine-tune that forgot it): content
    ("Plain words, a <| and to= inside.", False, ("Plain words, a <| and to= inside.", "", [])),
    # text between messages: blank lines belong to nobody
    ("<|channel|>analysis<|message|>a<|end|>\n\n<|start|>assistant<|channel|>final<|message|>b", False,
     ("b", "a", [])),
]


def parse(reply: str, calls: bool, step: int | None) -> tuple[str, str, list]:
    """(content, reasoning, calls) of `reply` fed whole (step None) or `step` characters at a time."""
    p, pieces = HarmonyParser(calls), []
    step = step or len(reply)
    for i in range(0, len(reply), step):
        pieces += p.feed(reply[i:i + step])
    pieces += p.finish()
    def text(kind: str) -> str:
        return "".join(v for k, v in pieces if k == kind)

    return text("content"), text("reasoning"), [(v[0], json.loads(v[1])) for k, v in pieces if k == "call"]


@pytest.mark.parametrize("reply,calls,expected", CASES)
@pytest.mark.parametrize("step", [None, 1, 3])
def test_reply_parsed_whole_and_streamed(reply, calls, expected, step):
    assert parse(reply, calls, step) == expected


def test_streamed_reasoning_is_released_before_the_message_closes():
    p = HarmonyParser(False)
    assert p.feed("<|channel|>analysis<|message|>") == []
    assert p.feed("Think") == [("reasoning", "Think")]
    assert p.feed("ing <|e") == [("reasoning", "ing ")]  # "<|e" may be the start of <|end|>: held
    assert p.feed("nd|>") == []


# ---- the history through gpt-oss's real template ----------------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
ASKED = [{"role": "system", "content": "Answer briefly."},
         {"role": "user", "content": "Weather in Paris and the time in CET?"},
         # two calls in one message, a preamble and the reasoning beside them; the results out of order
         {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two tools needed.",
          "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": '{"city":"Paris"}'}},
                         {"id": "c2", "type": "function", "function": {"name": "get_time",
                                                                       "arguments": '{"zone":"cet"}'}}]},
         {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
         {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "sunny"}'}]
ANSWERED = ASKED + [{"role": "assistant", "content": "Sunny; 14:05.", "reasoning_content": "Both known."},
                    {"role": "user", "content": "Thanks!"}]


def system_message(effort: str) -> str:
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            "Knowledge cutoff: 2024-06\n"
            f"Current date: {datetime.now().strftime('%Y-%m-%d')}\n\n"
            f"Reasoning: {effort}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
            "Calls to these tools must go to the commentary channel: 'functions'.<|end|>")


DEVELOPER = ("<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n# Tools\n\n## functions\n\n"
             "namespace functions {\n\n"
             "// Weather in a city\ntype get_weather = (_: {\ncity: string,\nunit?: \"c\" | \"f\",\n}) => any;\n\n"
             "// Time in a zone\ntype get_time = (_: {\nzone: \"utc\" | \"cet\",\n}) => any;\n\n"
             "} // namespace functions<|end|>")
# Each call its own message, followed by its result. The real template writes the recipient in the role
# part (the format allows either place) and departs from the format's description twice, kept since the
# template is the model's own: a bare `json` where the description writes `<|constrain|>json`, and a tool's
# output written as a JSON string.
ROUND_TRIP = ("<|start|>user<|message|>Weather in Paris and the time in CET?<|end|>"
              '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
              '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"sky\\": \\"sunny\\"}"<|end|>'
              '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "cet"}<|call|>'
              '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"14:05"<|end|>')
# While the calls are still running, the reasoning that led to them is kept, before the first call ...
WHILE_CALLING = ROUND_TRIP.replace(
    "<|start|>assistant to=functions.get_weather",
    "<|start|>assistant<|channel|>analysis<|message|>Two tools needed.<|end|><|start|>assistant to=functions.get_weather",
    1) + "<|start|>assistant"
# ... once a final answer follows, every earlier turn's reasoning is dropped
AFTER_ANSWER = (ROUND_TRIP + "<|start|>assistant<|channel|>final<|message|>Sunny; 14:05.<|end|>"
                "<|start|>user<|message|>Thanks!<|end|><|start|>assistant")


@pytest.fixture(scope="module")
def gpt_oss_template() -> str:
    path = llama_cpp_source.converter_dir() / "models" / "templates" / "openai-gpt-oss-120b.jinja"
    return path.read_text(encoding="utf-8")


def harmony_tokenizer(template: str, folder) -> Tokenizer:
    """A byte-level BPE vocabulary (token i < 256 is byte i) plus the harmony markers as special tokens,
    with gpt-oss's tokenizer_config (eos_token <|return|>) and its template, loaded as users' are."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HF

    byte_of = gpt2_byte_decoder()  # the character that stands for each byte → the byte
    hf = HF(models.BPE(vocab={ch: b for ch, b in byte_of.items()}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}))
    return Tokenizer.from_hf_dir(folder)


def test_tokenizer_ends_at_return_and_call_not_end(gpt_oss_template, tmp_path):
    tok = harmony_tokenizer(gpt_oss_template, tmp_path)
    ids = {s: tok.encode(s, add_special=False) for s in SPECIALS}
    assert all(len(v) == 1 for v in ids.values())  # each marker is one special token
    assert {ids["<|return|>"][0], ids["<|call|>"][0]} <= tok.eos_ids and ids["<|end|>"][0] not in tok.eos_ids


@pytest.mark.parametrize("history,effort,expected", [(ASKED, "high", WHILE_CALLING), (ANSWERED, "low", AFTER_ANSWER)],
                         ids=["while-calling", "after-answer"])
def test_history_renders_as_the_format_describes(gpt_oss_template, tmp_path, history, effort, expected):
    assert is_harmony(gpt_oss_template) and template_format(gpt_oss_template) == "harmony"
    tok = harmony_tokenizer(gpt_oss_template, tmp_path)
    parsed = RequestParser(tok, "gpt-oss", CTX).chat(
        {"messages": history, "tools": TOOLS, "reasoning_effort": effort})
    assert tok.decode(parsed.prompt_ids) == system_message(effort) + DEVELOPER + expected
    assert parsed.harmony and all(not p.skip_special_tokens for p in parsed.params)


# ---- the whole route: a model that writes a scripted reply ------------------------------------------

class ScriptedTokenizer(Tokenizer):
    """The harmony tokenizer, remembering the last prompt it rendered and its length."""

    def encode_chat(self, messages, add_generation_prompt=True, **kw):
        ids = super().encode_chat(messages, add_generation_prompt, **kw)
        self.prompt_len, self.last = len(ids), self.decode(ids)
        return ids


class ScriptedModel(Llama):
    """The tiny random model, its logits replaced by the scripted reply: position p of a request asks
    for reply token p + 1 - prompt length (one request at a time)."""

    def forward_paged(self, tokens, batch, pool, exact=None):
        logits = super().forward_paged(tokens, batch, pool, exact)  # [R, V]: the pool written as usual
        forced = torch.full_like(logits, -1e4)
        for r, row in enumerate(batch.logits_rows.tolist()):
            k = int(batch.positions[row]) + 1 - self.tok.prompt_len
            forced[r, self.script[min(k, len(self.script) - 1)]] = 0.0
        return forced


@pytest.fixture(scope="module")
def scripted(gpt_oss_template, tmp_path_factory):
    folder = tmp_path_factory.mktemp("harmony-tokenizer")
    harmony_tokenizer(gpt_oss_template, folder)
    tok = ScriptedTokenizer.from_hf_dir(folder)
    cfg = dataclasses.replace(CFG, vocab_size=tok.vocab_size, max_seq_len=CTX)
    model = ScriptedModel(cfg, random_weights(cfg, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    model.tok = tok
    engine = Engine(model, tok, EngineConfig(kv_memory=16 << 20, max_num_seqs=2))
    with serving(build_app(Served(AsyncEngine(engine), tok, "gpt-oss", CTX))) as base:
        yield model, tok, base, openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def script(model, tok, reply: str) -> None:
    """The model will write `reply` (its closing <|return|> or <|call|> an end token) and then stop."""
    model.script = tok.encode(reply, add_special=False)


_stream = streamed_chat  # tests/helpers.py


def test_chat_reasoning_and_content(scripted):
    model, tok, _, client = scripted
    script(model, tok, REASONED)
    ask = {"model": "gpt-oss", "messages": [{"role": "user", "content": "2+2?"}], "temperature": 0,
           "reasoning_effort": "high"}
    m = client.chat.completions.create(**ask).choices[0]
    assert "Reasoning: high" in tok.last and tok.last.endswith("<|start|>user<|message|>2+2?<|end|><|start|>assistant")
    # no marker leaks into the text, and <|return|> ended the reply
    assert (m.message.content, m.message.reasoning_content, m.finish_reason) == \
           ("2 + 2 = 4.", "The user asks for 2+2. Simple.", "stop")
    assert _stream(client, **ask) == {"content": "2 + 2 = 4.", "reasoning_content": "The user asks for 2+2. Simple.",
                                      "calls": {}, "finish": "stop"}


def test_chat_tool_call(scripted):
    model, tok, _, client = scripted
    script(model, tok, CALL)
    ask = {"model": "gpt-oss", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
           "temperature": 0}
    m = client.chat.completions.create(**ask).choices[0]
    assert "type get_weather = (_: {" in tok.last  # the tools reached the template
    assert m.finish_reason == "tool_calls" and m.message.reasoning_content == "Need to use function get_weather."
    assert not m.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.message.tool_calls] == \
           [("get_weather", {"city": "Paris"})]
    s = _stream(client, **ask)
    assert (s["content"], s["reasoning_content"], s["finish"]) == ("", "Need to use function get_weather.",
                                                                    "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()] == [("get_weather", {"city": "Paris"})]
    # the call and its result sent back render as the template writes them
    history = ask["messages"] + [m.message.model_dump(exclude_none=True),
                                 {"role": "tool", "tool_call_id": m.message.tool_calls[0].id, "content": "18 C"}]
    script(model, tok, "<|channel|>final<|message|>18 C in Paris.<|return|>")
    again = client.chat.completions.create(**{**ask, "messages": history}).choices[0].message
    assert again.content == "18 C in Paris."
    assert tok.last.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C"<|end|><|start|>assistant')


def test_ollama_chat_thinking_and_level(scripted):
    model, tok, base, _ = scripted
    script(model, tok, REASONED)
    ask = {"model": "gpt-oss", "messages": [{"role": "user", "content": "2+2?"}], "think": "low",
           "options": {"temperature": 0}}
    r = httpx.post(base + "/api/chat", json={**ask, "stream": False}, timeout=120).json()
    assert "Reasoning: low" in tok.last
    assert (r["message"]["content"], r["message"]["thinking"], r["done_reason"]) == \
           ("2 + 2 = 4.", "The user asks for 2+2. Simple.", "stop")
    lines = [json.loads(x) for x in httpx.post(base + "/api/chat", json=ask, timeout=120).text.splitlines()]
    assert "".join(x["message"].get("thinking", "") for x in lines) == "The user asks for 2+2. Simple."
    assert "".join(x["message"]["content"] for x in lines) == "2 + 2 = 4." and lines[-1]["done"]
    caps = httpx.post(base + "/api/show", json={"model": "gpt-oss"}, timeout=30).json()["capabilities"]
    assert "thinking" in caps


def test_responses_reasoning_effort_and_items(scripted):
    model, tok, _, client = scripted
    script(model, tok, REASONED)
    r = client.responses.create(model="gpt-oss", input="2+2?", reasoning={"effort": "medium"}, temperature=0)
    assert "Reasoning: medium" in tok.last
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "The user asks for 2+2. Simple." and r.output_text == "2 + 2 = 4."
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="gpt-oss", input="hi", reasoning={"effort": "extreme"})
    assert e.value.body["param"] == "reasoning"
