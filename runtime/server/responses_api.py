"""OpenAI's Responses API (POST /v1/responses) over the engine path of /v1/chat/completions, stateless.

A Responses body is translated into a chat-completions body and parsed by `RequestParser.chat`, so
its prompt, sampling, tools and grammars are those of the chat endpoint, with every check and every
400 (each error's param renamed to the Responses field it came from). The reply's pieces
(server/chat_response.py `replies`) become output items: a reasoning item for a think block, a message
for text, a function_call item per call, in the order the reply decides them. One code path: the
streamed events are built as the reply arrives, and the non-streamed Response is the one the last
event carries.

Stateless: nothing is stored, so `previous_response_id`, `conversation`, `background`, a stored
`prompt` and item references are 400s naming their param, and a stored response is never found
(404). A client sends the whole conversation as `input` each time, its earlier output items
included: function_call items become the assistant's tool calls, function_call_output items the
tool messages.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from lowbit.runtime.server.chat_response import Responder, call_id, replies
from lowbit.runtime.server.deps import frontend, require_key
from lowbit.runtime.server.errors import APIError, bad_request
from lowbit.runtime.server.request import Parsed, RequestParser
from lowbit.runtime.server.sse import sse_response

# the chat-completions extensions the chat endpoint takes, passed on under the same names (the
# Responses API has no seed or stop, which reproducible and bounded replies need)
_PASSED = ("temperature", "top_p", "parallel_tool_calls", "stream", "seed", "stop", "top_k", "min_p",
           "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos")
# accepted and without effect here (of `reasoning`, only its effort has one: the chat's reasoning_effort)
_IGNORED = ("store", "metadata", "user", "reasoning", "truncation", "service_tier", "stream_options",
            "max_tool_calls", "prompt_cache_key", "safety_identifier")
# need a stored response or a later poll, which a stateless server cannot give
_STATEFUL = ("previous_response_id", "conversation", "background", "prompt")
RESPONSES_FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "text",
                              "include", "top_logprobs", *_PASSED, *_IGNORED, *_STATEFUL})
# a chat-completions param → the Responses field it was made from
_PARAM = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "response_format": "text", "reasoning_effort": "reasoning"}
_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for the text's logprobs

router = APIRouter(dependencies=[Depends(require_key)])


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _renamed(e: APIError) -> APIError:
    """A chat parser's error in the Responses API's names."""
    if e.param in _PARAM:
        e.param = _PARAM[e.param]
        for chat, ours in (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
                           ("reasoning_effort", "reasoning.effort")):
            e.message = e.message.replace(chat, ours)
    return e


# ---- routes ---------------------------------------------------------------------------------------

@router.post("/v1/responses")
async def create_response(request: Request):
    fe = frontend(request)
    served = await fe.model(request)
    parsed, echo = await fe.parse(request, _parse, served.parser, served=served, fields=RESPONSES_FIELDS)
    rid = _id("resp")
    try:
        deltas = await fe.start(served, parsed, rid)
    except APIError as e:
        raise _renamed(e) from None
    stream = ResponsesStream(served.responder, parsed, rid, echo)
    if not parsed.stream:
        try:
            last = None
            async for last in stream.events(deltas):
                pass
        finally:
            await deltas.aclose()
        if stream.failure is not None:  # the engine failed (500) or the server is shutting down (503)
            raise stream.failure
        return JSONResponse(last["response"])
    return sse_response(_streamed(stream, deltas))


async def _streamed(stream: ResponsesStream, deltas) -> AsyncIterator[bytes]:
    try:
        async for e in stream.events(deltas):
            yield _sse(e)
    finally:
        await deltas.aclose()


@router.get("/v1/responses/{response_id}")
@router.delete("/v1/responses/{response_id}")
@router.get("/v1/responses/{response_id}/input_items")
@router.post("/v1/responses/{response_id}/cancel")
async def stored_response(response_id: str):
    raise APIError(404, f"No response found with id '{response_id}': this server is stateless and stores "
                        "no responses.", "invalid_request_error", "response_id", "not_found")


def _parse(parser: RequestParser, body: dict) -> tuple[Parsed, dict]:
    """A Responses body → (the chat request that runs it, the fields the Response echoes), on the
    worker thread `Frontend.parse` runs it on: the chat parser's errors in the Responses API's names."""
    chat, echo = chat_body(body)
    try:
        return parser.chat(chat), echo
    except APIError as e:
        raise _renamed(e) from None


# ---- request: a Responses body → a chat-completions body ------------------------------------------

def _text_of(content, where: str, param: str = "input") -> str:
    """A content field (a string, or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts", param)
    out = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in (*_TEXT_PARTS, "refusal"):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise bad_request(f"{where}.content[{j}]: only text parts are supported here, not {kind!r}", param)
        text = p.get("refusal" if p["type"] == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.content[{j}].text must be a string", param)
        out.append(text)
    return "".join(out)


def _messages(items, instructions) -> list[dict]:
    """`instructions` and `input` → chat messages."""
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    out = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    conversation = _Conversation(out)
    for i, it in enumerate(items):
        conversation.add(it, f"input[{i}]")
    return out


class _Conversation:
    """Chat messages made of `input` items, one at a time. A run of function_call items is one
    assistant message's tool calls (parallel calls), joined to the assistant's text just before
    them; a reasoning item becomes the next assistant message's reasoning_content."""

    def __init__(self, out: list[dict]):
        self.out = out
        self.names: dict[str, str] = {}  # call_id → function name, for the tool messages
        self.reasoning: str | None = None
        self.joinable = False  # the last message is an assistant's that this item's calls may join

    def add(self, it, where: str) -> None:
        if not isinstance(it, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = it.get("type", "message")
        if kind == "message":
            self._message(it, where)
        elif kind == "function_call":
            self._call(it, where)
        elif kind == "function_call_output":
            self._output(it, where)
        elif kind == "reasoning":
            self._reasoning(it, where)
        elif kind == "item_reference":
            raise bad_request(f"{where}: this server is stateless and stores no items to refer to; send the "
                              "item itself", "input")
        else:
            raise bad_request(f"{where}: items of type {kind!r} are not supported here (message, function_call, "
                              "function_call_output and reasoning are)", "input")

    def _assistant(self, msg: dict) -> dict:
        if self.reasoning is not None:
            msg["reasoning_content"], self.reasoning = self.reasoning, None
        return msg

    def _message(self, it: dict, where: str) -> None:
        role = it.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"{where}.role must be user, assistant, system or developer", "input")
        msg = {"role": role, "content": _text_of(it.get("content"), where)}
        self.out.append(self._assistant(msg) if role == "assistant" else msg)
        self.joinable = role == "assistant"

    def _call(self, it: dict, where: str) -> None:
        cid, name, args = it.get("call_id"), it.get("name"), it.get("arguments", "{}")
        if not (isinstance(cid, str) and isinstance(name, str) and isinstance(args, str)):
            raise bad_request(f"{where}: a function_call needs string call_id, name and arguments", "input")
        try:
            json.loads(args or "{}")
        except json.JSONDecodeError:
            raise bad_request(f"{where}.arguments is not JSON", "input") from None
        self.names[cid] = name
        call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args or "{}"}}
        if self.joinable:
            self.out[-1].setdefault("tool_calls", []).append(call)
        else:
            self.out.append(self._assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
            self.joinable = True

    def _output(self, it: dict, where: str) -> None:
        cid = it.get("call_id")
        if not isinstance(cid, str):
            raise bad_request(f"{where}.call_id must be a string", "input")
        msg = {"role": "tool", "tool_call_id": cid, "content": _text_of(it.get("output"), where)}
        if cid in self.names:
            msg["name"] = self.names[cid]
        self.out.append(msg)
        self.joinable = False

    def _reasoning(self, it: dict, where: str) -> None:
        parts = it.get("content") or it.get("summary") or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise bad_request(f"{where}: a reasoning item's content must be a list of text parts", "input")
        self.reasoning = "".join(p["text"] for p in parts) or None
        self.joinable = False


def _tools(tools) -> tuple[list[dict], list[dict]]:
    """Responses function tools → (chat tools, the tools as the Response echoes them)."""
    if tools is None:
        return [], []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools", "tools")
    chat, echo = [], []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported here, not {kind!r}", "tools")
        f = t["function"] if isinstance(t.get("function"), dict) else t  # the chat shape, as some clients send it
        fn = {"name": f.get("name"), "description": f.get("description") or "",
              "parameters": f.get("parameters") or {"type": "object", "properties": {}}}
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "name": fn["name"], "description": f.get("description"),
                     "parameters": fn["parameters"], "strict": f.get("strict")})
    return chat, echo


