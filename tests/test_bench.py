"""`lowbit bench` against a fake OpenAI server with scripted timing: every metric equals its
hand-computed value, failures of every kind are counted, the load shapes hold.

The fake server is an httpx transport whose SSE stream advances a virtual clock by the scripted
delay before each chunk, and the bench reads that clock, so the timings are exact: request i's
first content chunk comes TTFT_i after it was sent, then one chunk every D seconds (delays are
binary fractions, so the arithmetic below is exact in floating point).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest

from lowbit.runtime.bench.client import RESULT_FIELDS, BenchConfig, bench, build_prompts
from lowbit.runtime.bench.metrics import parse_slo
from lowbit.runtime.errors import LowbitError

TTFT = [0.25, 0.5, 0.75, 1.0]  # seconds, request i's time to first content chunk
D = 0.0625  # seconds between content chunks
CHUNKS = 5  # content chunks per reply
TOKENS = 10  # completion tokens per reply (the usage: 2 per chunk)
PROMPT = 100  # prompt tokens per request (the usage)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def sse(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


class FakeServer:
    """Scripted replies by arrival order: `fail` maps an arrival index to how that request fails."""

    def __init__(self, clock: Clock, ttft=TTFT, usage=True, fail=None, sleep=0.0):
        self.clock, self.ttft, self.usage, self.fail, self.sleep = clock, ttft, usage, fail or {}, sleep
        self.arrivals = 0
        self.in_flight = self.max_in_flight = 0
        self.bodies = []

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        i = self.arrivals
        self.arrivals += 1
        self.bodies.append(json.loads(request.content))
        how = self.fail.get(i)
        if how == "http":
            return httpx.Response(503, json={"error": {"message": "overloaded", "type": "server_error"}})
        if how == "transport":
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self.stream(i, how))

    async def stream(self, i: int, how):
        # in flight from the request to its last chunk (the client need not close the generator)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for k in range(CHUNKS):
            self.clock.t += self.ttft[i % len(self.ttft)] if k == 0 else D
            if self.sleep:
                await asyncio.sleep(self.sleep)
            if how == "error_event" and k == 2:
                self.in_flight -= 1
                yield sse({"error": {"message": "engine failed", "type": "server_error"}})
                return
            yield sse({"choices": [{"index": 0, "delta": {"content": f"w{k} "}, "finish_reason": None}]})
        yield sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if self.usage:
            yield sse({"choices": [], "usage": {"prompt_tokens": PROMPT, "completion_tokens": TOKENS,
                                                "total_tokens": PROMPT + TOKENS}})
        self.in_flight -= 1
        yield sse("[DONE]")


def run(cfg: BenchConfig, server: FakeServer, clock=None) -> dict:
    return asyncio.run(bench(cfg, clock=clock or server.clock, transport=server.transport(), show_progress=False))


def cfg(**kw) -> BenchConfig:
    return BenchConfig(**{"base_url": "http://fake/v1", "num_prompts": 4, "warmup": 0, "input_len": 16,
                          "output_len": 32, **kw})


def test_every_metric_equals_its_hand_computed_value():
    clock = Clock()
    doc = run(cfg(slo=parse_slo("ttft=600")), FakeServer(clock))
    (row,) = doc["results"]
    assert doc["model"] == "fake-model" and row["completed"] == 4 and row["failed"] == 0
    # per request: TTFT_i, then CHUNKS - 1 gaps of D; E2E = TTFT_i + 4 D; TPOT = 4 D / (TOKENS - 1)
    e2e = [t + (CHUNKS - 1) * D for t in TTFT]  # 0.5, 0.75, 1.0, 1.25
    duration = sum(e2e)  # one request at a time; the clock only moves inside replies: 3.5 s
    assert row["duration"] == duration == 3.5
    assert row["total_input_tokens"] == 4 * PROMPT and row["total_output_tokens"] == 4 * TOKENS
    assert row["request_throughput"] == 4 / 3.5
    assert row["output_throughput"] == 40 / 3.5
    assert row["total_token_throughput"] == 440 / 3.5
    assert row["request_goodput"] == 2 / 3.5  # TTFT 250 and 500 ms meet ttft=600
    assert row["mean_ttft_ms"] == 625.0 and row["median_ttft_ms"] == 625.0
    assert row["std_ttft_ms"] == pytest.approx(np.std([250, 500, 750, 1000]), rel=1e-15)
    # numpy's linear percentiles by hand: p90 at rank 0.9 * 3 = 2.7 -> 750 + 0.7 * 250
    assert row["p90_ttft_ms"] == pytest.approx(925.0, rel=1e-14)
    assert row["p99_ttft_ms"] == pytest.approx(992.5, rel=1e-14)
    tpot_ms = 4 * D / (TOKENS - 1) * 1000  # 27.77... ms for every request
    for stat in ("mean", "median", "p90", "p99"):
        assert row[f"{stat}_tpot_ms"] == pytest.approx(tpot_ms, rel=1e-14)
        assert row[f"{stat}_itl_ms"] == 62.5  # every gap is D
    assert row["std_itl_ms"] == 0.0
    assert row["mean_e2el_ms"] == 875.0 and row["median_e2el_ms"] == 875.0
    assert row["output_tokens_counted"] == ["usage"] and row["errors"] == []
    assert set(RESULT_FIELDS) <= set(row)


def test_failures_are_counted_with_their_messages():
    """An HTTP error, a transport error and an error event mid-stream (after a 200): three failures;
    the one good request is measured as usual."""
    clock = Clock()
    server = FakeServer(clock, fail={0: "http", 1: "transport", 2: "error_event"})
    (row,) = run(cfg(), server)["results"]
    assert row["completed"] == 1 and row["failed"] == 3
    errors = " | ".join(row["errors"])
    assert "HTTP 503: overloaded" in errors and "ConnectError" in errors and "engine failed" in errors
    assert row["mean_ttft_ms"] == 1000.0  # only request 3 counted
    assert row["total_output_tokens"] == TOKENS


def test_all_failed_is_reported_not_raised():
    (row,) = run(cfg(), FakeServer(Clock(), fail={i: "http" for i in range(4)}))["results"]
    assert row["completed"] == 0 and row["failed"] == 4 and row["mean_ttft_ms"] is None


def test_no_usage_counts_chunks_and_says_so():
    (row,) = run(cfg(), FakeServer(Clock(), usage=False))["results"]
    assert row["output_tokens_counted"] == ["chunks"] and row["total_output_tokens"] == 4 * CHUNKS
    assert row["total_input_tokens"] == 4 * 16  # the passage's estimated tokens


def test_requests_carry_the_config():
    server = FakeServer(Clock())
    run(cfg(ignore_eos=True, output_len=7, model="m"), server)
    body = server.bodies[0]
    assert body["model"] == "m" and body["max_tokens"] == 7 and body["ignore_eos"] is True and body["stream"]
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"][0]["content"].startswith("Continue this text:")


def test_concurrency_sweep_and_warmup():
    """Closed loop at 1 and 3: one row per level; at 3, three requests are in flight at once;
    warm-up requests reach the server but no row."""
    server = FakeServer(Clock(), sleep=0.01)
    doc = run(cfg(concurrency=(1, 3), num_prompts=6, warmup=2), server, clock=time.perf_counter)
    assert [r["max_concurrency"] for r in doc["results"]] == [1, 3]
    assert [r["completed"] for r in doc["results"]] == [6, 6]
    assert server.arrivals == 2 + 12 and server.max_in_flight == 3


def test_open_loop_poisson_with_a_cap():
    server = FakeServer(Clock(), sleep=0.01)
    doc = run(cfg(request_rate=500.0, max_concurrency=2, num_prompts=8), server, clock=time.perf_counter)
    (row,) = doc["results"]
    assert row["completed"] == 8 and row["request_rate"] == 500.0 and row["max_concurrency"] == 2
    assert server.max_in_flight == 2


def test_prompts_are_seeded_passages():
    text = "".join(f"word{i} " for i in range(2000))
    a = build_prompts(text, 5, 32, seed=3)
    assert a == build_prompts(text, 5, 32, seed=3) and a != build_prompts(text, 5, 32, seed=4)
    assert all(len(p.split("\n\n", 1)[1]) <= 32 * 4 for p, _ in a)


def test_slo_parsing():
    assert parse_slo("ttft=500, tpot=50") == {"ttft": 0.5, "tpot": 0.05}
    for bad in ("ttft", "speed=3", "ttft=-1"):
        with pytest.raises(ValueError):
            parse_slo(bad)


@pytest.mark.parametrize("given, base", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),  # the server's root, as vLLM's benchmark takes it
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/v1"),
    ("https://proxy.example/openai/v1", "https://proxy.example/openai/v1"),  # a path is kept as given
])
def test_base_url_is_the_root_or_the_v1_url(given, base):
    from lowbit.runtime.api_url import api_base

    assert api_base(given) == base


@pytest.mark.parametrize("given", ["127.0.0.1:8000", "ftp://host/v1", "http://", "http://h:1/v1?x=1"])
def test_a_base_url_that_is_not_an_http_url_is_one_line(given):
    from lowbit.runtime.api_url import api_base

    with pytest.raises(LowbitError) as e:
        api_base(given)
    assert "--base-url" in str(e.value) and repr(given) in str(e.value)
