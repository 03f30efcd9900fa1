"""The chat app's only way to a model: OpenAI's HTTP API (streamed `/v1/chat/completions`,
`/v1/models`), so the same app talks to `lowbit serve`, llama.cpp, Ollama or vLLM.

`stream_chat` yields `Chunk`s as the server sends them and ends with one carrying the `Stats`
(TTFT, decode tok/s, token counts). Failures are `ChatError`s with one readable line — the app shows
them as notifications, never as tracebacks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import httpx


class ChatError(Exception):
    """A failure to show the user: server down, context too long, a 4xx/5xx, a broken stream."""


@dataclass
class Settings:
    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 512
    model: str | None = None  # None: the server's first model


@dataclass
class Stats:
    model: str = ""
    ttft: float | None = None  # seconds
    decode_tps: float | None = None  # completion tokens after the first / their time
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


@dataclass
class Chunk:
    text: str = ""
    reasoning: str = ""  # a thinking model's reasoning (delta.reasoning_content), shown apart from the reply
    stats: Stats | None = None  # on the last chunk only
    extra: dict = field(default_factory=dict)


def _error_line(resp_status: int, body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    msg = msg or body.decode("utf-8", "replace")[:200] or "no message"
    return f"HTTP {resp_status}: {' '.join(str(msg).split())}"


class ChatClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600, transport=None):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(headers=headers, timeout=timeout, transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def models(self) -> list[dict]:
        """The server's models: dicts with at least "id" (lowbit adds "max_model_len")."""
        try:
            resp = await self._http.get(self.base_url + "/models", timeout=10)
        except httpx.HTTPError as e:
            raise ChatError(f"cannot reach {self.base_url}: {type(e).__name__}") from None
        if resp.status_code != 200:
            raise ChatError(_error_line(resp.status_code, resp.content))
        return list(resp.json().get("data") or [])

    async def health(self) -> int | None:
        """GET /health's status (lowbit: 503 while loading), None if the server cannot be reached."""
        root = self.base_url.removesuffix("/v1")
        try:
            return (await self._http.get(root + "/health", timeout=5)).status_code
        except httpx.HTTPError:
            return None

    async def stream_chat(self, messages: list[dict], settings: Settings, model: str) -> AsyncIterator[Chunk]:
        body = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "temperature": settings.temperature, "top_p": settings.top_p, "max_tokens": settings.max_tokens}
        stats = Stats(model=model)
        t0 = time.perf_counter()
        t_first = t_last = None
        pieces = 0
        try:
            async with self._http.stream("POST", self.base_url + "/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise ChatError(_error_line(resp.status_code, await resp.aread()))
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        err = obj["error"]
                        raise ChatError("the server failed mid-reply: " +
                                        (err.get("message", "") if isinstance(err, dict) else str(err)))
                    if obj.get("usage"):
                        stats.prompt_tokens = obj["usage"].get("prompt_tokens")
                        stats.completion_tokens = obj["usage"].get("completion_tokens")
                    for choice in obj.get("choices") or []:
                        if choice.get("finish_reason"):
                            stats.finish_reason = choice["finish_reason"]
                        delta = choice.get("delta") or {}
                        thought = delta.get("reasoning_content") or delta.get("reasoning")
                        if thought:
                            now = time.perf_counter()
                            t_first = t_first or now
                            t_last = now
                            pieces += 1
                            yield Chunk(reasoning=thought)
                        text = delta.get("content")
                        if text:
                            now = time.perf_counter()
                            t_first = t_first or now
                            t_last = now
                            pieces += 1
                            yield Chunk(text)
        except httpx.HTTPError as e:
            raise ChatError(f"connection to {self.base_url} failed: {type(e).__name__}") from None
        except json.JSONDecodeError:
            raise ChatError("the server sent a malformed stream") from None
        if t_first is not None:
            stats.ttft = t_first - t0
            n = stats.completion_tokens or pieces
            if n > 1 and t_last > t_first:
                stats.decode_tps = (n - 1) / (t_last - t_first)
        yield Chunk(stats=stats)
