"""Closed tool arguments (engine/grammar.py `closed`) and a request's own grammar (server/user_grammar.py):
what the grammars accept, judged by llguidance's matcher over a byte vocabulary, and the 400s."""

from __future__ import annotations

import pytest

from lowbit.runtime.engine.grammar import GrammarCompiler, GrammarError, closed, user_lark
from lowbit.runtime.server.errors import APIError
from lowbit.runtime.server.tools import parse_tools, reply_schema
from lowbit.runtime.server.user_grammar import user_grammar
from tests.helpers import ByteTokenizer


class Tok(ByteTokenizer):
    """The byte tokenizer with the encoder llguidance asks for text the grammar forces."""

    def encode(self, text: str, add_special: bool = True, limit=None) -> list[int]:
        return [min(max(ord(ch) - 32, 0), 99) for ch in text]


def accepts(grammar, text: str) -> bool:
    """Whether the grammar (a JSON schema, or Lark text) lets the model write exactly `text` and end."""
    tok = Tok()
    compiler = GrammarCompiler(tok)
    g = compiler.compile_lark(grammar) if isinstance(grammar, str) else compiler.compile(grammar)
    for t in tok.encode(text):
        if not g.allowed()[t]:
            return False
        g.accept(t)
    return bool(g.allowed()[100])


OPEN = {"type": "object", "properties": {"name": {"type": "string"},
                                         "where": {"type": "object", "properties": {"city": {"type": "string"}}},
                                         "tags": {"type": "array", "items": {"type": "object"}}},
        "required": ["name"]}


def test_closed_objects_admit_only_declared_properties():
    assert accepts(OPEN, '{"name": "a", "price": 3}')  # JSON Schema's default: open
    c = closed(OPEN)
    assert accepts(c, '{"name": "a", "where": {"city": "b"}, "tags": [{}]}')
    assert not accepts(c, '{"name": "a", "price": 3}')
    assert not accepts(c, '{"name": "a", "where": {"city": "b", "zip": 1}}')  # nested too
    assert not accepts(c, '{"name": "a", "tags": [{"x": 1}]}')  # and in items
    assert OPEN["properties"]["where"].get("additionalProperties") is None  # the caller's schema untouched


def test_closed_keeps_what_a_schema_says_and_reaches_defs_and_branches():
    said = {"type": "object", "additionalProperties": True,
            "properties": {"m": {"type": "object", "additionalProperties": {"type": "integer"}}}}
    assert closed(said) == said
    s = closed({"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                "anyOf": [{"$ref": "#/$defs/P"}, {"type": "object", "properties": {"y": {"type": "integer"}}}]})
    assert accepts(s, '{"x": 1}') and accepts(s, '{"y": 2}') and not accepts(s, '{"x": 1, "z": 3}')


def test_closed_all_of_admits_every_branch_names():
    """JSON Schema's additionalProperties sees only sibling properties: closing each allOf branch would
    admit no property at all, so the branches stay open and their parent admits all their names."""
    s = closed({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                          {"type": "object", "properties": {"b": {"type": "integer"}}}]})
    assert accepts(s, '{"a": 1, "b": 2}') and accepts(s, '{"a": 1}')
    assert not accepts(s, '{"a": 1, "c": 3}') and not accepts(s, '{"a": "x"}')
    # an object's own anyOf branches describe it too: the same
    s = closed({"type": "object", "properties": {"k": {"type": "string"}},
                "anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                          {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]})
    assert accepts(s, '{"k": "x", "a": 1}') and accepts(s, '{"b": 2}') and not accepts(s, '{"b": 2, "c": 3}')


def test_tool_calls_are_closed_and_the_prompt_shows_the_schema_as_sent():
    tools = [{"type": "function", "function": {"name": "book", "parameters": OPEN}}]
    named = parse_tools({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "book"}}}, None)
    assert not accepts(named.schema, '{"name": "a", "price": 3}') and accepts(named.schema, '{"name": "a"}')
    required = parse_tools({"tools": tools, "tool_choice": "required"}, None)
    assert not accepts(reply_schema(required), '[{"name": "book", "arguments": {"name": "a", "food": "b"}}]')
    assert required.tools[0].openai()["function"]["parameters"] == OPEN


@pytest.mark.parametrize("strict", [True, False, None])
def test_response_format_closes_objects_only_when_strict(strict):
    """OpenAI's semantics: strict true holds the reply to the declared properties; otherwise the schema
    is read as written (JSON Schema: open)."""
    spec = {"name": "r", "schema": OPEN, **({} if strict is None else {"strict": strict})}
    schema = GrammarCompiler.schema_of({"type": "json_schema", "json_schema": spec})
    assert accepts(schema, '{"name": "a", "price": 3}') is (strict is not True)


@pytest.mark.parametrize("kind, value, good, bad", [
    ("regex", r"\d{3}-\d{4}", "555-1234", "555-12345"),
    ("choice", ["yes", "no", 'a "quoted" one'], 'a "quoted" one', "maybe"),
    ("grammar", 'root ::= ("yes" | "no") " " [0-9]', "no 7", "no 77"),  # GBNF, as llama.cpp writes it
    ("grammar", 'start: "Answer: " WORD\nWORD: /[a-z]{1,8}/', "Answer: paris", "Answer: Paris"),  # Lark
])
def test_user_lark_holds_the_output(kind, value, good, bad):
    lark = user_lark(kind, value)
    assert accepts(lark, good) and not accepts(lark, bad)


@pytest.mark.parametrize("kind, value, says", [
    ("regex", "[0-9", "unclosed character class"),
    ("regex", "", "non-empty"),
    ("choice", [], "non-empty list"),
    ("choice", ["a", 1], "non-empty list"),
    ("grammar", "root ::= undefined", "Rule 'undefined' not found"),
    ("grammar", 'root ::= "open', "Unexpected end of input"),
    ("grammar", 'start: "a" b', 'unknown name: "b"'),
])
def test_user_lark_refuses_on_one_line(kind, value, says):
    with pytest.raises(GrammarError) as e:
        user_lark(kind, value)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "(", "grammar": "root ::= \"a\""}, "grammar"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar"),
    ({"grammar": "root ::= nothing"}, "grammar"),
])
def test_user_grammar_errors_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        user_grammar(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert "\n" not in e.value.message


def test_user_grammar_reads_each_spelling():
    assert user_grammar({}) is None
    assert user_grammar({"structured_outputs": {"regex": "ab", "json": None}}).lark == "start: /ab/"
    assert user_grammar({"guided_choice": ["a"]}).lark == 'start: "a"'
    assert user_grammar({"structured_outputs": {"json_object": True}}).schema == {"type": "object"}
    assert user_grammar({"guided_json": '{"type": "integer"}'}).schema == {"type": "integer"}
    strict = user_grammar({"structured_outputs": {"json": OPEN, "disable_additional_properties": True}})
    assert strict.param == "structured_outputs" and strict.schema == closed(OPEN)
    assert "start:" in user_grammar({"grammar": 'root ::= "a"'}).lark
