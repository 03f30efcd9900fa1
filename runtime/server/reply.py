"""A reply's text → what the client reads: content, reasoning, and tool calls, as the text streams.

`ReplyParser.feed(text)` takes each new piece of the reply and returns the pieces that are now
certain: `("content", str)`, `("reasoning", str)` or `("call", (name, arguments_json))`. Text that
might still turn out to open a think block or a tool call is held back until it is decided, so a
streamed reply and its fold say the same. `finish()` returns what is left once the reply ended.

Reasoning: with a template that has think tags — `<think>…</think>` (Qwen3, SmolLM3, DeepSeek-R1) or
`[THINK]…[/THINK]` (Mistral's reasoning models) — a block at the reply's start (or the whole reply
up to the closing tag when the prompt already opened the block, as DeepSeek-R1's template does) is
reasoning, never content.

Tool calls, per `ToolPlan.mode` (server/tools.py): the constrained JSON shapes (`named`,
`required`, `generic`) are parsed when the reply ends (they always parse; a `generic` answer's
`response` string streams as it is decoded); the native formats are found in the text, and a call
whose JSON does not parse stays in the content, as vLLM and llama.cpp leave it. `qwen3_xml` is read
like `hermes` (the same `<tool_call>` markers), each block's XML by server/qwen_xml.py, its parameters
typed by the function's schema (`tools`).
"""

from __future__ import annotations

import json

from lowbit.runtime.server.qwen_xml import parse_call

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# (open, close) think tags in the order a template is searched for them
THINK_TAGS = ((THINK_OPEN, THINK_CLOSE), ("[THINK]", "[/THINK]"))


def think_tags(template: str | None) -> tuple[str, str] | None:
    """The think tags a chat template teaches, or None where it has none."""
    return next((tags for tags in THINK_TAGS if tags[0] in (template or "")), None)

_TAGGED = ("hermes", "qwen3_xml")  # the formats whose calls sit between <tool_call> and </tool_call>
_GENERIC_ANSWER = '{"response": "'  # the generic grammar's separators are fixed (engine/grammar.py)


