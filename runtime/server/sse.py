"""The one streamed-response helper every dialect answers with: SSE (OpenAI's chat, completions and
Responses streams) or NDJSON (Ollama's), never buffered on the way."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi.responses import StreamingResponse


def sse_response(body: AsyncIterator[bytes], media_type: str = "text/event-stream") -> StreamingResponse:
    # no-cache and X-Accel-Buffering: a proxy (nginx) in front would otherwise hold the events back
    return StreamingResponse(body, media_type=media_type,
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
