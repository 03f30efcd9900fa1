"""Qwen3-Coder's XML tool calls (Qwen3-Coder, Qwen3.5), both ways: a call block of the reply → an OpenAI
tool call, and the Lark grammar (llguidance's syntax) that makes the model write one.

The templates (llama.cpp's models/templates/Qwen3.5-4B.jinja and Qwen3-Coder.jinja) ask for

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

and render a call of the history the same way from `arguments` as a mapping (server/tools.py
`history_message` decodes the client's JSON string): a string value as it is, a mapping or a list as
JSON (`tojson`), anything else through Jinja's `string` filter, which spells Python's `True`, `False`,
`None`. Calls follow one another one `\\n` apart.

A parameter's text, less the one `\\n` the template puts at each end, becomes its value by the function's
JSON schema for it:
- a string-only schema (`"type": "string"`, or an enum / const of strings): the text as it is, never
  parsed, so `007` stays "007" and a multi-line value keeps its lines;
- any other schema: the text parsed as JSON (or `True` / `False` / `None`, the template's own spelling),
  kept when its type is one the schema allows (an integral 3.0 counts as an integer); otherwise the text
  itself, so a model that writes `Paris` for an integer hands the client "Paris" to reject, not nothing;
- no schema to go by (a function not among the tools, a parameter its schema does not declare, a
  schema without a type or enum): the JSON value when the text is one, else the text.
A block with no `<function=NAME>`, or anything but whitespace and `<parameter=…>…</parameter>` in the
function, or a parameter left open, is no call: it stays content, whole, as a Hermes call whose JSON
does not parse does (server/reply.py). A name that is not among the tools is still a call, as the Hermes
path passes it on. A missing `</function>` is forgiven (the block's end closes it).

The grammar writes exactly the template's form: the declared parameters in the schema's order (the
order the tool listing shows the model; a fixed order keeps the grammar linear where "each once, in any
order" would need a rule per permutation), each required one once, each optional one at most once; a
string parameter as free text (its minLength / maxLength held; `pattern` is not), an enum or const as one
of its values, a boolean as JSON's `true` / `false` or the template's `True` / `False`, any other as JSON
held to the parameter's schema (llguidance's `%json`; a `$ref` reaches the function schema's `$defs`).
A function whose schema declares no properties may name any parameters, each value free text.
"""

from __future__ import annotations

import json
import re

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION = "<function="
_END_PARAM, _END_FUNCTION = "\n</parameter>\n", "</function>\n"  # as the template closes them
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_PY = {"True": True, "False": False, "None": None}  # Jinja's `string` filter on a bool or None
_TYPE = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
         type(None): "null"}
# the separators OpenAI's JSON mode writes (engine/grammar.py's); strict whitespace keeps a small model
# from wandering into runs of spaces inside a JSON parameter
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def is_qwen_xml(template: str | None) -> bool:
    """Whether a template teaches the XML calls: `<function=` inside its `<tool_call>` (Hermes templates
    put JSON there)."""
    src = template or ""
    return OPEN in src and FUNCTION in src


# ---- reply: a call block → (name, arguments as a JSON object string) -------------------------------

def _type_of(v) -> str:
    return _TYPE.get(type(v), "object")


def schema_types(schema) -> set[str]:
    """The JSON types a schema allows; empty when it says nothing (any value)."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    if "const" in schema:
        return {_type_of(schema["const"])}
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return {_type_of(v) for v in schema["enum"]}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            parts = [schema_types(s) for s in schema[key]]
            return set() if not all(parts) else set().union(*parts)
    return set()


def _allowed(v, types: set[str]) -> bool:
    t = _type_of(v)
    if t == "integer" and "number" in types:
        return True
    if t == "number" and "integer" in types and float(v).is_integer():
        return True
    return t in types


def param_value(raw: str, schema) -> object:
    """One parameter's text (between `<parameter=…>` and `</parameter>`) → its value (the rule above)."""
    text = raw.removeprefix("\n")
    text = text.removesuffix("\n")
    types = schema_types(schema)
    if types == {"string"}:
        return text
    word = text.strip()
    if word in _PY:
        v = _PY[word]
    else:
        try:
            v = json.loads(word)
        except json.JSONDecodeError:
            return text
    return v if not types or _allowed(v, types) else text