def _tool_choice(choice, tools: list[dict]) -> tuple[object, list[dict], object]:
    """Responses tool_choice → (chat tool_choice, the tools it leaves callable, the choice as the
    Response echoes it)."""
    if choice is None or isinstance(choice, str):
        return choice, tools, choice or "auto"
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice["function"].get("name") if isinstance(choice.get("function"), dict) else choice.get("name")
        return {"type": "function", "function": {"name": name}}, tools, {"type": "function", "name": name}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = choice.get("tools")
        if not isinstance(allowed, list) or choice.get("mode", "auto") not in ("auto", "required"):
            raise bad_request("tool_choice allowed_tools needs mode 'auto' or 'required' and a list of tools",
                              "tool_choice")
        names = {a.get("name") for a in allowed if isinstance(a, dict)}
        unknown = names - {t["function"]["name"] for t in tools}
        if unknown:
            raise bad_request(f"tool_choice allows tools that are not in tools: {sorted(map(str, unknown))}",
                              "tool_choice")
        return choice.get("mode", "auto"), [t for t in tools if t["function"]["name"] in names], choice
    raise bad_request("tool_choice must be 'auto', 'none', 'required', {\"type\": \"function\", \"name\": ...} "
                      "or {\"type\": \"allowed_tools\", ...}", "tool_choice")


