"""Tool calling, request side: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls` checked, the
history's tool messages made renderable, and the plan for the reply: which format the model writes
calls in, and the JSON schema that constrains it when the reply must parse.

Formats (how the model's own template teaches it to call):
- `hermes`: `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Hermes, Qwen2.5, Qwen3);
- `qwen3_xml`: `<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n…</function>\n</tool_call>`
  (Qwen3-Coder, Qwen3.5; server/qwen_xml.py reads it and writes its grammar);
- `llama3_json`: a bare `{"name": …, "parameters": {…}}` reply, optionally after `<|python_tag|>`
  (Llama 3.1-3.3);
- `mistral`: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`;
- `harmony`: gpt-oss's messages, a call being one to `functions.NAME` on the commentary channel
  (server/harmony.py, which also reads the reply);
- `generic`: templates that know nothing of tools (the default model's): the tools are described in
  a system message and the whole reply is JSON, either `{"tool_calls": [{"name", "arguments"}, …]}`
  or `{"response": "…"}`, constrained by the grammar so that it always parses (llama.cpp's
  "Generic" format).

`required` and a named function are constrained in every format (as vLLM does it): the reply is a
JSON list of calls (`required`) or the function's arguments object (named), so every call parses and
its arguments match the function's schema. `qwen3_xml` is the exception: its grammar writes the
calls in the template's own XML (`reply_grammar`), since a JSON reply is nothing that model was taught.
`auto` in a native format is free text until the model opens a call, then the call is held to the
schemas (`lazy_grammar`); the reply parser (server/reply.py) finds the calls in the text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

from lowbit.runtime.engine.grammar import closed
from lowbit.runtime.server.errors import bad_request
from lowbit.runtime.server.harmony import is_harmony
from lowbit.runtime.server.qwen_xml import call_body, calls_grammar, is_qwen_xml

FORMATS = ("hermes", "qwen3_xml", "llama3_json", "mistral", "harmony", "generic")
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule for function names (fullmatch: `$` allows a final \n)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema of type object

    @property
    def arguments(self) -> dict:
        """The schema a call's arguments are held to: the parameters closed (OpenAI's strict mode), so
        the model writes only the properties declared; the prompt still shows the parameters as sent."""
        return closed(self.parameters)

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                  "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request with tools asks of the reply."""

    tools: tuple[Tool, ...]
    choice: str  # "auto" | "required" | "named" | "none"
    named: str | None  # the function tool_choice names
    parallel: bool  # several calls in one reply allowed
    format: str  # FORMATS
    schema: dict | None = field(default=None)  # the constraint on the whole reply; None: unconstrained

    @property
    def mode(self) -> str | None:
        """How the reply parser reads the reply: the constrained JSON shapes, the format's text, or
        (tool_choice none) None: plain content."""
        if self.choice == "none":
            return None
        if self.format == "qwen3_xml":  # its grammar writes XML calls whatever the choice: read as text
            return self.format
        if self.choice == "named":
            return "named"
        if self.choice == "required":
            return "required"
        return self.format


def template_format(template: str | None) -> str:
    """The tool-call format a chat template teaches, from its source text."""
    src = template or ""
    if is_harmony(src):
        return "harmony"
    if "<tool_call>" in src:
        return "qwen3_xml" if is_qwen_xml(src) else "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|python_tag|>" in src or ("ipython" in src and "parameters" in src):
        return "llama3_json"
    return "generic"


