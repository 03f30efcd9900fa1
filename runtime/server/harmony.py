"""gpt-oss's harmony chat format, both ways: the history as its template wants it, and the reply's
messages → reasoning, content and tool calls.

A harmony reply is a run of messages, each `<|start|>ROLE HEADER<|message|>BODY` closed by `<|end|>`
(more follows), `<|return|>` (the answer is done) or `<|call|>` (a tool is to run). The prompt ends in
`<|start|>assistant`, so the reply opens in a header. The header names a channel (`<|channel|>analysis`,
`commentary`, `final`) and, for a tool call, a recipient (`to=functions.NAME`, written before or after
the channel) and the arguments' type (`<|constrain|>json`, or a bare `json`). A tool call:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

The markers are special tokens of gpt-oss's tokenizer: the request asks the engine to write them out
(`SamplingParams.skip_special_tokens=False`), and `<|return|>` and `<|call|>` are end tokens, so the
engine stops there and drops them (load/tokenizer_gguf.py `end_of_turn_ids`); `<|end|>` is not.

What each message becomes:
- `analysis` → reasoning (`reasoning_content`; Ollama's `thinking`);
- `final` → content;
- `commentary` without a recipient → content: it is the "preamble" the format describes, a note meant
  for the user (as "I'll look that up") before the calls; a message with no channel is content too;
- a recipient `functions.NAME` whose body is a JSON object → a tool call (NAME, the arguments);
- any other message with a recipient (no tools were asked for, a built-in tool such as `python` or
  `browser.search` this server does not run, arguments that are not a JSON object) → content, written
  out whole (header, `<|message|>`, body), so nothing the model said is lost, as server/reply.py leaves
  a native call that does not parse in the content.
Calls are decided when their message closes; the other bodies stream as they are decoded, less a
tail that could be the start of a closing marker, so a reply fed whole and one fed a character at a
time give the same pieces.
"""

from __future__ import annotations

import json
import re