def _response_format(text) -> tuple[dict | None, dict]:
    """`text.format` → (chat response_format, the format as the Response echoes it)."""
    if text is None:
        return None, {"type": "text"}
    if not isinstance(text, dict):
        raise bad_request("text must be an object such as {\"format\": {\"type\": \"text\"}}", "text")
    fmt = text.get("format")
    if fmt is None:
        return None, {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}, fmt
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format json_schema needs a \"schema\" object", "text")
        spec = {"name": fmt.get("name", "response"), "schema": fmt["schema"], "strict": fmt.get("strict")}
        return {"type": "json_schema", "json_schema": spec}, fmt
    raise bad_request(f"text.format.type must be text, json_object or json_schema, not {kind!r}", "text")


def _echoed(body: dict) -> None:
    """The fields a Response only echoes, typed as OpenAI types them: strings, and metadata an object
    of at most 16 string values (keys up to 64 characters, values up to 512)."""
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad_request(f"{name} must be a string", name)
    meta = body.get("metadata")
    if meta is None:
        return
    if not (isinstance(meta, dict) and len(meta) <= 16
            and all(len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in meta.items())):
        raise bad_request("metadata must be an object of at most 16 string values (keys up to 64 characters, "
                          "values up to 512)", "metadata")


def chat_body(body: dict) -> tuple[dict, dict]:
    """A Responses body → (the chat-completions body that runs it, the request fields the Response
    echoes). Raises a 400 naming the Responses param."""
    for name in _STATEFUL:
        if body.get(name) not in (None, False):
            raise bad_request(f"{name} is not supported: this server is stateless and stores nothing (no "
                              "responses, conversations or prompts); send the whole conversation as input", name)
    _echoed(body)
    include = body.get("include") or []
    if not (isinstance(include, list) and all(isinstance(s, str) for s in include)):
        raise bad_request("include must be a list of strings", "include")
    messages = _messages(body.get("input"), body.get("instructions"))
    tools, tools_echo = _tools(body.get("tools"))
    choice, callable_tools, choice_echo = _tool_choice(body.get("tool_choice"), tools)
    fmt, fmt_echo = _response_format(body.get("text"))
    chat = {k: body[k] for k in _PASSED if body.get(k) is not None}
    chat.update({"model": body.get("model"), "messages": messages})
    if callable_tools:
        chat["tools"] = callable_tools
    if choice is not None:
        chat["tool_choice"] = choice
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if isinstance(body.get("reasoning"), dict) and body["reasoning"].get("effort") is not None:
        chat["reasoning_effort"] = body["reasoning"]["effort"]
    if fmt is not None:
        chat["response_format"] = fmt
    if LOGPROBS in include:
        chat["logprobs"] = True
        if body.get("top_logprobs") is not None:
            chat["top_logprobs"] = body["top_logprobs"]
    echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False, "previous_response_id": None,
            "reasoning": body.get("reasoning") if isinstance(body.get("reasoning"), dict) else None,
            "store": False, "background": False,
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "text": {"format": fmt_echo}, "tool_choice": choice_echo, "tools": tools_echo,
            "top_logprobs": body.get("top_logprobs") if LOGPROBS in include else None,
            "truncation": body.get("truncation") if body.get("truncation") in ("auto", "disabled") else "disabled",
            "user": body.get("user"), "service_tier": "default"}
    return chat, echo


