"""The engine's deltas → Anthropic's Message and its stream events (server/anthropic_api.py's reply).

One code path: the stream's events are built as the reply arrives, and the non-streamed Message is the
one they leave. The reply parser's pieces (server/chat_response.py `replies`) become content blocks:
reasoning a `thinking` block (its `signature` a digest of its text: opaque, as Anthropic's are, and
never checked when a client sends it back), text a `text` block, each call a `tool_use` block whose
input arrives as one `input_json_delta`. Whitespace with no text block open waits for text that opens
one: the blank line between a think block or a call and the next thing is no block of its own.

stop_reason: `max_tokens` when max_tokens cut the reply (`model_context_window_exceeded` when the
context, smaller, did), else `tool_use` when it called a tool, else
`stop_sequence` (with the string) when one of stop_sequences ended it, else `end_turn`. The engine
says only "stop" for an end token and a stop string alike; a stop string is told by decoding the
reply's last tokens, which hold the string the engine cut (it stops at the token completing it).
usage: Anthropic's input_tokens are the prompt tokens not read from a cache, so the prompt's tokens
the engine reused are `cache_read_input_tokens` and the two add up to the prompt's length.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import deque
from collections.abc import AsyncIterator

from lowbit.runtime.engine.engine import Usage
from lowbit.runtime.server.chat_response import Responder, replies
from lowbit.runtime.server.errors import APIError
from lowbit.runtime.server.request import Parsed

# Anthropic's error type for each status it documents; 503 (the model loading, the server stopping) is
# the nearest to its overloaded_error
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                504: "timeout_error"}


def anthropic_error(e: APIError) -> dict:
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def sse_event(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def _usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens, "output_tokens": u.completion_tokens}


class Content:
    """The content blocks of one reply, built piece by piece; each method returns the stream events
    that announce the change. The block being written is always the last."""

    def __init__(self):
        self.blocks: list[dict] = []
        self.open: dict | None = None  # the text or thinking block still being written
        self.held = ""  # whitespace with no text block open

    def _start(self, block: dict) -> list[dict]:
        events = self.close()
        self.blocks.append(block)
        self.open = block
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1,
                          "content_block": dict(block)}]  # a copy: the block grows later

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def text(self, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "text":
            if not text.strip():
                self.held += text
                return []
            text, self.held = self.held + text, ""
            events = self._start({"type": "text", "text": ""})
        self.open["text"] += text
        return events + [self._delta({"type": "text_delta", "text": text})]

    def thinking(self, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "thinking":
            events = self._start({"type": "thinking", "thinking": "", "signature": ""})
        self.open["thinking"] += text
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def tool_use(self, name: str, arguments: str) -> list[dict]:
        """A whole call. Arguments that are no JSON object (a native call the grammar did not hold)
        cannot be a tool_use block's input: they stay in the text, as a call that does not parse does."""
        try:
            args = json.loads(arguments)
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            return self.text(json.dumps({"name": name, "arguments": args}, ensure_ascii=False))
        self.held = ""
        events = self._start({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name, "input": {}})
        self.open["input"] = args
        events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events + self.close()

    def close(self) -> list[dict]:
        block, self.open = self.open, None
        if block is None:
            return []
        events = []
        if block["type"] == "thinking":
            block["signature"] = hashlib.sha256(block["thinking"].encode()).hexdigest()
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        return events + [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def finish(self) -> list[dict]:
        """The reply ended: a reply that wrote no block is one text block (of its whitespace, or empty)."""
        events = []
        if not self.blocks:
            held, self.held = self.held, ""
            events = self._start({"type": "text", "text": ""})
            if held:
                self.open["text"] = held
                events.append(self._delta({"type": "text_delta", "text": held}))
        return events + self.close()


class MessageStream:
    """One request's reply: `events` yields its stream events as they come; `message()` is the Message
    as it stands (the non-streamed reply, once the events are through)."""

    def __init__(self, responder: Responder, tokenizer, parsed: Parsed, mid: str, stops: tuple[str, ...],
                 window: bool = False):
        """window: the context, not max_tokens, bounds the reply (server/anthropic_api.py `_parse`)."""
        self.responder, self.tok, self.parsed, self.mid, self.stops = responder, tokenizer, parsed, mid, stops
        self.window = window
        self.content = Content()
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = {"input_tokens": len(parsed.prompt_ids), "output_tokens": 0}  # until the engine's count
        # the reply's last tokens, enough to hold the longest stop string (a few more: a token may
        # decode to nothing, and a tokenizer may drop the first piece's leading space)
        self.tail: deque[int] = deque(maxlen=max(map(len, stops), default=0) + 16)
        self.failure: APIError | None = None  # what ended the reply, when it failed: a non-streamed reply's answer

    def message(self) -> dict:
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.responder.model_name,
                "content": self.content.blocks, "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence, "usage": self.usage}

    async def events(self, deltas) -> AsyncIterator[dict]:
        """message_start, ping, the blocks' events, message_delta and message_stop; an `error` event
        instead of the end when the engine failed after the reply began."""
        start = {**self.message(), "content": []}
        yield {"type": "message_start", "message": json.loads(json.dumps(start))}  # a snapshot
        yield {"type": "ping"}
        out = self.content
        try:
            async for _, pieces, d in replies(self.parsed, deltas):
                self.tail.extend(d.token_ids)
                events = []
                for kind, value in pieces:
                    if kind == "content":
                        events += out.text(value)
                    elif kind == "reasoning":
                        events += out.thinking(value)
                    else:
                        events += out.tool_use(*value)
                if d.finish_reason is not None:
                    finish = self.responder.finish_of(d)  # raises for an engine failure or a shutdown
                    events += out.finish()
                    self._ended(finish, d.usage)
                for e in events:
                    yield e
        except APIError as e:
            self.failure = e
            yield anthropic_error(e)
            return
        yield {"type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
               "usage": self.usage}
        yield {"type": "message_stop"}

    def _ended(self, finish: str, usage: Usage | None) -> None:
        if usage is not None:
            self.usage = _usage(usage)
        if finish == "length":
            self.stop_reason = "model_context_window_exceeded" if self.window else "max_tokens"
        elif any(b["type"] == "tool_use" for b in self.content.blocks):
            self.stop_reason = "tool_use"
        else:
            self.stop_sequence = self._stop_string()
            self.stop_reason = "end_turn" if self.stop_sequence is None else "stop_sequence"

    def _stop_string(self) -> str | None:
        """The stop sequence that ended the reply, or None (an end token did). The engine held back
        the string but generated its tokens: the tail decodes to it, the earliest-ending one winning
        as in runtime/engine/stop.py."""
        if not self.stops or not self.tail:
            return None
        text = self.tok.decode(list(self.tail), skip_special=self.parsed.params[0].skip_special_tokens)
        found = [(i + len(s), i, s) for s in self.stops for i in [text.find(s)] if i >= 0]
        return min(found)[2] if found else None