def _held(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _release(kind: str, text: str, keep: int, out: list) -> str:
    """Emit all of `text` but its last `keep` characters as a `kind` piece → the characters kept."""
    if len(text) > keep:
        out.append((kind, text[: len(text) - keep]))
    return text[len(text) - keep:]


def _json_values(text: str) -> list | None:
    """Every JSON value in `text`, separated by whitespace or ';' (Llama 3's parallel calls); None if
    anything else is there."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(v)


def _calls(values, args_key: str = "arguments") -> list[tuple[str, str]] | None:
    """[(name, arguments as a JSON string)] from parsed call objects; None if any is not a call."""
    out = []
    for v in values:
        for c in v if isinstance(v, list) else [v]:
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                return None
            args = c.get(args_key, c.get("arguments", c.get("parameters", {})))
            if isinstance(args, str):  # some models write the arguments as a JSON string already
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            out.append((c["name"], json.dumps(args, ensure_ascii=False)))
    return out


class ReplyParser:
    def __init__(self, mode: str | None, think: tuple[str, str] | None = None, in_think: bool = False,
                 named: str | None = None, tools: dict[str, dict] | None = None):
        """mode: ToolPlan.mode, or None for a reply without tools. think: the template's think tags
        (open, close), or None; in_think: the prompt ends inside an open think block. tools: each
        function's parameters schema by name (qwen3_xml types its parameters' text by them)."""
        self.mode, self.named, self.tools = mode, named, tools or {}
        self.open, self.close = think or THINK_TAGS[0]
        self.think = "open" if in_think else ("start" if think else "off")  # start: a block may open
        self.pending = ""  # text not yet decided
        self.body = ""  # the tool part of the reply, parsed when complete
        self.state = "text"  # text | call (inside a native call) | json (the whole reply is JSON)
        self.after_think = False  # the think block just closed
        self.after_call = False  # qwen3_xml: a call just closed, and only whitespace came since
        self.call = ""  # a native call's JSON, between its markers
        self.sent = 0  # generic answers: characters of the response string already sent
        if mode in ("named", "required", "generic"):
            self.state = "json"

    # ---- reasoning ---------------------------------------------------------------------------------

    def feed(self, text: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self.pending += text
        if self.think == "start":
            head = self.pending.lstrip()
            if head.startswith(self.open):
                self.pending, self.think = head[len(self.open):], "open"
            elif self.open.startswith(head):
                return out  # still undecided
            else:
                self.think = "off"
        if self.think == "open":
            end = self.pending.find(self.close)
            if end < 0:
                self.pending = _release("reasoning", self.pending, _held(self.pending, self.close), out)
                return out
            if end:
                out.append(("reasoning", self.pending[:end]))
            self.pending, self.think, self.after_think = self.pending[end + len(self.close):], "off", True
        text, self.pending = self.pending, ""
        if self.after_think:  # the blank lines between the block and the answer belong to neither
            text = text.lstrip("\n")
            self.after_think = not text
        return out + self._tools(text)

    def finish(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        if self.think == "open":
            if self.pending:
                out.append(("reasoning", self.pending))
            self.pending = ""
        elif self.pending:  # an unfinished "<thi": content after all
            self.think = "off"
            out += self._tools(self.pending)
            self.pending = ""
        return out + self._end()

    # ---- tool calls ---------------------------------------------------------------------------------

    def _tools(self, text: str) -> list[tuple[str, object]]:
        if self.mode is None:
            return [("content", text)] if text else []
        if self.state == "json":
            self.body += text
            return self._generic_answer() if self.mode == "generic" else []
        if self.mode == "llama3_json":  # a reply that opens with JSON is the call; any other is content
            self.body += text
            if self.state == "text":
                head = self.body.lstrip()
                if not head or "<|python_tag|>".startswith(head):
                    return []
                self.state = "call" if head.startswith(("{", "<|python_tag|>")) else "plain"
            if self.state == "plain":
                body, self.body = self.body, ""
                return [("content", body)] if body else []
            return []
        open_, close = ("<tool_call>", "</tool_call>") if self.mode in _TAGGED else ("[TOOL_CALLS]", None)
        out = []
        self.body += text
        while self.body:
            if self.state == "text":
                if self.after_call:  # the newline the template puts between calls is no content
                    self.body = self.body.lstrip()
                    self.after_call = not self.body
                    if not self.body:
                        return out
                at = self.body.find(open_)
                if self.mode == "mistral" and at < 0 and self.body.lstrip().startswith('[{"name"'):
                    at, open_ = self.body.index("["), ""  # the marker is a control token the stream drops
                if at < 0:
                    keep = _held(self.body, open_) or (len(self.body) if self.mode == "mistral" and
                                                       '[{"name"'.startswith(self.body.lstrip()) else 0)
                    if self.mode == "qwen3_xml":  # hold trailing whitespace too: before a call it is dropped
                        head = self.body[: len(self.body) - keep]
                        keep += len(head) - len(head.rstrip())
                    self.body = _release("content", self.body, keep, out)
                    return out
                pre = self.body[:at].rstrip() if self.mode == "qwen3_xml" else self.body[:at]
                if pre:  # qwen3_xml: less the "\n\n" its template writes between content and the calls
                    out.append(("content", pre))
                self.body, self.state, self.call = self.body[at + len(open_):], "call", ""
            else:
                if close is None:  # mistral: the rest of the reply is the call list
                    self.call += self.body
                    self.body = ""
                    return out
                self.call, self.body = self.call + self.body, ""
                end = self.call.find(close)
                if end < 0:
                    return out
                self.body, self.call = self.call[end + len(close):], self.call[:end]
                done = self._native_call(self.call, open_ + self.call + close)
                out += done
                self.state, self.after_call = "text", self.mode == "qwen3_xml" and done[0][0] == "call"
        return out

    def _native_call(self, body: str, raw: str) -> list[tuple[str, object]]:
        if self.mode == "qwen3_xml":
            call = parse_call(body, self.tools)
            return [("call", call)] if call else [("content", raw)]
        calls = _calls(_json_values(body.strip()) or [None])
        return [("call", c) for c in calls] if calls else [("content", raw)]

    def _generic_answer(self) -> list[tuple[str, object]]:
        """The `response` string of a generic answer, decoded as far as it is complete."""
        if not self.body.startswith(_GENERIC_ANSWER):
            return []
        raw = self.body[len(_GENERIC_ANSWER):]
        for cut in range(len(raw), max(len(raw) - 7, -1), -1):  # a partial escape (\u12) needs up to 6
            try:
                s = json.loads('"' + raw[:cut] + '"')
                break
            except json.JSONDecodeError:
                continue
        else:
            return []
        new, self.sent = s[self.sent:], max(self.sent, len(s))
        return [("content", new)] if new else []

    def _end(self) -> list[tuple[str, object]]:
        if self.mode is None:
            return []
        if self.state == "json":
            body, self.body = self.body.strip(), ""
            try:
                v = json.loads(body)
            except json.JSONDecodeError:  # cut off by max_tokens: what was written, as content
                return [] if self.mode == "generic" and self.sent else ([("content", body)] if body else [])
            if self.mode == "named":
                return [("call", (self.named, json.dumps(v, ensure_ascii=False)))]
            if self.mode == "generic":
                if isinstance(v, dict) and "response" in v:
                    rest = str(v["response"])[self.sent:]
                    return [("content", rest)] if rest else []
                v = v.get("tool_calls") if isinstance(v, dict) else None
            calls = _calls([v]) if isinstance(v, list) else None
            return [("call", c) for c in calls] if calls else [("content", body)]
        if self.state == "call" and self.mode == "llama3_json":
            body = self.body.strip().removeprefix("<|python_tag|>")
            calls = _calls(_json_values(body) or [None], "parameters")
            return [("call", c) for c in calls] if calls else [("content", self.body)]
        if self.state == "call":
            open_ = "<tool_call>" if self.mode in _TAGGED else "[TOOL_CALLS]"
            return self._native_call(self.call, open_ + self.call)  # closed by the end of the reply
        body, self.body = self.body, ""
        return [("content", body)] if body else []
