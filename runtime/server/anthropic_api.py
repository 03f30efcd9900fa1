"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the engine path of
/v1/chat/completions, so that Claude Code and the `anthropic` SDK can use the port.

A Messages body is translated into a chat-completions body and parsed by `RequestParser.chat`, so its
prompt, sampling, tools, thinking budget and grammars are the chat endpoint's, with every check and
every 400. The reply's pieces (server/chat_response.py `replies`) become content blocks
(server/anthropic_reply.py): `thinking` for a think block, `text`, and `tool_use` per call.

The translation:
- `system` (a string or text blocks) is the system message; `messages` hold text, `tool_use` (assistant),
  `tool_result` (user: each one a tool message, before the turn's text) and `thinking` blocks (the
  assistant's reasoning_content). A turn's text blocks are joined as the chat endpoint joins text parts.
  A message with role `system` among them (the `mid-conversation-system` beta, which Claude Code 2.1 uses
  for its agent list after the first user turn) is a system message in its place, as the template renders it.
  `cache_control`, `metadata`, `service_tier`, `context_management`, `output_config` (Claude Code's
  `effort`) and the `anthropic-version` / `anthropic-beta` headers and `?beta=true` query are accepted and
  without effect (the engine reuses prompt prefixes by itself).
- tools' `input_schema` is the function's parameters (runtime/engine/grammar.py drops the no-op
  `propertyNames: {"type": "string"}` of Claude Code's schemas, which the grammar library cannot compile).
- `tool_choice` auto / any / tool / none → auto / required / the named function / none;
  `disable_parallel_tool_use` → parallel_tool_calls false.
- `thinking` enabled / adaptive / disabled → the template's `enable_thinking` true / true / false;
  enabled's `budget_tokens` is the chat endpoint's thinking budget (runtime/engine/think_budget.py).
- `stop_sequences` → stop; `temperature`, `top_p`, `top_k` and `stream` pass on.
- `max_tokens` is required, as Anthropic requires it. Past the room the prompt leaves in the context it
  is cut to that room, and a reply that fills the context ends with stop_reason
  `model_context_window_exceeded`, as Anthropic's newer models answer, rather than a 400: Claude Code
  asks for 32,000 tokens whatever the model's context.

Refused with a 400 that says why: image, document and other non-text blocks (the models served read
text); Anthropic's server tools (`web_search_…`, `bash_…`, `code_execution_…`: any tool with a `type`
other than "custom"), which run on Anthropic's side; `mcp_servers`; and a last turn by the assistant
(a prefill to continue), which the chat template cannot render as unfinished. `redacted_thinking`
blocks are dropped: their `data` is Anthropic's encryption, no text a template could show.

Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}` with the status, the key's 401
included; the key is accepted as `x-api-key` (Anthropic's clients) or `Authorization: Bearer`.
"""

from __future__ import annotations

import hmac
import json
import re
import uuid
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from lowbit.runtime.server.anthropic_reply import MessageStream, anthropic_error, sse_event
from lowbit.runtime.server.deps import frontend
from lowbit.runtime.server.errors import APIError, bad_request, shaped_route
from lowbit.runtime.server.request import Parsed, RequestParser
from lowbit.runtime.server.sse import sse_response

# the Messages fields passed on to the chat endpoint under the same names
_PASSED = ("temperature", "top_p", "top_k", "stream")
# accepted and without effect here
_IGNORED = ("metadata", "service_tier", "container", "context_management", "inference_geo", "output_config")
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "mcp_servers",
                          "stop_sequences", *_PASSED, *_IGNORED})
MESSAGES_FIELDS = COUNT_FIELDS | {"max_tokens"}
# a chat parser's words in its errors → the Messages API's
_RENAMED = ((".function.parameters", ".input_schema"), (".function.name", ".name"),
            (".function.description", ".description"), ("thinking_budget_tokens", "thinking.budget_tokens"),
            ("stop must", "stop_sequences must"), ("stop: at most", "stop_sequences: at most"))
# Claude Code starts its system prompt with a billing header whose `cch=` value changes every request;
# left as it is, no two requests share a prompt prefix and a ~20k-token prompt is prefilled every turn
# (llama.cpp rewrites it the same way, its PR 21793)
_BILLING = re.compile(r"^(x-anthropic-billing-header:[^\n]*?cch=)[0-9A-Za-z]+;")


async def require_key(request: Request) -> None:
    """401 unless the request carries the server's API key (when it has one) as `x-api-key`, as
    Anthropic's clients send it, or as a bearer token (Claude Code's ANTHROPIC_AUTH_TOKEN)."""
    key = frontend(request).api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = [request.headers.get("x-api-key", ""), token.strip() if scheme.lower() == "bearer" else ""]
    # compare_digest: the time a wrong key takes tells nothing about how much of it was right
    if not any(g and hmac.compare_digest(g.encode(), key.encode()) for g in given):
        raise APIError(401, "Incorrect or missing API key (send it as 'x-api-key: <key>' or "
                            "'Authorization: Bearer <key>').", "authentication_error", None, "invalid_api_key")


router = APIRouter(dependencies=[Depends(require_key)], route_class=shaped_route(
    lambda e: JSONResponse(anthropic_error(e), status_code=e.status, headers=e.headers)))


# ---- routes ---------------------------------------------------------------------------------------

@router.post("/v1/messages")
async def create_message(request: Request):
    fe = frontend(request)
    served = await fe.model(request)
    parsed, stops, window = await fe.parse(request, _parse, served.parser, False, served=served,
                                           fields=MESSAGES_FIELDS)
    mid = f"msg_{uuid.uuid4().hex}"
    deltas = await fe.start(served, parsed, mid)  # a refusal raises here, before any byte is sent
    stream = MessageStream(served.responder, served.tokenizer, parsed, mid, stops, window)
    if not parsed.stream:
        try:
            async for _ in stream.events(deltas):
                pass
        finally:
            await deltas.aclose()
        if stream.failure is not None:  # the engine failed (500) or the server is shutting down (503)
            raise stream.failure
        return JSONResponse(stream.message())
    return sse_response(_streamed(stream, deltas))


async def _streamed(stream: MessageStream, deltas):
    try:
        async for e in stream.events(deltas):
            yield sse_event(e)
    finally:
        await deltas.aclose()


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    """The prompt's length in tokens, as /v1/messages would render it (without max_tokens)."""
    fe = frontend(request)
    served = await fe.model(request)
    parsed, _, _ = await fe.parse(request, _parse, served.parser, True, served=served, fields=COUNT_FIELDS)
    return JSONResponse({"input_tokens": len(parsed.prompt_ids)})


def _parse(parser: RequestParser, counting: bool, body: dict) -> tuple[Parsed, tuple[str, ...], bool]:
    """A Messages body → (the chat request that runs it, its stop sequences, whether the context cut its
    max_tokens), on the worker thread `Frontend.parse` runs it on: the chat parser's errors in the
    Messages API's words. counting: count_tokens' body, which has no max_tokens."""
    asked = None if counting else _max_tokens(body)
    chat = chat_body(body)
    try:
        parsed = parser.chat(chat)  # without max_tokens: each choice may take the room the prompt leaves
    except APIError as e:
        for chat_word, ours in _RENAMED:
            e.message = e.message.replace(chat_word, ours)
        raise
    room = parsed.params[0].max_tokens
    if asked is not None and asked < room:
        parsed = replace(parsed, params=[replace(p, max_tokens=asked) for p in parsed.params])
    return parsed, tuple(parsed.params[0].stop), asked is not None and asked > room


def _max_tokens(body: dict) -> int:
    asked = body.get("max_tokens")
    if asked is None:
        raise bad_request("max_tokens: field required", "max_tokens")
    if not (isinstance(asked, int) and not isinstance(asked, bool) and asked >= 1):
        raise bad_request(f"max_tokens must be an int >= 1, got {asked!r}", "max_tokens")
    return asked


# ---- request: a Messages body → a chat-completions body -------------------------------------------

def chat_body(body: dict) -> dict:
    """A Messages body → the chat-completions body that runs it, less max_tokens (`_parse` fits it to the
    context). Raises a 400 naming the Messages field."""
    if body.get("mcp_servers"):
        raise bad_request("mcp_servers is not supported: this server connects to no MCP servers; run the "
                          "tools on the client and send them as tools", "mcp_servers")
    chat = {k: body[k] for k in _PASSED if body.get(k) is not None}
    chat.update(model=body.get("model"), messages=_messages(body.get("system"), body.get("messages")))
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    chat.update(_tool_choice(body.get("tool_choice")))
    chat.update(_thinking(body.get("thinking")))
    return chat


def _text(content, where: str, param: str = "messages") -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", param)
    out = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else type(b).__name__
        if kind != "text":
            raise bad_request(f"{where}[{j}]: only text blocks are supported here, not {kind!r}", param)
        if not isinstance(b.get("text"), str):
            raise bad_request(f"{where}[{j}].text must be a string", param)
        out.append(b["text"])
    return "".join(out)


def _messages(system, messages) -> list[dict]:
    """`system` and `messages` → chat messages."""
    out = []
    if system is not None:
        text = _BILLING.sub(r"\g<1>fffff;", _text(system, "system", "system"))
        if text:
            out.append({"role": "system", "content": text})
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    names: dict[str, str] = {}  # tool_use id → the tool's name, for the tool messages
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad_request(f"{where}.role must be 'user', 'assistant' or 'system'", "messages")
        content = m.get("content")
        if m["role"] == "system":
            out.append({"role": "system", "content": _text(content, f"{where}.content")})
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(f"{where}.content must be a string or a list of content blocks", "messages")
        if m["role"] == "user":
            out += _user_turn(blocks, where, names)
        else:
            out.append(_assistant_turn(blocks, where, names))
    if out[-1]["role"] == "assistant":
        raise bad_request("the last message is the assistant's: continuing a prefilled reply is not supported "
                          "here; end with a user message", "messages")
    return out


def _block(b, where: str, allowed: tuple[str, ...]) -> str:
    """The block's type, checked against the turn's `allowed` ones."""
    kind = b.get("type") if isinstance(b, dict) else None
    if kind not in allowed:
        why = ("this server's models read text only" if kind in ("image", "document", "search_result")
               else f"{'a user' if 'tool_result' in allowed else 'an assistant'} turn holds {', '.join(allowed)}")
        raise bad_request(f"{where}: {kind!r} blocks are not supported here ({why})", "messages")
    return kind


def _user_turn(blocks: list, where: str, names: dict[str, str]) -> list[dict]:
    """A user turn → its tool results as tool messages, then its text as a user message."""
    tools, texts = [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if _block(b, at, ("text", "tool_result")) == "text":
            texts.append(_text([b], at))
            continue
        tid = b.get("tool_use_id")
        if not isinstance(tid, str):
            raise bad_request(f"{at}.tool_use_id must be a string", "messages")
        result = b.get("content")
        result = "" if result is None else _text(result, f"{at}.content")
        if b.get("is_error"):  # a tool message has no error flag: the model reads it in the text
            result = f"Error: {result}"
        tools.append({"role": "tool", "tool_call_id": tid, "content": result,
                      **({"name": names[tid]} if tid in names else {})})
    return tools + ([{"role": "user", "content": "".join(texts)}] if texts or not tools else [])


def _assistant_turn(blocks: list, where: str, names: dict[str, str]) -> dict:
    """An assistant turn → one assistant message: its text, its calls, its thinking as reasoning."""
    texts, thoughts, calls = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block(b, at, ("text", "tool_use", "thinking", "redacted_thinking"))
        if kind == "text":
            texts.append(_text([b], at))
        elif kind == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise bad_request(f"{at}.thinking must be a string", "messages")
            thoughts.append(b["thinking"])
        elif kind == "tool_use":
            tid, name, args = b.get("id"), b.get("name"), b.get("input", {})
            if not (isinstance(tid, str) and isinstance(name, str) and isinstance(args, dict)):
                raise bad_request(f"{at}: a tool_use block needs a string id and name and an object input",
                                  "messages")
            names[tid] = name
            calls.append({"id": tid, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    msg = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = "".join(thoughts)
    return msg


def _tools(tools) -> list[dict]:
    """Anthropic custom tools → chat tools."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad_request(f"tools[{i}] must be an object", "tools")
        if t.get("type") not in (None, "custom"):
            raise bad_request(f"tools[{i}]: {t.get('type')!r} is an Anthropic server tool, which runs on "
                              "Anthropic's servers; this server runs none: send custom tools (name, description, "
                              "input_schema) and run them on the client", "tools")
        if not isinstance(t.get("input_schema"), dict):
            raise bad_request(f"tools[{i}].input_schema must be a JSON schema object", "tools")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


# where a schema's keys are names (of properties, definitions) or its values data, not keywords
def _tool_choice(choice) -> dict:
    """Anthropic tool_choice → the chat fields that say the same."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if not isinstance(kind, str):  # a list or an object is no key to look up (a 500 before: unhashable)
        kind = None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice of type 'tool' needs the tool's name", "tool_choice")
        mapped = {"type": "function", "function": {"name": choice["name"]}}
    if mapped is None:
        raise bad_request("tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                          "{\"type\": \"tool\", \"name\": ...}", "tool_choice")
    out = {"tool_choice": mapped}
    serial = choice.get("disable_parallel_tool_use")
    if serial is not None:
        if not isinstance(serial, bool):
            raise bad_request("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
        out["parallel_tool_calls"] = not serial
    return out


def _thinking(thinking) -> dict:
    """Anthropic `thinking` → the template's enable_thinking (Qwen3's and others'; templates that do
    not read it ignore it) and, when enabled with a budget, the chat endpoint's thinking budget."""
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind == "adaptive":
        return {"chat_template_kwargs": {"enable_thinking": True}}
    if kind == "enabled":
        # checked by the chat parser (an int >= 0); Anthropic's own floor of 1,024 is its models' business
        return {"chat_template_kwargs": {"enable_thinking": True}, "thinking_budget_tokens": thinking.get("budget_tokens")}
    raise bad_request("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} "
                      "or {\"type\": \"disabled\"}", "thinking")
