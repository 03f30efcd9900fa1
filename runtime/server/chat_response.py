"""The engine's deltas → OpenAI's response shapes: SSE chunks when streamed, one JSON object when
not. One code path: both consume the same stream of (choice index, Delta) pairs, and the
non-streamed reply is its fold.

Streamed, per OpenAI: every chunk carries the same id; a chat stream opens with a role delta per
choice; each choice ends with a chunk holding its finish_reason; then, only when
`stream_options.include_usage` is set, one chunk with `choices: []` and the usage (every earlier
chunk then says `"usage": null`); then `data: [DONE]`. A failure after the stream began is sent as
`data: {"error": {...}}` and the stream closes.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import AsyncIterator, Callable

from lowbit.runtime.engine.engine import Delta, Usage
from lowbit.runtime.server.errors import APIError
from lowbit.runtime.server.harmony import HarmonyParser
from lowbit.runtime.server.reply import ReplyParser
from lowbit.runtime.server.request import Parsed


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def reply_parser(req: Parsed) -> ReplyParser | HarmonyParser:
    """How a choice's text is read: plain for /v1/completions; for chat, the request's tool mode and
    the template's think tags, or gpt-oss's harmony messages. A reply the grammar holds to JSON
    (response_format, tool_choice required or a named function) is JSON in every format."""
    if not req.chat:
        return ReplyParser(None)
    plan = req.tools
    if req.harmony and req.schema is None:
        return HarmonyParser(calls=plan is not None and plan.mode == "harmony")
    return ReplyParser(plan.mode if plan else None, req.think, req.in_think, plan.named if plan else None,
                       {t.name: t.parameters for t in plan.tools} if plan else None)


async def replies(req: Parsed, events: AsyncIterator[tuple[int, Delta]]):
    """(choice index, the pieces its delta decided, the delta): the engine's deltas read by each
    choice's ReplyParser (server/reply.py), which is flushed on the choice's last delta."""
    parsers = [reply_parser(req) for _ in req.params]
    async for i, d in events:
        pieces = parsers[i].feed(d.text)
        if d.finish_reason is not None:
            pieces += parsers[i].finish()
        yield i, pieces, d


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def usage_dict(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class Responder:
    """Shapes one request's reply. `last_error()` is the engine's failure behind an "error" finish."""

    def __init__(self, tokenizer, model_name: str, last_error: Callable[[], Exception | None]):
        self.tok, self.model_name, self.last_error = tokenizer, model_name, last_error

    # ---- pieces -----------------------------------------------------------------------------------

    def _token_str(self, t: int) -> tuple[str, list[int]]:
        b = self.tok.token_bytes(t)
        return b.decode("utf-8", errors="replace"), list(b)

    def chat_logprobs(self, d: Delta) -> list[dict]:
        out = []
        for t, (lp, top) in zip(d.token_ids, d.logprobs):
            s, b = self._token_str(t)
            # a constrained reply can allow fewer tokens than asked for: the rest are -inf, which JSON
            # cannot carry and which are no alternatives anyway
            tops = [{"token": ts, "logprob": float(tlp), "bytes": tb}
                    for tid, tlp in top if math.isfinite(tlp) for ts, tb in [self._token_str(tid)]]
            out.append({"token": s, "logprob": float(lp), "bytes": b, "top_logprobs": tops})
        return out

    def completion_logprobs(self, d: Delta, offset: int) -> dict:
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, (l, top) in zip(d.token_ids, d.logprobs):
            s, _ = self._token_str(t)
            lp["tokens"].append(s)
            lp["token_logprobs"].append(None if l is None else float(l))  # an echoed prompt's first token
            lp["top_logprobs"].append(None if l is None else
                                      {self._token_str(tid)[0]: float(tl) for tid, tl in top if math.isfinite(tl)})
            lp["text_offset"].append(offset)
            offset += len(s)
        return lp

    def finish_of(self, d: Delta) -> str:
        if d.finish_reason == "error":
            err = self.last_error()
            raise APIError(500, f"generation failed: {type(err).__name__}: {err}" if err else "generation failed",
                           "server_error")
        if d.finish_reason == "shutdown":
            raise APIError(503, "The server is shutting down; this request was stopped before it finished.",
                           "server_error", None, "server_shutdown", headers={"Retry-After": "5"})
        return d.finish_reason if d.finish_reason in ("stop", "length") else "stop"

    @staticmethod
    def total_usage(usages: list[Usage]) -> Usage:
        """n choices of one prompt: the prompt counts once (as OpenAI bills it), the completions add up."""
        return Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages), usages[0].cached_tokens)

    # ---- the two shapes ---------------------------------------------------------------------------

    async def fold(self, req: Parsed, rid: str, events: AsyncIterator[tuple[int, Delta]]) -> dict:
        n = len(req.params)
        texts: list[list[str]] = [[] for _ in range(n)]
        thoughts: list[list[str]] = [[] for _ in range(n)]
        calls: list[list[dict]] = [[] for _ in range(n)]
        chat_lps: list[list] = [[] for _ in range(n)]
        comp_lps: list[dict | None] = [None] * n
        finish, usages, offsets = ["stop"] * n, [None] * n, [0] * n
        now = int(time.time())
        async for i, pieces, d in replies(req, events):
            if req.logprobs:
                if req.chat:
                    chat_lps[i] += self.chat_logprobs(d)
                else:
                    part = self.completion_logprobs(d, offsets[i])
                    comp_lps[i] = part if comp_lps[i] is None else {k: comp_lps[i][k] + part[k] for k in part}
            offsets[i] += len(d.text)
            for kind, value in pieces:
                if kind == "content":
                    texts[i].append(value)
                elif kind == "reasoning":
                    thoughts[i].append(value)
                else:
                    calls[i].append({"id": call_id(), "type": "function",
                                     "function": {"name": value[0], "arguments": value[1]}})
            if d.finish_reason is not None:
                finish[i], usages[i] = self.finish_of(d), d.usage
                if calls[i] and finish[i] == "stop":
                    finish[i] = "tool_calls"
        choices = []
        for i in range(n):
            text = "".join(texts[i])
            if req.chat:
                msg = {"role": "assistant", "content": None if calls[i] and not text else text, "refusal": None}
                if calls[i]:
                    msg["tool_calls"] = calls[i]
                if thoughts[i]:
                    msg["reasoning_content"] = msg["reasoning"] = "".join(thoughts[i])
                choices.append({"index": i, "message": msg,
                                "logprobs": {"content": chat_lps[i]} if req.logprobs else None,
                                "finish_reason": finish[i]})
            else:
                choices.append({"index": i, "text": text, "logprobs": comp_lps[i] if req.logprobs else None,
                                "finish_reason": finish[i]})
        done = [u for u in usages if u is not None]
        return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": now,
                "model": self.model_name, "system_fingerprint": None, "choices": choices,
                "usage": usage_dict(self.total_usage(done)) if len(done) == n else None}

    async def chunks(self, req: Parsed, rid: str, events: AsyncIterator[tuple[int, Delta]]) -> AsyncIterator[bytes]:
        n = len(req.params)
        now = int(time.time())
        obj = "chat.completion.chunk" if req.chat else "text_completion"

        def chunk(choices: list, **extra) -> bytes:
            c = {"id": rid, "object": obj, "created": now, "model": self.model_name, "system_fingerprint": None,
                 "choices": choices}
            if req.include_usage:
                c["usage"] = None
            c.update(extra)
            return sse(c)

        offsets, usages = [0] * n, [None] * n
        try:
            if req.chat:
                for i in range(n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            n_calls = [0] * n
            async for i, pieces, d in replies(req, events):
                finish = self.finish_of(d) if d.finish_reason is not None else None
                if req.chat:
                    lp = {"content": self.chat_logprobs(d)} if req.logprobs and d.token_ids else None
                    deltas = []
                    for kind, value in pieces:
                        if kind == "content":
                            deltas.append({"content": value})
                        elif kind == "reasoning":
                            deltas.append({"reasoning_content": value, "reasoning": value})
                        else:
                            deltas.append({"tool_calls": [{"index": n_calls[i], "id": call_id(), "type": "function",
                                                           "function": {"name": value[0], "arguments": value[1]}}]})
                            n_calls[i] += 1
                    if lp and not deltas:
                        deltas.append({"content": ""})  # the tokens' logprobs, their text still undecided
                    for k, delta in enumerate(deltas):
                        yield chunk([{"index": i, "delta": delta, "logprobs": lp if k == 0 else None,
                                      "finish_reason": None}])
                    if finish:
                        if n_calls[i] and finish == "stop":
                            finish = "tool_calls"
                        yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}])
                else:
                    lp = self.completion_logprobs(d, offsets[i]) if req.logprobs else None
                    offsets[i] += len(d.text)
                    if d.text or finish:
                        yield chunk([{"index": i, "text": d.text, "logprobs": lp, "finish_reason": finish}])
                if finish:
                    usages[i] = d.usage
            done = [u for u in usages if u is not None]
            if req.include_usage and len(done) == n:
                yield chunk([], usage=usage_dict(self.total_usage(done)))
            yield sse("[DONE]")
        except APIError as e:  # a failure after the stream began: an error event, then close
            yield sse(e.body())
            if e.code == "server_shutdown":  # a deliberate end, not a broken stream: clients reading to [DONE] stop
                yield sse("[DONE]")