def parse_tools(body: dict, template: str | None) -> ToolPlan | None:
    """The request's tool plan; None when it sends no tools. Raises a 400 naming the param."""
    tools = body.get("tools")
    if tools is None and body.get("functions") is not None:  # the deprecated spelling
        tools = [{"type": "function", "function": f} for f in body["functions"]] \
            if isinstance(body["functions"], list) else body["functions"]
    choice = body.get("tool_choice", body.get("function_call"))
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    parsed, seen = [], set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'", "tools")
        if name in seen:
            raise bad_request(f"tools[{i}].function.name {name!r} is defined twice", "tools")
        seen.add(name)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema of type object", "tools")
        desc = f.get("description", "")
        if not isinstance(desc, str):
            raise bad_request(f"tools[{i}].function.description must be a string", "tools")
        parsed.append(Tool(name, desc, {"type": "object", **params}))
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else choice.get("name")
        if named not in seen:
            raise bad_request(f"tool_choice names a function that is not in tools: {named!r}", "tool_choice")
        choice = "named"
    elif choice not in ("auto", "none", "required"):
        raise bad_request("tool_choice must be 'auto', 'none', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    plan = ToolPlan(tuple(parsed), choice, named, parallel, template_format(template))
    return replace(plan, schema=reply_schema(plan))


def _call_schema(t: Tool, args_key: str = "arguments") -> dict:
    return {"type": "object", "properties": {"name": {"const": t.name}, args_key: t.arguments},
            "required": ["name", args_key], "additionalProperties": False}


def _calls_schema(tools: tuple[Tool, ...], parallel: bool) -> dict:
    items = _call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [_call_schema(t) for t in tools]}
    return {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def reply_schema(plan: ToolPlan) -> dict | None:
    """The JSON schema the whole reply is held to, or None when the reply is free text."""
    if plan.choice == "none" or plan.format == "qwen3_xml":  # qwen3_xml: reply_grammar's Lark instead
        return None
    if plan.choice == "named":
        return next(t for t in plan.tools if t.name == plan.named).arguments
    if plan.choice == "required":
        return _calls_schema(plan.tools, plan.parallel)
    if plan.format == "generic":
        calls = {"type": "object", "properties": {"tool_calls": _calls_schema(plan.tools, plan.parallel)},
                 "required": ["tool_calls"], "additionalProperties": False}
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        return {"anyOf": [answer, calls]}
    return None


def lazy_grammar(plan: ToolPlan) -> tuple[str, str] | None:
    """(trigger, Lark grammar of what follows it) for `auto` in a native format: free text until the
    model opens a call, then the call held to the functions' schemas. None where the reply is
    constrained whole, free, or the format has no opening marker (a bare Llama 3 JSON reply)."""
    if plan.choice != "auto" or plan.format in ("generic", "harmony"):  # harmony: the call has no fixed opening
        return None
    if plan.format == "qwen3_xml":
        return "<tool_call>", call_body([(t.name, t.arguments) for t in plan.tools])
    one = {"anyOf": [_call_schema(t) for t in plan.tools]}
    if plan.format == "hermes":
        return "<tool_call>", f'start: "\\n"? call "\\n"? "</tool_call>"\ncall: %json {json.dumps(one)}'
    if plan.format == "mistral":
        return "[TOOL_CALLS]", f"start: calls\ncalls: %json {json.dumps(_calls_schema(plan.tools, plan.parallel))}"
    params = {"anyOf": [_call_schema(t, "parameters") for t in plan.tools]}
    return "<|python_tag|>", f"start: call\ncall: %json {json.dumps(params)}"


def reply_grammar(plan: ToolPlan | None, in_think: bool) -> str | None:
    """The Lark grammar the whole reply is held to where a JSON schema cannot say it: qwen3_xml's
    required and named calls, in the template's XML (after the reasoning when the prompt opened a think
    block: `in_think`). None elsewhere."""
    if plan is None or plan.format != "qwen3_xml" or plan.choice not in ("required", "named"):
        return None
    tools = [(t.name, t.arguments) for t in plan.tools if plan.choice == "required" or t.name == plan.named]
    return calls_grammar(tools, plan.parallel and plan.choice == "required", in_think)


def generic_prompt(plan: ToolPlan) -> str:
    """The system text that teaches a template without tool support what it may call and how."""
    tools = json.dumps([t.openai()["function"] for t in plan.tools], ensure_ascii=False)
    if plan.choice == "auto":
        how = ('Answer with one JSON object: either {"response": "<your answer>"} to reply to the user, or '
               '{"tool_calls": [{"name": "<tool name>", "arguments": {...}}]} to call tools. When a tool_response '
               'already answers the question, reply to the user.')
    else:
        how = 'Answer with a JSON list of tool calls: [{"name": "<tool name>", "arguments": {...}}].'
    return f"You can call these tools:\n{tools}\n{how}"


def prompt_messages(messages: list[dict], plan: ToolPlan | None) -> tuple[list[dict], list[dict] | None]:
    """(the messages to render, the `tools` to hand the template). A native format hands the
    template the tools; the generic one describes them in a system message and writes earlier calls
    as the JSON it asks the model for."""
    if plan is None or plan.choice == "none":
        return [_plain_calls(m) for m in messages] if plan and plan.format == "generic" else messages, None
    if plan.format != "generic" and (plan.choice == "auto" or plan.format == "qwen3_xml"):
        return messages, [t.openai() for t in plan.tools]  # qwen3_xml: the grammar, not a prompt, makes it call
    out = [_plain_calls(m) for m in messages] if plan.format == "generic" else list(messages)
    text = generic_prompt(plan)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, [t.openai() for t in plan.tools] if plan.format != "generic" else None


def _plain_calls(m: dict) -> dict:
    """A message as the generic format writes it for a template that knows no tools: an assistant's
    tool_calls as the JSON the model is asked for, a tool result as a user turn holding a
    `tool_response` object (llama.cpp's generic format does the same)."""
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and calls:
        text = json.dumps({"tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                          for c in calls]}, ensure_ascii=False)
        return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
    if m["role"] == "tool":
        result = {"tool_response": {k: v for k, v in (("name", m.get("name")), ("id", m.get("tool_call_id")),
                                                      ("content", m["content"])) if v is not None}}
        return {"role": "user", "content": json.dumps(result, ensure_ascii=False)}
    return m


def history_message(i: int, m: dict) -> dict:
    """The tool fields of one incoming message, checked: an assistant's `tool_calls` (arguments
    decoded from their JSON string, as templates read them) and a tool message's `tool_call_id`."""
    out = {}
    if m["role"] == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(f"messages[{i}].tool_calls[{j}] must have function.name", "messages")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                                      "messages") from None
            out["tool_calls"].append({"id": c.get("id", f"call_{i}_{j}"), "type": "function",
                                      "function": {"name": fn["name"], "arguments": args}})
    if m["role"] == "tool":
        tid = m.get("tool_call_id")
        if tid is not None and not isinstance(tid, str):
            raise bad_request(f"messages[{i}].tool_call_id must be a string", "messages")
        out["tool_call_id"] = tid
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out