from lowbit.runtime.server.reply import _held, _release

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL = "<|return|>", "<|call|>"
# what closes a message's body: <|start|> too, for a message the model left without its <|end|>
_CLOSERS = (END, RETURN, CALL, START)
_FUNCTIONS = "functions."
# The longest header text before <|message|>: "assistant" (9) + "<|channel|>commentary" (21) +
# " to=functions." (14) + a 64-character name (OpenAI's limit) + " <|constrain|>json" (18) = 126.
# A reply that writes twice that with no <|message|> is not in harmony: it is content.
HEADER_MAX = 256
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes the harmony format (gpt-oss's does; no other template has channels)."""
    return CHANNEL in (template or "")


# ---- request: the history as gpt-oss's template reads it ------------------------------------------

def harmony_history(messages: list[dict]) -> list[dict]:
    """OpenAI-shaped history → what gpt-oss's template renders. The template writes one call per
    assistant message (`tool_calls[0]`) and names each tool result after the call just before it, so an
    assistant message with N calls becomes N messages, each followed by its result (matched by
    tool_call_id, else in order). It refuses a call message that has both `content` and reasoning (it
    writes either as the analysis before the call): the reasoning is kept, the content (a preamble
    already shown to the user) left out."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        i += 1
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if not calls:
            out.append(m)
            continue
        results = []  # the tool messages that answer these calls
        while i < len(messages) and messages[i]["role"] == "tool":
            results.append(messages[i])
            i += 1
        by_id = {r["tool_call_id"]: r for r in results if r.get("tool_call_id")}
        matched = [by_id.get(c.get("id")) for c in calls]
        rest = [r for r in results if not any(r is x for x in matched)]
        first = {k: v for k, v in m.items() if k != "tool_calls"}
        if first.get("reasoning_content"):
            first["content"] = ""
        for j, (call, result) in enumerate(zip(calls, matched)):
            if result is None and rest:
                result = rest.pop(0)
            out.append({**(first if j == 0 else {"role": "assistant", "content": ""}), "tool_calls": [call]})
            if result is not None:
                out.append(result)
        out += rest  # more results than calls: left where they were, for the template to judge
    return out


# ---- reply: the messages → the parser's pieces ----------------------------------------------------

class HarmonyParser:
    """ReplyParser's interface (server/reply.py): `feed(text)` → the pieces now certain,
    `("content", str)`, `("reasoning", str)` or `("call", (name, arguments_json))`; `finish()` → the
    rest. calls: whether the request offered tools (tool_choice auto)."""

    def __init__(self, calls: bool):
        self.calls = calls
        self.state = "header"  # header (before <|message|>) | body | between (after a closing marker)
        self.pending = ""  # text not yet decided
        self.header = ""  # the open message's header
        self.started = False  # the open message began with <|start|> (every one but the reply's first)
        self.kind = "content"  # where the open body goes: content | reasoning | call
        self.body = ""  # a call's body so far
        self.seen = False  # a message was opened: the reply is in harmony

    def feed(self, text: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self.pending += text
        while self._step(out):
            pass
        return out

    def finish(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        text, self.pending = self.pending, ""
        if self.state == "header":
            # a header cut off by max_tokens is no message; a reply with neither messages nor a
            # channel or recipient is no harmony at all: its text is content
            if text.strip() and not self.seen and CHANNEL not in text and not _RECIPIENT.search(text):
                out.append(("content", text))
        elif self.state == "body":
            self._close(text, out)
        elif text.strip():
            out.append(("content", text))
        return out

    def _step(self, out: list) -> bool:
        """Decide what can be decided in `pending`; True while a state changed (step again)."""
        if self.state == "header":
            at = self.pending.find(MESSAGE)
            if at >= 0:
                self._open(self.pending[:at])
                self.pending = self.pending[at + len(MESSAGE):]
                return True
            if len(self.pending) > HEADER_MAX:
                self.state, self.header, self.kind = "body", "", "content"
                return True
            return False
        if self.state == "body":
            found = [(at, m) for m in _CLOSERS if (at := self.pending.find(m)) >= 0]
            if found:
                at, marker = min(found)
                self._close(self.pending[:at], out)
                self.pending = self.pending[at + len(marker):]
                self.state, self.header = ("header" if marker == START else "between"), ""
                self.started = marker == START
                return True
            keep = max(_held(self.pending, m) for m in _CLOSERS)
            if self.kind == "call":
                self.body += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
            else:
                self.pending = _release(self.kind, self.pending, keep, out)
            return False
        # between messages: whitespace is nobody's; a header opens at <|start|> (or a bare <|channel|>)
        found = [(at, m) for m in (START, CHANNEL) if (at := self.pending.find(m)) >= 0]
        if found:
            at, marker = min(found)
            if self.pending[:at].strip():
                out.append(("content", self.pending[:at]))
            self.pending = self.pending[at + (len(START) if marker == START else 0):]
            self.state, self.started = "header", marker == START
            return True
        keep = max(_held(self.pending, START), _held(self.pending, CHANNEL))
        if self.pending[:len(self.pending) - keep].strip():  # stray text: content, as if a final message
            self.state, self.kind = "body", "content"
            return True
        return False

    def _open(self, header: str) -> None:
        """A message's header is complete: where its body goes."""
        self.state, self.header, self.body, self.seen = "body", header, "", True
        to, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
        if to is not None:
            self.kind = "call"
        elif channel is not None and channel.group(1) == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _close(self, text: str, out: list) -> None:
        """The open message ends with `text`, the last of its body."""
        if self.kind != "call":
            if text:
                out.append((self.kind, text))
            return
        body, self.body = self.body + text, ""
        to = _RECIPIENT.search(self.header).group(1)
        try:
            args = json.loads(body) if body.strip() else {}
        except json.JSONDecodeError:
            args = None
        if self.calls and to.startswith(_FUNCTIONS) and len(to) > len(_FUNCTIONS) and isinstance(args, dict):
            out.append(("call", (to[len(_FUNCTIONS):], json.dumps(args, ensure_ascii=False))))
        else:
            out.append(("content", (START if self.started else "") + self.header + MESSAGE + body))