# ---- reply: the pieces → output items and their events --------------------------------------------

class Output:
    """The output items of one reply, built piece by piece; each method returns the events (without
    their sequence numbers) that announce the change. The item being written is always the last.
    Text is one message item until a function call comes between; whitespace with no message open
    waits for text that opens one (the blank line after a call is no message of its own)."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None  # the message or reasoning item still being written
        self.held, self.held_logprobs = "", []  # whitespace with no message open, and its tokens' logprobs

    def _add(self, item: dict) -> dict:
        self.items.append(item)
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                "item": json.loads(json.dumps(item))}  # a snapshot: the item changes later

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _open(self, kind: str) -> list[dict]:
        events = self.close("completed")
        if kind == "message":
            item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        events.append(self._add(item))
        events.append({"type": "response.content_part.added", **self._where(item), "part": dict(part)})
        item["content"].append(part)
        self.open = item
        return events

    def text(self, text: str, logprobs: list) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "message":
            if not text.strip():
                self.held += text
                self.held_logprobs += logprobs
                return []
            text, logprobs = self.held + text, self.held_logprobs + logprobs
            self.held, self.held_logprobs = "", []
            events = self._open("message")
        part = self.open["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        return events + [{"type": "response.output_text.delta", **self._where(self.open), "delta": text,
                          "logprobs": logprobs}]

    def reasoning(self, text: str) -> list[dict]:
        events = [] if self.open is not None and self.open["type"] == "reasoning" else self._open("reasoning")
        self.open["content"][0]["text"] += text
        return events + [{"type": "response.reasoning_text.delta", **self._where(self.open), "delta": text}]

    def call(self, name: str, arguments: str) -> list[dict]:
        events = self.close("completed")
        self.held, self.held_logprobs = "", []
        item = {"type": "function_call", "id": _id("fc"), "call_id": call_id(), "name": name, "arguments": "",
                "status": "in_progress"}
        events.append(self._add(item))
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        item.update(arguments=arguments, status="completed")
        return events + [{"type": "response.function_call_arguments.delta", **where, "delta": arguments},
                         {"type": "response.function_call_arguments.done", **where, "arguments": arguments},
                         {"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": item}]

    def close(self, status: str) -> list[dict]:
        """Close the open item with `status` (completed | incomplete)."""
        item, self.open = self.open, None
        if item is None:
            return []
        where, part = self._where(item), item["content"][0]
        item["status"] = status
        if item["type"] == "message":
            done = {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": part["logprobs"]}
        else:
            done = {"type": "response.reasoning_text.done", **where, "text": part["text"]}
        return [done, {"type": "response.content_part.done", **where, "part": part},
                {"type": "response.output_item.done", "output_index": where["output_index"], "item": item}]

    def finish(self, status: str) -> list[dict]:
        """The reply ended. A reply without text or calls is still a message (of its whitespace, or
        empty), unless it was cut off while reasoning."""
        events = []
        said = any(it["type"] != "reasoning" for it in self.items)
        if not said and (self.held or not self.items):
            held, logprobs = self.held, self.held_logprobs
            self.held, self.held_logprobs = "", []
            events = self._open("message")
            if held:
                events += self.text(held, logprobs)
        return events + self.close(status)


class ResponsesStream:
    """One request's events, numbered; `response` is the Response as it stands."""

    def __init__(self, responder: Responder, parsed: Parsed, rid: str, echo: dict):
        self.responder, self.parsed, self.rid, self.echo = responder, parsed, rid, echo
        self.created = int(time.time())
        self.output = Output()
        self.seq = 0
        self.status, self.usage, self.incomplete, self.error = "in_progress", None, None, None
        self.failure: APIError | None = None  # what ended the reply, when it failed: a non-streamed reply's answer

    def response(self) -> dict:
        done = self.status != "in_progress"
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": self.status,
                "completed_at": int(time.time()) if self.status == "completed" else None,
                "error": self.error, "incomplete_details": self.incomplete,
                "model": self.responder.model_name, "output": self.output.items if done else [],
                **self.echo, "usage": self.usage}

    def _numbered(self, events: list[dict]):
        for e in events:
            e["sequence_number"] = self.seq
            self.seq += 1
            yield e

    async def events(self, deltas) -> AsyncIterator[dict]:
        """Every event of the reply, from response.created to its end: response.completed,
        response.incomplete (cut off by max_output_tokens), or response.failed (the engine failed)."""
        responder, out = self.responder, self.output
        for e in self._numbered([{"type": "response.created", "response": self.response()},
                                 {"type": "response.in_progress", "response": self.response()}]):
            yield e
        logprobs: list = []  # a token's logprobs go with the first text its delta decided
        try:
            async for _, pieces, d in replies(self.parsed, deltas):
                if self.parsed.logprobs:
                    logprobs += responder.chat_logprobs(d)
                events = []
                for kind, value in pieces:
                    if kind == "content":
                        events += out.text(value, logprobs)
                        logprobs = []
                    elif kind == "reasoning":
                        events += out.reasoning(value)
                        logprobs = []
                    else:
                        events += out.call(*value)
                if d.finish_reason is not None:
                    finish = responder.finish_of(d)
                    status = "incomplete" if finish == "length" else "completed"
                    events += out.finish(status)
                    self.status, self.usage = status, _usage(d.usage)
                    if status == "incomplete":
                        self.incomplete = {"reason": "max_output_tokens"}
                for e in self._numbered(events):
                    yield e
        except APIError as e:  # the engine failed after the reply began
            self.status, self.error, self.failure = "failed", {"code": e.code or "server_error", "message": e.message}, e
            for ev in self._numbered([{"type": "response.failed", "response": self.response()}]):
                yield ev
            return
        end = "response.completed" if self.status == "completed" else "response.incomplete"
        for e in self._numbered([{"type": end, "response": self.response()}]):
            yield e


def _usage(u) -> dict | None:
    if u is None:
        return None
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
