"""The reply parser (runtime/server/reply.py) on hand-written replies: each format's calls and
content, reasoning split out, and the same pieces whether the reply comes whole or a character at
a time (as a stream does)."""

from __future__ import annotations

import json

import pytest

from lowbit.runtime.server.reply import THINK_TAGS, ReplyParser, think_tags

THINK = THINK_TAGS[0]  # <think> </think>


def parse(text: str, mode, step: int | None = None, **kw) -> tuple[str, str, list]:
    """(content, reasoning, calls) of `text` fed whole, or `step` characters at a time."""
    p = ReplyParser(mode, **kw)
    pieces = []
    for i in range(0, len(text), step or max(len(text), 1)):
        pieces += p.feed(text[i:i + (step or len(text))])
    pieces += p.finish()
    content = "".join(v for k, v in pieces if k == "content")
    reasoning = "".join(v for k, v in pieces if k == "reasoning")
    calls = [(n, json.loads(a)) for k, (n, a) in ((k, v) for k, v in pieces if k == "call")] if pieces else []
    return content, reasoning, calls


CASES = [
    # mode, reply, content, calls
    (None, "just text <tool_call>{}</tool_call>", "just text <tool_call>{}</tool_call>", []),
    ("hermes", 'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
     "Sure.", [("f", {"x": 1})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": '
               '{"y": "a"}}</tool_call>', "", [("f", {}), ("g", {"y": "a"})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}', "", [("f", {"x": 1})]),  # ended before the close
    ("hermes", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ("hermes", "a < b and <tool", "a < b and <tool", []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 2}}', "", [("f", {"x": 2})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"z": null}}',
     "", [("f", {}), ("g", {"z": None})]),
    ("llama3_json", "  The answer is {not a call}", "  The answer is {not a call}", []),
    ("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {"x": 3}}]', "ok ", [("f", {"x": 3})]),
    ("mistral", '[{"name": "f", "arguments": {"x": 3}}]', "", [("f", {"x": 3})]),  # the marker was dropped
    ("mistral", "[1, 2] is a list", "[1, 2] is a list", []),
    ("generic", '{"response": "Hi \\"there\\" \\u00e9\\n"}', 'Hi "there" \u00e9\n', []),
    ("generic", '{"tool_calls": [{"name": "f", "arguments": {"a": [1, 2]}}]}', "", [("f", {"a": [1, 2]})]),
    ("required", '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": true}}]', "",
     [("f", {}), ("g", {"b": True})]),
]


@pytest.mark.parametrize("mode,reply,content,calls", CASES)
@pytest.mark.parametrize("step", [None, 1, 3])
def test_formats_whole_and_streamed(mode, reply, content, calls, step):
    assert parse(reply, mode, step)[::2] == (content, calls)


@pytest.mark.parametrize("step", [None, 1, 2])
def test_named_reply_is_the_arguments(step):
    assert parse('{"city": "Paris"}', "named", step, named="weather") == ("", "", [("weather", {"city": "Paris"})])


def test_generic_answer_streams_before_the_reply_ends():
    p = ReplyParser("generic")
    assert p.feed('{"response": "Hel') == [("content", "Hel")]
    assert p.feed('lo \\u00') == [("content", "lo ")]  # an escape still incomplete is held
    assert p.feed('e9"}') == [("content", "\u00e9")]
    assert p.finish() == []


def test_cut_off_constrained_reply_is_content():
    assert parse('[{"name": "f", "argu', "required") == ('[{"name": "f", "argu', "", [])


@pytest.mark.parametrize("step", [None, 1, 4])
def test_reasoning_split(step):
    text = "<think>\nweigh it\n</think>\n\nThe answer."
    assert parse(text, None, step, think=THINK) == ("The answer.", "\nweigh it\n", [])
    # the prompt opened the block (DeepSeek-R1's template): everything up to </think> is reasoning
    assert parse("hmm</think>Yes", None, step, think=THINK, in_think=THINK) == ("Yes", "hmm", [])
    # without think tags in the template, the tags are content
    assert parse(text, None, step) == (text, "", [])
    # reasoning then a call
    assert parse('<think>x</think><tool_call>{"name": "f", "arguments": {}}</tool_call>', "hermes", step,
                 think=THINK) == ("", "x", [("f", {})])


@pytest.mark.parametrize("step", [None, 1, 3])
def test_mistral_think_tags(step):
    """Mistral's reasoning models ([THINK]…[/THINK]), found in their template's text."""
    tags = think_tags("...{{- '[THINK]' + block['thinking'] + '[/THINK]' }}...")
    assert tags == ("[THINK]", "[/THINK]") and think_tags("{{ '<think>' }}") == THINK and think_tags("plain") is None
    assert parse("[THINK]weigh it[/THINK]The answer.", None, step, think=tags) == ("The answer.", "weigh it", [])
    assert parse("<think>x</think>y", None, step, think=tags) == ("<think>x</think>y", "", [])


def test_unfinished_think_prefix_is_content():
    assert parse("<thi", None, think=THINK) == ("<thi", "", [])
    assert parse("<think>never closed", None, think=THINK) == ("", "never closed", [])