def parse_call(body: str, tools: dict[str, dict]) -> tuple[str, str] | None:
    """A block's text between `<tool_call>` and `</tool_call>` → (name, arguments JSON), or None when it
    is not a call. tools: each function's parameters schema, by name."""
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    props = (tools.get(name) or {}).get("properties") or {}
    args, at = {}, 0
    while (p := _PARAM.match(inner, at)) is not None:
        key = p.group(1).strip()
        args[key] = param_value(p.group(2), props.get(key) if isinstance(props, dict) else None)
        at = p.end()
    if inner[at:].strip():
        return None
    return name, json.dumps(args, ensure_ascii=False)


# ---- grammar: what the model may write -------------------------------------------------------------

def _lit(s: str) -> str:
    """A Lark string literal."""
    return json.dumps(s, ensure_ascii=False)


def _text(lo: int = 0, hi: int | None = None) -> str:
    """A lazy regex: free text of lo..hi characters up to the first closing `\\n</parameter>\\n`."""
    n = "*" if lo == 0 and hi is None else f"{{{lo},{'' if hi is None else hi}}}"
    return rf"/(?s:.{n})\n<\/parameter>\n/"


def _param(rule: str, name: str, schema, defs: dict, rules: list[str]) -> str:
    """The rule for one `<parameter=name>…</parameter>\\n`, its value's rule appended to `rules`. defs:
    the function schema's `$defs` / `definitions`, which a parameter's `$ref` points into."""
    head = _lit(f"<parameter={name}>\n")
    schema = schema if isinstance(schema, dict) else {}
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if schema_types(schema) == {"boolean"} and not isinstance(values, list):
        values = ["true", "false", "True", "False"]  # JSON's spelling, or the one the template writes
    if isinstance(values, list) and values:
        alts = " | ".join(_lit(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)) for v in values)
        rules.append(f"{rule}: {head} ({alts}) {_lit(_END_PARAM)}")
    elif schema_types(schema) == {"string"}:
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        rules.append(f"{rule}: {head} {rule}_v")
        rules.append(f"{rule}_v[lazy]: {_text(lo if isinstance(lo, int) else 0, hi if isinstance(hi, int) else None)}")
    else:
        spec = json.dumps({**defs, **schema, "x-guidance": _JSON_OPTIONS}, ensure_ascii=False)
        rules.append(f"{rule}: {head} %json {spec} {_lit(_END_PARAM)}")
    return rule


def _function(i: int, name: str, params: dict, rules: list[str]) -> str:
    """The rule for `<function=name>\\n…</function>\\n`, its parts appended to `rules`."""
    rule = f"fn{i}"
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or ())
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    parts = []
    for j, (p, s) in enumerate(props.items()):
        r = _param(f"{rule}_p{j}", p, s, defs, rules)
        parts.append(r if p in required else f"{r}?")
    if not props and params.get("additionalProperties", True) is not False:
        rules.append(rf'{rule}_any: "<parameter=" /[A-Za-z0-9_.\-]{{1,64}}/ ">\n" {rule}_any_v')
        rules.append(f"{rule}_any_v[lazy]: {_text()}")
        parts.append(f"{rule}_any*")
    rules.append(f"{rule}: {_lit(FUNCTION + name + '>' + chr(10))} {' '.join(parts)} {_lit(_END_FUNCTION)}")
    return rule


def _functions(tools, rules: list[str]) -> str:
    """`tools`: (name, parameters schema) pairs → the rule choosing among their functions."""
    names = [_function(i, n, p, rules) for i, (n, p) in enumerate(tools)]
    rules.append(f"fns: {' | '.join(names)}")
    return "fns"


def call_body(tools) -> str:
    """The Lark grammar of what follows `<tool_call>` in the reply: one call, closed (the lazy grammar
    of tool_choice auto, engine/grammar.py LazyGrammar)."""
    rules: list[str] = []
    fns = _functions(tools, rules)
    return "\n".join([f'start: "\\n" {fns} {_lit(CLOSE)}', *rules])


def calls_grammar(tools, parallel: bool, in_think: bool) -> str:
    """The Lark grammar of a whole reply that must call (tool_choice required, or named with its one
    function in `tools`): call blocks only, several one `\\n` apart when `parallel`. in_think: the prompt
    opened a think block, so the reasoning runs free up to the first `</think>`, then `\\n\\n` (as the
    template writes a history turn) and the calls."""
    rules: list[str] = []
    fns = _functions(tools, rules)
    call = f'{_lit(OPEN + chr(10))} {fns} {_lit(CLOSE)}'
    start = f"start: {'think ' if in_think else ''}call{' more*' if parallel else ''}"
    extra = [r"think[lazy]: /(?s:.*)<\/think>\n\n/"] if in_think else []
    return "\n".join([start, f"call: {call}", *(['more: "\\n" call'] if parallel else []), *extra, *rules])
