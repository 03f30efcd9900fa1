"""No client's stream waits on another client's request: while `lowbit serve` (the default model, as users
start it: tests/conftest.py lowbit_server) streams replies, a huge prompt posted to any dialect is refused
without stalling them.

The probe (issue 42): before the fix, a 7 MB prompt held the GIL for 5-6 s while it was tokenized (and the
Responses and Ollama routes parsed on the event loop itself), so a stream's largest gap between chunks was
5.2-5.9 s. Now the routes parse on a worker thread, the tokenizer encodes without the GIL, and a prompt whose
length alone shows it cannot fit the context is refused before it is encoded. The judge is the stream's
largest gap between two chunks, against the issue's 1.5 s.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import pytest

from tests.conftest import SERVE_KEY

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {SERVE_KEY}"}
MAX_GAP = 1.5  # s: the line for a stream's largest gap between chunks
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def _huge(size: int) -> str:
    return ("The quick brown fox jumps over the lazy dog. " * (size // 45 + 1))[:size]


def _heavy_request(path: str, model: str, text: str) -> dict:
    """The body that posts `text` as the prompt on each dialect."""
    if path == "/v1/responses":
        return {"model": model, "input": text}
    if path == "/api/chat":
        return {"model": model, "messages": [{"role": "user", "content": text}], "stream": False}
    return {"model": model, "messages": [{"role": "user", "content": text}]}


async def _stream(client: httpx.AsyncClient, started: asyncio.Event, tokens: int) -> list[float]:
    """A streamed chat reply of `tokens` tokens → the arrival time of each chunk after the first."""
    times: list[float] = []
    body = {"messages": STORY, "stream": True, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=HEADERS) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                times.append(time.perf_counter())
                started.set()
    return times[1:]  # the first waits for a slot and the prompt, not on another request


async def _probe(base: str, path: str, size: int, streams: int, tokens: int) -> tuple[float, httpx.Response, float,
                                                                                        float]:
    """(the largest gap of any stream, the heavy request's response, when it was answered, when the last
    stream ended) for `streams` streams and one heavy prompt of `size` characters posted once they flow."""
    limits = httpx.Limits(max_connections=streams + 2)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        model = (await client.get("/v1/models", headers=HEADERS)).json()["data"][0]["id"]
        started = asyncio.Event()
        tasks = [asyncio.create_task(_stream(client, started, tokens)) for _ in range(streams)]
        await asyncio.wait_for(started.wait(), 120)
        heavy = await client.post(path, json=_heavy_request(path, model, _huge(size)), headers=HEADERS)
        answered = time.perf_counter()
        runs = await asyncio.gather(*tasks)
    gaps = [b - a for times in runs for a, b in itertools.pairwise(times)]
    return max(gaps), heavy, answered, max(times[-1] for times in runs)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/api/chat"])
def test_a_7mb_prompt_is_refused_without_stalling_a_stream(lowbit_server, path):
    gap, heavy, answered, ended = asyncio.run(_probe(lowbit_server[0], path, 7_000_000, 1, 300))
    print(f"{path}: 7 MB prompt answered {heavy.status_code}; the stream's largest gap {gap:.3f} s")
    assert heavy.status_code == 400 and "context length" in heavy.text, heavy.text[:300]
    assert "at least" in heavy.text  # told from its length, not tokenized
    assert answered < ended, "the stream ended before the prompt was refused: the probe measured nothing"
    assert gap <= MAX_GAP, f"{path}: a stream waited {gap:.2f} s between two chunks"


def test_16_streams_flow_while_a_700kb_prompt_is_refused(lowbit_server):
    gap, heavy, answered, ended = asyncio.run(_probe(lowbit_server[0], "/v1/chat/completions", 700_000, 16, 120))
    print(f"16 streams, 700 KB prompt answered {heavy.status_code}; the largest gap {gap:.3f} s")
    assert heavy.status_code == 400 and "context length" in heavy.text, heavy.text[:300]
    assert answered < ended, "the streams ended before the prompt was refused: the probe measured nothing"
    assert gap <= MAX_GAP, f"a stream waited {gap:.2f} s between two chunks"
